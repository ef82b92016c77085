"""Which sample indices a rank reads in each epoch, and in which order.

Position ``p`` of epoch ``e``'s order holds sample ``permutation_at(p, n, seed, e)``, a keyed
bijection of ``[0, n)`` evaluated one position at a time (:func:`dpu_pipe.rng.permutation_at`,
C kernel ``perm_index`` in ``_rng.pxd``): no rank holds the permutation, and every rank, thread
or producer computes the same order alone. Rank ``r`` takes every ``world_size``-th position
from ``r``, as PyTorch's ``DistributedSampler`` does. Sharding, ``shard_tail`` (with a worked
table) and the elastic resume: docs/design/determinism.md.

``stick_to_shard=True`` keeps each rank on the same samples every epoch (what a per-rank
decoded cache wants): rank ``r``'s ``k``-th position, ``p = r + k * world_size``, holds
``F(r + world_size * P_{r,e}(k))``, ``F`` a permutation of ``[0, n)`` keyed by the seed alone
and ``P_{r,e}`` one of the ``k`` rank ``r`` reads (with ``shard_tail="drop"`` the first
``n // world_size``, the rest staying in place) keyed by (seed, rank, world size) and epoch.
"""

import numpy as np

from . import _validate as _v
from ._rng import permute
from .constants import SHARD_TAILS
from .errors import ConfigError
from .rng import STREAM_STICK, check_epoch, check_seed, random_u64

__all__ = ["EpochSampler", "SHARD_TAILS", "MAX_SAMPLES"]

