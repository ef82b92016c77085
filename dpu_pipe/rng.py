"""The one random-number scheme of dpu_pipe, in numpy (twin of ``src/dpu_pipe/_rng.pxd``).

Every random decision — the epoch permutation, each sample's crop and flip — is a pure function
of ``(seed, epoch, sample index or position, stream)``: no generator state lives in threads or
processes, so a batch is the same whichever thread, producer rank or machine makes it. The
Cython kernels compute the same bits; the tests hold the twins to exact equality.

Generator
    Philox-4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2,
    3", SC 2011), checked against Random123's known-answer vectors. One call maps a 128-bit
    counter and a 64-bit key to a *block* of four uint32 words.

Key and counter
    The key is ``(seed & 0xFFFFFFFF, seed >> 32)`` with ``0 <= seed < 2**64``; the counter
    is ``(index & 0xFFFFFFFF, index >> 32, epoch, stream << 16 | block)`` with ``index <
    2**64``, ``epoch < 2**32`` and ``stream``, ``block < 2**16``. ``index`` is the sample's
    index in its source (not its position in a batch or shard), so a sample's augmentation
    does not depend on rank, world size or batch size.

Streams (one per purpose, so purposes never share random numbers)
    - 0 ``STREAM_SHUFFLE``: block r (r = 0..7) is round r of the epoch permutation's Feistel
      network, whose right half stands in the sample-index words (:func:`permutation_at`).
    - 1 ``STREAM_CROP``: block a (a = 0..9) is attempt a of RandomResizedCrop (u0 -> scale,
      u1 -> log aspect ratio); block 10 places the accepted crop (u0 -> top, u1 -> left).
    - 2 ``STREAM_FLIP``: block 0, u0 < p flips the sample horizontally.
    - 256 ``STREAM_AUGMENT``: auto-augment (src/dpu_pipe/_augment.pyx, aug_sample).
      TrivialAugmentWide: block 0 (u0 -> op, u1 -> bin), 1 (u0 <= 0.5 negates). RandAugment
      op k: blocks 2k (u0 -> op, u1 <= 0.5 negates), 2k+1 (u0 -> level noise, mstd).
      AutoAugment: block 0 (u0 -> sub-policy), 1 + s (u0 <= p applies step s, u1 <= 0.5
      negates).
    - 257 ``STREAM_JITTER``: colour jitter: blocks 0-1 (u0, u1, u0: the order), block 1 u1
      brightness, block 2 (contrast, saturation), block 3 u0 hue. The jitter of a view
      (dpu_pipe/views.py) with ``jitter_p < 1`` also reads block 4 (u0 < jitter_p applies it).
    - 258 ``STREAM_GRAYSCALE``: block 0, u0 < p makes the sample grayscale.
    - 259 ``STREAM_ERASE``: block 0, u0 < p erases; attempt a: block 1 + a (u0 -> scale,
      u1 -> log ratio), block 11 + a (u0 -> top, u1 -> left).
    - 260 ``STREAM_MIX``: batch ops (dpu_pipe/mix.py), keyed by the batch, not a sample: the
      index words hold ``step | rank << 32``. Block 0: u0 < mix_p mixes the batch, u1 <
      mix_switch_p picks CutMix; block 1: the CutMix box centre (u0 -> x, u1 -> y); blocks
      2...: the uniforms of the Beta draw (:func:`beta_variate`), two per block, in order.
    - 261 ``STREAM_HOOK``: the seed of ``batch_hook``'s numpy Generator (not Philox blocks:
      SeedSequence(seed, epoch, rank, step, 261)).
    - 262 ``STREAM_STICK``: ``stick_to_shard``'s keys (dpu_pipe/sampler.py), the 64-bit word
      0 of block 0 at index 0 (the fixed permutation's key) and of block 1 at index ``rank |
      world_size << 32`` (the key of that rank's in-shard shuffle); epoch 0.
    - 263 ``STREAM_BLUR``: multi-view Gaussian blur (dpu_pipe/views.py): block 0, u0 < blur_p
      blurs, u1 -> sigma = lo + (hi - lo) u1.
    - 264 ``STREAM_SOLARIZE``: multi-view solarize: block 0, u0 < solarize_p solarizes.
    - 265... ``STREAM_USER``: the first id free for new purposes; add them to this list.
    - 512..527 ``STREAM_ERASE_NOISE`` (erase_value="random"): element k of the erased (3, h,
      w) box, in that order, is the standard normal quantile of ((word k % 4) + 1/2) / 2**32
      of block (k // 4) % 2**16 of stream 512 + k // 2**18.

Views
    View ``v`` of a multi-view recipe draws every per-sample stream above at id ``stream + (v
    << VIEW_SHIFT)`` (:func:`view_stream`; every id above is below ``1 << VIEW_SHIFT``, and
    ``v < MAX_VIEWS`` keeps the id below 2**16): no two views share random numbers, and view 0
    draws exactly what a one-view recipe draws.

From words to numbers
    A block's words ``(x0, x1, x2, x3)`` form two 64-bit words ``w0 = x1 << 32 | x0`` and
    ``w1 = x3 << 32 | x2``; the uniforms are ``u0 = (w0 >> 11) * 2**-53`` and
    ``u1 = (w1 >> 11) * 2**-53``, in [0, 1) on the grid of 2**-53 — exact conversions.
    An integer uniform in ``[0, n)`` is ``floor(u * n)`` (bias below ``n * 2**-53``).

Floating point that is the same everywhere
    Only IEEE-754 ``+ - * / sqrt``, ``rint``, ``floor``, ``frexp`` and ``ldexp``, which are
    exactly rounded on every machine. libm's ``exp``/``log`` are not (glibc picks FMA or
    non-FMA variants at run time), so the aspect ratio uses :func:`portable_exp` and
    :func:`portable_log`: fixed polynomials, evaluated in the same order in both twins, within
    a couple of ulp of ``math.exp``/``math.log``. The C build passes ``-ffp-contract=off`` so
    that GCC does not fuse ``p * r + c`` into an FMA on aarch64.

The epoch permutation
    :func:`permutation_at` maps position ``p`` of epoch ``e`` to a sample index in ``[0, n)``
    in O(1) time and memory per position, for ``n`` up to 2**62. With ``bits = max(8,
    ceil(log2 n))``, ``p`` splits into a left half ``L`` of ``floor(bits / 2)`` bits and a
    right half ``R`` of ``ceil(bits / 2)`` bits (``p = L << |R| | R``); each of
    ``PERM_ROUNDS = 8`` rounds maps ``(L, R)`` to ``(R, L ^ F_r(R))``, where ``F_r(R)`` is
    word ``w0`` of the block ``(seed, e, index=R, STREAM_SHUFFLE, block=r)`` cut to ``|L|``
    bits, and the halves swap widths. That is a bijection of ``[0, 2**bits)``; applying it
    again while the result is ``>= n`` (cycle-walking) restricts it to ``[0, n)``, in fewer
    than 2 passes on average for ``n > 256``. Integer operations only. The 8-bit minimum
    keeps tiny datasets' permutations uniform (eight rounds on halves of one or two bits are
    measurably biased).
"""

