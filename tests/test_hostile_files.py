"""Hostile files end to end through Loader, with both on_error policies.

Every file of tests/hostile_corpus.py (plus files that vanish or turn into something else
after the dataset was listed, and packed datasets with damaged shards, indexes and
manifests) goes through a real Loader. Asserted for each: ``raise`` names the sample and its
file; ``skip`` replaces it by the next decodable sample of the reading order and records it;
a delivered sample is exactly what the batch kernel makes of that sample's bytes, and close to
an independent reference where the file is valid; batches stay full, nothing is dropped, and
no wait exceeds the loader's timeout.
"""

import os

import numpy as np
import pytest

import hostile_corpus as hc
import jpeg_corpus as jc
from dpu_pipe import DecodeError, FileList, Loader, PackedSource, ConfigError, ops, pack, rng
from dpu_pipe.kernel import BatchProcessor
from dpu_pipe.packed import format as fmt
from dpu_pipe.transforms import TransformConfig

pytestmark = pytest.mark.timeout(300)

SEED = 3
SIZE = 32
KW = dict(size=SIZE, dtype="uint8", seed=SEED, shuffle=False, drop_last=False, timeout=60)
# Mean absolute difference (uint8 levels) allowed between a delivered sample and the
# reference (Pillow decode + dpu_pipe.ops resampling of the same crop): the decoders agree
# to the bit on full-scale decodes; DCT-scaled decodes and CMYK rounding stay within ~1.
REF_TOL = 3.0


def _filler(i):
    return jc.pil_jpeg(jc.photo_sized(jc.PHOTOS[i % 3], 56 + i % 17, 64 + i % 13), quality=85)


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def _vanish(kind, path):
    """Make a listed file unreadable in one way after listing."""
    if kind == "deleted":
        os.remove(path)
    elif kind == "directory":
        os.remove(path)
        os.mkdir(path)
    elif kind == "fifo":
        os.remove(path)
        os.mkfifo(path)
    elif kind == "device":
        os.remove(path)
        os.symlink("/dev/zero", path)
    elif kind == "dangling_symlink":
        os.remove(path)
        os.symlink(path + ".gone", path)


VANISH = ("deleted", "directory", "fifo", "device", "dangling_symlink")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """FileList alternating hostile files and good fillers (label = index), the files'
    bytes and expectations; vanishing files are made to vanish after listing."""
    root = tmp_path_factory.mktemp("hostile")
    rows, data, expect, vanish = [], {}, {}, {}
    items = hc.corpus() + [(f"vanished_{k}", hc.base_jpeg(), "bad") for k in VANISH]
    for name, blob, exp in items:
        i = len(rows)
        path = str(root / f"{i:03d}_{name}.jpg")
        _write(path, blob)
        rows.append((path, i))
        data[i], expect[i] = blob, exp
        if name.startswith("vanished_"):
            vanish[i] = name[len("vanished_"):]
        j = i + 1
        path = str(root / f"{j:03d}_filler.jpg")
        blob = _filler(j)
        _write(path, blob)
        rows.append((path, j))
        data[j], expect[j] = blob, "good"
    src = FileList(rows)
    for i, kind in vanish.items():
        _vanish(kind, src.describe(i))
    return src, data, expect, items


def _kernel(blob, index, epoch=0):
    """What the batch kernel makes of ``blob`` as sample ``index``: (output or None)."""
    bp = BatchProcessor(TransformConfig(size=SIZE, dtype="uint8"))
    out, _, errors = bp.run([blob], np.array([index]), epoch=epoch, seed=SEED)
    return None if errors else out[0]


def _reference(blob, index, epoch=0):
    """Independent reference: Pillow's decode, the sample's crop and flip from dpu_pipe.rng,
    resampled by dpu_pipe.ops. None when Pillow cannot decode the bytes."""
    img = hc.reference(blob)
    if img is None:
        return None
    box = rng.random_resized_crop(SEED, epoch, index, img.shape[0], img.shape[1])
    flip = rng.random_flip(SEED, epoch, index)
    return ops.resize_crop(img, box, SIZE, flip=bool(flip), dtype="uint8")


def _close(a, b):
    return np.abs(a.astype(np.int16) - b.astype(np.int16)).mean() <= REF_TOL


def _stream(loader):
    return [(x.copy(), y.copy()) for x, y in loader]


