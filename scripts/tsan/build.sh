#!/usr/bin/env bash
# ThreadSanitizer build of the Cython kernels, to run the threaded tests with data races
# checked (scripts/tsan/check.sh runs them). Everything lands in build/tsan/:
#   tree/      a copy of setup.py, src/ and dpu_pipe/ (Python files as of this build), its
#              extensions built in place by gcc with -fsanitize=thread -O1 -g (setup.py's
#              DPU_PIPE_SANITIZE=thread; -ffp-contract=off as always). The checkout's own
#              in-place build (dpu_pipe/*.so) is not touched. Rebuild after editing either:
#              only what changed is translated and compiled again.
#   runtime/   gomp_tsan.so (from scripts/tsan/gomp_tsan.c): libgomp is not instrumented, so
#              TSAN cannot see the fork, join and barriers of an OpenMP team; this preloaded
#              shim states them to TSAN (see the file), so the kernels' OpenMP regions are
#              checked as they run in production rather than built without OpenMP.
# DPU_PIPE_TSAN_DIR puts it elsewhere; DPU_PIPE_TSAN_OPENMP=0 builds without OpenMP (batches
# on one thread: only the Python threads' concurrency is left to check). Run Python with it
# through scripts/tsan/python.sh (same variables). Needs gcc (libtsan comes with it).
#   scripts/tsan/build.sh [PYTHON]      default PYTHON: .venv/bin/python, else python3
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PY=${1:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=$ROOT/.venv/bin/python; else PY=$(command -v python3); fi
fi
# The build runs in the copy: a relative path must not change meaning (nor a venv's python
# become the interpreter it links to, so no symlinks are followed).
case $PY in */*) PY=$(realpath -s "$PY") ;; esac
OUT=${DPU_PIPE_TSAN_DIR:-$ROOT/build/tsan}
OPENMP=${DPU_PIPE_TSAN_OPENMP:-1}
T=$OUT/tree
log() { printf '\033[1m[tsan]\033[0m %s\n' "$*" >&2; }
LIBTSAN=$(readlink -f "$(gcc -print-file-name=libtsan.so)")
[ -f "$LIBTSAN" ] || { log "gcc's libtsan is missing (Debian: apt-get install libtsan2)"; exit 1; }

# 1. The copy. tar keeps the modification times, so the copy's own Cython and compiler
# outputs stay current for unchanged sources; Python files are replaced wholesale so that a
# module deleted from the checkout does not linger.
mkdir -p "$T/dpu_pipe"
find "$T/dpu_pipe" -mindepth 1 ! -name '_*.so' -delete
rm -rf "$T/src"
tar -cf - --exclude='*.so' --exclude=__pycache__ setup.py src dpu_pipe | tar -xpf - -C "$T"
# A build of the other OpenMP setting must not be reused as this one.
stamp="openmp=$OPENMP"
if [ "$(cat "$T/.build_switches" 2>/dev/null)" != "$stamp" ]; then
  rm -f "$T"/dpu_pipe/_*.so
fi
# Nor an extension whose source has left the checkout.
for so in "$T"/dpu_pipe/_*.so; do
  [ -e "$so" ] || continue
  name=$(basename "$so"); name=${name%%.*}
  [ -f "$T/src/dpu_pipe/$name.pyx" ] || rm -f "$so"
done

# 2. The extensions, in place in the copy (the copy's build/ holds Cython's C files).
log "building the extensions in $T (OpenMP: $OPENMP)"
if ! (cd "$T" && CC=gcc DPU_PIPE_SANITIZE=thread DPU_PIPE_OPENMP="$OPENMP" \
        "$PY" setup.py build_ext --inplace) > "$OUT/build.log" 2>&1; then
  tail -n 40 "$OUT/build.log" >&2
  log "build failed; the whole log: $OUT/build.log"
  exit 1
fi
echo "$stamp" > "$T/.build_switches"

# 3. The OpenMP shim, and a check that it covers every libgomp entry point the extensions
# call: one it does not know may synchronise in a way TSAN would not see.
mkdir -p "$OUT/runtime"
gcc -shared -fPIC -O1 -g -Wall -Werror -o "$OUT/runtime/gomp_tsan.so" scripts/tsan/gomp_tsan.c -ldl
known='^GOMP_(parallel|barrier|loop_end|loop_end_nowait|critical_start|critical_end|loop_(nonmonotonic_)?(dynamic|guided|static|runtime)_(start|next))$'
unknown=$(nm -D --undefined-only "$T"/dpu_pipe/_*.so | awk '{print $NF}' | sed 's/@.*//' \
          | grep '^GOMP_' | sort -u | grep -Ev "$known" || true)
if [ -n "$unknown" ]; then
  log "the extensions call libgomp functions scripts/tsan/gomp_tsan.c does not model:" $unknown
  exit 1
fi
log "done: scripts/tsan/python.sh runs Python with $T first on the path"
