#!/usr/bin/env bash
# DPULoader on the distribution's Open MPI instead of the mpich wheel: installs Open MPI (apt),
# builds mpi4py against it in .cache/system-mpi-venv, runs tests/mpi/test_system_mpi.py.
set -euo pipefail
cd "$(dirname "$0")/.."
./run.sh setup
if ! command -v mpicc >/dev/null || ! command -v mpiexec.openmpi >/dev/null; then
  sudo_=""; [ "$(id -u)" = 0 ] || sudo_=sudo
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq libopenmpi-dev openmpi-bin
fi
venv=.cache/system-mpi-venv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import mpi4py, numpy" 2>/dev/null; then
  python3 -m venv "$venv"
  MPICC=$(command -v mpicc) "$venv/bin/pip" install -q --no-binary=mpi4py mpi4py numpy
fi
DPU_PIPE_SYSTEM_MPI_PYTHON=$(pwd)/$venv/bin/python DPU_PIPE_SYSTEM_MPIEXEC=mpiexec.openmpi \
  .venv/bin/python -m pytest -q -s -p no:cacheprovider tests/mpi/test_system_mpi.py
