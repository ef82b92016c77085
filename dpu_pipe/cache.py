"""The decoded-sample cache of ``decode_max_side``: the reduced images of a source, kept in one
arena of ``cache_bytes`` bytes and served to every batch kernel given it.

The arena is laid out and used by C code over a raw pointer and size (``src/dpu_pipe/_cache.h``,
GCC atomics, no lock), so the same cache works over any shared memory; here, in local mode, an
anonymous shared mapping that one loader's threads share (and processes forked from it). Its
layout (header, a table of :data:`ENTRY_BYTES` per sample, pixels at :data:`ALIGN`-aligned
offsets), the no-eviction rule and its memory: docs/guides/caching.md.
"""

import mmap

import numpy as np

from . import _pipeline
from . import _validate as _v
from .errors import ConfigError

__all__ = ["DecodedCache", "ENTRY_BYTES", "ALIGN", "table_bytes", "check_cache_bytes"]

#: Bytes of the cache's table per sample index of the source.
ENTRY_BYTES = int(_pipeline.CACHE_ENTRY_BYTES)
#: Alignment of each stored sample's pixels (at most ALIGN - 1 padding bytes per sample).
ALIGN = int(_pipeline.CACHE_ALIGN)


def table_bytes(num_samples):
    """Bytes of ``cache_bytes`` a cache of a ``num_samples`` source spends before any pixel:
    the header and :data:`ENTRY_BYTES` per sample (every index of the source, whichever rank
    reads it), rounded up to 64."""
    return int(_pipeline.cache_table_bytes(_v.positive_int(num_samples, "num_samples")))


def check_cache_bytes(cache_bytes, num_samples):
    """``cache_bytes`` (bytes of the whole arena) as an int; :class:`ConfigError` when a cache
    of that size cannot hold one sample of a ``num_samples`` source beside its table."""
    cache_bytes = _v.positive_int(cache_bytes, "cache_bytes")
    need = table_bytes(num_samples)
    if cache_bytes <= need:
        raise ConfigError(
            f"cache_bytes={cache_bytes} cannot hold a sample: its table alone takes "
            f"{need} bytes for {num_samples} samples ({ENTRY_BYTES} bytes each)")
    return cache_bytes


class DecodedCache:
    """A cache of ``cache_bytes`` bytes for a source of ``num_samples`` samples, in an
    anonymous shared mapping of this process. ``cache_bytes`` counts the table: at least
    :func:`table_bytes` ``(num_samples)`` plus the bytes of the samples to hold."""

    def __init__(self, cache_bytes, num_samples):
        self.num_samples = _v.positive_int(num_samples, "num_samples")
        self.cache_bytes = check_cache_bytes(cache_bytes, self.num_samples)
        self._map = mmap.mmap(-1, self.cache_bytes)
        #: The kernel-side cache (:class:`dpu_pipe._pipeline.SampleCache`) batch kernels use.
        self.kernel = _pipeline.SampleCache(self._map, self.num_samples)

    def stats(self):
        """The counters: ``{"hits", "misses", "bytes", "entries", "did_not_fit"}`` — lookups
        that found / did not find their sample, pixel bytes stored, samples stored, samples
        refused for lack of room (each refused once; they are decoded every time after)."""
        return self.kernel.stats()

    def ready(self, indices):
        """Whether each sample of ``indices`` (int array (N,)) is stored: bool (N,). Not
        counted as lookups."""
        return self.kernel.ready(np.ascontiguousarray(indices, dtype=np.int64))

    def sample(self, index):
        """(pixels, scale): a copy of sample ``index``'s reduced image, uint8 (h, w, 3), and
        the DCT scale (eighths) it was decoded at; None when it is not stored."""
        return self.kernel.sample(_v.integer(index, "index", 0, self.num_samples - 1))

    def __repr__(self):
        return (f"DecodedCache(cache_bytes={self.cache_bytes}, num_samples={self.num_samples}, "
                f"{self.stats()})")
