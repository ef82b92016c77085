"""One-sided MPI transport between a host (rank 0 of a host group) and its producer ranks.

One window per host group, made once at start-up and kept for the job (or the loader's)
lifetime; everything after start-up is ``Put``, ``Flush`` and non-blocking point-to-point
messages, so no wait ever depends on a collective, and every wait has a deadline.

Protocol (record layouts in :mod:`dpu_pipe.offload.wire`):

* Work is numbered by *tickets* 0, 1, 2, ... in the order the host submits
  ``(stream, epoch, step)`` items. The host *assigns* tickets, lowest first, to producers
  that have room in their queue of :data:`~wire.QUEUE` entries, by a ``Put`` of an ``ASSIGN``
  record into the producer's own window. The producer starts making the batch at once, into
  its own memory (``depth`` batches ahead: produce-ahead-then-Put), so every producer stays
  busy whatever the number of host buffers.
* The host *grants* its free batch buffers to the lowest assigned tickets by writing the
  buffer index and a unique grant id into the same ``ASSIGN`` record. A producer holding a
  made batch whose entry shows a grant ``Put``\\ s the payload, ``Flush``\\ es, then ``Put``\\ s
  the sealed ``BUFFER_HEADER`` (grant id, ticket, epoch, step, sizes) and flushes again. The
  host reads the header from its own memory: intact (check word) and carrying the grant it
  issued means the payload is complete — the Flush orders the two writes.
* Producers report in their ``STATUS`` record of the host window: heartbeat, and ``done``
  (every assignment below it is finished or dropped); the host refills their queues from it
  and frees buffers of cancelled grants only once the producer passed them.
* The host cancels tickets (a new epoch, ``set_epoch``, another loader) by rewriting their
  entries as ``CANCELLED``; producers drop them, before or after making them.
* Requests of any other kind (pipeline specs, pings, validation work) travel as pickled
  point-to-point messages: see :meth:`HostTransport.request` and
  :mod:`dpu_pipe.offload.worker`.

Progress: the producers only write into the host's memory with ``Put`` and read their own;
the host only writes into producers' memory. None of it needs the *target* to call MPI when
the fabric does RMA in hardware or through shared memory (UCX over InfiniBand/RoCE — the
BlueField case — or MPICH with ``MPIR_CVAR_NOLOCAL=1``, measured), so a host busy in a long
GIL-holding C call does not stall its producers, and no progress thread is needed. Over a
transport that emulates RMA in software (UCX over TCP) deliveries wait for the host's next
call into MPI.

Liveness: a producer whose heartbeat stays still for ``liveness_timeout`` is *silent*. The
host either raises :class:`PipeTimeout` naming it (offload) or, when asked to take over
(hybrid), retires it: its tickets go back to the pool for the host's own threads, and every
buffer it was granted is quarantined for the rest of the run, so a stopped producer that
wakes up later (it still has ``Put`` access) writes only into memory nobody reads.

Shutdown: :meth:`HostTransport.close` writes ``stop`` into every producer's control record,
waits (deadline) until each reports it stopped, then frees the window collectively behind a
non-blocking barrier with a deadline. With a silent producer the window cannot be freed; the
host then ends the job with ``MPI_Abort`` at interpreter exit (a stopped rank never
finalizes, and ``mpiexec`` would wait for it forever).
"""
import atexit
import logging
import os
import pickle
import socket
import sys
import time

import numpy as np

from ..deadline import Backoff, deadline_in, poll_until
from ..errors import ConfigError, DecodeError, PipeTimeout, ProducerError, error_record
from ..mpi import load_mpi, wait_request
from . import wire
from .scheduler import LOCAL, Scheduler
from .wire import (ASSIGN, BUFFER_HEADER, CANCELLED, CONTROL, FAILED, OK, STATUS,
                   HostLayout, ProducerLayout)

__all__ = ["HostTransport", "ProducerTransport", "Delivery", "Reply", "RemoteError", "Work",
           "TAG_REQUEST", "TAG_REPLY", "LOCAL"]

log = logging.getLogger("dpu_pipe")

#: MPI tags of the request channel (host → producer) and its replies.
TAG_REQUEST, TAG_REPLY = 0x4451, 0x4452
# Heartbeat period, seconds: often enough that silence is seen quickly, rare enough to cost
# nothing next to a batch.
BEAT_EVERY = 0.05


