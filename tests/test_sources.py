"""Sources (ImageFolder, FileList, PackedSource) and the spec round trip; the packed format
itself is tested in test_packed.py."""

import io
import json
import os
import pickle
import shutil

import numpy as np
import pytest
from PIL import Image

from dpu_pipe import pack
from dpu_pipe.errors import ConfigError, DecodeError
from dpu_pipe.sources import FileList, ImageFolder, PackedSource, open_path, open_source

import jpeg_corpus as jc


def jpeg_bytes(seed):
    """A small JPEG whose bytes differ for every seed (size and colour depend on it)."""
    rng = np.random.default_rng(seed)
    h, w = 8 + seed % 5, 9 + seed % 7
    img = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


@pytest.fixture
def folder(tmp_path):
    """An ImageFolder tree with the awkward cases: mixed-case extensions, nested folders,
    non-image files, hidden entries, files directly in root."""
    root = tmp_path / "ds"
    files = {  # relpath -> seed, for the files that must be found
        "B/z.jpg": 1,
        "a/x.JPG": 2,
        "a/y.jpeg": 3,
        "a/nested/deeper/w.Jpeg": 4,
        "a/nested/v.jpg": 5,
        "a/nested.jpg": 6,
        "b/10.jpg": 7,
        "b/2.jpg": 8,
    }
    for rel, seed in files.items():
        write(str(root / rel), jpeg_bytes(seed))
    ignored = ["a/readme.txt", "a/image.gif", "a/xjpg", "a/.hidden.jpg", "a/.cache/h.jpg",
               "top.jpg", ".git/c/q.jpg"]
    for rel in ignored:
        write(str(root / rel), jpeg_bytes(99))
    return root, files


def reference_order(files):
    """Expected sample order: classes in code-point order, then (directory, name)."""
    def key(rel):
        d, n = rel.rsplit("/", 1)
        return (rel.split("/", 1)[0], d, n)
    return sorted(files, key=key)


# -- ImageFolder --------------------------------------------------------------------------

def test_image_folder_classes_labels_and_order(folder):
    root, files = folder
    os.makedirs(root / "c_empty")
    with pytest.raises(ConfigError, match="Found no valid file for the classes c_empty"):
        ImageFolder(root)   # as torchvision's ImageFolder
    src = ImageFolder(root, allow_empty=True)
    assert src.classes == ["B", "a", "b", "c_empty"]  # sorted code points, empty class kept
    expected = reference_order(files)
    assert [src.relpath(i) for i in range(len(src))] == expected
    assert len(src) == len(files)
    cls = {c: k for k, c in enumerate(src.classes)}
    want_labels = [cls[rel.split("/", 1)[0]] for rel in expected]
    assert src.labels.dtype == np.int64
    assert src.labels.tolist() == want_labels
    assert [src.label(i) for i in range(len(src))] == want_labels
    for i, rel in enumerate(expected):
        assert src.read(i) == jpeg_bytes(files[rel])
        assert src.describe(i) == os.path.join(str(root), rel)


def test_image_folder_takes_torchvision_extensions(tmp_path):
    names = ["a/x.jpg", "a/y.PNG", "a/z.webp", "b/p.bmp", "b/q.tiff", "b/r.ppm", "b/s.pgm",
             "b/t.tif", "b/u.JPEG"]
    for rel in names + ["a/v.gif", "b/w.txt"]:
        write(str(tmp_path / "ds" / rel), jpeg_bytes(1))
    src = ImageFolder(tmp_path / "ds")
    assert sorted(src.relpath(i) for i in range(len(src))) == sorted(names)


def test_image_folder_labels_are_read_only(folder):
    src = ImageFolder(folder[0])
    with pytest.raises(ValueError):
        src.labels[0] = 5


def test_image_folder_errors(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        ImageFolder(tmp_path / "missing")
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    (tmp_path / "empty" / "cls" / "a.gif").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"no image files.*cls"):
        ImageFolder(tmp_path / "empty")
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(jpeg_bytes(0))
    with pytest.raises(ConfigError, match="no class sub-folders"):
        ImageFolder(tmp_path / "flat")


