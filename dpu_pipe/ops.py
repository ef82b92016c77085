"""Per-image transforms after decode: crop + resize + flip + normalize + layout in one kernel.

The kernel (``dpu_pipe._ops``, C-level API in ``src/dpu_pipe/_ops.pxd``) resamples a source box
of a uint8 RGB image with Pillow's antialiased bilinear filter (``Image.resize(size,
Image.BILINEAR, box=...)``: a triangle whose support widens with the downscale factor), in
float32 instead of Pillow's 8-bit fixed point: closer to the exact filter, within one level of
255 of Pillow. Training (RandomResizedCrop) and validation (:func:`center_crop_box`) differ
only in the source box.

The self-supervised recipes (DINO, SimCLR, BYOL) add two whole-image ops: :func:`gaussian_blur`
and :func:`solarize`. Every result is bit-identical across runs, threads and x86-64/aarch64.

The three image functions read ``img``, a uint8 (H, W, 3) RGB array (strided rows in place,
other layouts copied first), fill ``out``, a writable C-contiguous array of the result's shape
and dtype (allocated when None), return it, and raise ConfigError for an invalid argument.
"""

import threading

import numpy as np

from . import _augment, _ops
from . import _validate as _v
from .constants import IMAGENET_MEAN, IMAGENET_STD, LAYOUTS
from .errors import ConfigError

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "resize_crop", "center_crop_box", "output_shape",
           "gaussian_blur", "solarize"]

_DTYPES = {"float32": np.float32, "uint8": np.uint8, "float16": np.float16}

_local = threading.local()


def _workspace():
    """This thread's resampling scratch, or a fresh one while a re-entrant call holds it."""
    ws = getattr(_local, "ws", None)
    if ws is None:
        ws = _local.ws = _ops.Workspace()
    return _ops.Workspace() if ws.busy else ws


def _size_pair(size):
    """``size`` as (height, width) in pixels, each below 2**20."""
    oh, ow = _v.image_size(size)
    if max(oh, ow) >= 1 << 20:
        raise ConfigError(f"size must hold positive ints below 2**20, got {size!r}")
    return oh, ow


def _dtype_name(dtype):
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in _DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return name


def output_shape(size, layout="CHW"):
    """Shape of one output sample: ``(3, oh, ow)`` for CHW, ``(oh, ow, 3)`` for HWC."""
    oh, ow = _size_pair(size)
    _v.choice(layout, "layout", LAYOUTS)
    return (3, oh, ow) if layout == "CHW" else (oh, ow, 3)


