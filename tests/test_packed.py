"""Packed datasets: sharded round trip, the documented layout, lazy index loading, damaged and
lying shards and manifests, header validation, umask, replacement, and the import layering."""

import ast
import io
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from PIL import Image

import dpu_pipe
from dpu_pipe import pack
from dpu_pipe.errors import ConfigError, DecodeError, DpuPipeError
from dpu_pipe.loader import Loader
from dpu_pipe.packed import format as fmt
from dpu_pipe.packed import writer as writer_mod
from dpu_pipe.packed.reader import PackedShard
from dpu_pipe.sources import (FileList, ImageFolder, PackedSource, as_source, open_path,
                              open_source)

import jpeg_corpus as jc
from helpers import TinySource, repo_env

pytestmark = pytest.mark.timeout(120)

PKG = os.path.dirname(os.path.abspath(dpu_pipe.__file__))
N = 18


def _image(i):
    """Sample i: a photo at its own size and subsampling; every 5th progressive, every 7th
    greyscale, so the set covers what a transcoder must keep pixel-exact."""
    name = jc.PHOTOS[i % 3]
    h, w = 33 + (i * 37) % 70, 41 + (i * 53) % 70
    mode = "L" if i % 7 == 3 else None
    return jc.pil_jpeg(jc.photo_sized(name, h, w), quality=85 + i % 10,
                       subsampling=("420", "444", "422")[i % 3], progressive=i % 5 == 2,
                       mode=mode)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """ImageFolder of N samples in 3 classes."""
    root = tmp_path_factory.mktemp("packed") / "folder"
    for i in range(N):
        jc.write_file(str(root / f"c{i % 3}" / f"img{i:03d}.jpg"), _image(i))
    return ImageFolder(root)


def _pack(src, out, **kw):
    return pack(src, out, **{"progress": False, "transcode": False, **kw})


@pytest.fixture(scope="module")
def sharded(folder, tmp_path_factory):
    """The folder packed into shards of ~8 kB (several records each, some alone)."""
    out = tmp_path_factory.mktemp("sharded") / "ds"
    return _pack(folder, out, shard_size=8000)


@pytest.fixture(scope="module")
def transcoded(folder, tmp_path_factory):
    """The folder packed with transcoding (restart every MCU) into shards of ~8 kB."""
    out = tmp_path_factory.mktemp("transcoded") / "ds"
    return _pack(folder, out, shard_size=8000, transcode=True)


def shard_records(path):
    """RECORD entries of a shard, parsed from its bytes."""
    return fmt.parse_shard(open(path, "rb").read())[1]


# -- round trip -------------------------------------------------------------------------

@pytest.mark.parametrize("shard_size, alignment", [(1, 1), (8000, 64), ("1GiB", 4096)],
                         ids=["one-per-shard", "8kB", "1GiB"])
def test_sharded_round_trip(folder, tmp_path, shard_size, alignment):
    out = tmp_path / "ds"
    packed = _pack(folder, out, shard_size=shard_size, alignment=alignment)
    assert isinstance(packed, PackedSource)
    jc.assert_same_samples(folder, packed)
    ds = packed.dataset
    want_shards = {1: N, 8000: None, "1GiB": 1}[shard_size]
    if want_shards is not None:
        assert ds.num_shards == want_shards
    else:
        assert 2 < ds.num_shards < N
        sizes = ds.shards["file_size"].astype(np.int64)
        single = ds.shards["count"] == 1
        assert np.all(sizes[~single] <= 8000)  # only a record alone may exceed the target
    assert sorted(os.listdir(out)) == ["manifest.dpk"] + [fmt.shard_name(k)
                                                          for k in range(ds.num_shards)]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary left
    for k in range(ds.num_shards):
        recs = shard_records(out / fmt.shard_name(k))
        assert np.all(recs["offset"] % alignment == 0)
        assert np.all(recs["flags"] == 0) and np.all(recs["format"] == 1)
        assert np.array_equal(recs["orig_length"], recs["length"])
    reopened = PackedSource(out / "manifest.dpk")  # the manifest opens it too
    jc.assert_same_samples(folder, reopened)
    assert reopened.describe(3) == (f"packed dataset {out}, shard {int(ds.shard_of(3))}, "
                                    f"record 3 ({folder.relpath(3)})")
    assert ds.meta["formats"] == {"jpeg": N} and ds.meta["unreadable"] == 0
    assert ds.meta["data_bytes"] == ds.meta["orig_bytes"] == \
        sum(len(folder.read(i)) for i in range(N))
    reopened.verify()


def test_file_list_and_repack(folder, tmp_path):
    rows = FileList([(folder.describe(i), i * 11 - 3) for i in range(N)])
    first = _pack(rows, tmp_path / "a", shard_size=20000)
    jc.assert_same_samples(rows, first)
    second = _pack(first, tmp_path / "b", shard_size=5000)  # a packed source packs too
    jc.assert_same_samples(rows, second)
    assert first.dataset.num_shards != second.dataset.num_shards


