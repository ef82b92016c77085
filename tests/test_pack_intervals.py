"""The packed format's restart-interval index (format version 3): offsets equal to the marker
scan's on real photographs, the own decoder given them equal to the scan-based decode, version-2
packs still read (scanned as before), and damaged or lying offsets refused by name or fallen
back from, never read outside the record."""

import os
import re
import shutil
import struct
import zlib

import numpy as np
import pytest

from dpu_pipe import _huffman
from dpu_pipe.errors import ConfigError, DecodeError
from dpu_pipe.packed import format as fmt
from dpu_pipe.packed.writer import pack
from dpu_pipe.sources import PackedSource
from dpu_pipe.tools.sample_data import dataset_files, make_imagenet_like
from test_packed import _varints as _decode_varints

N = 32


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    make_imagenet_like(root, n=N, classes=4, seed=5)
    return root


@pytest.fixture(scope="module")
def packed(photos, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed") / "ds"
    return pack(photos, out, progress=False, block_records=8)


def _u8(view):
    return np.frombuffer(view, np.uint8)


def _scan_reference(rec):
    """Interval offsets found with a regular expression over the entropy-coded data, apart
    from the decoder: each RSTn (in sequence) ends one interval and starts the next."""
    start = _huffman.header(rec)["scan_start"]
    data = rec.tobytes()
    offsets, k = [start], 0
    for m in re.finditer(rb"\xff+([^\x00\xff])", data[start:]):
        code = m.group(1)[0]
        if 0xD0 <= code <= 0xD7:
            assert code == 0xD0 + (k & 7)
            offsets.append(start + m.end())
            k += 1
        else:
            offsets.append(start + m.start())
            break
    return np.array(offsets, np.uint32)


def test_offsets_equal_the_marker_scan_on_every_record(packed):
    ds = packed.dataset
    assert ds.header["version"] == 3
    with_offsets = 0
    for i in range(len(ds)):
        rec = _u8(ds.record(i))
        got = ds.intervals(i)
        want = _huffman.find_intervals(rec)
        if ds.entry(i)["flags"] & fmt.TRANSCODED:
            assert want is not None, f"transcoded record {i} without restart intervals"
        assert (got is None) == (want is None), i
        if got is None:
            continue
        with_offsets += 1
        assert got.dtype == np.uint32
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, _scan_reference(rec))
        assert len(got) == _huffman.header(rec)["intervals"] + 1
    assert with_offsets == int(ds.shards["transcoded"].sum()) >= N * 3 // 4
    # What it costs: stated in docs/design/packed-format.md from this measure.
    per_record = ds.meta["interval_bytes"] / len(ds)
    assert 8 < per_record < 0.05 * ds.meta["data_bytes"] / len(ds)


def _boxes(h, rng, n):
    H, W = h["height"], h["width"]
    for _ in range(n):
        bh, bw = int(rng.integers(1, H + 1)), int(rng.integers(1, W + 1))
        yield (int(rng.integers(0, H - bh + 1)), int(rng.integers(0, W - bw + 1)), bh, bw)


