"""Python entry points to the C kernels of _rng.pxd, one call per array of samples.

The kernels themselves are meant to be cimported by the augmentation code; these wrappers let
tests hold them to the numpy twin (dpu_pipe.rng) bit for bit, and give Python callers a fast
path. Arguments broadcast like numpy's; results are C-contiguous arrays of the broadcast
shape (flattened to 1-D first, then reshaped).
"""

import numpy as np

from dpu_pipe.errors import ConfigError
from dpu_pipe.rng import _as_uint, check_crop_config

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t


def _flat(shape, *arrays):
    return [np.ascontiguousarray(np.broadcast_to(a, shape)).reshape(-1) for a in arrays]


def _sample_arrays(seed, epoch, index, *more):
    seed = _as_uint(seed, "seed", 64)
    epoch = _as_uint(epoch, "epoch", 32).astype(np.uint32)
    index = _as_uint(index, "index", 64)
    shape = np.broadcast_shapes(*(np.shape(a) for a in (seed, epoch, index) + more))
    return shape, _flat(shape, seed, epoch, index, *more)


def philox(counter, key):
    """Philox-4x32-10 of one 4-word counter under one 2-word key: tuple of 4 ints."""
    cdef uint32_t c[4]
    cdef uint32_t k[2]
    cdef uint32_t out[4]
    if len(counter) != 4 or len(key) != 2:
        raise ConfigError("counter needs 4 words and key 2 words")
    for i in range(4):
        c[i] = int(_as_uint(counter[i], "counter word", 32))
    for i in range(2):
        k[i] = int(_as_uint(key[i], "key word", 32))
    philox4x32_10(c, k, out)
    return out[0], out[1], out[2], out[3]


def block_words(seed, epoch, index, uint32_t stream, uint32_t block=0):
    """rng_block for every element: uint32, shape broadcast(...) + (4,)."""
    if stream >= 1 << 16 or block >= 1 << 16:
        raise ConfigError(f"stream and block must be in [0, 65536), got {stream}, {block}")
    shape, (s_, e_, i_) = _sample_arrays(seed, epoch, index)
    cdef const uint64_t[::1] s = s_
    cdef const uint32_t[::1] e = e_
    cdef const uint64_t[::1] ix = i_
    out = np.empty((s.shape[0], 4), np.uint32)
    cdef uint32_t[:, ::1] o = out
    cdef Py_ssize_t n
    with nogil:
        for n in range(s.shape[0]):
            rng_block(s[n], e[n], ix[n], stream, block, &o[n, 0])
    return out.reshape(shape + (4,))


def block_uniforms(seed, epoch, index, uint32_t stream, uint32_t block=0):
    """rng_uniform2 for every element: float64 (u0, u1), shape broadcast(...) + (2,)."""
    if stream >= 1 << 16 or block >= 1 << 16:
        raise ConfigError(f"stream and block must be in [0, 65536), got {stream}, {block}")
    shape, (s_, e_, i_) = _sample_arrays(seed, epoch, index)
    cdef const uint64_t[::1] s = s_
    cdef const uint32_t[::1] e = e_
    cdef const uint64_t[::1] ix = i_
    out = np.empty((s.shape[0], 2), np.float64)
    cdef double[:, ::1] o = out
    cdef Py_ssize_t n
    with nogil:
        for n in range(s.shape[0]):
            rng_uniform2(s[n], e[n], ix[n], stream, block, &o[n, 0], &o[n, 1])
    return out.reshape(shape + (2,))


def exp_array(x):
    """portable_exp elementwise over a float64 array."""
    x_ = np.ascontiguousarray(x, dtype=np.float64)
    cdef const double[::1] xv = x_.reshape(-1)
    out = np.empty(xv.shape[0], np.float64)
    cdef double[::1] o = out
    cdef Py_ssize_t n
    with nogil:
        for n in range(xv.shape[0]):
            o[n] = portable_exp(xv[n])
    return out.reshape(x_.shape)


def log_array(x):
    """portable_log elementwise over a float64 array."""
    x_ = np.ascontiguousarray(x, dtype=np.float64)
    cdef const double[::1] xv = x_.reshape(-1)
    out = np.empty(xv.shape[0], np.float64)
    cdef double[::1] o = out
    cdef Py_ssize_t n
    with nogil:
        for n in range(xv.shape[0]):
            o[n] = portable_log(xv[n])
    return out.reshape(x_.shape)


