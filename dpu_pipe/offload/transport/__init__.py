"""One-sided MPI transport between a host (rank 0 of a host group) and its producer ranks.

:mod:`~dpu_pipe.offload.transport.endpoint` (start-up and window I/O, both ends),
:mod:`~dpu_pipe.offload.transport.host` (the host end around the pure
:class:`~dpu_pipe.offload.scheduler.Scheduler`), :mod:`~dpu_pipe.offload.transport.producer`
(the producer end) and :mod:`~dpu_pipe.offload.transport.failures` (errors across the wire).
One window per host group, kept for the job; after start-up everything is ``Put``, ``Flush``
and non-blocking point-to-point messages, and every wait has a deadline. The protocol
(tickets, grants, heartbeats, cancellation, liveness, shutdown) is described in
docs/design/transport.md.
"""
from ..wire import CANCELLED, FAILED, OK
from .failures import pack_error, raise_remote
from .host import Delivery, HostTransport, RemoteError, Reply
from .producer import ProducerTransport, Work

__all__ = ["HostTransport", "ProducerTransport", "Delivery", "Reply", "RemoteError", "Work",
           "OK", "FAILED", "CANCELLED", "pack_error", "raise_remote"]
