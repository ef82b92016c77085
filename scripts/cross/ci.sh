#!/usr/bin/env bash
# CI step for the DPU wheel: cross-build the cp311-abi3 wheels (aarch64 + x86-64, toolchain
# installed by the script itself), then run tests/test_aarch64.py on them — wheel tags, bundled
# libraries and glibc symbols, NEON per kernel, the batch kernel's, RNG's and transcoder's tests
# under qemu-aarch64 (cortex-a72) in an arm64 chroot (--all: the decoder's, sampler's and
# Loader's too), x86-64 vs aarch64 bit-identity on Debian's
# arm64 CPython 3.11, the x86-64 wheel's SSE2 copies under qemu-x86_64 against its AVX2 ones,
# and the aarch64 pyconfig.h that the cp310 build derives. That is what proves the wheel a DPU
# installs; the other versions' wheels (cp39, cp310) and the abi3 wheel on the other
# interpreters (3.12, 3.13, natively and emulated) are the long form, --all (about 25 minutes more here); the short form's
# test_aarch64.py lists them as skipped with that command.
# Prints the time of each step.
#   scripts/cross/ci.sh [--all] [PYTHON]
#     --all    every wheel: cp39, cp310 and cp311-abi3 for both architectures, each tested on
#              every interpreter it serves (the x86-64 ones natively on 3.9-3.13)
#     PYTHON   runs pytest on the host (default .venv/bin/python)
# DPU_PIPE_CI_READY=FILE: the tests wait (30 minutes at most) for FILE, which .ci/run writes once
# ./run.sh setup has made the venv they run in; the wheels build meanwhile (their own venv).
set -euo pipefail
cd "$(dirname "$0")/../.."
all=0
if [ "${1:-}" = --all ]; then all=1; shift; fi
t0=$(date +%s)
if [ "$all" = 1 ]; then
    scripts/build_wheels.sh --arch aarch64,x86_64 --python all
    export DPU_PIPE_CROSS_TESTS=all
else
    scripts/build_wheels.sh --arch aarch64,x86_64 --python 3.11
    export DPU_PIPE_CROSS_TESTS=short
fi
t1=$(date +%s)
if [ -n "${DPU_PIPE_CI_READY:-}" ]; then
    deadline=$((t1 + 1800))
    until [ -e "$DPU_PIPE_CI_READY" ]; do
        [ "$(date +%s)" -lt "$deadline" ] || { echo "ci.sh: no $DPU_PIPE_CI_READY after 30 minutes" >&2; exit 1; }
        sleep 2
    done
fi
py=${1:-.venv/bin/python}
[ -x "$py" ] || py=python3
# build_wheels.sh installed the cross toolchain and the emulator; tests/test_aarch64.py (its NEON
# check disassembles with the cross objdump) fails under CI=true without them, and skips
# otherwise, so this step says it here rather than letting a hand run skip silently.
for t in aarch64-linux-gnu-gcc aarch64-linux-gnu-objdump qemu-aarch64-static; do
    command -v "$t" >/dev/null || { echo "ci.sh: $t missing after the wheel build" >&2; exit 1; }
done
DPU_PIPE_AARCH64_WHEEL=$(ls -t dist/dpu_pipe-*-cp311-abi3-*_aarch64.whl | head -1) \
DPU_PIPE_X86_64_WHEEL=$(ls -t dist/dpu_pipe-*-cp311-abi3-*_x86_64.whl | head -1) \
    "$py" -m pytest -q -s -rs -p no:cacheprovider --durations=20 tests/test_aarch64.py
t2=$(date +%s)
echo "cross-build: $((t1 - t0)) s, aarch64 tests: $((t2 - t1)) s"
