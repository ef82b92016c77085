"""The one description of a per-sample transform: what the batch kernel, the loaders and the
remote producers all read. It is plain data — validated once, hashable, and shipped to DPU
producers as a dict (``to_dict`` / ``from_dict``).

Train: RandomResizedCrop(size, scale, ratio) → horizontal flip with probability ``flip_p``.
Val:   resize the shorter side to ``resize`` → center crop ``size``.
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
        """JSON-serialisable form, for shipping to producers."""
        d = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d):
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown transform settings: {sorted(unknown)}")
        return cls(**d)

