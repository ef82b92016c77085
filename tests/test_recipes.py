"""Training recipes (interpolation, auto-augment, colour jitter, grayscale, random erasing)
against torchvision.transforms.v2.functional applied, with the parameters the kernel reports,
to the plain recipe's output of the same sample; bicubic resampling against Pillow; the
sampling frequencies of the auto-augment ops against torchvision's own sampling.

torchvision is in requirements-dev.txt (so CI runs every test here); the parity tests skip
only where it cannot be imported.
"""

import math

import numpy as np
import pytest

from dpu_pipe import _augment, augment, jpeg, ops
from dpu_pipe.kernel import BatchProcessor, SampleInfo
from dpu_pipe.errors import ConfigError
from dpu_pipe.transforms import TransformConfig

import jpeg_corpus as jc

SEED, EPOCH = 77, 2
SIZE = 48
COL = {name: k for k, name in enumerate(SampleInfo)}

try:
    import torch
    import torchvision.transforms.v2 as T
    import torchvision.transforms.v2.functional as F
except ImportError:          # pragma: no cover - requirements-dev.txt installs it
    torch = T = F = None
needs_tv = pytest.mark.skipif(T is None, reason="torchvision is not importable")

# Ops where torchvision's uint8 result is integer-exact (no float blend before truncation).
EXACT = {"Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Posterize",
         "Solarize", "AutoContrast", "Equalize", "Invert", "Brightness", "Sharpness",
         "Contrast", "brightness", "contrast", "hue", "grayscale"}


@pytest.fixture(scope="module")
def images():
    shapes = [("astronaut", 120, 160), ("coffee", 200, 90), ("chelsea", 97, 131),
              ("astronaut", 150, 199), ("coffee", 64, 64), ("chelsea", 181, 77)]
    return [jc.pil_jpeg(jc.photo_sized(n, h, w), quality=90) for n, h, w in shapes]


def _indices(n, offset=0):
    return np.arange(offset, offset + n, dtype=np.int64) * 7919 + 3


def _run(images, indices, threads=1, **kw):
    proc = BatchProcessor(TransformConfig(**kw), num_threads=threads)
    bufs = [images[int(i) % len(images)] for i in indices]
    out, info, errors = proc.run(bufs, indices, seed=SEED, epoch=EPOCH)
    assert not errors
    return out, info


def _tv_apply(img_hwc, params, fill=(0, 0, 0)):
    """torchvision's ops on a (h, w, 3) uint8 array with the given parameters."""
    t = torch.from_numpy(np.ascontiguousarray(img_hwc)).permute(2, 0, 1).contiguous()
    aa = T.TrivialAugmentWide(fill=list(fill))
    for name, mag in params["ops"]:
        t = aa._apply_image_or_video_transform(t, name, mag, interpolation=T.InterpolationMode.NEAREST,
                                               fill=aa._fill)
    for name, factor in params["jitter"].items():
        t = {"brightness": F.adjust_brightness, "contrast": F.adjust_contrast,
             "saturation": F.adjust_saturation, "hue": F.adjust_hue}[name](t, factor)
    if params["grayscale"]:
        t = F.rgb_to_grayscale(t, num_output_channels=3)
    return t.permute(1, 2, 0).numpy()


RECIPES = {
    "ta_wide": dict(auto_augment="ta_wide"),
    "ra": dict(auto_augment="ra", ra_num_ops=2, ra_magnitude=9),
    "ra-mstd": dict(auto_augment="ra", ra_num_ops=3, ra_magnitude=7, ra_mstd=0.5, ra_num_bins=11),
    "imagenet": dict(auto_augment="imagenet"),
    "jitter": dict(color_jitter=(0.4, 0.4, 0.4, 0.1), grayscale_p=0.3),
    "ta-fill": dict(auto_augment="ta_wide", fill=(128, 64, 255)),
}


