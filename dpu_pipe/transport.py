"""One-sided MPI transport: producer (DPU) ranks put finished batches into slots of a host's
RMA window, in order, with credits, error forwarding and liveness checks.

The payload is opaque here: a producer publishes up to ``slot_bytes`` bytes per step (images
and labels back to back, say) and the host gets a zero-copy ``uint8`` view of them.

Protocol, per host group (a communicator whose rank 0 is the host, the other ranks its
producers):

* The host allocates one window (``MPI.Win.Allocate``, displacement unit 1 byte) laid out as
  ``[control 64 B][producer entries 32 B each, padded to 64][slot 0][slot 1]...``; a slot is a
  64-byte :data:`SLOT_HEADER` followed by ``slot_bytes`` payload bytes rounded up to 64.
* Work is numbered by *tickets* 0, 1, 2, ...; ticket ``t`` lives in slot ``t % slots``. The host
  turns requested ``(epoch, step)`` pairs into tickets in request order and *grants* ticket
  ``t`` once slot ``t % slots`` is free (ticket ``t - slots`` released): it writes epoch/step
  into the slot header, then sets the slot's state word to ``(t, GRANTED)``. Those are the
  credits.
* A producer claims the next ticket with an atomic fetch-and-add on ``next_ticket`` (each ticket
  goes to exactly one producer, fast producers simply claim more), polls the slot's state
  atomically until it reads ``(t, GRANTED)``, reads epoch/step, produces, ``Put``\\ s the
  payload and the header, ``Flush``\\ es, and only then sets the state to ``(t, READY)`` (or
  ``(t, ERROR)`` with a pickled exception as payload). Without the Flush the host can see the
  state before the data.
* The host consumes tickets strictly in order; a ticket finished early waits in its slot.
* Liveness: every producer bumps its ``beat`` counter while it waits and whenever it
  publishes; the host, while it waits, raises :class:`PipeTimeout` naming a producer whose
  beat has not moved for ``liveness_timeout`` seconds. The host bumps ``host_beat`` the same
  way (from its progress thread) so producers do not wait forever on a vanished host.
* Stop: :meth:`Consumer.close` sets ``stop``; producers see it in their next wait, set their
  ``done`` word and return; then every rank frees the window collectively.

Every word that one side writes while the other may read it (state, counters, beats, stop,
the granted epoch/step) is accessed only with MPI atomics (``Rget_accumulate`` with
``REPLACE``, ``SUM`` or ``NO_OP`` on ``MPI.INT64_T``, completed with a deadline); payload and
the producer's header fields are plain ``Put``\\ s ordered before the state word by
``Flush``. That Flush is the one RMA wait without a deadline (MPI has no non-blocking
flush): a producer publishing to a host that stopped making MPI progress blocks there.

Progress: with shared memory the producers' RMA needs nothing from the host. Off-node (or
with MPICH ``MPIR_CVAR_NOLOCAL=1``) remote atomics, and over TCP even ``Put``, complete only
when the host calls into MPI, and a training host does not. ``Consumer(progress="thread")``
runs a helper thread that polls MPI every ``progress_interval`` seconds (needs
``MPI_THREAD_MULTIPLE``, which mpi4py requests by default). ``progress="none"`` leaves it to
the MPI library (MPICH ``MPIR_CVAR_ASYNC_PROGRESS=1``, which spins a core) or to shared memory.

All multi-byte fields are little-endian; hosts (x86-64) and DPUs (aarch64) are both
little-endian machines, which the MPI atomics (native byte order) rely on.
"""
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError, DecodeError, PipeTimeout, ProducerError
from .mpi import load_mpi, mpi_dtype, require_thread_multiple

__all__ = [
    "FORMAT_VERSION", "CONTROL", "PRODUCER_ENTRY", "SLOT_HEADER",
    "EMPTY", "GRANTED", "READY", "ERROR",
    "Layout", "Consumer", "Producer", "Batch", "Work",
    "Roles", "assign_producers", "discover_roles", "host_comm",
]

#: Version of the window layout and slot header; host and producers must agree.
FORMAT_VERSION = 1

_ALIGN = 64

#: Control block at offset 0 of the window (64 bytes).
CONTROL = np.dtype([
    ("next_ticket", "<i8"),   # next ticket to hand out; producers fetch-and-add 1
    ("stop", "<i8"),          # 1 once the host closes
    ("host_beat", "<i8"),     # bumped by the host while it lives
    ("reserved", "<i8", (5,)),
])

#: One entry per producer (comm rank r uses entry r - 1), after the control block (32 bytes).
PRODUCER_ENTRY = np.dtype([
    ("beat", "<i8"),          # bumped while the producer waits and when it publishes
    ("ticket", "<i8"),        # ticket it holds (-1: none yet), for error messages
    ("done", "<i8"),          # 1 once it has seen stop and left its loop
    ("reserved", "<i8"),
])

