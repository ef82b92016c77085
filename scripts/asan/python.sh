#!/usr/bin/env bash
# Python with the ASan+UBSan build of dpu_pipe (scripts/asan/build.sh) first on the path.
#   scripts/asan/python.sh -m pytest tests/test_jpeg.py
#   scripts/asan/python.sh tests/fuzz/fuzz_decode.py -runs=100000 tests/fuzz/corpus/decode
# The interpreter is not instrumented: the runtime is preloaded, leak checking is off (CPython
# keeps objects alive to exit by design), and PYTHONMALLOC=malloc sends Python's small objects
# through ASan's allocator so reads past a bytes object are caught too. numpy's own allocations
# go through malloc already. allocator_may_return_null lets a budget test that asks for a huge
# array get MemoryError instead of an ASan abort. Tests that measure RSS do not hold here: ASan
# keeps freed memory in quarantine (deselect them: -k "not leak and not memory").
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${DPU_PIPE_PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=$(command -v python3); fi
fi
OUT=${DPU_PIPE_ASAN_DIR:-$ROOT/build/asan}
RTLIB=$OUT/runtime/asan_with_fuzzer.so
[ -f "$RTLIB" ] || { echo "run scripts/asan/build.sh first" >&2; exit 1; }
export LD_PRELOAD=$RTLIB${LD_PRELOAD:+:$LD_PRELOAD}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:allocator_may_return_null=1:detect_stack_use_after_return=0:handle_segv=1:abort_on_error=1:symbolize=1:strict_init_order=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1:abort_on_error=1}
export PYTHONMALLOC=malloc
# Not the working directory: a checkout's own dpu_pipe/ would shadow the instrumented one.
export PYTHONSAFEPATH=1
export PYTHONPATH=$OUT/pkg${PYTHONPATH:+:$PYTHONPATH}
exec "$PY" "$@"
