"""Launching MPI jobs from pytest: every job under a wall-clock limit, oversubscribed on
whatever cores there are, with the checkout importable by the ranks."""
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import repo_env

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

mpi = pytest.importorskip("mpi4py", reason="MPI tests need mpi4py (pip install mpi4py mpich)")

from dpu_pipe.mpi import mpiexec_argv  # noqa: E402  (after the skip above)

#: Environments every stream scenario runs under: shared memory as on one node, and MPICH
#: with shared memory disabled, which makes the host's RMA behave as for an off-node DPU.
ENVS = {"shm": {}, "nolocal": {"MPIR_CVAR_NOLOCAL": "1"}}
#: ENVS as parameters whose off-node run waits for the slow tier: for scenarios where the quick
#: tier's shared-memory run already exercises the same host and producer code.
ENVS_NOLOCAL_SLOW = [pytest.param(k, id=k, marks=[pytest.mark.slow] if k == "nolocal" else [])
                     for k in ENVS]


@dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def timed_out(self):
        """True when the launcher was stopped at its deadline (``timeout --verbose`` says so):
        the job hung rather than ended by itself."""
        return "timeout: sending signal" in self.stderr

    def explain(self):
        return (f"exit {self.returncode} after {self.seconds:.1f}s\n--- stdout\n{self.stdout}"
                f"\n--- stderr\n{self.stderr[-4000:]}")


def run_mpi(nprocs, script, *args, env=None, limit=120, launcher_args=()):
    """Run ``script`` on ``nprocs`` ranks under ``timeout`` and return a :class:`Job`.

    ``timeout -k`` ends the launcher after ``limit`` seconds; the subprocess deadline a bit
    later kills the whole process group in case the launcher itself does not go quietly.
    """
    full_env = repo_env(**(env or {}))
    argv = ["timeout", "--verbose", "-k", "5", str(limit),
            *mpiexec_argv(nprocs, HERE / script, *args, launcher_args=launcher_args)]
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit + 20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"MPI job hung past {limit + 20}s: {argv}\n{out}\n{err[-4000:]}")
    return Job(proc.returncode, out, err, time.monotonic() - start)
