# Batch ops after the batch kernel: MixUp and CutMix of every row with the row before it (the
# batch rolled by one, as torchvision.transforms.v2 pairs them) and the soft labels that go
# with them, in place: the last row is saved first, then rows are mixed from the last to the
# first so that each reads its partner before the partner is overwritten.
#
# Arithmetic is torchvision's: out = a * lam + b * (1 - lam), lam and 1 - lam rounded to
# float32 first, no FMA, so float32 batches equal v2.MixUp's bit for bit; float16 and bfloat16
# rows are mixed in float32 and rounded once to nearest even, uint8 rows rounded half up.

from libc.math cimport NAN, sqrt
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

import numpy as np

from dpu_pipe._ops cimport _to_bf16, _to_f16
from dpu_pipe._rng cimport portable_exp, portable_log, rng_uniform2
from dpu_pipe.errors import ConfigError
from dpu_pipe.rng import _as_uint, _check_stream_block

cdef enum:
    MIX_F32 = 0
    MIX_U8 = 1
    MIX_F16 = 2
    MIX_BF16 = 3


cdef inline float _from_f16(uint16_t h) noexcept nogil:
    """float32 value of IEEE binary16 bits h (exact: every half is a float)."""
    cdef uint32_t sign = (<uint32_t>h & 0x8000u) << 16
    cdef uint32_t e = (<uint32_t>h >> 10) & 0x1Fu
    cdef uint32_t m = <uint32_t>h & 0x3FFu
    cdef uint32_t f
    cdef float out
    if e == 0x1Fu:                      # inf, nan
        f = sign | 0x7F800000u | (m << 13)
    elif e != 0:                        # normal
        f = sign | ((e + 112u) << 23) | (m << 13)
    else:                               # zero or subnormal: m * 2**-24, exact in float32
        out = <float>m * <float>5.960464477539063e-08
        memcpy(&f, &out, 4)
        f = f | sign
    memcpy(&out, &f, 4)
    return out


cdef inline float _from_bf16(uint16_t h) noexcept nogil:
    cdef uint32_t f = <uint32_t>h << 16
    cdef float out
    memcpy(&out, &f, 4)
    return out


cdef void _mix_pair(int kind, void* dst, const void* src, Py_ssize_t count, float lam,
                    float oml) noexcept nogil:
    """dst[k] = dst[k] * lam + src[k] * oml for count elements of dtype kind."""
    cdef Py_ssize_t k
    cdef float v
    cdef float* df
    cdef const float* sf
    cdef uint8_t* du
    cdef const uint8_t* su
    cdef uint16_t* dh
    cdef const uint16_t* sh
    if kind == MIX_F32:
        df = <float*>dst
        sf = <const float*>src
        for k in range(count):
            df[k] = sf[k] * oml + df[k] * lam
    elif kind == MIX_U8:
        du = <uint8_t*>dst
        su = <const uint8_t*>src
        # lam and oml are float32 roundings of a weight and its complement, so the blend of
        # two values <= 255 stays below 255.5 and + 0.5 truncates to 0..255: no clamp, and
        # the loop vectorizes.
        for k in range(count):
            v = <float>su[k] * oml + <float>du[k] * lam + <float>0.5
            du[k] = <uint8_t>v
    elif kind == MIX_F16:
        dh = <uint16_t*>dst
        sh = <const uint16_t*>src
        for k in range(count):
            dh[k] = _to_f16(_from_f16(sh[k]) * oml + _from_f16(dh[k]) * lam)
    else:
        dh = <uint16_t*>dst
        sh = <const uint16_t*>src
        for k in range(count):
            dh[k] = _to_bf16(_from_bf16(sh[k]) * oml + _from_bf16(dh[k]) * lam)


