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
producers answer from handlers registered with :func:`dpu_pipe.offload.worker.handler`.

The stream is the local :class:`~dpu_pipe.Loader`'s, bit for bit: producers and host threads
run the same :class:`~dpu_pipe.steps.StepProducer`, and batches are yielded strictly in order.
"""

import dataclasses
import logging
import queue
import threading
from collections import deque

import numpy as np

from .. import _validate as _v
from ..errors import ConfigError, DpuPipeError
from ..loader import Loader, _Run
from ..steps import StepProducer, StepStats
from . import wire
from .group import HostGroup, _mpi_running, host_group, shutdown
from .transport import FAILED, OK, _pack_error
from .wire import QUEUE

# HostGroup, host_group and shutdown live in .group; named here as before.
__all__ = ["DPULoader", "HostGroup", "host_group", "shutdown", "MODES"]

log = logging.getLogger("dpu_pipe")

MODES = ("offload", "hybrid", "local")


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

    Producer memory: ``dpu_pipe.offload.worker.DEPTH`` (2) batches per producer rank plus
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
                 liveness_timeout=60.0, hostmap=None, **kwargs):
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(host_threads, bool) or not isinstance(host_threads, int) \
                or host_threads < (1 if mode == "hybrid" else 0):
            raise ConfigError(f"host_threads must be an integer >= 1 in hybrid mode, got "
                              f"{host_threads!r}")
        self._group = None
        self._stream = None
        if mode != "local" or comm is not None or _mpi_running():
            # In an MPI job the hosts start the host group whatever the mode, so shard defaults
            # agree across modes and the producers are released at exit.
            self._group = host_group(comm, hostmap=hostmap)
            rank = self._group.host_index if rank is None else rank
            world_size = self._group.num_hosts if world_size is None else world_size
        super().__init__(source, batch_size, rank=rank, world_size=world_size, **kwargs)
        self.slots = self.prefetch + 1 if slots is None else slots
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ConfigError(f"slots must be an integer >= 1, got {slots!r}")
        labels = self.producer.labels
        #: Byte layout of this loader's batches in the window (and in hybrid host threads).
        self.layout = wire.PayloadLayout(self.batch_size, self.transform.sample_shape,
                                         self.transform.np_dtype, labels.dtype,
                                         labels.shape[1:])
        self.producer_threads = _v.positive_int(producer_threads, "producer_threads")
        self.liveness_timeout = _v.seconds(liveness_timeout, "liveness_timeout")
        self.host_threads = int(host_threads)
        if self._group is not None:
            self._group.reserve(self.slots, self.payload_bytes)
            if mode != "local" and self._group.producers == 0:
                log.warning("DPULoader: no producer rank serves this host; producing locally")
                mode = "local"
        self.mode = mode
        #: What arrived through the host group (:class:`RemoteStats`).
        self.remote_stats = RemoteStats()
        # The StepProducers of hybrid host threads 2..N (the first thread runs
        # self.producer), kept across streams so that stats() counts their work.
        self._thread_producers = []

    def host_producer(self, k):
        """The :class:`~dpu_pipe.steps.StepProducer` of hybrid host thread ``k`` (0-based):
        the loader's own for the first, one more per further thread, sharing its record of
        bad samples."""
        if k == 0:
            return self.producer
        while len(self._thread_producers) < k:
            p = self.producer
            prod = StepProducer(
                p.source, p.batch_size, p.transform, seed=p.seed, shuffle=p.sampler.shuffle,
                rank=p.sampler.rank, world_size=p.sampler.world_size,
                shard_tail=p.sampler.shard_tail, drop_last=p.drop_last,
                num_threads=self.num_threads, on_error=p.on_error)
            # One record of bad samples for every host thread: the loader reports the
            # first producer's (dict updates are atomic under the GIL).
            prod.bad_samples = p.bad_samples
            self._thread_producers.append(prod)
        return self._thread_producers[k - 1]

    def _step_stats(self):
        total = self.producer.stats
        for prod in self._thread_producers:
            total = total + prod.stats
        return total + StepStats(samples=self.remote_stats.producer_samples)

    def spec(self):
        """What producers need to make this loader's stream (JSON-serialisable)."""
        p = self.producer
        return {"version": wire.SPEC_VERSION, "source": self.source.spec(),
                "batch_size": self.batch_size, "transform": self.transform.to_dict(),
                "seed": p.seed, "shuffle": p.sampler.shuffle, "rank": p.sampler.rank,
                "world_size": p.sampler.world_size, "shard_tail": p.sampler.shard_tail,
                "drop_last": p.drop_last, "labels": self.layout.labels(),
                "on_error": p.on_error, "num_threads": self.producer_threads}

    @property
    def payload_bytes(self):
        """Bytes of one batch payload: header, indices, labels, images, bad-sample report
        (see :class:`~dpu_pipe.offload.wire.PayloadLayout`)."""
        return self.layout.nbytes

    def _make_run(self, epoch, start):
        if self.mode == "local":
            return super()._make_run(epoch, start)
        if self._stream is None:
            self._stream = _Stream(self)
        return _RemoteRun(self, epoch, start)

    def suspend(self):
        """Cancel this loader's work in flight and give back the batch its caller holds
        (the host group does this when another loader becomes active)."""
        if self._stream is not None:
            self._stream.suspend()

    def close(self):
        """Stop this loader's work and release its buffers (the producers keep serving the
        process's other loaders until it exits, or :func:`shutdown`). Idempotent."""
        super().close()
        if getattr(self, "_stream", None) is not None:
            self._stream.close()
            self._stream = None

    @property
    def bad_samples(self):
        bad = dict(self.producer.bad_samples)
        bad.update(self.remote_stats.bad)
        return bad

    def stats(self):
        """Loader counters plus, in offload and hybrid modes: bytes received, the producers'
        read/decode+augment/publish seconds, batches per producer rank (0: host threads),
        and samples made by each side (``producer_samples``, ``host_samples``), and the
        window polls made while waiting for batches (``host_polls``; each costs the host
        ~30-60 us of CPU, and a host waiting for a producer sleeps through most of its batch
        time instead of polling)."""
        d = super().stats()
        if self.mode != "local":
            r = self.remote_stats
            d.update(bytes_received=r.bytes, batches=r.batches,
                     producer_read_s=r.read_s, producer_process_s=r.process_s,
                     producer_publish_s=r.publish_s,
                     steps_per_producer={str(k): v for k, v in r.per_producer.items()},
                     producer_samples=r.producer_samples, host_samples=r.host_samples,
                     host_polls=r.polls)
        return d


