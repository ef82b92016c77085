"""The local Loader: determinism, exactly-once sharding, resume, bad samples, bounded memory,
packed vs folder sources, argument checks, the batch validity contract and torch output.

Every sample names itself: the datasets here have one class folder per image (or a file list
with label = index), so a yielded label *is* the sample index, and each yielded image is
checked against the batch kernel run on that sample alone — an image paired with the wrong
label, a sample delivered twice or a wrong crop all show.
"""

import io
import json
import os
import sys
import threading
import time

import numpy as np
import pytest
from PIL import Image

from dpu_pipe import (ConfigError, DecodeError, DpuPipeError, PipeTimeout, ProducerError,
                      pack)
from dpu_pipe.kernel import BatchProcessor
from dpu_pipe.loader import Loader
from dpu_pipe.sampler import SHARD_TAILS, EpochSampler
from dpu_pipe.sources import FileList, ImageFolder

import jpeg_corpus as jc
from helpers import rss_bytes

pytestmark = pytest.mark.timeout(120)

N = 25          # samples of the main dataset
SEED = 7
KW = dict(size=32, dtype="uint8", seed=SEED)   # defaults of the loaders below


# --- datasets ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """ImageFolder of N samples, one class folder each: label == sample index."""
    root = jc.write_indexed_folder(tmp_path_factory.mktemp("loader") / "folder", N)
    src = ImageFolder(root)
    assert src.labels.tolist() == list(range(N))
    return src


def subset(src, n):
    """FileList of the first n samples of ``src``, label = index."""
    return FileList([(src.describe(i), i) for i in range(n)])


def make(src, batch_size=4, **kw):
    return Loader(src, batch_size, **{**KW, **kw})


def one_epoch(loader):
    """The batches of one ``for`` loop over the loader, copied: [(images, labels)]."""
    return [(x.copy(), y.copy()) for x, y in loader]


def same(a, b):
    """Two lists of batches are equal, bit for bit, batch for batch."""
    return len(a) == len(b) and all(
        x.dtype == u.dtype and x.shape == u.shape and np.array_equal(x, u)
        and np.array_equal(y, v) for (x, y), (u, v) in zip(a, b))


def labels_of(batches):
    return np.concatenate([y for _, y in batches]).tolist() if batches else []


def kernel_reference(src, labels, epoch, **kw):
    """Each sample made alone by the batch kernel: what the loader must yield for labels
    (labels are indices here)."""
    from dpu_pipe.transforms import TransformConfig

    opts = {**KW, **kw}
    seed = opts.pop("seed")
    cfg = TransformConfig(**{k: v for k, v in opts.items()
                             if k in ("train", "size", "dtype", "layout")})
    bp = BatchProcessor(cfg, 1)
    out, _, errors = bp.run([src.read(int(i)) for i in labels], np.asarray(labels, np.int64),
                            epoch=epoch, seed=seed)
    assert errors == {}
    return out


def loader_threads():
    return [t for t in threading.enumerate() if t.name == "dpu_pipe-loader" and t.is_alive()]


def wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


# --- determinism -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference_stream(folder):
    """Three epochs of the main dataset, batch 4, one thread, prefetch 1."""
    with make(folder, num_threads=1, prefetch=1) as loader:
        return [one_epoch(loader) for _ in range(3)]


