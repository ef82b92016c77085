"""Loader throughput: the local Loader (num_threads 1 and 2) against the usual DataLoader path
done by hand without torch (Pillow decode + RandomResizedCrop with the same boxes + flip +
numpy normalize, in a thread pool and in a process pool of 1 and 2 workers), and the Loader's
overhead over the raw batch kernel — one interleaved run, see
``dpu_pipe.tools.bench_loader.loader_benchmark``. The table is printed; timings are never asserted.

The session is pinned to one core (conftest.py); the benchmark widens the affinity to every
core for its own run and restores it afterwards. ``DPU_PIPE_BENCH_N`` sets the images per
epoch (default 200).
"""


import numpy as np
import pytest

from dpu_pipe import rng
from dpu_pipe.tools import baselines, bench_loader
from dpu_pipe.batch import BatchProcessor
from dpu_pipe.tools.sample_data import dataset_files
from dpu_pipe.transforms import IMAGENET_MEAN, IMAGENET_STD, TransformConfig

from conftest import _bench_n

BATCH = 32


def test_pillow_baseline_makes_the_loaders_images(imagenet_like):
    """The baseline does the same work: same boxes and flips, so its images match the batch
    kernel's up to the resampling filter (a mirrored or shifted crop would differ ~100x more)."""
    Image = pytest.importorskip("PIL.Image")
    paths, _ = dataset_files(imagenet_like[0])
    paths = [str(p) for p in paths[:12]]
    cfg = TransformConfig(size=224)
    idx = np.arange(len(paths), dtype=np.int64)
    epoch, seed = 5, 3
    ours = BatchProcessor(cfg).run([open(p, "rb").read() for p in paths], idx, epoch=epoch,
                                   seed=seed)[0]
    mean = np.asarray(IMAGENET_MEAN, np.float32)
    std = np.asarray(IMAGENET_STD, np.float32)
    flips = 0
    for i, p in enumerate(paths):
        with Image.open(p) as im:
            w, h = im.size
        box = rng.random_resized_crop(seed, epoch, i, h, w)
        flip = rng.random_flip(seed, epoch, i)
        flips += flip
        theirs = np.empty((3, 224, 224), np.float32)
        baselines.pillow_sample(Image, p, box, flip, (224, 224), mean, std, theirs)
        assert np.abs(theirs - ours[i]).mean() < 0.05, (i, box, flip)
    assert 0 < flips < len(paths)


def test_loader_throughput(imagenet_like, capsys):
    n = _bench_n()
    result = bench_loader.loader_benchmark(imagenet_like[0], n=n, batch_size=min(BATCH, n),
                                    size=224, threads=(1, 2), repeat=3)
    table = bench_loader.format_loader_table(result)
    with capsys.disabled():
        print("\n\nLoader throughput (ImageNet-like sample dataset)\n" + table + "\n")
    methods = {(r["method"], r["workers"]) for r in result["rows"]}
    assert methods == {(m, k) for m in bench_loader.LOADER_METHODS for k in (1, 2)}
    assert all(r["img_per_s"] > 0 for r in result["rows"])
    assert [o["workers"] for o in result["overhead"]] == [1, 2]