class _Endpoint:
    """Start-up shared by both ends: version check, window, names of the ranks."""

    #: What is told about the window's memory (the host's pinned region for device copies):
    #: ``attach(mem)`` once the window is made, ``detach()`` before it is freed.
    window_users = ()

    def _setup(self, comm, setup_timeout):
        MPI = self._MPI = load_mpi()
        if sys.byteorder != "little":
            raise ConfigError("the dpu_pipe transport needs little-endian machines")
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        deadline = deadline_in(setup_timeout)
        # Every rank must be here before the blocking collectives of start-up.
        wait_request(comm.Ibarrier(), deadline,
                      f"start-up of the host group of {self.size} ranks (rank {self.rank})")
        idents = comm.allgather((wire.WIRE_VERSION, socket.gethostname(), os.getpid(),
                                 MPI.COMM_WORLD.Get_rank()))
        for v, host, pid, world in idents:
            wire.check_version(v, f"world rank {world} on {host} (pid {pid})")
        self._idents = [tuple(i[1:]) for i in idents]
        self._inflight = []

    def _allocate(self, my_bytes):
        try:
            self.win = self._MPI.Win.Allocate(my_bytes, 1, comm=self.comm)
        except self._MPI.Exception as exc:
            who = (f"group rank {self.rank} (world rank "
                   f"{self._MPI.COMM_WORLD.Get_rank()} on {socket.gethostname()}, "
                   f"pid {os.getpid()})")
            raise ConfigError(
                f"cannot allocate the {my_bytes}-byte RMA window on {who}: "
                f"{exc.Get_error_string()} — memory or /dev/shm is short; lower slots or "
                f"batch_size, or free /dev/shm") from exc
        self.win.Lock_all()
        self.mem = np.frombuffer(self.win.tomemory(), np.uint8)
        self.mem[:] = 0
        self.win.Sync()

    def _ready(self, setup_timeout):
        # Nobody writes into another rank's window before that rank zeroed it.
        wait_request(self.comm.Ibarrier(), deadline_in(setup_timeout),
                      "window set-up")

    def describe(self, rank):
        """Human-readable name of group rank ``rank`` for messages."""
        host, pid, world = self._idents[rank]
        role = "host" if rank == 0 else "producer"
        return f"{role} rank {rank} (world rank {world} on {host}, pid {pid})"

    def _put(self, data, rank, offset):
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self.win.Put(data, rank, target=(offset, data.nbytes, self._MPI.BYTE))
        # A Put may read its origin buffer until the next Flush (UCX does, off-node).
        self._inflight.append(data)

    def _flush(self, ranks):
        for r in ranks:
            self.win.Flush(r)
        self._inflight.clear()

    def _free_window(self, deadline, what):
        if self.win is None:
            return
        for user in self.window_users:
            user.detach()
        win, self.win = self.win, None
        self.mem = None
        win.Unlock_all()
        # Win.Free is collective: only enter it once everyone is known to be there.
        wait_request(self.comm.Ibarrier(), deadline, what)
        win.Free()


class Delivery:
    """A ticket's batch on the host: ``payload`` is a 1-D ``uint8`` view of ``payload_bytes``
    bytes (zero copy, inside the window or a host thread's buffer), valid until
    :meth:`HostTransport.release`. ``producer`` is the group rank that made it (0: the host's
    own threads)."""

    __slots__ = ("ticket", "stream", "epoch", "step", "producer", "payload", "buffer")

    def __init__(self, ticket, stream, epoch, step, producer, payload, buffer):
        self.ticket, self.stream, self.epoch, self.step = ticket, stream, epoch, step
        self.producer, self.payload, self.buffer = producer, payload, buffer

    def __repr__(self):
        return (f"Delivery(ticket={self.ticket}, stream={self.stream}, epoch={self.epoch}, "
                f"step={self.step}, producer={self.producer}, bytes={self.payload.nbytes})")


class RemoteError(ProducerError):
    """A request failed on a producer; ``remote_traceback`` is its traceback."""


