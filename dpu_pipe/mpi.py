"""Small MPI helpers: import mpi4py on demand (``import dpu_pipe`` works without MPI), launch
lines."""
import os
import shutil
import sys

from .deadline import poll_until
from .errors import ConfigError

__all__ = ["load_mpi", "wait_request", "mpiexec_path", "mpiexec_argv"]


def load_mpi():
    """``mpi4py.MPI``, imported (and so MPI initialized) on first use; :class:`ConfigError`
    naming the packages to install when mpi4py or an MPI library is missing."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ConfigError(
            "dpu_pipe's MPI transport needs mpi4py and an MPI library: "
            "pip install mpi4py mpich  (or mpi4py built against the cluster's MPI)"
        ) from exc
    return MPI


def wait_request(req, deadline, what):
    """Test the MPI request ``req`` until it completes, sleeping between tests (up to 5 ms:
    a blocking MPI wait would spin a core), or raise :class:`PipeTimeout` saying ``what``
    when ``deadline`` (``time.monotonic()`` seconds) passes."""
    poll_until(req.Test, deadline, f"{what}: no answer before the deadline", 0.005)


def mpiexec_path():
    """The ``mpiexec`` that belongs to this Python (the mpich wheel puts it beside python),
    else the first one on ``PATH``."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(here, os.X_OK):
        return here
    found = shutil.which("mpiexec")
    if found is None:
        raise ConfigError("mpiexec not found: pip install mpich, or put the MPI's bin/ on PATH")
    return found


def mpiexec_argv(nprocs, script, *args, launcher_args=()):
    """Command line running ``script`` on ``nprocs`` ranks under ``python -m mpi4py`` (an
    uncaught exception in any rank then aborts the job instead of leaving the other ranks
    waiting). ``launcher_args`` go to mpiexec before ``-n``."""
    return [mpiexec_path(), *launcher_args, "-n", str(int(nprocs)),
            sys.executable, "-m", "mpi4py", os.fspath(script), *map(str, args)]
