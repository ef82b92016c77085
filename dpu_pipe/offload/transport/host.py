"""The host end of the transport (group rank 0): the window I/O around the pure
:class:`~dpu_pipe.offload.scheduler.Scheduler` (producers' statuses and sealed headers in,
assignments and control records out), the request channel and the shutdown handshake."""
import atexit
import itertools
import logging
import sys
import time

from ...deadline import Backoff, deadline_in, poll_until
from ...errors import ConfigError, PipeTimeout, ProducerError
from .. import wire
from ..scheduler import LOCAL, Scheduler
from ..wire import ASSIGN, BUFFER_HEADER, CONTROL, FAILED, OK, STATUS, HostLayout, ProducerLayout
from .endpoint import BEAT_EVERY, TAG_REPLY, TAG_REQUEST, Endpoint
from .failures import raise_remote

log = logging.getLogger("dpu_pipe")


class Delivery:
    """A ticket's batch on the host: ``payload`` is a 1-D ``uint8`` view (zero copy, inside
    the window or a host thread's buffer), valid until :meth:`HostTransport.release`.
    ``producer`` is the group rank that made it (0: the host's own threads)."""

    __slots__ = ("ticket", "stream", "epoch", "step", "producer", "payload", "buffer")

    def __init__(self, ticket, stream, epoch, step, producer, payload, buffer):
        self.ticket, self.stream, self.epoch, self.step = ticket, stream, epoch, step
        self.producer, self.payload, self.buffer = producer, payload, buffer


class RemoteError(ProducerError):
    """A request failed on a producer; ``remote_traceback`` is its traceback."""


class Reply:
    """The answer to one :meth:`HostTransport.request`. ``done()`` polls the transport once,
    never blocking; ``result(timeout)`` polls until the handler's value arrives and returns it,
    or raises :class:`RemoteError` with the producer's traceback, or :class:`PipeTimeout`."""

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


