"""Packed datasets of earlier format versions still read: version 3 (its restart-interval index
checked by its block CRCs, otherwise ignored) and version 2; new packs are version 4, without
the index.

tests/data/packed_v3 was written by ``pack(ImageFolder(root), out, shard_size=3000,
block_records=2, threads=1)`` of dpu_pipe 830fc96 (the last writer of version 3) from 7 small
files: JPEGs in three subsamplings (one progressive, one greyscale) transcoded with a restart
marker every MCU, a PNG, and bytes that are no image (flagged unreadable). Its three shards
hold 4, 2 and 1 records; the index entries of the PNG and the unreadable record are empty.
"""

import os
import shutil
import struct
import zlib

import numpy as np
import pytest

from dpu_pipe import jpeg
from dpu_pipe.errors import ConfigError, DecodeError
from dpu_pipe.loader import Loader
from dpu_pipe.packed import format as fmt
from dpu_pipe.packed.writer import pack
from dpu_pipe.sources import PackedSource

import jpeg_corpus as jc

pytestmark = pytest.mark.timeout(120)

V3 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "packed_v3")
PATHS = ["c0/img0.jpg", "c0/img2.jpg", "c0/img4.jpg", "c0/img6.jpg", "c1/img1.jpg",
         "c1/img3.jpg", "c1/img5.png"]
UNREADABLE = 3


@pytest.fixture
def v3(tmp_path):
    """A writable copy of the version-3 fixture."""
    out = tmp_path / "v3"
    shutil.copytree(V3, out)
    return out


def _stream(path):
    kw = dict(train=True, size=16, seed=4, num_threads=1, on_error="skip")
    with Loader(path, 3, **kw) as ld:
        return [(x.copy(), y.copy()) for x, y in ld]


def test_version_3_pack_reads_as_written(tmp_path):
    src = PackedSource(V3)
    ds = src.dataset
    assert ds.header["version"] == 3 and ds.num_shards == 3
    sh = ds.shard(0)
    assert sh.header["version"] == 3 and sh.header["intervals_size"] > 8 * len(sh)
    assert ds.meta["interval_bytes"] > 0
    assert ds.check() == {}
    assert [src.relpath(i) for i in range(len(src))] == PATHS
    assert [src.label(i) for i in range(len(src))] == [0, 0, 0, 0, 1, 1, 1]
    for i in range(len(src)):
        rec = bytes(src.read(i))
        flags = int(ds.entry(i)["flags"])
        if i == UNREADABLE:
            assert flags == fmt.UNREADABLE
            with pytest.raises(DecodeError):
                jpeg.decode(rec)
        elif PATHS[i].endswith(".jpg"):
            assert flags == fmt.TRANSCODED
            np.testing.assert_array_equal(jpeg.decode(rec), jc.pil_decode(rec))
    # Repacked, its records are version 4's, byte for byte, and the stream is the same.
    new = pack(src, tmp_path / "v4", transcode=False, progress=False, block_records=2,
               shard_size=3000).dataset
    assert new.header["version"] == 4 and "interval_bytes" not in new.meta
    for k in range(new.num_shards):
        h = new.shard(k).header
        assert h["version"] == 4 and h["intervals_offset"] == h["intervals_size"] == 0
        assert h["paths_offset"] + h["paths_size"] == h["file_size"]
        assert h["file_size"] < ds.shard(k).header["file_size"]
    assert [bytes(new.record(i)) for i in range(len(new))] == \
        [bytes(ds.record(i)) for i in range(len(ds))]
    a, b = _stream(V3), _stream(new.path)
    assert len(a) == len(b) == 3
    for (xa, ya), (xb, yb) in zip(a, b):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)


def test_version_3_index_stays_covered_by_its_block_crc(v3):
    """A flipped byte in a version-3 shard's interval entries fails the CRC of the block
    whose entry holds it, though nothing reads the entry; the other block still reads."""
    spath = v3 / fmt.shard_name(0)
    raw = bytearray(spath.read_bytes())
    h = fmt.parse_shard_header(raw[:128], len(raw), "shard")
    ends = np.frombuffer(raw, "<u8", count=h["count"], offset=h["intervals_offset"])
    # Records 0..3 of shard 0: blocks of 2; record 3's entry is empty, record 2's is last.
    assert ends[1] < ends[2] == ends[3]
    raw[-1] ^= 0x40
    spath.write_bytes(raw)
    src = PackedSource(v3)
    src.read(0)
    with pytest.raises(DecodeError, match="index block 1 .*CRC mismatch") as exc:
        src.read(2)
    assert exc.value.index == 2
    bufs, errors = src.dataset.buffers(np.arange(7, dtype=np.int64))
    assert len(bufs) == 7 and sorted(errors) == [2, 3]


