"""The epoch permutation of _rng.pxd for Python callers: ``permute``, one call per array of
positions (dpu_pipe.sampler draws the epoch order with it).

The other kernels of _rng.pxd are cimported by the batch kernel (_pipeline); the tests reach
each of them through their own extension (tests/kernels/_rng_probe.pyx). Arguments broadcast
like numpy's; results are C-contiguous arrays of the broadcast shape (flattened to 1-D first,
then reshaped).
"""

import numpy as np

from dpu_pipe.errors import ConfigError
from dpu_pipe.rng import _as_uint

from libc.stdint cimport uint32_t, uint64_t


def _sample_arrays(seed, epoch, index):
    arrays = (_as_uint(seed, "seed", 64), _as_uint(epoch, "epoch", 32).astype(np.uint32),
              _as_uint(index, "index", 64))
    shape = np.broadcast_shapes(*(np.shape(a) for a in arrays))
    return shape, [np.ascontiguousarray(np.broadcast_to(a, shape)).reshape(-1) for a in arrays]


def permute(positions, n, seed, epoch):
    """perm_index for every element: the sample index at each position of the permutation of
    [0, n) keyed by (seed, epoch); int64, shape broadcast(positions, seed, epoch).

    ``n``: 1 <= n <= 2**62; ``positions``: integers in [0, n) (ConfigError otherwise).
    """
    cdef PermDomain d
    cdef uint64_t n_ = int(_as_uint(n, "n", 63))
    if perm_init(&d, n_) != 0:
        raise ConfigError(f"n must be in [1, 2**62], got {n}")
    pos_ = _as_uint(positions, "position", 63)
    if pos_.size and int(pos_.max()) >= n_:
        raise ConfigError(f"positions must be in [0, {n_}), got up to {int(pos_.max())}")
    shape, (s_, e_, p_) = _sample_arrays(seed, epoch, pos_)
    cdef const uint64_t[::1] s = s_
    cdef const uint32_t[::1] e = e_
    cdef const uint64_t[::1] p = p_
    out = np.empty(s.shape[0], np.uint64)
    cdef uint64_t[::1] o = out
    cdef Py_ssize_t i
    with nogil:
        for i in range(s.shape[0]):
            o[i] = perm_index(&d, s[i], e[i], p[i])
    return out.view(np.int64).reshape(shape)