def crop_boxes(seed, epoch, index, height, width, scale=(0.08, 1.0),
               ratio=(3.0 / 4.0, 4.0 / 3.0)):
    """The C kernel of dpu_pipe.rng.random_resized_crop for every element.

    Returns int64, shape broadcast(...) + (5,): columns top, left, crop height, crop width,
    accepted attempt (-1: central-crop fallback), all in full-resolution pixels.
    """
    cdef CropConfig cfg
    s_lo, s_hi, r_lo, r_hi = check_crop_config(scale, ratio)
    if crop_config_init(&cfg, s_lo, s_hi, r_lo, r_hi) != 0:
        raise ConfigError(f"invalid crop configuration scale={scale!r}, ratio={ratio!r}")
    shape, (s_, e_, i_, h_, w_) = _sample_arrays(seed, epoch, index,
                                                  np.asarray(height, np.int64),
                                                  np.asarray(width, np.int64))
    cdef const uint64_t[::1] s = s_
    cdef const uint32_t[::1] e = e_
    cdef const uint64_t[::1] ix = i_
    cdef const int64_t[::1] hv = h_
    cdef const int64_t[::1] wv = w_
    out = np.empty((s.shape[0], 5), np.int64)
    cdef int64_t[:, ::1] o = out
    cdef CropBox box
    cdef Py_ssize_t n
    cdef Py_ssize_t bad = -1
    with nogil:
        for n in range(s.shape[0]):
            if random_resized_crop(&cfg, s[n], e[n], ix[n], hv[n], wv[n], &box) != 0:
                bad = n
                break
            o[n, 0] = box.top
            o[n, 1] = box.left
            o[n, 2] = box.height
            o[n, 3] = box.width
            o[n, 4] = box.attempt
    if bad >= 0:
        raise ConfigError(f"image size must be in [1, 2**31) on both sides, got "
                          f"{hv[bad]} x {wv[bad]}")
    return out.reshape(shape + (5,))


def flips(seed, epoch, index, double p=0.5):
    """random_flip for every element: bool, shape broadcast(seed, epoch, index)."""
    if not 0.0 <= p <= 1.0:
        raise ConfigError(f"flip probability must be in [0, 1], got {p}")
    shape, (s_, e_, i_) = _sample_arrays(seed, epoch, index)
    cdef const uint64_t[::1] s = s_
    cdef const uint32_t[::1] e = e_
    cdef const uint64_t[::1] ix = i_
    out = np.empty(s.shape[0], np.uint8)
    cdef uint8_t[::1] o = out
    cdef Py_ssize_t n
    with nogil:
        for n in range(s.shape[0]):
            o[n] = <uint8_t>random_flip(s[n], e[n], ix[n], p)
    return out.view(bool).reshape(shape)


def permute(positions, n, seed, epoch):
    """perm_index for every element: the sample index at each position of the permutation of
    [0, n) keyed by (seed, epoch); int64, shape broadcast(positions, seed, epoch).

    ``n``: 1 <= n <= 2**62; ``positions``: integers in [0, n) (ConfigError otherwise). One
    (seed, epoch) for all positions, as the sampler asks, goes through the batch kernel.
    """
    cdef PermDomain d
    cdef uint64_t n_ = int(_as_uint(n, "n", 63))
    if perm_init(&d, n_) != 0:
        raise ConfigError(f"n must be in [1, 2**62], got {n}")
    pos_ = _as_uint(positions, "position", 63)
    if pos_.size and int(pos_.max()) >= n_:
        raise ConfigError(f"positions must be in [0, {n_}), got up to {int(pos_.max())}")
    one_key = np.ndim(seed) == 0 and np.ndim(epoch) == 0
    shape, (s_, e_, p_) = _sample_arrays(seed, epoch, pos_)
    cdef const uint64_t[::1] s = s_
    cdef const uint32_t[::1] e = e_
    cdef const uint64_t[::1] p = p_
    out = np.empty(s.shape[0], np.uint64)
    cdef uint64_t[::1] o = out
    cdef Py_ssize_t i, count = s.shape[0]
    cdef bint batch = one_key
    with nogil:
        if count and batch:
            perm_fill(&d, s[0], e[0], &p[0], &o[0], count)
        else:
            for i in range(count):
                o[i] = perm_index(&d, s[i], e[i], p[i])
    return out.view(np.int64).reshape(shape)