@dataclasses.dataclass
class RemoteStats:
    """Counters of the batches a :class:`DPULoader` received through its host group: payload
    bytes, batches, per group rank (0: host threads); the producers' read, decode+augment
    and publish seconds and samples (``producer_*``), the host threads' samples; window
    polls while waiting; and the bad samples producers reported ({index: message})."""

    bytes: int = 0
    batches: int = 0
    read_s: float = 0.0
    process_s: float = 0.0
    publish_s: float = 0.0
    producer_samples: int = 0
    host_samples: int = 0
    polls: int = 0
    per_producer: dict = dataclasses.field(default_factory=dict)
    bad: dict = dataclasses.field(default_factory=dict)

    def record_batch(self, producer, nbytes, head):
        """Count one delivered payload of ``nbytes`` from group rank ``producer`` whose
        header is ``head`` (:data:`~dpu_pipe.offload.wire.PAYLOAD_HEADER`)."""
        n = head["n"]
        self.bytes += nbytes
        self.batches += 1
        self.per_producer[producer] = self.per_producer.get(producer, 0) + 1
        if producer:
            self.read_s += head["read_ns"] * 1e-9
            self.process_s += head["process_ns"] * 1e-9
            self.publish_s += head["publish_ns"] * 1e-9
            self.producer_samples += n
        else:
            self.host_samples += n

    def record_bad(self, producer, report):
        """Note the bad samples of a producer's ``report`` ({index: message}) not seen
        before, logging each once."""
        for index, message in report.items():
            if index not in self.bad:
                self.bad[index] = message
                log.warning("producer %d skipped undecodable sample: %s", producer, message)


