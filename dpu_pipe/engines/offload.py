"""The engine of the offloaded modes (``mode="offload"``, ``"hybrid"``): batches made by
producer ranks (DPU cores), in hybrid mode by host threads too, put into this host's memory
over MPI one-sided RMA. Launch (on a cluster, add ``-hosts node1,...``, ``-hosts node1-dpu,...``)::

    mpiexec -n 1 python -m mpi4py train.py : -n 2 python -m mpi4py -m dpu_pipe.worker

A process's first offloaded loader starts its *host group* (collectively over the job:
:func:`~dpu_pipe.offload.group.host_group`). Each loader is a *stream* of that group: its
:func:`stream_request` goes to the producers once, then epochs, jumps and resumes are only
tickets. One stream is active at a time: iterating another loader cancels the previous one's
work in flight. Producers run the local engine's :class:`~dpu_pipe.batch.BatchMaker` and
batches are yielded in order, so the stream is the local one, bit for bit. See
docs/guides/offload.md and docs/design/transport.md.
"""

import atexit
import logging
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..batch import BatchMaker
from ..deadline import deadline_in
from ..errors import ConfigError, DpuPipeError, PipeTimeout
from ..offload import wire
from ..offload.transport import FAILED, OK, pack_error
from ..offload.wire import QUEUE
from ..sources import check_rebuild
from .base import Cancelled, Engine

__all__ = ["OffloadEngine", "RemoteStats", "prepare", "payload_layout", "stream_request"]

log = logging.getLogger("dpu_pipe")

#: Held by whatever drives the process's host group transport: loaders' threads take turns.
_TRANSPORT_LOCK = threading.RLock()
#: Set at interpreter exit, before the producers are released: no thread drives after it.
_EXITING = threading.Event()
_exit_hooked = set()         # ids of the host groups and transports the handler runs before


def _hook_exit(obj):
    """Run :func:`_take_transport_at_exit` before ``obj``'s exit handler (registered later)."""
    if id(obj) not in _exit_hooked:
        _exit_hooked.add(id(obj))
        atexit.register(_take_transport_at_exit)


def _take_transport_at_exit():
    """Keep the transport from exit on, once daemon threads still iterating let go of it
    (within one poll), so the shutdown never frees the window while a thread reads it."""
    _EXITING.set()
    if not _TRANSPORT_LOCK.acquire(timeout=30.0):
        log.warning("dpu_pipe: a thread kept the host window busy at exit")


def _check_not_exiting():
    if _EXITING.is_set():
        raise ConfigError("the interpreter is exiting: the host group is releasing its "
                          "producers, and no offloaded loader makes batches any more")


def payload_layout(maker):
    """The :class:`~dpu_pipe.offload.wire.PayloadLayout` of ``maker``'s batches."""
    return wire.PayloadLayout(maker.batch_size, wire.image_shapes(maker.transform),
                              maker.transform.np_dtype, maker.label_dtype, maker.label_shape)


def stream_request(stream_spec, layout, producer_threads, cache_bytes=0):
    """What producers need to make a loader's stream (JSON-serialisable): the
    :class:`~dpu_pipe.spec.StreamSpec` on the wire, ``layout``'s labels, the threads of each
    producer's kernel and, when not 0, the node cache's bytes with the source's sample count
    (where the stream runs, not what it is, so not in the spec)."""
    d = {"version": wire.STREAM_REQUEST_VERSION, **stream_spec.to_wire(),
         "labels": layout.labels(), "num_threads": producer_threads}
    if cache_bytes:
        d.update(cache_bytes=int(cache_bytes), cache_samples=len(stream_spec.source))
    return d


def prepare(loader, mode):
    """Set up ``loader`` (its host group in ``loader._group``) for ``mode``: reserve window
    space, check that its source rebuilds on the producers. Returns the mode it runs in,
    ``"local"`` (with a warning) when no producer serves this host; :class:`ConfigError` for
    ``"offload"`` in a job without producer ranks."""
    group = loader._group
    _hook_exit(group)
    check_rebuild(loader.source)
    group.reserve(loader.slots, payload_layout(loader.maker).nbytes)
    if mode == "offload" and not group.roles.producers:
        # torchrun, or a plain python: each process is an MPI job of its own.
        raise ConfigError(
            f"{type(loader).__name__}(mode='offload'): this MPI job has no producer rank "
            f"({group.num_hosts} host rank(s) and nothing else; a process "
            f"started by torchrun or plain python is an MPI job of one). Launch hosts "
            f"and producers as one MPMD job: mpiexec -n HOSTS python -m mpi4py "
            f"train.py : -n PRODUCERS python -m mpi4py -m dpu_pipe.worker — or use "
            f"mode='hybrid' or 'local' to produce on this host")
    if group.producers == 0:
        log.warning("dpu_pipe: no producer rank serves this host; producing locally")
        return "local"
    return mode