def test_unreadable_file_is_a_decode_error(folder):
    root, files = folder
    src = ImageFolder(root)
    os.remove(src.describe(2))
    with pytest.raises(DecodeError, match="cannot read") as info:
        src.read(2)
    assert info.value.index == 2 and info.value.path == src.describe(2)
    assert isinstance(info.value, ValueError)
    assert src.read(1)  # the others still read


@pytest.mark.parametrize("i", [-1, 8, 100])
def test_index_out_of_range(folder, i):
    src = ImageFolder(folder[0])
    with pytest.raises(IndexError):
        src.read(i)
    with pytest.raises(IndexError):
        src.label(i)


# -- FileList -----------------------------------------------------------------------------

@pytest.fixture
def listed(tmp_path):
    data = tmp_path / "data"
    names = ["a.jpg", "sub/b.jpg", "with space.jpg", "comma,name.jpg"]
    for k, n in enumerate(names):
        write(str(data / n), jpeg_bytes(10 + k))
    return data, names


def test_file_list_formats(listed):
    data, names = listed
    lst = data / "list.txt"
    lst.write_text("path,label\n"
                   "# a comment\n"
                   "a.jpg,3\n"
                   "\n"
                   "sub/b.jpg 0\n"
                   "with space.jpg\t7\n"
                   '"comma,name.jpg", 2\n', encoding="utf-8")
    src = FileList(lst)
    assert [src.relpath(i) for i in range(len(src))] == names
    assert src.labels.tolist() == [3, 0, 7, 2]
    assert src.classes is None
    for i, n in enumerate(names):
        assert src.read(i) == (data / n).read_bytes()


def test_file_list_root_and_absolute_paths(listed, tmp_path):
    data, names = listed
    lst = tmp_path / "elsewhere" / "list.csv"
    lst.parent.mkdir()
    lst.write_text(f"a.jpg,1\n{data / 'sub' / 'b.jpg'},2\n", encoding="utf-8")
    src = FileList(lst, root=data)
    assert src.read(0) == (data / "a.jpg").read_bytes()
    assert src.read(1) == (data / "sub" / "b.jpg").read_bytes()
    # Without root, relative paths resolve against the list's own directory.
    with pytest.raises(DecodeError, match="cannot read"):
        FileList(lst).read(0)


def test_file_list_rows(listed, monkeypatch):
    data, names = listed
    monkeypatch.chdir(data)
    src = FileList([("a.jpg", np.int32(4)), ("sub/b.jpg", "5")])
    assert src.labels.tolist() == [4, 5]
    assert src.read(1) == (data / "sub" / "b.jpg").read_bytes()
    with pytest.raises(ConfigError, match="row 1: label True"):
        FileList([("a.jpg", 1), ("b.jpg", True)])
    with pytest.raises(ConfigError, match="row 0: label nan is not a finite number"):
        FileList([("a.jpg", float("nan"))])
    with pytest.raises(ConfigError, match="row 0: label 36893488147419103232 does not fit"):
        FileList([("a.jpg", 2**65)])
    with pytest.raises(ConfigError, match="row 0: expected a \\(path, label\\) pair"):
        FileList([(3, 1)])
    with pytest.raises(ConfigError, match="row 1: 1 labels where the first sample has 2"):
        FileList([("a.jpg", (1, 2)), ("b.jpg", 3)])
    with pytest.raises(ConfigError, match="row 0: expected a \\(path, label\\) pair"):
        FileList(["a.jpg"])
    with pytest.raises(ConfigError, match="empty"):
        FileList([])


def test_file_list_float_and_multi_labels(tmp_path):
    (tmp_path / "reg.csv").write_text("path,target\na.jpg,0.25\nb.jpg,3\n")
    reg = FileList(tmp_path / "reg.csv")
    assert reg.labels.dtype == np.float32 and reg.labels.tolist() == [0.25, 3.0]
    assert reg.label(0) == 0.25
    (tmp_path / "multi.csv").write_text("path,cat,dog,eel\na.jpg,1,0,1\nb.jpg,0,0,1\n")
    multi = FileList(tmp_path / "multi.csv")
    assert multi.labels.dtype == np.int64 and multi.labels.shape == (2, 3)
    assert multi.label(1) == [0, 0, 1]
    rows = FileList([("a.jpg", (0.5, 1)), ("b.jpg", [2, 3])])
    assert rows.labels.dtype == np.float32 and rows.labels.tolist() == [[0.5, 1], [2, 3]]
    assert open_source(rows.spec()).fingerprint() == rows.fingerprint()
    with pytest.raises(ValueError):
        multi.labels[0, 0] = 7


