"""The producer end of the transport (group rank >= 1): its assignments and grants as they
appear in its own window, publishing a made batch (payload, Flush, sealed header, Flush), the
heartbeat and the request channel's replies."""
import os
import time

import numpy as np

from ...deadline import deadline_in
from ...errors import ConfigError, PipeTimeout
from ...mpi import wait_request
from .. import wire
from ..wire import (ASSIGN, BUFFER_HEADER, CANCELLED, CONTROL, FAILED, OK, STATUS, HostLayout,
                    ProducerLayout)
from .endpoint import BEAT_EVERY, TAG_REPLY, TAG_REQUEST, Endpoint
from .failures import pack_error


class Work:
    """One assignment a producer holds: make batch ``step`` of ``epoch`` of ``stream``."""

    __slots__ = ("seq", "ticket", "stream", "epoch", "step", "parts", "error", "buffers")

    def __init__(self, entry):
        self.seq, self.ticket, self.stream = entry["seq"], entry["ticket"], entry["stream"]
        self.epoch, self.step = entry["epoch"], entry["step"]
        self.parts = None       # buffers to put, back to back, once granted
        self.error = None       # pickled error record instead
        self.buffers = None     # the producer's own memory holding the parts


class ProducerTransport(Endpoint):
    """Producer end (group rank >= 1), collective at construction with the host's
    :class:`HostTransport`, which sends its settings. Used by one thread, the loop of
    :mod:`dpu_pipe.offload.producer_loop`. ``setup_timeout`` bounds the wait for the host to
    make the window (when its first loader starts iterating) and the shutdown handshake."""

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
        self._pending_replies = []
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

    def stop_requested(self):
        """True once the host wrote stop. Raises PipeTimeout when the host's heartbeat has
        been still for ``host_timeout`` seconds (it polls on every call it makes)."""
        self.win.Sync()
        ctl = wire.intact(self.mem, CONTROL)
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

    def _entry(self, seq):
        """Assignment ``seq`` if its entry is intact and still holds it, else None."""
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
        if e is None or e["buffer"] == CANCELLED:   # None: cancelled, passed and reused
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
        work.error = pack_error(exc, None, self.slot_bytes, self.describe(self.rank))
        work.parts = None

    def requests(self):
        """Requests the host sent, as ``[(id, kind, payload)]``; never blocks."""
        out = []
        while (msg := self.comm.improbe(source=0, tag=TAG_REQUEST)) is not None:
            out.append(msg.recv())
        return out

    def reply(self, rid, ok, value):
        """Answer request ``rid``: ``ok`` and the handler's value, or not ``ok`` and an
        :func:`~dpu_pipe.errors.error_record`."""
        req = self.comm.isend((rid, ok, value), dest=0, tag=TAG_REPLY)
        self._pending_replies = [r for r in self._pending_replies if not r.Test()]
        if not req.Test():
            self._pending_replies.append(req)

    def close(self):
        """Sign off (status stopped), then free the window with the host (deadline)."""
        if self.win is None:
            return
        self.stopped = True
        self.beat(force=True)
        deadline = deadline_in(self.setup_timeout)
        for r in self._pending_replies:
            wait_request(r, deadline, "a reply to the host")
        self._free_window(deadline, f"{self.describe(self.rank)} freeing the window")