@needs_tv
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_ops_match_torchvision_on_the_plain_output(images, recipe):
    kw = RECIPES[recipe]
    idx = _indices(60)
    plain, pinfo = _run(images, idx, size=SIZE, dtype="uint8", layout="HWC")
    aug, ainfo = _run(images, idx, size=SIZE, dtype="uint8", layout="HWC", **kw)
    # The recipe's ops draw from their own streams: crop, flip and DCT scale are the plain ones.
    np.testing.assert_array_equal(pinfo, ainfo)
    cfg = TransformConfig(size=SIZE, **kw)
    aug_k = _augment.Augmenter(augment.kernel_params(cfg))
    seen = set()
    for i, index in enumerate(idx):
        params = aug_k.params(SEED, EPOCH, int(index))
        names = [n for n, _ in params["ops"]] + list(params["jitter"])
        seen.update(names + ["grayscale"] * params["grayscale"])
        ref = _tv_apply(plain[i], params, cfg.recipe.fill)
        diff = np.abs(ref.astype(int) - aug[i].astype(int))
        if all(n in EXACT for n in names):
            assert diff.max() == 0, (index, params)
        elif len(names) == 1:
            assert diff.max() <= 1, (index, params)
        else:
            # A one-level difference of a blend can move the next op (equalize, autocontrast)
            # by more; it stays rare.
            assert (diff > 1).mean() < 0.01, (index, params, diff.max())
    assert len(seen) >= 5, seen             # the 60 samples exercise several ops


