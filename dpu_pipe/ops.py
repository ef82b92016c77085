"""Per-image transforms after decode: crop + resize + flip + normalize + layout in one kernel.

The kernel (``dpu_pipe._ops``, C-level API in ``src/dpu_pipe/_ops.pxd``) resamples a source box
of a uint8 RGB image with Pillow's antialiased bilinear filter — the one ``Image.resize(size,
Image.BILINEAR, box=...)`` uses: a triangle whose support widens with the downscale factor —
but in float32 arithmetic instead of Pillow's 8-bit fixed point, so results are closer to the
exact filter than Pillow's own (within one level of 255 of Pillow, see tests/test_ops.py).
Results are bit-identical across runs, threads and x86-64/aarch64.

Training (RandomResizedCrop) and validation (resize shorter side, centre crop) use the same
kernel: validation is just another source box, from :func:`center_crop_box`.
"""

import numbers
import threading

import numpy as np

from . import _ops
from . import _validate as _v
from .constants import IMAGENET_MEAN, IMAGENET_STD, LAYOUTS
from .errors import ConfigError

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "resize_crop", "center_crop_box", "output_shape"]

_DTYPES = {"float32": np.float32, "uint8": np.uint8, "float16": np.float16}

_local = threading.local()


def _workspace():
    ws = getattr(_local, "ws", None)
    if ws is None:
        ws = _local.ws = _ops.Workspace()
    return ws


def _size_pair(size, name="size"):
    if isinstance(size, numbers.Integral) and not isinstance(size, bool):
        size = (size, size)
    try:
        oh, ow = size
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be an int or a pair (height, width), got {size!r}") from None
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and 0 < v < 1 << 20
               for v in (oh, ow)):
        raise ConfigError(f"{name} must hold positive ints below 2**20, got {size!r}")
    return int(oh), int(ow)


def _dtype_name(dtype):
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in _DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return name


def _triple(values, name):
    return _v.triple(values, name)


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
        Decoded RGB image (or region). Rows may be strided (a slice of a larger image) and
        are read in place; other layouts (e.g. a column slice with a pixel step) are copied
        to a compact array first.
    box : (y0, x0, h, w)
        Source box in pixels of ``img``; fractional values allowed (a crop box scaled into an
        image decoded at DCT scale s/8). Must lie inside the image: ``0 <= y0``,
        ``y0 + h <= H``, ``h > 0``, and the same for x; an overshoot of up to 1e-6 pixel
        (rounding of a scaled box) is clamped.
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
        Writable C-contiguous array of the output shape and dtype to fill (e.g. one sample of
        a batch); allocated when None.
    interpolation : "bilinear" or "bicubic"
        Pillow's antialiased filter (torchvision's ``antialias=True``): the triangle, or the
        Keys cubic with a = -0.5, support scaled by the downscale factor. Bicubic overshoots:
        uint8 output is clamped to 0..255, float outputs are not.

    Returns
    -------
    ndarray
        ``out`` (or the new array): shape ``output_shape(size, layout)``, dtype ``dtype``.
    """
    if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
        got = (f"{type(img).__name__}" if not isinstance(img, np.ndarray)
               else f"{img.dtype} array of shape {img.shape}")
        raise ConfigError(f"img must be a uint8 array of shape (H, W, 3), got {got}")
    if img.shape[0] < 1 or img.shape[1] < 1:
        raise ConfigError(f"img is empty: shape {img.shape}")
    if img.strides[2] != 1 or img.strides[1] != 3:
        img = np.ascontiguousarray(img)
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
    mean = _triple(mean, "mean")
    std = _triple(std, "std")
    if not all(s > 0 for s in std):
        raise ConfigError(f"std must be positive, got {std!r}")
    if out is None:
        out = np.empty(shape, dtype=_DTYPES[name])
    else:
        if (not isinstance(out, np.ndarray) or out.shape != shape
                or out.dtype != np.dtype(_DTYPES[name])):
            got = (type(out).__name__ if not isinstance(out, np.ndarray)
                   else f"{out.dtype} array of shape {out.shape}")
            raise ConfigError(f"out must be a {name} array of shape {shape}, got {got}")
        if not out.flags.c_contiguous:
            raise ConfigError(f"out must be C-contiguous ({name}, shape {shape})")
        if not out.flags.writeable:
            raise ConfigError(f"out must be writable ({name}, shape {shape})")
    ws = _workspace()
    if ws.busy:  # shared by a re-entrant caller on this thread: use a private one
        ws = _ops.Workspace()
    ws.busy = True
    try:
        _ops.resize_crop_into(img, y0, x0, h, w, out.reshape(-1).view(np.uint8), oh, ow,
                              _v.boolean(flip, "flip"), _ops.DTYPE_CODES[name], _ops.LAYOUT_CODES[layout],
                              mean, std, ws,
                              _ops.FILTER_CODES[_v.choice(interpolation, "interpolation",
                                                          tuple(_ops.FILTER_CODES))])
    finally:
        ws.busy = False
    return out


def center_crop_box(height, width, size=224, resize=256):
    """Source box of the validation transform, for :func:`resize_crop` with ``size``.

    torchvision's ``Resize(resize)`` (shorter side to ``resize``, longer side
    ``int(resize * long / short)``) followed by ``CenterCrop(size)`` (offsets rounded half to
    even), expressed in pixels of the ``height`` x ``width`` source image. Where the crop is
    larger than the resized image, torchvision pads with zeros; here the image is scaled just
    enough to cover the crop instead.

    Returns
    -------
    (y0, x0, h, w) : tuple of float
        Box in source pixels.
    """
    for v, name in ((height, "height"), (width, "width"), (resize, "resize")):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or not 0 < v < 1 << 30:
            raise ConfigError(f"{name} must be a positive int, got {v!r}")
    sh, sw = _size_pair(size)
    if resize < min(sh, sw):
        raise ConfigError(f"resize ({resize}) must be at least the crop's shorter side "
                          f"({min(sh, sw)})")
    return _ops.center_crop_box(int(height), int(width), sh, sw, int(resize))