class _LocalMaker(threading.Thread):
    """A host thread of hybrid mode: makes tickets into its own payload-shaped buffers."""

    def __init__(self, loader, producer, free, done):
        super().__init__(name="dpu_pipe-hybrid", daemon=True)
        self.producer = producer
        self.layout = loader.layout
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
                st = self.producer.stats
                r0, p0 = st.read_s, st.process_s
                n = self.producer.produce(epoch, step, images, labels, indices)
                self.layout.write_header(buf, n=n, read_ns=round((st.read_s - r0) * 1e9),
                                         process_ns=round((st.process_s - p0) * 1e9))
                self.done.put((ticket, buf, OK, None))
            except Exception as exc:  # noqa: BLE001 - raised in the consumer for that step
                self.done.put((ticket, buf, FAILED, _pack_error(exc, None, 1 << 20,
                                                                "a host thread")))
            finally:
                self.busy = False


class _Stream:
    """A loader's place in its host group: its stream id, the tickets it has in flight (in
    order), the batch the caller holds, and in hybrid mode the host threads."""

    def __init__(self, loader):
        self.loader = loader
        self.hostgroup = loader._group
        self.transport = self.hostgroup.transport
        self.id = None
        self.spec_replies = []
        self.pending = deque()      # (ticket, epoch, step) submitted, in order
        self.feed = None            # (epoch, step) to submit next
        self.held = None            # ticket (or local buffer) the caller holds
        self.makers = []
        self.local_free = []
        self.local_done = queue.Queue()
        self.local = {}             # ticket -> local buffer, made or being made
        self.local_made = set()     # tickets of self.local already made

    # -- set-up -----------------------------------------------------------------------------
    def _ensure(self):
        loader = self.loader
        if self.transport is not None and self.id is None:
            t = self.transport
            if loader.slots > t.layout.buffers or loader.payload_bytes > t.layout.slot_bytes:
                self.hostgroup.grow(loader.slots, loader.payload_bytes)
            self.id, self.spec_replies = self.hostgroup.register(loader.spec())
            if loader.out.device is not None:
                loader.out.window = self.hostgroup.pinned_window(loader)
        if loader.mode == "hybrid" and not self.makers:
            for k in range(loader.host_threads):
                m = _LocalMaker(loader, loader.host_producer(k), self.local_free,
                                self.local_done)
                m.start()
                self.makers.append(m)
            self.local_free.extend(np.zeros(loader.payload_bytes, np.uint8)
                                   for _ in range(loader.host_threads + 2))

    def _check_specs(self):
        for r in self.spec_replies:
            if r._done:
                r.result(0)  # raises the producer's error opening the pipeline

    # -- flow -------------------------------------------------------------------------------
    def start(self, epoch, step):
        """Position the stream at ``(epoch, step)``: keep the tickets in flight when they
        continue from there, else cancel them."""
        self._ensure()
        self.hostgroup.activate(self.loader)
        if self.pending and self.pending[0][1:] == (epoch, step):
            return
        self.suspend(keep_held=True)
        # suspend() leaves no stream active; this one is, or another loader starting later
        # would not cancel the tickets submitted from here on.
        self.hostgroup.activate(self.loader)
        self.feed = (epoch, step)

    def _top_up(self):
        t, loader = self.transport, self.loader
        # Enough for every producer's queue and the host threads; more would only be
        # cancelled work when the stream jumps.
        ahead = loader.slots + QUEUE * (t.size - 1 if t else 0) + loader.host_threads
        while len(self.pending) < ahead:
            epoch, step = self.feed
            if step >= len(loader):
                epoch, step = epoch + 1, 0
            ticket = t.submit(self.id, epoch, step) if t else None
            self.pending.append((ticket, epoch, step))
            self.feed = (epoch, step + 1)

    def _run_local(self):
        """Hybrid: hand tickets to idle host threads when the producers fall behind."""
        t, loader = self.transport, self.loader
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
                    t.deliver(ticket, buf[:loader.layout.end(head["n"])], OK)
            else:
                self.local_free.append(buf)
        ready = sum(1 for tk, _, _ in self.pending if t.state(tk) == "ready")
        low = ready < loader.slots // 2 + 1
        for m in self.makers:
            if m.busy or not self.local_free:
                continue
            if not (low or t.pool_size(local_only=True)):
                return
            taken = t.take(1)
            if not taken:
                return
            ticket, stream, epoch, step = taken[0]
            buf = self.local_free.pop()
            self.local[ticket] = buf
            m.busy = True
            m.todo.put((ticket, epoch, step, buf))

    def next(self, epoch, step):
        """The batch for ``(epoch, step)`` as (images, labels, indices), waiting with the
        loader's deadline."""
        loader, t = self.loader, self.transport
        if self.hostgroup.active is not self.loader:
            # Another loader ran meanwhile and cancelled this one's work: continue from here.
            self.start(epoch, step)
        self._top_up()
        ticket, e, s = self.pending[0]
        if (e, s) != (epoch, step):
            raise DpuPipeError(f"stream out of step: next ticket is epoch {e} step {s}, "
                               f"expected epoch {epoch} step {step}")

        def between():
            self._check_specs()
            if self.makers:
                self._run_local()

        # Hybrid: the host's threads get their turn on every poll, so no naps.
        polls = t.polls
        d = t.wait(ticket, timeout=loader.timeout, between=between, nap=not self.makers)
        loader.remote_stats.polls += t.polls - polls
        self.pending.popleft()
        self.held = ticket
        # Grant the buffer just given back before the caller's training step, so producers
        # fill it meanwhile without waiting for the next call.
        t.poll()
        return self._unpack(d)

    def _unpack(self, d):
        loader = self.loader
        payload = d.payload
        head = wire.unpack(payload, wire.PAYLOAD_HEADER)
        n = head["n"]
        images, labels, indices = loader.layout.views(payload, n)
        stats = loader.remote_stats
        stats.record_bad(d.producer, loader.layout.report(payload, n, head["bad_bytes"]))
        stats.record_batch(d.producer, payload.nbytes, head)
        return images, labels, indices

    def release_held(self):
        """Give back the buffer of the batch the caller holds (the one release path: the
        loader's iterator calls it when the next batch is requested)."""
        if self.held is not None:
            # A device copy may still read the batch from its window slot: the producers
            # get the slot back only once it is done.
            self.loader.out.fence()
            ticket, self.held = self.held, None
            self.transport.release(ticket)
            buf = self.local.pop(ticket, None)
            if buf is not None:
                self.local_made.discard(ticket)
                self.local_free.append(buf)

    def suspend(self, keep_held=False):
        """Cancel the tickets in flight (and, unless ``keep_held``, give back the held
        batch): the stream continues later from its loader's position."""
        t = self.transport
        if t is None or t.closed:
            self.pending.clear()
            return
        if not keep_held:
            self.release_held()
        tickets = [tk for tk, _, _ in self.pending]
        t.cancel(tickets)
        # Buffers of host threads still making a cancelled ticket come back when they finish.
        for tk in tickets:
            buf = self.local.pop(tk, None)
            if tk in self.local_made:
                self.local_made.discard(tk)
                self.local_free.append(buf)
        self.pending.clear()
        if self.hostgroup.active is self.loader:
            self.hostgroup.active = None

    def close(self):
        self.suspend()
        for m in self.makers:
            m.todo.put(None)
        self.makers = []


class _RemoteRun(_Run):
    """The remote engine: batches from the host group's producers (and hybrid host threads)."""

    def __init__(self, loader, epoch, start):
        super().__init__(loader, epoch, start)
        self.stream = loader._stream
        self.failed = None
        self.stream.start(epoch, start)

    def _next_data(self):
        if self.failed is not None:
            raise DpuPipeError(f"this iteration ended with an error at epoch {self.epoch} "
                               f"step {self.next_step}: {self.failed}; start a new one")
        try:
            return self.stream.next(self.epoch, self.next_step)
        except BaseException as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            self.stream.suspend()
            raise

    def _release_held(self):
        # The held batch is the stream's, not this run's: the last batch of an epoch
        # outlives its loop and is given back when the next run asks for a batch.
        self.stream.release_held()

    def close(self):
        # The tickets in flight are the stream's: the next run continues with them when it
        # starts where this one stopped (the loader cancels them when it moves elsewhere).
        pass