@pytest.mark.parametrize("text, match", [
    ("a.jpg,1\nb.jpg,x\n", r"line 2: label 'x' is not an integer"),
    ("a.jpg,1\n\nb.jpg inf\n", r"line 3: label 'inf' is not finite"),
    ("a.jpg,1\nb.jpg,2,3\n", r"line 2: 2 labels where the first sample has 1"),
    ("a.jpg\n", r"line 1: expected 'path label'"),
    (" ,4\n", r"line 1: empty path"),
    ("# only a comment\n", r"empty"),
    ("a.jpg 99999999999999999999\n", r"line 1: label 99999999999999999999 does not fit"),
])
def test_file_list_errors_name_the_line(tmp_path, text, match):
    lst = tmp_path / "list.txt"
    lst.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=match):
        FileList(lst)


def test_file_list_missing_list(tmp_path):
    with pytest.raises(ConfigError, match="cannot read file list"):
        FileList(tmp_path / "nope.txt")


# -- per-sample metadata -------------------------------------------------------------------

def test_metadata_is_the_relative_path(folder, listed, tmp_path):
    srcs = all_sources(folder, listed, tmp_path)
    for name, src in srcs.items():
        for i in range(len(src)):
            assert src.metadata(i) == {"path": src.relpath(i)}, name
    # A packed source holds the relative paths of the dataset it was made from.
    img, pk = srcs["image_folder"], srcs["packed"]
    assert [pk.metadata(i) for i in range(len(pk))] == \
        [{"path": rel} for rel in reference_order(folder[1])]
    assert [pk.metadata(i) for i in range(len(pk))] == [img.metadata(i) for i in range(len(img))]


def test_file_list_meta_columns(tmp_path):
    (tmp_path / "list.csv").write_text(
        "# captions and a split beside two labels\n"
        "file,cat,caption,dog,split\n"
        'a.jpg,1,"a cat, sitting",0,train\n'
        "\n"
        "b.jpg,0, a dog ,1,val\n", encoding="utf-8")
    src = FileList(tmp_path / "list.csv", meta_columns=["split", "caption"])
    assert src.labels.dtype == np.int64 and src.labels.tolist() == [[1, 0], [0, 1]]
    assert src.metadata(0) == {"path": "a.jpg", "split": "train", "caption": "a cat, sitting"}
    assert src.metadata(1) == {"path": "b.jpg", "split": "val", "caption": "a dog"}
    # Without meta_columns the same header means four label columns, and text is no label.
    with pytest.raises(ConfigError, match="line 3: label 'a cat, sitting' is not an integer"):
        FileList(tmp_path / "list.csv")
    rows = FileList([("a.jpg", 0.5, "x"), ("b.jpg", 2, "y")], meta_columns=["note"])
    assert rows.labels.dtype == np.float32 and rows.metadata(1) == {"path": "b.jpg", "note": "y"}
    for lst in (src, rows):
        again = open_source(json.loads(json.dumps(lst.spec())))
        assert again.labels.tolist() == lst.labels.tolist()
        assert [again.metadata(i) for i in range(2)] == [lst.metadata(i) for i in range(2)]


@pytest.mark.parametrize("text, columns, match", [
    ("path,label\na.jpg,1\n", ["caption"], r"line 1: meta_columns \['caption'\] are not in"),
    ("path,caption\na.jpg,x\n", ["caption"], r"line 1: no label column left"),
    ("path,label,caption\na.jpg,1,x\nb.jpg,2\n", ["caption"],
     r"line 3: 2 fields where the header has 3"),
    ("path,label,caption\na.jpg,z,x\n", ["caption"], r"line 2: label 'z' is not an integer"),
    ("path,label,caption\n,1,x\n", ["caption"], r"line 2: empty path"),
    ("path,label\na.jpg,1\n", ["path"], r"meta_columns: 'path' is reserved"),
    ("path,label\na.jpg,1\n", ["index"], r"meta_columns: 'index' is reserved"),
    ("path,label\na.jpg,1\n", "caption", r"meta_columns must be a list of names"),
    ("path,label\na.jpg,1\n", ["a", "a"], r"must not repeat a name"),
    ("path,label\na.jpg,1\n", [" a"], r"without surrounding spaces"),
])
def test_file_list_meta_column_errors(tmp_path, text, columns, match):
    lst = tmp_path / "list.csv"
    lst.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=match):
        FileList(lst, meta_columns=columns)


