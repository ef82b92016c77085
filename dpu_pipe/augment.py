"""torchvision's augmentation spaces as data for the kernels (``_augment``): which ops, which are
signed, their magnitude bins; the AutoAugment ImageNet policy; colour jitter ranges.

The tables follow ``torchvision.transforms.v2`` (``TrivialAugmentWide``, ``RandAugment``,
``AutoAugment(IMAGENET)``): bins are ``torch.linspace``'s float32 values (its two-sided formula
in numpy, within one float32 ulp of torch), Posterize's bits
``round(8 - arange(bins) / ((bins - 1) / d))``. Nothing here runs per sample.
"""

import numpy as np

from .constants import AUTO_AUGMENT
from .rng import view_stream

__all__ = ["kernel_params", "AUTO_AUGMENT", "TA_WIDE_SPACE", "RA_SPACE", "IMAGENET_POLICY"]

_MODES = {None: 0, "ta_wide": 1, "ra": 2, "imagenet": 3}

# (name, signed, kind, start, end): kind 0 linear bins start..end, 1 posterize (end: the divisor
# d of its bits formula), 2 no magnitude.
# Translate ends of RandAugment/AutoAugment scale with the image: None = 150/331 of the side.
TA_WIDE_SPACE = (
    ("Identity", False, 2, 0.0, 0.0), ("ShearX", True, 0, 0.0, 0.99),
    ("ShearY", True, 0, 0.0, 0.99), ("TranslateX", True, 0, 0.0, 32.0),
    ("TranslateY", True, 0, 0.0, 32.0), ("Rotate", True, 0, 0.0, 135.0),
    ("Brightness", True, 0, 0.0, 0.99), ("Color", True, 0, 0.0, 0.99),
    ("Contrast", True, 0, 0.0, 0.99), ("Sharpness", True, 0, 0.0, 0.99),
    ("Posterize", False, 1, 8.0, 6.0), ("Solarize", False, 0, 1.0, 0.0),
    ("AutoContrast", False, 2, 0.0, 0.0), ("Equalize", False, 2, 0.0, 0.0))
_AA_COMMON = (
    ("ShearX", True, 0, 0.0, 0.3), ("ShearY", True, 0, 0.0, 0.3),
    ("TranslateX", True, 0, 0.0, None), ("TranslateY", True, 0, 0.0, None),
    ("Rotate", True, 0, 0.0, 30.0), ("Brightness", True, 0, 0.0, 0.9),
    ("Color", True, 0, 0.0, 0.9), ("Contrast", True, 0, 0.0, 0.9),
    ("Sharpness", True, 0, 0.0, 0.9), ("Posterize", False, 1, 8.0, 4.0),
    ("Solarize", False, 0, 1.0, 0.0), ("AutoContrast", False, 2, 0.0, 0.0),
    ("Equalize", False, 2, 0.0, 0.0))
RA_SPACE = (("Identity", False, 2, 0.0, 0.0),) + _AA_COMMON
_AA_SPACE = _AA_COMMON + (("Invert", False, 2, 0.0, 0.0),)

