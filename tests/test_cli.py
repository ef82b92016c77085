"""The dpu-pipe command line, run as `python -m dpu_pipe` in a subprocess like a user would."""

import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import dpu_pipe
from dpu_pipe.tools import cli
from dpu_pipe import pack
from dpu_pipe.packed.format import VERSION
from dpu_pipe.sources import FileList, ImageFolder, PackedSource

REPO = os.path.dirname(os.path.dirname(os.path.abspath(dpu_pipe.__file__)))


def run(*args, cwd):
    env = dict(os.environ)
    # The package under test, whether or not it is installed in this interpreter.
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "dpu_pipe", *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


def make_tree(root):
    for k, rel in enumerate(["cat/a.jpg", "cat/b.jpg", "dog/c.JPEG", "dog/sub/d.jpg",
                             "eel/e.jpg"]):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.fromarray(np.full((6 + k, 7, 3), 30 * k, np.uint8)).save(buf, format="JPEG")
        p.write_bytes(buf.getvalue())
    (root / "dog" / "notes.txt").write_text("not an image")
    return root


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path / "ds")


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    """One directory with a dataset and the broken inputs the error cases use."""
    d = tmp_path_factory.mktemp("bad_inputs")
    make_tree(d / "ds")
    (d / "bad.txt").write_text("a.jpg 1\nb.jpg seven\n")
    (d / "foreign.dpk").write_text("x,x\n")  # a text file, whatever its name
    (d / "gone.txt").write_text("no_such.jpg 0\n")
    pack(ImageFolder(d / "ds"), d / "good.dpk", progress=False, transcode=False)
    shutil.copytree(d / "good.dpk", d / "broken.dpk")
    manifest = d / "broken.dpk" / "manifest.dpk"
    manifest.write_bytes(manifest.read_bytes()[:-10])
    return d


