#!/usr/bin/env bash
# dpu_pipe's CUDA paths on a machine with an NVIDIA GPU, in one run of a few minutes (under
# 10 with the default budget):
#
#   scripts/gpu_check.sh                       # installs from build/gpu-wheelhouse, runs it all
#   scripts/gpu_check.sh --python .venv/bin/python   # a Python that has it all: no install
#
# Steps (each under its own deadline, all within --budget seconds; scripts/gpu/*.py):
#   preflight    imports dpu_pipe (decoding with its kernels), torch, mpi4py, Pillow, OpenCV,
#                pytest, the tests' sample photos, and runs `mpiexec -n 2` over mpi4py; then
#                asks torch for a CUDA device: none -> "no GPU", exit 3
#   cuda-tests   the test files holding tests that skip without CUDA, run whole; each of
#                those tests must pass (not skip)
#   offload      DPULoader(device="cuda") under mpiexec, 1 host + 2 producers: batches bit
#                for bit the local Loader's, copied from the registered RMA window
#                (stats()["device_path"] == "window"), re-registered when the window is made
#                again, hybrid mode's host batches staged
#   copy-timing  batch -> GPU by the window, staging and pageable paths, copies included;
#                the copy of batch k+1 overlaps compute on batch k (CUDA events on a copy
#                stream and a compute stream)
#   train        one epoch of examples/train_imagenet.py --device cuda --amp (resnet_tiny,
#                channels_last, NCCL with world size 1) offloaded to 2 producers
# Then a report: printed, written to WORK/gpu_report.md and, when OUT is set (the device
# machine's return folder), to $OUT/gpu_report.md with the step logs in $OUT/gpu_logs/.
#
# Exit status: 0 every check passed; 1 a check failed or something is missing (named);
# 3 everything imports and MPI runs, but there is no GPU ("no GPU").
#
# Install (no network needed): without --python, a venv is made in WORK from the base Python
# (default /opt/torch/.venv/bin/python if it exists, else python3) that sees the base's
# packages (torch ...), and the wheelhouse's dpu_pipe and mpich wheels go into it; its mpi4py
# too when the base's does not load MPICH. When scikit-image is missing, the wheelhouse's
# photos/ serve skimage.data (scripts/gpu/photos). Build the wheelhouse with
# scripts/gpu_wheelhouse.sh.
#
# Options:
#   --python PY        use PY as it is (dpu_pipe, torch, mpi4py installed; mpiexec beside it
#                      or on PATH)
#   --base-python PY   the Python the venv is made from (with --wheelhouse)
#   --wheelhouse DIR   default build/gpu-wheelhouse (or GPU_CHECK_WHEELHOUSE)
#   --work DIR         scratch folder (default a new one under /tmp)
#   --only LIST        run only these steps (comma-separated; preflight always runs)
#   --budget S         seconds for the whole run (default 540)
#   --without-gpu      go on past "no GPU" (the steps then fail where they need CUDA): a run
#                      of the script's own plumbing on a machine without one
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GPU=$ROOT/scripts/gpu
STEPS=(cuda-tests offload copy-timing train)
PY="" BASE_PY="" WH=${GPU_CHECK_WHEELHOUSE:-$ROOT/build/gpu-wheelhouse} WORK="" ONLY="" BUDGET=540
WITHOUT_GPU=0
while [ $# -gt 0 ]; do
    case $1 in
        --python) PY=$2; shift 2 ;;
        --base-python) BASE_PY=$2; shift 2 ;;
        --wheelhouse) WH=$2; shift 2 ;;
        --work) WORK=$2; shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        --budget) BUDGET=$2; shift 2 ;;
        --without-gpu) WITHOUT_GPU=1; shift ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 1 ;;
    esac
done
if [ -n "$ONLY" ]; then
    IFS=, read -r -a STEPS <<< "$ONLY"
    for s in "${STEPS[@]}"; do
        case $s in cuda-tests|offload|copy-timing|train) ;;
            *) echo "gpu_check.sh: no step $s (cuda-tests, offload, copy-timing, train)" >&2; exit 1 ;;
        esac
    done
fi

