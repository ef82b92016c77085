"""Per-image transform after decode, 224x224 output, one thread: the dpu_pipe kernel against
Pillow resize + numpy normalize and OpenCV resize + numpy normalize.

Run:  .venv/bin/python -m pytest bench/test_bench_ops.py --benchmark-columns=min,median,mean
      (add --benchmark-group-by=group to compare methods per crop)

Crops are those RandomResizedCrop and the validation transform produce on a 500x375 image:
  down   a 280x300 box (scale ~0.45 of the area) shrunk to 224 — antialiasing at work
  big    a 400x370 box (scale ~0.8), nearly the whole image, shrunk to 224
  up     a 101x120 box (scale ~0.065) enlarged to 224 — about 40 % of ImageNet train crops
  val    shorter side to 256, centre 224 crop (a 438x328 box)
Every method produces float32 CHW normalized with the ImageNet mean/std unless its name says
otherwise. OpenCV cannot take a fractional box, so it crops the box rounded to whole pixels.

Timings are CPU time of the calling thread (``time.thread_time``): the machine is shared, and
wall time would also count other processes' time slices. Nothing here asserts a timing.
"""

import time

import numpy as np
import pytest

from dpu_pipe import ops

Image = pytest.importorskip("PIL.Image")
cv2 = pytest.importorskip("cv2")

SIZE = 224
MEAN = np.array(ops.IMAGENET_MEAN, np.float32)
STD = np.array(ops.IMAGENET_STD, np.float32)
CROPS = {
    "down": (30.5, 40.25, 300.3, 280.7),
    "big": (2.3, 50.6, 370.2, 400.4),
    "up": (10.2, 20.7, 120.4, 100.9),
    "val": ops.center_crop_box(375, 500, SIZE, 256),
}


def _photo_like():
    """375x500 RGB with smooth structure and fine noise (resampling cost does not depend on
    content, but it keeps the outputs meaningful)."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:375, 0:500].astype(np.float32)
    base = np.stack([128 + 100 * np.sin(x / 37 + c) * np.cos(y / 23 - c) for c in range(3)], -1)
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


IMG = _photo_like()
PIL_IMG = Image.fromarray(IMG)


def _normalize_chw(a):
    return np.ascontiguousarray(((a.astype(np.float32) / 255 - MEAN) / STD).transpose(2, 0, 1))


def _cv2_crop(box):
    y0, x0, h, w = box
    top, left = int(round(y0)), int(round(x0))
    return IMG[top:top + int(round(h)), left:left + int(round(w))]


@pytest.fixture(autouse=True, scope="module")
def _one_opencv_thread():
    threads = cv2.getNumThreads()
    cv2.setNumThreads(1)
    yield
    cv2.setNumThreads(threads)


def _run(benchmark, crop, fn):
    benchmark.group = f"crop-{crop}"
    benchmark.extra_info["crop_box"] = CROPS[crop]
    result = benchmark(fn)
    assert result.shape in ((3, SIZE, SIZE), (SIZE, SIZE, 3))


@pytest.mark.benchmark(timer=time.thread_time)
@pytest.mark.parametrize("crop", list(CROPS))
@pytest.mark.parametrize("variant", ["float32-CHW", "float32-CHW-flip", "float32-HWC",
                                     "uint8-HWC", "float16-CHW"])
def test_dpu_pipe_kernel(benchmark, crop, variant):
    dtype, layout = variant.split("-")[:2]
    flip = variant.endswith("flip")
    out = np.empty(ops.output_shape(SIZE, layout), dtype)
    box = CROPS[crop]
    _run(benchmark, crop, lambda: ops.resize_crop(IMG, box, SIZE, flip=flip, dtype=dtype,
                                                  layout=layout, out=out))


@pytest.mark.benchmark(timer=time.thread_time)
@pytest.mark.parametrize("crop", list(CROPS))
def test_pillow_resize_numpy_normalize(benchmark, crop):
    y0, x0, h, w = CROPS[crop]
    box = (x0, y0, x0 + w, y0 + h)
    _run(benchmark, crop, lambda: _normalize_chw(
        np.asarray(PIL_IMG.resize((SIZE, SIZE), Image.BILINEAR, box=box))))


@pytest.mark.benchmark(timer=time.thread_time)
@pytest.mark.parametrize("crop", list(CROPS))
def test_pillow_resize_only_uint8(benchmark, crop):
    y0, x0, h, w = CROPS[crop]
    box = (x0, y0, x0 + w, y0 + h)
    _run(benchmark, crop, lambda: np.asarray(
        PIL_IMG.resize((SIZE, SIZE), Image.BILINEAR, box=box)))


@pytest.mark.benchmark(timer=time.thread_time)
@pytest.mark.parametrize("crop", list(CROPS))
@pytest.mark.parametrize("interp", ["INTER_AREA", "INTER_LINEAR"])
def test_opencv_resize_numpy_normalize(benchmark, crop, interp):
    src = _cv2_crop(CROPS[crop])
    flag = getattr(cv2, interp)
    _run(benchmark, crop, lambda: _normalize_chw(cv2.resize(src, (SIZE, SIZE),
                                                            interpolation=flag)))
