"""The per-image transform kernel (dpu_pipe.ops / dpu_pipe._ops) against references.

References:
  * ``reference()``: Pillow's antialiased bilinear resampling (Resample.c, precompute_coeffs)
    re-implemented here in float64 numpy as dense matrices, slow and plain. The kernel must
    match it within TOL (float32 arithmetic and rounding of the output dtype only).
  * Pillow itself (``Image.resize(size, BILINEAR, box=...)``, 8-bit fixed point, intermediate
    rounded to uint8): within 1 level of 255.

Tolerance per dtype, on the normalized scale (x/255 - mean)/std unless noted:
  float32  |kernel - reference| <= 3e-5   (measured max ~1e-6; float32 sums of up to 37 taps)
  float16  |kernel - reference| <= one float16 spacing at that magnitude (+ the float32 bound)
  uint8    |kernel - round_half_up(reference)| <= 1, and equal wherever the reference is
           further than 1e-3 from a rounding boundary (float32 vs float64 can only disagree there)
  vs Pillow (uint8): max difference 1; Pillow's uint8 intermediate moves ~20 % of pixels by 1.
"""

import functools
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dpu_pipe import ConfigError, ops
from dpu_pipe import _ops

import kernel_probes

Image = pytest.importorskip("PIL.Image")

MEAN = np.array(ops.IMAGENET_MEAN)
STD = np.array(ops.IMAGENET_STD)
F32_ATOL = 3e-5


@pytest.fixture(scope="module")
def probe():
    """tests/kernels/_ops_probe.pyx, built for this dpu_pipe: the kernel's plans, a forced pass
    order and the float16 conversions, which the package does not expose."""
    return kernel_probes.load("_ops_probe")


# --- reference ------------------------------------------------------------------------------

def pillow_matrix(in_size, in0, length, n_out):
    """Dense (n_out, in_size) resampling matrix of Pillow's precompute_coeffs, BILINEAR."""
    scale = length / n_out
    filterscale = max(scale, 1.0)
    support = 1.0 * filterscale
    m = np.zeros((n_out, in_size))
    for xx in range(n_out):
        center = in0 + (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)   # int() truncates toward 0, like C
        xmax = min(int(center + support + 0.5), in_size)
        x = np.arange(xmin, xmax)
        w = np.maximum(1.0 - np.abs((x - center + 0.5) * (1.0 / filterscale)), 0.0)
        m[xx, xmin:xmax] = w / w.sum()
    return m


def reference(img, box, size):
    """float64 (oh, ow, 3) resampling of box (y0, x0, h, w) of img, values 0..255."""
    y0, x0, h, w = box
    oh, ow = size
    my = pillow_matrix(img.shape[0], y0, h, oh)
    mx = pillow_matrix(img.shape[1], x0, w, ow)
    tmp = np.tensordot(img.astype(np.float64), mx, axes=(1, 1))     # (H, 3, ow)
    return np.tensordot(my, tmp, axes=(1, 0)).transpose(0, 2, 1)    # (oh, ow, 3)


def expected(ref, *, flip, dtype, layout):
    if flip:
        ref = ref[:, ::-1]
    if dtype != "uint8":
        ref = (ref / 255.0 - MEAN) / STD
    return ref.transpose(2, 0, 1) if layout == "CHW" else ref


def check_close(got, want, dtype):
    """Assert the per-dtype tolerance of the module docstring."""
    if dtype == "float32":
        err = np.abs(got.astype(np.float64) - want)
        assert err.max() <= F32_ATOL, f"max error {err.max():.3g}"
    elif dtype == "float16":
        err = np.abs(got.astype(np.float64) - want)
        mag = np.maximum(np.abs(want), np.abs(got.astype(np.float64))).astype(np.float16)
        bound = np.spacing(mag).astype(np.float64) + F32_ATOL
        assert (err <= bound).all(), f"worst excess {np.max(err - bound):.3g}"
    else:
        rounded = np.floor(want + 0.5)
        diff = np.abs(got.astype(np.float64) - rounded)
        assert diff.max() <= 1
        clear = np.abs((want - np.floor(want)) - 0.5) > 1e-3
        assert (diff[clear] == 0).all(), f"{np.count_nonzero(diff[clear])} clear mismatches"


