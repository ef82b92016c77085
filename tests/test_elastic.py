"""Elastic resume: a Loader state saved by a job of one world size continues on another.

Every sample names itself (one class folder per image: label == sample index), so the two
parts of an interrupted epoch — the batches the saved job's ranks took and the rest, made by
the new job's ranks — are checked on their labels: together they are the epoch, each sample
once (``uneven``, and ``mask`` counting valid rows; ``pad`` repeats the samples at the start of
the epoch's order in its padding, ``drop`` leaves out the rest's last positions). Images are
checked against the batch kernel run on each sample alone, and the epochs after the resumed
one against a fresh run of the new world size.
"""

import json

import numpy as np
import pytest

from dpu_pipe import ConfigError
from dpu_pipe.kernel import BatchProcessor
from dpu_pipe.loader import Loader
from dpu_pipe.sampler import EpochSampler
from dpu_pipe.sources import ImageFolder
from dpu_pipe.spec import StreamSpec
from dpu_pipe.transforms import TransformConfig


pytestmark = pytest.mark.timeout(300)

N = 29
BS = 3
SEED = 5
KW = dict(size=16, dtype="uint8", seed=SEED)


@pytest.fixture(scope="module")
def src(photo_folder):
    s = ImageFolder(photo_folder(N, shape=(40, 1, 48, 1), quality=85))
    assert s.labels.tolist() == list(range(N))
    return s


def make(src, world_size, rank, **kw):
    return Loader(src, kw.pop("batch_size", BS), rank=rank, world_size=world_size,
                  **{**KW, **kw})


def take(loader, k):
    """Labels of the next ``k`` batches (the loader keeps its position after them)."""
    it = iter(loader)
    return [next(it)[1].tolist() for _ in range(k)]


def epoch_rows(loader, check_images=None):
    """One ``for`` loop: (labels, valid labels, batch lengths), images checked against the
    kernel for ``check_images`` = (src, epoch)."""
    labels, valid, lengths = [], [], []
    for x, y in loader:
        if check_images is not None:
            s, epoch = check_images
            ref, _, errors = BatchProcessor(TransformConfig(**loader_transform(loader)), 1).run(
                [s.read(int(i)) for i in y], np.asarray(y, np.int64), epoch=epoch, seed=SEED)
            assert errors == {} and np.array_equal(x, ref)
        labels += y.tolist()
        valid += y[:loader.valid_rows].tolist()
        lengths.append(len(y))
    return labels, valid, lengths


def loader_transform(loader):
    t = loader.transform.to_dict()
    return {k: t[k] for k in ("train", "size", "dtype", "layout")}


def saved(loaders):
    """Every rank's state, through JSON as a checkpoint file would keep it."""
    return [json.loads(json.dumps(loader.state_dict())) for loader in loaders]


def interrupted(src, w_old, steps, **kw):
    """Epoch 0 of a ``w_old``-rank job stopped after ``steps`` batches on every rank: the
    labels each rank took and every rank's state."""
    old = [make(src, w_old, r, **kw) for r in range(w_old)]
    try:
        part1 = [v for loader in old for batch in take(loader, steps) for v in batch]
        return part1, saved(old)
    finally:
        for loader in old:
            loader.close()


