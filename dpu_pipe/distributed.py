"""``torch.distributed`` inside an MPMD job (``mpiexec -n 2 python -m mpi4py train.py : -n 4
python -m mpi4py -m dpu_pipe.worker``): the host ranks alone form the process group, with
their index among the hosts as ``RANK``, which loaders built afterwards shard by."""
import os
import socket
import time
from collections import namedtuple

import numpy as np

from ._torch import require_torch
from .errors import ConfigError
from .mpi import load_mpi, wait_request

__all__ = ["init_process_group", "ProcessGroupInfo", "TORCH_ENV"]

#: What torchrun (and torch's ``env://`` initialization) reads.
TORCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")

ProcessGroupInfo = namedtuple("ProcessGroupInfo", "rank world_size local_rank backend")
ProcessGroupInfo.__doc__ = """This process in the process group: ``rank``, ``world_size`` (hosts
only), ``local_rank`` (among the hosts on this hostname: the GPU to use), ``backend``."""


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_process_group(backend=None, *, comm=None, setup_timeout=120.0, **kwargs):
    """Initialize ``torch.distributed`` over the host ranks of this job; returns a
    :class:`ProcessGroupInfo`.

    Parameters
    ----------
    backend : str, optional
        ``"nccl"`` when CUDA is available, else ``"gloo"``.
    comm : mpi4py communicator, optional
        The MPMD job's communicator (default ``COMM_WORLD``), over which the call is
        collective: it starts the host group, so the producers must be running
        ``python -m dpu_pipe.worker``.
    setup_timeout : float
        Seconds the hosts wait for each other while agreeing on the port.
    **kwargs
        Passed to ``torch.distributed.init_process_group`` (``timeout``, ``device_id``, ...).

    The hosts agree through MPI on ``MASTER_ADDR`` (the first host's hostname, unless set)
    and a ``MASTER_PORT`` free on the first host (should another process take it first,
    start the job again). MPI is not used when ``init_method`` is given or ``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` are all set (torchrun); already initialized,
    nothing is done.
    """
    torch = require_torch("torch.distributed")
    dist = torch.distributed
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed")
    if dist.is_initialized():
        return ProcessGroupInfo(dist.get_rank(), dist.get_world_size(),
                                int(os.environ.get("LOCAL_RANK", 0)), dist.get_backend())
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    # torch.distributed.nn binds the default group into default arguments when first imported
    # (optimizers do, via torch._dynamo): imported later, it keeps the group and its gloo
    # threads past destroy_process_group, into shutdown, where they can abort the process.
    import torch.distributed.nn  # noqa: F401
    if "init_method" in kwargs or all(v in os.environ for v in TORCH_ENV):
        dist.init_process_group(backend=backend, **kwargs)
        return ProcessGroupInfo(dist.get_rank(), dist.get_world_size(),
                                int(os.environ.get("LOCAL_RANK", 0)), backend)
    # Function-local: the offload layer imports MPI, which a torchrun job must not need.
    from .offload.group import host_group

    MPI = load_mpi()
    group = host_group(comm)
    roles = group.roles
    world = MPI.COMM_WORLD if comm is None else comm
    hosts = world.Create_group(world.Get_group().Incl(list(roles.hosts)))
    try:
        port = np.array([_free_port() if group.host_index == 0 else 0], np.int64)
        wait_request(hosts.Ibcast(port, root=0), time.monotonic() + setup_timeout,
                     f"host {group.host_index}: agreeing on torch.distributed's port")
    finally:
        hosts.Free()
    names = [roles.hostnames[h] for h in roles.hosts]
    me = names[group.host_index]
    local_rank = names[:group.host_index].count(me)
    os.environ.setdefault("MASTER_ADDR", names[0])
    os.environ["MASTER_PORT"] = str(int(port[0]))
    os.environ.update(RANK=str(group.host_index), WORLD_SIZE=str(group.num_hosts),
                      LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(names.count(me)))
    dist.init_process_group(backend=backend, init_method="env://", rank=group.host_index,
                            world_size=group.num_hosts, **kwargs)
    return ProcessGroupInfo(group.host_index, group.num_hosts, local_rank, backend)
