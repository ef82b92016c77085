"""The one description of what happens to a sample and to a batch, read by the batch kernel,
the loaders and the remote producers: plain data, validated once, hashable, and shipped to DPU
producers as one flat dict (``to_dict`` / ``from_dict``).

A :class:`TransformConfig` has three parts, along the seams of the pipeline:
:class:`DecodeOptions` (how a JPEG is decoded), :class:`SampleRecipe` (what one sample goes
through, train or val, in torchvision's order, and the output conversion; with ``views``, one
output per view) and :class:`BatchOptions` (what happens to a finished train batch). Users pass
every option flat (``Loader(..., auto_augment="ta_wide", mixup_alpha=0.2)``) and
:class:`TransformConfig` routes each to its part by name: adding an option is adding a field
(with its check) to one part, and reading it where it acts.
"""

import functools
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from . import _validate as _v
from .constants import (AUTO_AUGMENT, IMAGENET_MEAN, IMAGENET_STD, INTERPOLATIONS, LAYOUTS)
from .errors import ConfigError
from .jpeg import DEFAULT_MAX_PIXELS
from .progressive import ProgressiveSize
from .rng import MAX_VIEWS
from .views import View

__all__ = ["TransformConfig", "DecodeOptions", "SampleRecipe", "BatchOptions",
           "IMAGENET_MEAN", "IMAGENET_STD"]


def _set(obj, name, value):
    object.__setattr__(obj, name, value)


def _check(obj, name, check, *args):
    """Replace field ``name`` of a frozen dataclass by ``check(value, name, *args)``."""
    _set(obj, name, check(getattr(obj, name), name, *args))


@dataclass(frozen=True)
class DecodeOptions:
    """How a sample's JPEG is decoded; the pixels of the crop box depend on it only through
    ``fast`` and ``decode_max_side``.

    ``decode_max_side=S`` (pixels; None: off) decodes every sample whole at the smallest DCT
    scale s/8 whose longest side is still >= S, then reduces it (antialiased bilinear) to a
    longest side of exactly S, the other ``round(side * S / longest)``, half up, at least 1
    (an image no larger than S is kept as decoded). Crops are drawn from and cut out of that
    image, so the stream depends on S, as on a ``pack --max-side`` dataset; it is what
    ``cache_bytes`` caches.
    """

    fast: bool = False                  # the fast IDCT and plain chroma upsampling
    max_pixels: int = DEFAULT_MAX_PIXELS  # refuse images larger than this (decompression bombs)
    decode_max_side: object = None      # None, or decode whole and reduce to this longest side

    def __post_init__(self):
        _check(self, "fast", _v.boolean)
        _check(self, "max_pixels", _v.positive_int)
        if self.decode_max_side is not None:
            _check(self, "decode_max_side", _v.integer, 1, _v.MAX_SIDE)