def test_file_list_meta_rows_errors():
    with pytest.raises(ConfigError, match=r"row 0: expected \(path, label, note\)"):
        FileList([("a.jpg", 1)], meta_columns=["note"])
    with pytest.raises(ConfigError, match=r"row 0: metadata 3 is not a string"):
        FileList([("a.jpg", 1, 3)], meta_columns=["note"])
    with pytest.raises(ConfigError, match=r"row 0: expected a \(path, label\) pair"):
        FileList([("a.jpg", 1, "x")])


# -- spec, open_source, pickling ----------------------------------------------------------

def all_sources(folder, listed, tmp_path):
    img = ImageFolder(folder[0])
    data, names = listed
    lst = data / "list.txt"
    lst.write_text("".join(f"{n!r},{k}\n".replace("'", '"') for k, n in enumerate(names)),
                   encoding="utf-8")
    from_file = FileList(lst)
    from_rows = FileList([(str(data / n), k) for k, n in enumerate(names)])
    pk = pack(img, tmp_path / "ds.dpk", progress=False, transcode=False)
    return {"image_folder": img, "file_list": from_file, "rows": from_rows, "packed": pk}


def test_spec_round_trip(folder, listed, tmp_path):
    for name, src in all_sources(folder, listed, tmp_path).items():
        spec = json.loads(json.dumps(src.spec()))  # JSON-serialisable, survives the trip
        assert spec["count"] == len(src)
        again = open_source(spec)
        assert type(again) is type(src), name
        assert again.spec() == spec
        jc.assert_same_samples(src, again)


def test_open_source_refuses_a_different_dataset(folder, tmp_path):
    root, files = folder
    spec = ImageFolder(root).spec()
    os.rename(root / "a" / "x.JPG", root / "a" / "x2.jpg")  # same count, other listing
    with pytest.raises(ConfigError, match="differs"):
        open_source(spec)
    write(str(root / "b" / "new.jpg"), jpeg_bytes(50))
    with pytest.raises(ConfigError, match="has 9 samples, the spec describes 8"):
        open_source(spec)


def test_open_source_bad_specs():
    with pytest.raises(ConfigError, match="not a source spec"):
        open_source({"kind": "zip"})
    with pytest.raises(ConfigError, match="not a source spec"):
        open_source("/some/path")
    with pytest.raises(ConfigError, match="does not take args.*'root'"):
        open_source({"kind": "image_folder"})
    with pytest.raises(ConfigError, match="cannot import 'no_such_module'"):
        open_source({"factory": "no_such_module:Src", "args": {}})
    with pytest.raises(ConfigError, match="has no 'Nope'"):
        open_source({"factory": "dpu_pipe.sources:Nope", "args": {}})
    with pytest.raises(ConfigError, match="not a source"):
        open_source({"factory": "builtins:dict", "args": {}})


def test_pickle(folder, listed, tmp_path):
    for name, src in all_sources(folder, listed, tmp_path).items():
        blob = pickle.dumps(src)
        again = pickle.loads(blob)
        jc.assert_same_samples(src, again)
        if name == "packed":  # pickles its path, not its data
            assert len(blob) < 1000
            assert again.path == src.path


def test_open_path_dispatch(folder, listed, tmp_path):
    srcs = all_sources(folder, listed, tmp_path)
    assert isinstance(open_path(folder[0]), ImageFolder)
    assert isinstance(open_path(srcs["packed"].path), PackedSource)
    assert isinstance(open_path(listed[0] / "list.txt"), FileList)
    with pytest.raises(ConfigError, match="does not exist"):
        open_path(tmp_path / "nothing")


def test_packed_survives_moving_the_original_tree(folder, tmp_path):
    root, files = folder
    out = tmp_path / "ds.dpk"
    expected = {rel: jpeg_bytes(seed) for rel, seed in files.items()}
    pack(ImageFolder(root), out, progress=False, transcode=False)
    shutil.rmtree(root)
    src = PackedSource(out)
    assert {src.relpath(i): src.read(i) for i in range(len(src))} == expected
