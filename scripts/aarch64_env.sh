#!/usr/bin/env bash
# An isolated arm64 userland for running dpu_pipe's aarch64 wheel under emulation on an x86-64
# machine: Debian arm64 .debs unpacked with dpkg-deb (CPython, glibc, libstdc++ — and nothing
# else, so a library missing from the wheel fails here as it would on a DPU), aarch64 wheels of
# what the tests import (numpy, pytest, Pillow, SciPy, scikit-image, OpenCV) installed by the
# host's pip (--platform, --target), entered with chroot and run by
# qemu-aarch64-static -cpu cortex-a72 (BlueField-2's core). A chroot, because qemu's -L falls back
# to the host's own library paths; no binfmt is needed, but nothing run inside may start
# subprocesses (they would be x86-64 execs of arm64 binaries).
#
#   scripts/aarch64_env.sh setup   [--python 3.11]            build or refresh it; prints its root
#   scripts/aarch64_env.sh install [--python 3.11] WHEEL [TEST_KERNELS]
#                                  install a dpu_pipe wheel (replacing one) and the test
#                                  extensions built with it (scripts/build_wheels.sh puts them in
#                                  build/wheels/test-kernels/<wheel>/), which the emulated tests
#                                  load from there (tests/kernel_probes.py, $DPU_PIPE_TEST_KERNELS)
#   scripts/aarch64_env.sh python  [--python 3.11] ARGS...    run the arm64 python3.X with ARGS
#   scripts/aarch64_env.sh pytest  [--python 3.11] FILES... [-- PYTEST-ARGS]
#                                  copy tests/ in and run pytest on FILES (paths under tests/)
#   scripts/aarch64_env.sh root    [--python 3.11]            print the userland's root
#
# Python 3.11 is Debian bookworm's (glibc 2.36); --python 3.9 builds a bullseye userland
# (glibc 2.31, as on Ubuntu 20.04 DPU images) and 3.13 a trixie one. Needs root for chroot
# (else an unprivileged user namespace, `unshare -r`). Environment: DPU_PIPE_CROSS_CACHE,
# DPU_PIPE_ARM64_ROOT (overrides the userland's location), DPU_PIPE_QEMU_CPU (default cortex-a72).

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=cross/common.sh
source "$here/cross/common.sh"

cmd=${1:-}; [ $# -gt 0 ] && shift
PYVER=3.11
if [ "${1:-}" = --python ]; then PYVER=$2; shift 2; fi
SUITE=$(suite_for_python "$PYVER") || die "no Debian suite carries CPython $PYVER (3.9, 3.11, 3.13)"
ROOT=${DPU_PIPE_ARM64_ROOT:-$CROSS_CACHE/userland/$SUITE-arm64}
QEMU_CPU=${DPU_PIPE_QEMU_CPU:-cortex-a72}
SITE=/usr/lib/python3/dist-packages   # Debian's site directory: numpy, pytest, Pillow
WHEEL_DIR=/opt/dpu_pipe               # the dpu_pipe wheel under test (on PYTHONPATH)
TEST_KERNELS_DIR=/opt/dpu_pipe-test-kernels   # its tests/kernels/ extensions, cross-compiled
# Python packages of the userland: what the kernel, decode and Loader tests import.
SUPPORT_WHEELS="numpy pytest pytest-timeout pillow scipy scikit-image opencv-python-headless"

manylinux_platforms() {  # the --platform list pip needs for "glibc <= 2.$1", aarch64
    local m
    for m in $(seq "$1" -1 17); do printf -- '--platform manylinux_2_%s_aarch64 ' "$m"; done
    printf -- '--platform manylinux2014_aarch64'
}

glibc_minor() { case $SUITE in bullseye) echo 31 ;; bookworm) echo 36 ;; trixie) echo 41 ;; esac; }

host_pip() {
    local py
    py=$(build_venv "${PYTHON:-python3}")
    "$py" -m pip "$@" 2> >(grep -v '^WARNING: Location' >&2)
}

pip_target() {  # DIR PIP-INSTALL-ARGS... : install aarch64 wheels for the userland's CPython
    local dir=$1; shift
    # shellcheck disable=SC2046
    host_pip install -q --upgrade --target "$dir" --only-binary=:all: $(manylinux_platforms "$(glibc_minor)") \
        --python-version "$PYVER" --implementation cp --abi "cp${PYVER/./}" "$@"
}

