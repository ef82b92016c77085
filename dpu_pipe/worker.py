"""``python -m dpu_pipe.worker``: a producer rank (on a DPU core) that finds its host in the
MPI job and serves it until the host stops (:mod:`dpu_pipe.offload.producer_loop`). Launch it
under ``python -m mpi4py``, so that an error in any rank aborts the job.

``--hostmap`` is as ``DPU_PIPE_HOSTMAP``. ``--serve FILE`` (``--hosts N``, ``--accept-timeout
SECONDS``): hosts outside this MPI job (``torchrun``) join through the port published in FILE
(:mod:`dpu_pipe.offload.rendezvous`). :func:`handler` registers a request handler, and modules
listed in :data:`HANDLER_MODULES` are imported for theirs before serving.
"""
from .offload.producer_loop import HANDLER_MODULES, handler, main, serve

__all__ = ["main", "serve", "handler", "HANDLER_MODULES"]

if __name__ == "__main__":
    main()