@dataclass(frozen=True)
class SampleRecipe:
    """What one sample goes through, train or val. Sizes are in pixels, (height, width).

    ``size`` may be a :class:`~dpu_pipe.progressive.ProgressiveSize` (train only): the output
    size then changes with the epoch (``TransformConfig.at_epoch``), and
    :attr:`sample_shape` is the largest epoch's, what buffers are sized for."""

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
    views: object = None                # None, or a multi-view recipe: a tuple of View

    def __post_init__(self):
        self._check_geometry()
        self._check_ops()
        self._check_views()

    def _check_views(self):
        if self.views is None:
            return
        if not self.train:
            raise ConfigError("views= is a train recipe (random crops and colour ops): "
                              "evaluate with train=False and no views")
        if isinstance(self.views, (View, dict, str)):
            raise ConfigError("views must be a list of dpu_pipe.views.View (e.g. "
                              "dpu_pipe.views.dino())")
        try:
            views = tuple(View.from_dict(v) for v in self.views)
        except TypeError:
            raise ConfigError(f"views must be a list of dpu_pipe.views.View, got "
                              f"{self.views!r}") from None
        if not 1 <= len(views) <= MAX_VIEWS:
            raise ConfigError(f"views must hold 1 to {MAX_VIEWS} views, got {len(views)}")
        # The view sets these; a recipe value beside it would be silently ignored.
        clash = [f.name for f in fields(self) if f.name in _PER_VIEW
                 and getattr(self, f.name) != _RECIPE_DEFAULTS[f.name]]
        if clash:
            raise ConfigError(f"views= sets each view's crop and colour ops itself: leave "
                              f"{', '.join(clash)} unset (or set them on each View)")
        _set(self, "views", views)

    def _check_geometry(self):
        size = self.size
        if isinstance(size, dict):
            size = ProgressiveSize.from_dict(size)
        if isinstance(size, ProgressiveSize):
            self._check_progressive(size)
            return
        size = _v.image_size(size)
        _set(self, "size", size)
        scale, ratio = _v.crop_range(self.scale, self.ratio)
        _set(self, "scale", scale)
        _set(self, "ratio", ratio)
        _check(self, "flip_p", _v.number, 0.0, 1.0)
        resize = _v.integer(self.resize, "resize", low=0) or int(round(min(size) / 0.875))
        if resize < min(size):
            raise ConfigError(f"resize ({resize}) must be at least the crop size {size}")
        _set(self, "resize", resize)
        _check(self, "train", _v.boolean)
        _check(self, "interpolation", _v.choice, INTERPOLATIONS)

    def _check_progressive(self, size):
        """The geometry checks with a progressive ``size``: a train recipe; ``resize`` (a
        validation setting) is kept as given."""
        _check(self, "train", _v.boolean)
        if not self.train:
            raise ConfigError("a progressive size is a train recipe: give the evaluation "
                              "loader a fixed size (FFCV's validation resolution, "
                              "examples/train_imagenet.py --val-res)")
        # Everything else is checked as for the largest size.
        resize = _v.integer(self.resize, "resize", low=0)
        _set(self, "size", (size.largest, size.largest))
        try:
            self._check_geometry()
        finally:
            _set(self, "size", size)
        _set(self, "resize", resize)

    @property
    def progressive(self):
        """Whether the output size changes with the epoch (``size`` is a ProgressiveSize)."""
        return isinstance(self.size, ProgressiveSize)

    @property
    def largest_size(self):
        """(height, width) of the largest output of any epoch, in pixels."""
        if self.progressive:
            return (self.size.largest,) * 2
        return self.size

    def _check_ops(self):
        """The output conversion, auto-augment, colour and erasing options."""
        _check(self, "mean", _v.triple)
        std = _v.triple(self.std, "std")
        if min(std) <= 0:
            raise ConfigError(f"std must be positive, got {self.std!r}")
        _set(self, "std", std)
        _check(self, "dtype", _v.dtype)
        _check(self, "layout", _v.choice, LAYOUTS)
        if self.auto_augment is not None:
            _v.choice(self.auto_augment, "auto_augment", AUTO_AUGMENT)
        _check(self, "ra_num_ops", _v.integer, 0, 16)
        _check(self, "ra_num_bins", _v.integer, 2, 64)
        _check(self, "ra_magnitude", _v.integer, 0, self.ra_num_bins - 1)
        _check(self, "ra_mstd", _v.number, 0.0, 100.0)
        fill = _v.triple(self.fill if not isinstance(self.fill, (int, float)) else
                         (self.fill,) * 3, "fill")
        if not all(0 <= v <= 255 and v == int(v) for v in fill):
            raise ConfigError(f"fill must be integers 0..255, got {self.fill!r}")
        _set(self, "fill", tuple(int(v) for v in fill))
        _check(self, "color_jitter", _v.color_jitter)
        _check(self, "grayscale_p", _v.number, 0.0, 1.0)
        _check(self, "random_erase", _v.number, 0.0, 1.0)
        es = _v.pair(self.erase_scale, "erase_scale")
        er = _v.pair(self.erase_ratio, "erase_ratio")
        if not (0 < es[0] and es[1] <= 1.0 and 0 < er[0]):
            raise ConfigError(f"erase_scale must lie in (0, 1] and erase_ratio be positive, "
                              f"got {self.erase_scale!r}, {self.erase_ratio!r}")
        _set(self, "erase_scale", es)
        _set(self, "erase_ratio", er)
        _set(self, "erase_value", _v.erase_value(self.erase_value, self.dtype,
                                                 self.largest_size))

    @property
    def sample_shape(self):
        """Shape of one output sample: (3, H, W) for CHW, (H, W, 3) for HWC (with a
        progressive size, the largest epoch's; with views, view 0's: see
        :attr:`view_shapes`)."""
        return self.view_shapes[0]

    @property
    def view_shapes(self):
        """Shape of one sample of each view, in view order: one shape without views."""
        sizes = [self.largest_size] if self.views is None else [v.size for v in self.views]
        return [(3, h, w) if self.layout == "CHW" else (h, w, 3) for h, w in sizes]

    @property
    def np_dtype(self):
        """numpy dtype of the output; bfloat16 samples are held as their uint16 bits."""
        return np.dtype(np.uint16 if self.dtype == "bfloat16" else self.dtype)

    @property
    def uint8_pass(self):
        """Whether samples are resized to uint8 first and augmented there, then converted
        (bicubic, auto-augment, colour jitter, grayscale), as torchvision's PIL pipeline holds
        them; the plain recipe converts inside the resampling pass."""
        return self.interpolation != "bilinear" or (self.train and (
            self.auto_augment is not None or self.color_jitter is not None
            or self.grayscale_p > 0))

    @property
    def augmented(self):
        """Whether anything beyond the fused crop, flip and conversion runs."""
        return self.uint8_pass or (self.train and self.random_erase > 0)


