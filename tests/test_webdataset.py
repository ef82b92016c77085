"""WebDataset tar shards: the same stream as the ImageFolder they were written from, the
member index and its cache, and damaged shards."""

import os
import pickle
import tarfile

import numpy as np
import pytest

from dpu_pipe import Loader
from dpu_pipe.errors import ConfigError, DecodeError
from dpu_pipe.sources import ImageFolder, WebDataset, as_source, expand_shards, open_source
from dpu_pipe.sources import webdataset as wds

import dataset_formats as dfm


batches = dfm.batches


@pytest.fixture(scope="module")
def folder(format_folder):
    return ImageFolder(format_folder)


@pytest.fixture
def shards(folder, tmp_path):
    paths = dfm.write_tars(folder, str(tmp_path / "train-%04d.tar"), 8)
    assert len(paths) == 3
    return str(tmp_path / "train-{0000..0002}.tar"), paths


def test_expand_shards():
    assert expand_shards("a-{08..11}.tar") == ["a-08.tar", "a-09.tar", "a-10.tar", "a-11.tar"]
    assert expand_shards("{x,y}/s{1..2}.tar") == ["x/s1.tar", "x/s2.tar", "y/s1.tar",
                                                  "y/s2.tar"]
    assert expand_shards("plain.tar") == ["plain.tar"]
    for bad in ("a{3..1}.tar", "a{b}.tar"):
        with pytest.raises(ConfigError):
            expand_shards(bad)


@pytest.mark.parametrize("train", [False, True], ids=["val", "train"])
def test_stream_equals_image_folder(folder, shards, train):
    pattern, _ = shards
    src = as_source(pattern)
    assert isinstance(src, WebDataset) and len(src) == len(folder)
    assert np.array_equal(src.labels, folder.labels)
    for i in range(len(folder)):
        assert src.read(i) == folder.read(i)
    want = batches(Loader(folder, 4, train=train, size=32, seed=5))
    got = batches(Loader(pattern, 4, train=train, size=32, seed=5))
    assert len(got) == len(want)
    for (gx, gy), (wx, wy) in zip(got, want):
        assert np.array_equal(gx, wx) and np.array_equal(gy, wy)


def test_json_labels_meta_and_buffers(folder, tmp_path):
    paths = dfm.write_tars(folder, str(tmp_path / "j-%d.tar"), 100, label="json")
    src = WebDataset(paths, label_key="json:label")
    assert np.array_equal(src.labels, folder.labels)
    meta = src.metadata(4)
    assert meta == {"__key__": os.path.splitext(folder.relpath(4))[0], "shard": paths[0]}
    assert folder.relpath(4).lower() in src.describe(4).lower()
    bufs, errors = src.buffers(np.array([3, 0, 7], np.int64))   # one shard: zero copy
    assert len(bufs) == 3 and not errors
    loaded = batches(Loader(src, 5, train=False, size=24, return_meta=False))
    want = batches(Loader(folder, 5, train=False, size=24))
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(loaded, want))


def test_spec_pickle_and_fingerprint(shards, tmp_path):
    pattern, paths = shards
    src = WebDataset(pattern)
    spec = src.spec()
    assert spec["factory"] == "dpu_pipe.sources.webdataset:WebDataset"
    again = open_source(spec)
    assert again.fingerprint() == src.fingerprint() and len(again) == len(src)
    assert pickle.loads(pickle.dumps(src)).read(5) == src.read(5)
    other = WebDataset(paths[:2])
    assert other.fingerprint() != src.fingerprint()


# -- the index cache --------------------------------------------------------------------