# --- cases ----------------------------------------------------------------------------------

# id: (image height, width), box (y0, x0, h, w), output (oh, ow)
CASES = {
    "down-typical": ((375, 500), (30.5, 40.25, 300.3, 280.7), (224, 224)),
    "up-typical": ((375, 500), (10.2, 20.7, 120.4, 100.9), (224, 224)),
    "one-pixel-crop": ((40, 50), (17.0, 23.0, 1.0, 1.0), (9, 11)),
    "one-pixel-out": ((60, 80), (5.5, 7.25, 40.0, 60.0), (1, 1)),
    "row-1xN": ((60, 80), (10.0, 3.3, 1.7, 70.2), (1, 37)),
    "col-Nx1": ((60, 80), (2.2, 40.0, 50.5, 2.0), (41, 1)),
    "strong-down-4000-wide": ((32, 4000), (0.0, 0.0, 32.0, 4000.0), (8, 224)),
    "strong-down-4000-tall": ((4000, 24), (0.0, 0.0, 4000.0, 24.0), (224, 6)),
    "extreme-aspect": ((50, 600), (20.25, 0.5, 3.0, 590.0), (224, 224)),
    "fractional-box": ((101, 157), (0.3, 0.7, 99.1, 150.6), (64, 96)),
    "edge-bottom-right": ((90, 120), (39.5, 59.75, 50.5, 60.25), (33, 47)),
    "full-image": ((90, 120), (0.0, 0.0, 90.0, 120.0), (45, 77)),
    "odd-output": ((75, 99), (3.1, 4.2, 70.3, 90.4), (13, 17)),
    "up-7x": ((30, 40), (0.0, 0.0, 30.0, 40.0), (224, 224)),
}


@functools.lru_cache(maxsize=None)
def image(shape, seed=0):
    rng = np.random.default_rng(seed + shape[0] * 7919 + shape[1])
    img = rng.integers(0, 256, size=(*shape, 3), dtype=np.uint8)
    img.setflags(write=False)
    return img


@functools.lru_cache(maxsize=None)
def case_reference(case_id):
    shape, box, size = CASES[case_id]
    return reference(image(shape), box, size)


