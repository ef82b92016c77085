#!/usr/bin/env bash
# DPULoader on the distribution's Open MPI instead of the mpich wheel: installs Open MPI (apt),
# builds mpi4py against it (cached, see below), runs tests/mpi/test_system_mpi.py: the
# stream, takeover and shutdown checks with osc=ucx and osc=^ucx, each job ending with every
# rank gone.
set -euo pipefail
cd "$(dirname "$0")/.."
./run.sh setup
if ! command -v mpicc >/dev/null || ! command -v mpiexec.openmpi >/dev/null; then
  sudo_=""; [ "$(id -u)" = 0 ] || sudo_=sudo
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq libopenmpi-dev openmpi-bin
fi
# mpi4py compiled against this Open MPI, kept outside the checkout (a clean clone reuses it),
# one per Open MPI version.
ompi=$(dpkg-query -W -f='${Version}' libopenmpi-dev 2>/dev/null || echo unknown)
venv=${DPU_PIPE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dpu_pipe}/system-mpi-venv-${ompi}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import mpi4py, numpy" 2>/dev/null; then
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  MPICC=$(command -v mpicc) "$venv/bin/pip" install -q --no-binary=mpi4py mpi4py numpy
fi
DPU_PIPE_SYSTEM_MPI_PYTHON=$venv/bin/python DPU_PIPE_SYSTEM_MPIEXEC=mpiexec.openmpi \
  .venv/bin/python -m pytest -q -s -p no:cacheprovider tests/mpi/test_system_mpi.py