def test_decoding_from_the_index_equals_decoding_after_a_scan(packed):
    """decode_box and read_coefficients given the index entry: the same pixels and
    coefficients as with the marker scan, at every scale, fast or not."""
    ds = packed.dataset
    rng = np.random.default_rng(0)
    decoded = 0
    for i in range(len(ds)):
        entry = ds.interval_entry(i)
        if entry is None:
            continue
        rec = _u8(ds.record(i))
        h = _huffman.header(rec)
        for (top, left, bh, bw), scale in zip(_boxes(h, rng, 4), (8, 4, 2, 1)):
            H, W = -(-h["height"] * scale // 8), -(-h["width"] * scale // 8)
            box = (top * scale // 8, left * scale // 8, 1, 1)
            box = box[:2] + (max(1, min(bh * scale // 8, H - box[0])),
                             max(1, min(bw * scale // 8, W - box[1])))
            fast = bool(i & 1)
            want = _huffman.decode_box(rec, box, scale, fast)
            got = _huffman.decode_box(rec, box, scale, fast, intervals=entry)
            assert (got is None) == (want is None)
            if want is not None:
                np.testing.assert_array_equal(got, want)
                decoded += 1
        my, mx = h["mcus"]
        rect = (my // 3, my // 3 + max(1, my // 2), mx // 4, mx // 4 + max(1, mx // 3))
        for a, b in zip(_huffman.read_coefficients(rec, rect, intervals=entry),
                        _huffman.read_coefficients(rec, rect)):
            np.testing.assert_array_equal(a, b)
    assert decoded >= len(ds) * 2


# -- on the Loader's path ----------------------------------------------------------------------

def _kernel_run(bufs, n, decoder, threads=1):
    """The batch kernel's (out, info, errors, intervals taken from an index) on ``bufs``."""
    from dpu_pipe.batch import BatchProcessor
    from dpu_pipe.transforms import TransformConfig

    bp = BatchProcessor(TransformConfig(size=64, jpeg_decoder=decoder), threads)
    out, info, errors = bp.run(bufs, np.arange(n), seed=3)
    return out, info, errors, bp._kernel.own_indexed


@pytest.mark.parametrize("shards", ["one", "several"])
def test_loader_batches_take_their_intervals_from_the_index(photos, packed, tmp_path, shards):
    """PackedSource.buffers hands each record's index entry to the batch kernel (the path
    of a batch inside one shard, and the per-record path of a batch across shards): with
    jpeg_decoder="own" every record's intervals come from the index, not the marker scan,
    and the batch equals libjpeg-turbo's; buffers without entries scan, as before."""
    src = packed if shards == "one" else pack(photos, tmp_path / "sharded", progress=False,
                                              shard_size=300_000)
    ds = src.dataset
    assert (ds.num_shards > 2) == (shards == "several")
    idx = np.arange(len(ds))[::-1].copy()
    with_entries = sum(ds.interval_entry(int(i)) is not None for i in idx)
    assert with_entries == len(ds)
    bufs, errors = src.buffers(idx)
    assert not errors
    want, want_info, want_err, _ = _kernel_run([src.read(int(i)) for i in idx], len(idx),
                                               "libjpeg")
    for threads in (1, 2):
        bufs, _ = src.buffers(idx)
        got, info, err, indexed = _kernel_run(bufs, len(idx), "own", threads)
        assert not err and not want_err
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(info, want_info)
        assert indexed == with_entries
    *_, indexed = _kernel_run([src.read(int(i)) for i in idx], len(idx), "own")
    assert indexed == 0


def test_lying_entries_in_a_batch_change_nothing(packed, record):
    """Entries attached to a batch's buffers that do not describe them (every kind of lie,
    and another record's entry) fail the decoder's check and the marker scan runs: the same
    pixels, and only the true entry counts as taken from the index."""
    from dpu_pipe import _jpeg

    ds = packed.dataset
    lies = list(_damaged(record).values())
    other = bytes(ds.interval_entry(0)) if bytes(ds.interval_entry(0)) != \
        _varints(_values(record)) else bytes(ds.interval_entry(1))
    entries = lies + [other, _varints(_values(record)), None]
    records = [record.tobytes()] * len(entries)
    want, want_info, _, _ = _kernel_run(records, len(records), "libjpeg")
    bufs = _jpeg.BufferList.from_buffers(records)
    bufs.attach_intervals(entries)
    got, info, errors, indexed = _kernel_run(bufs, len(records), "own")
    assert not errors
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(info, want_info)
    assert indexed == 1


def test_attached_entries_are_checked_against_the_buffers():
    from dpu_pipe import _jpeg

    bufs = _jpeg.BufferList.from_buffers([b"ab", b"cd"])
    with pytest.raises(ConfigError, match="3 interval entries for 2 buffers"):
        bufs.attach_intervals([b"", None, b"x"])
    data = np.zeros(10, np.uint8)
    with pytest.raises(ConfigError, match="interval entry 1 .* outside the 10-byte buffer"):
        bufs.attach_packed_intervals(data, np.array([0, 8], np.int64),
                                     np.array([2, 3], np.int64))
    with pytest.raises(ConfigError, match="for 2 buffers"):
        bufs.attach_packed_intervals(data, np.array([0], np.int64), np.array([2], np.int64))


# -- version 2 -------------------------------------------------------------------------------

def _downgrade_to_v2(path):
    """Rewrite a version-3 packed dataset in place as version 2 wrote it: no interval index,
    version 2 headers, block CRCs over entries and paths only."""
    mpath = os.path.join(path, fmt.MANIFEST_NAME)
    manifest = bytearray(open(mpath, "rb").read())
    mh = fmt.parse_manifest_header(manifest[:128], len(manifest), "manifest")
    table = np.frombuffer(manifest, fmt.SHARD_ENTRY, count=mh["num_shards"],
                          offset=mh["shards_offset"]).copy()
    for k in range(len(table)):
        spath = os.path.join(path, fmt.shard_name(k))
        raw = bytearray(open(spath, "rb").read())
        h = fmt.parse_shard_header(raw[:128], len(raw), "shard")
        n, b = h["count"], h["block_records"]
        recs = np.frombuffer(raw, fmt.RECORD, count=n, offset=h["index_offset"])
        paths = bytes(raw[h["paths_offset"]:h["paths_offset"] + h["paths_size"]])
        blocks = np.empty(h["nblocks"], "<u4")
        lo = 0
        for j in range(h["nblocks"]):
            block = recs[j * b:(j + 1) * b]
            hi = int(block["path_end"][-1])
            blocks[j] = fmt.block_crc(block.tobytes(), paths[lo:hi])
            lo = hi
        raw = raw[:h["paths_offset"] + h["paths_size"]]
        raw[h["blocks_offset"]:h["paths_offset"]] = blocks.tobytes()
        fields = {name: h[name] for name in fmt.SHARD_HEADER.names
                  if name not in ("magic", "version", "header_size", "header_crc32")}
        fields.update(file_size=len(raw), blocks_crc32=zlib.crc32(blocks),
                      intervals_offset=0, intervals_size=0)
        head = bytearray(fmt.encode_header(fmt.SHARD_HEADER, **fields))
        head[8:12] = struct.pack("<I", 2)
        head[124:128] = struct.pack("<I", zlib.crc32(head[:124]))
        raw[:128] = head
        open(spath, "wb").write(raw)
        table[k]["file_size"] = len(raw)
        table[k]["header_crc32"] = struct.unpack("<I", head[124:128])[0]
    so = mh["shards_offset"]
    manifest[so:so + table.nbytes] = table.tobytes()
    manifest[8:12] = struct.pack("<I", 2)
    _put(manifest, fmt.MANIFEST_HEADER, "shards_crc32", zlib.crc32(table.tobytes()))
    manifest[124:128] = struct.pack("<I", zlib.crc32(manifest[:124]))
    open(mpath, "wb").write(manifest)


def test_version_2_pack_reads_without_an_index(packed, tmp_path):
    old = tmp_path / "v2"
    shutil.copytree(packed.path, old)
    _downgrade_to_v2(old)
    src = PackedSource(old)
    ds = src.dataset
    assert ds.header["version"] == 2 and ds.shard(0).header["version"] == 2
    assert not ds.shard(0).has_intervals
    assert ds.check() == {}
    for i in range(len(ds)):
        assert ds.record(i) == packed.dataset.record(i)
        assert src.relpath(i) == packed.relpath(i) and src.label(i) == packed.label(i)
        assert ds.interval_entry(i) is None and ds.intervals(i) is None
    # The shards' interval ends and entries are the only difference.
    v3 = packed.dataset.shard(0).header
    assert ds.shard(0).header["file_size"] == v3["paths_offset"] + v3["paths_size"]


# -- damaged and lying indexes -----------------------------------------------------------------

def _varints(values):
    return fmt.encode_intervals(np.cumsum(values))


def _values(rec):
    return np.diff(_huffman.find_intervals(rec).astype(np.int64), prepend=0)


def _put(buf, dtype, field, value):
    """Write ``value`` into the header field ``field`` of ``dtype`` at the start of ``buf``."""
    ft, off = dtype.fields[field][:2]
    buf[off:off + ft.itemsize] = np.array(value, ft).tobytes()


@pytest.fixture(scope="module")
def record(packed):
    ds = packed.dataset
    i = next(i for i in range(len(ds)) if ds.interval_entry(i) is not None
             and len(ds.intervals(i)) > 20)
    return _u8(ds.record(i)).copy()


def _damaged(rec):
    v = _values(rec)
    rng = np.random.default_rng(3)
    shuffled = v.copy()
    shuffled[1:-1] = rng.permutation(v[1:-1])
    off_by_one = v.copy()
    off_by_one[5] += 1
    off_by_one[6] -= 1
    past_end = v.copy()
    past_end[-1] += 10
    first = v.copy()
    first[0] += 1
    zero = v.copy()
    zero[3:5] = (v[3] + v[4], 0)
    entry = fmt.encode_intervals(np.cumsum(v))
    return {
        "shuffled": _varints(shuffled),
        "off-by-one": _varints(off_by_one),
        "past-the-record": _varints(past_end),
        "first-start": _varints(first),
        "empty-interval": fmt.encode_intervals(np.cumsum(zero)),
        "one-short": _varints(v[:-1]),
        "one-more": _varints(np.append(v, 3)),
        "truncated-varint": entry[:-1] + bytes([entry[-1] | 0x80]),
        "huge-value": entry[:4] + b"\xff\xff\xff\xff\x7f" + entry[4:],
        "empty": b"",
    }


@pytest.mark.parametrize("damage", ["shuffled", "off-by-one", "past-the-record",
                                    "first-start", "empty-interval", "one-short", "one-more",
                                    "truncated-varint", "huge-value", "empty"])
def test_lying_entry_is_refused_or_falls_back(record, damage):
    """The decoder checks an entry before it reads at any offset: interval_offsets raises,
    decode_box answers None (its caller's libjpeg-turbo path then decodes), never a read
    outside the record (the sanitizer build runs these too)."""
    bad = _damaged(record)[damage]
    if damage == "shuffled" and _varints(_values(record)) == bad:
        pytest.skip("equal interval sizes: a shuffle changes nothing")
    with pytest.raises(DecodeError, match="interval index"):
        _huffman.interval_offsets(record, bad)
    h = _huffman.header(record)
    box = (0, 0, h["height"], h["width"])
    assert _huffman.decode_box(record, box, 8, False, intervals=bad) is None
    with pytest.raises(DecodeError, match="interval index"):
        _huffman.read_coefficients(record, intervals=bad)


def test_entry_of_a_record_without_markers_falls_back(photos):
    paths, _ = dataset_files(photos)
    data = next(d for d in (p.read_bytes() for p in paths)
                if _huffman.header(_u8(d)) is not None
                and not _huffman.header(_u8(d))["restart_interval"])
    rec = _u8(data)
    h = _huffman.header(rec)
    entry = fmt.encode_intervals([h["scan_start"], len(data) - 2])
    assert _huffman.decode_box(rec, (0, 0, 8, 8), 8, False, intervals=entry) is None
    with pytest.raises(DecodeError):
        _huffman.interval_offsets(rec, entry)


def _rewrite_entry(path, j, entry, fix_crc):
    """Replace record j's interval entry in shard 0 of ``path``; with ``fix_crc`` the block,
    block-table and header CRCs (and the manifest's copy) are recomputed, as a crafted file
    would have them."""
    spath = os.path.join(path, fmt.shard_name(0))
    raw = bytearray(open(spath, "rb").read())
    h = fmt.parse_shard_header(raw[:128], len(raw), "shard")
    n, b, io = h["count"], h["block_records"], h["intervals_offset"]
    ends = np.frombuffer(raw, "<u8", count=n, offset=io).astype(np.int64)
    entries = bytes(raw[io + 8 * n:])
    lo = int(ends[j - 1]) if j else 0
    grow = len(entry) - (int(ends[j]) - lo)
    entries = entries[:lo] + entry + entries[int(ends[j]):]
    ends[j:] += grow
    raw = raw[:io] + ends.astype("<u8").tobytes() + entries
    if fix_crc:
        recs = np.frombuffer(raw, fmt.RECORD, count=n, offset=h["index_offset"])
        paths = bytes(raw[h["paths_offset"]:h["paths_offset"] + h["paths_size"]])
        blocks = np.frombuffer(raw, "<u4", count=h["nblocks"], offset=h["blocks_offset"]).copy()
        v3ends, ventries = fmt.interval_parts(raw, dict(h, intervals_size=len(raw) - io))
        k = j // b
        block = recs[k * b:(k + 1) * b]
        plo = int(recs["path_end"][k * b - 1]) if k else 0
        parts = fmt.block_interval_parts(v3ends, ventries, k * b, len(block), "shard")
        blocks[k] = fmt.block_crc(block.tobytes(), paths[plo:int(block["path_end"][-1])],
                                  parts)
        raw[h["blocks_offset"]:h["paths_offset"]] = blocks.tobytes()
        _put(raw, fmt.SHARD_HEADER, "blocks_crc32", zlib.crc32(blocks.tobytes()))
    _put(raw, fmt.SHARD_HEADER, "file_size", len(raw))
    _put(raw, fmt.SHARD_HEADER, "intervals_size", len(raw) - io)
    raw[124:128] = struct.pack("<I", zlib.crc32(raw[:124]))
    open(spath, "wb").write(raw)
    mpath = os.path.join(path, fmt.MANIFEST_NAME)
    m = bytearray(open(mpath, "rb").read())
    so = struct.unpack_from("<Q", m, 32)[0]
    m[so + 16:so + 24] = struct.pack("<Q", len(raw))
    m[so + 48:so + 52] = raw[124:128]
    _put(m, fmt.MANIFEST_HEADER, "shards_crc32", zlib.crc32(m[so:so + 64]))
    m[124:128] = struct.pack("<I", zlib.crc32(m[:124]))
    open(mpath, "wb").write(m)


def test_crafted_entry_with_valid_crcs_names_the_record(packed, tmp_path):
    """An index entry that lies with every CRC recomputed gets past the CRC chain and
    meets the decoder's checks: DecodeError naming the record; the other records of its
    block still read."""
    copy = tmp_path / "crafted"
    shutil.copytree(packed.path, copy)
    ds0 = packed.dataset
    j = next(i for i in range(len(ds0)) if ds0.interval_entry(i) is not None)
    bad = _damaged(_u8(ds0.record(j)))["shuffled"]
    _rewrite_entry(copy, j, bad, fix_crc=True)
    ds = PackedSource(copy).dataset
    with pytest.raises(DecodeError, match="interval index") as exc:
        ds.intervals(j)
    assert exc.value.index == j and f"record {j}" in str(exc.value)
    assert bytes(ds.interval_entry(j)) == bad
    for i in range(len(ds)):
        if i != j and ds.interval_entry(i) is not None:
            np.testing.assert_array_equal(ds.intervals(i), ds0.intervals(i))


def test_damaged_entry_fails_the_block_crc(packed, tmp_path):
    copy = tmp_path / "damaged"
    shutil.copytree(packed.path, copy)
    ds0 = packed.dataset
    j = next(i for i in range(len(ds0)) if ds0.interval_entry(i) is not None)
    _rewrite_entry(copy, j, bytes(ds0.interval_entry(j))[:-1] + b"\x01", fix_crc=False)
    ds = PackedSource(copy).dataset
    with pytest.raises(DecodeError, match="CRC mismatch") as exc:
        ds.intervals(j)
    assert exc.value.index == j


@pytest.mark.parametrize("where", ["end-past-entries", "ends-decreasing"])
def test_lying_interval_ends_name_the_record(packed, tmp_path, where):
    copy = tmp_path / where
    shutil.copytree(packed.path, copy)
    spath = copy / fmt.shard_name(0)
    raw = bytearray(spath.read_bytes())
    h = fmt.parse_shard_header(raw[:128], len(raw), "shard")
    io, n = h["intervals_offset"], h["count"]
    ends = np.frombuffer(raw, "<u8", count=n, offset=io).copy()
    j = 3
    if where == "end-past-entries":
        ends[j] = h["intervals_size"]
    else:
        ends[j] = ends[j - 1] - 1 if ends[j - 1] else 1
        ends[j - 1] = max(ends[j - 1], 2)
    raw[io:io + 8 * n] = ends.tobytes()
    spath.write_bytes(raw)
    ds = PackedSource(copy).dataset
    with pytest.raises(DecodeError, match="interval index entry of record") as exc:
        ds.intervals(j)
    assert exc.value.index == j


def test_truncated_interval_index_is_refused(packed, tmp_path):
    """A shard whose interval index is cut short (sizes no longer add up): the shard is
    refused when opened, its records' reads name it."""
    copy = tmp_path / "cut"
    shutil.copytree(packed.path, copy)
    spath = copy / fmt.shard_name(0)
    raw = spath.read_bytes()
    with pytest.raises(ConfigError, match="truncated"):
        fmt.parse_shard(raw[:-5])
    h = fmt.parse_shard_header(raw[:128], len(raw), "shard")
    head = bytearray(raw[:128])
    _put(head, fmt.SHARD_HEADER, "intervals_size", 8 * h["count"] - 8)
    _put(head, fmt.SHARD_HEADER, "file_size", h["intervals_offset"] + 8 * h["count"] - 8)
    head[124:128] = struct.pack("<I", zlib.crc32(head[:124]))
    with pytest.raises(ConfigError, match="inconsistent part sizes"):
        fmt.parse_shard_header(bytes(head), h["intervals_offset"] + 8 * h["count"] - 8,
                               "shard")
    spath.write_bytes(raw[:-5])
    ds = PackedSource(copy).dataset
    with pytest.raises(DecodeError, match="shard 0") as exc:
        ds.intervals(0)
    assert exc.value.index == 0


def test_encode_intervals_round_trip():
    rng = np.random.default_rng(1)
    for _ in range(50):
        sizes = rng.integers(0, 2**int(rng.integers(1, 32)), size=int(rng.integers(2, 40)))
        offsets = np.cumsum(sizes).astype(np.int64)
        offsets = offsets[offsets < 2**32]
        if len(offsets) < 2:
            continue
        values = _decode_varints(fmt.encode_intervals(offsets))
        assert np.cumsum(values).tolist() == offsets.tolist()
    assert fmt.encode_intervals(None) == b""
    for bad in ([5], [3, 2], [0, 2**32]):
        with pytest.raises(ValueError):
            fmt.encode_intervals(bad)
