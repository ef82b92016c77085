"""One-sided MPI transport between a host (rank 0 of a host group) and its producer ranks.

Modules: :mod:`~dpu_pipe.offload.transport.endpoint` (start-up and window I/O, both ends),
:mod:`~dpu_pipe.offload.transport.host` (the host end around the pure
:class:`~dpu_pipe.offload.scheduler.Scheduler`), :mod:`~dpu_pipe.offload.transport.producer`
(the producer end) and :mod:`~dpu_pipe.offload.transport.failures` (errors across the wire).

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
* Requests of any other kind (stream requests, pings, validation work) travel as pickled
  point-to-point messages: see :meth:`HostTransport.request` and
  :mod:`dpu_pipe.offload.producer_loop`.

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
from ..scheduler import LOCAL
from ..wire import CANCELLED, FAILED, OK
from .endpoint import BEAT_EVERY, TAG_REPLY, TAG_REQUEST
from .failures import pack_error, raise_remote
from .host import Delivery, HostTransport, RemoteError, Reply
from .producer import ProducerTransport, Work

__all__ = ["HostTransport", "ProducerTransport", "Delivery", "Reply", "RemoteError", "Work",
           "TAG_REQUEST", "TAG_REPLY", "BEAT_EVERY", "LOCAL", "OK", "FAILED", "CANCELLED",
           "pack_error", "raise_remote"]
