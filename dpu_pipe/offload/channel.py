"""The validation channel of a host group: a duplicate of the group's communicator (so its
messages never match the batch stream's) and a dynamic RMA window on it, made collectively
when the group is set up. :mod:`dpu_pipe.offload.validation` speaks over it."""
from ..deadline import deadline_in
from ..mpi import load_mpi, wait_request

__all__ = ["Channel", "REQUEST_TAG", "RESULT_TAG", "MERGE_TAG"]

REQUEST_TAG = 0x5601     # host -> producer: a job (dict) or None (stop)
RESULT_TAG = 0x5602      # producer -> host: a result record
MERGE_TAG = 0x5603       # host -> host (world communicator): one host's sums for a job


class Channel:
    """The validation channel of one host group, made collectively over the group (``role``
    "host" or "producer") when it is set up, in the same order as its other collectives."""

    def __init__(self, group, role):
        MPI = self.MPI = load_mpi()
        self.role = role
        self.comm = group.Dup()
        self.win = MPI.Win.Create_dynamic(comm=self.comm)
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        #: host side: job id -> ValidationFuture of every RemoteValidation of this group,
        #: and sums from other hosts for jobs not submitted here yet.
        self.futures = {}
        self.early = {}
        self.sends = []             # pending isend requests (they own their pickled buffers)
        self._jobs = 0
        if role == "producer":
            # One passive-target epoch for the job's lifetime: each read is an Rget waited
            # on with a deadline, never a blocking lock or unlock.
            self.win.Lock_all()

    def close(self, timeout=10.0):
        """Free the window and the communicator, collectively once every rank stopped using
        them (Open MPI's UCX one-sided component hangs in MPI_Finalize while a window is
        still allocated). Idempotent."""
        if self.win is None:
            return
        win, self.win = self.win, None
        if self.role == "producer":
            win.Unlock_all()
        # Win.Free is collective: enter it only once every rank of the group is there.
        wait_request(self.comm.Ibarrier(), deadline_in(timeout),
                     f"{self.role} rank {self.rank} freeing the validation window")
        win.Free()
        self.comm.Free()

    def next_job(self):
        """The next job id: hosts that submit the same sequence of snapshots agree on it."""
        self._jobs += 1
        return self._jobs
