"""The one description of a per-sample transform: what the batch kernel, the loaders and the
remote producers all read. It is plain data — validated once, hashable, and shipped to DPU
producers as a dict (``to_dict`` / ``from_dict``).

Train: RandomResizedCrop(size, scale, ratio) → horizontal flip with probability ``flip_p``.
Val:   resize the shorter side to ``resize`` → center crop ``size``.
Both end in the output conversion: float32/float16 normalized by ``mean``/``std`` (given in
[0, 1] units, like torchvision), or uint8 (not normalized), in CHW or HWC layout.
"""

from dataclasses import asdict, dataclass, fields

import numpy as np

from .errors import ConfigError
from .jpeg import DEFAULT_MAX_PIXELS

__all__ = ["TransformConfig", "IMAGENET_MEAN", "IMAGENET_STD"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

DTYPES = ("float32", "float16", "uint8")
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
        if isinstance(size, (int, np.integer)):
            size = (int(size), int(size))
        try:
            size = tuple(int(v) for v in size)
        except (TypeError, ValueError):
            raise ConfigError(f"size must be an int or (height, width), got {self.size!r}") \
                from None
        if len(size) != 2 or min(size) <= 0:
            raise ConfigError(f"size must be positive (height, width), got {self.size!r}")
        object.__setattr__(self, "size", size)
        scale = _pair("scale", self.scale)
        ratio = _pair("ratio", self.ratio)
        if not (0 < scale[0] <= scale[1] <= 1.0):
            raise ConfigError(f"scale must satisfy 0 < min <= max <= 1, got {self.scale!r}")
        if not (0 < ratio[0] <= ratio[1]):
            raise ConfigError(f"ratio must satisfy 0 < min <= max, got {self.ratio!r}")
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "ratio", ratio)
        if not 0.0 <= float(self.flip_p) <= 1.0:
            raise ConfigError(f"flip_p must be in [0, 1], got {self.flip_p!r}")
        object.__setattr__(self, "flip_p", float(self.flip_p))
        resize = int(self.resize) or int(round(min(size) / 0.875))
        if resize < min(size):
            raise ConfigError(f"resize ({resize}) must be at least the crop size {size}")
        object.__setattr__(self, "resize", resize)
        for name in ("mean", "std"):
            vals = getattr(self, name)
            try:
                vals = tuple(float(v) for v in vals)
            except (TypeError, ValueError):
                raise ConfigError(f"{name} must be 3 numbers, got {vals!r}") from None
            if len(vals) != 3:
                raise ConfigError(f"{name} must be 3 numbers (R, G, B), got {vals!r}")
            object.__setattr__(self, name, vals)
        if min(self.std) <= 0:
            raise ConfigError(f"std must be positive, got {self.std!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        object.__setattr__(self, "train", bool(self.train))
        object.__setattr__(self, "fast", bool(self.fast))
        if int(self.max_pixels) <= 0:
            raise ConfigError("max_pixels must be positive")

    @property
    def sample_shape(self):
        """Shape of one output sample: (3, H, W) for CHW, (H, W, 3) for HWC."""
        h, w = self.size
        return (3, h, w) if self.layout == "CHW" else (h, w, 3)

    @property
    def np_dtype(self):
        return np.dtype(self.dtype)

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


def _pair(name, value):
    try:
        a, b = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a (min, max) pair, got {value!r}") from None
    return a, b