def resize_crop(img, box, size, *, flip=False, dtype="float32", layout="CHW",
                mean=IMAGENET_MEAN, std=IMAGENET_STD, out=None, interpolation="bilinear"):
    """Resample a box of an RGB image to ``size``, mirror it, convert and normalize it.

    Parameters
    ----------
    img : ndarray, uint8, shape (H, W, 3)
    box : (y0, x0, h, w)
        Source box in pixels of ``img``, fractional values allowed (a box scaled to a DCT
        scale). It must lie inside the image (``0 <= y0``, ``h > 0``, ``y0 + h <= H``, likewise
        for x); an overshoot of up to 1e-6 pixel is clamped.
    size : int or (oh, ow)
        Output height and width in pixels.
    flip : bool
        Mirror left-right (bit-identical to mirroring the unflipped output).
    dtype : "float32", "uint8" or "float16"
        float32/float16: ``(x / 255 - mean) / std`` per channel, computed as
        ``x * (1 / (255 std)) + (-mean / std)`` in float32 (within 2 float32 ulp of the
        formula); float16 is that float32 value rounded to nearest even. uint8: the resampled
        value rounded half up and clamped, ``mean``/``std`` ignored.
    layout : "CHW" or "HWC"
        Output ``(3, oh, ow)`` or ``(oh, ow, 3)``.
    mean, std : 3 floats each
        Per-channel normalization on the 0..1 scale; ``std`` > 0.
    out : ndarray, optional
        Of shape ``output_shape(size, layout)`` and dtype ``dtype``.
    interpolation : "bilinear" or "bicubic"
        Pillow's antialiased filter (torchvision's ``antialias=True``): the triangle, or the
        Keys cubic with a = -0.5, support scaled by the downscale factor. Bicubic overshoots:
        uint8 output is clamped to 0..255, float outputs are not.
    """
    img = _rgb_image(img)
    if img.shape[0] < 1 or img.shape[1] < 1:
        raise ConfigError(f"img is empty: shape {img.shape}")
    try:
        y0, x0, h, w = (float(v) for v in box)
    except (TypeError, ValueError):
        raise ConfigError(f"box must be 4 numbers (y0, x0, h, w), got {box!r}") from None
    H, W = img.shape[:2]
    slack = _ops.BOX_SLACK
    if not (h > 0 and w > 0 and y0 >= -slack and x0 >= -slack and y0 + h <= H + slack
            and x0 + w <= W + slack):
        raise ConfigError(f"box (y0, x0, h, w) = {(y0, x0, h, w)} must have h, w > 0 and lie "
                          f"inside the {H}x{W} image")
    oh, ow = _size_pair(size)
    name = _dtype_name(dtype)
    shape = output_shape((oh, ow), layout)
    mean = _v.triple(mean, "mean")
    std = _v.triple(std, "std")
    if not all(s > 0 for s in std):
        raise ConfigError(f"std must be positive, got {std!r}")
    flip = _v.boolean(flip, "flip")
    interpolation = _v.choice(interpolation, "interpolation", tuple(_ops.FILTER_CODES))
    out = _out_array(out, shape, name)
    ws = _workspace()
    ws.busy = True
    try:
        _ops.resize_crop_into(img, y0, x0, h, w, out.reshape(-1).view(np.uint8), oh, ow, flip,
                              _ops.DTYPE_CODES[name], _ops.LAYOUT_CODES[layout], mean, std, ws,
                              _ops.FILTER_CODES[interpolation])
    finally:
        ws.busy = False
    return out


def center_crop_box(height, width, size=224, resize=256):
    """Source box, as floats ``(y0, x0, h, w)`` in pixels of the ``height`` x ``width`` image,
    of torchvision's ``Resize(resize)`` then ``CenterCrop(size)``, for :func:`resize_crop`.

    Resize sets the shorter side to ``resize`` and the longer to ``int(resize * long /
    short)``; the crop's offsets round half to even. Where the crop is larger than the resized
    image, torchvision pads with zeros; here the image is scaled just enough to cover it.
    ConfigError when ``resize`` is below the crop's shorter side.
    """
    height, width, resize = (_v.integer(v, name, 1, (1 << 30) - 1) for v, name in
                             ((height, "height"), (width, "width"), (resize, "resize")))
    sh, sw = _size_pair(size)
    if resize < min(sh, sw):
        raise ConfigError(f"resize ({resize}) must be at least the crop's shorter side "
                          f"({min(sh, sw)})")
    return _ops.center_crop_box(height, width, sh, sw, resize)


def _what(value):
    """How an error message names a value that should have been an array."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype} array of shape {value.shape}"
    return type(value).__name__


def _rgb_image(img):
    """img checked as uint8 (H, W, 3), copied when its pixels are not 3 contiguous bytes."""
    if (not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3
            or img.shape[2] != 3):
        raise ConfigError(f"img must be a uint8 array of shape (H, W, 3), got {_what(img)}")
    if img.strides[2] != 1 or img.strides[1] != 3:
        img = np.ascontiguousarray(img)
    return img


def _out_array(out, shape, name):
    """``out`` checked as a writable C-contiguous ``name`` array of ``shape``, or a new one."""
    if out is None:
        return np.empty(shape, dtype=_DTYPES[name])
    if not isinstance(out, np.ndarray) or out.shape != shape \
            or out.dtype != np.dtype(_DTYPES[name]):
        raise ConfigError(f"out must be a {name} array of shape {shape}, got {_what(out)}")
    if not out.flags.c_contiguous:
        raise ConfigError(f"out must be C-contiguous ({name}, shape {shape})")
    if not out.flags.writeable:
        raise ConfigError(f"out must be writable ({name}, shape {shape})")
    return out


def _xy_pair(value, name, check):
    """An int/number or a sequence of two (x first, as torchvision), each passed to check."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ConfigError(f"{name} must be one value or a pair (x, y), got {value!r}")
        return check(value[0]), check(value[1])
    v = check(value)
    return v, v


