"""DPULoader on a system MPI (Open MPI from the distribution), not the mpich wheel.

Needs a Python whose mpi4py is built against that MPI, named by DPU_PIPE_SYSTEM_MPI_PYTHON,
and its launcher in DPU_PIPE_SYSTEM_MPIEXEC; scripts/check_system_mpi.sh sets both up
(apt's Open MPI, mpi4py compiled against it) and runs this file.
"""
import os
import subprocess
import time

import pytest

from dpu_pipe.tools.sample_data import make_imagenet_like
from helpers import ROOT, repo_env

PYTHON = os.environ.get("DPU_PIPE_SYSTEM_MPI_PYTHON")
MPIEXEC = os.environ.get("DPU_PIPE_SYSTEM_MPIEXEC", "mpiexec.openmpi")

pytestmark = pytest.mark.skipif(
    not PYTHON, reason="system-MPI check: run scripts/check_system_mpi.sh "
                       "(sets DPU_PIPE_SYSTEM_MPI_PYTHON)")


@pytest.mark.parametrize("osc", ["^ucx", "ucx"], ids=["osc-rdma-or-pt2pt", "osc-ucx"])
def test_dpuloader_over_system_mpi(tmp_path, osc):
    """Offload and hybrid streams equal Loader's, and a stopped producer is taken over,
    with Open MPI's one-sided component chosen by OMPI_MCA_osc (``ucx``: UCX, as on an
    InfiniBand/RoCE cluster; ``^ucx``: any other)."""
    data = tmp_path / "data"
    make_imagenet_like(data, n=40, classes=4, seed=0)
    # Open MPI refuses root and more ranks than cores unless told.
    env = repo_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_osc=osc)
    argv = ["timeout", "-k", "5", "240", MPIEXEC, "--oversubscribe",
            "-n", "1", PYTHON, "-m", "mpi4py", str(ROOT / "tests/mpi/system_mpi_host.py"),
            str(data), ":", "-n", "2", PYTHON, "-m", "mpi4py", "-m", "dpu_pipe.worker"]
    lib = subprocess.run([PYTHON, "-c", "from mpi4py import MPI; "
                          "print(MPI.Get_library_version().split(',')[0])"],
                         capture_output=True, text=True, env=env, timeout=60).stdout.strip()
    assert lib.startswith("Open MPI"), f"{PYTHON}'s mpi4py runs {lib!r}, not Open MPI"
    start = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    seconds = time.monotonic() - start
    ok = [line for line in proc.stdout.splitlines() if line.startswith("OK ")]
    # 124: timeout(1) ended the job at its deadline; with every check passed, a rank did
    # not leave MPI_Finalize (the osc=ucx hang of a window still allocated there).
    assert proc.returncode != 124, (f"killed at the 240 s deadline after {len(ok)} of 6 "
                                    f"checks:\n{proc.stdout}{proc.stderr[-3000:]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert len(ok) == 6, proc.stdout
    print(f"{lib}, osc={osc}: every rank gone after {seconds:.1f} s; {ok}")