@dataclass
class RemoteStats:
    """What an :class:`OffloadEngine` received, named as ``Loader.stats()`` reports it:
    payload bytes and batches, the producers' reported seconds, batches per producer rank
    (0: host threads), samples by side, and the window polls made while waiting (each
    costs the host ~30-60 us of CPU)."""

    bytes_received: int = 0
    batches: int = 0
    producer_read_s: float = 0.0
    producer_process_s: float = 0.0
    producer_publish_s: float = 0.0
    steps_per_producer: dict = field(default_factory=dict)
    producer_samples: int = 0
    host_samples: int = 0
    host_polls: int = 0

    def as_dict(self):
        return vars(self) | {"steps_per_producer": {str(k): v for k, v in
                                                    self.steps_per_producer.items()}}


class _HostThread(threading.Thread):
    """A hybrid host thread: makes tickets with its own BatchMaker into payload buffers."""

    def __init__(self, maker, layout, done):
        super().__init__(name="dpu_pipe-hybrid", daemon=True)
        self.maker = maker
        self.layout = layout
        self.todo = queue.Queue()
        self.done = done
        self.busy = False

    def run(self):
        while True:
            item = self.todo.get()
            if item is None:
                return
            ticket, epoch, step, buf = item
            try:
                images, labels, indices = self.layout.views(buf, self.layout.batch_size)
                st = self.maker.stats
                r0, p0 = st.read_s, st.process_s
                n = self.maker.make(epoch, step, images, labels, indices)
                self.layout.write_header(buf, n=n, read_ns=round((st.read_s - r0) * 1e9),
                                         process_ns=round((st.process_s - p0) * 1e9),
                                         sample_shape=self.maker.sample_shape_at(epoch))
                self.done.put((ticket, buf, OK, None))
            except Exception as exc:  # noqa: BLE001 - raised in the consumer for that step
                self.done.put((ticket, buf, FAILED, pack_error(exc, None, 1 << 20,
                                                                "a host thread")))
            finally:
                self.busy = False