cdef void mixup_rows(int kind, char* x, Py_ssize_t n, Py_ssize_t row_elems, Py_ssize_t item,
                     float lam, float oml, char* scratch) noexcept nogil:
    """MixUp of n rows of row_elems elements (item bytes each) at x, in place: row j with row
    j - 1 (row 0 with row n - 1). scratch holds one row."""
    cdef Py_ssize_t j, row_bytes = row_elems * item
    if n < 1:
        return
    memcpy(scratch, x + (n - 1) * row_bytes, row_bytes)
    for j in range(n - 1, 0, -1):
        _mix_pair(kind, x + j * row_bytes, x + (j - 1) * row_bytes, row_elems, lam, oml)
    _mix_pair(kind, x, scratch, row_elems, lam, oml)


cdef void _paste_box(char* dst, const char* src, bint chw, Py_ssize_t h, Py_ssize_t w,
                     Py_ssize_t item, Py_ssize_t y1, Py_ssize_t x1, Py_ssize_t y2,
                     Py_ssize_t x2) noexcept nogil:
    """Copy the box [y1, y2) x [x1, x2) of every channel of one sample from src to dst: rows
    of w items in three planes (CHW), or rows of w pixels of 3 items (HWC)."""
    cdef Py_ssize_t c, y, off, k = 1 if chw else 3
    for c in range(3 if chw else 1):
        for y in range(y1, y2):
            off = ((c * h + y) * w + x1) * k * item
            memcpy(dst + off, src + off, (x2 - x1) * k * item)


cdef void cutmix_rows(char* x, Py_ssize_t n, bint chw, Py_ssize_t h, Py_ssize_t w,
                      Py_ssize_t item, Py_ssize_t y1, Py_ssize_t x1, Py_ssize_t y2,
                      Py_ssize_t x2, char* scratch) noexcept nogil:
    """CutMix of n samples (3 x h x w, CHW or HWC) at x, in place: the box of row j - 1 pasted
    into row j (row n - 1's into row 0). scratch holds one sample."""
    cdef Py_ssize_t j, row_bytes = 3 * h * w * item
    if n < 1 or y2 <= y1 or x2 <= x1:
        return
    _paste_box(scratch, x + (n - 1) * row_bytes, chw, h, w, item, y1, x1, y2, x2)
    for j in range(n - 1, 0, -1):
        _paste_box(x + j * row_bytes, x + (j - 1) * row_bytes, chw, h, w, item, y1, x1, y2, x2)
    _paste_box(x, scratch, chw, h, w, item, y1, x1, y2, x2)


cdef int64_t mix_labels(const int64_t* labels, Py_ssize_t n, Py_ssize_t k, float on,
                        float off, float lam, float oml, float* out) noexcept nogil:
    """out (n, k) = on/off one-hot of each row's label * lam + its partner's (row j - 1) *
    oml, each product rounded to float32 then summed (torchvision's and timm's order).
    Returns -1, or the first row whose label lies outside [0, k)."""
    cdef Py_ssize_t j, c, p
    cdef float both_off = off * lam + off * oml
    cdef int64_t y, yp
    for j in range(n):
        if labels[j] < 0 or labels[j] >= k:
            return j
    for j in range(n):
        p = j - 1 if j else n - 1
        y = labels[j]
        yp = labels[p]
        for c in range(k):
            out[j * k + c] = both_off
        out[j * k + y] = on * lam + off * oml
        out[j * k + yp] = off * lam + on * oml
        if y == yp:
            out[j * k + y] = on * lam + on * oml
    return -1


# --- the Beta draw: twin of dpu_pipe.rng.beta_variate, operation for operation ------------

ctypedef struct Draws:
    uint64_t seed
    uint32_t epoch
    uint64_t index
    uint32_t stream
    uint32_t block             # next block to read
    int pending                # u1 of the last block not yet used
    double u1


cdef inline double _draw(Draws* d) noexcept nogil:
    """The next uniform: u0 then u1 of each block in turn; NaN past the last block."""
    cdef double u0
    if d.pending:
        d.pending = 0
        return d.u1
    if d.block > 0xFFFF:
        return NAN
    rng_uniform2(d.seed, d.epoch, d.index, d.stream, d.block, &u0, &d.u1)
    d.block += 1
    d.pending = 1
    return u0


