"""One-sided MPI transport between a host (rank 0 of a host group) and its producer ranks:
``endpoint`` (start-up and window I/O, both ends), ``host`` (the host end around the pure
:class:`~dpu_pipe.offload.scheduler.Scheduler`), ``producer`` (the producer end) and
``failures`` (errors across the wire). The protocol (tickets, grants, heartbeats,
cancellation, liveness, shutdown) is described in docs/design/transport.md.
"""
from ..wire import CANCELLED, FAILED, OK
from .failures import pack_error, raise_remote
from .host import Delivery, HostTransport, RemoteError, Reply
from .producer import ProducerTransport, Work

__all__ = ["HostTransport", "ProducerTransport", "Delivery", "Reply", "RemoteError", "Work",
           "OK", "FAILED", "CANCELLED", "pack_error", "raise_remote"]
