"""The sample dataset: made from real photos, deterministic, ImageNet-like, idempotent."""

import io
import json

import numpy as np
import pytest

PIL = pytest.importorskip("PIL")
pytest.importorskip("skimage")
from PIL import Image, JpegImagePlugin  # noqa: E402

from dpu_pipe import ConfigError  # noqa: E402
from dpu_pipe.tools.sample_data import (MANIFEST_NAME, class_names, dataset_files,  # noqa: E402
                                  make_imagenet_like, photo_corpus)

N = 20
CLASSES = 4

# Pillow's get_sampling: -1 unknown/gray, 0 = 4:4:4, 1 = 4:2:2, 2 = 4:2:0.
SAMPLING_NAMES = {0: "4:4:4", 1: "4:2:2", 2: "4:2:0"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagenet_like") / "ds"
    stats = make_imagenet_like(root, n=N, classes=CLASSES, seed=3)
    return root, stats


def _all_bytes(root):
    paths, _ = dataset_files(root)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in paths}


def test_corpus_is_real_colour_photographs():
    photos = photo_corpus()
    names = [n for n, _ in photos]
    assert len(photos) >= 8 and len(set(names)) == len(names)
    assert "skimage/astronaut" in names and "skimage/coffee" in names
    for name, img in photos:
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3, name
        assert min(img.shape[:2]) >= 300, name
        assert not img.flags.writeable, name
        # A photograph has colour (channels differ) and is spatially smooth: neighbouring pixels
        # differ far less than random pixel pairs do. Noise would fail the second check.
        g = img.astype(np.float32)
        assert np.abs(g[..., 0] - g[..., 2]).mean() > 5, name
        neighbour = np.abs(np.diff(g, axis=1)).mean()
        shuffled = np.random.default_rng(0).permutation(g.reshape(-1, 3))
        random_pairs = np.abs(np.diff(shuffled[:100_000], axis=0)).mean()
        assert neighbour < 0.5 * random_pairs, name


def test_layout_labels_and_decode(dataset):
    root, stats = dataset
    paths, labels = dataset_files(root)
    assert len(paths) == N == stats["count"]
    names = class_names(CLASSES)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == names
    for i, (p, label) in enumerate(zip(paths, labels)):
        assert p.name == f"{i:06d}.JPEG"
        assert label == i % CLASSES and p.parent.name == names[label]
        with Image.open(p) as im:
            assert im.format == "JPEG"
            im.load()
            assert im.mode in ("RGB", "L")
            assert 60 <= min(im.size) and max(im.size) <= 1300


def test_stats_match_the_files(dataset):
    root, stats = dataset
    paths, _ = dataset_files(root)
    widths, heights, sizes = [], [], []
    progressive = gray = 0
    sub = {"4:2:0": 0, "4:2:2": 0, "4:4:4": 0, "gray": 0}
    for p in paths:
        data = p.read_bytes()
        sizes.append(len(data))
        with Image.open(io.BytesIO(data)) as im:
            widths.append(im.size[0])
            heights.append(im.size[1])
            progressive += bool(im.info.get("progressive") or im.info.get("progression"))
            if im.mode == "L":
                gray += 1
                sub["gray"] += 1
            else:
                sub[SAMPLING_NAMES[JpegImagePlugin.get_sampling(im)]] += 1
    assert stats["mean_width"] == pytest.approx(np.mean(widths), abs=0.0501)
    assert stats["mean_height"] == pytest.approx(np.mean(heights), abs=0.0501)
    assert stats["mean_bytes"] == pytest.approx(np.mean(sizes), abs=0.0501)  # 1 decimal
    assert stats["total_bytes"] == sum(sizes)
    assert stats["progressive"] == progressive
    assert stats["gray"] == gray
    assert stats["subsampling"] == sub