#: Header at the start of every slot (64 bytes), payload follows at offset 64.
#: ``state`` is ``ticket * 4 + status`` (status EMPTY/GRANTED/READY/ERROR), or -1 before the
#: first grant; ticket and status share one word so a single atomic moves both.
#: ``epoch``/``step`` are written by the host when it grants the slot and echoed back by the
#: producer; ``payload_bytes`` is the number of payload bytes (the pickled error's length
#: when status is ERROR, which ``error_bytes`` also holds).
SLOT_HEADER = np.dtype([
    ("state", "<i8"),
    ("version", "<u4"),
    ("producer", "<i4"),      # producer's rank in the host group
    ("epoch", "<i8"),
    ("step", "<i8"),
    ("payload_bytes", "<i8"),
    ("error_bytes", "<i8"),
    ("ticket", "<i8"),
    ("reserved", "<i8"),
])

assert CONTROL.itemsize == 64 and PRODUCER_ENTRY.itemsize == 32 and SLOT_HEADER.itemsize == 64

#: Slot status codes (low two bits of ``state``).
EMPTY, GRANTED, READY, ERROR = 0, 1, 2, 3

_NO_TICKET = -1
_FIELD = {name: CONTROL.fields[name][1] for name in CONTROL.names}
_ENTRY = {name: PRODUCER_ENTRY.fields[name][1] for name in PRODUCER_ENTRY.names}
_HDR = {name: SLOT_HEADER.fields[name][1] for name in SLOT_HEADER.names}
_I8 = np.dtype("<i8")
# How often waits look at control words and heartbeats, seconds: often enough that close()
# and failure detection feel immediate, rare enough to cost nothing next to a batch.
_CHECK_EVERY = 0.05


def _state(ticket, status):
    return ticket * 4 + status


