"""A host process's place in the MPI job: its host group (this host and the producer ranks
serving it, from the host's MPI job or the producer job of a serve file), made on first use
and kept for the process lifetime, with the transport and the validation channel that
offloaded loaders and RemoteValidation share.
"""
import atexit
import logging

from ..device import PinnedRegion
from ..errors import ConfigError
from ..mpi import load_mpi
from . import rendezvous
from .channel import Channel
from .roles import discover_roles, host_comm
from .transport import HostTransport

__all__ = ["HostGroup", "host_group", "started_group", "shutdown"]

log = logging.getLogger("dpu_pipe")


def host_group(comm=None, *, hostmap=None, serve_file=None):
    """This host process's :class:`HostGroup` over ``comm`` (default ``COMM_WORLD``), started
    on first use collectively with every rank of ``comm``: every host calls it (or builds its
    first offloaded loader) at the same point of its program. Without ``comm``, a serve file
    (``serve_file``, else ``DPU_PIPE_SERVE``) joins the producer job that published it
    instead (:mod:`dpu_pipe.offload.rendezvous`)."""
    MPI = load_mpi()
    path = rendezvous.serve_file(serve_file) if comm is None else None
    if path is None and comm is None:
        comm = MPI.COMM_WORLD
    key = ("serve", path) if path is not None else comm.py2f()
    if key not in HostGroup._groups:
        HostGroup._groups[key] = HostGroup(comm, hostmap=hostmap, serve_file=path)
    return HostGroup._groups[key]


def started_group():
    """The one host group this process started (by an offloaded loader,
    :class:`~dpu_pipe.offload.validation.RemoteValidation` or
    :func:`dpu_pipe.distributed.init_process_group`), else None; calls no MPI."""
    groups = list(HostGroup._groups.values())
    return groups[0] if len(groups) == 1 else None


def shutdown():
    """Stop the producers of every host group of this process (also done at exit)."""
    for group in list(HostGroup._groups.values()):
        group.close()


class HostGroup:
    """This host's place in the job: its group (rank 0 = this host, then its producers), its
    index among the hosts, and the :attr:`transport`. ``producers`` is the number of producer
    ranks serving this host (0: no transport, loaders produce locally)."""

    _groups = {}

    def __init__(self, comm, *, hostmap=None, setup_timeout=60.0, serve_file=None):
        self.serve_file = serve_file
        if serve_file is not None:
            roles, self.group = rendezvous.join(serve_file, hostmap=hostmap, timeout=600.0)
        else:
            roles = discover_roles(comm, "host", hostmap=hostmap, timeout=600.0)
            self.group = host_comm(comm, roles)
        self.roles = roles
        self.validation = Channel(self.group, "host")
        self.host_index = roles.hosts.index(roles.rank)
        self.num_hosts = len(roles.hosts)
        self.producers = self.group.Get_size() - 1
        self.setup_timeout = setup_timeout
        self._transport = None
        self._setup_failed = None
        self._want = (1, 0)          # (buffers, slot_bytes): the largest loader's needs
        self.active = None          # the engine whose tickets are in flight
        self._pinned = None         # the window as pinned memory, once a loader has a device
        self.next_stream = 1
        self.open = True
        atexit.register(self.close)

    def reserve(self, buffers, slot_bytes):
        """Size the window for a loader of ``buffers`` batches of ``slot_bytes`` bytes
        (before the window exists; it is made when first needed)."""
        self._want = (max(self._want[0], buffers), max(self._want[1], slot_bytes))

    @property
    def transport(self):
        """The :class:`~dpu_pipe.offload.transport.HostTransport`, made on first use with
        the largest buffer count and batch size reserved so far (collective with this
        host's producers, which wait for it from their start)."""
        if self._transport is None and self.producers:
            if self._setup_failed is not None:
                raise ConfigError(f"the host window could not be made: {self._setup_failed}")
            buffers, slot_bytes = self._want
            try:
                self._transport = HostTransport(self.group, buffers=buffers,
                                                slot_bytes=slot_bytes,
                                                setup_timeout=self.setup_timeout)
            except BaseException as exc:
                # The producers are stuck in the same start-up: the job has to end, and
                # close() must not try again (python -m mpi4py aborts on the exception).
                self._setup_failed = exc
                raise
        return self._transport

    def activate(self, engine):
        """Make ``engine`` (an :class:`~dpu_pipe.engines.offload.OffloadEngine`) the stream in
        flight, cancelling the previous one's work; its takeover and liveness timeout become
        the transport's."""
        if self.active is not None and self.active is not engine:
            self.active.suspend()
        self.active = engine
        self.transport.configure(engine.takeover, engine.liveness_timeout)

    def deactivate(self, engine):
        if self.active is engine:
            self.active = None

    def grow(self, buffers, slot_bytes):
        """Make the window again for a loader larger than the window (collective with the
        producers, after the stream in flight is cancelled and its held batch released)."""
        if self.active is not None:
            self.active.suspend()
        self.reserve(buffers, slot_bytes)
        log.info("dpu_pipe: making the host window again for %d x %d bytes", *self._want)
        self._transport.resize(*self._want)

    def pinned_window(self, out, timeout):
        """The window registered as pinned memory with the device runtime of ``out`` (a
        loader's :class:`~dpu_pipe.device.BatchOutput`; made on first use, registered again
        when the window is made anew), for device copies straight from the window."""
        if self._pinned is None:
            self._pinned = PinnedRegion(out.device_backend(), timeout=timeout)
            self.transport.add_window_user(self._pinned)
        return self._pinned

    def register(self, request):
        """Send a stream request (:func:`dpu_pipe.engines.offload.stream_request`) to every
        producer; returns (stream id, replies)."""
        sid = self.next_stream
        self.next_stream += 1
        return sid, self.transport.request("stream", (sid, request))

    def close(self):
        """Stop this host's producers (they leave their loop and exit). Idempotent."""
        if not self.open:
            return
        self.open = False
        if self.active is not None:
            self.active.suspend()
        if self._setup_failed is not None:
            # The producers are stuck in the window's start-up and never reach the channel's
            # collective free: the job ends with the start-up error's abort.
            return
        if self._transport is None and self.producers:
            # The producers wait for the window from their start: make a minimal one so that
            # they are released the same way.
            self._want = (1, 0)
            self.transport
        if self._transport is not None:
            self._transport.close()
            if self._transport.sched.abort_at_exit:
                return          # a producer never signed off: the job ends with an abort
        self.validation.close(self.setup_timeout)
        if self.serve_file is not None:
            rendezvous.leave(self.group, self.setup_timeout)