def gaussian_blur(img, kernel_size, sigma=None, out=None):
    """Blur an RGB image with a Gaussian kernel, as torchvision v2's ``gaussian_blur`` does.

    The separable kernel has ``ksize`` weights ``exp(-t**2 / (2 sigma**2))`` per axis,
    ``t = -(ksize // 2) .. ksize // 2``, normalized to sum 1 (torchvision's
    ``_get_gaussian_kernel1d``). The image is reflect-padded (torch's ``"reflect"``), summed
    vertically then horizontally in float32 and rounded half to even. The outer taps whose
    weights sum to at most 2**-24 per end are left out, which moves a value by under 1e-4 of
    a level. The result is within one level of torchvision's, which sums in another order.

    Parameters
    ----------
    img, out : ndarray, uint8, shape (H, W, 3)
        ``out`` may be ``img`` itself (the input is then copied first).
    kernel_size : int or (int, int)
        Taps along x (width) and y (height), torchvision's order; one int for both. Odd and
        positive; ``kernel_size // 2`` must be below the image's size along that axis (torch
        refuses reflect padding as wide as the image).
    sigma : float or (float, float), optional
        Standard deviation along x and y, in pixels, > 0; one number for both. None:
        ``0.15 * ksize + 0.35`` per axis (torchvision's default).
    """
    img = _rgb_image(img)
    kx, ky = _xy_pair(kernel_size, "kernel_size",
                      lambda v: _v.integer(v, "kernel_size", 1, (1 << 20) - 1))
    if kx % 2 == 0 or ky % 2 == 0:
        raise ConfigError(f"kernel_size must hold odd integers, got {kernel_size!r}")
    if sigma is None:
        sx, sy = kx * 0.15 + 0.35, ky * 0.15 + 0.35
    else:
        if isinstance(sigma, (list, tuple)) and len(sigma) == 1:
            sigma = sigma[0]
        sx, sy = _xy_pair(sigma, "sigma", lambda v: _v.number(v, "sigma", 0.0, low_open=True))
    H, W = img.shape[:2]
    out = _out_array(out, img.shape, "uint8")
    if H == 0 or W == 0:
        return out
    if kx // 2 >= W or ky // 2 >= H:
        raise ConfigError(f"kernel_size (x, y) = ({kx}, {ky}) is too large for the {H}x{W} image: "
                          f"reflect padding needs kernel_size // 2 below the width ({W}) and the "
                          f"height ({H})")
    if np.may_share_memory(img, out):
        img = img.copy()
    _ops.gaussian_blur_into(img, out, kx, ky, sx, sy)
    return out


def solarize(img, threshold, out=None):
    """Invert every value at or above ``threshold``, as torchvision v2's ``solarize`` on uint8:
    ``v`` becomes ``255 - v`` where ``v >= threshold`` (compared in float32, as torch does).
    ``threshold`` is a level of the 0..255 scale, at most 255 (as torchvision; 128 in SimCLR,
    BYOL and DINO). ``out`` (uint8, shape (H, W, 3)) may be ``img`` itself: in place."""
    img = _rgb_image(img)
    thr = _v.number(threshold, "threshold", high=255.0)
    out = _out_array(out, img.shape, "uint8")
    if out is not img:
        np.copyto(out, img)
    _augment.solarize(out.reshape(-1), thr)
    return out