@pytest.mark.parametrize("threads", [1, 2], ids=lambda t: f"threads{t}")
def test_skip_delivers_every_position_and_reports_every_bad_file(hostile, threads):
    src, data, expect, _ = hostile
    n = len(src)
    with Loader(src, 4, on_error="skip", num_threads=threads, **KW) as loader:
        stream = _stream(loader)
        bad = loader.bad_samples
    images = np.concatenate([x for x, _ in stream])
    labels = np.concatenate([y for _, y in stream]).tolist()
    assert len(labels) == n and all(len(y) == 4 for _, y in stream[:-1])   # nothing dropped
    for i, message in bad.items():
        assert src.describe(i) in message, message
    delivered = set(labels)
    for i in range(n):
        e = expect[i]
        if e == "bad":
            assert i in bad and i not in delivered, (i, src.describe(i))
        elif e == "good":
            assert i not in bad and labels[i] == i, (i, src.describe(i), bad.get(i))
        # Position i holds sample i, or (i reported) the next decodable sample after it.
        want = i
        while want in bad:
            want = (want + 1) % n
        assert labels[i] == want, (i, labels[i], want)
    for pos, q in enumerate(labels):
        # Each delivered sample is exactly the kernel's output for its own bytes and index,
        # whoever made it and wherever it landed.
        made = _kernel(data[q], q)
        assert made is not None and np.array_equal(images[pos], made), (pos, q)
        e = expect[q]
        if e in ("good", "either"):
            ref = _reference(data[q], q)
            assert ref is not None and _close(images[pos], ref), (q, src.describe(q))
        elif e == "cut":
            intact = hc.base_jpeg()
            assert np.array_equal(images[pos], _kernel(intact, q)), src.describe(q)


def test_skip_is_the_same_stream_every_time(hostile):
    src = hostile[0]
    runs = []
    for threads, prefetch in ((1, 1), (2, 3)):
        with Loader(src, 4, on_error="skip", num_threads=threads, prefetch=prefetch,
                    **KW) as loader:
            runs.append((_stream(loader), loader.bad_samples))
    (a, bad_a), (b, bad_b) = runs
    assert bad_a == bad_b
    assert all(np.array_equal(x, u) and np.array_equal(y, v) for (x, y), (u, v) in zip(a, b))


def test_raise_names_each_bad_file(hostile):
    src, data, expect, _ = hostile
    raised = {}
    for i in range(0, len(src), 2):   # the hostile entries; fillers at odd indices
        pair = FileList([(src.describe(i + 1), i + 1), (src.describe(i), i)])
        with Loader(pair, 2, on_error="raise", **KW) as loader:
            try:
                (x, y), = _stream(loader)
            except DecodeError as err:
                raised[i] = err
                assert err.index == 1 and err.path == src.describe(i), err
                assert src.describe(i) in str(err) and "sample 1" in str(err)
                continue
        assert y.tolist() == [i + 1, i], y
        assert np.array_equal(x[1], _kernel(data[i], 1))
    for i in range(0, len(src), 2):
        if expect[i] == "bad":
            assert i in raised, f"{src.describe(i)} was delivered"
        elif expect[i] == "good":
            assert i not in raised, raised.get(i)


