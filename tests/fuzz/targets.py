"""Fuzz targets: each takes one input (bytes) and raises only when dpu_pipe misbehaves.

An untrusted input may make dpu_pipe raise its own errors (DecodeError, ConfigError — the
documented outcomes for bad data); anything else escaping (another exception type, a result
of the wrong shape or dtype, a record outside the mapped file) fails the target, and a crash
or sanitizer report ends the process. The same functions serve atheris (fuzz.py) and the
regression tests (test_regressions.py), which replay every checked-in input.

Inputs of ``decode`` and ``batch`` are a JPEG followed by a fixed-size trailer of settings
(region, scale, flags; transform settings), so seed JPEGs stay valid JPEGs and the fuzzer
mutates settings and data alike. The ``packed`` target takes a manifest and a shard in one
input (see :func:`packed`).
"""

import atexit
import functools
import os
import shutil
import struct
import tempfile
import zlib

import numpy as np

from dpu_pipe import jpeg
from dpu_pipe.errors import ConfigError, DecodeError

EXPECTED = (DecodeError, ConfigError)
# Budgets small enough that an execution stays fast, large enough for every seed.
MAX_PIXELS = 1 << 16
MAX_SCANS = 64

DECODE_TRAILER_FMT = "<BHHHHHH"         # flags, top, left, height, width, min_h, min_w
DECODE_TRAILER = struct.pack(DECODE_TRAILER_FMT, 0, 0, 0, 0, 0, 0, 0)
BATCH_TRAILER_FMT = "<BBBBBBBBIH"       # flags, oh, ow, scale lo/hi, ratio lo/hi, flip, seed, epoch
BATCH_TRAILER = struct.pack(BATCH_TRAILER_FMT, 1, 16, 16, 20, 255, 100, 150, 128, 0, 0)