# Paths given relative to where the script was started from.
absolute() { case $1 in /*|"") echo "$1" ;; */*) echo "$PWD/$1" ;; *) command -v "$1" || echo "$1" ;; esac; }
PY=$(absolute "$PY"); BASE_PY=$(absolute "$BASE_PY")
case $WH in /*) ;; *) WH=$PWD/$WH ;; esac
case $WORK in /*|"") ;; *) WORK=$PWD/$WORK ;; esac

say() { printf '[gpu-check %3ds] %s\n' "$SECONDS" "$*"; }
keep_logs() {  # the logs and records so far, into $OUT (the device machine's return folder)
    if [ -n "${OUT:-}" ] && [ -n "${LOGS:-}" ]; then
        mkdir -p "$OUT/gpu_logs"
        cp "$LOGS"/*.log "$RES"/*.json "$RES"/*.xml "$OUT/gpu_logs/" 2>/dev/null
    fi
    return 0
}
fail() { say "FAIL: $*"; keep_logs; exit 1; }

if [ -z "$WORK" ]; then WORK=$(mktemp -d /tmp/dpu_pipe-gpu-check.XXXXXX); fi
mkdir -p "$WORK" && WORK=$(cd "$WORK" && pwd) || fail "cannot make the work folder $WORK"
RES=$WORK/results LOGS=$WORK/logs
rm -rf "$RES" "$LOGS" && mkdir -p "$RES" "$LOGS"
# Every Python of the check runs from WORK: a checkout's dpu_pipe/ (sources without compiled
# kernels on a machine that did not build them) must not shadow the installed package.
cd "$WORK" || fail "cannot enter $WORK"
say "work folder $WORK"

# --- the Python ------------------------------------------------------------------------------
if [ -n "$PY" ]; then
    [ -x "$PY" ] || fail "--python $PY: not found"
    say "Python as it is: $PY"
else
    ls "$WH"/dpu_pipe-*.whl >/dev/null 2>&1 \
        || fail "no dpu_pipe wheel in the wheelhouse $WH: build it with scripts/gpu_wheelhouse.sh (and carry it), or give --python"
    WH=$(cd "$WH" && pwd)
    if [ -z "$BASE_PY" ]; then
        if [ -x /opt/torch/.venv/bin/python ]; then BASE_PY=/opt/torch/.venv/bin/python
        else BASE_PY=$(command -v python3 || true); fi
    fi
    [ -n "$BASE_PY" ] && [ -x "$BASE_PY" ] || fail "no base Python (--base-python)"
    VENV=$WORK/venv
    say "venv $VENV from $BASE_PY, wheels from $WH"
    rm -rf "$VENV"
    # pip runs from the wheelhouse's pip wheel: the base may have no pip of its own (a uv
    # venv) nor ensurepip (a distribution's Python without its venv package).
    pipwhl=$(ls "$WH"/pip-*.whl 2>/dev/null | tail -n 1)
    if [ -n "$pipwhl" ]; then
        "$BASE_PY" -m venv --without-pip "$VENV" > "$LOGS/install.log" 2>&1
    else
        "$BASE_PY" -m venv "$VENV" > "$LOGS/install.log" 2>&1
    fi || fail "venv: $(tail -5 "$LOGS/install.log")"
    PY=$VENV/bin/python
    # The base's packages (torch, numpy, ...) behind the venv's own: a venv made from a venv
    # would otherwise see only the base interpreter's site-packages.
    "$BASE_PY" - "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" <<'EOF' >> "$LOGS/install.log" 2>&1 \
        || fail "linking the base's packages: $(tail -5 "$LOGS/install.log")"
import os, sys, sysconfig
dirs = []
for key in ("purelib", "platlib"):
    d = sysconfig.get_paths()[key]
    if d not in dirs:
        dirs.append(d)
with open(os.path.join(sys.argv[1], "_gpu_check_base.pth"), "w") as f:
    for d in dirs:
        f.write(f"import site; site.addsitedir({d!r})\n")
EOF
    pipi() {
        local pip=("$PY" -m pip)
        [ -n "$pipwhl" ] && pip=("$PY" "$pipwhl/pip")
        # --ignore-installed: into the venv even when the base has the package (the
        # machine's mpi4py, a checkout's editable dpu_pipe), which it then shadows.
        "${pip[@]}" install -q --no-index --no-deps --ignore-installed \
            --disable-pip-version-check --find-links "$WH" "$@" >> "$LOGS/install.log" 2>&1
    }
    pipi dpu_pipe mpich || fail "pip install dpu_pipe mpich: $(tail -5 "$LOGS/install.log")"
    probe="from mpi4py import MPI; assert MPI.COMM_WORLD.allreduce(1) == 2"
    if ! timeout -k 5 60 "$VENV/bin/mpiexec" -n 2 "$PY" -c "$probe" >> "$LOGS/install.log" 2>&1; then
        say "the base's mpi4py does not load MPICH: the wheelhouse's mpi4py"
        pipi mpi4py || fail "pip install mpi4py: $(tail -5 "$LOGS/install.log")"
    fi
fi
if [ -d "${WH:-}/photos" ] && ! "$PY" -c "import skimage.data; skimage.data.astronaut()" >/dev/null 2>&1; then
    say "no scikit-image: the tests' sample photos from $WH/photos"
    export PYTHONPATH=$GPU/photos${PYTHONPATH:+:$PYTHONPATH} DPU_PIPE_GPU_PHOTOS=$WH/photos
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

# --- preflight --------------------------------------------------------------------------------
say "preflight"
timeout -k 5 180 "$PY" "$GPU/preflight.py" --result "$RES/preflight.json" 2>&1 | tee "$LOGS/preflight.log"
rc=${PIPESTATUS[0]}
if [ "$rc" = 3 ] && [ "$WITHOUT_GPU" = 1 ]; then
    say "no GPU: the steps run all the same (--without-gpu)"
elif [ "$rc" = 3 ]; then
    say "no GPU: nothing else to check here (exit 3)"
    keep_logs
    exit 3
elif [ "$rc" != 0 ]; then
    fail "preflight (exit $rc); see above"
fi
MPIEXEC=$("$PY" -c "from dpu_pipe.mpi import mpiexec_path; print(mpiexec_path())") \
    || fail "no mpiexec"

# --- steps ------------------------------------------------------------------------------------
declare -A STEP_RC=()
limit_for() {  # STEP-DEFAULT -> seconds left for a step, keeping 20 s for the report
    local left=$(( BUDGET - SECONDS - 20 ))
    [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}
run_step() {  # NAME DEFAULT-LIMIT CMD...: output in LOGS/NAME.log, exit status in STEP_RC
    local name=$1 lim rc; lim=$(limit_for "$2"); shift 2
    if [ "$lim" -lt 10 ]; then
        say "$name: no time left in the budget"
        echo "no time left in the --budget of $BUDGET s" > "$LOGS/$name.log"
        STEP_RC[$name]=124
        return
    fi
    say "$name (at most $lim s)"
    timeout -k 10 "$lim" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    STEP_RC[$name]=$rc
    if [ "$rc" = 0 ]; then
        say "$name: ok"
    else
        say "$name: FAILED (exit $rc); log tail:"
        tail -n 30 "$LOGS/$name.log" | sed 's/^/    /'
    fi
}
want() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }

if want cuda-tests; then
    # A copy of the tests, so that the ranks their MPI tests start (PYTHONPATH = the copy's
    # root) import the installed dpu_pipe.
    rm -rf "$WORK/tree" && mkdir -p "$WORK/tree"
    cp "$ROOT/pyproject.toml" "$WORK/tree/"
    (cd "$ROOT" && tar --exclude=__pycache__ -cf - tests) | tar -xf - -C "$WORK/tree"
    run_step cuda-tests 240 "$PY" "$GPU/cuda_tests.py" --tests "$WORK/tree/tests" \
        --result "$RES/cuda-tests.json"
fi
if want offload || want train; then
    "$PY" "$GPU/make_data.py" "$WORK/data" > "$LOGS/data.log" 2>&1 \
        || fail "making the datasets: $(tail -5 "$LOGS/data.log")"
fi
if want offload; then
    run_step offload 150 "$MPIEXEC" -n 1 "$PY" -m mpi4py "$GPU/offload_check.py" \
        --data "$WORK/data/offload" --result "$RES/offload.json" \
        : -n 2 "$PY" -m mpi4py -m dpu_pipe.worker
fi
if want copy-timing; then
    run_step copy-timing 150 "$PY" "$GPU/copy_timing.py" --result "$RES/copy-timing.json"
fi
if want train; then
    rm -rf "$WORK/run"
    # NCCL_DEBUG=VERSION: NCCL prints its version when it starts, the proof that it ran.
    run_step train-run 240 env NCCL_DEBUG=VERSION "$MPIEXEC" -n 1 "$PY" -m mpi4py \
        "$ROOT/examples/train_imagenet.py" --train "$WORK/data/train" --val "$WORK/data/val" \
        --epochs 1 --batch-size 32 --size 64 --arch resnet_tiny --width 16 --mode offload \
        --device cuda --amp --checkpoint "$WORK/run" --json "$WORK/run/log.json" \
        --log-every 5 --timeout 120 \
        : -n 2 "$PY" -m mpi4py -m dpu_pipe.worker
    # The run leaves the example's own files; train_check.py judges them (the step's record).
    "$PY" "$GPU/train_check.py" --run-dir "$WORK/run" --log "$LOGS/train-run.log" \
        --exit-status "${STEP_RC[train-run]}" --result "$RES/train.json" --val-count 80 \
        > "$LOGS/train.log" 2>&1
    STEP_RC[train]=$?
    [ "${STEP_RC[train]}" = 0 ] || { say "train: FAILED"; head -n 40 "$LOGS/train.log" | sed 's/^/    /'; }
fi

# --- report -----------------------------------------------------------------------------------
expect=preflight
for s in "${STEPS[@]}"; do expect+=",$s"; done
outs=(--out "$WORK/gpu_report.md")
[ -n "${OUT:-}" ] && mkdir -p "$OUT" && outs+=(--out "$OUT/gpu_report.md")
echo
# A step that ended without its record (crashed, timed out) is recorded with its log's tail.
lost=()
for s in "${STEPS[@]}"; do
    [ -f "$RES/$s.json" ] || lost+=(--fail-step "$s:${STEP_RC[$s]:-1}:$LOGS/$s.log")
done
"$PY" "$GPU/report.py" --results "$RES" "${outs[@]}" --expect "$expect" "${lost[@]}"
rc=$?
keep_logs
say "report: $WORK/gpu_report.md${OUT:+ and $OUT/gpu_report.md}"
[ "$rc" = 0 ] && exit 0 || exit 1
