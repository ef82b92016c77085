"""``python -m dpu_pipe.worker``: a producer rank (on a DPU core) serving its host.

It takes no arguments (``--hostmap`` optionally, as ``DPU_PIPE_HOSTMAP``): it finds its host
in the MPI job and serves it until the host stops (see :mod:`dpu_pipe.offload.producer_loop`).
Launch it under ``python -m mpi4py`` so that an error in any rank aborts the job.

``--serve FILE`` (with ``--hosts N``, default 1, and ``--accept-timeout SECONDS``): the
producers are an MPI job of their own; hosts that are not in it (started by ``torchrun``)
join through the port published in FILE (see :mod:`dpu_pipe.offload.rendezvous`).

:func:`handler` registers a handler of requests of one kind on the producers, and modules
listed in :data:`HANDLER_MODULES` are imported for theirs before serving (see
:mod:`dpu_pipe.offload.producer_loop`).
"""
from .offload.producer_loop import HANDLER_MODULES, handler, main, serve

__all__ = ["main", "serve", "handler", "HANDLER_MODULES"]

if __name__ == "__main__":
    main()