setup() {
    local stamp="$SUITE python$PYVER libstdc++6 | $SUPPORT_WHEELS"
    if [ "$(cat "$ROOT/.ok" 2>/dev/null)" = "$stamp" ] && [ -x "$ROOT/usr/bin/qemu-aarch64-static" ]; then
        echo "$ROOT"; return 0
    fi
    command -v qemu-aarch64-static >/dev/null || die "qemu-aarch64-static not found (apt-get install qemu-user-static)"
    log "arm64 userland: $SUITE python$PYVER in $ROOT"
    rm -rf "$ROOT"
    # shellcheck disable=SC2046
    unpack_debs "$ROOT" $(fetch_debs "$SUITE" arm64 "python$PYVER" libstdc++6)
    # Suites from trixie on ship files under /usr only; /lib etc. come from base-files' links.
    local d
    for d in bin sbin lib; do [ -e "$ROOT/$d" ] || ln -s "usr/$d" "$ROOT/$d"; done
    cp "$(command -v qemu-aarch64-static)" "$ROOT/usr/bin/qemu-aarch64-static"
    mkdir -p "$ROOT/tmp" "$ROOT/root" "$ROOT/work" "$ROOT$WHEEL_DIR" "$ROOT/dev"
    chmod 1777 "$ROOT/tmp"
    # pytest's capture opens /dev/null; a real device when we may make one
    mknod -m 666 "$ROOT/dev/null" c 1 3 2>/dev/null || { : > "$ROOT/dev/null"; chmod 666 "$ROOT/dev/null"; }
    log "aarch64 wheels: $SUPPORT_WHEELS"
    # shellcheck disable=SC2086
    pip_target "$ROOT$SITE" $SUPPORT_WHEELS
    echo "$stamp" > "$ROOT/.ok"
    echo "$ROOT"
}

install_wheel() {
    local whl=$1 kernels=${2:-}
    [ -f "$whl" ] || die "no such wheel: $whl"
    [ -z "$kernels" ] || [ -d "$kernels" ] || die "no such directory of test extensions: $kernels"
    [ -f "$ROOT/.ok" ] || setup >/dev/null
    rm -rf "${ROOT:?}$WHEEL_DIR" "${ROOT:?}$TEST_KERNELS_DIR" && mkdir -p "$ROOT$WHEEL_DIR"
    pip_target "$ROOT$WHEEL_DIR" --no-deps "$whl"
    log "installed $(basename "$whl") in $ROOT$WHEEL_DIR"
    if [ -n "$kernels" ]; then
        cp -r "$kernels" "$ROOT$TEST_KERNELS_DIR"
        log "installed its test extensions ($(cd "$kernels" && echo *.so)) in $ROOT$TEST_KERNELS_DIR"
    fi
}

enter() {  # run ARGS with the userland as /
    # A private mount and PID namespace gives the userland its own /proc (qemu emulates
    # /proc/self for the guest), gone with the last process: nothing stays mounted.
    local runner=(unshare --mount --pid --fork --mount-proc="$ROOT/proc")
    mkdir -p "$ROOT/proc"
    if [ "$(id -u)" != 0 ]; then
        unshare -r true 2>/dev/null || die "chroot needs root or unprivileged user namespaces"
        runner=(unshare -r --mount --pid --fork --mount-proc="$ROOT/proc")
    fi
    if ! "${runner[@]}" true 2>/dev/null; then
        log "no mount namespace here: the userland runs without /proc"
        runner=(); [ "$(id -u)" = 0 ] || runner=(unshare -r)
    fi
    local chroot_bin
    chroot_bin=$(command -v chroot || echo /usr/sbin/chroot)
    "${runner[@]}" env -i PATH=/usr/bin:/bin HOME=/root LANG=C.UTF-8 TMPDIR=/tmp \
        PYTHONPATH="$WHEEL_DIR" PYTHONDONTWRITEBYTECODE=1 PYTHONHASHSEED=0 \
        OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" DPU_PIPE_EMULATED=1 \
        DPU_PIPE_TEST_KERNELS="$TEST_KERNELS_DIR" \
        "$chroot_bin" "$ROOT" /usr/bin/qemu-aarch64-static -cpu "$QEMU_CPU" "$@"
}

run_python() {
    [ -f "$ROOT/.ok" ] || setup >/dev/null
    enter "/usr/bin/python$PYVER" "$@"
}

run_pytest() {
    local files=() args=()
    while [ $# -gt 0 ]; do
        if [ "$1" = -- ]; then shift; args=("$@"); break; fi
        files+=("$1"); shift
    done
    local src=$here/..
    rm -rf "$ROOT/work/tests" && mkdir -p "$ROOT/work"
    cp -r "$src/tests" "$ROOT/work/tests"
    find "$ROOT/work/tests" -name __pycache__ -prune -exec rm -rf {} +
    cp "$src/pyproject.toml" "$ROOT/work/" 2>/dev/null || true
    local rel=() f
    for f in "${files[@]}"; do rel+=("tests/${f#tests/}"); done
    # cd /work inside: pytest's rootdir and config are the copied pyproject.toml
    run_python -c 'import os, sys; os.chdir("/work"); import pytest; sys.exit(pytest.main(sys.argv[1:]))' \
        -p no:cacheprovider "${rel[@]}" "${args[@]}"
}

case $cmd in
    setup) setup ;;
    install) install_wheel "$@" ;;
    python) run_python "$@" ;;
    pytest) run_pytest "$@" ;;
    root) echo "$ROOT" ;;
    *) sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'; [ -z "$cmd" ] || exit 2 ;;
esac