class OffloadEngine(Engine):
    """A loader's stream in its host group: its id, the tickets in flight (in order, running
    ahead across epoch ends: :meth:`start` keeps them when the iteration continues where they
    stand), the batch the caller holds, what it received, and the hybrid host threads.
    Memory: the window's slots (shared by the process's loaders) and, in hybrid mode,
    ``host_threads + 2`` payload buffers of the stream's largest batch.
    """

    def __init__(self, loader):
        self.hostgroup = loader._group
        self.transport = self.hostgroup.transport
        _hook_exit(self.transport)
        self.out = loader.out
        self.timeout = loader.timeout
        self.takeover = loader.mode == "hybrid"
        self.liveness_timeout = loader.liveness_timeout
        self.slots = loader.slots
        self.layout = payload_layout(loader.maker)
        self.payload_bytes = self.layout.nbytes
        self.request = stream_request(loader.stream_spec, self.layout, loader.producer_threads,
                                      loader.cache_bytes)
        self.cache_nodes = {}       # node -> the largest counters its producers reported
        self.stream_spec = loader.stream_spec
        self.host_threads = loader.host_threads if self.takeover else 0
        self.num_threads = loader.num_threads
        self.first_maker = loader.maker
        self.makers = ()
        #: {sample index: message} of bad samples the producers reported.
        self.remote_bad = {}
        self.received = RemoteStats()
        self.stats_lock = threading.Lock()
        self.id = None
        self.open_replies = []
        self.pending = deque()      # (ticket, epoch, step) submitted, in order
        self.feed = None            # (epoch, step) to submit next
        self.held = None            # ticket the caller holds
        self.failed = None          # why the current iteration ended, if it failed
        self.threads = []
        self.stopping = []          # host threads told to stop by close(), maybe still making
        self.local_free = []
        self.local_done = queue.Queue()
        self.local = {}             # ticket -> local buffer, made or being made
        self.local_made = set()     # tickets of self.local already made

    def _ensure(self):
        if self.id is None:
            t = self.transport
            if self.slots > t.layout.buffers or self.payload_bytes > t.layout.slot_bytes:
                self.hostgroup.grow(self.slots, self.payload_bytes)
            self.id, self.open_replies = self.hostgroup.register(self.request)
            if self.out.device is not None:
                self.out.window = self.hostgroup.pinned_window(self.out, self.timeout)
        if self.host_threads and not self.threads:
            if any(th.is_alive() for th in self.stopping):
                raise PipeTimeout(f"a hybrid host thread of this loader did not stop within "
                                  f"{self.timeout:.0f} s (a batch still being made); try again")
            if not self.makers:     # kept across close(): their stats are the loader's
                more = [BatchMaker(self.stream_spec, self.num_threads)
                        for _ in range(self.host_threads - 1)]
                for m in more:
                    # One record of bad samples (dict updates are atomic under the GIL).
                    m.bad_samples = self.first_maker.bad_samples
                self.makers = (self.first_maker, *more)
            for m in self.makers:
                th = _HostThread(m, self.layout, self.local_done)
                th.start()
                self.threads.append(th)
            self.local_free.extend(np.zeros(self.payload_bytes, np.uint8)
                                   for _ in range(self.host_threads + 2))

    def start(self, epoch, step, end=None):
        with _TRANSPORT_LOCK:
            _check_not_exiting()
            self.failed = None
            self._ensure()
            self.hostgroup.activate(self)
            if self.pending and self.pending[0][1:] == (epoch, step):
                return
            self.suspend(release=False)
            # Active again, so that another loader starting later cancels these tickets.
            self.hostgroup.activate(self)
            self.feed = (epoch, step)

    def pause(self):
        pass    # the tickets ahead stay in flight: the next epoch usually continues there

    def _top_up(self):
        t = self.transport
        # Enough for every producer's queue and the host threads (more is wasted on a jump).
        ahead = self.slots + QUEUE * (t.size - 1) + self.host_threads
        while len(self.pending) < ahead:
            epoch, step = self.feed
            if step >= self.first_maker.batches_in(epoch):
                epoch, step = epoch + 1, 0
            self.pending.append((t.submit(self.id, epoch, step), epoch, step))
            self.feed = (epoch, step + 1)

    def _run_local(self):
        """Hybrid: hand tickets to idle host threads when the producers fall behind."""
        t = self.transport
        while True:
            try:
                ticket, buf, status, blob = self.local_done.get_nowait()
            except queue.Empty:
                break
            if ticket in self.local:
                self.local_made.add(ticket)
                if status == FAILED:
                    buf[:len(blob)] = np.frombuffer(blob, np.uint8)
                    t.deliver(ticket, buf[:len(blob)], FAILED)
                else:
                    head = wire.unpack(buf, wire.PAYLOAD_HEADER)
                    t.deliver(ticket, buf[:self.layout.end(head["n"],
                                                           self.layout.shape_of(head))], OK)
            else:
                self.local_free.append(buf)
        ready = sum(1 for tk, _, _ in self.pending if t.state(tk) == "ready")
        low = ready < self.slots // 2 + 1
        for th in self.threads:
            if th.busy or not self.local_free:
                continue
            if not (low or t.pool_size(local_only=True)):
                return
            taken = t.take(1)
            if not taken:
                return
            ticket, stream, epoch, step = taken[0]
            buf = self.local_free.pop()
            self.local[ticket] = buf
            th.busy = True
            th.todo.put((ticket, epoch, step, buf))

    def _next_data(self, epoch, step):
        if self.failed is not None:
            raise DpuPipeError(f"this iteration ended with an error at epoch {epoch} "
                               f"step {step}: {self.failed}; start a new one")
        with _TRANSPORT_LOCK:
            try:
                return self._next(epoch, step)
            except BaseException as exc:
                self.failed = f"{type(exc).__name__}: {exc}"
                self.suspend()
                raise

    def _next(self, epoch, step):
        t = self.transport
        if self.hostgroup.active is not self:
            # Another loader ran meanwhile and cancelled this one's work: continue from here.
            self.start(epoch, step)
        self._top_up()
        ticket, e, s = self.pending[0]
        if (e, s) != (epoch, step):
            raise DpuPipeError(f"stream out of step: next ticket is epoch {e} step {s}, "
                               f"expected epoch {epoch} step {step}")

        def between():
            if self.cancel is not None and self.cancel.is_set():
                raise Cancelled()
            _check_not_exiting()
            for r in self.open_replies:
                if r._done:
                    r.result(0)  # raises the producer's error opening the stream
            if self.threads:
                self._run_local()

        # Hybrid: the host's threads get their turn on every poll, so no naps.
        polls = t.polls
        d = t.wait(ticket, timeout=self.timeout, between=between, nap=not self.threads)
        self.received.host_polls += t.polls - polls
        self.pending.popleft()
        self.held = ticket
        # Grant the buffer just given back now, so producers fill it during the training step.
        t.poll()
        return self._unpack(d, epoch)

    def _unpack(self, d, epoch):
        payload = d.payload
        head = wire.unpack(payload, wire.PAYLOAD_HEADER)
        n = head["n"]
        shape = self.layout.shape_of(head)
        expected = self.first_maker.sample_shape_at(epoch)
        if shape != expected:
            raise DpuPipeError(f"producer {d.producer} sent epoch {epoch}'s batch with "
                               f"samples of shape {shape}; this stream's are {expected}")
        images, labels, indices = self.layout.views(payload, n, shape)
        for index, message in self.layout.report(payload, n, head["bad_bytes"],
                                                 shape).items():
            if index not in self.remote_bad:
                self.remote_bad[index] = message
                log.warning("producer %d skipped undecodable sample: %s", d.producer, message)
        r = self.received
        with self.stats_lock:       # stats() may read them from another thread
            r.bytes_received += payload.nbytes
            r.batches += 1
            r.steps_per_producer[d.producer] = r.steps_per_producer.get(d.producer, 0) + 1
            if d.producer:
                r.producer_read_s += head["read_ns"] * 1e-9
                r.producer_process_s += head["process_ns"] * 1e-9
                r.producer_publish_s += head["publish_ns"] * 1e-9
                r.producer_samples += n
            else:
                r.host_samples += n
            node = head["cache_node"]
            if node > 0:
                # Counters only grow: keep each one's largest, whichever producer sent it.
                seen = self.cache_nodes.get(node, (0,) * len(wire.CACHE_FIELDS))
                self.cache_nodes[node] = tuple(
                    max(a, head[f"cache_{k}"]) for a, k in zip(seen, wire.CACHE_FIELDS))
        return images, labels, indices

    def cache_stats(self):
        """The producers' node caches (``wire.CACHE_FIELDS``) as last reported, summed."""
        with self.stats_lock:
            nodes = list(self.cache_nodes.values())
        return {k: sum(c[i] for c in nodes) for i, k in enumerate(wire.CACHE_FIELDS)}

    def release_held(self):
        with _TRANSPORT_LOCK:
            if self.held is None:
                return
            # A device copy may still read the window slot: the producers get it back after.
            self.out.fence()
            ticket, self.held = self.held, None
            self.transport.release(ticket)
            buf = self.local.pop(ticket, None)
            if buf is not None:
                self.local_made.discard(ticket)
                self.local_free.append(buf)

    def suspend(self, release=True):
        """Cancel the tickets in flight (and, with ``release``, give back the held batch):
        the stream continues later from its loader's position."""
        with _TRANSPORT_LOCK:
            t = self.transport
            if t.closed:
                self.pending.clear()
                return
            if release:
                self.release_held()
            tickets = [tk for tk, _, _ in self.pending]
            t.cancel(tickets)
            # The buffers of host threads still making a cancelled ticket come back when done.
            for tk in tickets:
                buf = self.local.pop(tk, None)
                if tk in self.local_made:
                    self.local_made.discard(tk)
                    self.local_free.append(buf)
            self.pending.clear()
            self.hostgroup.deactivate(self)

    def close(self):
        with _TRANSPORT_LOCK:
            self.suspend()
            threads, self.threads = self.threads, []
            for th in threads:
                th.todo.put(None)
        # The next start() gives their makers to new threads (at exit they may be frozen).
        if sys.is_finalizing():
            return
        deadline = deadline_in(self.timeout)
        for th in threads:
            th.join(max(0.0, deadline - time.monotonic()))
        self.stopping = [th for th in threads if th.is_alive()]

    def busy(self, stats):
        return (stats["producer_read_s"] + stats["producer_process_s"],
                max(1, self.hostgroup.producers))

    def stats(self, made):
        """The makers' counters plus what arrived from the producers (:class:`RemoteStats`)."""
        d = made.as_dict()
        with self.stats_lock:
            d["samples"] += self.received.producer_samples
            d.update(self.received.as_dict())
        return d
