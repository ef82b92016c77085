#!/usr/bin/env bash
# Fuzz the targets of tests/fuzz/targets.py with atheris.
#   tests/fuzz/run.sh long  [TARGET ...]  the measured runs: 1,000,000 executions for the
#                                         decoder targets (header, decode), 200,000 for the
#                                         others; corpus kept in build/fuzz/corpus/
#   tests/fuzz/run.sh smoke [TARGET ...]  CI: FUZZ_SMOKE_SECONDS (default 15) per target from
#                                         the seeds and the checked-in regression inputs
#                                         (8 targets: about 3.5 minutes with start-up)
# With the sanitizer build (scripts/asan/build.sh) the targets run under ASan+UBSan and the
# extensions' and libjpeg's edges guide the fuzzer; without it, the plain build is fuzzed and
# only Python edges are seen (crashes still end the run; -keep_seed keeps every seed JPEG in
# the corpus, since without native edges they all look alike); FUZZ_BUILD=plain forces that. Logs: build/fuzz/logs/<target>.log;
# a crashing input: build/fuzz/artifacts/<target>/. FUZZ_JOBS: targets run at once (default 1).
# Exit status: non-zero if any target failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
MODE=${1:-}
shift || true
TARGETS=${*:-header decode batch packed filelist bufferlist tar parquet}
PY=${DPU_PIPE_PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=$ROOT/.venv/bin/python; else PY=$(command -v python3); fi
fi
export DPU_PIPE_PYTHON=$PY
OUT=$ROOT/build/fuzz
mkdir -p "$OUT/logs"
if [ -f build/asan/runtime/asan_with_fuzzer.so ] && [ "${FUZZ_BUILD:-}" != plain ]; then
  RUN=(scripts/asan/python.sh)
else
  echo "[fuzz] no sanitizer build (scripts/asan/build.sh): fuzzing the plain build" >&2
  RUN=(env PYTHONPATH="$ROOT" "$PY")
fi
if [ ! -d "$OUT/seeds/parquet" ]; then
  rm -rf "$OUT/seeds"
  PYTHONPATH=$ROOT "$PY" tests/fuzz/seeds.py "$OUT/seeds.tmp" >/dev/null || exit 1
  mv "$OUT/seeds.tmp" "$OUT/seeds"
fi
case "$MODE" in long|smoke) ;; *) echo "usage: $0 long|smoke [TARGET ...]" >&2; exit 2 ;; esac
# One target: its run, then one summary line; returns non-zero if it failed.
run_target() {
  local t=$1 limit corpus dirs log start rc done_line execs
  case "$MODE" in
    long)
      case $t in header|decode) limit=(-runs=1000000) ;; *) limit=(-runs=200000) ;; esac
      # Their work is all native: without the sanitizer build's edge counters a long run
      # mutates blind (libFuzzer counts a few dozen Python edges) and checks no memory.
      if [ "${RUN[0]}" != scripts/asan/python.sh ] && [ "${limit[0]}" = -runs=1000000 ]; then
        echo "[fuzz] $t: a long run needs the sanitizer build (scripts/asan/build.sh)" >&2
        return 1
      fi
      corpus=$OUT/corpus/$t ;;
    smoke)
      limit=(-max_total_time="${FUZZ_SMOKE_SECONDS:-15}" -seed=1)
      corpus=$(mktemp -d) ;;
  esac
  mkdir -p "$corpus" "$OUT/artifacts/$t"
  dirs=("$corpus" "$OUT/seeds/$t")
  [ -d "tests/fuzz/regressions/$t" ] && dirs+=("tests/fuzz/regressions/$t")
  log=$OUT/logs/$t.log
  [ "$MODE" = smoke ] && log=$OUT/logs/smoke-$t.log
  start=$SECONDS
  nice -n 5 "${RUN[@]}" tests/fuzz/fuzz.py "$t" "${limit[@]}" -keep_seed=1 -timeout=20 \
    -rss_limit_mb=3000 \
    -max_len=8192 -print_final_stats=1 -artifact_prefix="$OUT/artifacts/$t/" "${dirs[@]}" \
    >"$log" 2>&1
  rc=$?
  [ "$MODE" = smoke ] && rm -rf "$corpus"
  done_line=$(grep -E "^#[0-9]+[[:space:]]+(DONE|pulse|NEW|REDUCE)" "$log" | tail -1)
  execs=$(grep -o "number_of_executed_units: [0-9]*" "$log" | tail -1)
  echo "[fuzz] $t: rc=$rc $((SECONDS - start)) s; ${execs:-no stats}; last: ${done_line:-none}"
  [ $rc -eq 0 ] || { grep -m1 -E "ERROR|Traceback|SUMMARY" "$log"; return 1; }
}
# FUZZ_JOBS targets at once (default 1): each is one single-threaded process, so CI's smoke
# run uses both cores.
jobs_max=${FUZZ_JOBS:-1}
status=0
pids=()
for t in $TARGETS; do
  if [ "${#pids[@]}" -ge "$jobs_max" ]; then
    wait "${pids[0]}" || status=1
    pids=("${pids[@]:1}")
  fi
  run_target "$t" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