import functools
import operator

import numpy as np

from .errors import ConfigError

__all__ = [
    "STREAM_SHUFFLE", "STREAM_CROP", "STREAM_FLIP", "STREAM_AUGMENT", "STREAM_JITTER",
    "STREAM_GRAYSCALE", "STREAM_ERASE", "STREAM_MIX", "STREAM_HOOK", "STREAM_ERASE_NOISE",
    "STREAM_STICK", "STREAM_BLUR", "STREAM_SOLARIZE", "STREAM_USER", "VIEW_SHIFT", "MAX_VIEWS",
    "view_stream", "CROP_ATTEMPTS", "beta_variate", "PERM_ROUNDS", "PERM_MAX", "philox4x32_10",
    "random_words", "random_u64", "uniforms", "permutation_at", "portable_exp", "portable_log",
    "check_seed", "check_epoch", "check_crop_config", "random_resized_crop", "random_flip",
]

STREAM_SHUFFLE = 0
STREAM_CROP = 1
STREAM_FLIP = 2
STREAM_AUGMENT = 256
STREAM_JITTER = 257
STREAM_GRAYSCALE = 258
STREAM_ERASE = 259
STREAM_MIX = 260
STREAM_HOOK = 261
STREAM_STICK = 262
STREAM_BLUR = 263
STREAM_SOLARIZE = 264
STREAM_USER = 265
VIEW_SHIFT = 10
MAX_VIEWS = 64
STREAM_ERASE_NOISE = 512
CROP_ATTEMPTS = 10
PERM_ROUNDS = 8
PERM_MIN_BITS = 8
PERM_MAX = 1 << 62