MAX_SAMPLES = 1 << 40
# Positions go to the kernel this many at a time: bounded memory for whole-shard requests.
_CHUNK = 1 << 16


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
    shard_tail : "pad", "drop", "uneven" or "mask"
        The ``num_samples % world_size`` samples left over when the ranks stride through the
        order: ``"pad"`` wraps around to its start until every rank has ``ceil(n /
        world_size)`` (``DistributedSampler(drop_last=False)``); ``"drop"`` cuts them,
        ``n // world_size`` each (``drop_last=True``); ``"uneven"`` gives the first ``n %
        world_size`` ranks one more, so every sample is read once across ranks (a rank may get
        none); ``"mask"`` pads as ``"pad"`` and :meth:`valid` is False for the padding (at
        most the rank's last position): exact evaluation under DDP, as many steps per rank.
    resume : (epoch, start) or (epoch, start, order_world_size), optional
        Epoch ``epoch`` covers only positions ``start .. num_samples - 1`` of its order,
        sharded as above (padding wraps around to the whole order's start): what the ranks
        of another job size had not read. Other epochs are whole. The third item, only with
        ``stick_to_shard``: the world size whose order that epoch follows (default: this one).
    stick_to_shard : bool
        Every rank reads the same samples every epoch, reshuffled among them (see the module
        docstring); an elastic resume onto another world size finishes the resumed epoch in
        the saved job's order, then each rank's subset changes once.

    .. warning::
       Call :meth:`set_epoch` before each epoch (or pass the epoch to :meth:`indices` /
       :meth:`batches`). Forgetting it repeats epoch 0's order — and its augmentations,
       which are keyed by the same epoch — every epoch, silently.

    Memory: a few integers, whatever ``num_samples``; calls return arrays of the size asked for.
    """

    def __init__(self, num_samples, *, seed=0, shuffle=True, rank=0, world_size=1,
                 shard_tail="pad", resume=None, stick_to_shard=False):
        self.num_samples = _v.integer(num_samples, "num_samples", 1, MAX_SAMPLES)
        self.seed = check_seed(seed)
        self.world_size = _v.positive_int(world_size, "world_size")
        self.rank = _v.integer(rank, "rank", 0, self.world_size - 1)
        self.shuffle = _v.boolean(shuffle, "shuffle")
        self.shard_tail = _v.choice(shard_tail, "shard_tail", SHARD_TAILS)
        self.stick_to_shard = _v.boolean(stick_to_shard, "stick_to_shard")
        if self.stick_to_shard and self.world_size >= 1 << 32:
            raise ConfigError("stick_to_shard needs world_size < 2**32")
        self.resume = check_resume(resume, self.num_samples, self.stick_to_shard)
        self._keys = {}
        self._per_rank = self._count(self.num_samples)
        if self._per_rank == 0 and shard_tail == "drop":
            raise ConfigError(
                f"shard_tail='drop' with {self.num_samples} samples over world_size="
                f"{self.world_size} leaves every rank empty; use shard_tail='pad', 'uneven' "
                f"or 'mask', or fewer ranks")
        self.epoch = 0

    def _count(self, length, shard_tail=None):
        """This rank's share of ``length`` positions under ``shard_tail`` (default: its own)."""
        shard_tail = shard_tail or self.shard_tail
        if shard_tail in ("pad", "mask"):
            return -(-length // self.world_size)
        if shard_tail == "drop":
            return length // self.world_size
        return max(0, -(-(length - self.rank) // self.world_size))

    def _span(self, epoch):
        """(first position, positions) of ``epoch``'s order that the shards cover."""
        if self.resume is not None and epoch == self.resume[0]:
            return self.resume[1], self.num_samples - self.resume[1]
        return 0, self.num_samples

    def count(self, epoch=None):
        """Indices this rank reads in ``epoch`` (default: the current one): ``len(self)``, or
        fewer in the epoch of ``resume``."""
        return self._count(self._span(self._epoch(epoch))[1])

    def set_epoch(self, epoch):
        """Make ``epoch`` (0 <= epoch < 2**32) the one :meth:`indices`, :meth:`batches` and
        iteration use by default. See the warning in the class docstring."""
        self.epoch = check_epoch(epoch)

    def __len__(self):
        """Indices this rank reads per whole epoch (the same on every rank unless
        ``shard_tail="uneven"``); see :meth:`count`."""
        return self._per_rank

    def _epoch(self, epoch):
        return self.epoch if epoch is None else check_epoch(epoch)

    def _at(self, positions, epoch):
        """Sample indices at global positions (int64 array, each < num_samples)."""
        if not self.shuffle:
            return positions.astype(np.int64)
        if self.stick_to_shard:
            return self._stuck(positions, epoch)
        return permute(positions, self.num_samples, self.seed, epoch)

    def _key(self, rank, world_size):
        """Key of ``F`` (rank None) or of ``P_{rank}`` in a job of ``world_size`` ranks."""
        key = self._keys.get((rank, world_size))
        if key is None:
            index = 0 if rank is None else (world_size << 32) | rank
            key = int(random_u64(self.seed, 0, index, STREAM_STICK, 0 if rank is None else 1)[0])
            self._keys[(rank, world_size)] = key
        return key

    def _stuck(self, positions, epoch):
        """stick_to_shard's order at global positions ``r + k * W``: ``F(r + W * P_{r,e}(k))``."""
        n = self.num_samples
        ws = self.world_size
        if self.resume is not None and epoch == self.resume[0] and len(self.resume) == 3:
            ws = self.resume[2]
        rank, k = np.divmod(positions, ws)[::-1]
        stuck = np.empty(len(positions), np.int64)
        # Rank r's positions below n have k in 0 .. ceil((n - r) / W) - 1; "drop" reads only
        # the first n // W of them, so only those are shuffled (the dropped one stays put:
        # the same samples are left out every epoch).
        for r in np.unique(rank).tolist():
            sel = rank == r
            mine = n // ws if self.shard_tail == "drop" else -(-(n - r) // ws)
            kr = k[sel]
            shuffled = kr < mine
            if shuffled.any():
                kr[shuffled] = permute(kr[shuffled], mine, self._key(r, ws), epoch)
            stuck[sel] = r + ws * kr
        return permute(stuck, n, self._key(None, 0), 0)

    def permutation(self, epoch=None):
        """The global order of ``epoch`` before sharding: int64, shape (num_samples,), the
        same on every rank. For inspection: the sampler never holds it."""
        epoch = self._epoch(epoch)
        out = np.empty(self.num_samples, np.int64)
        for lo in range(0, self.num_samples, _CHUNK):
            hi = min(self.num_samples, lo + _CHUNK)
            out[lo:hi] = self._at(np.arange(lo, hi, dtype=np.int64), epoch)
        return out

    def _range(self, epoch, start, stop):
        """(epoch, start, stop) checked; None: the current epoch, the shard's end."""
        epoch = self._epoch(epoch)
        per_rank = self.count(epoch)
        start = _v.integer(start, "start", 0)
        stop = _v.integer(per_rank if stop is None else stop, "stop", start, per_rank)
        return epoch, start, stop

    def indices(self, epoch=None, start=0, stop=None):
        """This rank's sample indices for ``epoch`` (default: the current one) in reading
        order, shard positions ``start .. stop - 1`` (default: all): int64, (stop - start,)."""
        epoch, start, stop = self._range(epoch, start, stop)
        first, _ = self._span(epoch)
        out = np.empty(stop - start, np.int64)
        for lo in range(start, stop, _CHUNK):
            hi = min(stop, lo + _CHUNK)
            # Padding wraps around to the start of the order, as often as needed.
            pos = (first + self.rank + np.arange(lo, hi, dtype=np.int64) * self.world_size) \
                % self.num_samples
            out[lo - start:hi - start] = self._at(pos, epoch)
        return out

    def num_valid(self, epoch=None, start=0, stop=None):
        """How many of this rank's shard positions ``start .. stop - 1`` of ``epoch`` are
        valid: all but, with ``shard_tail="mask"``, the padding. Valid positions come first,
        so batch rows ``0 .. num_valid - 1`` are the valid ones."""
        epoch, start, stop = self._range(epoch, start, stop)
        if self.shard_tail != "mask":
            return stop - start
        real = self._count(self._span(epoch)[1], "uneven")
        return max(0, min(stop, real) - start)

    def valid(self, epoch=None, start=0, stop=None):
        """Which of this rank's shard positions ``start .. stop - 1`` of ``epoch`` are valid
        (see :meth:`num_valid`): bool, shape (stop - start,)."""
        epoch, start, stop = self._range(epoch, start, stop)
        return np.arange(stop - start) < self.num_valid(epoch, start, stop)

    def num_batches(self, batch_size, drop_last=False, epoch=None):
        """Batches :meth:`batches` yields on this rank in ``epoch`` (default: a whole epoch,
        not the one of ``resume``)."""
        batch_size = _v.positive_int(batch_size, "batch_size")
        drop_last = _v.boolean(drop_last, "drop_last")
        per_rank = self._per_rank if epoch is None else self.count(epoch)
        return per_rank // batch_size if drop_last else -(-per_rank // batch_size)

    def batch(self, epoch, step, batch_size, drop_last=False):
        """Indices of batch ``step`` (0-based) of ``epoch`` on this rank: int64,
        (batch_size,), or shorter for a kept last batch. O(batch_size) time and memory."""
        epoch = self._epoch(epoch)
        n = self.num_batches(batch_size, drop_last, epoch)
        step = _v.integer(step, "step", 0)
        if step >= n:
            raise ConfigError(f"step {step} is past the last batch of epoch {epoch} ({n} "
                              f"batches of {batch_size})")
        start = step * batch_size
        return self.indices(epoch, start, min(start + batch_size, self.count(epoch)))

    def batches(self, epoch=None, batch_size=1, drop_last=False):
        """This rank's batches of ``epoch``: int64 arrays of ``batch_size`` indices; the last
        is shorter, or left out with ``drop_last`` (as ``DataLoader``'s)."""
        epoch = self._epoch(epoch)
        n = self.num_batches(batch_size, drop_last, epoch)
        idx = self.indices(epoch, 0, min(n * batch_size, self.count(epoch)))
        return [idx[s * batch_size:(s + 1) * batch_size] for s in range(n)]

    def __iter__(self):
        """The indices of the current epoch, as Python ints (computed a chunk at a time)."""
        epoch = self.epoch
        per_rank = self.count(epoch)
        for lo in range(0, per_rank, _CHUNK):
            yield from self.indices(epoch, lo, min(per_rank, lo + _CHUNK)).tolist()

    def __repr__(self):
        return (f"EpochSampler(num_samples={self.num_samples}, seed={self.seed}, "
                f"shuffle={self.shuffle}, rank={self.rank}, world_size={self.world_size}, "
                f"shard_tail={self.shard_tail!r}, resume={self.resume}, "
                f"stick_to_shard={self.stick_to_shard}, epoch={self.epoch})")


def check_resume(resume, num_samples, stick_to_shard=False):
    """``resume`` as ``(epoch, start)`` ints with 0 <= start < num_samples, or None (also
    for a start of 0); only with ``stick_to_shard`` may a third item, ``order_world_size``,
    follow (the order depends on the world size then)."""
    if resume is None:
        return None
    try:
        epoch, start, *rest = resume
    except (TypeError, ValueError):
        rest = None
    if rest is None or len(rest) > 1 or (rest and not stick_to_shard):
        raise ConfigError(f"resume must be (epoch, start) or None (with stick_to_shard: "
                          f"(epoch, start[, order_world_size])), got {resume!r}")
    epoch = check_epoch(epoch)
    start = _v.integer(start, "resume start", 0, num_samples - 1)
    if start == 0:
        return None
    if rest and stick_to_shard:
        return (epoch, start, _v.integer(rest[0], "resume order_world_size", 1, (1 << 32) - 1))
    return (epoch, start)