cdef double _log_gamma(Draws* d, double shape) noexcept nogil:
    """log of a Gamma(shape, 1) variate (Marsaglia-Tsang, polar normals); NaN when the blocks
    run out."""
    cdef double boost = 0.0, dd, c, u, v, s, x, t, w
    if shape < 1.0:
        boost = portable_log(1.0 - _draw(d)) / shape
        shape = shape + 1.0
    dd = shape - 1.0 / 3.0
    c = 1.0 / sqrt(9.0 * dd)
    while True:
        while True:
            u = 2.0 * _draw(d) - 1.0
            v = 2.0 * _draw(d) - 1.0
            if u != u or v != v:
                return NAN
            s = u * u + v * v
            if 0.0 < s < 1.0:
                x = u * sqrt(-2.0 * portable_log(s) / s)
                break
        t = 1.0 + c * x
        if t <= 0.0:
            continue
        t = t * t * t
        w = _draw(d)
        if w != w:
            return NAN
        if portable_log(1.0 - w) < 0.5 * x * x + dd - dd * t + dd * portable_log(t):
            return portable_log(dd * t) + boost


cdef double beta_draw(uint64_t seed, uint32_t epoch, uint64_t index, uint32_t stream,
                      double a, double b, uint32_t first_block) noexcept nogil:
    """Beta(a, b) from the uniforms of blocks first_block, ... of stream; NaN when 2**16
    blocks do not suffice (never in practice: about 3 are used on average)."""
    cdef Draws d = Draws(seed, epoch, index, stream, first_block, 0, 0.0)
    cdef double lg_a, lg_b
    lg_a = _log_gamma(&d, a)
    lg_b = _log_gamma(&d, b)
    return 1.0 / (1.0 + portable_exp(lg_b - lg_a))


def beta_variate(seed, epoch, index, stream, double alpha, double beta, first_block=0):
    """The kernel twin of :func:`dpu_pipe.rng.beta_variate` (same arguments, same bits)."""
    _check_stream_block(stream, first_block)
    if not (alpha > 0 and beta > 0):
        raise ConfigError(f"Beta shapes must be positive, got {alpha}, {beta}")
    cdef double out = beta_draw(int(_as_uint(seed, "seed", 64)),
                                int(_as_uint(epoch, "epoch", 32)),
                                int(_as_uint(index, "index", 64)), stream, alpha, beta,
                                first_block)
    if out != out:
        raise ConfigError("the Beta draw ran out of random blocks")
    return out


def uniforms(seed, epoch, index, stream, block):
    """(u0, u1) of one block, as :func:`dpu_pipe.rng.uniforms` for scalars (Python floats)."""
    _check_stream_block(stream, block)
    cdef double u0, u1
    rng_uniform2(int(_as_uint(seed, "seed", 64)), int(_as_uint(epoch, "epoch", 32)),
                 int(_as_uint(index, "index", 64)), stream, block, &u0, &u1)
    return u0, u1


_KINDS = {np.dtype(np.float32): MIX_F32, np.dtype(np.uint8): MIX_U8}


def _kind(images, dtype):
    if not (isinstance(images, np.ndarray) and images.ndim == 4 and images.flags.c_contiguous
            and images.flags.writeable):
        raise ConfigError("images must be a writable C-contiguous (N, C, H, W) or (N, H, W, C) "
                          "array")
    if dtype == "float16" and images.dtype == np.float16:
        return MIX_F16
    if dtype == "bfloat16" and images.dtype == np.uint16:
        return MIX_BF16
    if images.dtype in _KINDS and dtype == images.dtype.name:
        return _KINDS[images.dtype]
    raise ConfigError(f"images of dtype {images.dtype} do not hold {dtype} values")


