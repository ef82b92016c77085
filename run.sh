#!/usr/bin/env bash
# One entry point for the README's commands. Each sets up what it needs on a fresh
# Debian/Ubuntu machine (apt packages when missing, a venv in .venv) and then runs.
#   ./run.sh demo    the main job: builds a dataset from real photographs, runs the pipeline
#   ./run.sh test    builds and runs the test suite, on every core (DPU_PIPE_TEST_JOBS workers,
#                    default: one per core; 0: in this process)
#   ./run.sh bench   the microbenchmarks (pytest-benchmark)
#   ./run.sh wheels  DPU (aarch64) and x86-64 wheels into dist/ (scripts/build_wheels.sh)
#   ./run.sh slurm   installs Debian's slurm-wlm and munge when missing (about 30-75 s) and
#                    runs the Slurm launch tests on a private one-machine cluster
#   ./run.sh slurm-deps  only installs them (CI does, so the suite runs those tests)
#   ./run.sh system-deps only the system packages that setup installs when missing
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

log() { printf '\033[1m[dpu_pipe]\033[0m %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    log "need root to run: $*"; exit 1; fi
}

system_deps() {
  local missing=()
  command -v cc >/dev/null || missing+=(build-essential)
  command -v pkg-config >/dev/null || missing+=(pkg-config)
  pkg-config --exists libjpeg 2>/dev/null || [ -f /usr/include/jpeglib.h ] || missing+=(libjpeg-dev)
  command -v python3 >/dev/null || missing+=(python3)
  if command -v python3 >/dev/null; then
    python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
    python3 - <<'PY' 2>/dev/null || missing+=(python3-dev)
import os, sys, sysconfig
sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else 1)
PY
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null || { log "install these system packages: ${missing[*]}"; exit 1; }
    log "installing system packages: ${missing[*]}"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

python_env() {
  if [ ! -x "$PY" ]; then
    log "creating $VENV"
    python3 -m venv "$VENV"
  fi
  local stamp="$VENV/.dpu_pipe_deps"
  local want
  want=$(cat pyproject.toml requirements-dev.txt 2>/dev/null | sha1sum | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing Python packages into $VENV"
    "$PY" -m pip install -q --disable-pip-version-check -U pip
    # --no-compile: pip would byte-compile all ~12,500 modules (about 90 s of CPU here, torch
    # most of it); Python compiles the ones a process imports, once, when bytecode caches are
    # on (./run.sh test and .ci/run turn them on).
    "$PY" -m pip install -q --disable-pip-version-check --no-compile -r requirements-dev.txt
    echo "$want" > "$stamp"
  fi
  # The editable build recompiles every kernel (about 90 s here) even when nothing changed, so
  # it is skipped when the build inputs and the built extensions are those of the last build.
  # A build made outside this script (the debug build, say) changes the extensions' hashes.
  local built="$VENV/.dpu_pipe_build"
  if [ "$(cat "$built" 2>/dev/null)" = "$(build_stamp)" ]; then
    log "dpu_pipe's kernels are up to date"
    return
  fi
  log "building dpu_pipe (Cython kernels)"
  "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . \
    || { log "build failed"; exit 1; }
  build_stamp > "$built"
}

# What the kernels are built from (sources, build scripts, build options) and what they
# became (the extensions in place), as one hash.
build_stamp() {
  {
    find src setup.py pyproject.toml -type f -print0 | LC_ALL=C sort -z | xargs -0 sha1sum
    find dpu_pipe -maxdepth 1 -name '*.so' -print0 | LC_ALL=C sort -z | xargs -0 -r sha1sum
    env | grep -E '^(DPU_PIPE_[A-Z_]*|CC|CFLAGS|CPPFLAGS|LDFLAGS)=' | LC_ALL=C sort || true
    cat "$VENV/.dpu_pipe_deps" 2>/dev/null || true
    "$PY" -c 'import sys; print(sys.version)'
  } | sha1sum | cut -d' ' -f1
}

setup() { system_deps; python_env; }

# Slurm stays out of setup: its daemons are not something every checkout wants installed,
# and the suite skips tests/mpi/test_slurm.py without them (fails, with CI=true).
# libpmix-dev: Slurm's PMIx plugin (test_slurm.py launches with --mpi=pmix too) dlopens the
# unversioned pmix2/lib/libpmix.so that only the -dev package has; Debian pulls it in with
# Open MPI's libopenmpi-dev, not with Slurm.
PMIX_LIB=/usr/lib/$(uname -m)-linux-gnu/pmix2/lib/libpmix.so
slurm_deps() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && [ -e "$PMIX_LIB" ] && return
  command -v apt-get >/dev/null || {
    log "install Slurm (slurmctld, slurmd, srun), munge and PMIx ($PMIX_LIB)"; exit 1; }
  log "installing slurm-wlm, munge and libpmix-dev"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
    slurm-wlm munge libpmix-dev >/dev/null
}

cmd=${1:-}
shift || true
case "$cmd" in
  demo)
    setup
    exec "$PY" -m dpu_pipe demo "$@"
    ;;
  test)
    setup
    # Bytecode caches on: without them every test run rewrites and compiles the test modules
    # again (collecting the quick tier took 21 s instead of 16 s here), and every process a
    # test starts compiles dpu_pipe again.
    unset PYTHONDONTWRITEBYTECODE
    # The whole suite unless test files or directories are named (./run.sh test tests/x.py).
    # pytest exits 5 when it collected nothing: that is a failure here too.
    where=(tests)
    for a in "$@"; do
      case "$a" in -*) ;; *) [ -e "${a%%::*}" ] && where=() ;; esac
    done
    # pytest-xdist: the whole suite runs on one worker per core, each given whole files
    # (--dist loadfile), so a file's module fixtures (datasets, the sdist build and the wheels
    # made from it) are made once and its tests keep their order; many tests wait on mpiexec
    # jobs and deadlines, which the other worker fills. Named files run in this process unless
    # DPU_PIPE_TEST_JOBS says otherwise; arguments given here come after and win (-n 0).
    jobs=${DPU_PIPE_TEST_JOBS:-auto}
    [ ${#where[@]} -gt 0 ] || jobs=${DPU_PIPE_TEST_JOBS:-0}
    # -rs lists every skipped test with its reason: a skip is a check that did not run.
    "$PY" -m pytest -q -rs -p no:cacheprovider -n "$jobs" --dist loadfile "$@" "${where[@]}"
    ;;
  bench)
    setup
    exec "$PY" -m pytest -q -p no:cacheprovider bench "$@"
    ;;
  wheels)
    exec scripts/build_wheels.sh "$@"
    ;;
  setup)
    setup
    ;;
  slurm-deps)
    slurm_deps
    ;;
  system-deps)
    system_deps
    ;;
  slurm)
    setup
    slurm_deps
    "$PY" -m pytest -q -rs -p no:cacheprovider "$@" tests/mpi/test_slurm.py
    ;;
  *)
    echo "usage: ./run.sh demo|test|bench|wheels|setup|slurm|slurm-deps|system-deps [args...]" >&2
    exit 2
    ;;
esac
