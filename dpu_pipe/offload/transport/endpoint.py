"""What both ends of the transport share: the start-up handshake (version check, names of the
ranks), the window's allocation, ``Put``/``Flush`` with their origin buffers kept alive, and the
collective free behind a barrier with a deadline."""
import os
import socket
import sys

import numpy as np

from ...deadline import deadline_in
from ...errors import ConfigError
from ...mpi import load_mpi, wait_request
from .. import wire

#: MPI tags of the request channel (host → producer) and its replies.
TAG_REQUEST, TAG_REPLY = 0x4451, 0x4452
# Heartbeat period, seconds: often enough that silence is seen quickly, rare enough to cost
# nothing next to a batch.
BEAT_EVERY = 0.05


class Endpoint:
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
        # Every rank must be here before the blocking collectives of start-up.
        wait_request(comm.Ibarrier(), deadline_in(setup_timeout),
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
            raise ConfigError(
                f"cannot allocate the {my_bytes}-byte RMA window on group rank {self.rank} "
                f"(world rank {self._MPI.COMM_WORLD.Get_rank()} on {socket.gethostname()}, "
                f"pid {os.getpid()}): {exc.Get_error_string()} — memory or /dev/shm is "
                f"short; lower slots or batch_size, or free /dev/shm") from exc
        self.win.Lock_all()
        self.mem = np.frombuffer(self.win.tomemory(), np.uint8)
        self.mem[:] = 0
        self.win.Sync()

    def _ready(self, setup_timeout):
        # Nobody writes into another rank's window before that rank zeroed it.
        wait_request(self.comm.Ibarrier(), deadline_in(setup_timeout), "window set-up")

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
