"""DPULoader: batches made by producer ranks (DPU cores) — and, in hybrid mode, by this
host's threads too — delivered into this host's memory over MPI one-sided RMA.

Launch (one machine)::

    mpiexec -n 1 python -m mpi4py train.py : -n 2 python -m mpi4py -m dpu_pipe.worker

and on a cluster, hosts and DPUs as separate machines (MPMD)::

    mpiexec -hosts node1,node2 -n 2 python -m mpi4py train.py \\
          : -hosts node1-dpu,node2-dpu -n 16 python -m mpi4py -m dpu_pipe.worker

The first DPULoader of a host process starts its *host group* (collective over the hosts and
producers of the job: roles, one window, once): see :mod:`dpu_pipe.offload.roles` for who
serves whom and :mod:`dpu_pipe.offload.transport` for the protocol. Every loader of the
process is a *stream* of that host group: its pipeline spec goes to the producers once, then its
epochs, ``set_epoch`` jumps, ``load_state_dict`` resumes are just the tickets it submits. One
stream is active at a time; iterating another loader cancels the work the previous one had
in flight (re-made when it continues). The producers serve the host until its process exits
(or :func:`shutdown`); an exception that ends the host ends the job (``python -m mpi4py``).

Request channel for other work (validation, say): :func:`host_group` gives the host's
:class:`HostGroup`; ``host_group().transport.request(kind, payload, to=None)`` sends a request to
one or every producer and returns :class:`~dpu_pipe.offload.transport.Reply` objects, which
producers answer from handlers registered with :func:`dpu_pipe.offload.producer_loop.handler`.

The stream is the local :class:`~dpu_pipe.Loader`'s, bit for bit: producers and host threads
run the same :class:`~dpu_pipe.batch.BatchMaker` built from the loader's
:class:`~dpu_pipe.spec.StreamSpec`, and batches are yielded strictly in order.

The engine of the offloaded modes is :class:`OffloadEngine` (the
:class:`~dpu_pipe.loader.Engine` contract): the host group knows engines, not loaders — it
activates one, suspends the previous one and asks the active one to give back its held batch
before it remakes the window.
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

from .. import _validate as _v
from ..deadline import deadline_in
from ..errors import ConfigError, DpuPipeError, PipeTimeout
from ..loader import Cancelled, Engine, Loader
from ..sources import check_spec
from ..batch import BatchMaker
from . import rendezvous, wire
from .group import HostGroup, _mpi_running, host_group, shutdown
from .transport import FAILED, OK, pack_error
from .wire import QUEUE

# HostGroup, host_group and shutdown live in .group; named here as before.
__all__ = ["DPULoader", "HostGroup", "host_group", "shutdown", "MODES"]

log = logging.getLogger("dpu_pipe")

MODES = ("offload", "hybrid", "local")

#: Held by whatever drives the host group's transport (one per process): the engines of two
#: loaders iterated in two threads take turns on it instead of driving it at once.
_TRANSPORT_LOCK = threading.RLock()
#: Set at interpreter exit, before the host group releases its producers: from then on no
#: thread starts driving the transport (a daemon thread still iterating gets ConfigError).
_EXITING = threading.Event()
#: Seconds the exit handler waits for a thread to let go of the transport.
_EXIT_WAIT = 30.0
_exit_hooked = set()         # ids of the host groups and transports the handler runs before


def _hook_exit(obj):
    """Run :func:`_take_transport_at_exit` before the exit handler ``obj`` (a host group or
    its transport) registered when it was made: atexit runs the later registered first."""
    if obj is not None and id(obj) not in _exit_hooked:
        _exit_hooked.add(id(obj))
        atexit.register(_take_transport_at_exit)


def _take_transport_at_exit():
    """Runs at interpreter exit, before the host group and its transport shut down: threads
    still iterating DPULoaders (daemon threads) let go of the transport within one poll,
    and the exiting thread keeps it, so the shutdown (which frees the window) never runs
    while another thread reads the window. Idempotent."""
    _EXITING.set()
    if not _TRANSPORT_LOCK.acquire(timeout=_EXIT_WAIT):
        log.warning("dpu_pipe: a thread kept the host window busy at exit")


def _check_not_exiting():
    if _EXITING.is_set():
        raise ConfigError("the interpreter is exiting: the host group is releasing its "
                          "producers, and no DPULoader makes batches any more")



class DPULoader(Loader):
    """:class:`~dpu_pipe.Loader` whose batches are made by producer ranks.

    Same arguments and behaviour as :class:`~dpu_pipe.Loader` (``len``, ``set_epoch``,
    ``state_dict``/``load_state_dict``, ``on_error``, torch output, the source's labels
    whatever their dtype and shape, ``return_meta``; a yielded batch stays valid until the
    next one is requested, also after the loop that ended an epoch), plus:

    Parameters
    ----------
    comm : mpi4py communicator, optional
        The job's communicator holding hosts and producers (default ``COMM_WORLD``). The
        first DPULoader of a process starts the host group: collective over ``comm``.
    mode : "offload", "hybrid" or "local"
        ``"offload"``: producers make the batches (this host's threads when it has no
        producer, with a warning). ``"hybrid"``: producers and ``host_threads`` host threads
        take work from the same ticket pool; the host threads take work only when the
        producers fall behind (fewer than ``slots // 2 + 1`` batches ready), and take over
        the work of a producer that falls silent. ``"local"``: this host's threads only,
        as :class:`~dpu_pipe.Loader`.
    host_threads : int
        Threads making batches on the host in hybrid mode (default 1). Each holds its own
        batch buffer: host memory grows by ``(host_threads + 2) × batch bytes``.
    rank, world_size : int, optional
        Shard of this host; default: its index among the host ranks and their count.
    slots : int, optional
        Batch buffers in the host's window (default ``prefetch + 1``): host memory for
        offloaded batches is ``slots × batch bytes``. The window is sized by the first
        DPULoader of the process (the largest of its slots and batch bytes seen so far when
        a later loader needs more: then it is made again, a collective with the producers).
    producer_threads : int
        Threads of each producer's batch kernel (keep 1 when producer ranks share a DPU).
    liveness_timeout : float
        Seconds without a producer's heartbeat after which it counts as silent: offload mode
        raises :class:`PipeTimeout` naming it; hybrid mode takes over its work.
    hostmap : str, optional
        ``"host:producer,..."`` hostname pairs, overriding ``DPU_PIPE_HOSTMAP`` and matching
        by name (see :mod:`dpu_pipe.offload.roles`). Used when the host group starts.
    serve_file : str or path, optional
        Join the producers of a job of their own (``python -m dpu_pipe.worker --serve
        FILE``) through the port they published in this file, instead of producer ranks of
        this MPI job — for hosts started by ``torchrun`` (default: ``DPU_PIPE_SERVE``; see
        :mod:`dpu_pipe.offload.rendezvous`). Each host is torch's ``RANK`` of ``WORLD_SIZE``.

    Producer memory: ``dpu_pipe.offload.producer_loop.DEPTH`` (2) batches per producer rank plus
    its decoder's scratch.

    With an accelerator ``device``, the window is registered as pinned memory
    (``cudaHostRegister``) and a batch made by a producer is copied to the device straight
    from its window slot; the slot is given back once that copy has completed. Without
    registration (refused, or a torch without ``torch.cuda.cudart``) batches go through
    pinned staging buffers, as with :class:`~dpu_pipe.Loader`; ``stats()["device_path"]``
    says which (see :mod:`dpu_pipe.device`).
    """

    def __init__(self, source, batch_size, *, comm=None, mode="offload", host_threads=1,
                 rank=None, world_size=None, slots=None, producer_threads=1,
                 liveness_timeout=60.0, hostmap=None, serve_file=None, **kwargs):
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(host_threads, bool) or not isinstance(host_threads, int) \
                or host_threads < (1 if mode == "hybrid" else 0):
            raise ConfigError(f"host_threads must be an integer >= 1 in hybrid mode, got "
                              f"{host_threads!r}")
        self._group = None
        serve = rendezvous.serve_file(serve_file) if comm is None else None
        if mode != "local" or comm is not None or serve is not None or _mpi_running():
            # In an MPI job the hosts start the host group whatever the mode, so shard defaults
            # agree across modes and the producers are released at exit.
            self._group = host_group(comm, hostmap=hostmap, serve_file=serve)
            _hook_exit(self._group)
            if self._group.roles.producers or self._group.num_hosts > 1:
                rank = self._group.host_index if rank is None else rank
                world_size = self._group.num_hosts if world_size is None else world_size
            # else an MPI job of this process alone (torchrun, plain python): the shard
            # comes from torch.distributed, as for Loader.
        super().__init__(source, batch_size, rank=rank, world_size=world_size, **kwargs)
        if mode != "local":
            # Producers rebuild the source from its spec: one that would not rebuild is
            # refused here, on the host, before any producer tries.
            check_spec(self.source)
        self.slots = self.prefetch + 1 if slots is None else slots
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ConfigError(f"slots must be an integer >= 1, got {slots!r}")
        #: Byte layout of this loader's batches in the window (and in hybrid host threads);
        #: labels as the batch ops leave them (float32 (num_classes,) rows when mixing).
        self.layout = wire.PayloadLayout(self.batch_size, self.transform.sample_shape,
                                         self.transform.np_dtype, self.maker.label_dtype,
                                         self.maker.label_shape)
        self.producer_threads = _v.positive_int(producer_threads, "producer_threads")
        self.liveness_timeout = _v.seconds(liveness_timeout, "liveness_timeout")
        self.host_threads = int(host_threads)
        if self._group is not None:
            self._group.reserve(self.slots, self.payload_bytes)
            if mode == "offload" and not self._group.roles.producers:
                # torchrun, or a plain python: each process is an MPI job of its own.
                raise ConfigError(
                    f"DPULoader(mode='offload'): this MPI job has no producer rank "
                    f"({self._group.num_hosts} host rank(s) and nothing else; a process "
                    f"started by torchrun or plain python is an MPI job of one). Launch hosts "
                    f"and producers as one MPMD job: mpiexec -n HOSTS python -m mpi4py "
                    f"train.py : -n PRODUCERS python -m mpi4py -m dpu_pipe.worker — or use "
                    f"mode='hybrid' or 'local' to produce on this host")
            if mode != "local" and self._group.producers == 0:
                log.warning("DPULoader: no producer rank serves this host; producing locally")
                mode = "local"
        self.mode = mode

    def _new_engine(self):
        if self.mode == "local":
            return super()._new_engine()
        return OffloadEngine(self)

    def _after_fork(self):
        if self.mode != "local":
            raise ConfigError(
                f"DPULoader(mode={self.mode!r}) used in a process forked from the one that "
                f"made it: the host window and the producers belong to the MPI process that "
                f"joined them. Use it in that process only (a DataLoader over it needs "
                f"num_workers=0), or make a Loader in the child")
        super()._after_fork()

    def spec(self):
        """What producers need to make this loader's stream (JSON-serialisable): the
        :class:`~dpu_pipe.spec.StreamSpec` on the wire, the label layout and the threads of
        each producer's kernel."""
        d = {"version": wire.SPEC_VERSION}
        d.update(self.stream_spec.to_wire())
        d.update(labels=self.layout.labels(), num_threads=self.producer_threads)
        return d

    @property
    def payload_bytes(self):
        """Bytes of one batch payload: header, indices, labels, images, bad-sample report
        (see :class:`~dpu_pipe.offload.wire.PayloadLayout`)."""
        return self.layout.nbytes

    def _busy(self, stats):
        if self.mode == "local":
            return super()._busy(stats)
        # Before the first iteration (no engine yet) nothing was received.
        return (stats.get("producer_read_s", 0.0) + stats.get("producer_process_s", 0.0),
                max(1, self._group.producers))

    def stats(self, interval=False):
        """Loader counters plus, in offload and hybrid modes: bytes received, the producers'
        read/decode+augment/publish seconds, batches per producer rank (0: host threads),
        and samples made by each side (``producer_samples``, ``host_samples``), and the
        window polls made while waiting for batches (``host_polls``; each costs the host
        ~30-60 us of CPU, and a host waiting for a producer sleeps through most of its batch
        time instead of polling)."""
        return super().stats(interval)


@dataclass
class RemoteStats:
    """What an :class:`OffloadEngine` received: payload bytes and batches, the producers'
    reported seconds, batches per producer rank (0: host threads), samples by side, and the
    window polls made while waiting."""

    bytes: int = 0
    batches: int = 0
    read_s: float = 0.0
    process_s: float = 0.0
    publish_s: float = 0.0
    per_producer: dict = field(default_factory=dict)
    host_samples: int = 0
    producer_samples: int = 0
    polls: int = 0

    def as_dict(self):
        return {"bytes_received": self.bytes, "batches": self.batches,
                "producer_read_s": self.read_s, "producer_process_s": self.process_s,
                "producer_publish_s": self.publish_s,
                "steps_per_producer": {str(k): v for k, v in self.per_producer.items()},
                "producer_samples": self.producer_samples, "host_samples": self.host_samples,
                "host_polls": self.polls}


class _HostThread(threading.Thread):
    """A host thread of hybrid mode: makes tickets with its own BatchMaker into its own
    payload-shaped buffers."""

    def __init__(self, maker, layout, free, done):
        super().__init__(name="dpu_pipe-hybrid", daemon=True)
        self.maker = maker
        self.layout = layout
        self.todo = queue.Queue()
        self.free, self.done = free, done
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
                                         process_ns=round((st.process_s - p0) * 1e9))
                self.done.put((ticket, buf, OK, None))
            except Exception as exc:  # noqa: BLE001 - raised in the consumer for that step
                self.done.put((ticket, buf, FAILED, pack_error(exc, None, 1 << 20,
                                                                "a host thread")))
            finally:
                self.busy = False