_M32 = np.uint64(0xFFFFFFFF)
_PHILOX_M0 = np.uint64(0xD2511F53)
_PHILOX_M1 = np.uint64(0xCD9E8D57)
_PHILOX_W0 = np.uint64(0x9E3779B9)
_PHILOX_W1 = np.uint64(0xBB67AE85)
_S32 = np.uint64(32)
_S11 = np.uint64(11)
_TWO_M53 = 1.1102230246251565e-16  # 2**-53

# The same decimal literals as in _rng.pxd; repr round-trips, so both parse to the same double.
_LN2_HI = 0.6931471803691238        # 21 trailing zero bits: k * _LN2_HI is exact
_LN2_LO = 1.9082149292705877e-10
_INV_LN2 = 1.4426950408889634
_EXP_COEF = (  # 1/n! for n = 13 .. 0, Horner order
    1.6059043836821613e-10, 2.08767569878681e-09, 2.505210838544172e-08,
    2.755731922398589e-07, 2.7557319223985893e-06, 2.48015873015873e-05,
    0.0001984126984126984, 0.001388888888888889, 0.008333333333333333,
    0.041666666666666664, 0.16666666666666666, 0.5, 1.0, 1.0,
)
_LOG_COEF = (  # 2/(2n+1) for n = 10 .. 1, Horner order in z = s**2
    0.09523809523809523, 0.10526315789473684, 0.11764705882352941, 0.13333333333333333,
    0.15384615384615385, 0.18181818181818182, 0.2222222222222222, 0.2857142857142857,
    0.4, 0.6666666666666666,
)
_SQRT_HALF = 0.7071067811865476
_EXP_MAX = 709.782712893384     # log(DBL_MAX)
_EXP_MIN = -745.2               # below half the smallest subnormal


# --- argument checks -------------------------------------------------------------------------

def _as_uint(value, name, bits):
    """value as a uint64 array after checking 0 <= value < 2**bits (ConfigError otherwise)."""
    arr = np.asarray(value)
    # Bools are not integers here, as everywhere in dpu_pipe._validate: seed=True is a mistake.
    if arr.dtype.kind == "b":
        raise ConfigError(f"{name} must be an integer (or integer array), got {value!r}")
    if arr.dtype.kind not in "iu":
        try:
            ints = [operator.index(v) for v in arr.reshape(-1)]
        except TypeError:
            raise ConfigError(f"{name} must be an integer (or integer array), "
                              f"got {value!r}") from None
        if any(v < 0 or v >= (1 << bits) for v in ints):
            raise ConfigError(f"{name} must be in [0, 2**{bits}), got {value!r}")
        return np.array(ints, dtype=np.uint64).reshape(arr.shape)
    if arr.size and (arr.min() < 0 or (bits < 64 and int(arr.max()) >= (1 << bits))):
        raise ConfigError(f"{name} must be in [0, 2**{bits}), got values in "
                          f"[{int(arr.min())}, {int(arr.max())}]")
    return arr.astype(np.uint64)


def _sample_args(seed, epoch, index):
    """(seed, epoch, index) as checked uint64 arrays."""
    return (_as_uint(seed, "seed", 64), _as_uint(epoch, "epoch", 32),
            _as_uint(index, "index", 64))


def check_seed(seed):
    """``seed`` as an int after checking 0 <= seed < 2**64 (ConfigError otherwise)."""
    return int(_as_uint(seed, "seed", 64))


def check_epoch(epoch):
    """``epoch`` as an int after checking 0 <= epoch < 2**32 (ConfigError otherwise)."""
    return int(_as_uint(epoch, "epoch", 32))


def check_crop_config(scale, ratio):
    """(scale_lo, scale_hi, ratio_lo, ratio_hi) as floats after checking
    0 <= scale_lo <= scale_hi, 0 < scale_hi, 0 < ratio_lo <= ratio_hi, all finite."""
    try:
        s_lo, s_hi = (float(v) for v in scale)
        r_lo, r_hi = (float(v) for v in ratio)
    except (TypeError, ValueError):
        raise ConfigError(f"scale and ratio must be pairs of numbers (lo, hi), got "
                          f"scale={scale!r}, ratio={ratio!r}") from None
    if not np.all(np.isfinite([s_lo, s_hi, r_lo, r_hi])):
        raise ConfigError(f"scale and ratio must be finite, got scale={scale!r}, ratio={ratio!r}")
    if not (0.0 <= s_lo <= s_hi and s_hi > 0.0):
        raise ConfigError(f"scale must satisfy 0 <= lo <= hi and hi > 0 (fractions of the "
                          f"image area), got {scale!r}")
    if not (0.0 < r_lo <= r_hi):
        raise ConfigError(f"ratio must satisfy 0 < lo <= hi (width/height), got {ratio!r}")
    return s_lo, s_hi, r_lo, r_hi