def mixup(images, double lam, dtype=None):
    """MixUp in place: ``images[j] = images[j] * lam + images[j - 1] * (1 - lam)`` (row 0 with
    the last row), as ``torchvision.transforms.v2.MixUp`` with weight ``lam`` in [0, 1].

    ``images``: (N, C, H, W) or (N, H, W, C), C-contiguous, float32, float16, uint8, or
    bfloat16 bits (uint16, with ``dtype="bfloat16"``); ``dtype`` defaults to the array's."""
    dtype = images.dtype.name if dtype is None else dtype
    cdef int kind = _kind(images, dtype)
    cdef Py_ssize_t n = images.shape[0], row = images[0].size if images.shape[0] else 0
    cdef Py_ssize_t item = images.itemsize
    cdef float lam32 = <float>lam, oml32 = <float>(1.0 - lam)
    scratch = np.empty(row * item, np.uint8)
    if n == 0:
        return images
    cdef uint8_t[::1] sv = scratch
    cdef uint8_t[::1] flat = images.reshape(-1).view(np.uint8)
    cdef char* x = <char*>&flat[0]
    with nogil:
        mixup_rows(kind, x, n, row, item, lam32, oml32, <char*>&sv[0])
    return images


def cutmix(images, box, layout="CHW"):
    """CutMix in place: the box ``(x1, y1, x2, y2)`` (torchvision's order, pixels, end
    exclusive) of ``images[j - 1]`` pasted into ``images[j]`` (the last row's into row 0), as
    ``torchvision.transforms.v2.CutMix``. ``images``: (N, 3, H, W) for CHW, (N, H, W, 3) for
    HWC, C-contiguous, any dtype."""
    if not (isinstance(images, np.ndarray) and images.ndim == 4 and images.flags.c_contiguous
            and images.flags.writeable):
        raise ConfigError("images must be a writable C-contiguous 4-d array")
    cdef bint chw = layout == "CHW"
    cdef Py_ssize_t h = images.shape[2] if chw else images.shape[1]
    cdef Py_ssize_t w = images.shape[3] if chw else images.shape[2]
    if images.shape[1 if chw else 3] != 3:
        raise ConfigError(f"images of shape {images.shape} are not 3-channel {layout}")
    cdef Py_ssize_t x1 = box[0], y1 = box[1], x2 = box[2], y2 = box[3]
    if not (0 <= x1 <= x2 <= w and 0 <= y1 <= y2 <= h):
        raise ConfigError(f"box {tuple(box)} does not lie in a {h}x{w} image")
    cdef Py_ssize_t n = images.shape[0], item = images.itemsize
    if n == 0:
        return images
    scratch = np.empty(3 * h * w * item, np.uint8)
    cdef uint8_t[::1] sv = scratch
    cdef uint8_t[::1] flat = images.reshape(-1).view(np.uint8)
    cdef char* x = <char*>&flat[0]
    with nogil:
        cutmix_rows(x, n, chw, h, w, item, y1, x1, y2, x2, <char*>&sv[0])
    return images


def soft_labels(labels, int num_classes, double lam, double smoothing=0.0, out=None):
    """float32 (N, num_classes): each row's label one-hot, smoothed as timm's
    ``mixup_target`` (off = smoothing / num_classes, on = 1 - smoothing + off), times
    ``lam``, plus its partner's (row j - 1; row 0's is the last row) times ``1 - lam``.

    ``labels``: int64 (N,) class indices. Raises ConfigError naming the first row whose
    label is outside [0, num_classes)."""
    cdef const int64_t[::1] lab = np.ascontiguousarray(labels, dtype=np.int64)
    cdef Py_ssize_t n = lab.shape[0]
    if out is None:
        out = np.empty((n, num_classes), np.float32)
    elif not (isinstance(out, np.ndarray) and out.dtype == np.float32
              and out.shape == (n, num_classes) and out.flags.c_contiguous):
        raise ConfigError(f"out must be a C-contiguous float32 array of shape "
                          f"{(n, num_classes)}")
    cdef float[:, ::1] o = out
    cdef double off = smoothing / num_classes
    cdef float off32 = <float>off, on32 = <float>(1.0 - smoothing + off)
    cdef float lam32 = <float>lam, oml32 = <float>(1.0 - lam)
    cdef int64_t bad = -1
    if n:
        with nogil:
            bad = mix_labels(&lab[0], n, num_classes, on32, off32, lam32, oml32, &o[0, 0])
    if bad >= 0:
        raise ConfigError(f"row {bad} has label {lab[bad]}, outside 0..{num_classes - 1} "
                          f"(num_classes={num_classes})")
    return out
