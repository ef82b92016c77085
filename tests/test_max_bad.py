"""The failure budget: ``max_bad`` bad samples (a count, or a fraction of the rank's shard)
are skipped; one more is a DecodeError that names the first failures."""

import os

import numpy as np
import pytest

from dpu_pipe import Loader
from dpu_pipe.errors import ConfigError, DecodeError
from dpu_pipe.sources import ImageFolder

import dataset_formats as dfm


def damaged_folder(root, bad):
    """An ImageFolder of 24 images (3 classes) whose samples ``bad`` are not images."""
    dfm.make_folder(root, classes=3, per_class=8, pngs=False)
    src = ImageFolder(root)
    for i in bad:
        with open(os.path.join(root, src.relpath(i)), "wb") as f:
            f.write(b"not an image at all")
    return src


def drain(loader):
    return [(x.copy(), y.copy()) for x, y in loader]


def test_within_budget_skips_like_skip(tmp_path):
    src = damaged_folder(str(tmp_path / "d"), [3, 10])
    want = drain(Loader(src, 4, train=False, size=16, on_error="skip"))
    for budget in (2, 0.1, 0.5):
        got = drain(Loader(src, 4, train=False, size=16, on_error="skip", max_bad=budget))
        assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
                   for a, b in zip(got, want))


@pytest.mark.parametrize("budget", [1, 0.05], ids=["count", "fraction"])
def test_past_the_budget_a_decode_error_summarizes(tmp_path, budget):
    src = damaged_folder(str(tmp_path / "d"), [3, 10, 17])
    with pytest.raises(DecodeError) as ei:
        drain(Loader(src, 4, train=False, size=16, on_error="skip", max_bad=budget))
    text = str(ei.value)
    assert f"max_bad={budget}" in text and "bad samples" in text
    assert src.relpath(3) in text and src.relpath(10) in text


def test_bad_budget_arguments(tmp_path):
    src = damaged_folder(str(tmp_path / "d"), [])
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(ConfigError, match="max_bad"):
            Loader(src, 4, on_error="skip", max_bad=bad)
    with pytest.raises(ConfigError, match="max_bad.*on_error='skip'"):
        Loader(src, 4, max_bad=3)
