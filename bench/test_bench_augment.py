"""Per-op cost of the recipe kernels (``_augment``) on a 224x224 uint8 crop, and the per-sample
cost of each recipe's post-decode work (resize → ops → conversion → erasing), one thread.

Run:  .venv/bin/python -m pytest bench/test_bench_augment.py --benchmark-columns=min,median
      .venv/bin/python bench/test_bench_augment.py          (a plain table, µs per call)

The op cases are the magnitudes the recipes draw most (TrivialAugmentWide's bins; RandAugment
m9). The recipe rows run ``Pipeline.run_decoded`` on a decoded 375x500 photo-like image for
many sample indices, so each recipe's own mix of ops is averaged; "uint8 pass" is the classic
recipe forced through the uint8 crop (a grayscale probability that never fires) — resize to
uint8 plus the conversion pass. Timings are CPU time of the calling thread
(``time.thread_time``): the machine is shared. Nothing here asserts a timing.
"""

import argparse
import statistics
import time

import numpy as np
import pytest

from dpu_pipe import _augment, augment
from dpu_pipe.kernel import BatchProcessor
from dpu_pipe.transforms import TransformConfig

SIZE = 224
OPS = [("ShearX", 0.3), ("TranslateY", -20.0), ("Rotate", 27.0), ("Rotate", 180.0),
       ("Brightness", 0.4), ("Color", 0.5), ("Contrast", -0.4), ("Sharpness", 0.6),
       ("Posterize", 5.0), ("Solarize", 0.6), ("AutoContrast", 0.0), ("Equalize", 0.0),
       ("Invert", 0.0), ("brightness", 1.3), ("contrast", 0.8), ("saturation", 1.2),
       ("hue", 0.1), ("grayscale", 0.0)]
RECIPES = {
    "classic": {},
    "uint8 pass": dict(grayscale_p=1e-12),
    "tv-new": dict(auto_augment="ta_wide", random_erase=0.1),
    "timm-vit": dict(interpolation="bicubic", auto_augment="ra", ra_num_ops=2, ra_magnitude=9,
                     ra_mstd=0.5, ra_num_bins=11, color_jitter=0.4, random_erase=0.25),
    "erase random": dict(random_erase=1.0, erase_value="random"),
}
N_SAMPLES = 64


def _photo_like(h, w, seed=0):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([128 + 100 * np.sin(x / 37 + c) * np.cos(y / 23 - c) for c in range(3)], -1)
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


CROP = _photo_like(SIZE, SIZE)
SOURCE = _photo_like(375, 500, seed=1)


def op_runner(name, mag):
    """A callable applying op ``name`` with ``mag`` to a fresh copy of the 224 crop."""
    aug = _augment.Augmenter(augment.kernel_params(TransformConfig(size=SIZE)))
    img = CROP.copy()

    def run():
        np.copyto(img, CROP)
        aug.apply_op(img, name, mag)
        return img
    return run


def recipe_runner(kw):
    """A callable running N_SAMPLES samples of one recipe on the decoded SOURCE; None when
    this build does not know the recipe's options."""
    try:
        proc = BatchProcessor(TransformConfig(size=SIZE, **kw))
    except Exception:                      # an option of a newer build
        return None
    kernel = proc._kernel
    out = proc.empty(1)
    info = np.zeros((1, 7), np.int32)

    def run():
        for index in range(N_SAMPLES):
            kernel.run_decoded(SOURCE, index, 0, 0, out, 0, info)
        return out
    return run


@pytest.mark.benchmark(timer=time.thread_time, group="op")
@pytest.mark.parametrize("name,mag", OPS, ids=[f"{n}-{m:g}" for n, m in OPS])
def test_op(benchmark, name, mag):
    result = benchmark(op_runner(name, mag))
    assert result.shape == (SIZE, SIZE, 3)


@pytest.mark.benchmark(timer=time.thread_time, group="recipe")
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipe(benchmark, recipe):
    run = recipe_runner(RECIPES[recipe])
    if run is None:
        pytest.skip(f"this build has no {recipe!r}")
    benchmark.extra_info["samples_per_call"] = N_SAMPLES
    assert benchmark(run).shape[0] == 1


def _time(run, repeat, calls):
    best = []
    for _ in range(repeat):
        t = time.thread_time()
        for _ in range(calls):
            run()
        best.append((time.thread_time() - t) / calls)
    return statistics.median(best)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    print("op (224x224)          µs/call")
    for name, mag in OPS:
        print(f"{name + ' ' + format(mag, 'g'):22s} {_time(op_runner(name, mag), args.repeat, 20) * 1e6:8.1f}")
    print("recipe (post-decode)   µs/sample")
    for recipe, kw in RECIPES.items():
        run = recipe_runner(kw)
        if run is not None:
            print(f"{recipe:22s} {_time(run, args.repeat, 1) / N_SAMPLES * 1e6:8.1f}")


if __name__ == "__main__":
    main()
