"""JPEG decoding: headers, region decode with early stop, DCT-scaled decode, batches.

All functions read JPEG bytes from memory (``bytes``, ``bytearray``, ``memoryview`` or a uint8
numpy array) and return RGB ``uint8`` arrays of shape ``(height, width, 3)``. Grayscale, RGB,
YCbCr, CMYK and YCCK (Adobe-inverted too), baseline, progressive and arithmetic-coded streams
(when the linked libjpeg-turbo decodes them), every chroma subsampling and restart intervals are
decoded. Undecodable data raises :class:`dpu_pipe.DecodeError` carrying libjpeg's message; the
process never aborts.

Accuracy modes
--------------
``fast=False`` (default): libjpeg's accurate integer IDCT and fancy (triangle-filter) chroma
upsampling — Pillow's and OpenCV's defaults; on the same libjpeg-turbo the output is identical.
``fast=True``: the fast integer IDCT (JDCT_IFAST) and plain chroma replication. It saves decode
time at a small error; see the README for its measured speed and error on photographs.

Corrupt data
------------
Decoding into missing data of a truncated stream is always an error (libjpeg would pad it
with grey); a region that ends before the cut decodes correctly. Other corrupt-data warnings
(e.g. extraneous bytes before a marker, a bad Huffman code) are tolerated unless
``strict=True``, as Pillow does. A corrupted entropy-coded segment that libjpeg cannot detect
decodes to wrong pixels: JPEG carries no checksum.

Restart intervals
-----------------
A region of a baseline Huffman JPEG with restart markers (a DRI segment; the output of
:func:`transcode`) is decoded from the restart intervals that cover it (plus two pixels all
round), copied with renumbered markers and a SOF of the sub-image's size into a per-decoder
scratch stream (at most the file's size, plus 16 bytes per covered interval). The pixels are
those of the plain region decode, bit for bit; the intervals above and beside the region are
not Huffman-decoded. Missing, misnumbered, misplaced or cut-short markers fall back to the plain
region decode. Only on damaged files do two outcomes differ from it: in ``strict`` mode a
corrupt-data warning in an interval outside the region goes unnoticed, and a stream cut short
after the intervals a region needs decodes that region, where the plain decode (one iMCU row
further for chroma context) reports the truncation.

Budgets
-------
``max_pixels`` (default 100 million) rejects decompression bombs from the header alone;
``max_scans`` (default 1000) bounds the work a crafted progressive stream can cause.
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
    """What a JPEG's markers say, read without decoding pixels.

    ``width``/``height`` in pixels, ``components`` the number of colour channels stored,
    ``colorspace`` one of ``"GRAY" "RGB" "YCbCr" "CMYK" "YCCK" "UNKNOWN"``, ``progressive``
    True for a progressive (multi-scan) stream.
    """

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
    """Read a JPEG's header without decoding pixels.

    Returns a :class:`JpegHeader`. Raises :class:`DecodeError` when the data is not a JPEG,
    is truncated before the first scan, or exceeds ``max_pixels`` (width × height).
    """
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
        Full-resolution pixel box to decode. Only the iMCU columns covering it are decoded
        (``jpeg_crop_scanline``), rows above it are skipped (``jpeg_skip_scanlines``) and
        decoding stops right after its last row. At scale 1 the result equals the full decode
        sliced, exactly.
    min_size : (h, w), optional
        Decode at the smallest power-of-two DCT scale (1/8, 1/4, 1/2, 1) that keeps the region
        at least ``h × w``. At scale s the result covers rows ``floor(top·s)`` to
        ``ceil((top+height)·s)`` of the scaled image (and likewise columns) — the pixels that
        cover the region — and equals the full decode at that scale, sliced.
    fast : bool
        Fast IDCT and plain chroma upsampling (see the module docstring).
    strict : bool
        Treat libjpeg's corrupt-data warnings as errors.
    max_pixels, max_scans : int
        Budgets checked before any pixel is decoded.

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
    view, reg = _as_view(data), _region(region)
    out, _ = _jpeg.decode(view, reg, min_h, min_w, _v.boolean(fast, "fast"),
                          _v.boolean(strict, "strict"), max_pixels, max_scans)
    return out


def decode_batch(buffers, out=None, *, regions=None, min_size=None, fast=False, strict=False,
                 max_pixels=DEFAULT_MAX_PIXELS, max_scans=DEFAULT_MAX_SCANS, on_error="raise"):
    """Decode N JPEGs into one preallocated array, with the GIL released for the whole batch.

    Parameters
    ----------
    buffers : sequence of bytes-like, or ``dpu_pipe._jpeg.BufferList``
        The N encoded images (a BufferList made once from packed storage avoids any per-image
        Python object).
    out : uint8 array (N, H, W, 3), C-contiguous, optional
        Image i is written to ``out[i, :h_i, :w_i]``; the rest of its slot is left as it was.
        Allocated when omitted, sized by the largest image (its headers are read first).
    regions : int array (N, 4), optional
        Per-image (top, left, height, width) in full-resolution pixels.
    min_size, fast, strict, max_pixels, max_scans
        As in :func:`decode`.
    on_error : "raise" or "return"
        ``"raise"``: raise :class:`DecodeError` for the first failed image (its ``index`` is the
        position in the batch). ``"return"``: give back the errors instead.

    Returns
    -------
    (out, shapes) where shapes is int32 (N, 3): decoded height, width and DCT scale (eighths)
    of each image — or (out, shapes, errors) with ``on_error="return"``, errors being a dict
    {index: DecodeError}; failed images have shape (0, 0, 0).
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
        try:
            w, h = read_header(b, max_pixels=max_pixels)[:2]
        except DecodeError:
            continue  # reported by the decode itself, with its index
        if regs is not None:
            top, left, rh, rw = (int(v) for v in regs[i])
            if top + rh > h or left + rw > w:
                continue  # reported by the decode itself, with its index
            h, w = rh, rw
        s = choose_scale(h, w, (min_h, min_w))
        hmax = max(hmax, -(-h * s // 8) + 1)
        wmax = max(wmax, -(-w * s // 8) + 1)
    return np.empty((len(bufs), hmax, wmax, 3), dtype=np.uint8)


def transcode(data, *, restart_interval=1, optimize=True, copy_markers=True,
              max_pixels=DEFAULT_MAX_PIXELS, max_scans=DEFAULT_MAX_SCANS):
    """Rewrite a JPEG losslessly as one baseline Huffman scan with restart markers.

    The DCT coefficients are copied unchanged (``jpeg_read_coefficients`` →
    ``jpeg_write_coefficients``, as ``jpegtran`` does), so the result decodes to exactly the
    pixels of ``data`` — whole, by region, at every DCT scale, in fast mode — while a region
    decode of it Huffman-decodes only the restart intervals covering the region (see the
    module docstring). Progressive and arithmetic-coded inputs become baseline Huffman.

    Parameters
    ----------
    data : bytes-like
        One complete JPEG stream.
    restart_interval : int or "row"
        A restart marker every this many MCUs (1 to 65535), or ``"row"``: one per MCU row.
        An interval that divides the number of MCUs in a row lets a region skip columns too.
        An MCU is 8×8 pixels for greyscale, 16×16 for 4:2:0, 16×8 for 4:2:2, 8×8 for 4:4:4.
    optimize : bool
        Huffman tables optimized for this image (two passes over the coefficients already in
        memory; smaller files, same pixels) instead of the standard tables.
    copy_markers : bool
        Copy APPn (EXIF, ICC profile, XMP) and COM segments. The JFIF APP0 or Adobe APP14
        segment that fixes the colour space is always written (by libjpeg, for the stream's
        colour space: YCbCr, greyscale, RGB, CMYK or YCCK as the original is read).
    max_pixels, max_scans : int
        Budgets checked as in :func:`decode` (the input is untrusted).

    Returns
    -------
    bytes: the new JPEG. Memory while it runs: the coefficients (2 bytes per sample of every
    component: 2 × width × height × (1 + 2/chroma-subsampling) bytes) and the output.

    Raises
    ------
    TranscodeUnsupported (a DecodeError)
        Keep ``data`` as it is: libjpeg reads it only with a corrupt-data warning (truncated,
        extraneous bytes, an inconsistent progressive sequence, a bad Huffman code — rewriting
        would fix in place what the decoder does with the damage, and strict mode would no
        longer see it), or this build cannot read its coefficients (arithmetic coding without
        arithmetic decoding).
    DecodeError
        libjpeg cannot read the data at all: not a JPEG, 12-bit or lossless (this libjpeg-turbo
        reads 8-bit DCT JPEGs only), or over a budget — :func:`decode` fails on it as well.
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
