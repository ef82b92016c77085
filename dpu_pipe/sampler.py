"""Which sample indices a rank reads in each epoch, and in which order.

One global permutation per epoch comes from ``(seed, epoch)`` through the Philox scheme of
:mod:`dpu_pipe.rng` (stream ``STREAM_SHUFFLE``), so every rank computes the same one without
talking to the others, and a resumed or re-produced epoch sees the same order. Each rank takes
every ``world_size``-th entry starting at ``rank``, as PyTorch's ``DistributedSampler`` does.
"""

import numpy as np

from .errors import ConfigError
from .rng import STREAM_SHUFFLE, _block, check_epoch, check_seed

__all__ = ["EpochSampler"]

# Sort keys carry the sample index in their low bits (see _permutation); this many bits of
# the 64 are left for randomness at the largest dataset allowed.
_MIN_RANDOM_BITS = 24
MAX_SAMPLES = 1 << (64 - _MIN_RANDOM_BITS)


def _permutation(num_samples, seed, epoch):
    """The epoch's permutation of range(num_samples), int64.

    Sample i gets the 64-bit Philox word of (seed, epoch, i, STREAM_SHUFFLE, block 0) as its
    sort key. Its low ``b = bit_length(num_samples - 1)`` bits are replaced by i itself: the
    keys become distinct, so any sorting algorithm (numpy's SIMD sorts differ between x86
    and aarch64, and between numpy versions) yields the same order, and ``sort`` of plain
    values is several times faster than ``argsort``. Samples whose top ``64 - b`` random bits
    tie — about ``num_samples**2 / 2**(65 - b)`` pairs, e.g. 0.2 for ImageNet's 1.28 M —
    keep index order between themselves.
    """
    bits = max(1, int(num_samples - 1).bit_length())
    mask = np.uint64((1 << bits) - 1)
    index = np.arange(num_samples, dtype=np.uint64)
    x0, x1, _, _ = _block(np.uint64(seed), np.uint64(epoch), index, STREAM_SHUFFLE, 0)
    keys = (x1 << np.uint64(32)) | x0
    keys &= ~mask
    keys |= index
    keys.sort()
    keys &= mask
    return keys.astype(np.int64)


def _check_int(value, name, low, high=None):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value >= high):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ConfigError(f"{name} must be {'in ' if high is not None else ''}{bound}, got {value}")
    return value


