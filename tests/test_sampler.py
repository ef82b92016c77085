"""EpochSampler: the order against its definition (the keyed permutation of dpu_pipe.rng),
sharding and batching against PyTorch's DistributedSampler + DataLoader, exact evaluation
shards, coverage over ranks, determinism across processes, flat memory and time for huge
datasets."""

import hashlib
import math
import os
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest

from dpu_pipe import ConfigError, rng
from dpu_pipe.sampler import SHARD_TAILS, EpochSampler

GRID = [(n, ws) for n in (1, 2, 7, 10, 64, 1001) for ws in (1, 2, 3, 8) if n >= ws]


def _distributed_sampler_shard(order, rank, world_size, drop_last):
    """PyTorch DistributedSampler.__iter__'s index arithmetic, on a given global order."""
    indices = list(order)
    n = len(indices)
    if drop_last and n % world_size != 0:
        num_samples = math.ceil((n - world_size) / world_size)
    else:
        num_samples = math.ceil(n / world_size)
    total_size = num_samples * world_size
    if not drop_last:
        padding_size = total_size - len(indices)
        if padding_size <= len(indices):
            indices += indices[:padding_size]
        else:
            indices += (indices * math.ceil(padding_size / len(indices)))[:padding_size]
    else:
        indices = indices[:total_size]
    return indices[rank:total_size:world_size]


def test_order_is_the_keyed_permutation():
    # Definition: position p of epoch e holds rng.permutation_at(p, n, seed, e) (numpy twin).
    for n, seed, epoch in ((1000, 12345, 7), (3, 0, 0), (1, 5, 5), (65537, 2**64 - 1, 2**32 - 1)):
        got = EpochSampler(n, seed=seed).permutation(epoch)
        assert got.dtype == np.int64
        assert np.array_equal(got, rng.permutation_at(np.arange(n), n, seed, epoch))


# Recorded once; every machine and numpy version must reproduce them.
KNOWN_PERM_10 = [4, 2, 9, 6, 7, 1, 5, 8, 3, 0]                    # n=10, seed=0, epoch 0
KNOWN_PERM_SHA256 = "32b825da4e68453817d41314e53d81e6a3cad48bd276e116f424da3e0c963b03"
KNOWN_HUGE = ([219139010594, 361545146473, 355408613500, 259283967766, 2921108708],
              [507546044271, 978444315566, 292602545107])    # n=2**40, seed 2**64-1, epoch 5


def test_permutation_known_values():
    assert EpochSampler(10, seed=0).permutation(0).tolist() == KNOWN_PERM_10
    perm = EpochSampler(1_000_003, seed=1).permutation(2)            # n=1000003, seed 1, epoch 2
    assert hashlib.sha256(perm.astype("<i8").tobytes()).hexdigest() == KNOWN_PERM_SHA256
    s = EpochSampler(2**40, seed=2**64 - 1)
    assert s.indices(5, 0, 5).tolist() == KNOWN_HUGE[0]
    assert s.indices(5, 2**40 - 3, 2**40).tolist() == KNOWN_HUGE[1]


def _tail_flag(shard_tail):
    return {"pad": False, "drop": True}[shard_tail]