@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
@pytest.mark.parametrize("which", ["sharded", "transcoded"])
def test_loader_stream_equals_the_original_files(folder, request, which, train):
    """A sharded dataset (batches spanning shards), its records transcoded or not, yields
    the original files' stream bit for bit."""
    packed = request.getfixturevalue(which)
    assert packed.dataset.num_shards > 3
    kw = dict(train=train, size=24, dtype="float32", seed=3, num_threads=2)
    with Loader(folder, 5, **kw) as a, Loader(packed, 5, **kw) as b:
        for _ in range(2):
            ea = [(x.copy(), y.copy()) for x, y in a]
            eb = [(x.copy(), y.copy()) for x, y in b]
            assert len(ea) == len(eb) == -(-len(folder) // 5)   # the last batch kept, shorter
            for (xa, ya), (xb, yb) in zip(ea, eb):
                assert np.array_equal(xa, xb) and np.array_equal(ya, yb)


def test_transcoded_records(folder, transcoded):
    """Every JPEG rewritten to baseline with a restart marker per MCU, decoding to the
    original's pixels; flags and original sizes recorded; sizes summed in the manifest."""
    ds = transcoded.dataset
    for i in range(N):
        orig, rec = folder.read(i), transcoded.read(i)
        e = ds.entry(i)
        assert (int(e["flags"]), int(e["format"])) == (fmt.TRANSCODED, 1)
        assert (int(e["orig_length"]), int(e["length"])) == (len(orig), len(rec))
        sofs = [m for m, *_ in jc.segments(rec) if m in jc.SOF_MARKERS]
        assert sofs in ([0xC0], [0xC1]), i  # baseline Huffman, the progressive ones too
        dri = jc.find_segment(rec, jc.DRI)
        assert dri and struct.unpack(">H", rec[dri[0] + 4:dri[0] + 6])[0] == 1
        assert np.array_equal(dpu_pipe.jpeg.decode(rec), dpu_pipe.jpeg.decode(orig)), i
    assert int(ds.shards["transcoded"].sum()) == N
    meta = ds.meta
    assert meta["transcode"] == {"restart_interval": 1, "optimize": True}
    assert meta["orig_bytes"] == sum(len(folder.read(i)) for i in range(N))
    assert meta["data_bytes"] == sum(len(transcoded.read(i)) for i in range(N))
    transcoded.verify()


def test_spec_and_pickle_reopen_lazily(sharded):
    import pickle
    again = open_source(json.loads(json.dumps(sharded.spec())))
    jc.assert_same_samples(sharded, again)
    blob = pickle.dumps(sharded)
    assert len(blob) < 1000
    jc.assert_same_samples(sharded, pickle.loads(blob))


def test_open_path_recognises_packed_datasets(sharded, folder, tmp_path):
    assert isinstance(open_path(sharded.path), PackedSource)
    assert isinstance(open_path(os.path.join(sharded.path, "manifest.dpk")), PackedSource)
    assert isinstance(open_path(folder.root), ImageFolder)
    for path in (sharded.path, os.path.join(sharded.path, "manifest.dpk")):
        assert isinstance(as_source(path), PackedSource)
    with pytest.raises(ConfigError, match="root= applies to file lists"):
        open_path(sharded.path, root=tmp_path)


def test_max_open_shards_bounds_the_mappings(sharded):
    src = PackedSource(sharded.path, max_open_shards=2)
    order = list(range(N))[::-1] + list(range(N))
    assert [src.read(i) for i in order] == [sharded.read(i) for i in order]
    assert len(src.dataset._open) == 2


def test_a_shard_verifies_on_its_own(sharded, tmp_path):
    lone = tmp_path / "lone.dpks"
    shutil.copy(os.path.join(sharded.path, fmt.shard_name(1)), lone)
    sh = PackedShard(lone)
    sh.verify()
    first = int(sh.header["first"])
    assert [bytes(sh.record(j)) for j in range(len(sh))] == \
        [sharded.read(first + j) for j in range(len(sh))]
    with pytest.raises(ConfigError, match="is a shard of a packed dataset, not a manifest"):
        PackedSource(lone)
    with pytest.raises(ConfigError, match="open the dataset's directory"):
        open_path(lone)


def test_progress_bar(folder, tmp_path, capsys):
    _pack(folder, tmp_path / "ds", progress=True)
    err = capsys.readouterr().err
    assert "packing ds" in err and f"{N}.0/{N}.0" in err and "100%" in err
    _pack(folder, tmp_path / "ds", progress=False)
    assert capsys.readouterr().err == ""


# -- the documented layout --------------------------------------------------------------

def test_layout_matches_documented_format(sharded, folder):
    """Parse manifest and shards with struct and the documented offsets alone, as a reader in
    another language would."""
    raw = open(os.path.join(sharded.path, "manifest.dpk"), "rb").read()
    (magic, version, hsize, count, nshards, shards_off, labels_off, meta_off, meta_size,
     file_size, shards_crc, meta_crc) = struct.unpack_from("<8sIIQQQQQQQII", raw, 0)
    assert (magic, version, hsize, count) == (b"DPUPACK\0", 4, 128, N)
    assert raw[80:124] == bytes(44) and struct.unpack_from("<I", raw, 124)[0] == \
        zlib.crc32(raw[:124])
    assert len(raw) == file_size == meta_off + meta_size
    table = raw[shards_off:shards_off + 64 * nshards]
    assert zlib.crc32(table) == shards_crc
    labels = struct.unpack_from(f"<{N}q", raw, labels_off)
    assert list(labels) == folder.labels.tolist()
    meta = json.loads(raw[meta_off:].decode("utf-8"))
    assert zlib.crc32(raw[meta_off:]) == meta_crc and meta["classes"] == folder.classes
    i = 0
    for k in range(nshards):
        first, n, fsize, data_bytes, orig_bytes, transcoded, hcrc = struct.unpack_from(
            "<QQQQQQI", table, 64 * k)
        assert first == i
        sh = open(os.path.join(sharded.path, f"shard-{k:06d}.dpks"), "rb").read()
        (smagic, sver, shsize, number, sfirst, scount, data_off, data_size, index_off,
         blocks_off, paths_off, paths_size, sfsize, block_records, alignment,
         blocks_crc, iv_off, iv_size) = struct.unpack_from("<8sIIQQQQQQQQQQIIIQQ", sh, 0)
        assert (smagic, sver, number, sfirst, scount) == (b"DPUSHRD\0", 4, k, first, n)
        assert (iv_off, iv_size) == (0, 0) and paths_off + paths_size == sfsize
        assert len(sh) == fsize == sfsize and struct.unpack_from("<I", sh, 124)[0] == hcrc \
            == zlib.crc32(sh[:124])
        nblocks = -(-n // block_records)
        blocks = struct.unpack_from(f"<{nblocks}I", sh, blocks_off)
        assert zlib.crc32(sh[blocks_off:paths_off]) == blocks_crc
        paths = sh[paths_off:paths_off + paths_size]
        prev_end, total = 0, 0
        for j in range(n):
            off, ln, label, orig, path_end, crc, flags, code = struct.unpack_from(
                "<QQqQQIBB", sh, index_off + 48 * j)
            rec = sh[off:off + ln]
            assert data_off <= off and off + ln <= data_off + data_size
            assert rec == folder.read(i) and crc == zlib.crc32(rec)
            assert label == folder.label(i) and (orig, flags, code) == (ln, 0, 1)
            assert paths[prev_end:path_end].decode("utf-8") == folder.relpath(i)
            prev_end, total, i = path_end, total + ln, i + 1
        assert data_bytes == orig_bytes == total and transcoded == 0
        for b in range(nblocks):
            lo = struct.unpack_from("<Q", sh, index_off + 48 * (b * block_records - 1) + 32)[0] \
                if b else 0
            hi_j = min((b + 1) * block_records, n) - 1
            hi = struct.unpack_from("<Q", sh, index_off + 48 * hi_j + 32)[0]
            entries = sh[index_off + 48 * b * block_records:index_off + 48 * (hi_j + 1)]
            assert zlib.crc32(paths[lo:hi], zlib.crc32(entries)) == blocks[b]
    assert i == N


# -- damaged, missing, foreign and lying data -------------------------------------------

def flip_byte(path, pos):
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def copy(sharded, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(sharded.path, out)
    return out


def _first_last(ds, k):
    first = int(ds.shards["first"][k])
    return first, first + int(ds.shards["count"][k])


def test_corrupted_record_names_its_shard_and_record(sharded, copy):
    k = 2
    lo, hi = _first_last(sharded.dataset, k)
    path = copy / fmt.shard_name(k)
    recs = shard_records(path)
    flip_byte(path, int(recs["offset"][0]) + int(recs["length"][0]) // 2)
    src = PackedSource(copy)
    src.read(lo)  # the index is intact: records read, unchecked, unless asked
    failures = src.dataset.check()
    assert list(failures) == [k] and f"shard {k} ({path})" in failures[k]
    assert "1 of" in failures[k] and "first bad: record 0" in failures[k]
    with pytest.raises(DecodeError, match=f"1 of {sharded.dataset.num_shards} shards fail"):
        src.verify()
    with pytest.raises(ConfigError, match="records fail their CRC"):
        PackedShard(path).verify()
    checked = PackedSource(copy, verify_reads=True)
    checked.read(lo - 1)
    with pytest.raises(DecodeError, match="CRC") as info:
        checked.read(lo)
    assert info.value.index == lo and f"shard {k}, record {lo}" in info.value.path
    bufs, errors = checked.buffers(np.array([lo - 1, lo, hi], dtype=np.int64))
    assert len(bufs) == 3 and list(errors) == [1] and errors[1].index == lo


def test_missing_shard_names_itself(sharded, copy):
    k = 1
    lo, hi = _first_last(sharded.dataset, k)
    os.remove(copy / fmt.shard_name(k))
    src = PackedSource(copy)  # the manifest opens: shards are touched when read
    assert src.read(hi) == sharded.read(hi)
    with pytest.raises(DecodeError, match=f"shard {k} .*{fmt.shard_name(k)}.* is missing") \
            as info:
        src.read(lo)
    assert info.value.index == lo
    assert list(src.dataset.check()) == [k]
    with pytest.raises(DecodeError, match=f"shard {k} .* is missing"):
        with Loader(src, 4, size=16, seed=1, shuffle=False, train=False) as loader:
            for _ in loader:
                pass
    # The skip policy replaces exactly that shard's records, each named with its shard.
    with Loader(src, 2, size=16, seed=1, on_error="skip") as loader:
        for _ in loader:
            pass
        assert set(loader.bad_samples) == set(range(lo, hi))
        assert all(fmt.shard_name(k) in m for m in loader.bad_samples.values())


def test_foreign_shard_is_refused(sharded, copy):
    os.replace(copy / fmt.shard_name(3), copy / fmt.shard_name(2))  # shard 3 posing as 2
    src = PackedSource(copy)
    lo, _ = _first_last(sharded.dataset, 2)
    with pytest.raises(DecodeError, match="shard 2 .* does not belong to this dataset"):
        src.read(lo)


def rewrite(raw, dtype, **fields):
    """Header fields changed and the header CRC recomputed, as another writer would."""
    h = np.frombuffer(raw[:128], dtype=dtype).copy()
    for k, v in fields.items():
        h[0][k] = v
    head = bytearray(h.tobytes())
    head[124:] = zlib.crc32(head[:124]).to_bytes(4, "little")
    return bytes(head) + raw[128:]


M = fmt.MANIFEST_HEADER


def remeta(raw, meta):
    """The manifest with another JSON object, its sizes and CRCs redone."""
    h = fmt.parse_manifest(raw)[0]
    raw = raw[:h["meta_offset"]] + meta
    return rewrite(raw, M, meta_size=len(meta), file_size=len(raw),
                   meta_crc32=zlib.crc32(meta))


@pytest.mark.parametrize("damage, match", [
    (lambda raw: raw[:-1], "truncated: its header describes"),
    (lambda raw: raw[:50], "truncated: 50 bytes"),
    (lambda raw: b"", "not a dpu_pipe packed dataset"),
    (lambda raw: raw + b"\0", "followed by unexpected bytes"),
    (lambda raw: jc.pil_jpeg(jc.photo_sized("coffee", 16, 16)), "not a dpu_pipe packed"),
    (lambda raw: rewrite(raw, M, version=1),
     "version 1 .*single-file.* reads versions 2, 3 and 4"),
    (lambda raw: rewrite(raw, M, version=5), "version 5 is not supported.*newer"),
    (lambda raw: raw[:20] + b"\x07" + raw[21:], "header corrupted"),
    (lambda raw: raw[:130] + bytes([raw[130] ^ 1]) + raw[131:], "shard table corrupted"),
    (lambda raw: raw[:-3] + bytes([raw[-3] ^ 1]) + raw[-2:], "metadata corrupted"),
    (lambda raw: rewrite(raw, M, labels_offset=10**12), "inconsistent part sizes"),
    (lambda raw: remeta(raw, b"[" * 100000), "unreadable metadata"),
    (lambda raw: remeta(raw, b'{"classes": null}'), "metadata lacks a valid 'data_bytes'"),
    (lambda raw: remeta(raw, b'{"classes": [1, 2]}'), "'classes' is not a list of names"),
    (lambda raw: rewrite(raw, M, count=N + 1), "inconsistent part sizes|hold 18 records"),
], ids=["minus-1-byte", "short-header", "empty", "trailing-byte", "jpeg", "version-1",
        "version-5", "header-crc", "table-crc", "meta-crc", "offsets", "meta-nested",
        "meta-missing-key", "meta-classes", "count"])
def test_damaged_or_foreign_manifest(copy, damage, match):
    manifest = copy / "manifest.dpk"
    manifest.write_bytes(damage(manifest.read_bytes()))
    with pytest.raises(ConfigError, match=match):
        PackedSource(copy)


def test_single_file_of_version_1_is_refused_naming_it(tmp_path):
    old = tmp_path / "old.dpk"  # a version-1 file's header: magic, version 1, size 128
    old.write_bytes(b"DPUPACK\0" + struct.pack("<II", 1, 128) + bytes(200))
    with pytest.raises(ConfigError, match="packed format version 1 .*pack the original"):
        open_path(old)


def relie(shard_bytes, j, **fields):
    """A shard whose RECORD j says other things, every CRC recomputed to match: what a
    malicious or buggy writer would produce."""
    h = fmt.parse_shard_header(shard_bytes[:128], len(shard_bytes), "s")
    raw = bytearray(shard_bytes)
    recs = np.frombuffer(raw, fmt.RECORD, count=h["count"], offset=h["index_offset"]).copy()
    for k, v in fields.items():
        recs[j][k] = v
    raw[h["index_offset"]:h["index_offset"] + recs.nbytes] = recs.tobytes()
    b = h["block_records"]
    paths = bytes(raw[h["paths_offset"]:])
    blocks = np.empty(h["nblocks"], "<u4")
    lo = 0
    for k in range(h["nblocks"]):
        blk = recs[k * b:(k + 1) * b]
        hi = min(int(blk["path_end"][-1]), len(paths))
        blocks[k] = fmt.block_crc(blk.tobytes(), paths[lo:hi] if lo <= hi else b"")
        lo = hi
    raw[h["blocks_offset"]:h["paths_offset"]] = blocks.tobytes()
    return rewrite(bytes(raw), fmt.SHARD_HEADER, blocks_crc32=zlib.crc32(blocks))


LIES = {
    "offset-past-end": dict(offset=2**40),
    "offset-in-header": dict(offset=8),
    "length-huge": dict(length=2**64 - 1),
    "offset+length-wraps": dict(offset=2**64 - 10, length=20),
    "length-past-data": dict(length=10**6),
    "path-end-past-blob": dict(path_end=10**6),
    "path-end-backwards": dict(path_end=0),
    "unknown-flag": dict(flags=0x80),
    "unknown-format": dict(format=200),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_lying_index_is_named_never_read_out_of_bounds(sharded, copy, lie):
    k = 2
    lo, hi = _first_last(sharded.dataset, k)
    j = hi - lo - 1  # the shard's last record (its path end cannot go backwards if j == 0)
    path = copy / fmt.shard_name(k)
    lied = relie(path.read_bytes(), j, **LIES[lie])
    with pytest.raises(ConfigError, match=f"index entry of record {j} is invalid"):
        fmt.parse_shard(lied, where="s")
    path.write_bytes(lied)
    # The manifest holds the shard's header CRC: re-bind it, as a full forgery would.
    man = copy / "manifest.dpk"
    raw = bytearray(man.read_bytes())
    h = fmt.parse_manifest(bytes(raw))[0]
    table = np.frombuffer(raw, fmt.SHARD_ENTRY, count=h["num_shards"],
                          offset=h["shards_offset"]).copy()
    table[k]["header_crc32"] = int.from_bytes(lied[124:128], "little")
    raw[h["shards_offset"]:h["shards_offset"] + table.nbytes] = table.tobytes()
    man.write_bytes(rewrite(bytes(raw), M, shards_crc32=zlib.crc32(table)))
    src = PackedSource(copy)
    with pytest.raises(DecodeError, match=f"shard {k} .*record {j} is invalid") as info:
        src.read(lo + j)
    assert info.value.index == lo + j
    bufs, errors = src.buffers(np.arange(N, dtype=np.int64))
    assert len(bufs) == N and sorted(errors) == list(range(lo, hi))  # its whole block


S = fmt.SHARD_HEADER


@pytest.mark.parametrize("fields, match", [
    (dict(index_offset=2**63), "inconsistent part sizes"),
    (dict(data_size=2**40), "inconsistent part sizes"),
    (dict(paths_size=1), "inconsistent part sizes"),
    (dict(count=2**50), "invalid record count"),
    (dict(count=0), "invalid record count"),
    (dict(block_records=0), "invalid record count .* or block size 0"),
    (dict(block_records=1), "inconsistent part sizes"),
    (dict(alignment=3), "invalid record alignment 3"),
    (dict(file_size=10), "followed by unexpected bytes"),
    (dict(version=7), "version 7 is not supported"),
], ids=["index-offset", "data-size", "paths-size", "count-huge", "count-0", "block-0",
        "block-1", "alignment", "file-size", "version"])
def test_shard_header_that_lies(sharded, fields, match):
    raw = open(os.path.join(sharded.path, fmt.shard_name(0)), "rb").read()
    with pytest.raises(ConfigError, match=match):
        fmt.parse_shard(rewrite(raw, S, **fields), where="s")


def test_shard_table_counts_that_lie(sharded, copy):
    """Two shard entries shifted by one record (the total still right, every CRC redone):
    the shard files disagree with the manifest and say so."""
    man = copy / "manifest.dpk"
    raw = bytearray(man.read_bytes())
    h = fmt.parse_manifest(bytes(raw))[0]
    table = np.frombuffer(raw, fmt.SHARD_ENTRY, count=h["num_shards"],
                          offset=h["shards_offset"]).copy()
    a = int(np.flatnonzero(table["count"][1:] > 1)[0])  # shards a and a+1, a+1 with 2+
    table[a]["count"] += 1
    table[a + 1]["first"] += 1
    table[a + 1]["count"] -= 1
    raw[h["shards_offset"]:h["shards_offset"] + table.nbytes] = table.tobytes()
    man.write_bytes(rewrite(bytes(raw), M, shards_crc32=zlib.crc32(table)))
    src = PackedSource(copy)
    for k in (a, a + 1):
        i = int(table[k]["first"])
        with pytest.raises(DecodeError, match=f"shard {k} .* does not belong to this dataset"):
            src.read(i)
    assert sorted(src.dataset.check()) == [a, a + 1]


def test_label_disagreeing_with_the_manifest_is_named(sharded, copy):
    k = 1
    lo, _ = _first_last(sharded.dataset, k)
    man = copy / "manifest.dpk"
    raw = bytearray(man.read_bytes())
    h = fmt.parse_manifest(bytes(raw))[0]
    raw[h["labels_offset"] + 8 * lo:h["labels_offset"] + 8 * lo + 8] = struct.pack("<q", 99)
    man.write_bytes(bytes(raw))
    with pytest.raises(DecodeError, match="record 0 has label .* in the shard and 99"):
        PackedSource(copy).read(lo)


def test_random_corruption_never_escapes_as_another_error(sharded):
    """Mutated shards and manifests: parsing either succeeds or raises ConfigError."""
    rng = random.Random(5)
    files = [open(os.path.join(sharded.path, n), "rb").read()
             for n in ("manifest.dpk", fmt.shard_name(0), fmt.shard_name(1))]
    outcomes = {"ok": 0, "refused": 0}
    for t in range(600):
        raw = bytearray(files[t % 3])
        for _ in range(rng.choice((1, 2, 8))):
            pos = rng.randrange(len(raw)) if rng.random() < 0.5 else rng.randrange(128)
            raw[pos] = rng.randrange(256)
        if rng.random() < 0.2:
            raw = raw[:rng.randrange(len(raw))]
        parse = fmt.parse_manifest if t % 3 == 0 else fmt.parse_shard
        try:
            parse(bytes(raw))
            outcomes["ok"] += 1
        except ConfigError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 300  # header, table and block CRCs catch nearly all


# -- lazy index loading -----------------------------------------------------------------

_MEMORY_PROBE = r"""
import json, os, sys, tracemalloc
import numpy as np
from dpu_pipe.sources import PackedSource

def rss():
    # Private (anonymous) and file-backed resident bytes: mapped index pages are the latter,
    # and the kernel maps up to 64 kB around each page touched (fault-around).
    with open("/proc/self/status") as f:
        kv = dict(line.split(":", 1) for line in f)
    return {k: int(kv[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile")}

path, n = sys.argv[1], int(sys.argv[2])
src0 = PackedSource(path)   # warm-up: the first open imports and allocates what any does
src0.read(0); src0.buffers(np.arange(2)); src0.close()
tracemalloc.start()
r0 = rss()
src = PackedSource(path)
r1, heap1 = rss(), tracemalloc.get_traced_memory()[0]
picks = np.random.default_rng(0).choice(n, 200, replace=False)
data = [src.read(int(i)) for i in picks]
bufs, errors = src.buffers(np.sort(picks))
assert not errors
ok = all(d[8:] == int(i).to_bytes(16, "little") for d, i in zip(data, picks))
ok = ok and all(src.label(int(i)) == int(i) % 1000 for i in picks)
r2, heap2 = rss(), tracemalloc.get_traced_memory()[1]
ds = src.dataset
ks = ds.shard_of(picks)
touched = len(set(zip(ks.tolist(), ((picks - ds.shards["first"][ks].astype(np.int64))
                                   // 256).tolist())))
checked = sum(int(s.checked.sum()) for s in ds._open.values())
print(json.dumps({"open_anon": r1["RssAnon"] - r0["RssAnon"],
                  "open_file": r1["RssFile"] - r0["RssFile"],
                  "read_anon": r2["RssAnon"] - r0["RssAnon"],
                  "read_file": r2["RssFile"] - r0["RssFile"],
                  "open_heap": heap1, "peak_heap": heap2, "ok": ok,
                  "blocks_touched": touched, "blocks_checked": checked,
                  "blocks_total": sum(-(-int(c) // 256) for c in ds.shards["count"]),
                  "shards": ds.num_shards, "shards_open": len(ds._open)}))
"""


def memory_probe(path, n):
    """Memory of opening a packed dataset and reading 200 random records, measured in a
    fresh interpreter (see _MEMORY_PROBE)."""
    env = repo_env()
    r = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(path), str(n)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux)")
def test_opening_and_reading_loads_only_the_index_blocks_used(tmp_path):
    n = 200_000
    out = tmp_path / "big"
    _pack(TinySource(n), out, shard_size=2_000_000, verify=False, threads=1)
    index_bytes = n * (fmt.RECORD.itemsize + 8)  # index entries + manifest labels: 11 MB
    m = memory_probe(out, n)
    assert m["ok"]
    # Exactly the index blocks holding the records read were loaded and checked.
    assert m["blocks_checked"] == m["blocks_touched"] < m["blocks_total"] / 2
    # Opening allocates a few kB (shard table, JSON); reading 200 records allocates no copy
    # of the index (private memory and Python heap ~1 MB, a quarter of it is the bound).
    assert m["open_heap"] < 64 * 1024, m
    assert m["peak_heap"] < index_bytes / 4 and m["read_anon"] < index_bytes / 4, m


# -- what pack writes -------------------------------------------------------------------

def _png_bytes():
    buf = io.BytesIO()
    Image.fromarray(np.full((9, 7, 3), 80, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_each_record_header_is_read_and_its_format_recorded(folder, tmp_path):
    good = folder.read(0)
    cases = {
        "a/jpeg.jpg": (good, 1, fmt.TRANSCODED),
        # libjpeg reads it with a warning: the transcoder leaves it as it is.
        "a/truncated.jpg": (good[:len(good) * 2 // 3], 1, 0),
        "a/png-named.jpg": (_png_bytes(), 2, 0),
        "a/gif.jpg": (b"GIF89a" + bytes(40), 3, 0),
        "a/webp.jpg": (b"RIFF\x10\0\0\0WEBPVP8 " + bytes(20), 4, 0),
        "a/cut-header.jpg": (good[:30], 1, fmt.UNREADABLE),
        "a/text.jpg": (b"hello, not an image", 0, fmt.UNREADABLE),
        "a/empty.jpg": (b"", 0, fmt.UNREADABLE),
    }
    root = tmp_path / "mixed"
    for rel, (data, _, _) in cases.items():
        jc.write_file(str(root / rel), data)
    src = ImageFolder(root)
    packed = _pack(src, tmp_path / "out", transcode=True)
    for i in range(len(src)):
        e = packed.dataset.entry(i)
        _, code, flags = cases[src.relpath(i)]
        assert (int(e["format"]), int(e["flags"])) == (code, flags), src.relpath(i)
        assert int(e["orig_length"]) == len(src.read(i))
        if not flags & fmt.TRANSCODED:  # kept as it was
            assert packed.read(i) == src.read(i), src.relpath(i)
    meta = packed.dataset.meta
    assert meta["formats"] == {"unknown": 2, "jpeg": 3, "png": 1, "gif": 1, "webp": 1}
    assert meta["unreadable"] == 3
    assert sorted(meta["unreadable_examples"]) == ["a/cut-header.jpg", "a/empty.jpg",
                                                   "a/text.jpg"]
    env = repo_env()
    r = subprocess.run([sys.executable, "-m", "dpu_pipe", "pack", root, tmp_path / "cli",
                        "-q"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "8 records (2 UNKNOWN, 3 JPEG, 1 PNG, 1 GIF, 1 WEBP)" in r.stdout
    assert "1 JPEGs transcoded (" in r.stdout and "% in size)" in r.stdout
    assert "3 records have a header their decoder cannot read" in r.stdout


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_output_respects_the_umask(folder, tmp_path, umask):
    old = os.umask(umask)
    try:
        packed = _pack(folder, tmp_path / "ds", shard_size=20000)
    finally:
        os.umask(old)
    assert os.stat(packed.path).st_mode & 0o777 == 0o777 & ~umask
    for name in os.listdir(packed.path):
        assert os.stat(os.path.join(packed.path, name)).st_mode & 0o777 == 0o666 & ~umask


def test_replaces_a_packed_dataset_and_refuses_anything_else(folder, tmp_path):
    out = tmp_path / "ds"
    _pack(folder, out, shard_size=1)
    again = _pack(FileList([(folder.describe(0), 5)]), out)
    assert len(again) == 1 and sorted(os.listdir(out)) == ["manifest.dpk", fmt.shard_name(0)]
    other = tmp_path / "mine"
    other.mkdir()
    (other / "keep.txt").write_text("user data")
    with pytest.raises(ConfigError, match="refusing to replace .* not a packed dataset"):
        _pack(folder, other)
    assert os.listdir(other) == ["keep.txt"]
    assert sorted(os.listdir(tmp_path)) == ["ds", "mine"]


def test_verify_catches_a_bad_write_and_keeps_the_old_dataset(folder, tmp_path, monkeypatch):
    out = tmp_path / "ds"
    _pack(folder, out)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    real_fsync = os.fsync

    def corrupting_fsync(fd):
        # Stands in for storage that returns other bytes than were written.
        if os.fstat(fd).st_size > 4096:
            os.pwrite(fd, b"\x00\x01\x02", 200)
        real_fsync(fd)

    monkeypatch.setattr(writer_mod.os, "fsync", corrupting_fsync)
    with pytest.raises(DpuPipeError, match="verification of written shard 0 .* 1 records"):
        _pack(folder, out)
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["ds"]


def test_unreadable_source_file_fails_naming_it(folder, tmp_path):
    rows = FileList([(folder.describe(0), 0), (str(tmp_path / "gone.jpg"), 1)])
    with pytest.raises(DecodeError, match="cannot read") as info:
        _pack(rows, tmp_path / "ds")
    assert info.value.index == 1
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("interval", [2, "row"])
def test_restart_interval_choice(folder, tmp_path, interval):
    packed = _pack(FileList([(folder.describe(i), i) for i in (0, 4)]), tmp_path / "ds",
                   transcode=True, restart_interval=interval)
    assert packed.dataset.meta["transcode"]["restart_interval"] == interval
    for i, orig in zip(range(2), (folder.read(0), folder.read(4))):
        rec = packed.read(i)
        dri = jc.find_segment(rec, jc.DRI)
        got = struct.unpack(">H", rec[dri[0] + 4:dri[0] + 6])[0]
        mcu_w = jc.imcu_size(rec)[1]
        width = dpu_pipe.jpeg.read_header(rec).width
        assert got == (2 if interval == 2 else -(-width // mcu_w))
        assert np.array_equal(dpu_pipe.jpeg.decode(rec), dpu_pipe.jpeg.decode(orig))


@pytest.mark.parametrize("kw, match", [
    (dict(alignment=48), "power of two"),
    (dict(transcode=True, restart_interval=0), "restart_interval must be"),
    (dict(transcode=True, restart_interval="col"), "restart_interval must be"),
    (dict(shard_size=0), "shard_size must be a positive"),
    (dict(shard_size="big"), "not a size: 'big'"),
    (dict(threads=0), "threads must be a positive"),
    (dict(transcode="yes"), "transcode must be True or False"),
])
def test_argument_errors(folder, tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        _pack(folder, tmp_path / "x", **kw)
    assert os.listdir(tmp_path) == []


def test_pack_argument_errors_about_source_and_place(folder, tmp_path):
    with pytest.raises(ConfigError, match="needs a dpu_pipe source"):
        _pack([b"abc"], tmp_path / "x")
    with pytest.raises(ConfigError, match="output directory does not exist"):
        _pack(folder, tmp_path / "no" / "x")


@pytest.mark.parametrize("text, value", [("1GiB", 2**30), ("500MB", 500 * 10**6),
                                         ("64M", 64 * 2**20), ("4096", 4096),
                                         ("1.5 KiB", 1536)])
def test_parse_size(text, value):
    assert writer_mod.parse_size(text) == value


def test_threads_give_the_same_dataset(folder, tmp_path):
    one = _pack(folder, tmp_path / "one", shard_size=8000, threads=1, transcode=True)
    three = _pack(folder, tmp_path / "three", shard_size=8000, threads=3, transcode=True)
    for name in os.listdir(one.path):
        a = open(os.path.join(one.path, name), "rb").read()
        b = open(os.path.join(three.path, name), "rb").read()
        assert a == b, name


# -- layering ---------------------------------------------------------------------------

def _imports(path):
    """Absolute dpu_pipe module names a file imports, at any level of its code."""
    pkg = os.path.relpath(os.path.dirname(path), os.path.dirname(PKG)).replace(os.sep, ".")
    if os.path.basename(path) == "__init__.py":
        pkg_of_file = pkg
    else:
        pkg_of_file = pkg
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom):
            base = pkg_of_file.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("dpu_pipe")}


def test_packed_and_sources_import_one_way():
    """sources imports the packed reader; neither the format nor the reader imports sources,
    the writer or anything above them."""
    above = {"dpu_pipe.sources", "dpu_pipe.packed.writer", "dpu_pipe.loader", "dpu_pipe.batch",
             "dpu_pipe.tools", "dpu_pipe.packed.writer.pack"}
    for name in ("format.py", "reader.py", "__init__.py"):
        got = _imports(os.path.join(PKG, "packed", name))
        assert not got & above, (name, got & above)
    src_imports = _imports(os.path.join(PKG, "sources", "packed.py"))
    assert "dpu_pipe.packed.reader" in src_imports
    assert not {m for m in src_imports if m.startswith("dpu_pipe.packed.writer")}
    # And each side imports first in a fresh interpreter.
    env = repo_env()
    for first in ("dpu_pipe.packed.writer", "dpu_pipe.sources", "dpu_pipe.packed.reader"):
        r = subprocess.run([sys.executable, "-c", f"import {first}"], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr


# -- what the transcoder takes, keeps, and cannot read -------------------------------------

def test_cmyk_arithmetic_12_bit_and_lossless_jpegs(tmp_path):
    """CMYK is transcoded; arithmetic coding is transcoded where this build decodes it and
    kept where it does not; 12-bit and lossless JPEGs, which libjpeg cannot read here, are
    kept and flagged unreadable. Readable records decode to the original's pixels."""
    import test_jpeg as tj
    want = {"cmyk-adobe": fmt.TRANSCODED, "ycck-adobe": fmt.TRANSCODED,
            "arith-420": fmt.TRANSCODED if tj.ARITH_DECODING else 0,
            "sof-12-bit": fmt.UNREADABLE, "sof3-lossless": fmt.UNREADABLE}
    datas = {name: (tj.BROKEN[name]() if name in tj.BROKEN else tj.case(name))
             for name in want}
    rows = []
    for name, data in datas.items():
        jc.write_file(str(tmp_path / "in" / f"{name}.jpg"), data)
        rows.append((str(tmp_path / "in" / f"{name}.jpg"), len(rows)))
    packed = _pack(FileList(rows), tmp_path / "ds", transcode=True)
    for i, name in enumerate(want):
        e = packed.dataset.entry(i)
        assert (int(e["flags"]), int(e["format"])) == (want[name], 1), name
        rec, orig = packed.read(i), datas[name]
        if want[name] != fmt.TRANSCODED:
            assert rec == orig, name
        if want[name] != fmt.UNREADABLE:
            assert np.array_equal(dpu_pipe.jpeg.decode(rec), dpu_pipe.jpeg.decode(orig)), name
    assert packed.dataset.meta["unreadable"] == 2
