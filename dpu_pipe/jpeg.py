"""JPEG decoding: headers, region decode with early stop, DCT-scaled decode, batches.

Every function reads JPEG bytes from memory (``bytes``, ``bytearray``, ``memoryview`` or a
uint8 numpy array) and returns RGB ``uint8`` arrays of shape ``(height, width, 3)``, whatever
the colour space (Adobe-inverted CMYK and YCCK too), subsampling, progression, arithmetic
coding (when the linked libjpeg-turbo decodes it) or restart intervals. Undecodable data
raises :class:`dpu_pipe.DecodeError` with libjpeg's message; the process never aborts.

A region of a baseline Huffman JPEG with restart markers (as :func:`transcode` writes) is
decoded from the restart intervals covering it, to the plain region decode's pixels, bit for
bit. That decode, the accuracy modes, corrupt data and the budgets: docs/guides/loading.md.
"""

from collections import namedtuple

import numpy as np

from . import _jpeg
from . import _validate as _v
from .errors import ConfigError, DecodeError, TranscodeUnsupported

__all__ = ["JpegHeader", "read_header", "decode", "decode_batch", "choose_scale", "transcode",
           "TranscodeUnsupported", "DEFAULT_MAX_PIXELS", "DEFAULT_MAX_SCANS"]

DEFAULT_MAX_PIXELS = 100_000_000
DEFAULT_MAX_SCANS = 1000

_COLORSPACES = {0: "UNKNOWN", 1: "GRAY", 2: "RGB", 3: "YCbCr", 4: "CMYK", 5: "YCCK"}


class JpegHeader(namedtuple("JpegHeader", "width height components colorspace progressive")):
    """What a JPEG's markers say: ``width``/``height`` in pixels, ``components`` (colour
    channels stored), ``colorspace`` (``"GRAY" "RGB" "YCbCr" "CMYK" "YCCK" "UNKNOWN"``) and
    ``progressive`` (a multi-scan stream)."""

    __slots__ = ()


def _as_view(data):
    if isinstance(data, (bytes, bytearray)):
        return data
    try:
        view = memoryview(data)
    except TypeError:
        raise ConfigError(f"JPEG data must be bytes-like, not {type(data).__name__}") from None
    if not view.c_contiguous:
        raise ConfigError("JPEG data must be a contiguous buffer")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


#: Largest C int: the decoder takes coordinates and scan counts as C ints.
_INT_MAX = 2**31 - 1


def _check_budget(max_pixels, max_scans):
    _v.integer(max_pixels, "max_pixels", 1, 2**63 - 1)
    _v.integer(max_scans, "max_scans", 1, _INT_MAX)


def read_header(data, *, max_pixels=DEFAULT_MAX_PIXELS):
    """A JPEG's :class:`JpegHeader`, read without decoding pixels. :class:`DecodeError` when
    the data is not a JPEG, is truncated before the first scan, or exceeds ``max_pixels``."""
    _check_budget(max_pixels, DEFAULT_MAX_SCANS)
    view = _as_view(data)
    w, h, comps, cs, progressive, _ = _jpeg.read_header(view, max_pixels, DEFAULT_MAX_SCANS)
    return JpegHeader(w, h, comps, _COLORSPACES.get(cs, "UNKNOWN"), progressive)


def choose_scale(height, width, min_size):
    """DCT scale, in eighths (1, 2, 4 or 8), that ``decode`` uses for a region of
    ``height × width`` full-resolution pixels: the smallest power of two keeping the decoded
    region at least ``min_size = (h, w)``. Scales 3/8…7/8 are never chosen: libjpeg-turbo has
    no SIMD IDCT for them and they decode slower than full scale."""
    return _jpeg.py_choose_scale(int(height), int(width), *_min_size(min_size))


def _min_size(min_size):
    if min_size is None:
        return 0, 0
    try:
        h, w = min_size
    except (TypeError, ValueError):
        raise ConfigError(f"min_size must be (height, width), got {min_size!r}") from None
    return (_v.integer(h, "min_size height", 0, _INT_MAX),
            _v.integer(w, "min_size width", 0, _INT_MAX))


