#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer build of the Cython kernels, for fuzzing and for
# running any test with memory errors checked. Everything lands in build/asan/:
#   libjpeg/   libjpeg-turbo from Debian's source package (apt-get source), built with clang,
#              ASan+UBSan and libFuzzer coverage, SIMD off so every read of the decoder is
#              instrumented C (the x86 SIMD is hand-written assembly ASan cannot see)
#   runtime/   asan_with_fuzzer.so: clang's ASan runtime and libFuzzer in one preloadable
#              library. Python itself is not instrumented, so the runtime has to come first
#              (LD_PRELOAD); libFuzzer in the global namespace makes atheris use it and see the
#              extensions' edge counters.
#   pkg/       an importable dpu_pipe: the instrumented extensions and a copy of this checkout's
#              Python files (rebuild after editing either)
# DPU_PIPE_ASAN_DIR puts it elsewhere (a second build beside one a fuzzer is using). Run Python
# with it through scripts/asan/python.sh (same variable). Needs: clang, cmake, dpkg-dev and a
# deb-src line for apt (the libjpeg part falls back to the system libjpeg, uninstrumented,
# with a warning when the source package cannot be fetched).
#   scripts/asan/build.sh [PYTHON]      default PYTHON: .venv/bin/python, else /work/main/.venv
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PY=${1:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=$(command -v python3); fi
fi
OUT=${DPU_PIPE_ASAN_DIR:-$ROOT/build/asan}
mkdir -p "$OUT"
SAN="-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=undefined"
SAN="$SAN -fno-omit-frame-pointer -g"
log() { printf '\033[1m[asan]\033[0m %s\n' "$*" >&2; }
command -v clang >/dev/null || { log "clang is needed (apt-get install clang)"; exit 1; }
RT=$(clang -print-resource-dir)/lib/linux

# 1. The sanitizer runtime with libFuzzer linked in, as one shared library.
if [ ! -f "$OUT/runtime/asan_with_fuzzer.so" ]; then
  log "runtime: $RT"
  mkdir -p "$OUT/runtime"
  # The static runtime's preinit object is for executables; a preloaded library initialises
  # from its constructor instead.
  tmp=$(mktemp -d)
  (cd "$tmp" && ar x "$RT/libclang_rt.asan-x86_64.a" && rm -f asan_preinit.cpp.o)
  clang -shared -o "$OUT/runtime/asan_with_fuzzer.so" "$tmp"/*.o \
    -Wl,--whole-archive "$RT/libclang_rt.asan_cxx-x86_64.a" \
    "$RT/libclang_rt.fuzzer_no_main-x86_64.a" -Wl,--no-whole-archive \
    -lpthread -ldl -lrt -lm -lstdc++
  rm -rf "$tmp"
fi

# 2. libjpeg-turbo from the distribution's source package, instrumented.
JPEG_PREFIX=$OUT/libjpeg
if [ ! -f "$JPEG_PREFIX/lib/libjpeg.so" ]; then
  mkdir -p "$OUT/src"
  src=$(ls -d "$OUT"/src/libjpeg-turbo-*/ 2>/dev/null | head -1 || true)
  if [ -z "$src" ]; then
    log "fetching Debian's libjpeg-turbo source package"
    (cd "$OUT/src" && apt-get source -qq libjpeg-turbo) || true
    src=$(ls -d "$OUT"/src/libjpeg-turbo-*/ 2>/dev/null | head -1 || true)
  fi
  if [ -n "$src" ]; then
    log "building $src with ASan+UBSan"
    mkdir -p "$OUT/jpeg-build"
    (cd "$OUT/jpeg-build" && CC=clang CFLAGS="$SAN -O1" cmake -S "$src" -B . -G "Unix Makefiles" \
        -DCMAKE_INSTALL_PREFIX="$JPEG_PREFIX" -DCMAKE_INSTALL_LIBDIR="$JPEG_PREFIX/lib" -DWITH_SIMD=0 \
        -DENABLE_STATIC=0 -DWITH_TURBOJPEG=0 -DWITH_ARITH_DEC=1 -DWITH_ARITH_ENC=1 \
        -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_POLICY_VERSION_MINIMUM=3.5 >/dev/null \
     && make -s -j 2 >/dev/null && make -s install >/dev/null)
  else
    log "WARNING: no libjpeg-turbo source (add a deb-src line to apt's sources);" \
        "the decoder's own reads stay unchecked"
  fi
fi

# 3. The extensions, built with clang and the same sanitizers, against that libjpeg.
log "building the extensions"
if [ -f "$JPEG_PREFIX/lib/libjpeg.so" ]; then
  export JPEG_INCLUDE_DIR=$JPEG_PREFIX/include JPEG_LIB_DIR=$JPEG_PREFIX/lib
  export LDFLAGS="-Wl,-rpath,$JPEG_PREFIX/lib"
fi
mkdir -p "$OUT/pkg/dpu_pipe"
# Cython's generated argument parsing computes NULL + 0 for calls without positional
# arguments (defined in C++, not in C): that one UBSan check stays off for the extensions.
CC=clang LDSHARED="clang -shared" CFLAGS="$SAN -fno-sanitize=pointer-overflow" DPU_PIPE_OPENMP=0 \
  "$PY" setup.py -q build_ext --force -b "$OUT/pkg" -t "$OUT/tmp" -j 2
# A copy, not links: the Python files stay those the extensions were built with while the
# checkout moves on (a long fuzzing run keeps a consistent package).
for f in dpu_pipe/*.py dpu_pipe/*/; do
  rm -rf "$OUT/pkg/dpu_pipe/$(basename "$f")"
  cp -r "$ROOT/${f%/}" "$OUT/pkg/dpu_pipe/$(basename "$f")"
done
log "done: scripts/asan/python.sh runs Python with build/asan/pkg first on the path"