# Files the targets write their input to (in memory when /dev/shm exists).
_TMP = tempfile.mkdtemp(prefix="dpu_pipe_fuzz_",
                        dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
atexit.register(shutil.rmtree, _TMP, True)


def _exact(data):
    """The input in a heap block of exactly its size, so ASan flags a read one byte past it
    (a ``bytes`` object carries a terminating NUL that would hide it)."""
    arr = np.empty(len(data), dtype=np.uint8)
    arr[:] = np.frombuffer(data, dtype=np.uint8)
    return arr


def header(data):
    """jpeg.read_header on arbitrary bytes."""
    try:
        h = jpeg.read_header(_exact(data), max_pixels=MAX_PIXELS)
    except EXPECTED:
        return
    assert h.width >= 1 and h.height >= 1 and h.width * h.height <= MAX_PIXELS, h
    assert h.colorspace in ("GRAY", "RGB", "YCbCr", "CMYK", "YCCK", "UNKNOWN"), h


def _scaled_box(h, w, region, scale):
    top, left, rh, rw = region
    sh, sw = -(-h * scale // 8), -(-w * scale // 8)
    r0, c0 = top * scale // 8, left * scale // 8
    r1, c1 = -(-(top + rh) * scale // 8), -(-(left + rw) * scale // 8)
    return min(r1, sh) - r0, min(c1, sw) - c0


def decode(data):
    """jpeg.decode with fuzzed region, min_size, fast and strict; the result's shape must be
    the one the documentation promises."""
    n = struct.calcsize(DECODE_TRAILER_FMT)
    if len(data) < n:
        return
    flags, top, left, rh, rw, mh, mw = struct.unpack(DECODE_TRAILER_FMT, data[-n:])
    img = _exact(data[:-n])
    try:
        hdr = jpeg.read_header(img, max_pixels=MAX_PIXELS)
    except EXPECTED:
        hdr = None
    region = min_size = None
    if flags & 4:
        if hdr is not None and not flags & 64:
            H, W = hdr.height, hdr.width
            top, left = top % H, left % W
            region = (top, left, 1 + rh % (H - top), 1 + rw % (W - left))
        else:
            region = (top, left, rh, rw)  # anything, inside the image or not
    if flags & 8:
        min_size = (mh % 600, mw % 600)
    try:
        out = jpeg.decode(img, region=region, min_size=min_size, fast=bool(flags & 1),
                          strict=bool(flags & 2), max_pixels=MAX_PIXELS, max_scans=MAX_SCANS)
    except EXPECTED:
        return
    assert hdr is not None, "decode succeeded where read_header failed"
    assert out.dtype == np.uint8 and out.ndim == 3 and out.shape[2] == 3, out.shape
    H, W = hdr.height, hdr.width
    box = region or (0, 0, H, W)
    scale = jpeg.choose_scale(box[2], box[3], min_size)
    assert out.shape[:2] == _scaled_box(H, W, box, scale), (out.shape, H, W, box, scale)


@functools.lru_cache(maxsize=64)
def _processor(train, oh, ow, scale, ratio, flip_p, dtype, layout, fast):
    from dpu_pipe.kernel import BatchProcessor
    from dpu_pipe.transforms import TransformConfig

    return BatchProcessor(TransformConfig(train=train, size=(oh, ow), scale=scale, ratio=ratio,
                                          flip_p=flip_p, dtype=dtype, layout=layout, fast=fast,
                                          max_pixels=MAX_PIXELS))


def batch(data):
    """The batch kernel (decode + RandomResizedCrop/flip or resize/center crop + normalize)
    on a fuzzed JPEG under fuzzed transform settings, three samples per batch (three
    different crops of the same bytes)."""
    n = struct.calcsize(BATCH_TRAILER_FMT)
    if len(data) < n:
        return
    flags, oh, ow, s0, s1, r0, r1, flip, seed, epoch = \
        struct.unpack(BATCH_TRAILER_FMT, data[-n:])
    lo, hi = sorted((max(s0, 1) / 255, max(s1, 1) / 255))
    rlo, rhi = sorted((max(r0, 1) / 100, max(r1, 1) / 100))
    try:
        proc = _processor(bool(flags & 1), 1 + oh % 48, 1 + ow % 48, (lo, hi), (rlo, rhi),
                          flip / 255, ("float32", "float16", "uint8")[(flags >> 1) % 3],
                          ("CHW", "HWC")[(flags >> 3) & 1], bool(flags & 16))
    except ConfigError:
        return
    img = _exact(data[:-n])
    indices = np.array([0, 1, 2**40 + epoch], dtype=np.int64)
    out, info, errors = proc.run([img, img, img], indices, epoch=epoch, seed=seed)
    assert out.shape == (3,) + proc.sample_shape and info.shape == (3, 7)
    for i in range(3):
        if i in errors:
            assert isinstance(errors[i], DecodeError) and errors[i].index == indices[i]
            assert info[i, 0] < 0, info[i]
        else:
            assert info[i, 0] == 0 and info[i, 6] in (1, 2, 4, 8), info[i]
            if out.dtype != np.uint8:
                assert np.isfinite(out[i]).all(), "non-finite output"


def _frame(manifest, shard, fix_crcs):
    """A packed-target input: the manifest and shard 0 of a packed dataset, one input."""
    return struct.pack("<I", len(manifest) | (fix_crcs << 31)) + manifest + shard


def _fixed_shard(b):
    """Shard bytes with every CRC recomputed where its parts can be found."""
    from dpu_pipe.packed import format as fmt

    if len(b) < fmt.HEADER_SIZE:
        return b
    h = np.frombuffer(bytes(b[:fmt.HEADER_SIZE]), fmt.SHARD_HEADER)[0]
    n, per = int(h["count"]), max(int(h["block_records"]), 1)
    idx, blk, pth = int(h["index_offset"]), int(h["blocks_offset"]), int(h["paths_offset"])
    io, isz = int(h["intervals_offset"]), int(h["intervals_size"])
    nblocks = -(-n // per)
    if n <= 4096 and idx + 48 * n <= len(b) and blk + 4 * nblocks <= len(b) <= 2**24:
        recs = np.frombuffer(bytes(b[idx:idx + 48 * n]), fmt.RECORD)
        paths, lo = bytes(b[pth:pth + int(h["paths_size"])]), 0
        ends = entries = None
        if int(h["version"]) == 3 and 8 * n <= isz and io + isz <= len(b):
            ends = np.frombuffer(bytes(b[io:io + 8 * n]), "<u8")
            entries = bytes(b[io + 8 * n:io + isz])
        for k in range(nblocks):
            block = recs[k * per:(k + 1) * per]
            hi = int(block["path_end"][-1])
            parts = ()
            if ends is not None:
                ilo = int(ends[k * per - 1]) if k else 0
                parts = (ends[k * per:(k + 1) * per].tobytes(),
                         entries[ilo:int(ends[min((k + 1) * per, n) - 1])])
            crc = fmt.block_crc(block.tobytes(), paths[lo:hi] if lo <= hi else b"", parts)
            b[blk + 4 * k:blk + 4 * k + 4] = struct.pack("<I", crc)
            lo = hi
        _put(b, fmt.SHARD_HEADER, "blocks_crc32", zlib.crc32(bytes(b[blk:blk + 4 * nblocks])))
    b[124:128] = struct.pack("<I", zlib.crc32(bytes(b[:124])))
    return b


def _put(buf, dtype, field, value):
    """Write ``value`` into the header field ``field`` of ``dtype`` at the start of ``buf``."""
    ft, off = dtype.fields[field][:2]
    buf[off:off + ft.itemsize] = np.array(value, ft).tobytes()


def _fixed_manifest(m, shard_header_crc):
    from dpu_pipe.packed import format as fmt

    if len(m) < fmt.HEADER_SIZE:
        return m
    h = np.frombuffer(bytes(m[:fmt.HEADER_SIZE]), fmt.MANIFEST_HEADER)[0]
    s, so = int(h["num_shards"]), int(h["shards_offset"])
    if 1 <= s <= 64 and so + 64 * s <= len(m):
        m[so + 48:so + 52] = struct.pack("<I", shard_header_crc)
        _put(m, fmt.MANIFEST_HEADER, "shards_crc32", zlib.crc32(bytes(m[so:so + 64 * s])))
    mo, ms = int(h["meta_offset"]), int(h["meta_size"])
    if mo + ms <= len(m):
        _put(m, fmt.MANIFEST_HEADER, "meta_crc32", zlib.crc32(bytes(m[mo:mo + ms])))
    m[124:128] = struct.pack("<I", zlib.crc32(bytes(m[:124])))
    return m


def _first_batch(src, n):
    """The buffers and one skip-policy batch of the first (up to 4) of ``src``'s ``n``
    samples: whatever the bytes, clean errors only."""
    from dpu_pipe.spec import StreamSpec
    from dpu_pipe.batch import BatchMaker
    from dpu_pipe.transforms import TransformConfig

    if not n:
        return
    idx = np.arange(min(n, 4), dtype=np.int64)
    bufs, errors = src.buffers(idx)
    assert len(bufs) == len(idx) and set(errors) <= set(range(len(idx)))
    try:
        maker = BatchMaker(StreamSpec(
            src, len(idx), TransformConfig(size=8, max_pixels=MAX_PIXELS),
            shuffle=False, drop_last=False, on_error="skip"))
        images = np.empty(maker.batch_shape, np.float32)
        labels = np.empty(maker.batch_size, np.int64)
        maker.make(0, 0, images, labels)
    except DecodeError:
        pass  # no decodable sample left to replace a bad one with


def open_packed(path):
    """The reader under test: a packed dataset path → a source. Point the target at another
    reader by replacing this function."""
    from dpu_pipe.sources import PackedSource

    return PackedSource(path)


def packed(data):
    """The packed-dataset reader on a fuzzed manifest and shard: open, every record, path and
    label, the batch path that turns the index into raw pointers, and the pure parsers. The
    input is ``<u4 manifest length | fix-CRCs bit 31>``, the manifest, then shard 0; with
    the bit set the target recomputes every CRC first, so a mutated index gets past the CRC
    checks and meets the reader's other checks. No record may lie outside its shard."""
    from dpu_pipe.packed import format as fmt

    if len(data) < 4:
        return
    head = struct.unpack("<I", data[:4])[0]
    mlen, fix = head & 0x7FFFFFFF, head >> 31
    manifest, shard = bytearray(data[4:4 + mlen]), bytearray(data[4 + mlen:])
    if fix:
        shard = _fixed_shard(shard)
        crc = struct.unpack("<I", shard[124:128])[0] if len(shard) >= 128 else 0
        manifest = _fixed_manifest(manifest, crc)
    d = os.path.join(_TMP, "ds")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, fmt.MANIFEST_NAME), "wb") as f:
        f.write(manifest)
    with open(os.path.join(d, fmt.shard_name(0)), "wb") as f:
        f.write(shard)
    for parse, buf in ((fmt.parse_manifest, manifest), (fmt.parse_shard, shard)):
        try:
            parse(bytes(buf))
        except ConfigError:
            pass
    try:
        src = open_packed(d)
    except ConfigError:
        return
    n = len(src)
    assert len(src.labels) == n
    good = []
    for i in range(min(n, 64)):
        try:
            ln = len(src.read(i))
            src.relpath(i)
            src.label(i)
        except DecodeError:
            continue
        entry = src.dataset.entry(i)
        sh = src.dataset.shard(int(src.dataset.shard_of(i)))
        lo = int(entry["offset"])
        assert ln == int(entry["length"]) and 0 <= lo and lo + ln <= len(sh.buffer), \
            f"record {i} ({lo}+{ln}) outside its {len(sh.buffer)}-byte shard"
        good.append(i)
        src.describe(i)
    src.classes
    _first_batch(src, n)
    src.close()


def filelist(data):
    """FileList parsing of a fuzzed list file (paths are listed, never opened)."""
    from dpu_pipe.sources import FileList, open_source

    path = os.path.join(_TMP, "list.txt")
    with open(path, "wb") as f:
        f.write(data)
    try:
        src = FileList(path, root="/nonexistent-root")
    except ConfigError:
        return
    n = len(src)
    assert n >= 1 and len(src.labels) == n
    for i in range(n):
        p = src.relpath(i)
        assert p and p == p.strip(), repr(p)
        src.describe(i)
        # One integer label, or a row of labels (several label columns, float labels).
        assert np.array_equal(np.asarray(src.label(i)), np.asarray(src.labels[i]))
    again = open_source(src.spec())
    assert [again.relpath(i) for i in range(n)] == [src.relpath(i) for i in range(n)]
    assert np.array_equal(again.labels, src.labels)


def bufferlist(data):
    """BufferList.from_packed (the batch decoders' view of a shard) with fuzzed offsets and
    lengths over a fuzzed buffer, then a batch decode through it: a record outside the
    buffer must be refused, never read. Input: the buffer, then k (offset, length) pairs as
    <i8, then k in one byte."""
    from dpu_pipe import _jpeg

    if not data:
        return
    k = data[-1] % 5
    if len(data) < 1 + 16 * k:
        return
    pairs = np.frombuffer(data[len(data) - 1 - 16 * k:len(data) - 1], "<i8").reshape(k, 2)
    buf = _exact(data[:len(data) - 1 - 16 * k])
    offsets = np.ascontiguousarray(pairs[:, 0], dtype=np.int64)
    lengths = np.ascontiguousarray(pairs[:, 1], dtype=np.int64)
    try:
        bufs = _jpeg.BufferList.from_packed(buf, offsets, lengths)
    except ConfigError:
        assert any(o < 0 or ln < 0 or int(o) + int(ln) > len(buf)
                   for o, ln in zip(offsets, lengths)), "a record inside the buffer refused"
        return
    for o, ln in zip(offsets.tolist(), lengths.tolist()):
        assert 0 <= o and 0 <= ln and o + ln <= len(buf), f"record ({o}, {ln}) accepted"
    if k:
        jpeg.decode_batch(bufs, np.zeros((k, 64, 64, 3), np.uint8), on_error="return",
                          max_pixels=64 * 64)


def _check_source(src, path_size=None):
    """What every dataset reader owes a fuzzed input: a length matching its labels, each
    sample's bytes or a DecodeError (never another exception), a batch view of the right
    length, and a batch produced (bad samples skipped)."""
    n = len(src)
    assert len(src.labels) == n
    for i in range(min(n, 64)):
        try:
            data = src.read(i)
        except DecodeError:
            continue
        assert isinstance(data, bytes)
        if path_size is not None:
            assert len(data) <= path_size, f"sample {i}: {len(data)} bytes from a " \
                                           f"{path_size}-byte file"
        src.describe(i)
        src.metadata(i)
        src.relpath(i)
    _first_batch(src, n)


def tar(data):
    """WebDataset on a fuzzed tar shard: the header scan, the member index (written to its
    cache, then read back from it), every sample's bytes, the batch path. A record must lie
    inside the file; the cached index must give the same source as the scan."""
    from dpu_pipe.sources import WebDataset
    from dpu_pipe.sources import webdataset as wds

    path = os.path.join(_TMP, "shard.tar")
    for p in wds._index_paths(path):
        if os.path.exists(p):
            os.unlink(p)
    with open(path, "wb") as f:
        f.write(data)
    try:
        src = WebDataset(path, label_key="cls" if not data[:1] == b"j" else "json:label")
    except ConfigError:
        return
    ix = src._index[0]
    ok = ix.samples["flags"] & (wds.TRUNCATED | wds.NO_IMAGE) == 0
    ends = ix.samples["offset"] + ix.samples["size"]
    assert (ends[ok] <= len(data)).all() and (ix.samples["offset"] >= 0).all()
    for i in range(min(len(src), 64)):
        try:
            got = src.read(i)
        except DecodeError:
            continue
        o = int(ix.samples["offset"][i])
        assert got == data[o:o + len(got)]
    again = WebDataset(path, label_key=src._label_key)   # from the cache just written
    assert again.fingerprint() == src.fingerprint()
    _check_source(src, len(data))


def parquet(data):
    """ParquetSource on a fuzzed Parquet or Arrow IPC file (told apart by its magic)."""
    from dpu_pipe.sources import ParquetSource

    path = os.path.join(_TMP, "rows.parquet")
    with open(path, "wb") as f:
        f.write(data)
    try:
        src = ParquetSource(path, max_cached_groups=2)
    except ConfigError:
        return
    _check_source(src)


TARGETS = {"header": header, "decode": decode, "batch": batch, "packed": packed,
           "filelist": filelist, "bufferlist": bufferlist, "tar": tar, "parquet": parquet}
