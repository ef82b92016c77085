#!/usr/bin/env bash
# CI step for the DPU wheel: cross-build the cp311 wheels (aarch64 + x86-64, toolchain installed
# by the script itself) and the cp39 aarch64 one, then run tests/test_aarch64.py — wheel tags,
# NEON per kernel, the kernel, decode and Loader tests under qemu-aarch64 (cortex-a72) in an arm64
# chroot, x86-64 vs aarch64 bit-identity, and the cp39 wheel in a glibc 2.31 userland (Debian
# bullseye, the glibc of Ubuntu 20.04 DPU images). Prints the time of each step.
#   scripts/cross/ci.sh [PYTHON]   PYTHON runs pytest on the host (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${1:-.venv/bin/python}
[ -x "$py" ] || py=python3
t0=$(date +%s)
scripts/build_wheels.sh --arch aarch64,x86_64 --python 3.11
scripts/build_wheels.sh --arch aarch64 --python 3.9
t1=$(date +%s)
DPU_PIPE_AARCH64_WHEEL=$(ls -t dist/dpu_pipe-*-cp311-cp311-*_aarch64.whl | head -1) \
DPU_PIPE_X86_64_WHEEL=$(ls -t dist/dpu_pipe-*-cp311-cp311-*_x86_64.whl | head -1) \
    "$py" -m pytest -q -s -p no:cacheprovider tests/test_aarch64.py
t2=$(date +%s)
echo "cross-build: $((t1 - t0)) s, aarch64 tests: $((t2 - t1)) s"
