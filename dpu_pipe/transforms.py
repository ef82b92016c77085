"""The one description of a per-sample transform: what the batch kernel, the loaders and the
remote producers all read. It is plain data — validated once, hashable, and shipped to DPU
producers as a dict (``to_dict`` / ``from_dict``).

Train: RandomResizedCrop(size, scale, ratio, interpolation) → horizontal flip with probability
``flip_p`` → auto-augment (``auto_augment``: TrivialAugmentWide, RandAugment or AutoAugment's
ImageNet policy) → colour jitter (random order of its four, as torchvision draws it) →
grayscale → output conversion → random erasing (``random_erase``), in torchvision's order;
then, on the whole batch, MixUp / CutMix and label smoothing and ``batch_hook``
(:mod:`dpu_pipe.mix`).
Val:   resize the shorter side to ``resize`` (``interpolation``) → center crop ``size``.
Both end in the output conversion: float32/float16/bfloat16 normalized by ``mean``/``std``
(given in [0, 1] units, like torchvision), or uint8 (not normalized), in CHW or HWC layout.
bfloat16 is the float32 value rounded to nearest even, as torch rounds it; numpy has no
bfloat16, so numpy arrays hold its uint16 bits.
"""

from dataclasses import asdict, dataclass, fields

import numpy as np

from . import _validate as _v
from .errors import ConfigError
from .jpeg import DEFAULT_MAX_PIXELS
from .ops import IMAGENET_MEAN, IMAGENET_STD

__all__ = ["TransformConfig", "IMAGENET_MEAN", "IMAGENET_STD"]


DTYPES = ("float32", "float16", "bfloat16", "uint8")
LAYOUTS = ("CHW", "HWC")
INTERPOLATIONS = ("bilinear", "bicubic")
AUTO_AUGMENT = ("ta_wide", "ra", "imagenet")
#: Who decodes the JPEG crop boxes: libjpeg-turbo, or dpu_pipe's own baseline decoder
#: (bit-identical; it hands every stream it does not take, and damaged data, to libjpeg-turbo).
JPEG_DECODERS = ("libjpeg", "own")


