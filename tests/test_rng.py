"""The RNG scheme: Philox known answers, the key/counter mapping, the C kernels against the
numpy twin bit for bit, portable exp/log, and RandomResizedCrop/flip against torchvision's
algorithm (exact where it is deterministic, statistically where it is random)."""

import hashlib
import math

import numpy as np
import pytest

from dpu_pipe import ConfigError, rng

import kernel_probes

stats = pytest.importorskip("scipy.stats")


@pytest.fixture(scope="module")
def probe():
    """tests/kernels/_rng_probe.pyx, built for this dpu_pipe: each kernel of _rng.pxd over
    arrays (Philox, block words and uniforms, portable exp/log, crop boxes, flips), which the
    package does not expose."""
    return kernel_probes.load("_rng_probe")


# Random123 tests/kat_vectors, "philox4x32 10" lines: counter[4], key[2] -> output[4].
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
KAT_IDS = ["zeros", "ones", "pi"]


def _sample_grid(n):
    """n (seed, epoch, index) triples spread over the full ranges, from integer arithmetic
    only (no generator whose stream could change between numpy versions)."""
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        seed = i * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x0123456789ABCDEF)
        epoch = (i * np.uint64(2654435761)) & np.uint64(0xFFFFFFFF)
        index = (i * np.uint64(0xBF58476D1CE4E5B9)) >> np.uint64(i.size % 7 + 1)
    seed[:4] = [0, 1, 2**64 - 1, 2**63]
    epoch[:4] = [0, 0, 2**32 - 1, 1]
    index[:4] = [0, 2**64 - 1, 0, 2**32]
    return seed, epoch, index


def _sizes(n):
    """Image sizes: tiny ones, extreme aspect ratios and ordinary photos."""
    special = [(1, 1), (2, 3), (3, 2), (1, 2), (2, 1), (1, 1000), (1000, 1), (5, 4000),
               (4000, 5), (7, 9), (224, 224), (375, 500), (500, 375), (2, 2), (16, 9)]
    h = np.empty(n, np.int64)
    w = np.empty(n, np.int64)
    k = len(special)
    h[:k], w[:k] = zip(*special)
    i = np.arange(k, n)
    h[k:] = 1 + (i * 7919) % 1500
    w[k:] = 1 + (i * 104729) % 2300
    # every fifth: one of the special sizes again, so each is hit thousands of times
    sel = i[i % 5 == 0]
    h[sel], w[sel] = h[sel % k], w[sel % k]
    return h, w


# --- Philox ----------------------------------------------------------------------------------

@pytest.mark.parametrize("ctr,key,expected", KAT, ids=KAT_IDS)
def test_philox_known_answers_numpy(ctr, key, expected):
    assert tuple(rng.philox4x32_10(ctr, key).tolist()) == expected


@pytest.mark.parametrize("ctr,key,expected", KAT, ids=KAT_IDS)
def test_philox_known_answers_cython(probe, ctr, key, expected):
    assert probe.philox(ctr, key) == expected


def test_philox_vectorised_matches_scalar(probe):
    counters = np.array([k[0] for k in KAT] * 3, dtype=np.uint32)
    keys = np.array([k[1] for k in KAT] * 3, dtype=np.uint32)
    out = rng.philox4x32_10(counters, keys)
    assert out.dtype == np.uint32 and out.shape == (9, 4)
    assert [tuple(r) for r in out.tolist()] == [k[2] for k in KAT] * 3
    # broadcasting one key over many counters, against the scalar C call
    g = np.random.default_rng(5)
    ctr = g.integers(0, 2**32, size=(300, 4), dtype=np.uint64)
    key = (0xDEADBEEF, 0x12345678)
    got = rng.philox4x32_10(ctr, key)
    want = [probe.philox(tuple(int(v) for v in c), key) for c in ctr]
    assert [tuple(r) for r in got.tolist()] == want


def test_key_counter_mapping(probe):
    """The scheme of rng's docstring: key = (seed lo, seed hi), counter = (index lo,
    index hi, epoch, stream << 16 | block)."""
    seed, epoch, index, stream, block = 0x0123456789ABCDEF, 5, 2**40 + 3, 1, 7
    want = rng.philox4x32_10([3, 256, 5, (1 << 16) | 7], [0x89ABCDEF, 0x01234567])
    assert np.array_equal(rng.random_words(seed, epoch, index, stream, block), want)
    assert np.array_equal(probe.block_words(seed, epoch, index, stream, block), want)
    x0, x1, x2, x3 = (int(v) for v in want)
    w0, w1 = x1 << 32 | x0, x3 << 32 | x2
    assert rng.random_u64(seed, epoch, index, stream, block).tolist() == [w0, w1]
    u = rng.uniforms(seed, epoch, index, stream, block)
    assert u.tolist() == [(w0 >> 11) / 2**53, (w1 >> 11) / 2**53]