@dataclass(frozen=True)
class BatchOptions:
    """What happens to a finished train batch: torchvision v2 MixUp / CutMix, timm's switch,
    probability and label smoothing (labels then float32 (B, num_classes)), and the user's
    ``batch_hook`` (see :mod:`dpu_pipe.mix`)."""

    mixup_alpha: float = 0.0            # MixUp's Beta(alpha, alpha); 0 = off
    cutmix_alpha: float = 0.0           # CutMix's Beta(alpha, alpha); 0 = off
    mix_switch_p: float = 0.5           # both on: probability that a batch is CutMix
    mix_p: float = 1.0                  # probability that a batch is mixed at all
    label_smoothing: float = 0.0        # timm's: off = s / K, on = 1 - s + s / K
    num_classes: object = None          # K, needed by mixing and smoothing
    batch_hook: object = None           # "module:function" run on every finished batch

    def __post_init__(self):
        for name in ("mixup_alpha", "cutmix_alpha"):
            _check(self, name, _v.number, 0.0, 1e6)
        for name in ("mix_switch_p", "mix_p", "label_smoothing"):
            _check(self, name, _v.number, 0.0, 1.0)
        if self.num_classes is not None:
            _check(self, "num_classes", _v.integer, 1, 1 << 24)
        if self.num_classes is None and self.soft:
            raise ConfigError("mixup_alpha, cutmix_alpha and label_smoothing need "
                              "num_classes (labels become float32 (B, num_classes))")
        if self.batch_hook is not None:
            _v.hook_path(self.batch_hook, "batch_hook")

    @property
    def soft(self):
        """Whether labels become float32 (B, num_classes): mixing or smoothing is on."""
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0 or self.label_smoothing > 0


#: Recipe options a View sets for itself (refused beside ``views``).
_PER_VIEW = ("size", "scale", "ratio", "flip_p", "interpolation", "auto_augment",
             "color_jitter", "grayscale_p", "random_erase")
_RECIPE_DEFAULTS = {f.name: f.default for f in fields(SampleRecipe)}

#: The parts of a TransformConfig, in order: (attribute, class).
_PARTS = (("decode", DecodeOptions), ("recipe", SampleRecipe), ("batch_ops", BatchOptions))
#: Flat option name -> the attribute of the part that holds it.
_OWNER = {f.name: attr for attr, cls in _PARTS for f in fields(cls)}
#: Options left out of ``to_dict`` while None (their default).
_ONLY_WHEN_SET = ("decode_max_side", "views")


def _recipe_property(name):
    return property(lambda self: getattr(self.recipe, name),
                    doc=f"The recipe's ``{name}`` (:attr:`SampleRecipe.{name}`).")


