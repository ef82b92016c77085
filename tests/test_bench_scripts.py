"""The developer benchmarks under bench/ (``bench_decode.py``, ``bench_transcode.py``,
``bench_loader.py``, ``bench_blur.py``, ``bench_cache.py``, ``bench_views.py``), run as scripts
the way a developer runs them, on a few small JPEGs: they leave the data as it was, and their JSON holds every method once with figures that add up.
Timings themselves are never asserted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jpeg_corpus as jc

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
N = 8


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    """A small ImageFolder of photographs, one of them progressive."""
    root = tmp_path_factory.mktemp("bench") / "data"
    for i in range(N):
        p = root / f"class{i % 2}" / f"{i:03d}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        img = jc.photo_sized(jc.PHOTOS[i % 3], 240 + 9 * i, 300 + 7 * i)
        p.write_bytes(jc.pil_jpeg(img, progressive=(i == 3)))
    return root


def _snapshot(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in root.rglob("*"))


def _script(name, *args, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return subprocess.run([sys.executable, str(REPO / "bench" / name), *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=280)


@pytest.mark.parametrize("packed", [False, True], ids=["folder", "packed"])
def test_bench_decode_writes_json_on_stdout(jpegs, tmp_path, packed):
    data = jpegs
    if packed:
        from dpu_pipe import pack
        from dpu_pipe.sources import FileList
        data = tmp_path / "mine.dpk"
        pack(FileList([(str(p), 0) for p in sorted(jpegs.rglob("*.jpg"))]), data,
             progress=False)
    before = _snapshot(jpegs)
    r = _script("bench_decode.py", "--data", data, "-n", 4, "--repeat", 2, "--methods",
                "pillow,dpu,dpu_batch_region_min224", "--no-pin", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["benchmark"] == "decode" and result["n"] == 4
    rows = result["rows"]
    assert [row["method"] for row in rows] == ["pillow", "dpu", "dpu_batch_region_min224"]
    for row in rows:
        assert 0 < row["img_per_s_min"] <= row["img_per_s"] <= row["img_per_s_max"]
        assert row["img_per_s"] == pytest.approx(4 / row["seconds"])
    assert rows[0]["vs_pillow"] == 1.0
    # Full decodes give every pixel: the same megapixels per image for both libraries.
    assert rows[0]["mpix_per_s"] / rows[0]["img_per_s"] == \
        pytest.approx(rows[1]["mpix_per_s"] / rows[1]["img_per_s"])
    assert _snapshot(jpegs) == before


def test_bench_decode_argument_errors_name_the_flag(tmp_path):
    for argv, flag in ((["--images", "-3"], "-n/--images"), (["--repeat", "0"], "--repeat"),
                       (["--methods", "pillow,nope"], "--methods")):
        r = _script("bench_decode.py", *argv, cwd=tmp_path)
        assert r.returncode == 2 and flag in r.stderr, (argv, r.stderr)


def test_bench_transcode_tables_add_up(jpegs, tmp_path):
    before = _snapshot(jpegs)
    out = tmp_path / "t.json"
    r = _script("bench_transcode.py", "--data", jpegs, "-n", N, "--repeat", 1, "--no-pin",
                "--json", out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["n"] == N and result["subsets"] == {"baseline": N - 1, "progressive": 1}
    assert set(result["decode"]) == {"baseline", "progressive"}
    methods = [row["method"] for row in result["decode"]["baseline"]]
    assert methods[:2] == ["Pillow full decode + crop", "region decode, original"]
    assert [m for m in methods if m.startswith("region decode, restart")] == [
        f"region decode, restart {iv}" for iv in (1, 2, 4, "row", "1-std")]
    assert 0 < result["assembly"]["assembled"] <= N
    assert 0 < result["assembly"]["sub_stream_share"] <= 1
    assert [row["method"] for row in result["end_to_end"]] == [
        "Pillow + numpy", "batch kernel, original", "batch kernel, restart 1",
        "batch kernel, restart 4", "batch kernel, restart row"]
    assert sum(result["time_split_us"].values()) == pytest.approx(
        result["time_split_total_us"])
    assert "end to end, one thread" in r.stdout
    assert _snapshot(jpegs) == before


def test_bench_loader_every_method_makes_every_batch(jpegs, tmp_path):
    r = _script("bench_loader.py", "--data", jpegs, "-n", N, "--batch-size", 4, "--threads",
                "1", "--repeat", 1, "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["images"] == N and result["batches"] == 2 and result["size"] == [224, 224]
    assert [(row["method"], row["workers"]) for row in result["rows"]] == [
        ("loader", 1), ("kernel", 1), ("pillow_threads", 1), ("pillow_processes", 1)]
    assert all(row["img_per_s"] > 0 for row in result["rows"])
    (overhead,) = result["overhead"]
    assert overhead["workers"] == 1 and overhead["loader_s"] > 0 and overhead["kernel_s"] > 0


def test_pillow_baseline_makes_the_kernels_images(jpegs):
    """bench_loader's Pillow batches crop the boxes and flips dpu_pipe's kernel draws: the
    images agree up to the resampling filter (a mirrored or shifted crop differs ~100x more)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import bench_loader
    finally:
        sys.path.remove(str(REPO / "bench"))
    from dpu_pipe import jpeg, rng
    from dpu_pipe.kernel import BatchProcessor
    from dpu_pipe.transforms import TransformConfig

    paths = [str(p) for p in sorted(jpegs.rglob("*.jpg"))]
    idx = np.arange(len(paths), dtype=np.int64)
    buffers = [Path(p).read_bytes() for p in paths]
    ours = BatchProcessor(TransformConfig(size=224)).run(buffers, idx, epoch=5, seed=3)[0]
    boxes, flips = [], []
    for i, b in enumerate(buffers):
        h = jpeg.read_header(b)
        boxes.append(rng.random_resized_crop(3, 5, i, h.height, h.width))
        flips.append(bool(rng.random_flip(3, 5, i)))
    theirs = np.empty_like(ours)
    assert bench_loader.pillow_batch(paths, idx, boxes, flips, theirs) is idx
    for i in range(len(paths)):
        assert np.abs(theirs[i] - ours[i]).mean() < 0.05, (i, boxes[i], flips[i])
    assert 0 < sum(flips) < len(paths)