class Reply:
    """The answer to one :meth:`HostTransport.request`. ``done()`` never blocks (it polls the
    transport once); ``result(timeout)`` waits, polling, and returns the handler's value or
    raises :class:`RemoteError` with the producer's traceback, or :class:`PipeTimeout`."""

    def __init__(self, transport, rid, kind, to):
        self._transport, self.id, self.kind, self.to = transport, rid, kind, to
        self._done, self._ok, self._value = False, None, None

    def _set(self, ok, value):
        self._done, self._ok, self._value = True, ok, value

    def done(self):
        if not self._done:
            self._transport.poll()
        return self._done

    def result(self, timeout=None):
        t = self._transport
        # A producer that failed or fell silent meanwhile raises instead of the timeout.
        poll_until(lambda: self.done() or t._raise_failure(),
                   deadline_in(t.timeout if timeout is None else float(timeout)),
                   f"no reply to request {self.kind!r} #{self.id} from "
                   f"{t.describe(self.to)} within the deadline", t.poll_interval, stretch=True)
        if not self._ok:
            info = self._value
            raise RemoteError(f"{info['type']}: {info['message']} (request {self.kind!r})",
                              producer=t.describe(self.to),
                              remote_traceback=info.get("traceback"))
        return self._value


class HostTransport(_Endpoint):
    """Host end (group rank 0). Collective at construction with a :class:`ProducerTransport`
    on every other rank of ``comm``; afterwards nothing it does waits for a collective.

    Parameters
    ----------
    comm : mpi4py Intracomm
        The host group; rank 0 is this host.
    buffers : int
        Batch buffers in the window (>= 1): at most this many made batches wait on the host.
        Host memory is ``HostLayout.total_bytes`` ≈ ``buffers × slot_bytes``.
    slot_bytes : int
        Payload capacity of one buffer, bytes.
    liveness_timeout : float
        Seconds of a still heartbeat after which a producer counts as silent.
    takeover : bool
        False: a silent producer raises PipeTimeout (from :meth:`wait`). True: it is retired,
        its tickets return to the pool for :meth:`take` (the host's threads), its granted
        buffers are quarantined; so is a producer whose batch takes ``SLOW_FACTOR`` times
        the usual time.
    timeout : float
        Default deadline of :meth:`wait` and :meth:`Reply.result`, seconds.
    setup_timeout : float
        Deadline of start-up and shutdown handshakes, seconds.
    """

    def __init__(self, comm, *, buffers, slot_bytes, liveness_timeout=60.0, takeover=False,
                 timeout=300.0, setup_timeout=60.0, poll_interval=1e-3):
        if comm.Get_rank() != 0:
            raise ConfigError("the host transport is rank 0 of its host group")
        if int(buffers) < 1 or int(slot_bytes) < 0:
            raise ConfigError(f"need buffers >= 1 and slot_bytes >= 0, got {buffers}, "
                              f"{slot_bytes}")
        if min(liveness_timeout, timeout, setup_timeout, poll_interval) <= 0:
            raise ConfigError("timeouts and intervals must be positive seconds")
        self._liveness_timeout = float(liveness_timeout)
        self._takeover = bool(takeover)
        self.timeout = float(timeout)
        self.setup_timeout = float(setup_timeout)
        self.poll_interval = float(poll_interval)
        self.window_users = []
        self.sched = None
        self._setup(comm, self.setup_timeout)
        self._window(buffers, slot_bytes)
        self.closed = False
        self._replies = {}
        self._sends = []
        self._next_rid = 1
        self._host_beat = 0
        self._last_beat = 0.0
        self.polls = 0              # polls made (each costs the host ~30-60 us of CPU)
        atexit.register(self._exit)

    # The scheduler's state, as the transport's (one scheduler per window).
    tickets = property(lambda self: self.sched.tickets)
    peers = property(lambda self: self.sched.peers)
    free = property(lambda self: self.sched.free)
    quarantined = property(lambda self: self.sched.quarantined)
    failure = property(lambda self: self.sched.failure)

    @property
    def _abort_at_exit(self):
        """End the job with MPI_Abort at exit (a producer may never sign off): the
        scheduler's verdict, which close() overrides with what it saw."""
        return self.sched is not None and self.sched.abort_at_exit

    @_abort_at_exit.setter
    def _abort_at_exit(self, value):
        self.sched.abort_at_exit = bool(value)

    @property
    def takeover(self):
        return self._takeover

    @takeover.setter
    def takeover(self, value):
        self._takeover = self.sched.takeover = bool(value)

    @property
    def liveness_timeout(self):
        return self._liveness_timeout

    @liveness_timeout.setter
    def liveness_timeout(self, value):
        self._liveness_timeout = self.sched.liveness_timeout = float(value)

    def _window(self, buffers, slot_bytes):
        """Make the window (collective with every producer's ``_window``)."""
        self.layout = HostLayout(buffers, slot_bytes, self.size - 1)
        self._allocate(self.layout.total_bytes)
        for user in self.window_users:
            user.attach(self.mem)
        self.comm.bcast({"slot_bytes": self.layout.slot_bytes, "buffers": self.layout.buffers,
                         "host_timeout": max(3600.0, 10 * self.liveness_timeout)}, root=0)
        self._ready(self.setup_timeout)
        now = time.monotonic()
        old = self.sched
        self.sched = Scheduler(self.layout.buffers, range(1, self.size), now,
                               liveness_timeout=self._liveness_timeout,
                               takeover=self._takeover, describe=self.describe)
        if old is not None:     # numbering goes on across windows: grants stay unique
            self.sched.next_ticket, self.sched.next_grant = old.next_ticket, old.next_grant
            self.sched.abort_at_exit, self.sched.failure = old.abort_at_exit, old.failure
        self._seen = {}
        self._polled = self._prev_poll = time.monotonic()

    def resize(self, buffers, slot_bytes):
        """Make the window again with ``buffers`` buffers of ``slot_bytes`` bytes (a loader
        larger than the first one). Every ticket must be released or cancelled; collective
        with the producers (they take it as a request), guarded by deadlines."""
        self._check_open()
        if self.tickets:
            raise ConfigError("resize() with batches in flight: cancel or release them first")
        silent = [p for p in self.peers.values() if p.retired or p.stopped]
        if silent:
            raise ConfigError("cannot make the window again: "
                              + ", ".join(self.describe(p.rank) for p in silent)
                              + " no longer serve(s)")
        self.request("resize")
        deadline = deadline_in(self.setup_timeout)
        self._free_window(deadline, "making the window again")
        self._window(buffers, slot_bytes)
        self._replies.clear()

    def add_window_user(self, user):
        """Tell ``user`` about the window's memory: ``user.attach(mem)`` now and whenever
        :meth:`resize` makes the window anew, ``user.detach()`` before the window is freed
        (resize, close)."""
        self._check_open()
        self.window_users.append(user)
        user.attach(self.mem)

    # -- work (the scheduler decides; see dpu_pipe.offload.scheduler) -----------------------
    def submit(self, stream, epoch, step):
        """Queue ``(stream, epoch, step)``; returns its ticket. Tickets are assigned to
        producers (and granted buffers) lowest first."""
        self._check_open()
        return self.sched.submit(stream, epoch, step)

    def cancel(self, tickets):
        """Drop submitted tickets that are not released yet (made or not). Their producers
        drop the work; a granted buffer returns once its producer has passed the entry."""
        self.sched.cancel(tickets)
        self._write_outbox()

    def take(self, limit):
        """Up to ``limit`` tickets from the pool for the host's own threads (lowest first),
        as ``[(ticket, stream, epoch, step)]``; they are delivered with :meth:`deliver`."""
        return self.sched.take(limit)

    def pool_size(self, local_only=False):
        return self.sched.pool_size(local_only)

    def deliver(self, ticket, payload, status=OK):
        """A host thread made ``ticket``: ``payload`` (uint8 view) is its batch; with
        ``status=FAILED`` it is a pickled error record."""
        t = self.sched.tickets.get(ticket)
        if t is None:  # cancelled meanwhile
            return
        self.sched.deliver(ticket, Delivery(t.ticket, t.stream, t.epoch, t.step, LOCAL,
                                            payload, -1), {"status": status})

    def state(self, ticket):
        """"ready", "waiting" or None (unknown: cancelled or released)."""
        return self.sched.state(ticket)

    def wait(self, ticket, timeout=None, between=None, nap=True):
        """The :class:`Delivery` of ``ticket``, polling until it is made. Raises the
        producer's error for it (DecodeError with a note and a ProducerError cause naming the
        producer, or ProducerError), or PipeTimeout after ``timeout`` seconds (default
        :attr:`timeout`) or when a producer fell silent without takeover, naming it.
        ``between()``, when given, runs after every poll (the host's own threads' turn).
        ``nap``: while the producer making ``ticket`` is expected to take a while longer,
        sleep through it instead of polling (False when ``between`` must run often)."""
        sched = self.sched
        t = sched.tickets.get(ticket)
        if t is None:
            raise ConfigError(f"ticket {ticket} is not pending (cancelled or released)")
        wait = self.timeout if timeout is None else float(timeout)
        start = time.monotonic()
        backoff = Backoff(self.poll_interval)
        while t.ready is None:
            self.poll()
            if sched.needs_reclaim(t):
                sched.reclaim(t)
                self._write_outbox()
            if between is not None:
                between()
            if t.ready is not None:
                break
            self._raise_failure()
            now = time.monotonic()
            if now - start > wait:
                raise PipeTimeout(f"step {t.step} of epoch {t.epoch} (ticket {ticket}) not "
                                  f"made within {wait:g} s; {sched.holder(t)}")
            backoff(min(sched.nap(t, now), start + wait - now) if nap else 0.0)
        d = t.ready
        if t.header.get("status") == FAILED:
            blob = bytes(d.payload)
            who = self.describe(d.producer) if d.producer else "a host thread"
            self.release(ticket)
            _raise_remote(blob, who, t.epoch, t.step)
        return d

    def release(self, ticket):
        """Give ``ticket``'s buffer back (the batch view becomes invalid)."""
        self.sched.release(ticket)

    def _raise_failure(self):
        if self.sched.failure is not None:
            raise PipeTimeout(self.sched.failure)

    # -- the poll: window I/O around the scheduler -------------------------------------------
    def poll(self):
        """Look at producers' statuses and the granted buffers, detect silence, refill
        queues, grant free buffers, deliver replies. Cheap; never blocks."""
        if self.closed:
            return
        now = time.monotonic()
        self.polls += 1
        self.win.Sync()
        dirty = set()
        self._prev_poll, self._polled = self._polled, now
        for peer in self.sched.peers.values():
            if not peer.retired:
                self._read_status(peer, now)
        for t in self.sched.granted_tickets():
            self._read_header(t)
        self.sched.schedule(now)
        self._write_outbox(dirty)
        if now - self._last_beat > BEAT_EVERY:
            self._last_beat = now
            self._host_beat += 1
            ctl = wire.pack(CONTROL, stop=0, host_beat=self._host_beat)
            for peer in self.sched.peers.values():
                if not peer.retired:
                    self._put(ctl, peer.rank, 0)
                    dirty.add(peer.rank)
        self._flush(dirty)
        self._poll_channel()

    def _record(self, offset, dtype):
        """The sealed record at ``offset`` of this window, or None; a record unchanged since
        the last poll costs one bytes comparison."""
        snap = bytes(self.mem[offset:offset + dtype.itemsize])
        last = self._seen.get(offset)
        if last is not None and last[0] == snap:
            return last[1]
        rec = wire.intact(snap, dtype)
        self._seen[offset] = (snap, rec)
        return rec

    def _read_status(self, peer, now):
        st = self._record(self.layout.status(peer.rank), STATUS)
        if st is not None:
            self.sched.on_status(peer.rank, st, now, self._prev_poll)

    def _read_header(self, t):
        L = self.layout
        h = self._record(L.header(t.buffer), BUFFER_HEADER)
        try:
            if not self.sched.header_matches(t, h):
                return
        except ValueError as exc:
            raise ProducerError(str(exc), producer=self.describe(t.owner)) from None
        if h["payload_bytes"] > L.slot_bytes:
            raise ProducerError(f"buffer {t.buffer} holds a header that does not match its "
                                f"grant: {h}", producer=self.describe(t.owner))
        t.header = h
        payload = self.mem[L.payload(t.buffer):][:h["payload_bytes"]]
        t.ready = Delivery(t.ticket, t.stream, t.epoch, t.step, t.owner, payload, t.buffer)

    def _write_outbox(self, dirty=None):
        """Write the scheduler's ``ASSIGN`` entries into the producers' windows: flushed
        here, or added to ``dirty`` for the caller to flush."""
        ranks = set() if dirty is None else dirty
        for rank, entry in self.sched.outbox:
            self._put(wire.pack(ASSIGN, **entry), rank, ProducerLayout.entry(entry["seq"]))
            ranks.add(rank)
        self.sched.outbox.clear()
        if dirty is None:
            self._flush(ranks)

    # -- request channel ------------------------------------------------------------------
    def request(self, kind, payload=None, to=None):
        """Send a request of ``kind`` (str) with ``payload`` (any picklable object) to
        producer ``to`` (group rank), or to every producer when ``to`` is None. Returns a
        :class:`Reply` (a list of them for every producer). Never blocks: the message is
        sent without waiting, replies arrive while the host polls."""
        self._check_open()
        if to is None:
            return [self.request(kind, payload, r) for r in self.peers]
        if to not in self.peers:
            raise ConfigError(f"no producer rank {to} in this host group")
        rid = self._next_rid
        self._next_rid += 1
        reply = self._replies[rid] = Reply(self, rid, kind, to)
        self._sends.append(self.comm.isend((rid, kind, payload), dest=to, tag=TAG_REQUEST))
        return reply

    def _poll_channel(self):
        MPI = self._MPI
        while True:
            msg = self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_REPLY)
            if msg is None:
                break
            rid, ok, value = msg.recv()
            reply = self._replies.pop(rid, None)
            if reply is not None:
                reply._set(ok, value)
        self._sends = [r for r in self._sends if not r.Test()]

    # -- shutdown -------------------------------------------------------------------------
    def _check_open(self):
        if self.closed:
            raise ConfigError("the host transport is closed")

    def close(self, timeout=None):
        """Stop every producer (even a silent one: a stopped process that wakes up finds the
        stop), wait for their sign-off (deadline ``timeout``, default ``setup_timeout``) and
        free the window. Idempotent. With a producer that never signs off the window stays
        allocated and the job ends with MPI_Abort at interpreter exit."""
        if self.closed:
            return
        deadline = deadline_in(self.setup_timeout if timeout is None else timeout)
        stop = wire.pack(CONTROL, stop=1, host_beat=self._host_beat + 1)
        for peer in self.peers.values():
            self._put(stop, peer.rank, 0)
        self._flush(self.peers)
        backoff = Backoff(0.01)
        now = time.monotonic()
        while True:
            self.win.Sync()
            for peer in self.peers.values():
                self._read_status(peer, now)
            missing = [p for p in self.peers.values() if not p.stopped]
            if not missing or time.monotonic() > deadline:
                break
            self._poll_channel()
            backoff()
        self.closed = True
        # Every producer signed off (a silent one may have woken up): the job can end cleanly.
        self._abort_at_exit = bool(missing)
        if missing:
            log.warning("closing with %s not signed off; the job ends at exit",
                        ", ".join(self.describe(p.rank) for p in missing))
            return
        self._free_window(deadline, "freeing the window")

    def _exit(self):
        if not self.closed:
            try:
                self.close(timeout=min(self.setup_timeout, 10.0))
            except Exception:  # noqa: BLE001 - at exit, end the job rather than hang it
                self._abort_at_exit = True
        if self._abort_at_exit and not self._MPI.Is_finalized():
            sys.stdout.flush()
            sys.stderr.flush()
            self._MPI.COMM_WORLD.Abort(1)


