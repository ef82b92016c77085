"""The host's ticket scheduler: a pure state machine, no MPI.

:class:`~dpu_pipe.offload.transport.HostTransport` hands it the records read from its window
and writes the ``ASSIGN`` entries it puts in :attr:`Scheduler.outbox`. Every decision (who
makes which ticket, which buffer it is granted, when a buffer is free again, what becomes of a
silent or slow producer's work) is made here; the states of tickets and buffers (free,
granted, quarantined) are drawn in docs/design/transport.md.
"""
import logging

from .wire import CANCELLED, QUEUE, WAITING

__all__ = ["Scheduler", "Ticket", "Peer", "LOCAL"]

log = logging.getLogger("dpu_pipe")

#: Owner of a ticket made by the host's own threads (hybrid mode).
LOCAL = 0
#: Hybrid takeover of a slow producer: its batch took this many times the usual batch time,
#: and at least SLOW_FLOOR seconds.
SLOW_FACTOR, SLOW_FLOOR = 10, 1.0
#: A host waiting for a batch its producer is making sleeps through the expected rest of it,
#: waking this share of the producer's usual batch time early, at most NAP_MAX seconds at once.
NAP_MARGIN, NAP_MAX = 0.1, 0.5


class Ticket:
    __slots__ = ("ticket", "stream", "epoch", "step", "owner", "seq", "buffer", "grant",
                 "ready", "local_only", "header")

    def __init__(self, ticket, stream, epoch, step):
        self.ticket, self.stream, self.epoch, self.step = ticket, stream, epoch, step
        self.owner = None       # producer rank, LOCAL, or None while in the pool
        self.seq = -1           # assignment seq at its producer
        self.buffer = -1        # granted window buffer
        self.grant = -1
        self.ready = None       # the delivery once made
        self.local_only = False  # taken over from a silent producer: the host makes it
        self.header = None


class Peer:
    """The host's view of one producer."""

    def __init__(self, rank, now):
        self.rank = rank
        self.next_seq = 0
        self.done = 0
        self.beat = -1
        self.seen = now
        self.retired = False
        self.stopped = False
        self.entries = {}           # seq -> Ticket, not yet passed by the producer
        self.working = -1           # the ticket it reports making, since working_since
        self.working_since = now
        self.batch_s = None         # its usual batch time (moving average, seconds)
        self.since_error = 0.0      # working_since is late by up to this (the poll gap)