def test_pack_image_folder(tree, tmp_path):
    out = tmp_path / "ds.dpk"
    r = run("pack", tree, out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "5 records (5 JPEG) in 1 shards" in r.stdout and "CRCs checked" in r.stdout
    src, packed = ImageFolder(tree), PackedSource(out)
    growth = packed.dataset.meta["data_bytes"] / packed.dataset.meta["orig_bytes"] - 1
    assert f"5 JPEGs transcoded ({100 * growth:+.1f} % in size)" in r.stdout
    assert packed.classes == ["cat", "dog", "eel"]
    assert np.array_equal(packed.labels, src.labels)
    for i in range(5):  # transcoded losslessly
        assert np.array_equal(dpu_pipe.jpeg.decode(packed.read(i)),
                              dpu_pipe.jpeg.decode(src.read(i)))
    r = run("info", out, "--json", cwd=tmp_path)
    info = json.loads(r.stdout)["dataset"]
    assert info["transcoded"] == 5 and info["size_growth"] == pytest.approx(growth)
    assert info["original_bytes"] == sum(len(src.read(i)) for i in range(5))


def test_pack_file_list_with_root(tree, tmp_path):
    lst = tmp_path / "val.txt"
    lst.write_text("eel/e.jpg 4\ncat/a.jpg 9\n")
    out = tmp_path / "val.dpk"
    r = run("pack", lst, out, "--root", tree, "--quiet", "--alignment", "4096",
            "--no-transcode", "--shard-size", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    summary = json.loads(r.stdout)
    assert (summary["count"], summary["shards"], summary["verified"]) == (2, 2, True)
    packed = PackedSource(out)
    assert packed.labels.tolist() == [4, 9]
    assert packed.read(0) == (tree / "eel" / "e.jpg").read_bytes()
    assert all(packed.dataset.entry(i)["offset"] % 4096 == 0 for i in range(2))
    assert packed.spec()["count"] == len(FileList(lst, root=tree))


def test_info_summarises_folder_and_packed_dataset(tree, tmp_path):
    out = tmp_path / "ds.dpk"
    assert run("pack", tree, out, "-q", "--no-transcode", cwd=tmp_path).returncode == 0
    jpeg_bytes = sum(p.stat().st_size for p in tree.rglob("*") if p.suffix.lower() in
                     (".jpg", ".jpeg"))
    r = run("info", tree, "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    folder = json.loads(r.stdout)["dataset"]
    assert folder["format"] == "ImageFolder directory"
    assert folder["count"] == 5 and folder["total_bytes"] == jpeg_bytes
    assert folder["classes"] == ["cat", "dog", "eel"] and folder["label_range"] == [0, 2]
    r = run("info", "--data", out, "--json", "--verify", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    packed = json.loads(r.stdout)["dataset"]
    assert packed["format"] == f"dpu_pipe packed v{VERSION}" and packed["bad_shards"] == {}
    keys = ("count", "total_bytes", "classes", "num_labels", "label_range")
    assert {k: packed[k] for k in keys} == {k: folder[k] for k in keys}
    assert (packed["original_bytes"], packed["transcoded"], packed["size_growth"]) == \
        (jpeg_bytes, 0, 0.0)
    flip = out / "shard-000000.dpks"  # a shard checked on its own names its bad record
    raw = bytearray(flip.read_bytes())
    raw[200] ^= 0xFF
    flip.write_bytes(bytes(raw))
    r = run("info", "--data", flip, "--verify", "--json", cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    shard = json.loads(r.stdout)["dataset"]
    assert shard["format"] == f"dpu_pipe packed v{VERSION} shard" and shard["count"] == 5
    assert "1 of 5 records fail their CRC check" in shard["bad_shards"]["0"]
    r = run("info", out, cwd=tmp_path)  # human-readable form
    assert r.returncode == 0, r.stderr
    assert "dpu_pipe build:" in r.stdout and "dataset:" in r.stdout
    assert "count           5" in r.stdout and "3: cat, dog, eel" in r.stdout
    assert "decoded cache (cache_bytes):" in r.stdout and "table_bytes  256" in r.stdout


def test_info_build(tmp_path):
    r = run("info", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["build"] == json.loads(json.dumps(dpu_pipe.build_info()))
    # The decoded cache's overhead: 24 bytes per sample, stored samples 16-byte aligned.
    assert json.loads(r.stdout)["cache"] == {"entry_bytes": 24, "align": 16}


@pytest.mark.parametrize("args, status, message", [
    (["pack", "missing_dir", "x.dpk"], 2, "dataset path does not exist"),
    (["pack", "bad.txt", "x.dpk"], 2, "bad.txt, line 2: label 'seven' is not an integer"),
    (["pack", "foreign.dpk", "x.dpk"], 2, "label 'x' is not an integer"),
    (["pack", "broken.dpk", "x.dpk"], 2, "truncated"),
    (["pack", "ds", "x.dpk", "--shard-size", "lots"], 2,
     "argument --shard-size: not a size: 'lots'"),
    (["pack", "ds", "x.dpk", "--restart-interval", "0"], 2,
     "argument --restart-interval: must be an integer >= 1"),
    (["info", "--verify"], 2, "--verify and --root need a dataset"),
    (["info", "ds", "--verify"], 2, "--verify applies to packed datasets"),
    (["pack", "ds", "x.dpk", "--alignment", "3"], 2, "power of two"),
    (["pack", "gone.txt", "x.dpk"], 1, "cannot read"),
    (["info", "broken.dpk"], 2, "truncated"),
    ([], 2, "required: COMMAND"),
    (["frobnicate"], 2, "invalid choice"),
])
def test_errors_and_exit_status(bad_inputs, args, status, message):
    r = run(*args, cwd=bad_inputs)
    assert r.returncode == status, (r.stdout, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert not (bad_inputs / "x.dpk").exists()


def test_adding_a_subcommand_is_one_entry(monkeypatch, capsys):
    def add_args(p):
        p.add_argument("--times", type=int, default=1)

    def hello(args):
        print("hello " * args.times)
        return 3

    monkeypatch.setitem(cli.COMMANDS, "hello", ("say hello", add_args, hello))
    assert cli.main(["hello", "--times", "2"]) == 3
    assert capsys.readouterr().out.strip() == "hello hello"
    # Entries may name their functions as "module:function", imported on use.
    monkeypatch.setitem(cli.COMMANDS, "hello2",
                        ("say hello", "dpu_pipe.tools.cli:_info_args", "dpu_pipe.tools.cli:_info_run"))
    with pytest.raises(SystemExit):
        cli.main(["hello2", "--help"])
    assert "--json" in capsys.readouterr().out


def test_info_summarises_tar_shards_and_parquet(tmp_path):
    from dataset_formats import make_folder, write_parquet, write_tars

    folder = ImageFolder(make_folder(tmp_path / "folder", classes=3, per_class=4, pngs=False))
    shards = write_tars(folder, str(tmp_path / "train-%04d.tar"), 5)
    parquet = write_parquet(folder, str(tmp_path / "train.parquet"))
    expected = {"count": len(folder), "num_labels": 3, "label_range": [0, 2]}
    for path, kind, files in ((str(tmp_path / "train-{0000..0002}.tar"), "WebDataset", shards),
                              (parquet, "ParquetSource", [parquet])):
        r = run("info", path, "--json", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)["dataset"]
        assert got["format"] == f"{kind} ({len(files)} files)"
        assert {k: got[k] for k in expected} == expected
        assert got["total_bytes"] == sum(os.path.getsize(f) for f in files)