def _region(region):
    if region is None:
        return None
    try:
        top, left, height, width = region
    except (TypeError, ValueError):
        raise ConfigError(f"region must be (top, left, height, width), got {region!r}") from None
    return (_v.integer(top, "region top", 0, _INT_MAX),
            _v.integer(left, "region left", 0, _INT_MAX),
            _v.integer(height, "region height", 1, _INT_MAX),
            _v.integer(width, "region width", 1, _INT_MAX))


def decode(data, *, region=None, min_size=None, fast=False, strict=False,
           max_pixels=DEFAULT_MAX_PIXELS, max_scans=DEFAULT_MAX_SCANS):
    """Decode a JPEG to RGB.

    Parameters
    ----------
    data : bytes-like
        One complete JPEG stream.
    region : (top, left, height, width), optional
        Full-resolution pixel box to decode: only the iMCU columns covering it are decoded,
        rows above it are skipped and decoding stops after its last row. At scale 1 the result
        equals the full decode sliced.
    min_size : (h, w), optional
        Decode at the smallest power-of-two DCT scale (1/8, 1/4, 1/2, 1) that keeps the region
        at least ``h × w``. The result is then rows ``floor(top·s)`` to ``ceil((top+height)·s)``
        (likewise columns) of the full decode at scale s.
    fast : bool
        The fast integer IDCT and plain chroma replication: faster, at a small error. False:
        libjpeg's accurate IDCT and fancy upsampling, as Pillow's (on the same libjpeg-turbo,
        identical).
    strict : bool
        Treat libjpeg's corrupt-data warnings as errors (decoding into the missing data of a
        truncated stream always is one).
    max_pixels, max_scans : int
        Budgets checked before any pixel is decoded: width × height, against decompression
        bombs, and the scans of a progressive stream.

    Returns
    -------
    numpy.ndarray, uint8, shape (H, W, 3), RGB.

    Raises
    ------
    DecodeError
        The data is not a decodable JPEG (libjpeg's message), is truncated, or exceeds a budget.
    ConfigError
        ``region`` is malformed or not inside the image.
    """
    _check_budget(max_pixels, max_scans)
    min_h, min_w = _min_size(min_size)
    return _jpeg.decode(_as_view(data), _region(region), min_h, min_w, _v.boolean(fast, "fast"),
                        _v.boolean(strict, "strict"), max_pixels, max_scans)[0]


def decode_batch(buffers, out=None, *, regions=None, min_size=None, fast=False, strict=False,
                 max_pixels=DEFAULT_MAX_PIXELS, max_scans=DEFAULT_MAX_SCANS, on_error="raise"):
    """Decode N JPEGs into one preallocated array, with the GIL released for the whole batch.

    Parameters
    ----------
    buffers : sequence of bytes-like, or ``dpu_pipe._jpeg.BufferList``
        The N encoded images (a BufferList avoids any per-image Python object).
    out : uint8 array (N, H, W, 3), C-contiguous, optional
        Image i is written to ``out[i, :h_i, :w_i]``, the rest of its slot left as it was.
        Allocated when omitted (not for a BufferList), sized by the largest image.
    regions : int array (N, 4), optional
        Per-image (top, left, height, width) in full-resolution pixels.
    min_size, fast, strict, max_pixels, max_scans
        As in :func:`decode`.
    on_error : "raise" or "return"
        Raise :class:`DecodeError` for the first failed image (``index``: its position in the
        batch), or return the errors.

    Returns
    -------
    (out, shapes), or (out, shapes, errors) with ``on_error="return"``
        ``shapes``: int32 (N, 3), each image's decoded height, width and DCT scale (eighths);
        (0, 0, 0) for a failed one. ``errors``: {index: DecodeError}.
    """
    _v.choice(on_error, "on_error", ("raise", "return"))
    _check_budget(max_pixels, max_scans)
    min_h, min_w = _min_size(min_size)
    bufs = buffers if isinstance(buffers, _jpeg.BufferList) else \
        _jpeg.BufferList.from_buffers(_as_view(b) for b in buffers)
    n = len(bufs)
    regs = None
    if regions is not None:
        regs = np.asarray(regions)
        if regs.shape != (n, 4) or (regs.size and regs.dtype.kind not in "iu"):
            raise ConfigError(f"regions must be integers of shape ({n}, 4), got "
                              f"{regs.dtype} {regs.shape}")
        if regs.size and (regs.min() < 0 or regs.max() > _INT_MAX):
            raise ConfigError(f"regions must lie in [0, 2**31), got values in "
                              f"[{regs.min()}, {regs.max()}]")
        regs = np.ascontiguousarray(regs, dtype=np.int64)
    if out is None:
        out = _allocate_batch(buffers, bufs, regs, min_h, min_w, max_pixels)
    elif not (isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.ndim == 4
              and out.shape[0] >= n and out.shape[3] == 3 and out.flags.c_contiguous
              and out.flags.writeable):
        raise ConfigError(f"out must be a writable C-contiguous uint8 array of shape "
                          f"({n}, H, W, 3)")
    shapes = np.zeros((n, 3), dtype=np.int32)
    status = np.zeros(n, dtype=np.int32)
    messages = _jpeg.decode_batch(bufs, out, regs, min_h, min_w, _v.boolean(fast, "fast"),
                                  _v.boolean(strict, "strict"), max_pixels, max_scans, shapes,
                                  status)
    errors = {i: DecodeError(msg, index=i) for i, msg in messages.items()}
    if on_error == "return":
        return out, shapes, errors
    if errors:
        raise errors[min(errors)]
    return out, shapes


