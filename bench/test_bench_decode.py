"""Decode microbenchmarks: one pytest-benchmark per method of ``bench_decode.METHODS``.

Each benchmark round decodes every image of the sample (see conftest.py); ``extra_info`` holds
the images per second of the median round. Timings are reported, never asserted.
``python bench/bench_decode.py`` gives the interleaved comparison table.
"""

import numpy as np
import pytest

from bench_decode import BATCH, METHODS, decode_methods, random_resized_crop_boxes

ROUNDS = 5


@pytest.mark.parametrize("method", list(METHODS))
def test_decode(benchmark, decode_inputs, method):
    buffers, sizes, boxes = decode_inputs
    if method == "opencv":
        pytest.importorskip("cv2")
    (description, fn), = decode_methods(buffers, boxes, [method]).values()
    starts = range(0, len(buffers), BATCH if method == "dpu_batch_region_min224" else 1)

    def decode_all():
        for i in starts:
            fn(i)

    benchmark.group = "decode"
    benchmark.extra_info["description"] = description
    benchmark.extra_info["images"] = len(buffers)
    benchmark.pedantic(decode_all, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    benchmark.extra_info["img_per_s"] = round(len(buffers) / benchmark.stats.stats.median, 1)


def test_crop_boxes_follow_random_resized_crop():
    """The boxes the region benchmarks decode obey torchvision's RandomResizedCrop rules."""
    rng = np.random.default_rng(1)
    sizes = [(int(h), int(w)) for h, w in rng.integers(20, 1200, size=(2000, 2))]
    sizes += [(20, 1000), (1000, 20), (300, 300)]  # no box of share >= 0.08 fits the first two
    boxes = random_resized_crop_boxes(sizes, seed=0)
    assert not np.array_equal(boxes, random_resized_crop_boxes(sizes, seed=1))  # seed is used
    fallback = 0
    for (H, W), (top, left, h, w) in zip(sizes, boxes):
        assert 0 <= top and top + h <= H and 0 <= left and left + w <= W and h > 0 and w > 0
        central = top == (H - h) // 2 and left == (W - w) // 2
        share, aspect = h * w / (H * W), w / h
        # Rounding of h and w to whole pixels widens the bounds by about one pixel per side.
        tol_area = (h + w + 1) / (H * W)
        tol_aspect = aspect * (1 / h + 1 / w) * 1.01
        in_rules = (0.08 - tol_area <= share <= 1 + tol_area
                    and 3 / 4 - tol_aspect <= aspect <= 4 / 3 + tol_aspect)
        if not in_rules:
            # The central fallback: the largest box of the clamped aspect, centred.
            assert central and (h == H or w == W), (H, W, h, w)
            fallback += 1
    assert tuple(boxes[-3]) == (0, 486, 20, 27) and tuple(boxes[-2]) == (486, 0, 27, 20)
    assert fallback >= 2
    # On square images most first attempts fit: shares then cover the whole [0.08, 1] range.
    square = random_resized_crop_boxes([(1000, 1000)] * 500, seed=2)
    shares = square[:, 2] * square[:, 3] / 1e6
    assert shares.min() >= 0.079 and np.mean(shares < 0.2) > 0.05 and np.mean(shares > 0.8) > 0.02