def test_index_cached_beside_the_shard_and_stale_cache_detected(shards, monkeypatch):
    _, paths = shards
    first = WebDataset(paths)
    cache = wds._index_paths(paths[0])[0]
    assert os.path.isfile(cache)
    calls = []
    real_scan = wds.scan_shard
    monkeypatch.setattr(wds, "scan_shard", lambda *a: calls.append(a[0]) or real_scan(*a))
    second = WebDataset(paths)
    assert calls == [] and second.fingerprint() == first.fingerprint()
    # Append a sample to shard 0: size and mtime change, its index is rebuilt.
    with tarfile.open(paths[0], "a") as tf:
        dfm._add(tf, "extra/new.jpg", dfm.image_bytes(999))
        dfm._add(tf, "extra/new.cls", b"2")
    st = os.stat(paths[0])
    os.utime(paths[0], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    third = WebDataset(paths)
    assert calls == [paths[0]]
    assert len(third) == len(first) + 1 and third.label(8) == 2
    assert third.read(8) == dfm.image_bytes(999)
    # A damaged cache file is rebuilt, not trusted.
    with open(cache, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 64)
    calls.clear()
    fourth = WebDataset(paths)
    assert calls == [paths[0]] and fourth.fingerprint() == third.fingerprint()


def test_cache_with_wrong_offsets_is_rebuilt(shards, monkeypatch):
    _, paths = shards
    src = WebDataset(paths[:1])
    ix = src._index[0]
    samples = ix.samples.copy()
    samples["offset"][0] = os.path.getsize(paths[0])    # past the end: not trusted
    want = {"version": wds.INDEX_VERSION, "size": os.path.getsize(paths[0]),
            "mtime_ns": os.stat(paths[0]).st_mtime_ns, "image_keys": list(src._image_keys),
            "label_key": "cls"}
    wds._save_index(wds._index_paths(paths[0])[0], wds._ShardIndex(samples, ix.keys, {}), want)
    again = WebDataset(paths[:1])
    assert again.read(0) == src.read(0)


def test_read_only_data_directory_uses_the_user_cache(shards, tmp_path, monkeypatch):
    _, paths = shards
    data_dir = os.path.dirname(paths[0])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(wds, "_writable", lambda d: d != data_dir)
    os.chmod(data_dir, 0o555)
    try:
        src = WebDataset(paths)
        assert not any(os.path.exists(wds._index_paths(p)[0]) for p in paths)
        cached = [wds._index_paths(p)[1] for p in paths]
        assert all(os.path.isfile(p) for p in cached)
        assert str(tmp_path / "xdg") in cached[0]
        assert WebDataset(paths).fingerprint() == src.fingerprint()
    finally:
        os.chmod(data_dir, 0o755)


def test_unwritable_everywhere_still_opens(shards, tmp_path, monkeypatch):
    _, paths = shards
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "none"))
    monkeypatch.setattr(wds, "_writable", lambda d: False)
    monkeypatch.setattr(wds, "_save_index", lambda *a: (_ for _ in ()).throw(OSError("ro")))
    assert len(WebDataset(paths)) == 21


# -- damaged shards ---------------------------------------------------------------------