@pytest.mark.parametrize("n,world_size", GRID, ids=[f"n{n}-ws{w}" for n, w in GRID])
@pytest.mark.parametrize("shard_tail", ["pad", "drop"])
@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffle", "ordered"])
def test_shards_match_distributed_sampler(n, world_size, shard_tail, shuffle):
    if shard_tail == "drop" and n < world_size:
        pytest.skip("every rank would be empty")
    epoch = 3
    samplers = [EpochSampler(n, seed=99, shuffle=shuffle, rank=r, world_size=world_size,
                             shard_tail=shard_tail) for r in range(world_size)]
    order = samplers[0].permutation(epoch)
    for s in samplers:
        # every rank computes the same global order, whichever rank it is
        assert np.array_equal(s.permutation(epoch), order)
    if not shuffle:
        assert np.array_equal(order, np.arange(n))
    shards = [s.indices(epoch) for s in samplers]
    for r, shard in enumerate(shards):
        assert shard.dtype == np.int64
        assert shard.tolist() == _distributed_sampler_shard(order.tolist(), r, world_size,
                                                            _tail_flag(shard_tail))
        assert len(shard) == len(samplers[r])
    assert len({len(s) for s in shards}) == 1

    every = np.concatenate(shards)
    if shard_tail == "drop":
        # exactly the kept head of the permutation, each once
        kept = (n // world_size) * world_size
        assert len(np.unique(every)) == len(every) == kept
        assert set(every.tolist()) == set(order[:kept].tolist())
    else:
        # all samples; duplicates only from wrapping to the start of the permutation
        counts = np.bincount(every, minlength=n)
        assert counts.min() >= 1
        pad = len(every) - n
        assert pad < world_size
        assert np.array_equal(np.flatnonzero(counts > 1), np.sort(order[:pad]))


EXACT_GRID = [(n, ws, bs) for n in (1, 2, 7, 10, 64, 101) for ws in (1, 2, 3, 4, 8)
              for bs in (1, 3, 5, 16)]


@pytest.mark.parametrize("n,world_size,batch_size", EXACT_GRID,
                         ids=[f"n{n}-ws{w}-bs{b}" for n, w, b in EXACT_GRID])
def test_uneven_shards_count_every_sample_once(n, world_size, batch_size):
    """Exact evaluation: over all ranks' batches, every sample exactly once, nothing padded,
    nothing dropped, the shards as the padded ones without their padding."""
    epoch = 2
    samplers = [EpochSampler(n, seed=7, rank=r, world_size=world_size, shard_tail="uneven")
                for r in range(world_size)]
    order = samplers[0].permutation(epoch)
    seen = []
    for r, s in enumerate(samplers):
        padded = _distributed_sampler_shard(order.tolist(), r, world_size, False)
        assert len(s) == len(range(r, n, world_size))
        assert s.indices(epoch).tolist() == padded[:len(s)]
        bs = s.batches(epoch, batch_size)
        assert len(bs) == s.num_batches(batch_size) == -(-len(s) // batch_size)
        assert all(len(b) == batch_size for b in bs[:-1])
        for step, b in enumerate(bs):
            assert np.array_equal(s.batch(epoch, step, batch_size), b)
        seen += [i for b in bs for i in b.tolist()]
    assert sorted(seen) == list(range(n))


def test_seven_samples_two_ranks_batch_three():
    def batches(shard_tail, drop_last=False):
        return [[b.tolist() for b in EpochSampler(7, shuffle=False, rank=r, world_size=2,
                                                  shard_tail=shard_tail).batches(0, 3, drop_last)]
                for r in range(2)]
    assert batches("uneven") == [[[0, 2, 4], [6]], [[1, 3, 5]]]
    assert batches("pad") == [[[0, 2, 4], [6]], [[1, 3, 5], [0]]]
    assert batches("drop") == [[[0, 2, 4]], [[1, 3, 5]]]
    assert batches("pad", True) == [[[0, 2, 4]], [[1, 3, 5]]]


def _torch_batches(n, world_size, batch_size, sampler_drop_last, loader_drop_last):
    """Per rank, the index batches of DistributedSampler + DataLoader (shuffle=False)."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, DistributedSampler

    out = []
    for r in range(world_size):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=r, shuffle=False,
                                     drop_last=sampler_drop_last)
        loader = DataLoader(range(n), batch_size=batch_size, sampler=sampler,
                            drop_last=loader_drop_last)
        out.append([b.tolist() if isinstance(b, torch.Tensor) else list(b) for b in loader])
    return out


@pytest.mark.parametrize("shard_tail", ["pad", "drop"])
@pytest.mark.parametrize("drop_last", [False, True], ids=["keep-last", "drop-last"])
@pytest.mark.parametrize("n,world_size,batch_size", [(64, 3, 5), (7, 2, 3), (10, 4, 2),
                                                     (3, 5, 2), (100, 8, 7)])
def test_batches_match_torch_distributed_sampler_and_dataloader(n, world_size, batch_size,
                                                                 shard_tail, drop_last):
    if shard_tail == "drop" and n < world_size:
        pytest.skip("every rank would be empty")
    want = _torch_batches(n, world_size, batch_size, _tail_flag(shard_tail), drop_last)
    got = [[b.tolist() for b in EpochSampler(n, shuffle=False, rank=r, world_size=world_size,
                                             shard_tail=shard_tail).batches(0, batch_size,
                                                                            drop_last)]
           for r in range(world_size)]
    assert got == want


def test_worked_table_from_docstring():
    """64 samples, 3 ranks, batch 5: the table in EpochSampler's docstring."""
    def shard(tail, r):
        return EpochSampler(64, shuffle=False, rank=r, world_size=3, shard_tail=tail)

    assert [shard("pad", r).indices(0)[-1] for r in range(3)] == [63, 0, 1]
    assert [len(shard("pad", r)) for r in range(3)] == [22, 22, 22]
    assert [shard("drop", r).indices(0)[-1] for r in range(3)] == [60, 61, 62]
    assert [len(shard("drop", r)) for r in range(3)] == [21, 21, 21]
    assert [shard("uneven", r).indices(0)[-1] for r in range(3)] == [63, 61, 62]
    assert [len(shard("uneven", r)) for r in range(3)] == [22, 21, 21]
    sizes = {t: [[len(b) for b in shard(t, r).batches(0, 5)] for r in range(3)]
             for t in ("pad", "drop", "uneven")}
    assert sizes["pad"] == [[5, 5, 5, 5, 2]] * 3
    assert sizes["drop"] == [[5, 5, 5, 5, 1]] * 3
    assert sizes["uneven"] == [[5, 5, 5, 5, 2], [5, 5, 5, 5, 1], [5, 5, 5, 5, 1]]
    for t in ("pad", "drop", "uneven"):
        assert [shard(t, r).num_batches(5, drop_last=True) for r in range(3)] == [4, 4, 4]


def test_world_larger_than_dataset_pads_by_repeating():
    shards = [EpochSampler(3, shuffle=False, rank=r, world_size=8).indices(0).tolist()
              for r in range(8)]
    assert shards == [[0], [1], [2], [0], [1], [2], [0], [1]]


def test_epochs_and_seeds_change_the_order():
    s = EpochSampler(1000, seed=5)
    orders = [s.permutation(e) for e in range(5)]
    for i in range(5):
        assert np.array_equal(np.sort(orders[i]), np.arange(1000))
        for j in range(i):
            assert not np.array_equal(orders[i], orders[j])
    assert np.array_equal(s.permutation(3), orders[3])       # and repeatable
    assert not np.array_equal(EpochSampler(1000, seed=6).permutation(0), orders[0])
    # orders look random: mean displacement of a random permutation is about n/3
    disp = np.abs(orders[0] - np.arange(1000)).mean()
    assert 280 < disp < 390


def test_set_epoch_iteration_and_len():
    s = EpochSampler(50, seed=1, rank=1, world_size=4)
    assert len(s) == 13
    first = list(s)
    assert all(type(i) is int for i in first)
    assert first == s.indices(0).tolist()
    assert list(s) == first                  # without set_epoch the order repeats
    s.set_epoch(1)
    assert list(s) == s.indices(1).tolist() != first
    assert s.indices().tolist() == s.indices(1).tolist()
    # the returned array is the caller's: changing it does not change the sampler
    idx = s.indices()
    idx[:] = -1
    assert s.indices().min() >= 0


@pytest.mark.parametrize("drop_last", [False, True])
def test_batches(drop_last):
    s = EpochSampler(103, seed=4, rank=2, world_size=3)
    idx = s.indices(2)
    assert len(idx) == 35
    bs = s.batches(2, 8, drop_last)
    assert s.num_batches(8, drop_last) == len(bs) == (4 if drop_last else 5)
    assert all(len(b) == 8 for b in bs[:4])
    assert np.array_equal(np.concatenate(bs), idx[:32] if drop_last else idx)
    for step, b in enumerate(bs):
        assert np.array_equal(s.batch(2, step, 8, drop_last), b)
    with pytest.raises(ConfigError, match="past the last batch"):
        s.batch(2, len(bs), 8, drop_last)
    # the default keeps the partial batch, as DataLoader's
    assert s.num_batches(8) == 5
    # any window of the shard equals the same slice of the whole
    for lo, hi in ((0, 0), (0, 1), (7, 20), (34, 35)):
        assert np.array_equal(s.indices(2, lo, hi), idx[lo:hi])


def test_shard_of_a_huge_dataset_in_constant_memory_and_time():
    """10**9 samples over 8 ranks: a batch anywhere in the epoch costs what it costs at
    10**6 (CPU time of this process, which other processes on the machine do not inflate);
    nothing of the size of the dataset is allocated."""
    cost = {}
    for n in (10**6, 10**9):
        s = EpochSampler(n, seed=2024, rank=3, world_size=8)
        tracemalloc.start()
        t = time.process_time()
        b = [s.batch(e, step, 256) for e in (0, 1) for step in (0, len(s) // 256 // 2)]
        cost[n] = time.process_time() - t
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 1 << 20, f"{peak} bytes traced for 4 batches of n={n}"
        for x in b:
            assert len(x) == 256 and len(np.unique(x)) == 256 and 0 <= x.min() and x.max() < n
    # generous: a loaded machine; the old sort took seconds at 10**8 and could not run at 10**9
    assert cost[10**9] < 20 * cost[10**6] + 0.5, cost


_CHILD = """
import hashlib, sys
import numpy as np
from dpu_pipe.sampler import EpochSampler
from dpu_pipe import rng
s = EpochSampler(100003, seed=2**64 - 5, rank=1, world_size=3)
s.set_epoch(7)
idx = s.indices()
crop = np.stack(rng.random_resized_crop(2**64 - 5, 7, idx, 375, 500), -1).astype('<i8')
flip = rng.random_flip(2**64 - 5, 7, idx).astype(np.uint8)
sys.stdout.write(hashlib.sha256(idx.astype('<i8').tobytes() + crop.tobytes()
                                + flip.tobytes()).hexdigest())
"""


def test_same_stream_in_another_process():
    s = EpochSampler(100003, seed=2**64 - 5, rank=1, world_size=3)
    idx = s.indices(7)
    crop = np.stack(rng.random_resized_crop(2**64 - 5, 7, idx, 375, 500), -1).astype("<i8")
    flip = rng.random_flip(2**64 - 5, 7, idx).astype(np.uint8)
    here = hashlib.sha256(idx.astype("<i8").tobytes() + crop.tobytes() + flip.tobytes()).hexdigest()
    for hashseed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "PYTHONHASHSEED": hashseed},
                             cwd=_repo_root())
        assert out.returncode == 0, out.stderr
        assert out.stdout == here


def _repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_samples=0), "num_samples"),
    (dict(num_samples=-5), "num_samples"),
    (dict(num_samples=2.0), "num_samples"),
    (dict(num_samples=2**41), "num_samples"),
    (dict(num_samples=10, rank=2, world_size=2), "rank"),
    (dict(num_samples=10, rank=-1), "rank"),
    (dict(num_samples=10, world_size=0), "world_size"),
    (dict(num_samples=10, seed=-1), "seed"),
    (dict(num_samples=10, seed=2**64), "seed"),
    (dict(num_samples=3, world_size=4, shard_tail="drop"), "every rank empty"),
    (dict(num_samples=3, shard_tail="even"), "shard_tail"),
    (dict(num_samples=3, shuffle="no"), "shuffle"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EpochSampler(**kwargs)


def test_bad_epoch_and_batch_arguments():
    s = EpochSampler(10)
    for bad in (-1, 2**32, 1.5):
        with pytest.raises(ConfigError, match="epoch"):
            s.set_epoch(bad)
        with pytest.raises(ConfigError, match="epoch"):
            s.indices(bad)
    with pytest.raises(ConfigError, match="batch_size"):
        s.batches(0, 0)
    with pytest.raises(ConfigError, match="step"):
        s.batch(0, -1, 2)
    with pytest.raises(ConfigError, match="drop_last"):
        s.batches(0, 2, drop_last="yes")
    with pytest.raises(ConfigError, match="stop"):
        s.indices(0, 0, 11)


# --- shard_tail="mask" and the resume point of an elastic resume --------------------------------

def _brute_shard(n, world_size, rank, tail, start=0):
    """Rank ``rank``'s positions of an epoch covering positions start..n-1, and which are
    valid, by enumeration: stride from start + rank, pad by wrapping around the whole order."""
    length = n - start
    per_rank = {"pad": -(-length // world_size), "mask": -(-length // world_size),
                "drop": length // world_size,
                "uneven": len(range(rank, length, world_size))}[tail]
    offsets = [rank + k * world_size for k in range(per_rank)]
    pos = [(start + o) % n for o in offsets]
    valid = [tail != "mask" or o < length for o in offsets]
    return pos, valid


@pytest.mark.parametrize("tail", SHARD_TAILS)
@pytest.mark.parametrize("n", [1, 2, 7, 64, 65])
def test_shards_with_and_without_a_resume_point_equal_enumeration(n, tail):
    for world_size in (1, 2, 3, 4):
        for start in sorted({0, min(1, n - 1), n // 3, n - 1}):
            if tail == "drop" and n < world_size:
                continue
            for epoch in (0, 3):
                for rank in range(world_size):
                    s = EpochSampler(n, seed=9, rank=rank, world_size=world_size,
                                     shard_tail=tail, resume=(3, start))
                    where = start if epoch == 3 else 0
                    pos, valid = _brute_shard(n, world_size, rank, tail, where)
                    perm = s.permutation(epoch)
                    assert s.count(epoch) == len(pos)
                    assert s.indices(epoch).tolist() == perm[pos].tolist()
                    assert s.valid(epoch).tolist() == valid
                    assert s.num_valid(epoch) == sum(valid)
                    if len(pos) > 2:
                        assert s.num_valid(epoch, 1, len(pos) - 1) == sum(valid[1:-1])
                    batches = s.batches(epoch, 2)
                    assert len(batches) == s.num_batches(2, epoch=epoch) == -(-len(pos) // 2)
                    assert len(s) == len(_brute_shard(n, world_size, rank, tail)[0])


def test_mask_shards_are_pads_with_the_padding_flagged():
    for r in range(3):
        pad = EpochSampler(64, seed=1, rank=r, world_size=3, shard_tail="pad")
        mask = EpochSampler(64, seed=1, rank=r, world_size=3, shard_tail="mask")
        assert mask.indices(2).tolist() == pad.indices(2).tolist()
        assert mask.valid(2).tolist() == [True] * 21 + [r == 0]
        assert pad.valid(2).all()


def test_resume_point_checks():
    for bad in ((0, 10), (0, -1), (-1, 2), (0,), "ab", 5):
        with pytest.raises(ConfigError):
            EpochSampler(10, resume=bad)
    assert EpochSampler(10, resume=(4, 0)).resume is None