def test_proportions_are_imagenet_like():
    """The documented distributions, checked on a sample large enough to be stable (the
    per-image draws are cheap; only encoding is skipped here)."""
    from dpu_pipe.tools.sample_data import _draw_size

    sizes = np.array([_draw_size(np.random.default_rng(np.random.SeedSequence([0, i])))
                      for i in range(4000)])
    w, h = sizes[:, 0], sizes[:, 1]
    assert 440 <= w.mean() <= 520 and 360 <= h.mean() <= 440
    long_side = np.maximum(w, h)
    assert 0.70 <= np.mean(long_side == 500) <= 0.85
    assert 0.18 <= np.mean(h > w) <= 0.32
    assert 0.05 <= np.mean(long_side >= 700) and long_side.max() <= 1200
    assert 0.07 <= np.mean(long_side < 450) <= 0.13
    landscape = (w == 500) & (h < w)
    assert np.mean(landscape & (h == 375)) > 0.2 and np.mean(landscape & (h == 333)) > 0.1


def test_encoder_settings_follow_the_documented_mix(dataset):
    root, stats = dataset
    assert 100 <= stats["mean_width"] and 100 <= stats["mean_height"]
    sub = stats["subsampling"]
    assert sum(sub.values()) == N
    # With 20 files, 80 % 4:2:0 gives at least 11 of them with probability > 0.999.
    assert sub["4:2:0"] >= 11
    assert stats["progressive"] <= 8 and stats["gray"] <= 5
    assert 75 <= stats["quality_mean"] <= 95
    assert stats["corpus"] == [n for n, _ in photo_corpus()]


def test_same_seed_same_bytes_other_seed_other_bytes(dataset, tmp_path):
    root, stats = dataset
    again = make_imagenet_like(tmp_path / "again", n=N, classes=CLASSES, seed=3)
    assert _all_bytes(root) == _all_bytes(tmp_path / "again")
    assert {k: v for k, v in again.items() if k != "root"} == \
        {k: v for k, v in stats.items() if k != "root"}
    # Image i depends on (seed, i) only, so a larger dataset starts with the same files.
    make_imagenet_like(tmp_path / "longer", n=N + 3, classes=CLASSES, seed=3)
    longer = _all_bytes(tmp_path / "longer")
    assert all(longer[k] == v for k, v in _all_bytes(root).items())
    make_imagenet_like(tmp_path / "other", n=N, classes=CLASSES, seed=4)
    other = _all_bytes(tmp_path / "other")
    assert sum(other[k] == v for k, v in _all_bytes(root).items()) == 0


def test_idempotent_and_rebuilds_on_change(tmp_path):
    root = tmp_path / "ds"
    make_imagenet_like(root, n=5, classes=2, seed=0)
    first = root / "n00000000" / "000000.JPEG"
    mtime = first.stat().st_mtime_ns
    make_imagenet_like(root, n=5, classes=2, seed=0)
    assert first.stat().st_mtime_ns == mtime  # not rewritten

    # A damaged file makes the dataset incomplete: it is rebuilt with the same bytes.
    original = first.read_bytes()
    first.write_bytes(original[:100])
    make_imagenet_like(root, n=5, classes=2, seed=0)
    assert first.read_bytes() == original

    # Other parameters replace the dataset, with no stale files left behind.
    make_imagenet_like(root, n=3, classes=3, seed=0)
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.JPEG"))
    assert files == ["n00000000/000000.JPEG", "n00000001/000001.JPEG", "n00000002/000002.JPEG"]
    assert json.loads((root / MANIFEST_NAME).read_text())["params"]["n"] == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries


def test_refuses_foreign_directory_and_bad_arguments(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not made by make_imagenet_like"):
        make_imagenet_like(tmp_path, n=2)
    assert (tmp_path / "mine.txt").read_text() == "keep me"
    for kwargs, match in [(dict(n=0), "n must be"), (dict(classes=0), "classes must be"),
                          (dict(seed=-1), "seed must be"), (dict(n=2.5), "n must be"),
                          (dict(n=10**6), r"n must be an integer in \[1, 999999\]")]:
        with pytest.raises(ConfigError, match=match):
            make_imagenet_like(tmp_path / "new", **kwargs)
    with pytest.raises(ConfigError, match="no dataset"):
        dataset_files(tmp_path)


def test_missing_scikit_image_names_the_pip_package(monkeypatch):
    from dpu_pipe.tools import sample_data

    monkeypatch.setattr(sample_data, "_package_dir", lambda name: None)
    sample_data.photo_corpus.cache_clear()
    try:
        with pytest.raises(ConfigError, match="pip install scikit-image"):
            photo_corpus()
    finally:
        monkeypatch.undo()
        sample_data.photo_corpus.cache_clear()
    assert photo_corpus()
