#!/usr/bin/env bash
# The threaded tests under ThreadSanitizer: builds (scripts/tsan/build.sh, incremental), shows
# that TSAN and the OpenMP shim work (omp_selftest.c: silent as written, a report when racy;
# race_selftest.py: a kernel race from two Python threads is reported), then runs the tests
# through scripts/tsan/python.sh with scripts/tsan/pytest_tsan.py, which fails a test during
# which TSAN reported and counts the reports at the end. Exit status 0 only when every test
# passed and TSAN reported nothing.
#   scripts/tsan/check.sh short   CI: the Loader's threaded tests (num_threads=2, prefetch,
#                                 close and failure while the producer runs) and
#                                 tests/test_threads.py's in-process tests, stress 24 s
#   scripts/tsan/check.sh long    tests/test_loader.py, tests/test_batch.py and
#                                 tests/test_threads.py whole (in-process), stress 120 s
# Extra arguments go to pytest. DPU_PIPE_STRESS_SECONDS overrides the stress time. Reports:
# build/tsan/logs/<short|long>/tsan.<pid> (emptied first).
# tests/test_threads.py's subprocess tests are left out: their children put the checkout
# first on PYTHONPATH, so they would run the plain build (with libtsan preloaded, to no use),
# and the fork tests fork a threaded process, which TSAN does not support (die_after_fork).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
MODE=${1:-short}
shift || true
OUT=${DPU_PIPE_TSAN_DIR:-$ROOT/build/tsan}
log() { printf '\033[1m[tsan]\033[0m %s\n' "$*" >&2; }
SECONDS=0
scripts/tsan/build.sh
log "build: ${SECONDS} s"

# The runtime and the OpenMP shim on a program whose answer is known; then a known race
# reached from Python threads (scripts/tsan/race_selftest.py).
mkdir -p "$OUT/selftest"
gcc -fopenmp -fsanitize=thread -O1 -g -o "$OUT/selftest/omp_selftest" scripts/tsan/omp_selftest.c
reports() {   # reports() LOGDIR PROGRAM ARGS...: how many reports PROGRAM made
  local dir=$1; shift
  rm -rf "$dir"
  # The first report is the answer: the racy programs stop there (a race hit in a loop
  # makes TSAN slow down every access after it).
  TSAN_OPTIONS=halt_on_error=1 TSAN_LOG_DIR=$dir DPU_PIPE_PYTHON=$1 \
    scripts/tsan/python.sh "${@:2}" >/dev/null 2>&1 || true
  cat "$dir"/tsan.* 2>/dev/null | grep -c "WARNING: ThreadSanitizer" || true
}
clean=$(reports "$OUT/selftest/clean" "$OUT/selftest/omp_selftest")
racy=$(reports "$OUT/selftest/racy" "$OUT/selftest/omp_selftest" racy)
threads=$(reports "$OUT/selftest/python" "" scripts/tsan/race_selftest.py)
if [ "$clean" != 0 ] || [ "$racy" = 0 ] || [ "$threads" = 0 ]; then
  log "self-test failed: reports for the correct OpenMP program: $clean (0 expected), for" \
      "the racy one: $racy, for race_selftest.py: $threads (1 or more expected); logs in" \
      "$OUT/selftest/"
  exit 1
fi
log "self-tests: ${SECONDS} s"

# The subprocess tests of tests/test_threads.py (see above), and the Loader's memory test:
# TSAN's shadow memory and access history add to the RSS it bounds.
apart="during_iteration or exit_with or keyboard or ctrl_c or forked or torch_dataloader_workers
       or memory_stays_flat"
case $MODE in
  short)
    export DPU_PIPE_STRESS_SECONDS=${DPU_PIPE_STRESS_SECONDS:-24}
    tests=(tests/test_loader.py tests/test_threads.py)
    select="((any_threads_and_prefetch and threads2) or float32_stream_is_the_same
             or (raise_names_the_bad_file and prefetch3) or (skip_keeps and threads2)
             or (without_copy and prefetch3) or close_mid_epoch or producer or abandoned
             or test_threads) and not ($apart)" ;;
  long)
    export DPU_PIPE_STRESS_SECONDS=${DPU_PIPE_STRESS_SECONDS:-120}
    tests=(tests/test_loader.py tests/test_batch.py tests/test_threads.py)
    select="not ($apart)" ;;
  *) log "usage: scripts/tsan/check.sh short|long [pytest arguments]"; exit 2 ;;
esac
[ -f tests/test_threads.py ] || { log "tests/test_threads.py is missing"; exit 1; }
export TSAN_LOG_DIR=$OUT/logs/$MODE
rm -rf "$TSAN_LOG_DIR"
rc=0
PYTHONPATH=$ROOT/scripts/tsan scripts/tsan/python.sh -m pytest -q -p no:cacheprovider \
  -p pytest_tsan -o timeout=600 -k "$(echo $select)" "${tests[@]}" "$@" || rc=$?
log "$MODE run: ${SECONDS} s in all, pytest status $rc (66: TSAN reported)"
exit "$rc"
