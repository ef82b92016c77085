"""The producers' decoded-sample cache: one per node, shared by every producer rank of a host
on that node, in MPI's own shared memory (the user's side and the set-up's steps:
docs/guides/caching.md).

:meth:`NodeCaches.open` sets a cache up collectively over the node's producers. Its blocking
MPI calls come after a non-blocking barrier with a deadline, so they return at once; from then
on the arena works as in local mode (``src/dpu_pipe/_cache.h``): no lock and no MPI call per
sample. One cache per (source, transform, ``cache_bytes``), kept until the producers stop;
set-ups run one at a time per communicator, in the order requests arrive (the same on every
producer), so the collectives match.
"""

import itertools
import json
import logging
import time

from .. import _pipeline
from ..cache import DecodedCache
from ..deadline import deadline_in
from ..errors import ConfigError, PipeTimeout
from ..mpi import load_mpi

__all__ = ["NodeCaches", "SharedCache", "cache_key", "run_to_end"]

log = logging.getLogger("dpu_pipe")


def cache_key(source_spec, transform, cache_bytes):
    """The key of a node cache: what its pixels depend on (the source and the transform's
    decode options) and its size. JSON text."""
    return json.dumps({"source": source_spec, "transform": transform,
                       "cache_bytes": int(cache_bytes)}, sort_keys=True)


def run_to_end(gen, nap=0.001):
    """Drive the generator ``gen`` (a :meth:`NodeCaches.open`) to its end, sleeping ``nap``
    seconds between steps; returns its value. For threads that may block (validation)."""
    try:
        while True:
            next(gen)
            time.sleep(nap)
    except StopIteration as stop:
        return stop.value


class SharedCache(DecodedCache):
    """A :class:`~dpu_pipe.cache.DecodedCache` in node rank 0's segment ``buffer`` of the MPI
    shared-memory window ``win`` (kept alive with it); ``init``: lay the arena out (node rank 0)
    or attach to it. ``node``, its first producer's host-group rank, names it in counters."""

    def __init__(self, win, buffer, num_samples, init, node):
        self.win = win
        self.num_samples = int(num_samples)
        self.node = int(node)
        self.kernel = _pipeline.SampleCache(buffer, self.num_samples, init)
        self.cache_bytes = int(self.kernel.nbytes)


class NodeCaches:
    """The node caches of this producer rank (see the module docstring).

    Parameters
    ----------
    group : mpi4py.MPI.Intracomm
        The host group (the host as rank 0, its producers after it). Collective over the
        producers of ``group`` (start-up only).
    setup_timeout : float
        Seconds each barrier of a cache's set-up waits for the node's other producers.
    """

    #: Communicator names: the producer loop's stream requests, the validation thread's jobs.
    USERS = ("stream", "validation")

    def __init__(self, group, setup_timeout=60.0):
        MPI = self.MPI = load_mpi()
        self.setup_timeout = float(setup_timeout)
        everyone = group.Get_group()
        producers = everyone.Excl([0])
        # Create_group is collective over the producers only: the host goes on with its own
        # start-up meanwhile.
        pcomm = group.Create_group(producers)
        producers.Free()
        everyone.Free()
        node = pcomm.Split_type(MPI.COMM_TYPE_SHARED, key=pcomm.Get_rank())
        pcomm.Free()
        #: The host-group rank of this node's first producer (names the node).
        self.node = node.bcast(group.Get_rank(), root=0)
        # One communicator per thread that sets caches up: collectives of two threads on
        # one communicator could interleave differently on two ranks.
        self.comms = {"stream": node, "validation": node.Dup()}
        self.caches = {}            # (user, cache_key) -> SharedCache, in the order made
        self._queue = {u: [] for u in self.USERS}    # set-ups waiting, in arrival order
        self._tokens = itertools.count()

    def open(self, key, cache_bytes, num_samples, user="stream"):
        """Generator: yields while it waits for the node's other producers, then returns the
        :class:`SharedCache` of ``key`` (:func:`cache_key`), made collectively on first use.
        ``user`` names the calling thread's communicator (:attr:`USERS`). Raises
        :class:`PipeTimeout` when a barrier passes ``setup_timeout``."""
        # Each communicator's caches are its own: two threads never set one up together.
        key = (user, key)
        cache = self.caches.get(key)
        if cache is not None:
            return cache
        queue = self._queue[user]
        token = next(self._tokens)
        queue.append(token)
        try:
            while queue[0] != token:
                yield
            cache = self.caches.get(key)    # made by a set-up queued before this one
            if cache is None:
                cache = yield from self._make(key, int(cache_bytes), int(num_samples),
                                              self.comms[user])
            return cache
        finally:
            queue.remove(token)

    def _barrier(self, comm, what):
        req = comm.Ibarrier()
        deadline = deadline_in(self.setup_timeout)
        while not req.Test():
            if time.monotonic() > deadline:
                raise PipeTimeout(
                    f"decoded-sample cache: producer at node rank {comm.Get_rank()} waited "
                    f"{self.setup_timeout:g} s for the node's {comm.Get_size()} producers "
                    f"{what}")
            yield

    def _make(self, key, cache_bytes, num_samples, comm):
        MPI = self.MPI
        need = int(_pipeline.cache_table_bytes(num_samples))
        if cache_bytes <= need:
            raise ConfigError(f"cache_bytes={cache_bytes} cannot hold a sample: its table "
                              f"alone takes {need} bytes for {num_samples} samples")
        yield from self._barrier(comm, "to reach the cache's set-up")
        first = comm.Get_rank() == 0
        try:
            win = MPI.Win.Allocate_shared(cache_bytes if first else 0, 1, comm=comm)
        except MPI.Exception as exc:
            raise ConfigError(f"cannot allocate the decoded-sample cache: {cache_bytes} "
                              f"bytes of shared memory on this node ({exc}); lower "
                              f"cache_bytes or make /dev/shm larger") from None
        buf, _ = win.Shared_query(0)
        if first:
            cache = SharedCache(win, buf, num_samples, True, self.node)
        yield from self._barrier(comm, "to lay out the cache")
        if not first:
            cache = SharedCache(win, buf, num_samples, False, self.node)
        self.caches[key] = cache
        log.debug("dpu_pipe: node cache of %d bytes for %d samples (%d producers)",
                  cache_bytes, num_samples, comm.Get_size())
        return cache

    def close(self):
        """Free the windows, collectively over the node's producers (after their validation
        threads ended), in the order each communicator made them; skipped, with a warning,
        when one does not arrive within ``setup_timeout`` (they stay mapped until exit)."""
        if not self.caches:
            return
        try:
            run_to_end(self._barrier(self.comms["stream"], "to free the caches"))
        except PipeTimeout as exc:
            log.warning("dpu_pipe: %s; the caches stay mapped until exit", exc)
            return
        for user in self.USERS:
            for key in [k for k in self.caches if k[0] == user]:
                self.caches.pop(key).win.Free()
