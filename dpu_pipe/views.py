"""Multi-view recipes: several augmented views of every sample, decoded once.

``Loader(source, batch_size, views=[View(...), ...])`` yields ``(images, labels)`` where
``images`` holds one batch per view, ``(B, 3, H_v, W_v)`` (or ``(B, H_v, W_v, 3)``), in view
order. View ``v`` of sample ``i`` in epoch ``e`` is a pure function of ``(seed, e, i, v)``
(each op draws from its own stream, offset by the view: :func:`dpu_pipe.rng.view_stream`).
The ops, their order, the presets and their sources: docs/guides/recipes.md ("Views").
"""

from dataclasses import dataclass, fields

from . import _validate as _v

__all__ = ["View", "dino", "simclr", "byol", "DINO_JITTER", "SIMCLR_JITTER"]

#: ColorJitter(brightness, contrast, saturation, hue) of DINO and BYOL.
DINO_JITTER = (0.4, 0.4, 0.2, 0.1)
#: SimCLR's ColorJitter at strength s = 1: (0.8 s, 0.8 s, 0.8 s, 0.2 s).
SIMCLR_JITTER = (0.8, 0.8, 0.8, 0.2)


@dataclass(frozen=True)
class View:
    """One view of a multi-view recipe (all sizes in pixels, probabilities in [0, 1]).

    Parameters
    ----------
    size : int or (height, width)
        Output size of the view.
    scale, ratio : (min, max)
        RandomResizedCrop's range of the crop's area (fraction of the image's) and of its
        aspect ratio (width / height).
    interpolation : "bilinear" or "bicubic"
        Resampling of the crop (antialiased, as Pillow's).
    color_jitter : None or (brightness, contrast, saturation, hue)
        ColorJitter's factors (torchvision's meaning); None: no jitter.
    flip_p, jitter_p, grayscale_p, blur_p, solarize_p : float
        Probabilities of the horizontal flip, of applying the jitter (``RandomApply``), of
        RandomGrayscale, of the Gaussian blur and of solarization.
    blur_sigma : (low, high)
        The blur's sigma (pixels) is drawn uniformly from this range.
    blur_kernel : int or None
        Taps of the blur kernel along each axis (odd, below twice the smaller side); None:
        SimCLR's rule, 10 % of the smaller side made odd (23 for 224, 9 for 96).
    solarize_threshold : float
        Values at or above it (0..255 scale) are inverted.
    """

    size: object = 224
    scale: tuple = (0.08, 1.0)
    ratio: tuple = (3 / 4, 4 / 3)
    interpolation: str = "bilinear"
    flip_p: float = 0.5
    color_jitter: object = None
    jitter_p: float = 1.0
    grayscale_p: float = 0.0
    blur_p: float = 0.0
    blur_sigma: tuple = (0.1, 2.0)
    blur_kernel: object = None
    solarize_p: float = 0.0
    solarize_threshold: float = 128.0

    def __post_init__(self):
        for key, value in _v.view(self, _DEFAULTS).items():
            object.__setattr__(self, key, value)

    @classmethod
    def from_dict(cls, d):
        """The view of ``d`` (a View, or the dict :meth:`to_dict` gives)."""
        if isinstance(d, View):
            return d
        return cls(**_v.view(d, _DEFAULTS))

    def to_dict(self):
        """The view as a JSON-serialisable dict (lists for pairs)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}

    @property
    def recipe_fields(self):
        """The fields a one-view :class:`~dpu_pipe.transforms.SampleRecipe` shares with the
        view, as recipe options."""
        return {k: getattr(self, k) for k in ("size", "scale", "ratio", "interpolation",
                                              "flip_p", "color_jitter", "grayscale_p")}


_DEFAULTS = {f.name: f.default for f in fields(View)}


def dino(global_size=224, local_size=96, local_crops=8, global_scale=(0.4, 1.0),
         local_scale=(0.05, 0.4)):
    """DINO's multi-crop, as facebookresearch/dino's ``DataAugmentationDINO`` (Caron et al.,
    ICCV 2021) with DINOv2's blur kernel (9 taps): the list of View
    ``[global 1, global 2, local 1, ..., local n]``.

    Parameters
    ----------
    global_size, local_size : int
        Output sizes (pixels) of the global and local views.
    local_crops : int
        Number of local views (DINO's ``local_crops_number``), 0 to 62.
    global_scale, local_scale : (min, max)
        Crop area ranges (DINO's ``global_crops_scale``, ``local_crops_scale``).
    """
    local_crops = _v.integer(local_crops, "local_crops", 0, 62)
    common = dict(interpolation="bicubic", flip_p=0.5, color_jitter=DINO_JITTER, jitter_p=0.8,
                  grayscale_p=0.2, blur_sigma=(0.1, 2.0), blur_kernel=9)
    g1 = View(size=global_size, scale=global_scale, blur_p=1.0, **common)
    g2 = View(size=global_size, scale=global_scale, blur_p=0.1, solarize_p=0.2,
              solarize_threshold=128, **common)
    local = View(size=local_size, scale=local_scale, blur_p=0.5, **common)
    return [g1, g2] + [local] * local_crops


def simclr(size=224):
    """SimCLR's two views (Chen et al., ICML 2020, appendix A), colour distortion strength 1,
    of output size ``size`` pixels: a list of two View."""
    view = View(size=size, scale=(0.08, 1.0), flip_p=0.5, color_jitter=SIMCLR_JITTER,
                jitter_p=0.8, grayscale_p=0.2, blur_p=0.5, blur_sigma=(0.1, 2.0),
                blur_kernel=None)
    return [view, view]


def byol(size=224):
    """BYOL's two views (Grill et al., NeurIPS 2020, table 6), of output size ``size`` pixels:
    a list of two View, blur p 1.0 and 0.1, solarize p 0 and 0.2."""
    common = dict(size=size, scale=(0.08, 1.0), interpolation="bicubic", flip_p=0.5,
                  color_jitter=DINO_JITTER, jitter_p=0.8, grayscale_p=0.2,
                  blur_sigma=(0.1, 2.0), blur_kernel=None, solarize_threshold=128)
    return [View(blur_p=1.0, solarize_p=0.0, **common),
            View(blur_p=0.1, solarize_p=0.2, **common)]