def _allocate_batch(buffers, bufs, regs, min_h, min_w, max_pixels):
    if isinstance(buffers, _jpeg.BufferList):
        raise ConfigError("pass out= when decoding a BufferList")
    hmax = wmax = 1
    for i, b in enumerate(buffers):
        # Bad data and bad regions are skipped here: the decode reports them with their index.
        try:
            w, h = read_header(b, max_pixels=max_pixels)[:2]
        except DecodeError:
            continue
        if regs is not None:
            top, left, rh, rw = (int(v) for v in regs[i])
            if top + rh > h or left + rw > w:
                continue
            h, w = rh, rw
        s = choose_scale(h, w, (min_h, min_w))
        hmax = max(hmax, -(-h * s // 8) + 1)
        wmax = max(wmax, -(-w * s // 8) + 1)
    return np.empty((len(bufs), hmax, wmax, 3), dtype=np.uint8)


def transcode(data, *, restart_interval=1, optimize=True, copy_markers=True,
              max_pixels=DEFAULT_MAX_PIXELS, max_scans=DEFAULT_MAX_SCANS):
    """Rewrite a JPEG losslessly as one baseline Huffman scan with restart markers.

    The DCT coefficients are copied unchanged, as ``jpegtran`` does, so the result decodes to
    exactly the pixels of ``data`` (whole, by region, at every DCT scale, in fast mode), while
    a region decode of it Huffman-decodes only the restart intervals covering the region.

    Parameters
    ----------
    data : bytes-like
        One complete JPEG stream.
    restart_interval : int or "row"
        A restart marker every this many MCUs (1 to 65535), or ``"row"``: one per MCU row.
        An interval that divides the number of MCUs in a row lets a region skip columns too.
        An MCU is 8×8 pixels for greyscale, 16×16 for 4:2:0, 16×8 for 4:2:2, 8×8 for 4:4:4.
    optimize : bool
        Huffman tables optimized for this image (smaller files) instead of the standard ones.
    copy_markers : bool
        Copy APPn (EXIF, ICC profile, XMP) and COM segments. The JFIF APP0 or Adobe APP14
        segment that fixes the colour space is always written.
    max_pixels, max_scans : int
        As in :func:`decode`.

    Returns
    -------
    bytes
        The new JPEG. Memory while it runs: the output and 2 bytes per sample of every
        component for the coefficients.

    Raises
    ------
    TranscodeUnsupported (a DecodeError)
        Keep ``data`` as it is: libjpeg reads it only with a corrupt-data warning (rewriting
        would hide the damage from strict mode), or this build cannot read its coefficients
        (arithmetic coding without arithmetic decoding).
    DecodeError
        libjpeg cannot read the data at all (not a JPEG, 12-bit, lossless, over a budget).
    ConfigError
        An argument is invalid.
    """
    _check_budget(max_pixels, max_scans)
    if restart_interval == "row":
        interval, rows = 0, 1
    else:
        interval, rows = _v.integer(restart_interval, "restart_interval", 1, 65535), 0
    return _jpeg.transcode(_as_view(data), interval, rows, bool(optimize), bool(copy_markers),
                           max_pixels, max_scans)