class EpochSampler:
    """Sample indices of one rank's shard of a dataset, epoch by epoch.

    Parameters
    ----------
    num_samples : int
        Size of the dataset; indices are ``0 .. num_samples - 1`` (at most 2**40).
    seed : int
        Seed of the permutation, 0 <= seed < 2**64; the same on every rank.
    shuffle : bool
        False keeps index order (0, 1, 2, ...) in every epoch.
    rank, world_size : int
        This rank and the number of ranks sharing the dataset, 0 <= rank < world_size.
    drop_last : bool
        How the dataset is cut into equal shards when ``world_size`` does not divide it:

        * ``False`` (default, as ``DistributedSampler``): the permutation is padded by
          wrapping around to its start, so every sample is read and a few are read twice.
        * ``True``: the tail of the permutation is dropped, so no sample is read twice and a
          few (different ones each epoch when shuffling) are not read at all.

        Every rank gets ``len(sampler)`` indices either way. The same flag is the default
        for :meth:`batches`: drop the last partial batch, or keep it.

    Worked example: dataset ``0..6`` (7 samples), ``world_size=2``, ``shuffle=False`` (with
    shuffling, the same happens to the permuted order ``p[0..6]``):

    ==============  =======================  ==========  ==========  ========
    ``drop_last``   global order (padded)    rank 0      rank 1      per rank
    ==============  =======================  ==========  ==========  ========
    ``False``       0 1 2 3 4 5 6 **0**      0 2 4 6     1 3 5 **0**   4
    ``True``        0 1 2 3 4 5 (6 dropped)  0 2 4       1 3 5         3
    ==============  =======================  ==========  ==========  ========

    and then, with ``batches(epoch, batch_size=3)``: ``drop_last=False`` gives rank 0
    ``[0 2 4] [6]`` and rank 1 ``[1 3 5] [0]``; ``drop_last=True`` gives ``[0 2 4]`` and
    ``[1 3 5]``.

    .. warning::
       Call :meth:`set_epoch` before each epoch (or pass the epoch to :meth:`indices` /
       :meth:`batches`). Forgetting it repeats epoch 0's order — and its augmentations,
       which are keyed by the same epoch — every epoch, silently.
    """

    def __init__(self, num_samples, *, seed=0, shuffle=True, rank=0, world_size=1,
                 drop_last=False):
        self.num_samples = _check_int(num_samples, "num_samples", 1, MAX_SAMPLES + 1)
        self.seed = check_seed(seed)
        self.world_size = _check_int(world_size, "world_size", 1)
        self.rank = _check_int(rank, "rank", 0, self.world_size)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        if self.drop_last:
            self._per_rank = self.num_samples // self.world_size
            if self._per_rank == 0:
                raise ConfigError(
                    f"drop_last=True with {self.num_samples} samples over world_size="
                    f"{self.world_size} leaves every rank empty; use drop_last=False or "
                    f"fewer ranks")
        else:
            self._per_rank = -(-self.num_samples // self.world_size)
        self.epoch = 0
        self._cache = None  # (epoch, this rank's indices): batches() of one epoch reuse it

    def set_epoch(self, epoch):
        """Make ``epoch`` (0 <= epoch < 2**32) the one :meth:`indices`, :meth:`batches` and
        iteration use by default. See the warning in the class docstring."""
        self.epoch = check_epoch(epoch)

    def __len__(self):
        """Number of indices this rank reads per epoch (the same on every rank)."""
        return self._per_rank

    def permutation(self, epoch=None):
        """The global order of ``epoch`` before sharding: int64, shape (num_samples,), the
        same on every rank."""
        epoch = self.epoch if epoch is None else check_epoch(epoch)
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        return _permutation(self.num_samples, self.seed, epoch)

    def indices(self, epoch=None):
        """This rank's sample indices for ``epoch`` (default: the one set by
        :meth:`set_epoch`), in reading order: int64, shape (len(self),)."""
        return self._shard(epoch).copy()

    def _shard(self, epoch):
        """This rank's indices, shared with the cache: callers must not modify them."""
        epoch = self.epoch if epoch is None else check_epoch(epoch)
        cache = self._cache
        if cache is not None and cache[0] == epoch:
            return cache[1]
        order = self.permutation(epoch)
        total = self._per_rank * self.world_size
        if total > order.size:
            order = np.resize(order, total)     # repeats from the start: the wrap padding
        shard = np.ascontiguousarray(order[self.rank:total:self.world_size])
        self._cache = (epoch, shard)
        return shard

    def num_batches(self, batch_size, drop_last=None):
        """Number of batches :meth:`batches` yields per epoch on this rank."""
        batch_size = _check_int(batch_size, "batch_size", 1)
        drop_last = self.drop_last if drop_last is None else bool(drop_last)
        return self._per_rank // batch_size if drop_last else -(-self._per_rank // batch_size)

    def batch(self, epoch, step, batch_size, drop_last=None):
        """Indices of batch ``step`` (0-based) of ``epoch`` on this rank: int64, shape
        (batch_size,) or shorter for the last batch when it is kept."""
        n = self.num_batches(batch_size, drop_last)
        step = _check_int(step, "step", 0)
        if step >= n:
            raise ConfigError(f"step {step} is past the last batch of the epoch ({n} batches "
                              f"of {batch_size})")
        return self._shard(epoch)[step * batch_size:(step + 1) * batch_size].copy()

    def batches(self, epoch=None, batch_size=1, drop_last=None):
        """This rank's batches of ``epoch``: a list of int64 arrays of ``batch_size`` indices
        each; the last one is shorter, or dropped when ``drop_last`` (default: the sampler's
        own ``drop_last``) is true."""
        n = self.num_batches(batch_size, drop_last)
        idx = self.indices(epoch)
        return [idx[s * batch_size:(s + 1) * batch_size] for s in range(n)]

    def __iter__(self):
        """The indices of the current epoch, as Python ints."""
        return iter(self.indices().tolist())

    def __repr__(self):
        return (f"EpochSampler(num_samples={self.num_samples}, seed={self.seed}, "
                f"shuffle={self.shuffle}, rank={self.rank}, world_size={self.world_size}, "
                f"drop_last={self.drop_last}, epoch={self.epoch})")