def _align(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class Layout:
    """Byte offsets of the host window for ``slots`` slots of ``slot_bytes`` payload bytes
    each and ``producers`` producer entries. All offsets are multiples of 64."""

    slots: int
    slot_bytes: int
    producers: int

    entries_offset = CONTROL.itemsize

    @property
    def slots_offset(self):
        return _align(self.entries_offset + self.producers * PRODUCER_ENTRY.itemsize)

    @property
    def slot_stride(self):
        return SLOT_HEADER.itemsize + _align(self.slot_bytes)

    @property
    def total_bytes(self):
        """Bytes the host allocates: its bound on transport memory (slots x slot size)."""
        return self.slots_offset + self.slots * self.slot_stride

    def entry_offset(self, producer):
        """Offset of the entry of the producer with group rank ``producer`` (>= 1)."""
        return self.entries_offset + (producer - 1) * PRODUCER_ENTRY.itemsize

    def slot_offset(self, slot):
        return self.slots_offset + slot * self.slot_stride

    def payload_offset(self, slot):
        return self.slot_offset(slot) + SLOT_HEADER.itemsize


class _Endpoint:
    """What host and producers share: the window, atomics on int64 words, hostnames."""

    def _setup(self, comm, config):
        MPI = self._MPI = load_mpi()
        if sys.byteorder != "little":
            raise ConfigError("the dpu_pipe transport needs little-endian machines")
        self._comm = comm
        self._rank = comm.Get_rank()
        self._closed = False
        self._win = None
        self._int64 = mpi_dtype(_I8)
        config = comm.bcast(config, root=0)
        # Every rank checks every version, so a mismatch fails everywhere at once instead of
        # leaving some ranks inside the collective window allocation.
        idents = comm.allgather((FORMAT_VERSION, socket.gethostname(), os.getpid(),
                                 MPI.COMM_WORLD.Get_rank()))
        versions = sorted({v for v, *_ in idents})
        if versions != [FORMAT_VERSION] or config["version"] != FORMAT_VERSION:
            raise ConfigError(f"transport format versions differ between ranks: {versions}; "
                              "install the same dpu_pipe version on hosts and DPUs")
        self._idents = [tuple(i[1:]) for i in idents]
        self.layout = Layout(config["slots"], config["slot_bytes"], comm.Get_size() - 1)
        self._config = config
        size = self.layout.total_bytes if self._rank == 0 else 0
        self._win = MPI.Win.Allocate(size, 1, comm=comm)
        self._scratch = np.zeros(max(8, 4 * self.layout.producers), _I8)

    def describe(self, rank):
        """Human-readable name of group rank ``rank`` for error messages."""
        host, pid, world = self._idents[rank]
        role = "host" if rank == 0 else "producer"
        return f"{role} rank {rank} (world rank {world} on {host}, pid {pid})"

    # Atomics on int64 words of the host's window. Each one is request-based
    # (Rget_accumulate: its completion means the operation took effect at the host) and
    # completes before the call returns, because the next protocol step depends on it. Unlike
    # Flush, the request can be waited on with a deadline: off-node, RMA to a host that
    # makes no MPI progress at all (stopped, swapped out) would otherwise block forever.
    def _atomic(self, disp, origin, op):
        result = np.empty(origin.size, _I8)
        req = self._win.Rget_accumulate(origin, result, 0,
                                        target=(disp, origin.size, self._int64), op=op)
        if not req.Test():
            start = time.monotonic()
            backoff = _Backoff(self._poll)
            while not req.Test():
                if time.monotonic() - start > self._rma_timeout:
                    raise PipeTimeout(
                        f"{self.describe(0)} stopped answering: an atomic on its window "
                        f"(byte {disp}) did not complete within {self._rma_timeout:g} s "
                        f"(issued by {self.describe(self._rank)})")
                backoff()
        return result

    def _read(self, disp, count=1):
        return self._atomic(disp, self._scratch[:count], self._MPI.NO_OP)

    def _write(self, disp, values):
        self._atomic(disp, np.ascontiguousarray(values, _I8), self._MPI.REPLACE)

    def _add(self, disp, value=1):
        return int(self._atomic(disp, np.array([value], _I8), self._MPI.SUM)[0])

    def _free_window(self):
        win, self._win = self._win, None
        if win is not None:
            try:
                win.Unlock_all()
            finally:
                win.Free()


class _Backoff:
    """Poll pacing for waits: tight at first (a batch about to land), then sleeps doubling
    up to ``longest`` seconds so a long wait costs little CPU."""

    def __init__(self, longest):
        self.longest = longest
        self.delay = 0.0

    def __call__(self):
        if self.delay:
            time.sleep(self.delay)
        self.delay = min(self.longest, max(2e-5, self.delay * 2))


class _Progress(threading.Thread):
    """Host helper that calls into MPI every ``interval`` seconds, so remote atomics and
    Puts complete while the training thread runs Python/C code without MPI calls, and
    bumps ``host_beat`` every ``_CHECK_EVERY`` seconds."""

    def __init__(self, comm, interval, beat):
        super().__init__(name="dpu_pipe-mpi-progress", daemon=True)
        self._comm, self._interval, self._beat = comm, interval, beat
        self._halt = threading.Event()
        self.error = None

    def run(self):
        MPI = load_mpi()
        last = 0.0
        try:
            while not self._halt.wait(self._interval):
                self._comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
                now = time.monotonic()
                if now - last >= _CHECK_EVERY:
                    self._beat()
                    last = now
        except BaseException as exc:  # surfaced by the consumer's next call
            self.error = exc

    def stop(self, timeout):
        self._halt.set()
        self.join(timeout)


@dataclass(frozen=True)
class Work:
    """A ticket a producer holds: produce batch ``step`` of ``epoch`` into ``slot``."""

    ticket: int
    epoch: int
    step: int
    slot: int


class Batch:
    """One delivered step on the host.

    ``payload`` is a 1-D ``uint8`` view of ``payload_bytes`` bytes inside the window (zero
    copy); it stays valid until :meth:`release`, after which a producer may overwrite it.
    ``producer`` is the group rank that produced it. Use as a context manager to release
    on exit.
    """

    __slots__ = ("epoch", "step", "ticket", "producer", "payload", "_consumer")

    def __init__(self, consumer, epoch, step, ticket, producer, payload):
        self._consumer = consumer
        self.epoch, self.step, self.ticket = epoch, step, ticket
        self.producer, self.payload = producer, payload

    def release(self):
        """Give the slot back so the host can grant it to a later step."""
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            consumer._release(self.ticket)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __repr__(self):
        return (f"Batch(epoch={self.epoch}, step={self.step}, ticket={self.ticket}, "
                f"producer={self.producer}, bytes={self.payload.nbytes})")


class Consumer(_Endpoint):
    """Host end of the transport. Collective over ``comm``: the host is rank 0, every other
    rank must construct a :class:`Producer` at the same time. One thread uses a Consumer;
    its progress thread is internal.

    Typical loop::

        with Consumer(comm, slots=4, slot_bytes=nbytes) as consumer:
            for step in range(steps):
                consumer.request(epoch, step)
            for step in range(steps):
                with consumer.get() as batch:   # waits, raises producer errors
                    train(batch.payload)        # zero-copy view, valid inside the block

    Parameters
    ----------
    comm : mpi4py Intracomm
        The host group (see :func:`host_comm`); rank 0 is this host.
    slots : int
        K, number of batch slots (>= 1): how many steps may be in flight or waiting.
    slot_bytes : int
        Payload capacity of one slot in bytes (e.g. 256*224*224*3 + 256*8 for uint8 images
        plus int64 labels). Host memory is ``Layout.total_bytes`` ~ ``slots * slot_bytes``.
    timeout : float
        Default seconds :meth:`get` waits for one step before :class:`PipeTimeout`.
    liveness_timeout : float
        Seconds without a heartbeat after which a producer counts as dead or hung. Must
        exceed the longest time a producer spends on one batch without calling
        :meth:`Producer.beat`.
    host_timeout : float or None
        Seconds without the host's heartbeat after which producers give up (default 120 s
        with the progress thread, else 3600 s, since then the host beats only inside calls).
    progress : "thread" or "none"
        Who makes MPI progress while the host computes (see module docstring).
    progress_interval : float
        Seconds between the progress thread's MPI polls (CPU cost vs. delivery latency).
    poll_interval : float
        Longest sleep between two polls of a waiting call, seconds.
    """

    def __init__(self, comm, *, slots, slot_bytes, timeout=600.0, liveness_timeout=60.0,
                 host_timeout=None, progress="thread", progress_interval=5e-4,
                 poll_interval=1e-3):
        if comm.Get_rank() != 0:
            raise ConfigError("the Consumer must be rank 0 of its host group; "
                              "other ranks construct a Producer")
        if int(slots) < 1 or int(slot_bytes) < 0:
            raise ConfigError(f"need slots >= 1 and slot_bytes >= 0, got {slots}, {slot_bytes}")
        if progress not in ("thread", "none"):
            raise ConfigError(f"progress must be 'thread' or 'none', got {progress!r}")
        if min(timeout, liveness_timeout, progress_interval, poll_interval) <= 0:
            raise ConfigError("timeouts and intervals must be positive seconds")
        if progress == "thread":
            require_thread_multiple("Consumer(progress='thread')")
        if host_timeout is None:
            host_timeout = 120.0 if progress == "thread" else 3600.0
        self.timeout = float(timeout)
        self.liveness_timeout = float(liveness_timeout)
        self._poll = float(poll_interval)
        self._rma_timeout = self.timeout  # atomics on our own window complete locally
        config = dict(version=FORMAT_VERSION, slots=int(slots), slot_bytes=int(slot_bytes),
                      liveness_timeout=self.liveness_timeout, host_timeout=float(host_timeout),
                      poll_interval=self._poll)
        self._progress = None
        self._pcomm = None
        self._broken = None
        self._setup(comm, config)
        try:
            self._init_window()
            self._pcomm = comm.Dup()  # collective: producers dup too, see Producer
            if progress == "thread":
                self._progress = _Progress(self._pcomm, float(progress_interval), self._beat)
                self._progress.start()
        except BaseException:
            self._free_window()
            raise
        L = self.layout
        self._requests = deque()          # (epoch, step) not yet granted
        self._granted = 0                 # next ticket to grant
        self._next = 0                    # next ticket to deliver
        self._slot_ticket = [None] * L.slots   # ticket occupying each slot until released
        self._assigned = {}               # ticket -> (epoch, step), while granted
        self._beats = np.zeros(L.producers, _I8)
        self._beat_seen = np.full(L.producers, time.monotonic())
        self._observed = time.monotonic()
        self._last_check = 0.0

    def _init_window(self):
        L, win = self.layout, self._win
        win.Lock_all()
        mem = np.frombuffer(win.tomemory(), np.uint8)
        mem[:L.slots_offset] = 0
        for r in range(1, L.producers + 1):
            mem[L.entry_offset(r) + _ENTRY["ticket"]:][:8].view(_I8)[0] = _NO_TICKET
        for j in range(L.slots):
            mem[L.slot_offset(j):][:SLOT_HEADER.itemsize] = 0
            mem[L.slot_offset(j):][:8].view(_I8)[0] = -1
        win.Sync()
        self._mem = mem
        self._comm.Barrier()  # producers start accessing the window after this

    # -- host heartbeat -------------------------------------------------------------------
    def _poke(self):
        # Atomics on our own window complete without entering MPI's progress engine, so a
        # waiting host pokes it, else producers' RMA would stall with progress="none".
        self._pcomm.Iprobe(self._MPI.ANY_SOURCE, self._MPI.ANY_TAG)

    def _beat(self):
        self._add(_FIELD["host_beat"])

    # -- requests and credits -------------------------------------------------------------
    def request(self, epoch, step):
        """Ask for batch ``step`` of ``epoch``; steps are delivered by :meth:`get` in the
        order they were requested. Granted to a producer as soon as a slot is free."""
        self._check_usable()
        self._requests.append((int(epoch), int(step)))
        self._grant()

    def _grant(self):
        L = self.layout
        while self._requests and self._slot_ticket[self._granted % L.slots] is None:
            ticket, slot = self._granted, self._granted % L.slots
            epoch, step = self._requests.popleft()
            base = L.slot_offset(slot)
            self._write(base + _HDR["epoch"], [epoch, step])
            self._write(base + _HDR["state"], [_state(ticket, GRANTED)])
            self._slot_ticket[slot] = ticket
            self._assigned[ticket] = (epoch, step)
            self._granted += 1

    def _release(self, ticket):
        slot = ticket % self.layout.slots
        if self._slot_ticket[slot] != ticket:
            return
        self._slot_ticket[slot] = None
        self._assigned.pop(ticket, None)
        if not self._closed:
            self._grant()

    @property
    def pending(self):
        """Number of requested steps not yet delivered by :meth:`get`."""
        return self._granted + len(self._requests) - self._next

    # -- delivery -------------------------------------------------------------------------
    def get(self, timeout=None):
        """The next requested step, as a :class:`Batch` (release it when done).

        Waits at most ``timeout`` seconds (default: the consumer's ``timeout``). Raises
        :class:`PipeTimeout` when the step does not arrive in time or a producer stops
        answering (naming it), the producer's :class:`DecodeError` (with a note and a
        :class:`ProducerError` cause naming the producer) or :class:`ProducerError` when the
        producer published an error for this step, :class:`ConfigError` when nothing is
        requested or every slot holds an unreleased batch.
        """
        self._check_usable()
        ticket, L = self._next, self.layout
        if ticket >= self._granted:
            if self._requests:
                raise ConfigError(f"all {L.slots} slots hold batches that were not released; "
                                  "release() one before the next get()")
            raise ConfigError("get() with no step requested: call request(epoch, step) first")
        if not L.producers:
            raise ConfigError("this host group has no producer ranks")
        slot = ticket % L.slots
        base = L.slot_offset(slot)
        epoch, step = self._assigned[ticket]
        wait = self.timeout if timeout is None else float(timeout)
        start = time.monotonic()
        backoff = _Backoff(self._poll)
        while True:
            state = int(self._read(base + _HDR["state"])[0])
            if state in (_state(ticket, READY), _state(ticket, ERROR)):
                break
            now = time.monotonic()
            if now - self._last_check >= _CHECK_EVERY:
                self._last_check = now
                self._beat()
                self._check_producers(f"waiting for step {step} of epoch {epoch}")
                if self._progress is not None and self._progress.error is not None:
                    raise ProducerError("the MPI progress thread failed",
                                        producer="host") from self._progress.error
            if now - start > wait:
                holder = self._holder(ticket)
                raise PipeTimeout(f"step {step} of epoch {epoch} (ticket {ticket}) not delivered "
                                  f"within {wait:g} s; {holder}")
            self._poke()
            backoff()
        self._win.Sync()  # make the producer's flushed Puts visible to our loads
        header = self._mem[base:base + SLOT_HEADER.itemsize].view(SLOT_HEADER)[0]
        self._next += 1
        who = int(header["producer"])
        name = self.describe(who) if 1 <= who <= L.producers else f"producer rank {who}"
        problem = self._header_problem(header, ticket, epoch, step)
        if problem:
            self._release(ticket)
            raise ProducerError(f"slot {slot} holds a corrupt header: {problem}", producer=name)
        nbytes = int(header["payload_bytes"])
        payload = self._mem[L.payload_offset(slot):][:nbytes]
        if state == _state(ticket, ERROR):
            blob = bytes(payload)
            self._release(ticket)
            _raise_remote(blob, name, epoch, step)
        return Batch(self, epoch, step, ticket, who, payload)

    def _header_problem(self, header, ticket, epoch, step):
        if int(header["version"]) != FORMAT_VERSION:
            return f"format version {int(header['version'])}, expected {FORMAT_VERSION}"
        if int(header["ticket"]) != ticket:
            return f"ticket {int(header['ticket'])}, expected {ticket}"
        if (int(header["epoch"]), int(header["step"])) != (epoch, step):
            return (f"epoch/step {int(header['epoch'])}/{int(header['step'])}, "
                    f"expected {epoch}/{step}")
        if not 0 <= int(header["payload_bytes"]) <= self.layout.slot_bytes:
            return f"payload_bytes {int(header['payload_bytes'])} > slot_bytes"
        return None

    def _entries(self):
        L = self.layout
        return self._read(L.entries_offset, 4 * L.producers).reshape(L.producers, 4)

    def _holder(self, ticket):
        entries = self._entries()
        held = [r + 1 for r in range(self.layout.producers) if entries[r, 1] == ticket]
        if held:
            return f"it is held by {self.describe(held[0])}"
        return "no producer has claimed it yet"

    def _check_producers(self, doing):
        """Raise PipeTimeout naming the producers whose heartbeat has been still for
        ``liveness_timeout`` seconds, longest silent first; marks the consumer broken (the window cannot be freed
        collectively without that rank)."""
        entries = self._entries()
        now = time.monotonic()
        if now - self._observed > 10 * _CHECK_EVERY:
            # The host was away (training, no MPI calls). Without a progress thread remote
            # beats may have been stuck waiting for it, so silence counts only from now.
            self._beat_seen[:] = now
        self._observed = now
        moved = entries[:, 0] != self._beats
        self._beats[moved] = entries[moved, 0]
        self._beat_seen[moved] = now
        silent = now - self._beat_seen
        dead = np.flatnonzero((silent > self.liveness_timeout) & (entries[:, 2] == 0))
        if dead.size == 0:
            return
        # Longest silent first: a stopped rank can stall others that share a channel with it
        # (same DPU, shared memory), and those fall silent after it.
        dead = dead[np.argsort(-silent[dead], kind="stable")]
        r = int(dead[0])
        ticket = int(entries[r, 1])
        held = (f"; it held step {self._assigned[ticket][1]} of epoch "
                f"{self._assigned[ticket][0]}" if ticket in self._assigned else "")
        others = "".join(f"; also silent for {silent[o]:.1f} s: {self.describe(int(o) + 1)}"
                         for o in dead[1:])
        self._broken = (f"{self.describe(r + 1)} stopped answering: no heartbeat for "
                        f"{silent[r]:.1f} s (liveness_timeout {self.liveness_timeout:g} s) "
                        f"while the host was {doing}{held}{others}")
        raise PipeTimeout(self._broken)

    def _check_usable(self):
        if self._closed:
            raise ConfigError("the consumer is closed")
        if self._broken:
            raise PipeTimeout(f"the transport is broken: {self._broken}")

    # -- shutdown -------------------------------------------------------------------------
    def close(self):
        """Tell producers to stop, wait (bounded by ``liveness_timeout``) until each has
        left its loop, stop the progress thread and free the window (collective).

        After a producer stopped answering the window is left allocated: freeing it is
        collective and would wait for the dead rank forever; the job is expected to end
        with the exception (``python -m mpi4py`` aborts it). Batches' payload views are
        invalid after close.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if not self._broken:
                self._write(_FIELD["stop"], [1])
                self._wait_done()
        finally:
            if self._progress is not None:
                self._progress.stop(timeout=5.0)
            if not self._broken:
                self._pcomm.Free()
                self._free_window()

    def _wait_done(self):
        L = self.layout
        backoff = _Backoff(self._poll)
        while True:
            entries = self._entries()
            if L.producers == 0 or bool(np.all(entries[:, 2] == 1)):
                return
            now = time.monotonic()
            if now - self._last_check >= _CHECK_EVERY:
                self._last_check = now
                self._beat()
                self._check_producers("closing")
            self._poke()
            backoff()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and self._broken is None and isinstance(exc, PipeTimeout):
            # The host gave up waiting: a producer may be stuck mid-batch, so a clean
            # collective shutdown cannot be promised either.
            self._broken = str(exc)
        self.close()


class Producer(_Endpoint):
    """Producer end of the transport, on every rank of ``comm`` except 0 (the host).
    Collective with the host's :class:`Consumer`; all settings come from the host.

    Typical loop::

        with Producer(comm) as producer:
            producer.serve(lambda work: make_batch(work.epoch, work.step))
    """

    def __init__(self, comm):
        if comm.Get_rank() == 0:
            raise ConfigError("rank 0 of a host group is the host: construct a Consumer there")
        self._setup(comm, None)
        cfg = self._config
        self.liveness_timeout = cfg["liveness_timeout"]
        self.host_timeout = cfg["host_timeout"]
        self._poll = cfg["poll_interval"]
        self._rma_timeout = self.host_timeout
        self._stopped = False
        self._entry = self.layout.entry_offset(self._rank)
        try:
            comm.Barrier()            # the host has initialized the window
            self._win.Lock_all()
            self._pcomm = comm.Dup()  # matches the host's progress communicator
        except BaseException:
            self._free_window()
            raise
        self._last_beat = 0.0
        self.last_publish_ns = 0
        self._host_beat = None
        self._host_seen = time.monotonic()
        self._write(self._entry + _ENTRY["beat"], [1])

    # -- liveness ---------------------------------------------------------------------------
    def beat(self, force=False):
        """Tell the host this producer is alive. Cheap; call it inside batches that take
        longer than a fraction of ``liveness_timeout``. Rate-limited unless ``force``."""
        now = time.monotonic()
        if force or now - self._last_beat >= _CHECK_EVERY:
            self._last_beat = now
            self._add(self._entry + _ENTRY["beat"])

    def _control(self, doing):
        """Beat, read the control block; True when the host asked to stop. Raises
        PipeTimeout when the host's heartbeat has been still for ``host_timeout``."""
        self.beat(force=True)
        ctrl = self._read(0, 3)
        now = time.monotonic()
        if ctrl[2] != self._host_beat:
            self._host_beat, self._host_seen = int(ctrl[2]), now
        elif now - self._host_seen > self.host_timeout:
            raise PipeTimeout(f"{self.describe(0)} stopped answering: no heartbeat for "
                              f"{now - self._host_seen:.1f} s while {self.describe(self._rank)} "
                              f"was {doing}")
        if ctrl[1]:
            self._finish()
            return True
        return False

    def _finish(self):
        if not self._stopped:
            self._stopped = True
            self._write(self._entry + _ENTRY["done"], [1])

    # -- work -----------------------------------------------------------------------------
    def claim(self):
        """Claim the next ticket and wait until the host grants its slot.

        Returns a :class:`Work`, or None once the host has asked producers to stop (then
        the producer has signed off; only :meth:`close` remains).
        """
        if self._stopped or self._control("claiming"):
            return None
        L = self.layout
        ticket = self._add(_FIELD["next_ticket"])
        self._write(self._entry + _ENTRY["ticket"], [ticket])
        slot = ticket % L.slots
        base = L.slot_offset(slot)
        want = _state(ticket, GRANTED)
        backoff = _Backoff(self._poll)
        last = time.monotonic()
        while int(self._read(base + _HDR["state"])[0]) != want:
            now = time.monotonic()
            if now - last >= _CHECK_EVERY:
                last = now
                if self._control(f"waiting for a credit for ticket {ticket}"):
                    return None
            backoff()
        epoch, step = (int(v) for v in self._read(base + _HDR["epoch"], 2))
        return Work(ticket, epoch, step, slot)

    def publish(self, work, *parts):
        """Deliver the payload of ``work``: the buffers in ``parts`` are placed back to back
        at the start of the slot's payload area (total at most ``slot_bytes``)."""
        views = []
        for p in parts:
            view = memoryview(p)
            if not view.c_contiguous:
                raise ConfigError(f"payload parts must be C-contiguous buffers, got {view.shape} "
                                  f"with strides {view.strides}")
            views.append(view.cast("B"))
        total = sum(v.nbytes for v in views)
        if total > self.layout.slot_bytes:
            raise ConfigError(f"payload of {total} bytes does not fit a slot of "
                              f"{self.layout.slot_bytes} bytes")
        t0 = time.perf_counter_ns()
        offset = self.layout.payload_offset(work.slot)
        for v in views:
            if v.nbytes:
                self._win.Put(v, 0, target=(offset, v.nbytes, self._MPI.BYTE))
            offset += v.nbytes
        self._post(work, READY, total, 0)
        #: Nanoseconds the last publish took (Put, Flush, status update).
        self.last_publish_ns = time.perf_counter_ns() - t0

    def publish_error(self, work, exc, tb_text=None):
        """Deliver an error for ``work`` instead of a payload: the exception (pickled when
        it can be) and its traceback text, truncated to fit the slot. The host raises it."""
        if tb_text is None:
            tb_text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        blob = _pack_error(exc, tb_text, self.layout.slot_bytes,
                           self.describe(self._rank))
        if blob:
            self._win.Put(np.frombuffer(blob, np.uint8), 0,
                          target=(self.layout.payload_offset(work.slot), len(blob),
                                  self._MPI.BYTE))
        self._post(work, ERROR, len(blob), len(blob))

    def _post(self, work, status, payload_bytes, error_bytes):
        header = np.zeros(1, SLOT_HEADER)
        header["version"] = FORMAT_VERSION
        header["producer"] = self._rank
        header["epoch"], header["step"] = work.epoch, work.step
        header["payload_bytes"], header["error_bytes"] = payload_bytes, error_bytes
        header["ticket"] = work.ticket
        raw = header.view(np.uint8)[8:]  # everything but the state word
        base = self.layout.slot_offset(work.slot)
        self._win.Put(raw, 0, target=(base + 8, raw.nbytes, self._MPI.BYTE))
        # Data must be complete at the host before the state says READY (measured: without
        # this Flush the host can read the state first).
        self._win.Flush(0)
        self._write(base + _HDR["state"], [_state(work.ticket, status)])
        self.beat(force=True)

    def serve(self, produce):
        """Claim, produce and publish until the host stops the stream.

        ``produce(work)`` returns a buffer or a tuple/list of buffers (placed back to back).
        An exception from it is published to the host for that step (and serving goes on);
        exceptions of the transport itself propagate. Returns the number of steps this
        producer handled.
        """
        count = 0
        while (work := self.claim()) is not None:
            try:
                out = produce(work)
            except Exception as exc:
                self.publish_error(work, exc)
            else:
                parts = out if isinstance(out, (tuple, list)) else (out,)
                self.publish(work, *parts)
            count += 1
        return count

    def close(self):
        """Wait for the host's stop (bounded by the host's heartbeat), sign off, free the
        window (collective with the host's :meth:`Consumer.close`)."""
        if self._closed:
            return
        self._closed = True
        backoff = _Backoff(self._poll)
        last = 0.0
        while not self._stopped:
            now = time.monotonic()
            if now - last >= _CHECK_EVERY:
                last = now
                self._control("closing")
            if not self._stopped:
                backoff()
        self._pcomm.Free()
        self._free_window()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            # Waiting here for the host's stop would hold back the error; let it propagate
            # (python -m mpi4py aborts the job) and leave the window to the abort.
            self._closed = True


# -- errors across the wire -------------------------------------------------------------------
def _pack_error(exc, tb_text, capacity, who):
    """Pickle ``exc`` and its traceback text into at most ``capacity`` bytes, dropping the
    exception object and trimming the traceback's head (its last frames say the most) and the
    message as needed. Returns b"" when not even a minimal record fits."""
    try:
        exc_blob = pickle.dumps(exc, protocol=4)
        pickle.loads(exc_blob)  # some exceptions pickle but do not unpickle
    except Exception:
        exc_blob = None
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    message = str(exc)

    def pack(exc_blob, tb, msg):
        return pickle.dumps({"type": kind, "message": msg, "traceback": tb, "exc": exc_blob,
                             "where": who}, protocol=4)

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


# -- roles -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Roles:
    """Who is who in a communicator: ``hosts`` and ``producers`` are rank tuples (ascending),
    ``host_of`` maps each producer rank to its host rank, ``hostnames`` lists every rank's
    hostname. ``rank``/``role`` describe the calling rank."""

    hosts: tuple
    producers: tuple
    host_of: dict
    hostnames: tuple
    rank: int
    role: str

    def producers_of(self, host):
        """Producer ranks served by host rank ``host``, ascending."""
        return tuple(p for p in self.producers if self.host_of[p] == host)

    @property
    def my_host(self):
        """The host rank of the calling rank (itself when it is a host)."""
        return self.rank if self.role == "host" else self.host_of[self.rank]


def _short(name):
    return name.split(".", 1)[0]


def _extends(dpu, host):
    """True when hostname ``dpu`` is ``host`` plus a suffix after '-' or '_' (node01 ->
    node01-dpu, node01_bf2), compared on short names so domains do not matter."""
    dpu, host = _short(dpu), _short(host)
    return len(dpu) > len(host) + 1 and dpu.startswith(host) and dpu[len(host)] in "-_"


def assign_producers(roles, hostnames):
    """Map producers to hosts. ``roles[r]`` is "host" or "producer", ``hostnames[r]`` the
    hostname of rank r. Returns ``{producer rank: host rank}``.

    A producer goes to a host on the same hostname if there is one, else to a host whose
    hostname its own extends (the DPU of that node; the longest such host name wins), else
    anywhere. Among candidates the host with the fewest producers so far wins (then the
    lowest rank), so producers spread evenly; unmatched producers are placed last.
    """
    hosts = [r for r, role in enumerate(roles) if role == "host"]
    if not hosts:
        raise ConfigError("no rank declared the role 'host'")
    load = {h: 0 for h in hosts}
    host_of, unmatched = {}, []

    def place(p, candidates):
        h = min(candidates, key=lambda h: (load[h], h))
        load[h] += 1
        host_of[p] = h

    for p, role in enumerate(roles):
        if role != "producer":
            continue
        same = [h for h in hosts if hostnames[h] == hostnames[p]]
        if not same:
            ext = [h for h in hosts if _extends(hostnames[p], hostnames[h])]
            if ext:
                longest = max(len(_short(hostnames[h])) for h in ext)
                same = [h for h in ext if len(_short(hostnames[h])) == longest]
        if same:
            place(p, same)
        else:
            unmatched.append(p)
    for p in unmatched:
        place(p, hosts)
    return host_of


def discover_roles(comm, role, *, hostname=None):
    """Collective: every rank of ``comm`` declares ``role`` ("host" or "producer"); returns
    the same :class:`Roles` on every rank. ``hostname`` defaults to ``socket.gethostname()``.
    Raises :class:`ConfigError` on every rank when any role is invalid or no host exists."""
    hostname = socket.gethostname() if hostname is None else str(hostname)
    table = comm.allgather((role, hostname))
    roles = [r for r, _ in table]
    bad = sorted({repr(r) for r in roles if r not in ("host", "producer")})
    if bad:
        raise ConfigError(f"roles must be 'host' or 'producer', got {', '.join(bad)}")
    hostnames = tuple(h for _, h in table)
    host_of = assign_producers(roles, hostnames)
    return Roles(hosts=tuple(r for r, x in enumerate(roles) if x == "host"),
                 producers=tuple(r for r, x in enumerate(roles) if x == "producer"),
                 host_of=host_of, hostnames=hostnames, rank=comm.Get_rank(), role=role)


def host_comm(comm, roles):
    """Collective: split ``comm`` into one communicator per host, the host as rank 0 and its
    producers after it in rank order. Each rank gets its own group's communicator."""
    me = comm.Get_rank()
    host = roles.my_host
    return comm.Split(color=roles.hosts.index(host), key=0 if me == host else me + 1)
