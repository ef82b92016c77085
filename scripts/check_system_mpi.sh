#!/usr/bin/env bash
# DPULoader on the distribution's Open MPI instead of the mpich wheel: installs Open MPI (apt)
# when missing, then runs tests/mpi/test_system_mpi.py: the stream, takeover and shutdown
# checks with osc=ucx and osc=^ucx, each job under its own deadline and ending with every
# rank gone.
#
# mpi4py for Open MPI: the mpi4py wheel of the checkout's venv carries an extension for Open
# MPI's ABI beside the MPICH one (mpi4py >= 4); MPI4PY_MPIABI=openmpi selects it, so nothing
# is built. Where it does not (an older mpi4py), mpi4py is compiled against this Open MPI
# into a venv kept outside the checkout, one per Open MPI version (a clean clone reuses it).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || ./run.sh setup
if ! command -v mpicc >/dev/null || ! command -v mpiexec.openmpi >/dev/null; then
  sudo_=""; [ "$(id -u)" = 0 ] || sudo_=sudo
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq libopenmpi-dev openmpi-bin
fi
probe='from mpi4py import MPI; import sys; sys.exit("Open MPI" not in MPI.Get_library_version())'
if MPI4PY_MPIABI=openmpi .venv/bin/python -c "$probe" 2>/dev/null; then
  python=$PWD/.venv/bin/python
  export MPI4PY_MPIABI=openmpi
else
  ompi=$(dpkg-query -W -f='${Version}' libopenmpi-dev 2>/dev/null || echo unknown)
  venv=${DPU_PIPE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dpu_pipe}/system-mpi-venv-${ompi}
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import mpi4py, numpy" 2>/dev/null; then
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv"
    MPICC=$(command -v mpicc) nice -n 10 "$venv/bin/pip" install -q --no-binary=mpi4py mpi4py numpy
  fi
  python=$venv/bin/python
fi
DPU_PIPE_SYSTEM_MPI_PYTHON=$python DPU_PIPE_SYSTEM_MPIEXEC=mpiexec.openmpi \
  .venv/bin/python -m pytest -q -s -p no:cacheprovider tests/mpi/test_system_mpi.py "$@"
