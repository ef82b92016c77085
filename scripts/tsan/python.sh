#!/usr/bin/env bash
# Python with the ThreadSanitizer build of dpu_pipe (scripts/tsan/build.sh) first on the path.
#   scripts/tsan/python.sh -m pytest -p no:cacheprovider tests/test_batch.py
# The interpreter is not instrumented, so gcc's TSAN runtime is preloaded (it has to be
# initialised before any instrumented code runs), followed by the OpenMP shim
# (scripts/tsan/gomp_tsan.c). TSAN then checks what the extensions' code reads and writes;
# Python's own objects, numpy and libjpeg are not instrumented and are not checked (the GIL and
# Python's thread primitives are pthread mutexes and condition variables, which TSAN sees, so
# orderings made in Python hold for the kernels' accesses too). PYTHONMALLOC=malloc lets TSAN
# see where Python's small objects start and end. Reports go to build/tsan/logs/tsan.<pid>
# (TSAN_LOG_DIR elsewhere), with suppressions from scripts/tsan/suppressions.txt; a process
# that made any exits with status 66. TSAN_OPTIONS from the environment comes after these
# defaults and overrides them (halt_on_error=1 to stop at the first report, say).
# Not for bash or other uninstrumented programs: LD_PRELOAD is inherited by subprocesses, and
# bash crashes under the TSAN runtime.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${DPU_PIPE_PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=$(command -v python3); fi
fi
OUT=${DPU_PIPE_TSAN_DIR:-$ROOT/build/tsan}
SHIM=$OUT/runtime/gomp_tsan.so
ls "$OUT"/tree/dpu_pipe/_*.so >/dev/null 2>&1 && [ -f "$SHIM" ] \
  || { echo "run scripts/tsan/build.sh first" >&2; exit 1; }
LIBTSAN=$(readlink -f "$(gcc -print-file-name=libtsan.so)")
LOGS=${TSAN_LOG_DIR:-$OUT/logs}
mkdir -p "$LOGS"
export LD_PRELOAD=$LIBTSAN:$SHIM${LD_PRELOAD:+:$LD_PRELOAD}
# history_size=7: the earlier access of a race is reported with its stack even when the
# threads ran many kernels in between (the default history loses it: "failed to restore
# the stack").
defaults="exitcode=66 halt_on_error=0 history_size=7 second_deadlock_stack=1"
defaults="$defaults suppressions=$ROOT/scripts/tsan/suppressions.txt log_path=$LOGS/tsan"
export TSAN_OPTIONS="$defaults${TSAN_OPTIONS:+ $TSAN_OPTIONS}"
export PYTHONMALLOC=malloc
# Not the working directory: a checkout's own dpu_pipe/ would shadow the instrumented one.
export PYTHONSAFEPATH=1
export PYTHONPATH=$OUT/tree${PYTHONPATH:+:$PYTHONPATH}
# For scripts/tsan/pytest_tsan.py: where the build and the reports are.
export DPU_PIPE_TSAN_TREE=$OUT/tree DPU_PIPE_TSAN_LOGS=$LOGS
exec "$PY" "$@"