TAILS = ("uneven", "mask", "pad", "drop")


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("w_old,w_new", [(2, 3), (3, 2)], ids=["2to3", "3to2"])
def test_the_rest_of_the_epoch_goes_to_the_new_ranks(src, w_old, w_new, steps, tail):
    part1, states = interrupted(src, w_old, steps, shard_tail=tail)
    perm = EpochSampler(N, seed=SEED).permutation(0)
    read = steps * BS * w_old
    # The saved ranks read a prefix of the epoch's order.
    assert sorted(part1) == sorted(perm[:read].tolist())
    rest = N - read
    per_rank = {"uneven": None, "drop": rest // w_new}.get(tail, -(-rest // w_new))
    part2, counted = [], []
    for r in range(w_new):
        with make(src, w_new, r, shard_tail=tail) as a, make(src, w_new, r, shard_tail=tail) as b:
            a.load_state_dict(states, elastic=True)          # every saved rank's state
            b.load_state_dict(states[w_old - 1], elastic=True)  # one rank's stands for all
            assert a.state_dict() == b.state_dict()
            mine = len(range(r, rest, w_new)) if per_rank is None else per_rank
            assert len(a) == -(-mine // BS)
            labels, valid, lengths = epoch_rows(a, check_images=(src, 0))
            assert (labels, valid) == epoch_rows(b)[:2]
            assert len(lengths) == -(-mine // BS) and sum(lengths) == mine
            assert a.epoch == 1
            # Later epochs are the new world size's, bit for bit.
            with make(src, w_new, r, shard_tail=tail) as fresh:
                fresh.set_epoch(1)
                want = [(x.copy(), y.copy()) for x, y in fresh]
            got = [(x.copy(), y.copy()) for x, y in a]
            assert len(got) == len(want) and all(
                np.array_equal(x, u) and np.array_equal(y, v) for (x, y), (u, v) in zip(got, want))
        part2 += labels
        counted += valid
    both = part1 + part2
    if tail == "uneven":
        assert sorted(both) == list(range(N)) and counted == part2
    elif tail == "mask":
        # Valid rows: every sample once. The padding repeats the epoch's first samples.
        assert sorted(part1 + counted) == list(range(N))
        pad = per_rank * w_new - rest
        assert len(part2) - len(counted) == pad
        assert sorted(set(part2) - set(counted)) == sorted(perm[:pad].tolist())
    elif tail == "pad":
        pad = per_rank * w_new - rest
        assert sorted(set(both)) == list(range(N)) and len(both) == N + pad
        twice = sorted(k for k in set(both) if both.count(k) > 1)
        assert twice == sorted(perm[:pad].tolist())
    else:
        # Each sample at most once; the rest's last rest % w_new positions are dropped.
        assert len(both) == len(set(both)) == read + per_rank * w_new
        assert sorted(set(range(N)) - set(both)) == sorted(perm[read + per_rank * w_new:].tolist())


def test_a_changed_world_size_is_refused_without_elastic(src):
    _, states = interrupted(src, 2, 1)
    with make(src, 3, 0) as loader:
        with pytest.raises(ConfigError, match=r"world_size=2.*elastic=True"):
            loader.load_state_dict(states[0])
        with pytest.raises(ConfigError, match="elastic=True"):
            loader.load_state_dict(states)
        assert loader.state_dict()["step"] == 0 and loader.stream_spec.resume is None


def test_ranks_at_different_steps_are_refused(src):
    old = [make(src, 2, r) for r in range(2)]
    take(old[0], 2)
    take(old[1], 1)
    states = saved(old)
    for loader in old:
        loader.close()
    with make(src, 3, 1) as loader:
        with pytest.raises(ConfigError, match=r"different steps \(rank 0 at step 2, rank 1 at "
                                              r"step 1\)"):
            loader.load_state_dict(states, elastic=True)
        with pytest.raises(ConfigError, match=r"every rank 0\.\.1"):
            loader.load_state_dict(states[:1] * 2, elastic=True)
        other_epoch = [states[0], {**states[1], "epoch": 1, "step": 0}]
        with pytest.raises(ConfigError, match="different epochs"):
            loader.load_state_dict(other_epoch, elastic=True)
        with pytest.raises(ConfigError, match="same dataset and arguments"):
            loader.load_state_dict([{**s, "seed": SEED + 1} for s in states], elastic=True)
        assert loader.state_dict()["step"] == 0


def test_uneven_shards_one_rank_at_its_end(src):
    """Uneven shards of 29 over 2 ranks, batch 3: 15 and 14 samples, 5 batches each; with
    batch 7 rank 0 has 3 batches, rank 1 two — rank 1 at its end (step 2) and rank 0 at step
    2 is the same point: everything but rank 0's last batch was read."""
    old = [make(src, 2, r, shard_tail="uneven", batch_size=7) for r in range(2)]
    part1 = [v for loader in old for batch in take(loader, 2) for v in batch]
    states = saved(old)
    assert [len(loader) for loader in old] == [3, 2]
    for loader in old:
        loader.close()
    part2 = []
    for r in range(3):
        with make(src, 3, r, shard_tail="uneven", batch_size=7) as loader:
            loader.load_state_dict(states, elastic=True)
            part2 += epoch_rows(loader)[0]
    assert sorted(part1 + part2) == list(range(N)) and len(part2) == 1


def test_a_state_of_the_resumed_epoch_resumes_plainly_and_elastically(src):
    """2 -> 3 ranks, then a state saved in the resumed epoch: the same 3 ranks continue it
    without elastic (the state carries the resume point), and 3 -> 2 ranks continue it
    elastically again; the three parts are the epoch, each sample once."""
    part1, states = interrupted(src, 2, 1, shard_tail="uneven")
    mid = [make(src, 3, r, shard_tail="uneven") for r in range(3)]
    part2, rest_of_mid = [], []
    for loader in mid:
        loader.load_state_dict(states, elastic=True)
        part2 += take(loader, 1)[0]
    states2 = saved(mid)
    assert all(s["resume"] == [0, 1 * BS * 2] and s["step"] == 1 for s in states2)
    for loader in mid:
        rest_of_mid.append(epoch_rows(loader)[0])
        loader.close()
    for r in range(3):
        with make(src, 3, r, shard_tail="uneven") as again:
            again.load_state_dict(states2[r])
            assert epoch_rows(again)[0] == rest_of_mid[r]
            assert again.state_dict()["resume"] is None     # epoch 1 is whole
    part3 = []
    for r in range(2):
        with make(src, 2, r, shard_tail="uneven") as last:
            last.load_state_dict(states2, elastic=True)
            part3 += epoch_rows(last)[0]
    assert sorted(part1 + part2 + part3) == list(range(N))


def test_elastic_with_the_same_geometry_is_a_plain_resume(src):
    with make(src, 2, 1) as full:
        want = epoch_rows(full)[0][2 * BS:]
    _, states = interrupted(src, 2, 2)
    with make(src, 2, 1) as loader:
        loader.load_state_dict(states[0], elastic=True)     # rank 0's state on rank 1
        assert loader.stream_spec.resume is None and loader.state_dict()["step"] == 2
        assert epoch_rows(loader)[0] == want
    with make(src, 2, 1) as loader:
        loader.load_state_dict(states, elastic=True)        # every rank's: its own is used
        assert loader.state_dict()["step"] == 2 and epoch_rows(loader)[0] == want


def test_an_epoch_read_to_its_end_resumes_at_the_next(src):
    old = [make(src, 2, r) for r in range(2)]
    for loader in old:
        take(loader, len(loader))
    states = saved(old)
    for loader in old:
        loader.close()
    with make(src, 3, 2) as loader, make(src, 3, 2) as fresh:
        loader.load_state_dict(states, elastic=True)
        assert (loader.epoch, loader.stream_spec.resume) == (1, None)
        fresh.set_epoch(1)
        assert epoch_rows(loader)[0] == epoch_rows(fresh)[0]


def test_another_batch_size_under_elastic(src):
    """2 ranks of batch 3 -> 3 ranks of batch 2 (the same global batch): exactly once."""
    part1, states = interrupted(src, 2, 2, shard_tail="uneven")
    part2 = []
    for r in range(3):
        with make(src, 3, r, shard_tail="uneven", batch_size=2) as loader:
            with pytest.raises(ConfigError, match="batch_size=3"):
                loader.load_state_dict(states[r % 2])
            loader.load_state_dict(states, elastic=True)
            part2 += epoch_rows(loader)[0]
    assert sorted(part1 + part2) == list(range(N))


def test_the_resume_point_travels_in_the_wire_spec(src):
    cfg = TransformConfig(size=16)
    plain = StreamSpec(src, 3, cfg, world_size=3, rank=1)
    assert "resume" not in plain.to_wire()          # streams without one: unchanged specs
    spec = StreamSpec(src, 3, cfg, world_size=3, rank=1, resume=(4, 12))
    wire = json.loads(json.dumps(spec.to_wire()))
    assert wire["resume"] == [4, 12]
    back = StreamSpec.from_wire(wire)
    assert back.resume == (4, 12) and back.to_wire() == spec.to_wire()
    assert StreamSpec(src, 3, cfg, resume=(4, 0)).resume is None
    for bad in ((4, N), (4, -1), (-1, 3), (1, 2, 3), "x"):
        with pytest.raises(ConfigError):
            StreamSpec(src, 3, cfg, resume=bad)


def test_a_version_2_state_is_still_read(src):
    with make(src, 2, 0) as loader:
        take(loader, 2)
        state = loader.state_dict()
    old = {k: v for k, v in state.items() if k != "resume"}
    old["version"] = 2
    with make(src, 2, 0) as a, make(src, 2, 0) as b:
        a.load_state_dict(state)
        b.load_state_dict(old)
        assert epoch_rows(a)[0] == epoch_rows(b)[0]