def test_version_3_lying_interval_ends_name_the_record(v3):
    spath = v3 / fmt.shard_name(0)
    raw = bytearray(spath.read_bytes())
    h = fmt.parse_shard_header(raw[:128], len(raw), "shard")
    io = h["intervals_offset"]
    raw[io + 8:io + 16] = struct.pack("<Q", h["intervals_size"])   # record 1: past the entries
    spath.write_bytes(raw)
    with pytest.raises(ConfigError, match="interval index entry of record 1 is invalid"):
        fmt.parse_shard(bytes(raw))
    with pytest.raises(DecodeError, match="interval index entry of record 1") as exc:
        PackedSource(v3).read(1)
    assert exc.value.index == 1


def test_version_3_index_cut_short_is_refused(v3):
    raw = (v3 / fmt.shard_name(0)).read_bytes()
    h = fmt.parse_shard_header(raw[:128], len(raw), "shard")
    with pytest.raises(ConfigError, match="truncated"):
        fmt.parse_shard(raw[:-5])
    # Sizes that no longer reach the ends table's 8 bytes per record, the CRC redone.
    size = h["intervals_offset"] + 8 * h["count"] - 8
    head = _rehead(raw[:128], fmt.SHARD_HEADER, intervals_size=8 * h["count"] - 8,
                   file_size=size)
    with pytest.raises(ConfigError, match="inconsistent part sizes"):
        fmt.parse_shard_header(head, size, "shard")


def _rehead(raw, dtype, **fields):
    """``raw`` with header fields changed and the header CRC redone, as another writer's."""
    h = np.frombuffer(bytes(raw[:128]), dtype).copy()
    for k, v in fields.items():
        h[0][k] = v
    head = bytearray(h.tobytes())
    head[124:] = zlib.crc32(head[:124]).to_bytes(4, "little")
    return bytes(head) + bytes(raw[128:])


def _as_version(path, version):
    """Rewrite a version-4 pack in place with another version number in every header (the
    shard table's header CRCs and every CRC above them redone): version 2 is version 4
    without RESIZED records."""
    mpath = os.path.join(path, fmt.MANIFEST_NAME)
    manifest = bytearray(open(mpath, "rb").read())
    mh = fmt.parse_manifest_header(manifest[:128], len(manifest), "manifest")
    table = np.frombuffer(manifest, fmt.SHARD_ENTRY, count=mh["num_shards"],
                          offset=mh["shards_offset"]).copy()
    for k in range(len(table)):
        spath = os.path.join(path, fmt.shard_name(k))
        raw = _rehead(open(spath, "rb").read(), fmt.SHARD_HEADER, version=version)
        open(spath, "wb").write(raw)
        table[k]["header_crc32"] = struct.unpack("<I", raw[124:128])[0]
    so = mh["shards_offset"]
    manifest[so:so + table.nbytes] = table.tobytes()
    open(mpath, "wb").write(_rehead(manifest, fmt.MANIFEST_HEADER, version=version,
                                    shards_crc32=zlib.crc32(table.tobytes())))


def test_version_2_pack_reads(tmp_path):
    new = pack(PackedSource(V3), tmp_path / "v4", transcode=False, progress=False,
               block_records=2).dataset
    old = tmp_path / "v2"
    shutil.copytree(new.path, old)
    _as_version(old, 2)
    ds = PackedSource(old).dataset
    assert ds.header["version"] == 2 and ds.shard(0).header["version"] == 2
    assert ds.check() == {}
    assert [bytes(ds.record(i)) for i in range(len(ds))] == \
        [bytes(new.record(i)) for i in range(len(new))]
    # A version-2 header cannot claim an interval index.
    raw = (old / fmt.shard_name(0)).read_bytes()
    h = fmt.parse_shard_header(raw[:128], len(raw), "shard")
    head = _rehead(raw[:128], fmt.SHARD_HEADER, intervals_offset=h["paths_offset"],
                   intervals_size=8 * h["count"])
    with pytest.raises(ConfigError, match="inconsistent part sizes"):
        fmt.parse_shard_header(head, len(raw), "shard")