class OffloadEngine(Engine):
    """The engine of the offloaded modes: a loader's stream in its host group — its stream
    id, the tickets it has in flight (in order), the batch the caller holds, what it
    received, and in hybrid mode the host threads.

    Tickets run ahead of the caller, across epoch ends: :meth:`pause` keeps them, and
    :meth:`start` keeps them when the iteration continues where they stand (else cancels
    them). Memory: the window's slots (shared by the process's loaders) and, in hybrid
    mode, ``host_threads + 2`` payload buffers.
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
        self.layout = loader.layout
        self.payload_bytes = loader.payload_bytes
        self.wire_spec = loader.spec()
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
        self.spec_replies = []
        self.pending = deque()      # (ticket, epoch, step) submitted, in order
        self.feed = None            # (epoch, step) to submit next
        self.held = None            # ticket (or local buffer) the caller holds
        self.failed = None          # why the current iteration ended, if it failed
        self.threads = []
        self.stopping = []          # host threads told to stop by close(), maybe still making
        self.local_free = []
        self.local_done = queue.Queue()
        self.local = {}             # ticket -> local buffer, made or being made
        self.local_made = set()     # tickets of self.local already made

    # -- set-up -----------------------------------------------------------------------------
    def _ensure(self):
        if self.transport is not None and self.id is None:
            t = self.transport
            if self.slots > t.layout.buffers or self.payload_bytes > t.layout.slot_bytes:
                self.hostgroup.grow(self.slots, self.payload_bytes)
            self.id, self.spec_replies = self.hostgroup.register(self.wire_spec)
            if self.out.device is not None:
                self.out.window = self.hostgroup.pinned_window(self.out, self.timeout)
        if self.host_threads and not self.threads:
            if any(th.is_alive() for th in self.stopping):
                raise PipeTimeout(f"a hybrid host thread of this loader did not stop within "
                                  f"{self.timeout:.0f} s (a batch still being made); try again")
            if not self.makers:     # kept across close(): their stats are the loader's
                makers = [self.first_maker] + [BatchMaker(self.stream_spec, self.num_threads)
                                               for _ in range(self.host_threads - 1)]
                for m in makers[1:]:
                    # One record of bad samples for every host thread (dict updates are
                    # atomic under the GIL).
                    m.bad_samples = self.first_maker.bad_samples
                self.makers = tuple(makers)
            for m in self.makers:
                th = _HostThread(m, self.layout, self.local_free, self.local_done)
                th.start()
                self.threads.append(th)
            self.local_free.extend(np.zeros(self.payload_bytes, np.uint8)
                                   for _ in range(self.host_threads + 2))

    def _check_specs(self):
        for r in self.spec_replies:
            if r._done:
                r.result(0)  # raises the producer's error opening the pipeline

    # -- flow -------------------------------------------------------------------------------
    def start(self, epoch, step, end):
        """Position the stream at ``(epoch, step)``: keep the tickets in flight when they
        continue from there, else cancel them."""
        with _TRANSPORT_LOCK:
            self._start(epoch, step)

    def _start(self, epoch, step):
        _check_not_exiting()
        self.failed = None
        self._ensure()
        self.hostgroup.activate(self)
        if self.pending and self.pending[0][1:] == (epoch, step):
            return
        self.suspend(release=False)
        # suspend() leaves no stream active; this one is, or another loader starting later
        # would not cancel the tickets submitted from here on.
        self.hostgroup.activate(self)
        self.feed = (epoch, step)

    def pause(self):
        pass    # the tickets ahead stay in flight: the next epoch usually continues there

    def _top_up(self):
        t = self.transport
        # Enough for every producer's queue and the host threads; more would only be
        # cancelled work when the stream jumps.
        ahead = self.slots + QUEUE * (t.size - 1 if t else 0) + self.host_threads
        while len(self.pending) < ahead:
            epoch, step = self.feed
            if step >= self.first_maker.batches_in(epoch):
                epoch, step = epoch + 1, 0
            ticket = t.submit(self.id, epoch, step) if t else None
            self.pending.append((ticket, epoch, step))
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
                    t.deliver(ticket, buf[:self.layout.end(head["n"])], OK)
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
            self._start(epoch, step)
        self._top_up()
        ticket, e, s = self.pending[0]
        if (e, s) != (epoch, step):
            raise DpuPipeError(f"stream out of step: next ticket is epoch {e} step {s}, "
                               f"expected epoch {epoch} step {step}")

        def between():
            if self.cancel is not None and self.cancel.is_set():
                raise Cancelled()
            _check_not_exiting()
            self._check_specs()
            if self.threads:
                self._run_local()

        # Hybrid: the host's threads get their turn on every poll, so no naps.
        polls = t.polls
        d = t.wait(ticket, timeout=self.timeout, between=between, nap=not self.threads)
        self.received.polls += t.polls - polls
        self.pending.popleft()
        self.held = ticket
        # Grant the buffer just given back before the caller's training step, so producers
        # fill it meanwhile without waiting for the next call.
        t.poll()
        return self._unpack(d)

    def _unpack(self, d):
        payload = d.payload
        head = wire.unpack(payload, wire.PAYLOAD_HEADER)
        n = head["n"]
        images, labels, indices = self.layout.views(payload, n)
        for index, message in self.layout.report(payload, n, head["bad_bytes"]).items():
            if index not in self.remote_bad:
                self.remote_bad[index] = message
                log.warning("producer %d skipped undecodable sample: %s", d.producer, message)
        r = self.received
        with self.stats_lock:       # stats() may read them from another thread
            r.bytes += payload.nbytes
            r.batches += 1
            r.per_producer[d.producer] = r.per_producer.get(d.producer, 0) + 1
            if d.producer:
                r.read_s += head["read_ns"] * 1e-9
                r.process_s += head["process_ns"] * 1e-9
                r.publish_s += head["publish_ns"] * 1e-9
                r.producer_samples += n
            else:
                r.host_samples += n
        return images, labels, indices

    def release_held(self):
        with _TRANSPORT_LOCK:
            self._release_held()

    def _release_held(self):
        if self.held is not None:
            # A device copy may still read the batch from its window slot: the producers
            # get the slot back only once it is done.
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
            self._suspend(release)

    def _suspend(self, release):
        t = self.transport
        if t is None or t.closed:
            self.pending.clear()
            return
        if release:
            self._release_held()
        tickets = [tk for tk, _, _ in self.pending]
        t.cancel(tickets)
        # Buffers of host threads still making a cancelled ticket come back when they finish.
        for tk in tickets:
            buf = self.local.pop(tk, None)
            if tk in self.local_made:
                self.local_made.discard(tk)
                self.local_free.append(buf)
        self.pending.clear()
        self.hostgroup.deactivate(self)

    def close(self):
        with _TRANSPORT_LOCK:
            self._suspend(True)
            threads, self.threads = self.threads, []
            for th in threads:
                th.todo.put(None)
        # The next start() gives the same makers to new threads: these must have let go of
        # them (a maker's kernel is for one thread at a time). At interpreter exit daemon
        # threads may be frozen for good: no join then.
        if sys.is_finalizing():
            return
        deadline = deadline_in(self.timeout)
        for th in threads:
            th.join(max(0.0, deadline - time.monotonic()))
        self.stopping = [th for th in threads if th.is_alive()]

    def stats(self, made):
        d = made.as_dict()
        with self.stats_lock:
            d["samples"] += self.received.producer_samples
            d.update(self.received.as_dict())
        return d