# --- Philox-4x32-10 --------------------------------------------------------------------------

def philox4x32_10(counter, key):
    """Philox-4x32-10 of ``counter`` (uint32, shape (..., 4)) under ``key`` (uint32, shape
    (..., 2)); the leading shapes broadcast. Returns uint32, shape (..., 4)."""
    counter = np.asarray(counter, dtype=np.uint64)
    key = np.asarray(key, dtype=np.uint64)
    if counter.shape[-1:] != (4,) or key.shape[-1:] != (2,):
        raise ConfigError(f"counter needs shape (..., 4) and key (..., 2), got "
                          f"{counter.shape} and {key.shape}")
    return np.stack(_philox(*np.moveaxis(counter, -1, 0), *np.moveaxis(key, -1, 0)),
                    axis=-1).astype(np.uint32)


_CHUNK = 1 << 14


def _philox(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 of counter (c0..c3) under key (k0, k1), uint64 arrays holding 32-bit
    values (a product of two of them fits, so its high and low halves come out exactly),
    broadcast against each other. Returns four uint64 arrays of the broadcast shape."""
    args = np.broadcast_arrays(*(np.asarray(a, np.uint64) for a in (c0, c1, c2, c3, k0, k1)))
    shape = args[0].shape
    args = [a.reshape(-1) for a in args]
    out = np.empty((4, args[0].size), np.uint64)
    # A chunk at a time, so that the round's temporaries stay in cache on large inputs.
    for lo in range(0, out.shape[1], _CHUNK):
        c0, c1, c2, c3, k0, k1 = (a[lo:lo + _CHUNK] for a in args)
        for r in range(10):
            if r:
                k0 = (k0 + _PHILOX_W0) & _M32
                k1 = (k1 + _PHILOX_W1) & _M32
            p0 = c0 * _PHILOX_M0
            p1 = c2 * _PHILOX_M1
            # (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0))
            c0, c1, c2, c3 = ((p1 >> _S32) ^ c1 ^ k0, p1 & _M32,
                              (p0 >> _S32) ^ c3 ^ k1, p0 & _M32)
        out[:, lo:lo + _CHUNK] = c0, c1, c2, c3
    return tuple(out.reshape((4,) + shape))


def _block(seed, epoch, index, stream, block):
    """Words of one block per element, as four uint64 arrays of the broadcast shape (the
    scheme in the module docstring); inputs are already-checked uint64 arrays or scalars."""
    seed = np.asarray(seed, np.uint64)
    index = np.asarray(index, np.uint64)
    return _philox(index & _M32, index >> _S32, np.asarray(epoch, np.uint64),
                   np.uint64((int(stream) << 16) | int(block)), seed & _M32, seed >> _S32)


def _check_stream_block(stream, block):
    if not (0 <= int(stream) < 1 << 16 and 0 <= int(block) < 1 << 16):
        raise ConfigError(f"stream and block must be in [0, 65536), got {stream}, {block}")


def _words(seed, epoch, index, stream, block):
    """:func:`_block` after checking every argument."""
    _check_stream_block(stream, block)
    return _block(*_sample_args(seed, epoch, index), stream, block)


def random_words(seed, epoch, index, stream, block=0):
    """The block's four uint32 words, shape broadcast(seed, epoch, index) + (4,)."""
    return np.stack(_words(seed, epoch, index, stream, block), axis=-1).astype(np.uint32)


def random_u64(seed, epoch, index, stream, block=0):
    """The block's two 64-bit words (w0, w1), uint64, shape broadcast(...) + (2,)."""
    x0, x1, x2, x3 = _words(seed, epoch, index, stream, block)
    return np.stack(((x1 << _S32) | x0, (x3 << _S32) | x2), axis=-1)


def _unit(lo, hi):
    return (((hi << _S32) | lo) >> _S11).astype(np.float64) * _TWO_M53


def uniforms(seed, epoch, index, stream, block=0):
    """The block's two uniforms (u0, u1) in [0, 1), float64, shape broadcast(...) + (2,)."""
    x0, x1, x2, x3 = _words(seed, epoch, index, stream, block)
    return np.stack((_unit(x0, x1), _unit(x2, x3)), axis=-1)


# --- the epoch permutation ------------------------------------------------------------------

def permutation_at(positions, n, seed, epoch):
    """Sample index at each of ``positions`` (integers in ``[0, n)``) of epoch ``epoch``'s
    permutation of ``[0, n)``, 1 <= n <= 2**62: the Feistel construction of the module
    docstring (twin of ``_rng.pxd``'s ``perm_index``). Arguments broadcast; returns int64."""
    n = operator.index(n) if not isinstance(n, (bool, np.bool_)) else -1
    if not 1 <= n <= PERM_MAX:
        raise ConfigError(f"n must be in [1, 2**62], got {n}")
    pos = _as_uint(positions, "position", 63)
    if pos.size and int(pos.max()) >= n:
        raise ConfigError(f"positions must be in [0, {n}), got up to {int(pos.max())}")
    seed = _as_uint(seed, "seed", 64)
    epoch = _as_uint(epoch, "epoch", 32)
    shape = np.broadcast_shapes(pos.shape, seed.shape, epoch.shape)
    x, seed, epoch = (np.broadcast_to(a, shape).reshape(-1).copy() for a in (pos, seed, epoch))
    if n == 1:
        return np.zeros(shape, np.int64)
    bits = max(PERM_MIN_BITS, (n - 1).bit_length())
    # First pass for all, then only for those still outside [0, n): cycle-walking.
    todo = np.arange(x.size)
    while todo.size:
        y = _feistel(x[todo], seed[todo], epoch[todo], bits // 2, bits - bits // 2)
        x[todo] = y
        todo = todo[y >= np.uint64(n)]
    return x.view(np.int64).reshape(shape)


def _feistel(x, seed, epoch, bits_l, bits_r):
    """One pass of the Feistel network over [0, 2**(bits_l + bits_r)) (uint64 arrays)."""
    a, b = bits_l, bits_r
    left = x >> np.uint64(b)
    right = x & np.uint64((1 << b) - 1)
    for r in range(PERM_ROUNDS):
        f0, f1, _, _ = _block(seed, epoch, right, STREAM_SHUFFLE, r)
        f = (left ^ ((f1 << _S32) | f0)) & np.uint64((1 << a) - 1)
        left, right = right, f
        a, b = b, a
    return (left << np.uint64(b)) | right


# --- exp and log from + - * / only -----------------------------------------------------------

def portable_exp(x):
    """e**x (float64, elementwise) within ~1 ulp, the same bits as _rng.pxd's portable_exp."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(all="ignore"):
        k = np.rint(x * _INV_LN2)
        k = np.where(np.isfinite(k), k, 0.0)
        r = (x - k * _LN2_HI) - k * _LN2_LO
        p = np.full(x.shape, _EXP_COEF[0])
        for c in _EXP_COEF[1:]:
            p = p * r + c
        y = np.ldexp(p, k.astype(np.int32))
    y = np.where(x > _EXP_MAX, np.inf, np.where(x < _EXP_MIN, 0.0, y))
    return np.where(np.isnan(x), x, y)


def portable_log(x):
    """Natural log (float64, elementwise) within ~1 ulp, the same bits as _rng.pxd's
    portable_log: -inf for 0, nan for negative or nan, inf for inf."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(all="ignore"):
        m, e = np.frexp(x)
        low = m < _SQRT_HALF
        m = np.where(low, m * 2.0, m)
        e = (e - low).astype(np.float64)
        f = m - 1.0
        s = f / (2.0 + f)
        z = s * s
        q = np.full(x.shape, _LOG_COEF[0])
        for c in _LOG_COEF[1:]:
            q = q * z + c
        hfsq = 0.5 * f * f
        # log(1 + f) = f - f*f/2 + s * (f*f/2 + z q), grouped as in _rng.pxd (fdlibm's form)
        y = e * _LN2_HI - ((hfsq - (s * (hfsq + z * q) + e * _LN2_LO)) - f)
    y = np.where(x == np.inf, np.inf, y)
    y = np.where(x == 0.0, -np.inf, y)
    return np.where((x < 0.0) | np.isnan(x), np.nan, y)


# --- augmentation parameters -----------------------------------------------------------------

def view_stream(stream, view):
    """Stream id of ``stream`` for view ``view`` (0 <= view < MAX_VIEWS) of a multi-view
    recipe: ``stream + (view << VIEW_SHIFT)``."""
    if isinstance(view, bool) or not isinstance(view, (int, np.integer)) \
            or not 0 <= view < MAX_VIEWS:
        raise ConfigError(f"view must be an integer in [0, {MAX_VIEWS}), got {view!r}")
    if not 0 <= int(stream) < 1 << VIEW_SHIFT:
        raise ConfigError(f"stream {stream} has no per-view ids (ids below {1 << VIEW_SHIFT})")
    return int(stream) + (int(view) << VIEW_SHIFT)


def random_resized_crop(seed, epoch, index, height, width, scale=(0.08, 1.0),
                        ratio=(3.0 / 4.0, 4.0 / 3.0), *, return_attempt=False, view=0):
    """torchvision's ``RandomResizedCrop.get_params`` for sample ``index`` of ``epoch``: 10
    attempts, then a central crop with the aspect ratio clamped into ``ratio`` — but never an
    empty crop where torchvision would give one (ratio bounds far from 1 on a tiny image).

    ``height``, ``width``: the image size in pixels (1 .. 2**31 - 1); ``scale``: the crop's
    area as a fraction of the image's; ``ratio``: the crop's width/height; ``view``: the view
    of a multi-view recipe (:func:`view_stream`). Arguments broadcast. Returns ``(top, left,
    crop_height, crop_width)`` in pixels (int64 arrays, or ints if every input is a scalar),
    plus ``attempt`` (0..9, or -1 for the central-crop fallback) if ``return_attempt``.
    """
    s_lo, s_hi, r_lo, r_hi = check_crop_config(scale, ratio)
    crop_stream = view_stream(STREAM_CROP, view)
    seed, epoch, index = _sample_args(seed, epoch, index)
    height, width = np.asarray(height), np.asarray(width)
    for name, side in (("height", height), ("width", width)):
        if side.dtype.kind not in "iu":
            raise ConfigError(f"{name} must be an integer, got {side.dtype}")
        if side.size and (side.min() < 1 or side.max() >= 1 << 31):
            raise ConfigError(f"{name} must be in [1, 2**31)")
    scalar = all(np.ndim(a) == 0 for a in (seed, epoch, index, height, width))
    arrays = np.broadcast_arrays(seed, epoch, index, height, width)
    shape = arrays[0].shape
    seed, epoch, index = (a.reshape(-1) for a in arrays[:3])
    H, W = (a.reshape(-1).astype(np.int64) for a in arrays[3:])

    lr_lo, lr_hi = (float(v) for v in portable_log(np.array([r_lo, r_hi])))
    area = (H * W).astype(np.float64)
    Hf, Wf = H.astype(np.float64), W.astype(np.float64)
    top, left, h, w = np.zeros((4, H.size), np.int64)
    attempt = np.full(H.size, -1, np.int32)

    todo = np.arange(H.size)
    for a in range(CROP_ATTEMPTS):
        if not todo.size:
            break
        x0, x1, x2, x3 = _block(seed[todo], epoch[todo], index[todo], crop_stream, a)
        target = area[todo] * (s_lo + (s_hi - s_lo) * _unit(x0, x1))
        aspect = portable_exp(lr_lo + (lr_hi - lr_lo) * _unit(x2, x3))
        wf = np.rint(np.sqrt(target * aspect))      # half to even, as Python's round
        hf = np.rint(np.sqrt(target / aspect))
        ok = (wf > 0.0) & (wf <= Wf[todo]) & (hf > 0.0) & (hf <= Hf[todo])
        done = todo[ok]
        w[done] = wf[ok].astype(np.int64)
        h[done] = hf[ok].astype(np.int64)
        attempt[done] = a
        todo = todo[~ok]

    acc = np.flatnonzero(attempt >= 0)
    if acc.size:
        x0, x1, x2, x3 = _block(seed[acc], epoch[acc], index[acc], crop_stream, CROP_ATTEMPTS)
        span_h = H[acc] - h[acc]
        span_w = W[acc] - w[acc]
        t = np.floor(_unit(x0, x1) * (span_h + 1).astype(np.float64)).astype(np.int64)
        l = np.floor(_unit(x2, x3) * (span_w + 1).astype(np.float64)).astype(np.int64)
        top[acc] = np.minimum(t, span_h)
        left[acc] = np.minimum(l, span_w)

    fb = todo      # central crop with the aspect ratio clamped into ratio, as torchvision
    if fb.size:
        Hb, Wb = Hf[fb], Wf[fb]
        in_ratio = Wb / Hb
        narrow = in_ratio < r_lo
        wide = ~narrow & (in_ratio > r_hi)
        with np.errstate(over="ignore"):
            hb = np.where(narrow, np.rint(Wb / r_lo), Hb)
            wb = np.where(wide, np.rint(Hb * r_hi), Wb)
        # Clamped in float64 so that an infinite quotient never reaches the int conversion.
        hb = np.minimum(np.maximum(hb, 1.0), Hb).astype(np.int64)
        wb = np.minimum(np.maximum(wb, 1.0), Wb).astype(np.int64)
        h[fb], w[fb] = hb, wb
        top[fb] = (H[fb] - hb) // 2
        left[fb] = (W[fb] - wb) // 2

    out = (top, left, h, w) + ((attempt,) if return_attempt else ())
    if scalar:
        return tuple(int(v[0]) for v in out)
    return tuple(v.reshape(shape) for v in out)


def random_flip(seed, epoch, index, p=0.5, view=0):
    """Whether sample ``index`` of ``epoch`` is flipped horizontally (probability ``p``), as
    ``RandomHorizontalFlip(p)``: bool array of the broadcast shape, or a bool for scalars.
    ``view``: the view of a multi-view recipe (:func:`view_stream`)."""
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ConfigError(f"flip probability must be in [0, 1], got {p}")
    seed, epoch, index = _sample_args(seed, epoch, index)
    x0, x1, _, _ = _block(seed, epoch, index, view_stream(STREAM_FLIP, view), 0)
    flip = _unit(x0, x1) < p
    return bool(flip) if flip.ndim == 0 else flip


# --- Beta variates from + - * / sqrt and the portable exp/log --------------------------------

def beta_variate(seed, epoch, index, stream, alpha, beta, first_block=0):
    """A Beta(alpha, beta) variate in [0, 1] (a Python float; positive shapes, scalars only)
    from the uniforms of blocks ``first_block``, ``first_block + 1``, ... of ``stream``, u0
    then u1, about 3 blocks on average; the same bits as ``dpu_pipe._mix.beta_variate``.

    G_a / (G_a + G_b) of two Gamma variates, each by Marsaglia and Tsang's method (ACM TOMS
    26(3), 2000) with Marsaglia's polar normals, and Gamma(a) = Gamma(a + 1) U**(1/a) for a
    shape below 1. Computed with portable logarithms, so tiny shapes (alpha = 0.1: Gamma
    variates below 1e-300) give 0 or 1, not 0/0.
    """
    _check_stream_block(stream, first_block)
    key = _sample_args(seed, epoch, index)

    def draws(block):
        while True:
            _check_stream_block(stream, block)
            x0, x1, x2, x3 = _block(*key, stream, block)
            yield float(_unit(x0, x1))
            yield float(_unit(x2, x3))
            block += 1

    draw = functools.partial(next, draws(first_block))
    lg_a = _log_gamma_variate(draw, float(alpha))
    lg_b = _log_gamma_variate(draw, float(beta))
    return 1.0 / (1.0 + _pexp(lg_b - lg_a))


def _plog(x):
    return float(portable_log(np.float64(x)))


def _pexp(x):
    return float(portable_exp(np.float64(x)))


def _log_gamma_variate(draw, shape):
    """log of a Gamma(shape, 1) variate; ``draw()`` gives uniforms in [0, 1)."""
    boost = 0.0
    if shape < 1.0:
        boost = _plog(1.0 - draw()) / shape      # 1 - u lies in (0, 1]
        shape += 1.0
    d = shape - 1.0 / 3.0
    c = 1.0 / np.sqrt(9.0 * d)
    while True:
        while True:                               # polar method: one standard normal
            u = 2.0 * draw() - 1.0
            v = 2.0 * draw() - 1.0
            s = u * u + v * v
            if 0.0 < s < 1.0:
                x = u * float(np.sqrt(-2.0 * _plog(s) / s))
                break
        t = 1.0 + c * x
        if t <= 0.0:
            continue
        t = t * t * t
        if _plog(1.0 - draw()) < 0.5 * x * x + d - d * t + d * _plog(t):
            return _plog(d * t) + boost
