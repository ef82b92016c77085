#!/usr/bin/env bash
# CI step for the wheels: cross-build the cp311-abi3 wheels (aarch64 + x86-64, toolchain
# installed by the script itself) and the cp39 and cp310 aarch64 ones, then run
# tests/test_aarch64.py — wheel tags, bundled libraries and glibc symbols of every wheel, NEON
# per kernel, the kernel, decode and Loader tests under qemu-aarch64 (cortex-a72) in an arm64
# chroot, x86-64 vs aarch64 bit-identity for each wheel on each arm64 interpreter Debian has
# (3.9 in a glibc 2.31 userland as on Ubuntu 20.04 DPUs, 3.11, 3.13), the x86-64 abi3 wheel
# natively on 3.12 and 3.13, and the aarch64 pyconfig.h that the cp310 build derives.
# Prints the time of each step.
#   scripts/cross/ci.sh [--all] [PYTHON]
#     --all    every wheel: cp39, cp310 and cp311-abi3 for both architectures (the x86-64
#              ones then also run natively on 3.9 and 3.10)
#     PYTHON   runs pytest on the host (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/../.."
all=0
if [ "${1:-}" = --all ]; then all=1; shift; fi
py=${1:-.venv/bin/python}
[ -x "$py" ] || py=python3
t0=$(date +%s)
if [ "$all" = 1 ]; then
    scripts/build_wheels.sh --arch aarch64,x86_64 --python all
else
    scripts/build_wheels.sh --arch aarch64,x86_64 --python 3.11
    scripts/build_wheels.sh --arch aarch64 --python 3.9,3.10
fi
t1=$(date +%s)
# build_wheels.sh installed the cross toolchain and the emulator; tests/test_aarch64.py (its NEON
# check disassembles with the cross objdump) fails under CI=true without them, and skips
# otherwise, so this step says it here rather than letting a hand run skip silently.
for t in aarch64-linux-gnu-gcc aarch64-linux-gnu-objdump qemu-aarch64-static; do
    command -v "$t" >/dev/null || { echo "ci.sh: $t missing after the wheel build" >&2; exit 1; }
done
DPU_PIPE_AARCH64_WHEEL=$(ls -t dist/dpu_pipe-*-cp311-abi3-*_aarch64.whl | head -1) \
DPU_PIPE_X86_64_WHEEL=$(ls -t dist/dpu_pipe-*-cp311-abi3-*_x86_64.whl | head -1) \
    "$py" -m pytest -q -s -rs -p no:cacheprovider tests/test_aarch64.py
t2=$(date +%s)
echo "cross-build: $((t1 - t0)) s, aarch64 tests: $((t2 - t1)) s"