@dataclass(frozen=True, init=False)
class TransformConfig:
    """A sample's and a batch's transform: :attr:`decode` (:class:`DecodeOptions`),
    :attr:`recipe` (:class:`SampleRecipe`) and :attr:`batch_ops` (:class:`BatchOptions`).

    Built from flat options (``TransformConfig(train=False, size=160, mixup_alpha=0.2)``),
    each routed to the part that owns it, or from parts (``decode=``, ``recipe=``,
    ``batch_ops=``), flat options then overriding their fields. An unknown option is a
    ``TypeError``, as for any function.
    """

    decode: DecodeOptions
    recipe: SampleRecipe
    batch_ops: BatchOptions

    def __init__(self, decode=None, recipe=None, batch_ops=None, **options):
        unknown = sorted(set(options) - set(_OWNER))
        if unknown:
            raise TypeError(f"TransformConfig got an unexpected keyword argument "
                            f"{unknown[0]!r}")
        for (attr, cls), part in zip(_PARTS, (decode, recipe, batch_ops)):
            mine = {k: v for k, v in options.items() if _OWNER[k] == attr}
            if part is None:
                part = cls(**mine)
            elif not isinstance(part, cls):
                raise ConfigError(f"{attr} must be a {cls.__name__}, got {part!r}")
            elif mine:
                part = replace(part, **mine)
            _set(self, attr, part)
        ops = self.batch_ops
        if self.recipe.views is not None and (ops.mixup_alpha or ops.cutmix_alpha
                                              or ops.batch_hook):
            raise ConfigError("mixup_alpha, cutmix_alpha and batch_hook work on one batch of "
                              "images, not on the views of a multi-view recipe: leave them "
                              "unset with views=")

    # Read from the recipe: see SampleRecipe.
    train = _recipe_property("train")
    sample_shape = _recipe_property("sample_shape")
    progressive = _recipe_property("progressive")
    np_dtype = _recipe_property("np_dtype")
    views = _recipe_property("views")
    view_shapes = _recipe_property("view_shapes")
    augmented = _recipe_property("augmented")
    uint8_pass = _recipe_property("uint8_pass")

    def at_epoch(self, epoch):
        """The transform of epoch ``epoch``: a fixed-size one (itself when the size is fixed;
        with a progressive size, that epoch's size). The batch kernel and the batch ops run
        on it."""
        if not self.recipe.progressive:
            return self
        return _sized(self, self.recipe.size.size_at(epoch))

    def sample_shape_at(self, epoch):
        """Shape of one output sample of epoch ``epoch``."""
        return self.at_epoch(epoch).sample_shape

    @property
    def sample_bytes(self):
        """Bytes of one output sample, every view's together."""
        return sum(int(np.prod(s)) for s in self.view_shapes) * self.np_dtype.itemsize

    def per_view(self):
        """``[(config, view)]``, one per view: the one-view TransformConfig that makes it
        (the recipe's crop and colour options from the View) and the
        :class:`~dpu_pipe.views.View` (None without views)."""
        if self.recipe.views is None:
            return [(self, None)]
        return [(replace(self, recipe=replace(self.recipe, views=None, resize=0,
                                              **v.recipe_fields)), v)
                for v in self.recipe.views]

    @property
    def soft_labels(self):
        """Whether batches carry float32 (B, num_classes) labels: a train transform that
        mixes or smooths labels (validation keeps the source's labels)."""
        return self.recipe.train and self.batch_ops.soft

    def to_dict(self):
        """The flat options as a JSON-serialisable dict, for producers and saved states.
        Options added after a stream format was fixed (``decode_max_side``) appear only when
        set, so the saved states and producers' stream keys of streams without them stay."""
        d = {}
        for attr, _ in _PARTS:
            d.update(asdict(getattr(self, attr)))
        if self.recipe.views is not None:
            d["views"] = [v.to_dict() for v in self.recipe.views]
        for key in _ONLY_WHEN_SET:
            if d[key] is None:
                del d[key]
        if self.recipe.progressive:
            d["size"] = self.recipe.size.to_dict()
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d):
        unknown = set(d) - set(_OWNER)
        if unknown:
            raise ConfigError(f"unknown transform settings: {sorted(unknown)}")
        return cls(**d)


@functools.lru_cache(maxsize=32)
def _sized(config, side):
    """``config`` (a progressive TransformConfig) at the fixed size ``side`` x ``side``:
    kept, since every batch asks for its epoch's."""
    return replace(config, recipe=replace(config.recipe, size=(side, side)))
