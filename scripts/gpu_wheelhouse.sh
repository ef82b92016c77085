#!/usr/bin/env bash
# Build the wheelhouse that scripts/gpu_check.sh installs from on a GPU machine that has no
# network (Python 3.12 with torch, mpi4py, pillow, opencv, pytest; no MPI library, no
# libjpeg headers, no scikit-image):
#
#   scripts/gpu_wheelhouse.sh [--out build/gpu-wheelhouse] [--python 3.12] [--worktree]
#
# What goes in (kept under 50 MiB: the whole folder travels with the check):
#   dpu_pipe-*-cp311-abi3-*_x86_64.whl   built by scripts/build_wheels.sh (libjpeg-turbo bundled)
#                                        from the committed HEAD, or with --worktree from the
#                                        working tree as it is (tracked and untracked files)
#   mpich-*.whl, mpi4py-*.whl            binary wheels for CPython X.Y on x86-64 (pip download):
#                                        the MPI library, and an mpi4py for it in case the
#                                        machine's own does not load it
#   pip-*.whl                            pip itself, run from its wheel: the machine's Python
#                                        may have neither pip nor ensurepip
#   photos/                              the four sample photographs the tests' data helpers
#                                        read through skimage.data (from the scikit-image wheel,
#                                        with SHA256SUMS): scikit-image needs SciPy, which is
#                                        too large to carry; scripts/gpu/photos serves these
#                                        files under that name when scikit-image is absent
#   MANIFEST                             name, size and sha256 of every file above
#
# Options:
#   --out DIR       the wheelhouse (default build/gpu-wheelhouse; emptied first)
#   --python X.Y    the GPU machine's CPython (default 3.12)
#   --worktree      build the dpu_pipe wheel from the working tree instead of HEAD
#   --reuse-wheel   keep the dpu_pipe wheel already in --out (refresh the rest only)
#   --no-install    passed to build_wheels.sh: its toolchain must already be there
# Environment: PYTHON (runs pip and the build, default python3), MPICH_SPEC and MPI4PY_SPEC
# (requirement strings, default "mpich" and "mpi4py").
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)

OUT=$root/build/gpu-wheelhouse PYVER=3.12 WORKTREE=0 REUSE=0 BUILD_ARGS=()
while [ $# -gt 0 ]; do
    case $1 in
        --out) OUT=$2; shift 2 ;;
        --python) PYVER=$2; shift 2 ;;
        --worktree) WORKTREE=1; shift ;;
        --reuse-wheel) REUSE=1; shift ;;
        --no-install) BUILD_ARGS+=(--no-install); shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_wheelhouse.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-python3}
LIMIT_MIB=50
log() { printf '[gpu-wheelhouse] %s\n' "$*" >&2; }

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ "$REUSE" = 1 ]; then
    ls "$OUT"/dpu_pipe-*-cp311-abi3-*x86_64.whl >/dev/null 2>&1 \
        || { log "--reuse-wheel: no dpu_pipe wheel in $OUT"; exit 1; }
    mkdir -p "$tmp/keep" && mv "$OUT"/dpu_pipe-*.whl "$tmp/keep/"
fi
rm -rf "${OUT:?}"/*

# --- the dpu_pipe wheel ------------------------------------------------------------------------
if [ "$REUSE" = 1 ]; then
    mv "$tmp"/keep/*.whl "$OUT/"
    log "dpu_pipe wheel kept: $(cd "$OUT" && ls dpu_pipe-*.whl)"
elif [ "$WORKTREE" = 1 ]; then
    src=$root
    log "dpu_pipe wheel from the working tree"
else
    # A clean export of HEAD: other uncommitted edits in the tree do not end up in the wheel.
    src=$tmp/src
    mkdir -p "$src"
    git -C "$root" archive HEAD | tar -x -C "$src"
    log "dpu_pipe wheel from HEAD $(git -C "$root" rev-parse --short HEAD)"
fi
if [ "$REUSE" = 0 ]; then
    # build_wheels.sh builds in its own copy under $src/build/wheels, never in dpu_pipe/ in
    # place.
    PYTHON=$PY "$root/scripts/build_wheels.sh" --arch x86_64 --python "$PYVER" --src "$src" \
        --out "$OUT" --no-resolve "${BUILD_ARGS[@]}"
fi

# --- MPI -----------------------------------------------------------------------------------------
plats=()
for m in $(seq 35 -1 17); do plats+=(--platform "manylinux_2_${m}_x86_64"); done
plats+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
log "pip download ${MPICH_SPEC:-mpich} ${MPI4PY_SPEC:-mpi4py} pip for CPython $PYVER x86-64"
"$PY" -m pip download -q --no-deps --only-binary :all: "${plats[@]}" --python-version "$PYVER" \
    --implementation cp -d "$OUT" "${MPICH_SPEC:-mpich}" "${MPI4PY_SPEC:-mpi4py}" pip

# --- the tests' sample photographs ----------------------------------------------------------------
log "scikit-image's sample photographs"
"$PY" -m pip download -q --no-deps --only-binary :all: "${plats[@]}" --python-version "$PYVER" \
    --implementation cp -d "$tmp/sk" scikit-image
mkdir -p "$OUT/photos"
"$PY" - "$tmp"/sk/scikit_image-*.whl "$OUT/photos" <<'EOF'
import hashlib, os, sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
names = {"astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg"}
with zipfile.ZipFile(whl) as z:
    found = {os.path.basename(n): n for n in z.namelist()
             if n.startswith("skimage/data/") and os.path.basename(n) in names}
    missing = names - set(found)
    if missing:
        sys.exit(f"{os.path.basename(whl)} lacks skimage/data/{sorted(missing)}")
    with open(os.path.join(dest, "SHA256SUMS"), "w") as sums:
        for name in sorted(found):
            data = z.read(found[name])
            with open(os.path.join(dest, name), "wb") as f:
                f.write(data)
            sums.write(f"{hashlib.sha256(data).hexdigest()}  {name}\n")
    with open(os.path.join(dest, "SOURCE"), "w") as f:
        f.write(os.path.basename(whl) + "\n")
EOF

# --- manifest and size ------------------------------------------------------------------------------
(cd "$OUT" && find . -type f ! -name MANIFEST | sort | while read -r f; do
    printf '%s  %10d  %s\n' "$(sha256sum "$f" | cut -c1-64)" "$(stat -c %s "$f")" "${f#./}"
done) > "$OUT/MANIFEST"
ls "$OUT"/dpu_pipe-*-cp311-abi3-*x86_64.whl >/dev/null \
    || { log "no dpu_pipe x86-64 abi3 wheel in $OUT"; exit 1; }
ls "$OUT"/mpich-*.whl "$OUT"/mpi4py-*.whl "$OUT"/pip-*.whl >/dev/null
bytes=$(du -sb "$OUT" | cut -f1)
log "$OUT: $(( bytes / 1024 / 1024 )) MiB"
sed 's/^/    /' "$OUT/MANIFEST" >&2
if [ "$bytes" -gt $(( LIMIT_MIB * 1024 * 1024 )) ]; then
    log "over ${LIMIT_MIB} MiB: too large to travel with the check"
    exit 1
fi