def test_a_fifo_listed_as_a_sample_does_not_block(tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: the reader must refuse it
    at once rather than hang the producer (and with it the training loop)."""
    fifo = str(tmp_path / "x.jpg")
    os.mkfifo(fifo)
    src = FileList([(fifo, 0)])
    with pytest.raises(DecodeError, match="not a regular file") as info:
        src.read(0)
    assert info.value.path == fifo


# --- packed datasets --------------------------------------------------------------------------

N_PACKED = 24


@pytest.fixture
def packed_dir(tmp_path):
    """A packed dataset of N_PACKED good records: 4 shards of 6, index blocks of 2."""
    rows = []
    for i in range(N_PACKED):
        p = str(tmp_path / f"{i:02d}.jpg")
        _write(p, _filler(i))
        rows.append((p, i))
    blob = sum(len(_filler(i)) for i in range(6))
    out = str(tmp_path / "ds")
    pack(FileList(rows), out, progress=False, shard_size=blob, block_records=2)
    return out


def _shard_records(path, k):
    ds = PackedSource(path).dataset
    e = ds.shards[k]
    return list(range(int(e["first"]), int(e["first"]) + int(e["count"])))


def _damage(path, how):
    """Damage one part of the packed dataset; returns the record indices it makes bad."""
    shard = os.path.join(path, fmt.shard_name(1))
    bad = _shard_records(path, 1)
    if how == "shard_truncated":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) - 100)
    elif how == "shard_missing":
        os.remove(shard)
    elif how == "index_block_corrupted":
        h = np.fromfile(shard, fmt.SHARD_HEADER, count=1)[0]
        with open(shard, "r+b") as f:
            f.seek(int(h["index_offset"]) + 48 * 2 + 8)     # block 1, record 2's length
            f.write(b"\x07")
        bad = bad[2:4]
    elif how == "record_corrupted":
        h = np.fromfile(shard, fmt.SHARD_HEADER, count=1)[0]
        rec = np.fromfile(shard, fmt.RECORD, count=1, offset=int(h["index_offset"]))[0]
        with open(shard, "r+b") as f:
            f.seek(int(rec["offset"]) + 2)
            f.write(bytes(64))                              # zeros over its first markers
        bad = bad[:1]
    return bad


DAMAGE = ("shard_truncated", "shard_missing", "index_block_corrupted", "record_corrupted")


@pytest.mark.parametrize("how", DAMAGE)
def test_packed_damage_is_reported_by_record_and_shard(packed_dir, how):
    bad = _damage(packed_dir, how)
    src = PackedSource(packed_dir)
    with Loader(src, 4, on_error="skip", **KW) as loader:
        stream = _stream(loader)
        skipped = loader.bad_samples
    assert sorted(skipped) == bad
    labels = np.concatenate([y for _, y in stream]).tolist()
    assert len(labels) == N_PACKED
    for i in range(N_PACKED):
        want = i
        while want in skipped:
            want += 1
        assert labels[i] == want
    first_bad = min(bad)
    with Loader(PackedSource(packed_dir), 4, on_error="raise", **KW) as loader:
        with pytest.raises(DecodeError) as info:
            _stream(loader)
    assert info.value.index == first_bad
    text = str(info.value)
    assert (fmt.shard_name(1) in text or "shard 1," in text) and f"sample {first_bad}" in text


@pytest.mark.parametrize("how", ["truncated", "header_flipped", "shard_table_flipped",
                                 "labels_flipped"])
def test_a_damaged_manifest_is_refused_at_opening(packed_dir, how):
    manifest = os.path.join(packed_dir, fmt.MANIFEST_NAME)
    raw = bytearray(open(manifest, "rb").read())
    h = np.frombuffer(bytes(raw[:128]), fmt.MANIFEST_HEADER)[0]
    if how == "truncated":
        raw = raw[:-10]
    else:
        at = {"header_flipped": 20, "shard_table_flipped": int(h["shards_offset"]) + 8,
              "labels_flipped": int(h["labels_offset"]) + 3}[how]
        raw[at] ^= 0x10
    _write(manifest, bytes(raw))
    if how == "labels_flipped":
        # Labels are checked against each shard's index block when a record is read.
        with Loader(PackedSource(packed_dir), 4, on_error="raise", **KW) as loader:
            with pytest.raises(DecodeError, match="label") as info:
                _stream(loader)
        assert info.value.index == 0
        return
    with pytest.raises(ConfigError, match=fmt.MANIFEST_NAME):
        Loader(PackedSource(packed_dir), 4, **KW)


def test_a_listed_path_with_a_nul_byte_is_a_bad_sample(tmp_path):
    """A file list is untrusted: a path the OS cannot name is reported like a missing file
    (it used to escape as ValueError and stop the loader under on_error="skip")."""
    good = str(tmp_path / "a.jpg")
    _write(good, _filler(0))
    src = FileList([(good, 0), (str(tmp_path / "b\0c.jpg"), 1)])
    with Loader(src, 2, on_error="skip", **KW) as loader:
        (x, y), = _stream(loader)
        assert y.tolist() == [0, 0] and list(loader.bad_samples) == [1]
    with Loader(src, 2, on_error="raise", **KW) as loader:
        with pytest.raises(DecodeError, match="NUL byte") as info:
            _stream(loader)
    assert info.value.index == 1
