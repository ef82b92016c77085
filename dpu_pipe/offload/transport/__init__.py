"""One-sided MPI transport between a host (rank 0 of a host group) and its producer ranks:
``endpoint`` (both ends), ``host``, ``producer`` and ``failures`` (errors across the wire).
The protocol: docs/design/transport.md."""
from ..wire import CANCELLED, FAILED, OK
from .failures import pack_error, raise_remote
from .host import Delivery, HostTransport, RemoteError, Reply
from .producer import ProducerTransport, Work

__all__ = ["HostTransport", "ProducerTransport", "Delivery", "Reply", "RemoteError", "Work",
           "OK", "FAILED", "CANCELLED", "pack_error", "raise_remote"]