#: AutoAugment's ImageNet policy: 25 sub-policies of two (op, probability, magnitude bin).
IMAGENET_POLICY = (
    (("Posterize", 0.4, 8), ("Rotate", 0.6, 9)),
    (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
    (("Equalize", 0.8, None), ("Equalize", 0.6, None)),
    (("Posterize", 0.6, 7), ("Posterize", 0.6, 6)), (("Equalize", 0.4, None), ("Solarize", 0.2, 4)),
    (("Equalize", 0.4, None), ("Rotate", 0.8, 8)), (("Solarize", 0.6, 3), ("Equalize", 0.6, None)),
    (("Posterize", 0.8, 5), ("Equalize", 1.0, None)), (("Rotate", 0.2, 3), ("Solarize", 0.6, 8)),
    (("Equalize", 0.6, None), ("Posterize", 0.4, 6)), (("Rotate", 0.8, 8), ("Color", 0.4, 0)),
    (("Rotate", 0.4, 9), ("Equalize", 0.6, None)),
    (("Equalize", 0.0, None), ("Equalize", 0.8, None)),
    (("Invert", 0.6, None), ("Equalize", 1.0, None)), (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Rotate", 0.8, 8), ("Color", 1.0, 2)), (("Color", 0.8, 8), ("Solarize", 0.8, 7)),
    (("Sharpness", 0.4, 7), ("Invert", 0.6, None)), (("ShearX", 0.6, 5), ("Equalize", 1.0, None)),
    (("Color", 0.4, 0), ("Equalize", 0.6, None)), (("Equalize", 0.4, None), ("Solarize", 0.2, 4)),
    (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
    (("Invert", 0.6, None), ("Equalize", 1.0, None)), (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Equalize", 0.8, None), ("Equalize", 0.6, None)))


def linspace32(start, end, steps):
    """torch.linspace(start, end, steps) in float32 by its formula: start + step * i below
    the middle, end - step * (steps - 1 - i) from there."""
    f = np.float32
    a, b = f(start), f(end)
    if steps == 1:
        return np.array([a], np.float32)
    step = (b - a) / f(steps - 1)
    half = steps // 2
    return np.array([a + step * f(i) if i < half else b - step * f(steps - 1 - i)
                     for i in range(steps)], np.float32)


def _posterize_bits(num_bins, div):
    q = np.arange(num_bins).astype(np.float32) / np.float32((num_bins - 1) / div)
    return np.rint(np.float32(8) - q).astype(np.int64).astype(np.float64)


def _bins(entry, num_bins, height, width):
    """(start, end, magnitude bins) of one space entry for an image of height x width."""
    name, _, kind, start, end = entry
    if kind == 2:
        return 0.0, 0.0, []
    if kind == 1:
        return 8.0, end, _posterize_bits(num_bins, end)
    if end is None:
        end = 150.0 / 331.0 * (width if name == "TranslateX" else height)
    return float(start), float(end), linspace32(start, end, num_bins)


def _jitter_ranges(color_jitter):
    """ColorJitter's (min, max) per brightness, contrast, saturation, hue; None when off."""
    if color_jitter is None:
        return [None] * 4
    b, c, s, h = color_jitter
    out = [None if v == 0 else (max(0.0, 1.0 - v), 1.0 + v) for v in (b, c, s)]
    out.append(None if h == 0 else (-h, h))
    return out


def kernel_params(config, view=None, index=0):
    """The dict ``_augment.Augmenter`` and the batch kernel read, from a TransformConfig's
    :class:`~dpu_pipe.transforms.SampleRecipe`; for view ``index`` of a multi-view recipe,
    from its one-view config (:meth:`~dpu_pipe.transforms.TransformConfig.per_view`) and
    its :class:`~dpu_pipe.views.View` (jitter probability, blur, solarize, RNG streams)."""
    extra = {"jitter_p": 1.0, "blur_p": 0.0, "solarize_p": 0.0, "vstream": 0}
    if view is not None:
        extra = {"jitter_p": view.jitter_p, "blur_p": view.blur_p,
                 "blur_sigma": list(view.blur_sigma), "blur_kernel": view.blur_kernel,
                 "solarize_p": view.solarize_p,
                 "solarize_threshold": float(view.solarize_threshold),
                 "vstream": view_stream(0, index)}
    config = config.recipe
    oh, ow = config.size
    mode = config.auto_augment if config.train else None
    num_bins = config.ra_num_bins if mode == "ra" else (10 if mode == "imagenet" else 31)
    space, policies = [], []
    if mode in ("ta_wide", "ra"):
        for entry in TA_WIDE_SPACE if mode == "ta_wide" else RA_SPACE:
            start, end, bins = _bins(entry, num_bins, oh, ow)
            space.append((entry[0], bool(entry[1]), entry[2], start, end,
                          [float(v) for v in bins]))
    elif mode == "imagenet":
        table = {e[0]: e for e in _AA_SPACE}
        for pol in IMAGENET_POLICY:
            policies.append([(name, p, 0.0 if level is None else
                              float(_bins(table[name], 10, oh, ow)[2][level]),
                              bool(table[name][1]) and level is not None)
                             for name, p, level in pol])
    train = config.train
    return {
        "mode": _MODES[mode], "size": [oh, ow], "space": space, "num_bins": num_bins,
        "num_ops": config.ra_num_ops if mode == "ra" else 0,
        "magnitude": config.ra_magnitude if mode == "ra" else 0,
        "mstd": config.ra_mstd if mode == "ra" else 0.0,
        "posterize_div": 4.0 if mode in ("ra", "imagenet") else 6.0,
        "policies": policies, "fill": list(config.fill),
        "jitter": _jitter_ranges(config.color_jitter if train else None),
        "grayscale_p": config.grayscale_p if train else 0.0,
        "erase_p": config.random_erase if train else 0.0,
        "erase_scale": list(config.erase_scale), "erase_ratio": list(config.erase_ratio),
        "erase_value": [0.0] * 3 if config.erase_value == "random" else
                       [float(v) for v in config.erase_value],
        "erase_random": config.erase_value == "random", **extra,
    }