@needs_tv
def test_each_op_on_random_images_matches_torchvision():
    rng = np.random.default_rng(3)
    aug_k = _augment.Augmenter(augment.kernel_params(TransformConfig(size=8)))
    cases = [("ShearX", 0.3), ("ShearX", -0.99), ("ShearY", 0.45), ("TranslateX", 13.7),
             ("TranslateY", -20.2), ("Rotate", 30.0), ("Rotate", -90.0), ("Rotate", 135.0),
             ("Rotate", 180.0), ("Rotate", -4.5), ("Brightness", 0.4), ("Brightness", -0.99),
             ("Color", 0.5), ("Color", -0.9), ("Contrast", 0.6), ("Contrast", -0.3),
             ("Sharpness", 0.7), ("Sharpness", -0.8), ("Posterize", 3.0), ("Posterize", 0.0),
             ("Posterize", 8.0), ("Solarize", 0.6), ("Solarize", 0.0), ("AutoContrast", 0.0),
             ("Equalize", 0.0), ("Invert", 0.0)]
    for h, w in [(48, 48), (37, 61)]:
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        low = (img // 4 + 60).astype(np.uint8)            # narrow range: autocontrast works
        for base in (img, low):
            for name, mag in cases:
                ours = base.copy()
                aug_k.apply_op(ours, name, mag)
                ref = _tv_apply(base, {"ops": [[name, mag]], "jitter": {}, "grayscale": False})
                diff = np.abs(ours.astype(int) - ref.astype(int))
                assert diff.max() <= (0 if name in EXACT else 1), (name, mag, (h, w))
    with pytest.raises(ConfigError, match="unknown op"):
        aug_k.apply_op(np.zeros((4, 4, 3), np.uint8), "Blur", 1.0)


@needs_tv
def test_random_erase_matches_torchvision_erase(images):
    idx = _indices(40)
    plain, _ = _run(images, idx, size=SIZE)
    erased, _ = _run(images, idx, size=SIZE, random_erase=0.5)
    aug_k = _augment.Augmenter(augment.kernel_params(TransformConfig(size=SIZE, random_erase=0.5)))
    hits = 0
    for i, index in enumerate(idx):
        box = aug_k.params(SEED, EPOCH, int(index))["erase"]
        ref = torch.from_numpy(plain[i].copy())
        if box is not None:
            hits += 1
            ref = F.erase(ref, *box, v=torch.zeros(3, 1, 1))
        np.testing.assert_array_equal(ref.numpy(), erased[i])
    assert 10 <= hits <= 30


def _erase_noise_reference(seed, epoch, index, n, ks=None):
    """Elements ``ks`` (default: all ``n``) of the documented value="random" stream
    (dpu_pipe/rng.py, STREAM_ERASE_NOISE): element k of the (3, h, w) box is the normal
    quantile of word k % 4 of block (k // 4) % 2**16 of stream 512 + k // 2**18, computed
    here with scipy's ndtri."""
    from scipy.special import ndtri

    from dpu_pipe import rng

    ks = np.arange(n) if ks is None else np.asarray(ks)
    blocks = {}
    for q in np.unique(ks >> 2):
        blocks[q] = rng.random_words(seed, epoch, index, rng.STREAM_ERASE_NOISE + int(q >> 16),
                                     int(q & 0xFFFF))
    words = np.array([blocks[k >> 2][k & 3] for k in ks], np.float64)
    return ndtri((words + 0.5) / 2**32)


@pytest.mark.slow
def test_random_erase_draws_standard_normal_values(images):
    """erase_value="random" (torchvision's value="random"): outside the box the plain
    recipe's values; inside, the documented Philox values (equal to scipy's normal quantile
    to float32 precision), pooled mean 0 and std 1, different per sample and channel."""
    idx = _indices(40)
    plain, _ = _run(images, idx, size=SIZE)
    erased, _ = _run(images, idx, size=SIZE, random_erase=0.7, erase_value="random")
    cfg = TransformConfig(size=SIZE, random_erase=0.7, erase_value="random")
    aug_k = _augment.Augmenter(augment.kernel_params(cfg))
    values, firsts = [], set()
    for i, index in enumerate(idx):
        box = aug_k.params(SEED, EPOCH, int(index))["erase"]
        if box is None:
            np.testing.assert_array_equal(plain[i], erased[i])
            continue
        t, l, h, w = box
        inside = erased[i][:, t:t + h, l:l + w]
        ref = _erase_noise_reference(SEED, EPOCH, int(index), 3 * h * w)
        np.testing.assert_allclose(inside.ravel(), ref, rtol=1e-6, atol=1e-6)
        outside = erased[i].copy()
        outside[:, t:t + h, l:l + w] = plain[i][:, t:t + h, l:l + w]
        np.testing.assert_array_equal(outside, plain[i])
        values.append(inside.ravel())
        firsts.add(float(inside[0, 0, 0]))
    v = np.concatenate(values)
    assert len(values) >= 20 and len(firsts) == len(values)
    assert v.size > 5000
    assert abs(v.mean()) < 4 / np.sqrt(v.size) and abs(v.std() - 1) < 0.03, (v.mean(), v.std())
    # The tails are there too: a standard normal has 4.6 % beyond 2 sigma.
    assert 0.03 < (np.abs(v) > 2).mean() < 0.065


def test_random_erase_noise_spans_its_streams():
    """Boxes past 2**18 elements move on to the next noise stream, as documented."""
    cfg = TransformConfig(size=(400, 400), random_erase=1.0, erase_scale=(0.9, 0.95),
                          erase_ratio=(0.9, 1.1), erase_value="random")
    proc = BatchProcessor(cfg)
    aug_k = _augment.Augmenter(augment.kernel_params(cfg))
    img = np.random.default_rng(0).integers(0, 256, (450, 460, 3), np.uint8)
    out, info = proc.empty(1), np.zeros((1, len(SampleInfo)), np.int32)
    for index in range(20):
        box = aug_k.params(0, 0, index)["erase"]
        if box is not None and 3 * box[2] * box[3] > 2**18:
            break
    else:
        pytest.fail("no box of more than 2**18 elements")
    assert proc._kernel.run_decoded(img, index, 0, 0, out, 0, info) is None
    t, l, h, w = box
    n = 3 * h * w
    ks = np.r_[0:50, 2**18 - 50:2**18 + 50, n - 50:n]       # both sides of the stream change
    np.testing.assert_allclose(out[0][:, t:t + h, l:l + w].ravel()[ks],
                               _erase_noise_reference(0, 0, index, n, ks), rtol=1e-6, atol=1e-6)


def test_erase_box_follows_torchvision_get_params():
    """Box sizes and positions within bounds; h < H and w < W; area in scale x image."""
    cfg = TransformConfig(size=(40, 56), random_erase=1.0, erase_scale=(0.1, 0.3))
    aug_k = _augment.Augmenter(augment.kernel_params(cfg))
    areas = []
    for index in range(400):
        box = aug_k.params(1, 0, index)["erase"]
        if box is None:
            continue
        i, j, h, w = box
        assert 0 <= i and i + h <= 40 and 0 <= j and j + w <= 56 and h < 40 and w < 56
        areas.append(h * w / (40 * 56))
    assert len(areas) > 300
    assert 0.07 < min(areas) and max(areas) < 0.34


def _chi2_p(observed, expected):
    from scipy.stats import chi2
    observed, expected = np.asarray(observed, float), np.asarray(expected, float)
    stat = ((observed - expected) ** 2 / expected).sum()
    return chi2.sf(stat, len(observed) - 1)


def _two_sample_p(a, b):
    from scipy.stats import chi2_contingency
    keys = sorted(set(a) | set(b))
    table = np.array([[a.get(k, 0) for k in keys], [b.get(k, 0) for k in keys]]) + 0.5
    return chi2_contingency(table)[1]


def _tv_draws(transform, n):
    """(op, magnitude) pairs torchvision's transform applies over n calls on a tiny image."""
    seen = []

    def record(image, name, magnitude, interpolation, fill):
        seen.append((name, round(magnitude, 4)))
        return image
    transform._apply_image_or_video_transform = record
    torch.manual_seed(0)
    img = torch.zeros(3, SIZE, SIZE, dtype=torch.uint8)
    for _ in range(n):
        transform(img)
    return seen


def _ours(cfg, n):
    aug_k = _augment.Augmenter(augment.kernel_params(cfg))
    return [(name, round(mag, 4)) for index in range(n)
            for name, mag in aug_k.params(5, 1, index)["ops"]]


def _counts(pairs, key):
    out = {}
    for p in pairs:
        out[key(p)] = out.get(key(p), 0) + 1
    return out


@needs_tv
@pytest.mark.parametrize("mode", ["ta_wide"] + [pytest.param(m, marks=pytest.mark.slow)
                                                for m in ("ra", "imagenet")])
def test_op_and_magnitude_frequencies_match_torchvision_sampling(mode):
    n = 6000
    cfg = TransformConfig(size=SIZE, auto_augment=mode)
    tv = {"ta_wide": T.TrivialAugmentWide(), "ra": T.RandAugment(),
          "imagenet": T.AutoAugment(T.AutoAugmentPolicy.IMAGENET)}[mode]
    ours, theirs = _ours(cfg, n), _tv_draws(tv, n)
    assert abs(len(ours) - len(theirs)) < 0.05 * len(theirs)
    p_ops = _two_sample_p(_counts(ours, lambda p: p[0]), _counts(theirs, lambda p: p[0]))
    # Magnitude values per op (signs included); 1e-4 rounding absorbs the float32 ulp
    # between numpy's linspace formula and torch's vectorized one.
    p_mag = _two_sample_p(_counts(ours, lambda p: p), _counts(theirs, lambda p: p))
    assert p_ops > 1e-4 and p_mag > 1e-4, (p_ops, p_mag)
    # The check can fail: a sampler that never draws the first op of the space is rejected.
    biased = [p for p in ours if p[0] != ours[0][0]] + [ours[1]] * 0
    assert _two_sample_p(_counts(biased, lambda p: p[0]), _counts(theirs, lambda p: p[0])) < 1e-6


def test_ta_wide_op_and_bin_frequencies_are_uniform():
    n = 14 * 31 * 20
    pairs = _ours(TransformConfig(size=SIZE, auto_augment="ta_wide"), n)
    ops_ = _counts(pairs, lambda p: p[0])
    assert len(ops_) == 14
    assert _chi2_p(list(ops_.values()), [n / 14] * 14) > 1e-4
    rot = _counts([p for p in pairs if p[0] == "Rotate"], lambda p: abs(p[1]))
    assert len(rot) == 31
    assert _chi2_p(list(rot.values()), [sum(rot.values()) / 31] * 31) > 1e-4
    skewed = dict(rot)
    skewed[0.0] = skewed.get(0.0, 0) + 60
    assert _chi2_p(list(skewed.values()), [sum(rot.values()) / 31] * 31) < 1e-4


def test_ra_mstd_spreads_the_level():
    cfg = TransformConfig(size=SIZE, auto_augment="ra", ra_magnitude=5, ra_num_bins=11,
                          ra_mstd=1.0)
    rot = [abs(m) for name, m in _ours(cfg, 3000) if name == "Rotate"]
    level = np.array(rot) / 30.0 * 10
    assert abs(level.mean() - 5) < 0.15 and 0.85 < level.std() < 1.15
    plain = [abs(m) for name, m in _ours(cfg.__class__(size=SIZE, auto_augment="ra",
                                                       ra_magnitude=5, ra_num_bins=11), 300)
             if name == "Rotate"]
    assert set(np.round(plain, 4)) == {15.0}


@needs_tv
def test_magnitude_tables_equal_torch_linspace_within_an_ulp():
    for start, end, n in [(0, 0.99, 31), (0, 135, 31), (0, 32, 31), (1, 0, 31), (0, 0.3, 10),
                          (0, 150 / 331 * SIZE, 31), (0, 0.9, 11)]:
        ours = augment.linspace32(start, end, n)
        ref = torch.linspace(start, end, n).numpy()
        assert np.all(np.abs(ours.view(np.int32) - ref.view(np.int32)) <= 1)
    for n, d in [(31, 6), (31, 4), (10, 4), (11, 4)]:
        ref = (8 - (torch.arange(n) / ((n - 1) / d))).round().int().numpy()
        np.testing.assert_array_equal(augment._posterize_bits(n, d), ref)


@pytest.mark.parametrize("kw", [dict(auto_augment="ta_wide", random_erase=0.3,
                                     interpolation="bicubic"),
                                dict(auto_augment="ra", ra_mstd=0.5, color_jitter=0.4,
                                     grayscale_p=0.2, dtype="float16", layout="HWC"),
                                dict(auto_augment="imagenet", dtype="bfloat16"),
                                dict(random_erase=0.6, erase_value="random", layout="HWC"),
                                dict(auto_augment="ta_wide", random_erase=0.6,
                                     erase_value="random", dtype="float16")])
def test_threads_do_not_change_the_stream(images, kw):
    idx = _indices(24)
    a, ia = _run(images, idx, threads=1, size=SIZE, **kw)
    b, ib = _run(images, idx[::-1].copy(), threads=2, size=SIZE, **kw)
    np.testing.assert_array_equal(a, b[::-1])
    np.testing.assert_array_equal(ia, ib[::-1])


def test_plain_recipe_is_unchanged_by_the_recipe_fields(images):
    idx = _indices(12)
    a, _ = _run(images, idx, size=SIZE)
    b, _ = _run(images, idx, size=SIZE, auto_augment=None, random_erase=0.0, color_jitter=None,
                interpolation="bilinear", grayscale_p=0.0)
    np.testing.assert_array_equal(a, b)
    assert not TransformConfig().augmented
    # Identity-only samples of an augmented recipe equal the plain uint8 output.
    c, _ = _run(images, idx, size=SIZE, dtype="uint8", layout="HWC")
    d, _ = _run(images, idx, size=SIZE, dtype="uint8", layout="HWC", auto_augment="ra",
                ra_num_ops=0)
    np.testing.assert_array_equal(c, d)


def _pillow_bicubic(img, box, size):
    from PIL import Image
    y0, x0, h, w = box
    return np.asarray(Image.fromarray(img).resize((size[1], size[0]), Image.BICUBIC,
                                                  box=(x0, y0, x0 + w, y0 + h)))


def test_bicubic_matches_pillow():
    """Antialiased bicubic against Pillow's: mean below 0.25 levels on photographs, downscaling
    and upscaling. Pillow clamps its uint8 image between the two passes, which cuts bicubic's
    overshoot at sharp edges; the float32 intermediate here keeps it, so a few pixels at
    black/white edges differ by more (measured: max 10, on 0.25 % of the values of a 7.7x
    downscale of the astronaut photo; everywhere else at most 2)."""
    stats = []
    for name, h, w in [("astronaut", 300, 400), ("coffee", 200, 300), ("chelsea", 180, 240)]:
        img = jc.photo_sized(name, h, w)
        for box, size in [((10, 20, h - 40, w - 30), (48, 48)), ((0, 0, h, w), (64, 80)),
                          ((30, 40, 25, 31), (56, 56)), ((5.5, 7.25, 120.5, 99.75), (33, 47))]:
            ours = ops.resize_crop(img, box, size, dtype="uint8", layout="HWC",
                                   interpolation="bicubic")
            ref = _pillow_bicubic(img, box, size)
            d = np.abs(ours.astype(int) - ref.astype(int))
            stats.append((d.max(), d.mean(), (d > 2).mean()))
            assert d.mean() < 0.25 and (d > 2).mean() < 0.005, (name, box, size)
    worst, mean = max(s[0] for s in stats), np.mean([s[1] for s in stats])
    print(f"bicubic vs Pillow: max {worst}, mean {mean:.4f}")
    assert sum(s[2] == 0 for s in stats) >= 10


@needs_tv
def test_bicubic_and_bilinear_match_torchvision_antialias():
    img = jc.photo_sized("astronaut", 256, 320)
    t = torch.from_numpy(img).permute(2, 0, 1).contiguous()
    for interp, mode in [("bilinear", T.InterpolationMode.BILINEAR),
                         ("bicubic", T.InterpolationMode.BICUBIC)]:
        for size in [(64, 64), (100, 150), (300, 400)]:
            ours = ops.resize_crop(img, (0, 0, 256, 320), size, dtype="uint8", layout="HWC",
                                   interpolation=interp)
            ref = F.resize(t, list(size), interpolation=mode, antialias=True)
            d = np.abs(ours.astype(int) - ref.permute(1, 2, 0).numpy().astype(int))
            print(f"{interp} {size} vs torchvision: max {d.max()}, mean {d.mean():.4f}")
            assert d.max() <= (1 if interp == "bilinear" else 6) and d.mean() < 0.2


def test_bicubic_train_and_val_run_the_uint8_pass(images):
    idx = _indices(8)
    for train in (True, False):
        lin, _ = _run(images, idx, size=SIZE, train=train, dtype="uint8")
        cub, _ = _run(images, idx, size=SIZE, train=train, dtype="uint8",
                      interpolation="bicubic")
        d = np.abs(lin.astype(int) - cub.astype(int))
        assert 0 < d.mean() < 6        # a different filter, the same crop


@pytest.mark.parametrize("bad, match", [
    (dict(interpolation="nearest"), "interpolation"),
    (dict(auto_augment="rand-m9"), "auto_augment"),
    (dict(ra_magnitude=31), "ra_magnitude"),
    (dict(ra_num_ops=-1), "ra_num_ops"),
    (dict(color_jitter=(0.4, 0.4)), "color_jitter"),
    (dict(color_jitter=(0.1, 0.1, 0.1, 0.7)), "color_jitter"),
    (dict(grayscale_p=1.5), "grayscale_p"),
    (dict(random_erase=-0.1), "random_erase"),
    (dict(erase_scale=(0.0, 0.3)), "erase_scale"),
    (dict(fill=(0, 300, 0)), "fill"),
    (dict(erase_value="gauss"), "erase_value"),
    (dict(erase_value="random", dtype="uint8"), "uint8 output is not normalized"),
    (dict(erase_value="random", size=(1200, 1200)), "up to"),
])
def test_recipe_settings_are_checked(bad, match):
    with pytest.raises(ConfigError, match=match):
        TransformConfig(**bad)


def test_recipe_round_trips_through_to_dict():
    cfg = TransformConfig(auto_augment="ra", ra_mstd=0.5, color_jitter=0.4, random_erase=0.25,
                          interpolation="bicubic", fill=128)
    assert TransformConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.recipe.color_jitter == (0.4, 0.4, 0.4, 0.0)
    assert cfg.recipe.fill == (128, 128, 128)
    assert math.isclose(cfg.recipe.erase_scale[1], 0.33)


@needs_tv
def test_loader_describe_gives_the_parameters_of_its_batches(photo_folder):
    """describe(epoch, index) of a Loader: the crop and flip of the plain recipe (its kernel
    info), and ops that turn the plain Loader's sample into the augmented Loader's."""
    from dpu_pipe.loader import Loader

    root = str(photo_folder(6, classes=2, shape=(90, 7, 120, -5), quality=90))
    kw = dict(size=SIZE, dtype="uint8", layout="HWC", seed=SEED, shuffle=False)
    recipe = dict(auto_augment="ta_wide", color_jitter=0.3, random_erase=0.5)
    with Loader(root, 6, **kw) as plain, Loader(root, 6, **kw, **recipe) as aug:
        plain.set_epoch(EPOCH)
        aug.set_epoch(EPOCH)
        (xp, _), = list(plain)
        (xa, _), = list(aug)
        for index in range(6):
            p = aug.describe(EPOCH, index)
            assert p["crop"] == plain.describe(EPOCH, index)["crop"]
            assert p["flip"] == plain.describe(EPOCH, index)["flip"]
            ref = _tv_apply(np.asarray(xp[index]), p)
            if p["erase"] is not None:
                i, j, h, w = p["erase"]
                ref[i:i + h, j:j + w] = 0
            diff = np.abs(ref.astype(int) - np.asarray(xa[index]).astype(int))
            assert (diff > 1).mean() < 0.01, (index, p)
        with pytest.raises(ConfigError, match="index"):
            aug.describe(EPOCH, 6)


def test_bicubic_upscale_with_outputs_centred_on_source_pixels():
    """At an upscale whose output centres fall on source pixel centres, bicubic taps at
    distances 1 and 2 weigh exactly 0: trimming them made the row windows move backwards and
    the kernel refused the box. It resizes, and matches Pillow's bicubic."""
    from PIL import Image
    from dpu_pipe import ops

    img = np.random.default_rng(7).integers(0, 256, (20, 20, 3), dtype=np.uint8)
    got = ops.resize_crop(img, (2.0, 2.0, 16.0, 16.0), (48, 48), dtype="uint8", layout="HWC",
                          interpolation="bicubic")
    ref = np.asarray(Image.fromarray(img).resize((48, 48), Image.BICUBIC, box=(2, 2, 18, 18)))
    diff = np.abs(got.astype(int) - ref.astype(int))
    # Pillow clamps to uint8 between its two passes, this kernel keeps float32: on noise a
    # few values differ by more (test_bicubic_matches_pillow bounds it the same way).
    assert diff.mean() < 0.5 and (diff > 2).mean() < 0.01, (diff.mean(), (diff > 2).mean())