def test_truncated_member_is_a_decode_error_naming_shard_and_member(folder, tmp_path):
    path = dfm.write_tars(folder, str(tmp_path / "t-%d.tar"), 100)[0]
    with tarfile.open(path) as tf:
        last = [m for m in tf.getmembers() if m.name.endswith((".jpg", ".png"))][-1]
    with open(path, "r+b") as f:
        f.truncate(last.offset_data + last.size // 2)
    src = WebDataset(path, label_key=None)
    n = len(src)
    with pytest.raises(DecodeError, match="truncated tar member") as ei:
        src.read(n - 1)
    assert path in str(ei.value) and last.name in str(ei.value)
    bufs, errors = src.buffers(np.arange(n, dtype=np.int64))
    assert list(errors) == [n - 1]
    assert src.read(0) == folder.read(0)
    # Loader: raise names it; skip replaces it and keeps the batch size.
    with pytest.raises(DecodeError, match="truncated"):
        batches(Loader(src, 7, train=False, size=16))
    got = batches(Loader(src, 7, train=False, size=16, on_error="skip"))
    assert sum(len(y) for _, y in got) == n


def test_missing_label_and_missing_image(tmp_path):
    path = str(tmp_path / "m.tar")
    with tarfile.open(path, "w") as tf:
        dfm._add(tf, "a.jpg", dfm.image_bytes(1))
        dfm._add(tf, "a.cls", b"3")
        dfm._add(tf, "b.jpg", dfm.image_bytes(2))            # no label
        dfm._add(tf, "c.cls", b"1")                          # no image
        dfm._add(tf, "d.jpg", dfm.image_bytes(3))
        dfm._add(tf, "d.cls", b"seven")                      # not an integer
    src = WebDataset(path)
    assert len(src) == 4 and src.label(0) == 3
    with pytest.raises(DecodeError, match=r"missing label: no member b\.cls"):
        src.read(1)
    with pytest.raises(DecodeError, match="no image member"):
        src.read(2)
    with pytest.raises(DecodeError, match="'seven' in d.cls is not an integer"):
        src.read(3)


@pytest.mark.parametrize("damage", ["header", "empty", "gzip", "missing"])
def test_unreadable_shards_are_config_errors(folder, tmp_path, damage):
    path = dfm.write_tars(folder, str(tmp_path / "d-%d.tar"), 100)[0]
    if damage == "header":
        with tarfile.open(path) as tf:
            third = tf.getmembers()[2]
        with open(path, "r+b") as f:
            f.seek(third.offset + 148)     # the header checksum field
            f.write(b"9999999\0")
        match = f"bad tar header at byte {third.offset}"
    elif damage == "empty":
        open(path, "wb").close()
        match = "not an uncompressed tar"
    elif damage == "gzip":
        import gzip
        data = open(path, "rb").read()
        with open(path, "wb") as f:
            f.write(gzip.compress(data))
        match = "not an uncompressed tar"
    else:
        os.unlink(path)
        match = "do not exist"
    with pytest.raises(ConfigError, match=match):
        WebDataset(path)


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT],
                         ids=["ustar", "gnu", "pax"])
def test_header_scan_lists_what_tarfile_lists(tmp_path, fmt):
    """Long names (GNU 'L' records, pax path, ustar prefix), non-ASCII names, directories,
    symlinks and empty members: the scan finds the regular members tarfile finds, at the
    same offsets."""
    path = str(tmp_path / "x.tar")
    deep = "d" * 60 + "/" + "e" * 60
    names = ["a/short.jpg", f"{deep}/long_{'x' * 90}.jpg", "ü/naïve.png", "empty.jpg"]
    with tarfile.open(path, "w", format=fmt) as tf:
        info = tarfile.TarInfo("somedir")
        info.type = tarfile.DIRTYPE
        tf.addfile(info)
        link = tarfile.TarInfo("link.jpg")
        link.type = tarfile.SYMTYPE
        link.linkname = "a/short.jpg"
        tf.addfile(link)
        for k, name in enumerate(names):
            if fmt == tarfile.USTAR_FORMAT and len(name.rsplit("/", 1)[-1]) > 100:
                name = f"{deep}/short{k}.jpg"      # ustar: prefix + name only
            dfm._add(tf, name, b"" if name == "empty.jpg" else dfm.image_bytes(k))
    with tarfile.open(path) as tf:
        want = [(m.name, m.offset_data, m.size) for m in tf.getmembers() if m.isreg()]
    data = open(path, "rb").read()
    assert list(wds._tar_members(data, len(data), path)) == want
    src = WebDataset(path, label_key=None)
    assert len(src) == len(want)


def test_base256_size_and_pax_size_fields():
    assert wds._octal(b"0000017\0") == 15
    assert wds._octal(bytes([0x80]) + (2**40).to_bytes(11, "big")) == 2**40
    assert wds._octal(b"\xff" * 12) is None and wds._octal(b"12x\0") is None
    assert wds._pax(b"16 path=abc.jpg\n", "w") == {"path": b"abc.jpg"}
    with pytest.raises(ConfigError, match="malformed pax record"):
        wds._pax(b"99 path=abc.jpg\n", "w")


def test_loader_meta_names_key_and_shard(folder, shards):
    pattern, paths = shards
    ld = Loader(pattern, 8, train=False, size=16, return_meta=True)
    keys, shard_of = [], []
    for _, _, meta in ld:
        keys.extend(meta["__key__"])
        shard_of.extend(meta["shard"])
    assert keys == [os.path.splitext(folder.relpath(i))[0] for i in range(len(folder))]
    assert shard_of == [paths[i // 8] for i in range(len(folder))]