def test_bench_blur_times_every_method_and_case(tmp_path):
    pytest.importorskip("torchvision")
    r = _script("bench_blur.py", "--rounds", 1, "--n", 2, "--no-pin", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["size"] == 224 and result["pinned"] is None
    assert list(result["us_per_image"]) == ["k3-s1.0", "k9-s1.0", "k23-s1.0", "k23-s2.0"]
    for times in result["us_per_image"].values():
        assert sorted(times) == ["dpu_pipe", "pillow", "torchvision"]
        assert all(t > 0 for t in times.values())


def test_bench_cache_runs_every_method_and_fills_the_cache(jpegs, tmp_path):
    before = _snapshot(jpegs)
    out = tmp_path / "cache.json"
    r = _script("bench_cache.py", "--data", jpegs, "--n", N, "--rounds", 2, "--json", out,
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["images"] == N and list(result["methods"]) == [
        "default", "max_side", "cache_first", "cache_warm"]
    assert all(len(m["wall_img_s"]) == 2 and min(m["cpu_img_s"]) > 0
               for m in result["methods"].values())
    st = result["cache_stats"]
    # The warm loader's cache: filled in its first epoch, then two epochs of hits only.
    assert st["entries"] == N and st["misses"] == N and st["hits"] == 2 * N
    assert _snapshot(jpegs) == before


def test_bench_views_times_every_method(jpegs, tmp_path):
    pytest.importorskip("torchvision")
    out = tmp_path / "views.json"
    r = _script("bench_views.py", "--data", jpegs, "--n", N, "--repeat", 1, "--json", out,
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["n"] == N
    assert sorted(result["img_per_s"]) == sorted([
        "dino", "dino-pil", "dino-v2", "simclr", "simclr-v2", "dino-v2-ftz", "simclr-v2-ftz",
        "dino-cache", "simclr-cache", "simclr-pack", "simclr-crops", "classic"])
    assert all(rate > 0 for rate in result["img_per_s"].values())
    assert "DINO" in r.stdout and "SimCLR" in r.stdout


def test_bench_views_runs_the_methods_asked_for(jpegs, tmp_path):
    pytest.importorskip("torchvision")
    out = tmp_path / "views.json"
    r = _script("bench_views.py", "--data", jpegs, "--n", N, "--repeat", 1, "--json", out,
                "--methods", "simclr,simclr-crops", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(json.loads(out.read_text())["img_per_s"]) == ["simclr", "simclr-crops"]
    assert "simclr-crops" in r.stdout          # each method's rate, with or without a baseline
    r = _script("bench_views.py", "--data", jpegs, "--methods", "simclr,nope", cwd=tmp_path)
    assert r.returncode == 2 and "unknown nope" in r.stderr, r.stderr
