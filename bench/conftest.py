"""Shared set-up of the decode microbenchmarks (``pytest bench``, pytest-benchmark).

The ImageNet-like sample dataset is made once from real photographs under
``$XDG_CACHE_HOME/dpu_pipe`` (``~/.cache/dpu_pipe``, the same place ``dpu-pipe bench`` uses) and
reused by later runs. File bytes and RandomResizedCrop boxes are prepared before any timing;
the session runs pinned to one core with OpenCV on one thread
(``dpu_pipe.tools.harness.one_core``), as ``bench_decode.py`` does.

``DPU_PIPE_BENCH_N`` sets the number of images (default 200: each benchmark round decodes all of
them, keeping a full run well under a minute per method).
"""

import io
import os
from pathlib import Path

import pytest



def _bench_n():
    raw = os.environ.get("DPU_PIPE_BENCH_N", "200")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise pytest.UsageError(f"DPU_PIPE_BENCH_N must be a positive integer, got {raw!r}")
    return n


@pytest.fixture(scope="session", autouse=True)
def one_core():
    """Pin the session to one core and OpenCV to one thread; restored afterwards."""
    from dpu_pipe.tools.harness import one_core

    with one_core():
        yield


@pytest.fixture(scope="session")
def imagenet_like():
    """(root, stats) of the cached sample dataset (1000 images; benchmarks use the first N)."""
    pytest.importorskip("PIL")
    pytest.importorskip("skimage")
    from dpu_pipe.tools.sample_data import default_cache_dir, make_imagenet_like

    root = Path(default_cache_dir()) / "imagenet_like_n1000_s0"
    stats = make_imagenet_like(root, n=1000, classes=10, seed=0, progress=True)
    return root, stats


@pytest.fixture(scope="session")
def decode_inputs(imagenet_like):
    """(buffers, sizes, boxes): the first N files' bytes, their (height, width) and the
    RandomResizedCrop boxes (N, 4) drawn with seed 0."""
    from PIL import Image

    from bench_decode import random_resized_crop_boxes
    from dpu_pipe.tools.harness import load_buffers

    _, buffers = load_buffers(imagenet_like[0], _bench_n())
    sizes = []
    for b in buffers:
        with Image.open(io.BytesIO(b)) as im:
            sizes.append((im.size[1], im.size[0]))
    return buffers, sizes, random_resized_crop_boxes(sizes, seed=0)
