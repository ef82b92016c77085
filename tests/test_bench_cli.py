"""``dpu-pipe bench`` on a user's own data: read only, numbers that add up, JSON and
plots, argument errors that name the flag; generated data under the XDG cache."""

import json
import os

import numpy as np
import pytest
from PIL import Image

import jpeg_corpus as jc
from dpu_pipe.tools import cli
from dpu_pipe.tools.sample_data import default_cache_dir

pytestmark = pytest.mark.timeout(300)

N = 12


@pytest.fixture(scope="module")
def user_data(tmp_path_factory):
    """A user's small ImageFolder (not made by dpu_pipe), with one PNG posing as a .jpg."""
    root = tmp_path_factory.mktemp("user") / "mine"
    for i in range(N):
        p = root / f"class{i % 3}" / f"{i:03d}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(jc.pil_jpeg(jc.photo_sized(jc.PHOTOS[i % 3], 240 + 7 * i, 300 + 5 * i)))
    Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(root / "class0" / "png.jpg", "PNG")
    return root


def _snapshot(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in root.rglob("*"))


def test_bench_measures_the_users_data_and_writes_nothing_there(user_data, tmp_path, capsys):
    before = _snapshot(user_data)
    out = tmp_path / "r.json"
    status = cli.main(["bench", "--data", str(user_data), "-n", "100", "--repeat", "2",
                       "--threads", "1", "--json", str(out), "--plots", str(tmp_path / "p")])
    assert status == 0
    assert _snapshot(user_data) == before
    result = json.loads(out.read_text())
    assert result["n"] == N and result["skipped_undecodable"] == 1
    assert result["mad_vs_pillow"] < 0.05   # the same crops and flips as Pillow's
    sp = result["split_ms"]
    assert sp["decode"] > 0 and sp["total"] > 0   # (a loaded machine can swap them on 12)
    assert sp["decode"] + sp["augment"] == pytest.approx(sp["total"])
    for r in result["rows"]:
        assert 0 < r["min"] <= r["img_per_s"] <= r["max"]
    table = capsys.readouterr().out
    assert f"{N} images of {user_data}" in table and f"= {sp['total']:.2f} ms" in table
    for name in ("augment_rates.png", "augment_split.png"):
        with Image.open(tmp_path / "p" / name) as im:
            assert im.format == "PNG" and im.size[0] > 300


@pytest.mark.parametrize("argv, flag", [
    (["bench", "-n", "0"], "-n/--images"), (["bench", "--images", "-3"], "-n/--images"),
    (["bench", "--repeat", "0"], "--repeat"), (["bench", "--seed", "x"], "--seed"),
    (["pack", "a", "b", "--alignment", "0"], "--alignment")])
def test_argument_errors_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["pack", "info", "bench", "bench-train", "demo", "plan"])
def test_every_option_has_help(command):
    parser = cli._parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in [(command, sub.choices[command])]:
        for action in p._actions:
            assert action.help, (name, action.option_strings or action.dest)


def test_generated_data_goes_to_the_xdg_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == os.path.join(str(tmp_path), "dpu_pipe")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == os.path.join(str(tmp_path), "home", ".cache", "dpu_pipe")


def test_bench_baselines_cut_the_same_crop_and_flip():
    """Pillow's and OpenCV's methods of ``dpu-pipe bench`` make the same sample up to their
    resampling filters; a mirrored crop differs many times more."""
    from dpu_pipe.tools.bench_augment import opencv_augment, pillow_augment

    pytest.importorskip("cv2")
    data = jc.pil_jpeg(jc.photo_sized(jc.PHOTOS[0], 360, 480), quality=95)
    box = (40, 100, 250, 300)
    out = {}
    for name, fn in (("pillow", pillow_augment), ("opencv", opencv_augment)):
        for flip in (False, True):
            out[name, flip] = np.empty((3, 224, 224), np.float32)
            fn(data, box, flip, out[name, flip])
    same = np.abs(out["pillow", True] - out["opencv", True]).mean()
    assert same < 0.05
    assert np.abs(out["pillow", False] - out["opencv", True]).mean() > 5 * same
    assert np.abs(out["pillow", True][:, :, ::-1] - out["pillow", False]).max() < 1e-5