class HostTransport(Endpoint):
    """Host end (group rank 0), collective at construction with a :class:`ProducerTransport`
    on every other rank of ``comm``; afterwards nothing it does waits for a collective.
    Raises ConfigError off rank 0 or for a parameter out of range.

    Parameters
    ----------
    comm : mpi4py Intracomm
        The host group; rank 0 is this host.
    buffers : int
        Batch buffers in the window (>= 1): at most this many made batches wait on the host.
    slot_bytes : int
        Payload capacity of one buffer, bytes; host memory is about ``buffers × slot_bytes``.
    liveness_timeout : float
        Seconds of a still heartbeat after which a producer counts as silent.
    takeover : bool
        False: a silent producer raises PipeTimeout (from :meth:`wait`). True: it (or one
        whose batch takes ``SLOW_FACTOR`` times the usual time) is retired, its tickets
        return to the pool for :meth:`take`, its granted buffers are quarantined.
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
        self.timeout = float(timeout)
        self.setup_timeout = float(setup_timeout)
        self.poll_interval = float(poll_interval)
        self.window_users = []
        self.sched = None
        self._setup(comm, self.setup_timeout)
        self._window(buffers, slot_bytes, float(liveness_timeout), bool(takeover))
        self.closed = False
        self._replies = {}
        self._sends = []
        self._request_ids = itertools.count(1)
        self._host_beat = 0
        self._last_beat = 0.0
        self.polls = 0              # polls made (each costs the host ~30-60 us of CPU)
        atexit.register(self._exit)

    tickets = property(lambda self: self.sched.tickets)
    peers = property(lambda self: self.sched.peers)

    def configure(self, takeover, liveness_timeout):
        """Set the stream in flight's ``takeover`` and ``liveness_timeout`` (see above)."""
        self.sched.takeover = bool(takeover)
        self.sched.liveness_timeout = float(liveness_timeout)

    def _window(self, buffers, slot_bytes, liveness_timeout, takeover):
        """Make the window (collective with every producer's ``_window``)."""
        self.layout = HostLayout(buffers, slot_bytes, self.size - 1)
        self._allocate(self.layout.total_bytes)
        for user in self.window_users:
            user.attach(self.mem)
        self.comm.bcast({"slot_bytes": self.layout.slot_bytes, "buffers": self.layout.buffers,
                         "host_timeout": max(3600.0, 10 * liveness_timeout)}, root=0)
        self._ready(self.setup_timeout)
        old = self.sched
        self.sched = Scheduler(self.layout.buffers, range(1, self.size), time.monotonic(),
                               liveness_timeout=liveness_timeout, takeover=takeover,
                               describe=self.describe)
        if old is not None:     # numbering goes on across windows: grants stay unique
            self.sched.next_ticket, self.sched.next_grant = old.next_ticket, old.next_grant
            self.sched.abort_at_exit, self.sched.failure = old.abort_at_exit, old.failure
        self._seen = {}
        self._polled = self._prev_poll = time.monotonic()

    def resize(self, buffers, slot_bytes):
        """Make the window again with ``buffers`` buffers of ``slot_bytes`` bytes, for a
        loader larger than the first; collective with the producers (a request to them),
        under deadlines. ConfigError while a ticket is pending or a producer no longer
        serves."""
        self._check_open()
        if self.tickets:
            raise ConfigError("resize() with batches in flight: cancel or release them first")
        silent = [p for p in self.peers.values() if p.retired or p.stopped]
        if silent:
            raise ConfigError("cannot make the window again: "
                              + ", ".join(self.describe(p.rank) for p in silent)
                              + " no longer serve(s)")
        self.request("resize")
        self._free_window(deadline_in(self.setup_timeout), "making the window again")
        self._window(buffers, slot_bytes, self.sched.liveness_timeout, self.sched.takeover)
        self._replies.clear()

    def add_window_user(self, user):
        """Call ``user.attach(mem)`` with the window's memory now and whenever :meth:`resize`
        makes it anew, ``user.detach()`` before it is freed."""
        self._check_open()
        self.window_users.append(user)
        user.attach(self.mem)

    def submit(self, stream, epoch, step):
        """Queue ``(stream, epoch, step)``; returns its ticket (assigned and granted lowest
        first)."""
        self._check_open()
        return self.sched.submit(stream, epoch, step)

    def cancel(self, tickets):
        """Cancel ``tickets`` (:meth:`Scheduler.cancel`); their entries are written at once."""
        self.sched.cancel(tickets)
        self._write_outbox()

    def take(self, limit):
        """Tickets for the host's own threads (:meth:`Scheduler.take`), for :meth:`deliver`."""
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
        """The :class:`Delivery` of ``ticket``, polling until it is made; ``between()``, when
        given, runs after every poll (the host's own threads' turn). ``nap``: sleep while the
        producer making ``ticket`` is expected to take a while longer (False when ``between``
        must run often). Raises the producer's error
        (:func:`~dpu_pipe.offload.transport.failures.raise_remote`), or PipeTimeout after
        ``timeout`` seconds (default :attr:`timeout`) or when a producer fell silent without
        takeover, naming it."""
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
            raise_remote(blob, who, t.epoch, t.step)
        return d

    def release(self, ticket):
        """Give ``ticket``'s buffer back (the batch view becomes invalid)."""
        self.sched.release(ticket)

    def _raise_failure(self):
        if self.sched.failure is not None:
            raise PipeTimeout(self.sched.failure)

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
        """The sealed record at ``offset``, or None; one bytes comparison while unchanged."""
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
        """Put the scheduler's ``ASSIGN`` entries; flush them, or add their ranks to ``dirty``."""
        ranks = set() if dirty is None else dirty
        for rank, entry in self.sched.outbox:
            self._put(wire.pack(ASSIGN, **entry), rank, ProducerLayout.entry(entry["seq"]))
            ranks.add(rank)
        self.sched.outbox.clear()
        if dirty is None:
            self._flush(ranks)

    def request(self, kind, payload=None, to=None):
        """Send a request of ``kind`` (str) with ``payload`` (any picklable object) to
        producer ``to`` (group rank), or to each producer when ``to`` is None; returns its
        :class:`Reply` (a list of them). Never blocks: replies arrive while the host polls."""
        self._check_open()
        if to is None:
            return [self.request(kind, payload, r) for r in self.peers]
        if to not in self.peers:
            raise ConfigError(f"no producer rank {to} in this host group")
        rid = next(self._request_ids)
        reply = self._replies[rid] = Reply(self, rid, kind, to)
        self._sends.append(self.comm.isend((rid, kind, payload), dest=to, tag=TAG_REQUEST))
        return reply

    def _poll_channel(self):
        while (msg := self.comm.improbe(source=self._MPI.ANY_SOURCE, tag=TAG_REPLY)) is not None:
            rid, ok, value = msg.recv()
            reply = self._replies.pop(rid, None)
            if reply is not None:
                reply._set(ok, value)
        self._sends = [r for r in self._sends if not r.Test()]

    def _check_open(self):
        if self.closed:
            raise ConfigError("the host transport is closed")

    def close(self, timeout=None):
        """Stop every producer (a silent one too: a stopped process that wakes up finds the
        stop), wait ``timeout`` seconds at most (default ``setup_timeout``) for their
        sign-off and free the window. Idempotent. Without every sign-off the window stays
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
        self.sched.abort_at_exit = bool(missing)
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
                self.sched.abort_at_exit = True
        if self.sched.abort_at_exit and not self._MPI.Is_finalized():
            sys.stdout.flush()
            sys.stderr.flush()
            self._MPI.COMM_WORLD.Abort(1)