class Work:
    """One assignment a producer holds: make batch ``step`` of ``epoch`` of ``stream``."""

    __slots__ = ("seq", "ticket", "stream", "epoch", "step", "parts", "error", "buffers")

    def __init__(self, entry):
        self.seq, self.ticket, self.stream = entry["seq"], entry["ticket"], entry["stream"]
        self.epoch, self.step = entry["epoch"], entry["step"]
        self.parts = None       # buffers to put, back to back, once granted
        self.error = None       # pickled error record instead
        self.buffers = None     # the producer's own memory holding the parts

    def __repr__(self):
        return (f"Work(ticket={self.ticket}, stream={self.stream}, epoch={self.epoch}, "
                f"step={self.step})")


class ProducerTransport(_Endpoint):
    """Producer end (group rank >= 1): collective at construction with the host's
    :class:`HostTransport`; settings come from the host. Used by one thread (the worker
    loop in :mod:`dpu_pipe.offload.worker`), which calls :meth:`next_work`,
    :meth:`granted`, :meth:`publish` and :meth:`beat`. ``setup_timeout`` bounds the wait for
    the host to make the window (it does so when its first loader starts iterating) and the
    shutdown handshake."""

    def __init__(self, comm, *, setup_timeout=86400.0, poll_interval=1e-3):
        if comm.Get_rank() == 0:
            raise ConfigError("rank 0 of a host group is the host")
        self._setup(comm, setup_timeout)
        self.setup_timeout = setup_timeout
        self.poll_interval = poll_interval
        self.made = 0
        self._window()
        self.working = -1
        self._beat = 0
        self._last_beat = 0.0
        self._host_beat = -1
        self._host_seen = time.monotonic()
        self.stopped = False
        self.beat(force=True)

    def _window(self):
        self._allocate(ProducerLayout.total_bytes)
        config = self.comm.bcast(None, root=0)
        self.slot_bytes = config["slot_bytes"]
        self.host_timeout = config["host_timeout"]
        self.layout = HostLayout(config["buffers"], self.slot_bytes, self.size - 1)
        self._ready(self.setup_timeout)
        self.next_seq = 0
        self._done = 0

    def resize(self):
        """The host's ``resize`` request: free the window and make the new one with it
        (every assignment of the old one is void)."""
        self._free_window(deadline_in(self.setup_timeout),
                          f"{self.describe(self.rank)} making the window again")
        self._window()
        self._host_seen = time.monotonic()
        self.beat(force=True)

    # -- control --------------------------------------------------------------------------
    def _control(self):
        self.win.Sync()
        return wire.intact(self.mem, CONTROL)

    def stop_requested(self):
        """True once the host wrote stop. Raises PipeTimeout when the host's heartbeat has
        been still for ``host_timeout`` seconds (it polls on every call it makes)."""
        ctl = self._control()
        now = time.monotonic()
        if ctl is not None:
            if ctl["stop"]:
                return True
            if ctl["host_beat"] != self._host_beat:
                self._host_beat, self._host_seen = ctl["host_beat"], now
        if now - self._host_seen > self.host_timeout:
            raise PipeTimeout(f"{self.describe(0)} stopped answering: no heartbeat for "
                              f"{now - self._host_seen:.0f} s (seen by "
                              f"{self.describe(self.rank)})")
        return False

    def beat(self, force=False, done=None):
        """Write this producer's status (heartbeat, progress) into the host's window.
        Rate-limited to every few ms unless ``force``; cheap."""
        now = time.monotonic()
        if done is not None and done != self._done:
            self._done, force = done, True
        if not force and now - self._last_beat < BEAT_EVERY:
            return
        self._last_beat = now
        self._beat += 1
        rec = wire.pack(STATUS, beat=self._beat, done=self._done, working=self.working,
                        stopped=int(self.stopped), made=self.made, pid=os.getpid())
        self._put(rec, 0, self.layout.status(self.rank))
        self._flush([0])

    # -- work -----------------------------------------------------------------------------
    def _entry(self, seq):
        e = wire.intact(self.mem[ProducerLayout.entry(seq):], ASSIGN)
        return e if e is not None and e["seq"] == seq else None

    def next_work(self):
        """The next assignment (a :class:`Work`), or None when there is none yet; cancelled
        assignments are skipped."""
        self.win.Sync()
        while True:
            e = self._entry(self.next_seq)
            if e is None:
                return None
            self.next_seq += 1
            if e["buffer"] != CANCELLED:
                return Work(e)

    def granted(self, work):
        """``(buffer, grant)`` once the host granted a buffer for ``work``, None while not
        yet, CANCELLED when the host dropped it."""
        self.win.Sync()
        e = self._entry(work.seq)
        if e is None:  # the entry was reused: it was cancelled and passed
            return CANCELLED
        if e["buffer"] == CANCELLED:
            return CANCELLED
        if e["buffer"] < 0:
            return None
        return e["buffer"], e["grant"]

    def publish(self, work, buffer, grant):
        """Put ``work``'s parts (or its error record) into ``buffer``, Flush, then its sealed
        header, Flush. Returns the nanoseconds it took."""
        t0 = time.perf_counter_ns()
        L = self.layout
        offset = L.payload(buffer)
        total = 0
        parts = [np.frombuffer(work.error, np.uint8)] if work.error is not None else work.parts
        for p in parts:
            view = memoryview(p)
            if not view.c_contiguous:
                raise ConfigError(f"payload parts must be C-contiguous, got strides "
                                  f"{view.strides}")
            view = view.cast("B")
            if total + view.nbytes > L.slot_bytes:
                raise ConfigError(f"payload of more than {L.slot_bytes} bytes does not fit "
                                  "a buffer")
            if view.nbytes:
                self.win.Put(view, 0, target=(offset + total, view.nbytes, self._MPI.BYTE))
            total += view.nbytes
        # The payload must be complete at the host before the header says so.
        self.win.Flush(0)
        rec = wire.pack(BUFFER_HEADER, grant=grant, ticket=work.ticket, epoch=work.epoch,
                        step=work.step, payload_bytes=total, producer=self.rank,
                        status=FAILED if work.error is not None else OK, stream=work.stream)
        self._put(rec, 0, L.header(buffer))
        self._flush([0])
        self.made += 1
        return time.perf_counter_ns() - t0

    def fail(self, work, exc):
        """Turn ``exc`` into ``work``'s error record (delivered instead of a payload)."""
        work.error = _pack_error(exc, None, self.slot_bytes, self.describe(self.rank))
        work.parts = None

    # -- request channel ------------------------------------------------------------------
    def requests(self):
        """Requests the host sent, as ``[(id, kind, payload)]`` (never blocks)."""
        out = []
        while True:
            msg = self.comm.improbe(source=0, tag=TAG_REQUEST)
            if msg is None:
                return out
            out.append(msg.recv())

    def reply(self, rid, ok, value):
        """Answer request ``rid``: ``ok`` and the handler's value, or not ``ok`` and an error
        record (see :func:`~dpu_pipe.errors.error_record`). Small replies complete without the host."""
        req = self.comm.isend((rid, ok, value), dest=0, tag=TAG_REPLY)
        self._pending_replies = [r for r in getattr(self, "_pending_replies", []) if not r.Test()]
        if not req.Test():
            self._pending_replies.append(req)

    def close(self):
        """Sign off (status stopped), then free the window with the host (deadline)."""
        if self.win is None:
            return
        self.stopped = True
        self.beat(force=True)
        deadline = deadline_in(self.setup_timeout)
        for r in getattr(self, "_pending_replies", []):
            wait_request(r, deadline, "a reply to the host")
        self._free_window(deadline, f"{self.describe(self.rank)} freeing the window")