def test_streams_blocks_epochs_are_distinct():
    base = rng.random_words(42, 3, 1000, rng.STREAM_CROP, 0)
    for other in [rng.random_words(42, 3, 1000, rng.STREAM_FLIP, 0),
                  rng.random_words(42, 3, 1000, rng.STREAM_CROP, 1),
                  rng.random_words(42, 4, 1000, rng.STREAM_CROP, 0),
                  rng.random_words(42, 3, 1001, rng.STREAM_CROP, 0),
                  rng.random_words(43, 3, 1000, rng.STREAM_CROP, 0)]:
        assert not np.array_equal(base, other)


def test_block_words_and_uniforms_twins_agree(probe):
    seed, epoch, index = _sample_grid(20000)
    for stream, block in [(0, 0), (1, 10), (2, 0), (rng.STREAM_USER, 65535)]:
        a = rng.random_words(seed, epoch, index, stream, block)
        b = probe.block_words(seed, epoch, index, stream, block)
        assert a.dtype == b.dtype == np.uint32
        assert np.array_equal(a, b)
        u = rng.uniforms(seed, epoch, index, stream, block)
        v = probe.block_uniforms(seed, epoch, index, stream, block)
        assert np.array_equal(u.view(np.uint64), v.view(np.uint64))
        assert u.min() >= 0.0 and u.max() < 1.0
        # 53-bit grid
        assert np.all(u * 2**53 == np.floor(u * 2**53))


def test_uniforms_are_uniform():
    seed, epoch, index = 7, 0, np.arange(100_000)
    u = rng.uniforms(seed, epoch, index, rng.STREAM_USER)
    for col in (0, 1):
        assert stats.kstest(u[:, col], "uniform").pvalue > 1e-3
    # the two halves of a block are not correlated
    assert abs(np.corrcoef(u[:, 0], u[:, 1])[0, 1]) < 0.015


# --- portable exp / log ----------------------------------------------------------------------

def _ulps(a, b):
    return np.abs(a - b) / np.spacing(np.abs(b))


def test_portable_exp_twins_and_accuracy(probe):
    g = np.random.default_rng(11)
    x = np.concatenate([g.uniform(-0.5, 0.5, 50000), g.uniform(-30, 30, 50000),
                        g.uniform(-744, 709.7, 20000),
                        [0.0, -0.0, 1e-300, -1e-300, 709.78, 709.8, -745.0, -746.0, 1000.0,
                         -1000.0, np.inf, -np.inf, np.nan, math.log(0.75), math.log(4 / 3)]])
    a = rng.portable_exp(x)
    b = probe.exp_array(x)
    assert np.array_equal(a.view(np.uint64), b.view(np.uint64))
    normal = (x > -700) & (x < 709)
    assert _ulps(a[normal], np.exp(x[normal])).max() <= 2
    assert a[x == 1000.0][0] == np.inf and a[x == -1000.0][0] == 0.0
    assert a[x == np.inf][0] == np.inf and a[x == -np.inf][0] == 0.0
    assert np.isnan(a[np.isnan(x)]).all()
    assert a[x == 0.0].tolist() == [1.0, 1.0]


def test_portable_log_twins_and_accuracy(probe):
    g = np.random.default_rng(12)
    x = np.concatenate([np.exp(g.uniform(-700, 700, 50000)), g.uniform(0.5, 2.0, 50000),
                        [5e-324, 2.2250738585072014e-308, 1.0, 0.75, 4 / 3, 0.08,
                         1.7976931348623157e308, 0.0, -1.0, np.inf, np.nan]])
    a = rng.portable_log(x)
    b = probe.log_array(x)
    assert np.array_equal(a.view(np.uint64), b.view(np.uint64))
    ok = np.isfinite(x) & (x > 0) & (x != 1.0)
    assert _ulps(a[ok], np.log(x[ok])).max() <= 2
    assert a[x == 1.0][0] == 0.0
    assert a[x == 0.0][0] == -np.inf and a[x == np.inf][0] == np.inf
    assert np.isnan(a[(x < 0) | np.isnan(x)]).all()