def test_batches_are_the_samples_their_labels_name(folder, reference_stream):
    for epoch, batches in enumerate(reference_stream):
        # the last partial batch is kept by default, as DataLoader's drop_last=False
        assert [len(y) for _, y in batches] == [4] * (N // 4) + [N % 4]
        for images, labels in batches:
            assert images.shape == (len(labels), 3, 32, 32) and images.dtype == np.uint8
            assert labels.dtype == np.int64
            assert np.array_equal(images, kernel_reference(folder, labels, epoch))
        assert sorted(labels_of(batches)) == list(range(N))


@pytest.mark.parametrize("prefetch", [1, 3], ids=lambda p: f"prefetch{p}")
@pytest.mark.parametrize("threads", [1, 2, 4], ids=lambda t: f"threads{t}")
def test_stream_is_the_same_for_any_threads_and_prefetch(folder, reference_stream, threads,
                                                         prefetch):
    with make(folder, num_threads=threads, prefetch=prefetch) as loader:
        for epoch in range(3):
            assert loader.epoch == epoch
            assert same(one_epoch(loader), reference_stream[epoch]), f"epoch {epoch}"


def test_float32_stream_is_the_same_for_any_threads(folder):
    kw = dict(dtype="float32", layout="HWC", batch_size=5)
    with make(folder, num_threads=1, **kw) as a, make(folder, num_threads=2, prefetch=3,
                                                      **kw) as b:
        ea, eb = one_epoch(a), one_epoch(b)
    assert ea[0][0].dtype == np.float32 and ea[0][0].shape == (5, 32, 32, 3)
    assert same(ea, eb)


def test_seeds_and_epochs_give_other_streams(folder, reference_stream):
    e0, e1 = reference_stream[0], reference_stream[1]
    assert labels_of(e0) != labels_of(e1)               # another order
    with make(folder, seed=SEED + 1) as other:
        s0 = one_epoch(other)
    assert labels_of(s0) != labels_of(e0)
    # The same sample gets another crop in another epoch and under another seed.
    by_label = {}
    for name, stream in (("e0", e0), ("e1", e1), ("s0", s0)):
        for images, labels in stream:
            for img, lab in zip(images, labels.tolist()):
                by_label.setdefault(lab, {})[name] = img
    common = [d for d in by_label.values() if len(d) == 3]
    assert common
    assert all(not np.array_equal(d["e0"], d["e1"]) for d in common)
    assert all(not np.array_equal(d["e0"], d["s0"]) for d in common)


def test_set_epoch(folder, reference_stream):
    with make(folder) as loader:
        loader.set_epoch(2)
        assert loader.epoch == 2
        assert same(one_epoch(loader), reference_stream[2])
        assert loader.epoch == 3
        # Mid-epoch: set_epoch of another epoch starts it at its first batch; of the current
        # epoch it keeps the position (the torch habit after load_state_dict).
        loader.set_epoch(1)
        for k, _ in enumerate(loader):
            if k == 2:
                break
        loader.set_epoch(1)
        assert loader.state_dict()["step"] == 3
        assert same(one_epoch(loader), reference_stream[1][3:])
        loader.set_epoch(1)
        for k, _ in enumerate(loader):
            if k == 1:
                break
        loader.set_epoch(2)
        loader.set_epoch(1)
        assert same(one_epoch(loader), reference_stream[1])
        loader.set_epoch(0)
        assert same(one_epoch(loader), reference_stream[0])
        for bad in (-1, 2**32, 1.5, "1"):
            with pytest.raises(ConfigError):
                loader.set_epoch(bad)


def test_after_a_full_epoch_the_loader_moves_on(folder, reference_stream):
    with make(folder) as loader:
        assert len(loader) == -(-N // 4) and loader.epoch == 0
        got = []
        for epoch in range(3):
            got.append(one_epoch(loader))
            assert loader.epoch == epoch + 1
            assert loader.state_dict()["step"] == 0
        assert all(same(g, r) for g, r in zip(got, reference_stream))


def test_a_broken_loop_continues_where_it_stopped(folder, reference_stream):
    ref = reference_stream[0]
    with make(folder, prefetch=2) as loader:
        first = []
        for images, labels in loader:
            first.append((images.copy(), labels.copy()))
            if len(first) == 2:
                break
        assert loader.epoch == 0 and loader.state_dict()["step"] == 2
        rest = one_epoch(loader)
        assert same(first + rest, ref)
        # All batches taken without reaching StopIteration: the next loop is the next epoch.
        taken = [(x.copy(), y.copy()) for _, (x, y) in zip(range(len(loader)), loader)]
        assert same(taken, reference_stream[1])
        assert same(one_epoch(loader), reference_stream[2])


def test_no_shuffle_reads_in_index_order(folder):
    with make(folder, shuffle=False, drop_last=False) as loader:
        for _ in range(2):
            assert labels_of(one_epoch(loader)) == list(range(N))


# --- sharding: exactly once --------------------------------------------------------------------

# (shard_tail, drop_last): the torch pairs' (DistributedSampler drop_last, DataLoader
# drop_last) = (True, True) and (False, False), and exact evaluation.
SHARDING = [("drop", True), ("pad", False), ("uneven", False), ("uneven", True),
            ("mask", False)]


@pytest.mark.parametrize("shard_tail,drop_last", SHARDING,
                         ids=[f"{t}-{'drop' if d else 'keep'}" for t, d in SHARDING])
@pytest.mark.parametrize("n", [24, 25], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("world_size", [1, 2, 3], ids=lambda w: f"world{w}")
def test_ranks_cover_the_dataset_exactly_once(folder, world_size, n, shard_tail, drop_last):
    src = subset(folder, n)
    bs = 4
    loaders = [make(src, bs, rank=r, world_size=world_size, shard_tail=shard_tail,
                    drop_last=drop_last, num_threads=1 + r % 2) for r in range(world_size)]
    try:
        for epoch in range(2):
            perm = EpochSampler(n, seed=SEED).permutation(epoch)
            assert sorted(perm.tolist()) == list(range(n))
            union, counted = [], []
            for r, loader in enumerate(loaders):
                per_rank = {"drop": n // world_size, "pad": -(-n // world_size),
                            "mask": -(-n // world_size),
                            "uneven": len(range(r, n, world_size))}[shard_tail]
                batches = per_rank // bs if drop_last else -(-per_rank // bs)
                assert len(loader) == batches
                stream = []
                for x, y in loader:
                    stream.append((x.copy(), y.copy()))
                    counted += y[:loader.valid_rows].tolist()
                assert len(stream) == batches
                got = labels_of(stream)
                for images, labels in stream:
                    assert len(labels) == bs or (not drop_last and images is stream[-1][0])
                    assert np.array_equal(images, kernel_reference(src, labels, epoch))
                # Rank r reads every world_size-th entry of the epoch's permutation from r,
                # wrapped around to its start when padding.
                padded = np.resize(perm, -(-n // world_size) * world_size)
                assert got == padded[r::world_size][:len(got)].tolist()
                union += got
            if drop_last:
                assert len(union) == len(set(union))
                if shard_tail == "drop":
                    assert len(union) == world_size * (n // world_size // bs) * bs
            elif shard_tail == "uneven":
                assert sorted(union) == list(range(n))          # every sample exactly once
            if shard_tail == "mask":
                assert sorted(counted) == list(range(n))        # valid rows: exactly once
            else:
                assert counted == union                         # every row valid
            if not drop_last and shard_tail in ("pad", "mask"):
                per_rank = -(-n // world_size)
                assert sorted(set(union)) == list(range(n))     # every sample read
                assert len(union) == per_rank * world_size
                twice = sorted(k for k in set(union) if union.count(k) > 1)
                assert twice == sorted(perm[:per_rank * world_size - n].tolist())
    finally:
        for loader in loaders:
            loader.close()


def test_drop_shards_change_every_epoch(folder):
    """With shard_tail='drop' the dropped samples differ between epochs (shuffled)."""
    src = subset(folder, 25)
    dropped = []
    with make(src, 4, world_size=2, rank=0, shard_tail="drop", drop_last=True) as a, \
            make(src, 4, world_size=2, rank=1, shard_tail="drop", drop_last=True) as b:
        for _ in range(4):
            dropped.append(frozenset(range(25)) - set(labels_of(one_epoch(a)))
                           - set(labels_of(one_epoch(b))))
    assert len(set(dropped)) > 1


def test_evaluation_defaults_read_everything_in_order(folder):
    """train=False: no shuffle, no drop (the last partial batch kept), every epoch."""
    with make(folder, 12, train=False) as loader:
        assert len(loader) == 3
        for _ in range(2):
            stream = one_epoch(loader)
            assert [len(y) for _, y in stream] == [12, 12, 1]
            assert labels_of(stream) == list(range(N))
    with make(folder, 12, train=False, shuffle=True, seed=3) as shuffled:
        assert sorted(labels_of(one_epoch(shuffled))) == list(range(N))


def test_uneven_evaluation_seven_samples_two_ranks_batch_three(folder):
    """shard_tail='uneven' counts each sample once: no padding, no duplicate, but rank 1 has
    one batch less."""
    src = subset(folder, 7)
    per_rank = []
    for r in range(2):
        with make(src, 3, train=False, rank=r, world_size=2, shard_tail="uneven") as loader:
            stream = one_epoch(loader)
            per_rank.append([y.tolist() for _, y in stream])
            for images, labels in stream:
                assert np.array_equal(images, kernel_reference(src, labels, 0, train=False))
    assert per_rank == [[[0, 2, 4], [6]], [[1, 3, 5]]]


def test_masked_evaluation_seven_samples_two_ranks_batch_three(folder):
    """train=False's default, shard_tail='mask': both ranks run two batches; rank 1's last
    row is padding (sample 0 again), flagged not valid in meta and by valid_rows."""
    src = subset(folder, 7)
    per_rank, valid, counts = [], [], []
    for r in range(2):
        with make(src, 3, train=False, rank=r, world_size=2, return_meta=True) as loader:
            assert loader.stream_spec.shard_tail == "mask" and len(loader) == 2
            rows, flags, vr = [], [], []
            for images, labels, meta in loader:
                assert np.array_equal(images, kernel_reference(src, labels, 0, train=False))
                assert meta["valid"].dtype == bool and len(meta["valid"]) == len(labels)
                rows.append(labels.tolist())
                flags.append(meta["valid"].tolist())
                vr.append(loader.valid_rows)
            per_rank.append(rows)
            valid.append(flags)
            counts.append(vr)
    assert per_rank == [[[0, 2, 4], [6]], [[1, 3, 5], [0]]]
    assert valid == [[[True] * 3, [True]], [[True] * 3, [False]]]
    assert counts == [[3, 1], [3, 0]]


def test_exact_evaluation_with_more_ranks_than_samples(folder):
    src = subset(folder, 2)
    seen = []
    for r in range(3):
        with make(src, 3, train=False, rank=r, world_size=3, shard_tail="uneven") as loader:
            assert len(loader) == (0 if r == 2 else 1)
            for epoch in range(2):
                got = labels_of(one_epoch(loader))
                assert loader.epoch == epoch + 1
                if epoch == 0:
                    seen += got
    assert sorted(seen) == [0, 1]


def test_training_defaults_match_distributed_sampler_and_dataloader(folder):
    """64 samples, 3 ranks, batch 5: DistributedSampler + DataLoader give every rank 5
    batches (the last of 2), the padding wrapping to the start of the order."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, DistributedSampler

    src = FileList([(folder.describe(i % N), i) for i in range(64)])
    for r in range(3):
        with make(src, 5, rank=r, world_size=3, shuffle=False) as loader:
            got = [y.tolist() for _, y in loader]
        ds = DistributedSampler(range(64), num_replicas=3, rank=r, shuffle=False)
        want = [b.tolist() for b in DataLoader(range(64), batch_size=5, sampler=ds)]
        assert got == want and len(got) == 5


# --- resume ------------------------------------------------------------------------------------

RESUME_N = 23
RESUME_BS = 3


def _resume_grid():
    for threads in (1, 2):
        for shard_tail, drop_last in (("drop", True), ("pad", False), ("uneven", False)):
            for world_size in (1, 3):
                if shard_tail == "uneven" and world_size == 1:
                    continue
                yield pytest.param(threads, shard_tail, drop_last, world_size,
                                   id=f"threads{threads}-{shard_tail}-"
                                      f"{'drop' if drop_last else 'keep'}-world{world_size}")


@pytest.mark.parametrize("threads,shard_tail,drop_last,world_size", list(_resume_grid()))
def test_resume_gives_the_rest_of_the_stream(folder, threads, shard_tail, drop_last,
                                             world_size):
    src = subset(folder, RESUME_N)
    kw = dict(batch_size=RESUME_BS, shard_tail=shard_tail, drop_last=drop_last,
              world_size=world_size, rank=world_size - 1, num_threads=threads, prefetch=2)
    with make(src, **kw) as loader:
        ref = [one_epoch(loader) for _ in range(3)]
        L = len(loader)
    assert all(len(e) == L for e in ref) and L >= 2
    rng = np.random.default_rng(threads * 10 + world_size + 100 * drop_last
                                + 1000 * SHARD_TAILS.index(shard_tail))
    randoms = sorted(set(rng.integers(1, L, size=2).tolist()))
    # (name, loops completed, batches taken in the next loop): the consumer stops there.
    stops = [("start", 0, 0)] + [(f"epoch0-step{k}", 0, k) for k in randoms] + [
        ("epoch0-all-batches", 0, L),        # took every batch, StopIteration not reached
        ("epoch0-done", 1, 0),               # the loop ended
        (f"epoch1-step{randoms[0]}", 1, randoms[0]),
    ]
    for name, loops, taken in stops:
        with make(src, **kw) as first:
            for _ in range(loops):
                one_epoch(first)
            it = iter(first)
            for _ in range(taken):
                next(it)
            state = json.loads(json.dumps(first.state_dict()))   # survives a checkpoint file
        assert state["epoch"] == loops and state["step"] == taken, name
        # The rest, as the consumer sees it in fresh ``for`` loops: what is left of this
        # epoch (nothing when every batch was taken), then the next epochs.
        expected = ([ref[loops][taken:]] if taken < L else []) + ref[loops + 1:]
        with make(src, **kw) as resumed:
            resumed.load_state_dict(state)
            got = [one_epoch(resumed) for _ in expected]
            assert resumed.epoch == 3, name
        for k, (g, e) in enumerate(zip(got, expected)):
            assert len(g) == len(e), f"{name}: loop {k} ends after {len(g)} batches, not {len(e)}"
            assert same(g, e), f"{name}: loop {k} differs"


def test_resume_into_the_same_loader(folder, reference_stream):
    with make(folder) as loader:
        for _, _ in zip(range(3), loader):
            pass
        state = loader.state_dict()
        one_epoch(loader)
        one_epoch(loader)
        loader.load_state_dict(state)
        assert same(one_epoch(loader), reference_stream[0][3:])
        assert same(one_epoch(loader), reference_stream[1])


MISMATCH = {
    "seed": dict(seed=SEED + 1),
    "batch_size": dict(batch_size=4),
    "drop_last": dict(drop_last=False),
    "shard_tail": dict(shard_tail="pad"),
    "shuffle": dict(shuffle=False),
    "world_size": dict(world_size=2, rank=0),
    "rank": dict(world_size=3, rank=1),
    "dataset_size": dict(n=24),
}


@pytest.mark.parametrize("change", list(MISMATCH.values()), ids=list(MISMATCH))
def test_load_state_dict_refuses_other_arguments(folder, change):
    base = dict(batch_size=3, world_size=3, rank=0, shard_tail="drop", drop_last=True,
                shuffle=True, n=23)
    with make(subset(folder, 23), **{k: v for k, v in base.items() if k != "n"}) as a:
        next(iter(a))
        state = a.state_dict()
    other = {**base, **change}
    n = other.pop("n")
    with make(subset(folder, n), **other) as b:
        with pytest.raises(ConfigError, match="same dataset and arguments"):
            b.load_state_dict(state)
        # The loader is untouched and still works.
        assert b.state_dict()["step"] == 0 and len(one_epoch(b)) == len(b)


@pytest.mark.parametrize("state", [
    pytest.param(None, id="none"),
    pytest.param([1, 2], id="list"),
    pytest.param({"epoch": 0, "step": 0}, id="no-version"),
    pytest.param("VERSION", id="other-version"),
    pytest.param("STEP_PAST_END", id="step-past-end"),
    pytest.param("STEP_NEGATIVE", id="step-negative"),
])
def test_load_state_dict_refuses_bad_states(folder, state):
    with make(folder) as loader:
        good = loader.state_dict()
        if state == "VERSION":
            state = {**good, "version": good["version"] + 1}
        elif state == "STEP_PAST_END":
            state = {**good, "step": len(loader) + 1}
        elif state == "STEP_NEGATIVE":
            state = {**good, "step": -1}
        with pytest.raises(ConfigError):
            loader.load_state_dict(state)


@pytest.mark.parametrize("epoch", [-1, 2**32], ids=["negative", "too-large"])
def test_load_state_dict_refuses_a_bad_epoch(folder, epoch):
    with make(folder) as loader:
        state = {**loader.state_dict(), "epoch": epoch}
        with pytest.raises(ConfigError):
            loader.load_state_dict(state)


# --- bad samples -------------------------------------------------------------------------------

def bad_bytes(kind):
    """Bytes of each kind of undecodable file (None: the file is missing)."""
    good = jc.indexed_jpeg(0)
    scan = jc.first_scan_data(good)
    return {
        "corrupt": good[:2] + bytes(range(180)) + good[182:],   # garbage over the header
        "truncated": good[:scan + 20],                           # cut in the first scan row
        "empty": b"",
        # Neither a JPEG nor a format OpenCV decodes (PNGs and the like are decoded).
        "not-an-image": b"path,label\nimages/a.jpg,3\n" * 8,
        "missing": None,
    }[kind]


BAD_KINDS = ["corrupt", "truncated", "empty", "not-an-image", "missing"]
# Files libjpeg decodes through other paths: they must come out fine.
SPECIAL = {
    "cmyk": lambda: jc.pil_jpeg(jc.photo_sized("astronaut", 90, 70), mode="CMYK"),
    "gray": lambda: jc.pil_jpeg(np.ascontiguousarray(jc.photo_sized("coffee", 70, 90)[..., 0])),
    "progressive": lambda: jc.pil_jpeg(jc.photo_sized("chelsea", 80, 80), progressive=True),
}


def make_dataset(root, n, bad=None, special=None):
    """FileList of n samples, label = index; ``bad``/``special``: {index: kind}."""
    bad, special = bad or {}, special or {}
    rows = []
    for i in range(n):
        path = os.path.join(root, f"{i:03d}.jpg")
        if i in bad:
            data = bad_bytes(bad[i])
        elif i in special:
            data = SPECIAL[special[i]]()
        else:
            data = jc.indexed_jpeg(i)
        if data is not None:
            jc.write_file(path, data)
        rows.append((path, i))
    return FileList(rows)


@pytest.mark.parametrize("prefetch", [1, 3], ids=lambda p: f"prefetch{p}")
@pytest.mark.parametrize("kind", BAD_KINDS)
def test_raise_names_the_bad_file_in_the_consumer(tmp_path, kind, prefetch):
    n, bs, bad_index = 16, 4, 9
    src = make_dataset(str(tmp_path), n, bad={bad_index: kind})
    path = src.describe(bad_index)
    # The batch that holds the bad sample, in this epoch's reading order.
    order = EpochSampler(n, seed=SEED).permutation(0).tolist()
    bad_step = order.index(bad_index) // bs
    baseline = threading.active_count()
    loader = make(src, bs, num_threads=2, prefetch=prefetch, on_error="raise")
    yielded = 0
    with pytest.raises(DecodeError) as info:
        for images, labels in loader:
            assert bad_index not in labels.tolist()
            yielded += 1
    err = info.value
    assert yielded == bad_step                      # the batches before it came through
    assert err.index == bad_index and err.path == path
    assert path in str(err) and f"sample {bad_index}" in str(err)
    assert isinstance(err, ValueError)
    # Iterating again meets the same error at the same place; the loader does not hang.
    with pytest.raises(DecodeError) as again:
        for _ in loader:
            pass
    assert again.value.index == bad_index
    loader.close()
    assert threading.active_count() == baseline


def test_several_bad_samples_in_one_batch_raise_the_first(tmp_path):
    src = make_dataset(str(tmp_path), 8, bad={2: "empty", 5: "corrupt", 6: "missing"})
    with make(src, 8, shuffle=False, on_error="raise") as loader:
        with pytest.raises(DecodeError) as info:
            next(iter(loader))
    assert info.value.index == 2 and info.value.path == src.describe(2)


BAD = {2: "corrupt", 6: "truncated", 11: "empty", 12: "not-an-image", 17: "missing"}
GOOD_SPECIAL = {1: "cmyk", 7: "gray", 13: "progressive"}


@pytest.fixture(scope="module")
def bad_dataset(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("bad"))
    return make_dataset(root, 20, bad=BAD, special=GOOD_SPECIAL)


def _skip_run(src, epochs=2, **kw):
    with make(src, 4, on_error="skip", **kw) as loader:
        stream = [one_epoch(loader) for _ in range(epochs)]
        return stream, loader.bad_samples


@pytest.mark.parametrize("threads", [1, 2], ids=lambda t: f"threads{t}")
def test_skip_keeps_batches_full_and_records_the_bad_samples(bad_dataset, threads, caplog):
    src = bad_dataset
    caplog.set_level("WARNING", logger="dpu_pipe")
    stream, bad = _skip_run(src, num_threads=threads, prefetch=2)
    assert set(bad) == set(BAD)
    for index, message in bad.items():
        assert src.describe(index) in message
    # Logged once per bad sample, not once per epoch.
    assert len([r for r in caplog.records if r.name == "dpu_pipe"]) == len(BAD)
    for epoch, batches in enumerate(stream):
        shard = EpochSampler(20, seed=SEED).permutation(epoch).tolist()
        assert len(batches) == 5
        for step, (images, labels) in enumerate(batches):
            assert len(labels) == 4 and images.shape[0] == 4
            assert not set(labels.tolist()) & set(BAD)
            # A bad sample is replaced by the next sample of the reading order that decodes,
            # which keeps its own label and crop.
            for j, index in enumerate(shard[step * 4:step * 4 + 4]):
                want = index
                k = step * 4 + j
                while want in BAD:
                    k = (k + 1) % 20
                    want = shard[k]
                assert labels[j] == want, (epoch, step, j)
            assert np.array_equal(images, kernel_reference(src, labels, epoch))
        # CMYK, grayscale and progressive files decode and are delivered.
        assert set(GOOD_SPECIAL) <= set(labels_of(batches))


def test_skip_is_deterministic(bad_dataset):
    a, bad_a = _skip_run(bad_dataset, num_threads=1, prefetch=1)
    b, bad_b = _skip_run(bad_dataset, num_threads=2, prefetch=3)
    assert bad_a == bad_b
    for ea, eb in zip(a, b):
        assert same(ea, eb)
    # And after a resume, with no bad sample known yet to the new loader.
    with make(bad_dataset, 4, on_error="skip") as first:
        one_epoch(first)
        it = iter(first)
        next(it), next(it)
        state = first.state_dict()
    with make(bad_dataset, 4, on_error="skip", num_threads=2) as resumed:
        resumed.load_state_dict(state)
        assert same(one_epoch(resumed), a[1][2:])


def test_skip_with_every_sample_bad_raises(tmp_path):
    src = make_dataset(str(tmp_path), 4, bad={0: "empty", 1: "corrupt", 2: "missing",
                                              3: "truncated"})
    with make(src, 2, on_error="skip") as loader:
        with pytest.raises(DecodeError, match="no decodable sample"):
            one_epoch(loader)


# --- memory ------------------------------------------------------------------------------------

@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_memory_stays_flat_over_20_epochs(folder):
    # Batches of 8 x 3 x 112 x 112 float32 (1.2 MB): a buffer leaked per epoch would show.
    baseline_threads = threading.active_count()
    with make(folder, 8, size=112, dtype="float32", prefetch=2, num_threads=2) as loader:
        for _ in range(2):                       # warm-up: buffers, decoders, allocator
            one_epoch(loader)
        rss0 = rss_bytes()
        for _ in range(20):
            for _images, _labels in loader:
                pass
        rss1 = rss_bytes()
        assert loader.epoch == 22
    assert rss1 - rss0 <= 0.03 * rss0, f"RSS grew from {rss0 >> 20} MB to {rss1 >> 20} MB"
    assert threading.active_count() == baseline_threads


# --- packed source -----------------------------------------------------------------------------

@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
def test_packed_copy_gives_the_same_stream(folder, tmp_path, train):
    packed = pack(folder, str(tmp_path / "ds.dpk"), progress=False)
    try:
        kw = dict(train=train, dtype="float32", num_threads=2, batch_size=5)
        with make(folder, **kw) as a, make(packed, **kw) as b:
            for _ in range(2):
                ea, eb = one_epoch(a), one_epoch(b)
                assert len(ea) == 5 and same(ea, eb)
    finally:
        packed.close()


def test_packed_copy_with_bad_samples(bad_dataset, tmp_path):
    """Skip mode on a packed file (records addressed in place): same stream, same bad set."""
    # A packed file cannot hold a missing file: pack the others, labels = original index.
    keep = [i for i in range(20) if BAD.get(i) != "missing"]
    rows = FileList([(bad_dataset.describe(i), i) for i in keep])
    packed = pack(rows, str(tmp_path / "bad.dpk"), progress=False)
    try:
        a, bad_a = _skip_run(rows)
        b, bad_b = _skip_run(packed)
        # Sample indices are positions in the list of kept files.
        assert set(bad_a) == set(bad_b) == {k for k, i in enumerate(keep) if i in BAD}
        for ea, eb in zip(a, b):
            assert same(ea, eb)
        with make(packed, 4, on_error="raise") as loader:
            with pytest.raises(DecodeError) as info:
                one_epoch(loader)
        assert "bad.dpk" in str(info.value)
    finally:
        packed.close()


# --- arguments -------------------------------------------------------------------------------

BAD_ARGS = {
    "batch_size-0": dict(batch_size=0),
    "batch_size-negative": dict(batch_size=-4),
    "batch_size-float": dict(batch_size=2.0),
    "batch_size-bool": dict(batch_size=True),
    "batch_size-str": dict(batch_size="4"),
    "batch_size-larger-than-shard": dict(batch_size=N + 1, drop_last=True),
    "prefetch-0": dict(prefetch=0),
    "prefetch-float": dict(prefetch=1.5),
    "prefetch-bool": dict(prefetch=True),
    "dtype-float64": dict(dtype="float64"),
    "layout-NCHW": dict(layout="NCHW"),
    "on_error-ignore": dict(on_error="ignore"),
    "on_error-None": dict(on_error=None),
    "output-jax": dict(output="jax"),
    "size-0": dict(size=0),
    "num_threads-0": dict(num_threads=0),
    "timeout-negative": dict(timeout=-1),
    "rank-out-of-range": dict(rank=2, world_size=2),
    "world_size-0": dict(world_size=0),
    "seed-negative": dict(seed=-1),
    "unknown-option": dict(colour="red"),
}


@pytest.mark.parametrize("args", list(BAD_ARGS.values()), ids=list(BAD_ARGS))
def test_bad_arguments_raise_config_error(folder, args):
    baseline = threading.active_count()
    args = dict(args)
    bs = args.pop("batch_size", 4)
    with pytest.raises((ConfigError, TypeError)) as info:
        Loader(folder, bs, **{**KW, **args})
    if "colour" not in args:   # an unknown keyword is Python's TypeError; the rest ConfigError
        assert isinstance(info.value, ConfigError), info.value
    assert threading.active_count() == baseline


@pytest.mark.parametrize("args", [dict(num_threads=2.5), dict(num_threads="2"),
                                  dict(num_threads=True), dict(timeout="10"),
                                  dict(timeout=float("nan"))],
                         ids=["threads-float", "threads-str", "threads-bool", "timeout-str",
                              "timeout-nan"])
def test_loose_arguments_raise_config_error(folder, args):
    with pytest.raises(ConfigError):
        Loader(folder, 4, **{**KW, **args}).close()


def test_output_torch_without_torch_is_a_config_error(folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)   # import torch -> ImportError
    with pytest.raises(ConfigError, match="PyTorch"):
        make(folder, output="torch")


# --- batch validity: copy=False reuses buffers, copy=True does not -------------------------------

@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_labels_kept_across_batches_stay_right(folder, output):
    """The images of a kept batch are overwritten by design (without copy); its labels are not:
    a user keeping (x, y) pairs gets every label of a copy=True run."""
    if output == "torch":
        pytest.importorskip("torch")
    with make(folder, 2, prefetch=1, output=output) as loader, \
            make(folder, 2, copy=True) as check:
        ref = one_epoch(check)
        held = [(x, y) for x, y in loader]
    assert len(held) == len(ref) >= 4
    assert all(np.array_equal(np.asarray(y), r[1]) for (_, y), r in zip(held, ref))


@pytest.mark.parametrize("prefetch", [1, 3], ids=lambda p: f"prefetch{p}")
def test_without_copy_a_batch_buffer_is_reused_after_prefetch_plus_one_steps(folder, prefetch):
    ring = prefetch + 1
    # drop_last: every batch full, so each buffer holds a whole batch to compare
    with make(folder, 2, prefetch=prefetch, drop_last=True) as loader, \
            make(folder, 2, copy=True, drop_last=True) as check:
        ref = one_epoch(check)
        views = []
        for k, (images, labels) in enumerate(loader):
            # While it is held, the batch is the right one.
            assert np.array_equal(images, ref[k][0]) and np.array_equal(labels, ref[k][1])
            views.append((images, labels))
            if k >= ring:
                # Batch k lives in the buffer of batch k - (prefetch + 1), which now shows it;
                # labels are fresh arrays and keep their values.
                old_images, old_labels = views[k - ring]
                assert np.shares_memory(old_images, images)
                assert np.array_equal(old_images, images)
                assert not np.shares_memory(old_labels, labels)
                assert np.array_equal(old_labels, ref[k - ring][1])
            for j in range(max(0, k - ring + 1), k):
                assert not np.shares_memory(views[j][0], images)
        assert len(views) == len(ref) >= 3 * ring
        # Memory is bounded: prefetch + 1 buffers in all.
        assert len({v[0].__array_interface__["data"][0] for v in views}) == ring


def test_with_copy_batches_stay_valid(folder):
    with make(folder, 2, copy=False) as shared_loader:
        ref = one_epoch(shared_loader)
    with make(folder, 2, copy=True, prefetch=1) as loader:
        kept = list(loader)
        for j, (images, labels) in enumerate(kept):
            for other, _ in kept[j + 1:]:
                assert not np.shares_memory(images, other)
        assert same(kept, ref)
        assert all(x.flags.writeable and x.flags.c_contiguous for x, _ in kept)


# --- torch ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "uint8"])
def test_torch_output(folder, dtype):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    want_dtype = {"float32": torch.float32, "float16": torch.float16, "uint8": torch.uint8}
    with make(folder, 3, dtype=dtype, prefetch=1, drop_last=True) as numpy_loader:
        ref = one_epoch(numpy_loader)
    with make(folder, 3, dtype=dtype, prefetch=1, output="torch", drop_last=True) as loader:
        ptrs = []
        for k, (images, labels) in enumerate(loader):
            assert isinstance(images, torch.Tensor) and isinstance(labels, torch.Tensor)
            assert images.dtype == want_dtype[dtype] and labels.dtype == torch.int64
            assert tuple(images.shape) == (3, 3, 32, 32) and images.is_contiguous()
            # Zero copy: the tensor is a view of the loader's numpy buffer (torch.from_numpy).
            arr = images.numpy()
            assert arr.__array_interface__["data"][0] == images.data_ptr()
            assert np.array_equal(arr, ref[k][0]) and np.array_equal(labels.numpy(), ref[k][1])
            ptrs.append(images.data_ptr())
        assert len(set(ptrs)) == 2            # the loader's prefetch + 1 buffers, nothing else
    with make(folder, 3, dtype=dtype, output="torch", copy=True, drop_last=True) as loader:
        kept = list(loader)
        assert len({x.data_ptr() for x, _ in kept}) == len(kept) == len(ref)


# --- a stale iterator must not move the loader -----------------------------------------------------

@pytest.mark.parametrize("how", ["set_epoch", "new_iter"])
def test_an_invalidated_iterator_does_not_advance_the_loader(folder, how):
    with make(folder, 2, prefetch=3, shuffle=False) as loader:
        old = iter(loader)
        next(old)
        wait_for(lambda: loader.stats()["batches"] >= 4)   # prefetched batches are waiting
        if how == "set_epoch":
            loader.set_epoch(3)
            new = None
        else:
            new = iter(loader)
            assert next(new)[1].tolist() == [2, 3]
        position = (loader.epoch, loader.state_dict()["step"])
        try:
            images, labels = next(old)
            yielded = labels.tolist()
        except (StopIteration, DpuPipeError):
            yielded = None
        assert (loader.epoch, loader.state_dict()["step"]) == position
        assert yielded is None, f"the old iterator yielded batch {yielded}"


# --- lifecycle: close, timeouts, producer failures ------------------------------------------------

class SlowList(FileList):
    """A file list whose reads take ``delay`` seconds."""
    delay = 0.0

    def read(self, i):
        time.sleep(self.delay)
        return super().read(i)


class FailingList(FileList):
    """A file list whose read of sample ``fail_at`` raises a non-decode error."""
    fail_at = 3

    def read(self, i):
        if i == self.fail_at:
            raise RuntimeError("disk on fire")
        return super().read(i)


@pytest.mark.parametrize("prefetch", [1, 3], ids=lambda p: f"prefetch{p}")
def test_close_mid_epoch_stops_the_producer(folder, prefetch):
    baseline = threading.active_count()
    loader = make(folder, 2, prefetch=prefetch, num_threads=2)
    for k, _ in enumerate(loader):
        if k == 1:
            break
    assert threading.active_count() == baseline + 1      # the producer waits for a slot
    loader.close()
    assert threading.active_count() == baseline
    loader.close()                                        # idempotent
    # A closed loader can be iterated again: it starts a new producer where it stood.
    assert loader.state_dict()["step"] == 2
    assert len(one_epoch(loader)) == len(loader) - 2
    loader.close()
    with make(folder, 2) as ctx:
        next(iter(ctx))
    assert threading.active_count() == baseline


def test_a_slow_producer_times_out_in_the_consumer(folder):
    src = SlowList([(folder.describe(i), i) for i in range(8)])
    src.delay = 0.4
    baseline = threading.active_count()
    loader = make(src, 2, timeout=0.2)
    # The deadline error itself, at the first step: a batch of two 0.4 s samples cannot be
    # made in time, however loaded the machine.
    with pytest.raises(PipeTimeout, match=r"no batch within .* s \(epoch 0, step 0\)"):
        next(iter(loader))
    loader.close()
    wait_for(lambda: threading.active_count() == baseline, timeout=10)


def test_a_producer_failure_is_carried_to_the_consumer(folder):
    src = FailingList([(folder.describe(i), i) for i in range(8)])
    baseline = threading.active_count()
    with make(src, 2, shuffle=False) as loader:
        it = iter(loader)
        assert next(it)[1].tolist() == [0, 1]
        with pytest.raises(ProducerError) as info:
            next(it)
    err = info.value
    assert err.producer == "loader thread"
    assert "disk on fire" in str(err) and "RuntimeError" in err.remote_traceback
    assert isinstance(err.__cause__, RuntimeError)
    assert threading.active_count() == baseline


def test_an_abandoned_loader_does_not_keep_its_thread(folder):
    import gc

    before = set(loader_threads())
    try:
        images, labels = next(iter(make(folder, 2)))
        del images, labels
        gc.collect()
        wait_for(lambda: not set(loader_threads()) - before, timeout=3)
    finally:
        for t in set(loader_threads()) - before:   # do not leave it running for later tests
            stop = t._args[-1] if getattr(t, "_args", None) else None
            if isinstance(stop, threading.Event):
                stop.set()


def test_a_closed_loader_is_freed_where_it_is_dropped(folder, monkeypatch):
    """A loader closed, then dropped, starts no finalizing thread: that daemon thread would free
    the buffers, and the interpreter's exit may stop it inside C++ code (an abort). Iterated
    again after close(), a dropped loader is closed by that thread as before."""
    import gc

    started = []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start",
                        lambda thread: (started.append(thread.name), start(thread))[1])
    loader = make(folder, 2)
    next(iter(loader))
    loader.close()
    del loader
    gc.collect()
    assert started == ["dpu_pipe-maker"]
    loader = make(folder, 2)
    next(iter(loader))
    loader.close()
    next(iter(loader))
    del loader
    gc.collect()
    assert started.count("dpu_pipe-finalize") == 1
    wait_for(lambda: not any(t.name == "dpu_pipe-finalize" for t in threading.enumerate()),
             timeout=10)


def test_a_finalizer_never_waits_in_the_thread_the_collector_runs_it_in(folder):
    """The collector runs a dropped loader's __del__ in whatever thread allocates: in hybrid
    mode, a host thread of another loader whose batch the main thread waits for while holding
    the lock that close() takes (a job hung there). __del__ returns at once, and the close
    happens in a thread of its own once the lock is free."""
    loader = make(folder, 2)
    next(iter(loader))
    assert loader._iter is not None
    held, release = threading.Event(), threading.Event()

    def holder():
        with loader._lock:
            held.set()
            release.wait(30)

    h = threading.Thread(target=holder)
    h.start()
    try:
        assert held.wait(10)
        fin = threading.Thread(target=loader.__del__)
        fin.start()
        fin.join(10)
        assert not fin.is_alive(), "__del__ waited for the lock another thread holds"
        assert loader._iter is not None, "closed before the lock was free"
    finally:
        release.set()
        h.join(10)
    wait_for(lambda: loader._iter is None, timeout=10)    # the close's end of the iteration


def test_set_epoch_after_load_state_dict_keeps_the_restored_position(folder, reference_stream):
    """The torch habit: restore, then set_epoch(e) for every epoch from the restored one on.
    Nothing of the restored epoch is seen twice, nothing is missed."""
    with make(folder) as first:
        for k, _ in enumerate(first):
            if k == 1:
                break
        state = first.state_dict()
    assert (state["epoch"], state["step"]) == (0, 2)
    with make(folder) as loader:
        loader.load_state_dict(state)
        got = []
        for epoch in range(state["epoch"], 2):
            loader.set_epoch(epoch)
            got.append(one_epoch(loader))
    assert same(got[0], reference_stream[0][2:])
    assert same(got[1], reference_stream[1])


def test_state_names_its_dataset_and_another_is_refused(folder, tmp_path):
    from PIL import Image

    other = tmp_path / "other"
    for i in range(N):
        d = other / f"k{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((20, 24, 3), 9 * i, np.uint8)).save(d / f"{i}.jpg")
    with make(folder) as a:
        state = a.state_dict()
        assert state["source"]["fingerprint"] == a.source.fingerprint()
        assert state["source"]["num_samples"] == N
    with make(other) as b:     # same size, other files: num_samples alone would accept it
        with pytest.raises(ConfigError, match=r"another dataset.*other"):
            b.load_state_dict(state)
        b.load_state_dict({k: v for k, v in state.items() if k != "source"})


@pytest.mark.parametrize("key, says", [
    ("num_workers", "use num_threads"), ("persistent_workers", "there is no equivalent"),
    ("prefetch_factor", "use prefetch"), ("pin_memory_device", "use device"),
    ("worker_init_fn", "there is no equivalent"), ("collate_fn", "use batch_hook")])
def test_torch_dataloader_keywords_name_the_equivalent(folder, key, says):
    with pytest.raises(ConfigError, match=rf"{key}= is a torch DataLoader argument; {says}"):
        Loader(folder, 4, **{key: 2})


def test_timeout_zero_is_the_default_deadline(folder):
    from dpu_pipe.loader import DEFAULT_TIMEOUT

    with make(folder, timeout=0) as loader:
        assert loader.timeout == DEFAULT_TIMEOUT
    for bad in (-1, float("inf"), "1", True):
        with pytest.raises(ConfigError, match="timeout"):
            Loader(folder, 4, timeout=bad)


def test_interval_stats_count_since_the_last_call(folder):
    with make(folder, batch_size=4) as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        a = loader.stats(interval=True)
        next(it)
        b = loader.stats(interval=True)
        c = loader.stats(interval=True)
    assert (a["samples"], b["samples"], c["samples"]) == (12, 4, 0)
    for s in (a, b):
        assert s["img_per_s"] == pytest.approx(s["samples"] / s["seconds"])
        assert 0 <= s["data_wait_share"] <= 1 and 0 <= s["producer_busy_share"] <= 1.01
        assert s["bad_samples"] == 0
    assert loader.stats()["samples"] >= 16          # cumulative counters unchanged


def test_interval_busy_share_counts_a_batch_where_it_ran(folder):
    # The maker reads slowly, so a batch is under way at every mark; booking each batch
    # only when it ends would put a whole batch in an interval shorter than it.
    src = SlowList([(folder.describe(i), i) for i in range(16)])
    src.delay = 0.05
    with make(src, batch_size=4, prefetch=3) as loader:
        it = iter(loader)
        next(it)
        time.sleep(2 * src.delay)       # about half of the next batch, under way
        loader.stats(interval=True)
        made = loader.maker.stats.batches
        deadline = time.monotonic() + 30
        while loader.maker.stats.batches == made:
            assert time.monotonic() < deadline, "the maker made no batch in 30 s"
            time.sleep(0.005)
        s = loader.stats(interval=True)
    assert 0.7 <= s["producer_busy_share"] <= 1.01, s


def test_waits_show_in_the_torch_profiler(folder):
    torch = pytest.importorskip("torch")
    with make(folder) as loader, torch.profiler.profile() as prof:
        n = sum(1 for _ in loader)
    waits = [e for e in prof.events() if e.name == "dpu_pipe.wait"]
    assert len(waits) == n == len(loader)