# -- errors across the wire -------------------------------------------------------------------
def _pack_error(exc, tb_text, capacity, who):
    """Pickle the :func:`~dpu_pipe.errors.error_record` of ``exc`` (made by ``who``, with its
    traceback text ``tb_text``, default the one of ``exc``) and the exception itself into at
    most ``capacity`` bytes, dropping the exception object and trimming the traceback's head
    (its last frames say the most) and the message as needed. Returns b"" when not even a
    minimal record fits."""
    try:
        exc_blob = pickle.dumps(exc, protocol=4)
        pickle.loads(exc_blob)  # some exceptions pickle but do not unpickle
    except Exception:
        exc_blob = None
    record = error_record(exc, who)
    message = record["message"]
    if tb_text is None:
        tb_text = record["traceback"]

    def pack(exc_blob, tb, msg):
        return pickle.dumps(dict(record, message=msg, traceback=tb, exc=exc_blob), protocol=4)

    blob = pack(exc_blob, tb_text, message)
    if len(blob) <= capacity:
        return blob
    if exc_blob is not None and len(exc_blob) > capacity // 2:
        exc_blob = None
    msg = message[:max(0, capacity // 4)]
    spare = capacity - len(pack(exc_blob, "", msg))
    if spare > 40:
        tail = tb_text[-(spare - 40):]
        blob = pack(exc_blob, "...(truncated)\n" + tail, msg)
        while len(blob) > capacity and tail:  # non-ASCII text pickles longer than its length
            tail = tail[len(tail) // 8 + 1:]
            blob = pack(exc_blob, "...(truncated)\n" + tail, msg)
        if len(blob) <= capacity:
            return blob
    for blob in (pack(None, "", msg), pack(None, "", message[:40]), pack(None, "", "")):
        if len(blob) <= capacity:
            return blob
    return b""


def _raise_remote(blob, who, epoch, step):
    """Raise on the host the error a producer published for step ``step`` of ``epoch``."""
    where = f"step {step} of epoch {epoch}"
    if not blob:
        raise ProducerError(f"failed on {where} (the slot is too small to carry the error)",
                            producer=who)
    try:
        info = pickle.loads(blob)
    except Exception as exc:
        raise ProducerError(f"failed on {where}; its error record is unreadable: {exc!r}",
                            producer=who) from None
    original = None
    if info.get("exc") is not None:
        try:
            original = pickle.loads(info["exc"])
        except Exception:  # its class may not exist on the host
            original = None
    remote = ProducerError(f"{info['type']}: {info['message']} (on {where})", producer=who,
                           remote_traceback=info.get("traceback") or None)
    if isinstance(original, DecodeError):
        if hasattr(original, "add_note"):
            original.add_note(f"raised in {who} on {where}")
        raise original from remote
    if isinstance(original, BaseException):
        raise remote from original
    raise remote