@pytest.mark.parametrize("flip", [False, True], ids=["noflip", "flip"])
@pytest.mark.parametrize("layout", ["CHW", "HWC"])
@pytest.mark.parametrize("dtype", ["float32", "uint8", "float16"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_matches_float64_reference(case_id, dtype, layout, flip):
    shape, box, size = CASES[case_id]
    got = ops.resize_crop(image(shape), box, size, flip=flip, dtype=dtype, layout=layout)
    assert got.dtype == np.dtype(dtype)
    assert got.shape == ops.output_shape(size, layout)
    check_close(got, expected(case_reference(case_id), flip=flip, dtype=dtype, layout=layout),
                dtype)


@pytest.mark.parametrize("seed", range(4))
def test_random_boxes_match_reference(seed):
    rng = np.random.default_rng(seed)
    for _ in range(10):
        shape = (int(rng.integers(1, 90)), int(rng.integers(1, 90)))
        h = float(rng.uniform(0.01, shape[0]))
        w = float(rng.uniform(0.01, shape[1]))
        box = (float(rng.uniform(0, shape[0] - h)), float(rng.uniform(0, shape[1] - w)), h, w)
        size = (int(rng.integers(1, 70)), int(rng.integers(1, 70)))
        flip = bool(rng.integers(2))
        img = image(shape, seed)
        got = ops.resize_crop(img, box, size, flip=flip, layout="HWC")
        check_close(got, expected(reference(img, box, size), flip=flip, dtype="float32",
                                  layout="HWC"), "float32")


@pytest.mark.parametrize("case_id", ["down-typical", "up-typical", "fractional-box",
                                     "edge-bottom-right", "strong-down-4000-wide",
                                     "extreme-aspect", "one-pixel-crop"])
def test_within_one_level_of_pillow(case_id):
    shape, (y0, x0, h, w), (oh, ow) = CASES[case_id]
    img = image(shape)
    pil = np.asarray(Image.fromarray(img).resize((ow, oh), Image.BILINEAR,
                                                 box=(x0, y0, x0 + w, y0 + h)))
    got = ops.resize_crop(img, (y0, x0, h, w), (oh, ow), dtype="uint8", layout="HWC")
    diff = np.abs(got.astype(int) - pil.astype(int))
    assert diff.max() <= 1
    assert np.mean(diff) < 0.35
    raw = ops.resize_crop(img, (y0, x0, h, w), (oh, ow), layout="HWC",
                          mean=(0, 0, 0), std=(1 / 255,) * 3)
    assert np.abs(raw - pil).max() <= 1.0 + 1e-3


def test_identity_box_is_exact():
    img = image((37, 53))
    got = ops.resize_crop(img, (0, 0, 37, 53), (37, 53), dtype="uint8", layout="HWC")
    np.testing.assert_array_equal(got, img)
    got = ops.resize_crop(img, (0, 0, 37, 53), (37, 53), dtype="uint8", layout="CHW", flip=True)
    np.testing.assert_array_equal(got, img[:, ::-1].transpose(2, 0, 1))


@pytest.mark.parametrize("dtype", ["float32", "uint8", "float16"])
@pytest.mark.parametrize("case_id", ["down-typical", "up-typical", "odd-output", "row-1xN"])
def test_flip_and_layouts_are_bit_identical(case_id, dtype):
    shape, box, size = CASES[case_id]
    img = image(shape)
    hwc = ops.resize_crop(img, box, size, dtype=dtype, layout="HWC")
    chw = ops.resize_crop(img, box, size, dtype=dtype, layout="CHW")
    hwc_f = ops.resize_crop(img, box, size, dtype=dtype, layout="HWC", flip=True)
    chw_f = ops.resize_crop(img, box, size, dtype=dtype, layout="CHW", flip=True)
    assert hwc.tobytes() == np.ascontiguousarray(chw.transpose(1, 2, 0)).tobytes()
    assert hwc_f.tobytes() == np.ascontiguousarray(hwc[:, ::-1]).tobytes()
    assert chw_f.tobytes() == np.ascontiguousarray(chw[:, :, ::-1]).tobytes()


def test_deterministic_across_calls_and_threads():
    shape, box, size = CASES["down-typical"]
    img = image(shape)
    boxes = [box, CASES["up-typical"][1], (0.0, 0.0, 375.0, 500.0), (100.5, 3.25, 60.0, 400.0)]
    first = [ops.resize_crop(img, b, size, flip=bool(i % 2)).tobytes()
             for i, b in enumerate(boxes)]

    def run(k):
        i = k % len(boxes)
        return i, ops.resize_crop(img, boxes[i], size, flip=bool(i % 2)).tobytes()

    with ThreadPoolExecutor(4) as pool:
        for i, data in pool.map(run, range(32)):
            assert data == first[i]


def test_out_into_batch_slot_and_strided_image():
    shape, box, size = CASES["up-typical"]
    img = image(shape)
    batch = np.zeros((3, 3, 224, 224), np.float32)
    got = ops.resize_crop(img, box, size, out=batch[1])
    assert got is batch[1] or np.shares_memory(got, batch[1])
    np.testing.assert_array_equal(batch[1], ops.resize_crop(img, box, size))
    assert not batch[0].any() and not batch[2].any()
    # Rows of a wider buffer (row stride > 3 * width): same result as a compact copy.
    wide = np.zeros((375, 520, 3), np.uint8)
    wide[:, 10:510] = img
    view = wide[:, 10:510]
    assert not view.flags.c_contiguous
    np.testing.assert_array_equal(ops.resize_crop(view, box, size), batch[1])


def test_workspace_reuse_across_sizes(probe):
    img = image((375, 500))
    plans = [((0.0, 0.0, 375.0, 500.0), (224, 224)), ((1.5, 2.5, 3.0, 4.0), (7, 5)),
             ((10.0, 10.0, 300.0, 20.0), (1, 300)), ((0.0, 0.0, 375.0, 500.0), (224, 224))]
    ws = _ops.Workspace()
    for box, (oh, ow) in plans:
        out = np.empty((3, oh, ow), np.float32)
        _ops.resize_crop_into(img, *box, out.reshape(-1).view(np.uint8), oh, ow, False,
                              _ops.DTYPE_CODES["float32"], _ops.LAYOUT_CODES["CHW"],
                              ops.IMAGENET_MEAN, ops.IMAGENET_STD, ws)
        np.testing.assert_array_equal(out, ops.resize_crop(img, box, (oh, ow)))
    assert ws.nbytes >= probe.workspace_bytes(500, 375.0, 500.0, 224, 224)


def test_uint8_ignores_mean_and_std():
    shape, box, size = CASES["odd-output"]
    a = ops.resize_crop(image(shape), box, size, dtype="uint8")
    b = ops.resize_crop(image(shape), box, size, dtype="uint8", mean=(9, 9, 9), std=(3, 3, 3))
    np.testing.assert_array_equal(a, b)


def test_custom_mean_std():
    shape, box, size = CASES["fractional-box"]
    mean, std = (0.5, 0.25, 0.0), (0.5, 2.0, 1.0)
    got = ops.resize_crop(image(shape), box, size, mean=mean, std=std, layout="HWC")
    want = (case_reference("fractional-box") / 255.0 - np.array(mean)) / np.array(std)
    assert np.abs(got - want).max() <= F32_ATOL


# --- pass order -----------------------------------------------------------------------------

def resize_crop_order(probe, img, box, size, order, *, flip=False, dtype="float32",
                      layout="CHW"):
    """ops.resize_crop with the kernel's pass order forced ("h_first" or "v_first")."""
    oh, ow = size
    out = np.empty(ops.output_shape(size, layout), dtype)
    probe.resize_crop_order(img, *box, out.reshape(-1).view(np.uint8), oh, ow, flip,
                            _ops.DTYPE_CODES[dtype], _ops.LAYOUT_CODES[layout],
                            ops.IMAGENET_MEAN, ops.IMAGENET_STD, probe.ORDER_CODES[order])
    return out


def pass_order(probe, src_h, src_w, y0, x0, h, w, oh, ow):
    """The pass order ops_plan picks: "h_first" or "v_first"."""
    code = probe.plan(src_h, src_w, y0, x0, h, w, oh, ow)[0]
    return {v: k for k, v in probe.ORDER_CODES.items()}[code]


@pytest.mark.parametrize("order", ["h_first", "v_first"])
@pytest.mark.parametrize("layout", ["CHW", "HWC"])
@pytest.mark.parametrize("dtype", ["float32", "uint8", "float16"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_both_pass_orders_match_reference(probe, case_id, dtype, layout, order):
    shape, box, size = CASES[case_id]
    for flip in (False, True):
        got = resize_crop_order(probe, image(shape), box, size, order, flip=flip, dtype=dtype,
                                layout=layout)
        check_close(got, expected(case_reference(case_id), flip=flip, dtype=dtype,
                                  layout=layout), dtype)


@pytest.mark.parametrize("order", ["h_first", "v_first"])
@pytest.mark.parametrize("dtype", ["float32", "uint8", "float16"])
@pytest.mark.parametrize("case_id", ["down-typical", "up-typical", "odd-output", "row-1xN"])
def test_each_pass_order_is_bit_identical_across_flip_and_layouts(probe, case_id, dtype, order):
    shape, box, size = CASES[case_id]
    img = image(shape)
    hwc = resize_crop_order(probe, img, box, size, order, dtype=dtype, layout="HWC")
    chw = resize_crop_order(probe, img, box, size, order, dtype=dtype, layout="CHW")
    chw_f = resize_crop_order(probe, img, box, size, order, dtype=dtype, layout="CHW", flip=True)
    assert hwc.tobytes() == np.ascontiguousarray(chw.transpose(1, 2, 0)).tobytes()
    assert chw_f.tobytes() == np.ascontiguousarray(chw[:, :, ::-1]).tobytes()


def test_pass_order_follows_the_sizes(probe):
    H, W = 375, 500
    # Vertical downscale: summing source rows first leaves the horizontal pass oh rows.
    assert pass_order(probe, H, W, 30.5, 40.25, 300.3, 280.7, 224, 224) == "v_first"
    assert pass_order(probe, H, W, *ops.center_crop_box(H, W, 224, 256), 224, 224) == "v_first"
    # Upscale: the horizontal pass on the ~120 source rows is cheaper than on 224.
    assert pass_order(probe, H, W, 10.2, 20.7, 120.4, 100.9, 224, 224) == "h_first"
    # ops.resize_crop uses the plan's order: same bits as forcing it.
    shape, box, size = CASES["down-typical"]
    order = pass_order(probe, *shape, *box, *size)
    assert ops.resize_crop(image(shape), box, size).tobytes() == \
        resize_crop_order(probe, image(shape), box, size, order).tobytes()


# --- coefficient tables ---------------------------------------------------------------------

@pytest.mark.parametrize("in_size,in0,length,n_out", [
    (500, 40.25, 280.7, 224), (500, 20.7, 100.9, 224), (4000, 0.0, 4000.0, 224),
    (50, 17.0, 1.0, 9), (120, 59.75, 60.25, 47), (7, 0.0, 7.0, 7)],
    ids=["down", "up", "down-18x", "one-pixel", "edge", "identity"])
@pytest.mark.parametrize("flip", [False, True], ids=["noflip", "flip"])
def test_axis_tables_match_pillow_coefficients(probe, in_size, in0, length, n_out, flip):
    # The axis as the columns of a plan (mirrored when flipping) and as its rows (never
    # mirrored), the other axis one pixel wide.
    _, columns, _ = probe.plan(1, in_size, 0.0, in0, 1.0, length, 1, n_out, flip)
    _, _, rows = probe.plan(in_size, 1, in0, 0.0, length, 1.0, n_out, 1)
    m = pillow_matrix(in_size, in0, length, n_out)
    for (starts, counts, weights), mirrored in ((columns, flip), (rows, False)):
        want = m[::-1] if mirrored else m
        for i in range(n_out):
            nz = np.flatnonzero(want[i])
            # Zero-weight taps at the ends are trimmed; everything non-zero is kept, in order.
            assert starts[i] == nz[0] and counts[i] == nz[-1] - nz[0] + 1
            np.testing.assert_allclose(weights[i], want[i, nz[0]:nz[-1] + 1], rtol=0,
                                       atol=1e-7)
        if (in0, length, n_out) == (0.0, in_size, in_size):
            assert all(w == [1.0] for w in weights)


# --- float16 conversion ---------------------------------------------------------------------

@pytest.mark.parametrize("f16c", [False, True], ids=["portable", "f16c"])
def test_float16_conversion_is_numpy_round_to_nearest_even(probe, f16c):
    if f16c and not probe.has_f16c():
        pytest.skip("no F16C instructions on this CPU")
    # Every float16 value and the exact midpoints (ties) around it, plus a sweep over all
    # float32 exponents, signs and NaN/inf bit patterns.
    halves = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = halves[np.isfinite(halves)].astype(np.float32)
    with np.errstate(over="ignore"):
        up = np.nextafter(finite.astype(np.float16), np.float16(np.inf)).astype(np.float32)
    ties = ((finite.astype(np.float64) + up.astype(np.float64)) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(ties, np.float32(np.inf)),
                           np.nextafter(ties, np.float32(-np.inf))])
    sweep = np.arange(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([finite, ties, near, sweep, np.float32([np.inf, -np.inf, 65504, 65520,
                                                               -65520, 1e-8, -0.0])])
    got = np.empty(x.shape, np.uint16)
    probe.float32_to_float16_bits(np.ascontiguousarray(x, np.float32), got, f16c)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan].view(np.float16)).all()


# --- validation transform -------------------------------------------------------------------

def test_center_crop_box_numbers():
    # 375 x 500: shorter side 256 -> 256 x int(256 * 500 / 375) = 256 x 341; crop offsets
    # round(16.0) = 16 and round(58.5) = 58 (half to even).
    y0, x0, h, w = ops.center_crop_box(375, 500)
    assert (y0, h) == pytest.approx((16 * 375 / 256, 224 * 375 / 256), rel=1e-15)
    assert (x0, w) == pytest.approx((58 * 500 / 341, 224 * 500 / 341), rel=1e-15)
    y0, x0, h, w = ops.center_crop_box(500, 375, size=(200, 100), resize=256)
    assert (x0, w) == pytest.approx((78 * 375 / 256, 100 * 375 / 256), rel=1e-15)
    assert (y0, h) == pytest.approx((70 * 500 / 341, 200 * 500 / 341), rel=1e-15)
    # Square: nothing to crop on a side exactly the crop size.
    assert ops.center_crop_box(224, 224, size=224, resize=224) == (0.0, 0.0, 224.0, 224.0)


@pytest.mark.parametrize("shape", [(375, 500), (500, 333), (224, 224), (257, 1000)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_center_crop_box_equals_resize_then_crop(shape):
    img = image(shape)
    h, w = shape
    if w <= h:
        nw, nh = 256, int(256 * h / w)
    else:
        nh, nw = 256, int(256 * w / h)
    top, left = int(round((nh - 224) / 2.0)), int(round((nw - 224) / 2.0))
    full = reference(img, (0.0, 0.0, float(h), float(w)), (nh, nw))[top:top + 224,
                                                                   left:left + 224]
    box = ops.center_crop_box(h, w, 224, 256)
    got = ops.resize_crop(img, box, 224, layout="HWC", mean=(0, 0, 0), std=(1 / 255,) * 3)
    assert np.abs(got - full).max() < 2e-3
    pil = np.asarray(Image.fromarray(img).resize((nw, nh), Image.BILINEAR)
                     .crop((left, top, left + 224, top + 224)))
    got8 = ops.resize_crop(img, box, 224, layout="HWC", dtype="uint8")
    assert np.abs(got8.astype(int) - pil).max() <= 1


# --- argument errors ------------------------------------------------------------------------

def _img():
    return image((40, 50))


@pytest.mark.parametrize("box", [(-0.5, 0, 10, 10), (0, -1, 10, 10), (0, 0, 0, 10),
                                 (0, 0, 10, -2), (35, 0, 5.5, 10), (0, 45, 10, 5.01),
                                 (math.nan, 0, 10, 10), (0, 0, math.inf, 10), (0, 0, 10)],
                         ids=["neg-y", "neg-x", "zero-h", "neg-w", "past-bottom",
                              "past-right", "nan", "inf", "three-values"])
def test_bad_box(box):
    with pytest.raises(ConfigError, match="box"):
        ops.resize_crop(_img(), box, 8)


def test_box_overshoot_from_rounding_is_clamped():
    img = image((40, 50))
    exact = ops.resize_crop(img, (0.0, 0.0, 40.0, 50.0), (16, 20))
    for box in [(0.0, 0.0, 40.0 + 5e-7, 50.0), (-5e-7, 0.0, 40.0 + 5e-7, 50.0 + 4e-7),
                (0.0, -3e-7, 40.0, 50.0 + 3e-7)]:
        got = ops.resize_crop(img, box, (16, 20))
        assert np.abs(got - exact).max() < 1e-5
    with pytest.raises(ConfigError, match="box"):
        ops.resize_crop(img, (0.0, 0.0, 40.0 + 1e-5, 50.0), (16, 20))


@pytest.mark.parametrize("size", [0, -3, (8, 0), (8,), (2, 3, 4), True, 2.5, (1 << 20, 4)],
                         ids=["zero", "negative", "zero-w", "one-value", "three-values",
                              "bool", "float", "huge"])
def test_bad_size(size):
    with pytest.raises(ConfigError, match="size"):
        ops.resize_crop(_img(), (0, 0, 10, 10), size)


@pytest.mark.parametrize("img", [np.zeros((10, 10, 3), np.float32), np.zeros((10, 10), np.uint8),
                                 np.zeros((10, 10, 4), np.uint8), np.zeros((0, 10, 3), np.uint8),
                                 [[1, 2, 3]]],
                         ids=["float-image", "gray", "rgba", "empty", "list"])
def test_bad_image(img):
    with pytest.raises(ConfigError, match="img"):
        ops.resize_crop(img, (0, 0, 1, 1), 4)


def test_bad_dtype_layout_mean_std():
    with pytest.raises(ConfigError, match="dtype"):
        ops.resize_crop(_img(), (0, 0, 10, 10), 8, dtype="float64")
    with pytest.raises(ConfigError, match="layout"):
        ops.resize_crop(_img(), (0, 0, 10, 10), 8, layout="NCHW")
    with pytest.raises(ConfigError, match="mean"):
        ops.resize_crop(_img(), (0, 0, 10, 10), 8, mean=(0.5, 0.5))
    with pytest.raises(ConfigError, match="std"):
        ops.resize_crop(_img(), (0, 0, 10, 10), 8, std=(0.2, 0.0, 0.2))
    with pytest.raises(ConfigError, match="std"):
        ops.resize_crop(_img(), (0, 0, 10, 10), 8, std=(0.2, math.nan, 0.2))


def test_bad_out_says_what_it_needs():
    box = (0, 0, 10, 10)
    with pytest.raises(ConfigError, match=r"float32 array of shape \(3, 8, 6\)"):
        ops.resize_crop(_img(), box, (8, 6), out=np.empty((3, 6, 8), np.float32))
    with pytest.raises(ConfigError, match=r"uint8 array of shape \(8, 6, 3\)"):
        ops.resize_crop(_img(), box, (8, 6), dtype="uint8", layout="HWC",
                        out=np.empty((8, 6, 3), np.float32))
    with pytest.raises(ConfigError, match="C-contiguous"):
        ops.resize_crop(_img(), box, (8, 6), out=np.empty((3, 8, 12), np.float32)[:, :, ::2])
    readonly = np.empty((3, 8, 6), np.float32)
    readonly.setflags(write=False)
    with pytest.raises(ConfigError, match="writable"):
        ops.resize_crop(_img(), box, (8, 6), out=readonly)
    with pytest.raises(ConfigError, match="out"):
        ops.resize_crop(_img(), box, (8, 6), out=[0.0] * 144)


def test_center_crop_larger_than_resized_image_covers_it():
    # 375 x 500 resized to 224 x 298 cannot hold a 224 x 320 crop: the image is scaled to
    # cover it instead (factor max(224/375, 320/500) = 0.64 -> 240 x 320), centred.
    y0, x0, h, w = ops.center_crop_box(375, 500, size=(224, 320), resize=224)
    assert (y0, x0) == pytest.approx((8 * 375 / 240, 0.0), rel=1e-15)
    assert (h, w) == pytest.approx((224 * 375 / 240, 500.0), rel=1e-15)
    got = ops.resize_crop(image((375, 500)), (y0, x0, h, w), (224, 320), dtype="uint8")
    assert got.shape == (3, 224, 320)


def test_bad_center_crop():
    with pytest.raises(ConfigError, match="resize"):
        ops.center_crop_box(375, 500, size=224, resize=200)
    with pytest.raises(ConfigError, match="height"):
        ops.center_crop_box(0, 500)
    with pytest.raises(ConfigError, match="size"):
        ops.center_crop_box(375, 500, size=0)