class Scheduler:
    """Tickets, producers' queues and the window's buffers of one host group.

    Parameters
    ----------
    buffers : int
        Batch buffers of the window.
    ranks : iterable of int
        Group ranks of the producers.
    now : float
        ``time.monotonic()`` seconds; every method that looks at time takes ``now``.
    liveness_timeout : float
        Seconds of a still heartbeat after which a producer is silent.
    takeover : bool
        Retire silent (and slow) producers and give their work to the host's threads
        (True), or record a failure naming them (False).
    describe : callable, optional
        ``describe(rank)``: the producer's name in messages.
    """

    def __init__(self, buffers, ranks, now, *, liveness_timeout=60.0, takeover=False,
                 describe=None):
        self.liveness_timeout = float(liveness_timeout)
        self.takeover = bool(takeover)
        self.describe = describe or (lambda rank: f"producer rank {rank}")
        self.buffers = int(buffers)
        self.peers = {r: Peer(r, now) for r in ranks}
        self.free = list(range(self.buffers))
        self.quarantined = set()
        self.tickets = {}           # ticket -> Ticket, submitted and not released/cancelled
        self.pool = []              # tickets waiting for an owner, ascending
        self.next_ticket = 0
        self.next_grant = 1
        self.failure = None         # message of a silent producer (no takeover)
        #: A producer may never sign off (silent, retired): end the job at exit.
        self.abort_at_exit = False
        self.outbox = []            # (rank, ASSIGN fields) to write, in order

    def submit(self, stream, epoch, step):
        """Queue ``(stream, epoch, step)``; returns its ticket."""
        t = Ticket(self.next_ticket, int(stream), int(epoch), int(step))
        self.next_ticket += 1
        self.tickets[t.ticket] = t
        self.pool.append(t.ticket)
        return t.ticket

    def cancel(self, tickets):
        """Drop submitted tickets that are not released yet (made or not). Their producers
        drop the work; a granted buffer returns once its producer has passed the entry."""
        for tk in list(tickets):
            t = self.tickets.pop(tk, None)
            if t is None:
                continue
            if t.owner is None:
                self.pool.remove(tk)
            elif t.owner != LOCAL and not self.peers[t.owner].retired:
                peer = self.peers[t.owner]
                self._write_entry(peer, t, CANCELLED)
                if t.ready is not None and t.buffer >= 0:
                    # Made and delivered: the producer is done with the buffer.
                    self._free_buffer(t.buffer)
                    peer.entries.pop(t.seq, None)
                # else: freed when the producer passes the entry (see on_status)
            t.ready = None

    def take(self, limit):
        """Up to ``limit`` tickets from the pool for the host's own threads (lowest first),
        as ``[(ticket, stream, epoch, step)]``."""
        out = []
        while self.pool and len(out) < limit:
            t = self.tickets[self.pool.pop(0)]
            t.owner = LOCAL
            out.append((t.ticket, t.stream, t.epoch, t.step))
        return out

    def pool_size(self, local_only=False):
        return sum(1 for tk in self.pool if self.tickets[tk].local_only or not local_only)

    def deliver(self, ticket, ready, header):
        """A host thread made ``ticket`` (ignored when it was cancelled meanwhile)."""
        t = self.tickets.get(ticket)
        if t is not None:
            t.ready, t.header = ready, header

    def state(self, ticket):
        """"ready", "waiting" or None (unknown: cancelled or released)."""
        t = self.tickets.get(ticket)
        return None if t is None else ("ready" if t.ready is not None else "waiting")

    def release(self, ticket):
        """Give ``ticket``'s buffer back."""
        t = self.tickets.pop(ticket, None)
        if t is not None and t.owner not in (None, LOCAL):
            peer = self.peers[t.owner]
            peer.entries.pop(t.seq, None)
            if t.buffer >= 0 and not peer.retired:
                self._free_buffer(t.buffer)

    def holder(self, t):
        """Who has ticket ``t``, for messages."""
        if t.owner is None:
            return "no producer has it yet (all queues full or no producer left)"
        if t.owner == LOCAL:
            return "a host thread is making it"
        return f"it is held by {self.describe(t.owner)}"

    def on_status(self, rank, st, now, prev_poll):
        """Producer ``rank``'s ``STATUS`` record ``st`` (a dict), read at ``now``; the
        previous poll was at ``prev_poll``."""
        peer = self.peers[rank]
        if st["beat"] != peer.beat:
            peer.beat, peer.seen = st["beat"], now
        peer.stopped = bool(st["stopped"])
        if st["working"] != peer.working:
            if peer.working >= 0:
                took = now - peer.working_since
                peer.batch_s = took if peer.batch_s is None else 0.8 * peer.batch_s + 0.2 * took
            peer.working, peer.working_since = st["working"], now
            peer.since_error = now - prev_poll
        if st["done"] > peer.done:
            peer.done = st["done"]
            for seq in [s for s in peer.entries if s < peer.done]:
                t = peer.entries[seq]
                if t.ticket not in self.tickets:   # cancelled: its buffer can be reused
                    del peer.entries[seq]
                    if t.buffer >= 0:
                        self._free_buffer(t.buffer)

    def granted_tickets(self):
        """Tickets granted a buffer and not ready: their buffer's header is to be read."""
        return [t for t in self.tickets.values() if t.ready is None and t.buffer >= 0]

    def header_matches(self, t, h):
        """True when the sealed header ``h`` of ``t``'s buffer carries ``t``'s grant (the
        payload is complete); ValueError when it carries the grant but names other work."""
        if h is None or h["grant"] != t.grant:
            return False
        if (h["ticket"], h["epoch"], h["step"], h["producer"]) != \
                (t.ticket, t.epoch, t.step, t.owner):
            raise ValueError(f"buffer {t.buffer} holds a header that does not match its "
                             f"grant: {h}")
        return True

    def schedule(self, now):
        """One round: detect silence (and slowness), refill queues, grant free buffers."""
        self.check_silence(now)
        self.assign()
        self.grant()

    def _live(self):
        return [p for p in self.peers.values() if not p.retired and not p.stopped]

    def check_silence(self, now):
        silent = sorted((p for p in self._live() if now - p.seen > self.liveness_timeout),
                        key=lambda p: p.seen)
        if silent and self.takeover:
            for p in silent:
                self.retire(p.rank, f"no heartbeat for {now - p.seen:.1f} s")
        elif silent and self.failure is None:
            names = "; ".join(f"{self.describe(p.rank)}: no heartbeat for {now - p.seen:.1f} s"
                              + self._held_by(p) for p in silent)
            self.failure = (f"producer stopped answering (liveness_timeout "
                            f"{self.liveness_timeout:g} s): {names}")
            self.abort_at_exit = True
        elif not silent and self.takeover:
            self._check_slow(now)

    def _check_slow(self, now):
        """Takeover: retire a producer whose batch took ``SLOW_FACTOR`` times the median batch
        time (and ``SLOW_FLOOR`` s): hung in a read, say, while its heartbeat goes on."""
        live = self._live()
        usual = sorted(p.batch_s for p in live if p.batch_s is not None)
        if len(usual) < 2:
            return
        median = usual[len(usual) // 2]
        limit = max(SLOW_FLOOR, SLOW_FACTOR * median)
        for p in live:
            took = now - p.working_since
            if p.working in self.tickets and took > limit:
                self.retire(p.rank, f"its batch has taken {took:.1f} s, over {SLOW_FACTOR}x "
                                    f"the usual {median:.3f} s")

    def _held_by(self, peer):
        held = sorted((t.epoch, t.step) for t in peer.entries.values()
                      if t.ticket in self.tickets)
        return f" (it held epoch/step {held})" if held else ""

    def retire(self, rank, why):
        """Takeover: producer ``rank``'s tickets return to the pool for the host's threads,
        and every buffer it was granted and may still write stays quarantined."""
        peer = self.peers[rank]
        peer.retired = True
        self.abort_at_exit = True
        back = []
        for t in peer.entries.values():
            if t.buffer >= 0:
                self.quarantined.add(t.buffer)
            if t.ticket in self.tickets and t.ready is None:
                self._to_host(t)
                back.append(t.ticket)
        peer.entries.clear()
        log.warning("%s is silent (%s): the host takes over its %d batch(es)%s",
                    self.describe(rank), why, len(back),
                    f"; {len(self.quarantined)} window buffer(s) quarantined"
                    if self.quarantined else "")

    def needs_reclaim(self, t):
        """Takeover: ``t`` is awaited next, assigned to a live producer, but no buffer is free
        or will be (the others are quarantined or hold later batches, consumed after it)."""
        return (t.ready is None and bool(self.quarantined) and not self.free
                and t.owner not in (None, LOCAL) and t.buffer < 0)

    def reclaim(self, t):
        """Take ``t`` back from its producer for the host's threads (see needs_reclaim)."""
        peer = self.peers[t.owner]
        self._write_entry(peer, t, CANCELLED)
        peer.entries.pop(t.seq, None)
        self._to_host(t)
        log.info("%s: no window buffer left for epoch %d step %d; the host makes it",
                 self.describe(peer.rank), t.epoch, t.step)

    def _to_host(self, t):
        t.owner, t.seq, t.buffer, t.grant = None, -1, -1, -1
        t.local_only = True
        self.pool = sorted(self.pool + [t.ticket])

    def _free_buffer(self, b):
        if b not in self.quarantined and b not in self.free:
            self.free.append(b)

    def _write_entry(self, peer, t, buffer):
        self.outbox.append((peer.rank, dict(seq=t.seq, ticket=t.ticket, stream=t.stream,
                                            epoch=t.epoch, step=t.step, buffer=buffer,
                                            grant=t.grant)))

    def assign(self):
        live = self._live()
        while self.pool and live:
            # The producer with the most room gets the lowest ticket: work spreads evenly.
            peer = min(live, key=lambda p: (p.next_seq - p.done, p.rank))
            if peer.next_seq - peer.done >= QUEUE:
                return
            i = next((i for i, tk in enumerate(self.pool)
                      if not self.tickets[tk].local_only), None)
            if i is None:
                return
            t = self.tickets[self.pool.pop(i)]
            t.owner, t.seq = peer.rank, peer.next_seq
            peer.next_seq += 1
            peer.entries[t.seq] = t
            self._write_entry(peer, t, WAITING)

    def grant(self):
        if not self.free:
            return
        waiting = sorted(tk for tk, t in self.tickets.items()
                         if t.owner not in (None, LOCAL) and t.buffer < 0 and t.ready is None)
        for tk in waiting[:len(self.free)]:
            t = self.tickets[tk]
            t.buffer, t.grant = self.free.pop(0), self.next_grant
            self.next_grant += 1
            self._write_entry(self.peers[t.owner], t, t.buffer)

    def nap(self, t, now):
        """Seconds the host can sleep before ``t`` may be ready, 0 when it cannot tell: a
        producer's batch time is regular enough to sleep through most of it instead of polling
        (~40 us of CPU each). Every producer at work bounds the nap (the host grants and
        assigns when it finishes); waking late costs latency, not throughput."""
        if t.owner in (None, LOCAL) or t.buffer < 0 or self.peers[t.owner].working != t.ticket:
            return 0.0
        nap = min(NAP_MAX, self.liveness_timeout / 4)
        for p in self._live():
            if p.working < 0:
                continue
            if p.batch_s is None:
                return 0.0
            due = p.working_since + p.batch_s - now
            nap = min(nap, due - NAP_MARGIN * p.batch_s - p.since_error)
        return max(0.0, nap)
