# The RNG kernels of _rng.pxd one at a time, over arrays, for tests/test_rng.py: Philox on
# one counter, the words and uniforms of a block, portable exp/log, crop boxes and flips. The
# package calls these kernels only inside its batch kernel and permutation; the tests hold each
# of them to known answers, to the numpy twin (dpu_pipe.rng) and to torchvision's algorithm.
# They are inline code of _rng.pxd, compiled here from the package's source with the package's
# flags (tests/kernel_probes.py), and cross-compiled with the aarch64 wheel for its emulated
# tests (scripts/build_wheels.sh). Arguments are checked by dpu_pipe.rng's own checks and
# broadcast like numpy's; results are C-contiguous arrays of the broadcast shape.
import numpy as np

from dpu_pipe.errors import ConfigError
from dpu_pipe.rng import _as_uint, check_crop_config

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t

from dpu_pipe._rng cimport (CropBox, CropConfig, crop_config_init, philox4x32_10, portable_exp,
                            portable_log, random_flip, random_resized_crop, rng_block,
                            rng_uniform2)


def _flat(shape, *arrays):
    return [np.ascontiguousarray(np.broadcast_to(a, shape)).reshape(-1) for a in arrays]


def _sample_arrays(seed, epoch, index, *more):
    seed = _as_uint(seed, "seed", 64)
    epoch = _as_uint(epoch, "epoch", 32).astype(np.uint32)
    index = _as_uint(index, "index", 64)
    shape = np.broadcast_shapes(*(np.shape(a) for a in (seed, epoch, index) + more))
    return shape, _flat(shape, seed, epoch, index, *more)


def _check_stream(uint32_t stream, uint32_t block):
    if stream >= 1 << 16 or block >= 1 << 16:
        raise ConfigError(f"stream and block must be in [0, 65536), got {stream}, {block}")


def philox(counter, key):
    """philox4x32_10 of one 4-word counter under one 2-word key: tuple of 4 ints."""
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
    _check_stream(stream, block)
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
    _check_stream(stream, block)
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
    """random_resized_crop (the kernel of dpu_pipe.rng.random_resized_crop) for every element.

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
