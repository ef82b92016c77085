"""Multi-view recipes: several augmented views of every sample, decoded once.

Self-supervised pretraining (DINO, SimCLR, BYOL) trains on several random views of each image.
``Loader(source, batch_size, views=[View(...), ...])`` yields ``(images, labels)`` where
``images`` is a list with one batch per view, ``(B, 3, H_v, W_v)`` (or ``(B, H_v, W_v, 3)``)
in view order; dtype, layout, normalization, device and pinning apply to every view as they
do to a one-view batch.

Each sample's JPEG is decoded once: the region that covers every view's crop, at the DCT
scale the most demanding view allows; each view is cut and resampled from it. A view then
goes through, in torchvision's order: RandomResizedCrop(size, scale, ratio, interpolation)
→ horizontal flip (``flip_p``) → ``RandomApply([ColorJitter(*color_jitter)], p=jitter_p)``
(its four adjustments in a random order) → ``RandomGrayscale(grayscale_p)`` →
``RandomApply([GaussianBlur(blur_kernel, blur_sigma)], p=blur_p)`` →
``RandomSolarize(solarize_threshold, p=solarize_p)`` → the output conversion.

Randomness: view ``v`` of sample ``i`` in epoch ``e`` is a pure function of
``(seed, e, i, v)``: each op draws from its own stream of the counter-based RNG, offset by
the view (see :mod:`dpu_pipe.rng`), so turning one op off (p = 0) never moves another's draw,
and view 0 draws what a one-view recipe with the same parameters draws.
``Loader.describe(epoch, index)`` gives, per view, the crop, flip, jitter factors, grayscale,
blur ``{"sigma", "kernel"}`` and solarize threshold a sample got.

The presets follow the published recipes: :func:`dino` (Caron et al., "Emerging Properties in
Self-Supervised Vision Transformers", ICCV 2021; facebookresearch/dino,
``DataAugmentationDINO``), :func:`simclr` (Chen et al., "A Simple Framework for Contrastive
Learning of Visual Representations", ICML 2020, appendix A) and :func:`byol` (Grill et al.,
"Bootstrap Your Own Latent", NeurIPS 2020, table 6).
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
    flip_p : float
        Probability of the horizontal flip.
    color_jitter : None or (brightness, contrast, saturation, hue)
        ColorJitter's factors (torchvision's meaning); None: no jitter.
    jitter_p : float
        Probability that the jitter is applied (``RandomApply``).
    grayscale_p : float
        Probability of RandomGrayscale.
    blur_p : float
        Probability of the Gaussian blur.
    blur_sigma : (low, high)
        The blur's sigma (pixels) is drawn uniformly from this range.
    blur_kernel : int or None
        Taps of the blur kernel along each axis (odd, below twice the smaller side); None:
        SimCLR's rule, 10 % of the smaller side made odd (23 for 224, 9 for 96).
    solarize_p : float
        Probability of solarization.
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
        return {f.name: list(v) if isinstance(v, tuple) else v
                for f in fields(self) for v in (getattr(self, f.name),)}

    @property
    def recipe_fields(self):
        """The fields a one-view :class:`~dpu_pipe.transforms.SampleRecipe` shares with the
        view, as recipe options (size, scale, ratio, interpolation, flip_p, color_jitter,
        grayscale_p)."""
        return {k: getattr(self, k) for k in ("size", "scale", "ratio", "interpolation",
                                              "flip_p", "color_jitter", "grayscale_p")}


_DEFAULTS = {f.name: f.default for f in fields(View)}


def dino(global_size=224, local_size=96, local_crops=8, global_scale=(0.4, 1.0),
         local_scale=(0.05, 0.4)):
    """DINO's multi-crop: two global views and ``local_crops`` local ones.

    As facebookresearch/dino's ``DataAugmentationDINO`` (main_dino.py): every view is
    RandomResizedCrop (bicubic) → flip 0.5 → ColorJitter(0.4, 0.4, 0.2, 0.1) with p 0.8 →
    grayscale 0.2 → Gaussian blur, p 1.0 on global view 1, 0.1 on global view 2 (which is
    then solarized with p 0.2, threshold 128), 0.5 on the locals. The blur is DINOv2's
    torchvision ``GaussianBlur(kernel_size=9, sigma=(0.1, 2.0))`` (DINO v1 blurs with
    Pillow's ``GaussianBlur(radius)``, same sigma range).

    Parameters
    ----------
    global_size, local_size : int
        Output sizes (pixels) of the global and local views.
    local_crops : int
        Number of local views (DINO's ``local_crops_number``), >= 0.
    global_scale, local_scale : (min, max)
        Crop area ranges (DINO's ``global_crops_scale``, ``local_crops_scale``).

    Returns
    -------
    list of View
        ``[global 1, global 2, local 1, ..., local n]``.
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
    """SimCLR's two views (Chen et al. 2020, appendix A; google-research/simclr).

    Each: RandomResizedCrop(size, scale (0.08, 1)) → flip 0.5 → ColorJitter(0.8, 0.8, 0.8,
    0.2) with p 0.8 (colour distortion strength 1) → grayscale 0.2 → Gaussian blur with p 0.5,
    sigma in (0.1, 2.0), a kernel of 10 % of the size (made odd: 23 for 224).

    Parameters
    ----------
    size : int
        Output size (pixels) of both views.

    Returns
    -------
    list of View
    """
    view = View(size=size, scale=(0.08, 1.0), flip_p=0.5, color_jitter=SIMCLR_JITTER,
                jitter_p=0.8, grayscale_p=0.2, blur_p=0.5, blur_sigma=(0.1, 2.0),
                blur_kernel=None)
    return [view, view]


def byol(size=224):
    """BYOL's two views (Grill et al. 2020, table 6).

    Each: RandomResizedCrop(size, scale (0.08, 1), bicubic) → flip 0.5 → ColorJitter(0.4,
    0.4, 0.2, 0.1) with p 0.8 → grayscale 0.2 → Gaussian blur (sigma in (0.1, 2.0), kernel
    23 pixels at 224: 10 % of the size, odd) with p 1.0 on view 1 and 0.1 on view 2 →
    solarize (threshold 128) with p 0 on view 1 and 0.2 on view 2.

    Parameters
    ----------
    size : int
        Output size (pixels) of both views.

    Returns
    -------
    list of View
    """
    common = dict(size=size, scale=(0.08, 1.0), interpolation="bicubic", flip_p=0.5,
                  color_jitter=DINO_JITTER, jitter_p=0.8, grayscale_p=0.2,
                  blur_sigma=(0.1, 2.0), blur_kernel=None, solarize_threshold=128)
    return [View(blur_p=1.0, solarize_p=0.0, **common),
            View(blur_p=0.1, solarize_p=0.2, **common)]