@dataclass(frozen=True)
class TransformConfig:
    """Per-sample transform, train or val. Sizes are in pixels, (height, width)."""

    train: bool = True
    size: tuple = (224, 224)
    scale: tuple = (0.08, 1.0)
    ratio: tuple = (3 / 4, 4 / 3)
    flip_p: float = 0.5
    resize: int = 0                     # val: shorter side before the crop; 0 = size / 0.875
    mean: tuple = IMAGENET_MEAN
    std: tuple = IMAGENET_STD
    dtype: str = "float32"
    layout: str = "CHW"
    fast: bool = False                  # decode with the fast IDCT and plain upsampling
    max_pixels: int = DEFAULT_MAX_PIXELS
    # "libjpeg" or "own" (JPEG_DECODERS): the same pixels either way, only the speed differs.
    jpeg_decoder: str = "libjpeg"
    # Recipes (train only, except interpolation), in torchvision's vocabulary:
    interpolation: str = "bilinear"     # crop and validation resize, antialiased (Pillow)
    auto_augment: object = None         # None, "ta_wide", "ra" or "imagenet"
    ra_num_ops: int = 2                 # RandAugment: ops per sample
    ra_magnitude: int = 9               # RandAugment: magnitude bin (0 .. ra_num_bins - 1)
    ra_num_bins: int = 31               # RandAugment: num_magnitude_bins
    ra_mstd: float = 0.0                # RandAugment: std of the level (timm's mstd), in bins
    fill: tuple = (0, 0, 0)             # auto-augment affine ops: value outside the image
    color_jitter: object = None         # None or (brightness, contrast, saturation, hue)
    grayscale_p: float = 0.0            # RandomGrayscale probability
    random_erase: float = 0.0           # RandomErasing probability
    erase_scale: tuple = (0.02, 0.33)
    erase_ratio: tuple = (0.3, 3.3)
    erase_value: tuple = (0.0, 0.0, 0.0)  # in output units (after normalize), per channel,
                                          # or "random" (standard normal values)
    # Batch ops (train only; dpu_pipe.mix): torchvision v2 MixUp / CutMix, timm's switch,
    # probability and label smoothing; labels then float32 (B, num_classes).
    mixup_alpha: float = 0.0            # MixUp's Beta(alpha, alpha); 0 = off
    cutmix_alpha: float = 0.0           # CutMix's Beta(alpha, alpha); 0 = off
    mix_switch_p: float = 0.5           # both on: probability that a batch is CutMix
    mix_p: float = 1.0                  # probability that a batch is mixed at all
    label_smoothing: float = 0.0        # timm's: off = s / K, on = 1 - s + s / K
    num_classes: object = None          # K, needed by mixing and smoothing
    batch_hook: object = None           # "module:function" run on every finished batch

    def __post_init__(self):
        size = self.size
        if isinstance(size, (int, np.integer)) and not isinstance(size, (bool, np.bool_)):
            size = (size, size)
        try:
            size = tuple(size)
        except TypeError:
            raise ConfigError(f"size must be an int or (height, width), got {self.size!r}") \
                from None
        if len(size) != 2:
            raise ConfigError(f"size must be an int or (height, width), got {self.size!r}")
        size = tuple(_v.positive_int(v, "size") for v in size)
        object.__setattr__(self, "size", size)
        scale = _v.pair(self.scale, "scale")
        ratio = _v.pair(self.ratio, "ratio")
        if not 0 < scale[0] <= scale[1] <= 1.0:
            raise ConfigError(f"scale must satisfy 0 < min <= max <= 1, got {self.scale!r}")
        if not 0 < ratio[0]:
            raise ConfigError(f"ratio must satisfy 0 < min <= max, got {self.ratio!r}")
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "ratio", ratio)
        object.__setattr__(self, "flip_p", _v.number(self.flip_p, "flip_p", 0.0, 1.0))
        resize = _v.integer(self.resize, "resize", low=0) or int(round(min(size) / 0.875))
        if resize < min(size):
            raise ConfigError(f"resize ({resize}) must be at least the crop size {size}")
        object.__setattr__(self, "resize", resize)
        object.__setattr__(self, "mean", _v.triple(self.mean, "mean"))
        std = _v.triple(self.std, "std")
        if min(std) <= 0:
            raise ConfigError(f"std must be positive, got {self.std!r}")
        object.__setattr__(self, "std", std)
        object.__setattr__(self, "dtype", _v.dtype(self.dtype))
        object.__setattr__(self, "layout", _v.choice(self.layout, "layout", LAYOUTS))
        object.__setattr__(self, "train", _v.boolean(self.train, "train"))
        object.__setattr__(self, "fast", _v.boolean(self.fast, "fast"))
        object.__setattr__(self, "max_pixels", _v.positive_int(self.max_pixels, "max_pixels"))
        object.__setattr__(self, "jpeg_decoder", _v.choice(self.jpeg_decoder, "jpeg_decoder",
                                                           JPEG_DECODERS))
        self._check_recipe()

    def _check_recipe(self):
        """Validate and normalize the recipe fields (augmentation beyond crop and flip)."""
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("interpolation", _v.choice(self.interpolation, "interpolation", INTERPOLATIONS))
        if self.auto_augment is not None:
            _v.choice(self.auto_augment, "auto_augment", AUTO_AUGMENT)
        set_("ra_num_ops", _v.integer(self.ra_num_ops, "ra_num_ops", 0, 16))
        set_("ra_num_bins", _v.integer(self.ra_num_bins, "ra_num_bins", 2, 64))
        set_("ra_magnitude", _v.integer(self.ra_magnitude, "ra_magnitude", 0,
                                        self.ra_num_bins - 1))
        set_("ra_mstd", _v.number(self.ra_mstd, "ra_mstd", 0.0, 100.0))
        fill = _v.triple(self.fill if not isinstance(self.fill, (int, float)) else
                         (self.fill,) * 3, "fill")
        if not all(0 <= v <= 255 and v == int(v) for v in fill):
            raise ConfigError(f"fill must be integers 0..255, got {self.fill!r}")
        set_("fill", tuple(int(v) for v in fill))
        if self.color_jitter is not None:
            cj = self.color_jitter
            cj = (cj, cj, cj, 0.0) if isinstance(cj, (int, float)) else cj
            try:
                cj = tuple(float(v) for v in cj)
            except (TypeError, ValueError):
                raise ConfigError("color_jitter must be None, a number or (brightness, "
                                  f"contrast, saturation, hue), got {self.color_jitter!r}") \
                    from None
            if len(cj) == 3:
                cj = cj + (0.0,)
            if len(cj) != 4 or not all(0.0 <= v < 1e6 for v in cj) or cj[3] > 0.5:
                raise ConfigError("color_jitter must be (brightness, contrast, saturation, "
                                  f"hue) with each >= 0 and hue <= 0.5, got {self.color_jitter!r}")
            set_("color_jitter", cj if any(cj) else None)
        set_("grayscale_p", _v.number(self.grayscale_p, "grayscale_p", 0.0, 1.0))
        set_("random_erase", _v.number(self.random_erase, "random_erase", 0.0, 1.0))
        es = _v.pair(self.erase_scale, "erase_scale")
        er = _v.pair(self.erase_ratio, "erase_ratio")
        if not (0 < es[0] and es[1] <= 1.0 and 0 < er[0]):
            raise ConfigError(f"erase_scale must lie in (0, 1] and erase_ratio be positive, "
                              f"got {self.erase_scale!r}, {self.erase_ratio!r}")
        set_("erase_scale", es)
        set_("erase_ratio", er)
        set_("erase_value", _v.erase_value(self.erase_value, self.dtype, self.size))
        for name in ("mixup_alpha", "cutmix_alpha"):
            set_(name, _v.number(getattr(self, name), name, 0.0, 1e6))
        set_("mix_switch_p", _v.number(self.mix_switch_p, "mix_switch_p", 0.0, 1.0))
        set_("mix_p", _v.number(self.mix_p, "mix_p", 0.0, 1.0))
        set_("label_smoothing", _v.number(self.label_smoothing, "label_smoothing", 0.0, 1.0))
        if self.num_classes is not None:
            set_("num_classes", _v.integer(self.num_classes, "num_classes", 1, 1 << 24))
        if self.num_classes is None and (self.mixup_alpha > 0 or self.cutmix_alpha > 0
                                         or self.label_smoothing > 0):
            raise ConfigError("mixup_alpha, cutmix_alpha and label_smoothing need "
                              "num_classes (labels become float32 (B, num_classes))")
        if self.batch_hook is not None:
            _v.hook_path(self.batch_hook, "batch_hook")

    @property
    def sample_shape(self):
        """Shape of one output sample: (3, H, W) for CHW, (H, W, 3) for HWC."""
        h, w = self.size
        return (3, h, w) if self.layout == "CHW" else (h, w, 3)

    @property
    def np_dtype(self):
        """numpy dtype of the output; bfloat16 samples are held as their uint16 bits."""
        return np.dtype(np.uint16 if self.dtype == "bfloat16" else self.dtype)

    @property
    def sample_bytes(self):
        return int(np.prod(self.sample_shape)) * self.np_dtype.itemsize

    def to_dict(self):
        """JSON-serialisable form, for shipping to producers. ``jpeg_decoder`` only when it
        is not the default, so the specs (and producers' stream keys) of every other stream
        stay what they were."""
        d = asdict(self)
        if d["jpeg_decoder"] == "libjpeg":
            del d["jpeg_decoder"]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @property
    def uint8_pass(self):
        """Whether samples are resized to uint8 first and augmented there, then converted
        (bicubic, auto-augment, colour jitter, grayscale), as torchvision's PIL pipeline holds
        them; the plain recipe converts inside the resampling pass."""
        return self.interpolation != "bilinear" or (self.train and (
            self.auto_augment is not None or self.color_jitter is not None
            or self.grayscale_p > 0))

    @property
    def soft_labels(self):
        """Whether batches carry float32 (B, num_classes) labels: a train transform that
        mixes or smooths labels (validation keeps the source's labels)."""
        return self.train and (self.mixup_alpha > 0 or self.cutmix_alpha > 0
                               or self.label_smoothing > 0)

    @property
    def augmented(self):
        """Whether anything beyond the fused crop, flip and conversion runs."""
        return self.uint8_pass or (self.train and self.random_erase > 0)

    @classmethod
    def from_dict(cls, d):
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown transform settings: {sorted(unknown)}")
        return cls(**d)