# --- RandomResizedCrop and flip: the twins -----------------------------------------------------

CONFIGS = [((0.08, 1.0), (3 / 4, 4 / 3)),       # torchvision's defaults
           ((0.25, 1.0), (0.5, 2.0)),
           ((1.0, 1.0), (1.0, 1.0)),            # deterministic size
           ((0.0, 0.01), (0.1, 10.0)),
           ((0.5, 3.0), (5.0, 20.0))]           # area above the image, ratio above 1


@pytest.mark.parametrize("scale,ratio", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_crop_twins_agree(probe, scale, ratio):
    n = 120_000 if scale == (0.08, 1.0) else 30_000
    seed, epoch, index = _sample_grid(n)
    H, W = _sizes(n)
    top, left, h, w, att = rng.random_resized_crop(seed, epoch, index, H, W, scale, ratio,
                                                   return_attempt=True)
    c = probe.crop_boxes(seed, epoch, index, H, W, scale, ratio)
    assert c.dtype == np.int64 and c.shape == (n, 5)
    for col, arr in enumerate((top, left, h, w, att)):
        assert np.array_equal(c[:, col], arr), f"column {col}"
    # the crop lies inside the image and is never empty
    assert np.all((h >= 1) & (w >= 1) & (top >= 0) & (left >= 0))
    assert np.all((top + h <= H) & (left + w <= W))
    fb = att < 0
    assert np.array_equal(top[fb], (H[fb] - h[fb]) // 2)
    assert np.array_equal(left[fb], (W[fb] - w[fb]) // 2)


def test_flip_twins_agree(probe):
    seed, epoch, index = _sample_grid(100_000)
    for p in (0.5, 0.0, 1.0, 0.1):
        a = rng.random_flip(seed, epoch, index, p)
        b = probe.flips(seed, epoch, index, p)
        assert a.dtype == b.dtype == np.bool_
        assert np.array_equal(a, b)
    assert not rng.random_flip(seed, epoch, index, 0.0).any()
    assert rng.random_flip(seed, epoch, index, 1.0).all()


def test_scalar_calls_match_arrays():
    seed, epoch, index = _sample_grid(50)
    H, W = _sizes(50)
    arrays = rng.random_resized_crop(seed, epoch, index, H, W)
    for i in range(50):
        one = rng.random_resized_crop(int(seed[i]), int(epoch[i]), int(index[i]),
                                      int(H[i]), int(W[i]))
        assert one == tuple(int(a[i]) for a in arrays)
        assert all(type(v) is int for v in one)
        assert rng.random_flip(int(seed[i]), int(epoch[i]), int(index[i])) is \
            bool(rng.random_flip(seed, epoch, index)[i])


# Recorded from this implementation; a build on another machine (aarch64, another compiler or
# numpy) must reproduce the same bits, which is the point of the scheme.
GOLDEN_CROPS = {
    # (seed, epoch, index, H, W): (top, left, crop h, crop w, attempt, flip)
    (0, 0, 0, 375, 500): (9, 139, 334, 339, 0, True),
    (1, 2, 3, 480, 640): (1, 45, 456, 436, 0, False),
    (2**64 - 1, 2**32 - 1, 2**64 - 1, 224, 224): (0, 62, 157, 145, 0, True),
    (12345, 90, 1281166, 333, 500): (29, 231, 155, 167, 1, False),
    (0, 0, 0, 10, 1000): (0, 493, 10, 13, -1, True),
    (0, 0, 0, 1000, 10): (493, 0, 13, 10, -1, True),
    (7, 1, 5, 1, 1): (0, 0, 1, 1, 0, False),
}
# sha256 of the crops (int64 little-endian, 5 columns) and flips (uint8) of _sample_grid(10000)
# on _sizes(10000), default scale/ratio/p.
GOLDEN_SHA256 = "72fee82748d4c3d1a392d77f957ecccfe0d8f557e2748d1c758e724ed06db2fc"


def _golden_digest(crop_fn, flip_fn):
    seed, epoch, index = _sample_grid(10_000)
    H, W = _sizes(10_000)
    c = np.asarray(crop_fn(seed, epoch, index, H, W), dtype="<i8")
    f = np.asarray(flip_fn(seed, epoch, index), dtype=np.uint8)
    return hashlib.sha256(c.tobytes() + f.tobytes()).hexdigest()


@pytest.mark.parametrize("key", list(GOLDEN_CROPS), ids=[str(k) for k in GOLDEN_CROPS])
def test_golden_values(probe, key):
    *box, flip = GOLDEN_CROPS[key]
    assert rng.random_resized_crop(*key, return_attempt=True) == tuple(box)
    assert probe.crop_boxes(*key).tolist() == box
    assert rng.random_flip(*key[:3]) is flip
    assert bool(probe.flips(*key[:3])) is flip


def test_golden_digest(probe):
    assert _golden_digest(probe.crop_boxes, probe.flips) == GOLDEN_SHA256
    assert _golden_digest(lambda *a: np.stack(rng.random_resized_crop(*a, return_attempt=True), -1),
                          rng.random_flip) == GOLDEN_SHA256


# --- RandomResizedCrop: exact cases ----------------------------------------------------------

def _torchvision_fallback(H, W, ratio):
    """torchvision's central-crop fallback, verbatim in plain Python."""
    in_ratio = float(W) / float(H)
    if in_ratio < min(ratio):
        w = W
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = H
        w = int(round(h * max(ratio)))
    else:
        w = W
        h = H
    return (H - h) // 2, (W - w) // 2, h, w


@pytest.mark.parametrize("H,W,ratio", [(10, 1000, (3 / 4, 4 / 3)), (1000, 10, (3 / 4, 4 / 3)),
                                       (3, 4000, (3 / 4, 4 / 3)), (4000, 3, (0.5, 2.0)),
                                       (50, 50, (5.0, 6.0)), (50, 50, (0.1, 0.2)),
                                       (13, 17, (0.7, 1.5))])
def test_fallback_is_torchvision_central_crop(probe, H, W, ratio):
    # scale far above 1 makes every attempt too large, so the fallback is always taken
    n = 2000
    top, left, h, w, att = rng.random_resized_crop(7, 3, np.arange(n), H, W, (50.0, 60.0), ratio,
                                                   return_attempt=True)
    assert np.all(att == -1)
    want = _torchvision_fallback(H, W, ratio)
    assert set(zip(top.tolist(), left.tolist(), h.tolist(), w.tolist())) == {want}
    c = probe.crop_boxes(7, 3, np.arange(n), H, W, (50.0, 60.0), ratio)
    assert set(map(tuple, c[:, :4].tolist())) == {want}


def test_fallback_never_empty_where_torchvision_would_be(probe):
    # torchvision: w = 1, h = round(1 / 5) = 0 -> an empty crop; here one pixel
    assert _torchvision_fallback(1, 1, (5.0, 6.0))[2] == 0
    assert rng.random_resized_crop(0, 0, 0, 1, 1, (50.0, 60.0), (5.0, 6.0)) == (0, 0, 1, 1)
    assert probe.crop_boxes(0, 0, 0, 1, 1, (50.0, 60.0), (5.0, 6.0)).tolist() == [0, 0, 1, 1, -1]


def test_tiny_images():
    idx = np.arange(20000)
    # 1x1: every accepted attempt is the whole pixel
    top, left, h, w = rng.random_resized_crop(3, 0, idx, 1, 1)
    assert np.all((top == 0) & (left == 0) & (h == 1) & (w == 1))
    # 2x3: every possible crop appears, each inside the image
    top, left, h, w = rng.random_resized_crop(3, 0, idx, 2, 3)
    boxes = set(zip(top.tolist(), left.tolist(), h.tolist(), w.tolist()))
    assert all(t + hh <= 2 and l + ww <= 3 for t, l, hh, ww in boxes)
    assert {(0, 0, 1, 1), (1, 2, 1, 1), (0, 0, 2, 2), (0, 1, 2, 2), (0, 0, 2, 3)} <= boxes


def test_deterministic_scale_and_ratio():
    # scale = ratio = 1 on a square image: always the whole image, from attempt 0
    top, left, h, w, att = rng.random_resized_crop(1, 1, np.arange(1000), 64, 64, (1.0, 1.0),
                                                   (1.0, 1.0), return_attempt=True)
    assert np.all((top == 0) & (left == 0) & (h == 64) & (w == 64) & (att == 0))


# --- RandomResizedCrop and flip: distributions against torchvision's algorithm -----------------

def _torchvision_crops(gen, n, H, W, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop.get_params run for n images at once, step for step,
    with numpy's Generator and libm's exp/log in place of torch's: (top, left, h, w,
    fallback) for each draw, int64 (n, 5)."""
    out = np.empty((n, 5), np.int64)
    area = H * W
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    pending = np.arange(n)
    for _ in range(10):
        target_area = area * gen.uniform(scale[0], scale[1], pending.size)
        aspect_ratio = np.exp(gen.uniform(log_ratio[0], log_ratio[1], pending.size))
        w = np.round(np.sqrt(target_area * aspect_ratio)).astype(np.int64)  # half to even
        h = np.round(np.sqrt(target_area / aspect_ratio)).astype(np.int64)
        ok = (0 < w) & (w <= W) & (0 < h) & (h <= H)
        k = pending[ok]
        out[k, 0] = gen.integers(0, H - h[ok] + 1)
        out[k, 1] = gen.integers(0, W - w[ok] + 1)
        out[k, 2] = h[ok]
        out[k, 3] = w[ok]
        out[k, 4] = 0
        pending = pending[~ok]
    out[pending] = (*_torchvision_fallback(H, W, ratio), 1)
    return out


def _chi2_same(a, b, bins):
    """p-value of a chi-square test that samples a and b come from one distribution."""
    ca, _ = np.histogram(a, bins)
    cb, _ = np.histogram(b, bins)
    keep = (ca + cb) > 0
    return stats.chi2_contingency(np.stack([ca[keep], cb[keep]])).pvalue


@pytest.fixture(scope="module")
def photo_draws():
    H, W, n = 375, 500, 100_000
    ours = np.stack(rng.random_resized_crop(2024, 5, np.arange(n), H, W, return_attempt=True), -1)
    ref = _torchvision_crops(np.random.default_rng(2024), n, H, W)
    return H, W, ours, ref


def test_crop_distribution_matches_torchvision(photo_draws):
    H, W, ours, ref = photo_draws
    feats = {
        "scale": (lambda c: c[:, 2] * c[:, 3] / (H * W), np.linspace(0.0, 1.0, 41)),
        "log_ratio": (lambda c: np.log(c[:, 3] / c[:, 2]), np.linspace(-0.32, 0.32, 33)),
        "height": (lambda c: c[:, 2], np.linspace(0.5, H + 0.5, 39)),
        "top": (lambda c: (c[:, 0] + 0.5) / (H - c[:, 2] + 1), np.linspace(0.0, 1.0, 21)),
        "left": (lambda c: (c[:, 1] + 0.5) / (W - c[:, 3] + 1), np.linspace(0.0, 1.0, 21)),
    }
    for name, (f, bins) in feats.items():
        p = _chi2_same(f(ours), f(ref), bins)
        assert p > 1e-3, f"{name}: chi-square p = {p:.2e}"
    # the same continuous scale distribution by KS as well
    p = stats.ks_2samp(ours[:, 2] * ours[:, 3], ref[:, 2] * ref[:, 3]).pvalue
    assert p > 1e-3


def test_crop_distribution_detects_a_wrong_algorithm(photo_draws):
    # The tests above have the power to see a plausible bug: a uniform instead of
    # log-uniform aspect ratio.
    H, W, ours, _ = photo_draws
    gen = np.random.default_rng(1)
    r = gen.uniform(3 / 4, 4 / 3, ours.shape[0])
    s = gen.uniform(0.08, 1.0, ours.shape[0])
    w = np.rint(np.sqrt(s * H * W * r))
    h = np.rint(np.sqrt(s * H * W / r))
    ok = (w <= W) & (h <= H)
    p = _chi2_same(np.log(ours[:, 3] / ours[:, 2]), np.log(w[ok] / h[ok]),
                   np.linspace(-0.32, 0.32, 33))
    assert p < 1e-6


@pytest.mark.parametrize("H,W", [(64, 400), (400, 64), (2, 3), (3, 1)])
def test_fallback_frequency_matches_torchvision(H, W):
    n = 100_000
    _, _, _, _, att = rng.random_resized_crop(99, 1, np.arange(n), H, W, return_attempt=True)
    ref = _torchvision_crops(np.random.default_rng(99), n, H, W)
    ours_fb = int(np.sum(att < 0))
    ref_fb = int(ref[:, 4].sum())
    table = np.array([[ours_fb, n - ours_fb], [ref_fb, n - ref_fb]])
    if ours_fb == ref_fb == 0:
        return
    p = stats.chi2_contingency(table).pvalue
    assert p > 1e-3, f"fallback {ours_fb / n:.4f} vs torchvision {ref_fb / n:.4f}, p = {p:.2e}"


def test_fallback_frequency_against_exact_probability():
    # On a 64x400 image an attempt succeeds iff h = round(sqrt(A s / r)) <= 64 (w <= 400 then
    # holds); the probability q over (s, log r) is a 2-D integral, estimated here on a fine
    # grid, and the fallback probability is (1 - q)**10.
    H, W = 64, 400
    s = (np.arange(2000) + 0.5) / 2000 * 0.92 + 0.08
    lr = ((np.arange(2000) + 0.5) / 2000 * 2 - 1) * math.log(4 / 3)
    S, R = np.meshgrid(s, np.exp(lr))
    h = np.rint(np.sqrt(H * W * S / R))
    w = np.rint(np.sqrt(H * W * S * R))
    q = np.mean((h <= H) & (w <= W) & (h > 0) & (w > 0))
    p_fb = (1 - q) ** 10
    n = 100_000
    _, _, _, _, att = rng.random_resized_crop(5, 0, np.arange(n), H, W, return_attempt=True)
    assert stats.binomtest(int(np.sum(att < 0)), n, p_fb).pvalue > 1e-3


def test_flip_frequency():
    n = 100_000
    for p in (0.5, 0.2):
        k = int(rng.random_flip(31, 2, np.arange(n), p).sum())
        assert stats.binomtest(k, n, p).pvalue > 1e-3
    # independent of the crop of the same sample
    f = rng.random_flip(31, 2, np.arange(n))
    top = rng.random_resized_crop(31, 2, np.arange(n), 375, 500)[0]
    assert _chi2_same(top[f], top[~f], np.linspace(0, 375, 16)) > 1e-3


# --- argument checks -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(scale=(0.5, 0.1)), "scale"),
    (dict(scale=(-0.1, 1.0)), "scale"),
    (dict(scale=(0.0, 0.0)), "scale"),
    (dict(scale=(0.1, float("nan"))), "finite"),
    (dict(ratio=(0.0, 1.0)), "ratio"),
    (dict(ratio=(2.0, 1.0)), "ratio"),
    (dict(ratio=(1.0, float("inf"))), "finite"),
    (dict(ratio=1.0), "pairs"),
])
def test_bad_crop_config(probe, kwargs, match):
    for fn in (rng.random_resized_crop, probe.crop_boxes):
        with pytest.raises(ConfigError, match=match):
            fn(0, 0, 0, 10, 10, **kwargs)


@pytest.mark.parametrize("args,match", [
    ((-1, 0, 0, 10, 10), "seed"),
    ((2**64, 0, 0, 10, 10), "seed"),
    ((0.5, 0, 0, 10, 10), "seed"),
    ((0, -1, 0, 10, 10), "epoch"),
    ((0, 2**32, 0, 10, 10), "epoch"),
    ((0, 0, -3, 10, 10), "index"),
    ((0, 0, 0, 0, 10), "height|size"),
    ((0, 0, 0, 10, -5), "width|size"),
    ((0, 0, 0, 2**31, 10), "height|size"),
])
def test_bad_sample_arguments(probe, args, match):
    for fn in (rng.random_resized_crop, probe.crop_boxes):
        with pytest.raises(ConfigError, match=match):
            fn(*args)


def test_bad_flip_and_stream_arguments(probe):
    for fn in (rng.random_flip, probe.flips):
        with pytest.raises(ConfigError, match="probability"):
            fn(0, 0, 0, 1.5)
    with pytest.raises(ConfigError, match="stream"):
        rng.random_words(0, 0, 0, 1 << 16)
    with pytest.raises(ConfigError, match="stream"):
        probe.block_words(0, 0, 0, 0, 1 << 16)
    with pytest.raises(ConfigError, match="shape"):
        rng.philox4x32_10([0, 0, 0], [0, 0])
    assert rng.check_seed(2**64 - 1) == 2**64 - 1
    # A bool is not a seed (True would silently be seed 1), in any form.
    for bad in (True, False, np.bool_(True), np.array([1, 0], dtype=bool)):
        with pytest.raises(ConfigError, match="seed must be an integer"):
            rng._as_uint(bad, "seed", 64)
    for bad in (True, np.bool_(False)):
        with pytest.raises(ConfigError, match="seed must be an integer"):
            rng.check_seed(bad)
        with pytest.raises(ConfigError, match="epoch must be an integer"):
            rng.check_epoch(bad)
    assert rng.check_epoch(np.int64(3)) == 3
