"""Build of the Cython kernels.

Environment switches (read once, here):
  DPU_PIPE_DEBUG=1     bounds/wraparound checks on, -O1 -g: the build CI tests kernels with.
  DPU_PIPE_MARCH=...   value for -march (e.g. "native" for a local build, "armv8-a" for DPUs);
                       unset gives the compiler's portable baseline, as wheels need.
  DPU_PIPE_MTUNE=...   value for -mtune (e.g. "cortex-a72").
  DPU_PIPE_OPENMP=0    build without OpenMP (batches then run on one thread; build_info says so).
  DPU_PIPE_LIMITED_API=0|1  the stable ABI (one cp311-abi3 wheel for CPython 3.11 and later);
                       unset: on when the building interpreter is 3.11 or later. Cross-builds set
                       it for their target version (scripts/build_wheels.sh).
  DPU_PIPE_BUILD_JOBS=N  extensions compiled at once (default: the CPUs this process may use).
  DPU_PIPE_SANITIZE=thread  ThreadSanitizer instrumentation, -O1 -g (scripts/tsan/build.sh;
                       the interpreter must preload libtsan to import the result).
  JPEG_INCLUDE_DIR / JPEG_LIB_DIR   libjpeg location when pkg-config cannot tell.
"""
import glob
import os
import shlex
import subprocess
import sys

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # pragma: no cover - pyproject's build-system lists Cython
    sys.exit("dpu_pipe needs Cython >= 3 to build: pip install 'Cython>=3'")

DEBUG = os.environ.get("DPU_PIPE_DEBUG", "") not in ("", "0")
MARCH = os.environ.get("DPU_PIPE_MARCH", "")
MTUNE = os.environ.get("DPU_PIPE_MTUNE", "")
OPENMP = os.environ.get("DPU_PIPE_OPENMP", "1") not in ("", "0")
SANITIZE = os.environ.get("DPU_PIPE_SANITIZE", "")
if SANITIZE not in ("", "thread"):
    sys.exit("dpu_pipe: DPU_PIPE_SANITIZE takes only 'thread' (ASan: scripts/asan/build.sh)")
SANITIZE_ARGS = ["-fsanitize=thread", "-fno-omit-frame-pointer"] if SANITIZE else []
# Typed memoryviews need the buffer protocol, which entered the Limited API in 3.11: below
# that, one build per CPython version.
LIMITED_API_MIN = (3, 11)
LIMITED_API = os.environ.get("DPU_PIPE_LIMITED_API",
                             "1" if sys.version_info >= LIMITED_API_MIN else "0") not in ("", "0")
if LIMITED_API and sys.version_info < LIMITED_API_MIN:
    sys.exit("dpu_pipe: DPU_PIPE_LIMITED_API=1 needs CPython >= 3.11 to build")
# Six extensions of similar size: compiled one at a time, a build leaves all CPUs but one idle.
try:
    BUILD_JOBS = int(os.environ.get("DPU_PIPE_BUILD_JOBS", "0"))
except ValueError:
    sys.exit("dpu_pipe: DPU_PIPE_BUILD_JOBS must be a whole number of jobs")
if BUILD_JOBS < 1:
    BUILD_JOBS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else (os.cpu_count() or 1)


def _pkg_config(*args):
    try:
        out = subprocess.run(["pkg-config", *args, "libjpeg"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return shlex.split(out.stdout)


def libjpeg_flags():
    """Include dirs, library dirs and libraries for libjpeg-turbo's jpeglib API."""
    inc = os.environ.get("JPEG_INCLUDE_DIR")
    lib = os.environ.get("JPEG_LIB_DIR")
    if inc or lib:
        return [inc] if inc else [], [lib] if lib else [], ["jpeg"]
    cflags, libs = _pkg_config("--cflags"), _pkg_config("--libs")
    if cflags is not None and libs is not None:
        return ([f[2:] for f in cflags if f.startswith("-I")],
                [f[2:] for f in libs if f.startswith("-L")],
                [f[2:] for f in libs if f.startswith("-l")] or ["jpeg"])
    for d in ("/usr/include", "/usr/local/include", "/opt/homebrew/include"):
        if os.path.exists(os.path.join(d, "jpeglib.h")):
            return [d], [], ["jpeg"]
    sys.exit(
        "dpu_pipe: libjpeg-turbo development files not found (jpeglib.h).\n"
        "  Debian/Ubuntu: apt-get install libjpeg-dev pkg-config\n"
        "  Fedora/RHEL:   dnf install libjpeg-turbo-devel pkgconf\n"
        "or set JPEG_INCLUDE_DIR and JPEG_LIB_DIR."
    )


def compile_args():
    args = ["-ffp-contract=off", "-fno-math-errno", "-std=c11"]
    args += ["-O1", "-g"] if DEBUG or SANITIZE else ["-O3"]
    args += SANITIZE_ARGS
    if MARCH:
        args.append(f"-march={MARCH}")
    if MTUNE:
        args.append(f"-mtune={MTUNE}")
    if OPENMP:
        args.append("-fopenmp")
    return args


DIRECTIVES = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
}

inc, libdirs, libs = libjpeg_flags()
common = dict(
    # src/dpu_pipe holds the C headers (_resample.h) beside the .pxd files that include them.
    include_dirs=inc + [os.path.join(os.path.dirname(os.path.abspath(__file__)), "src",
                                     "dpu_pipe")],
    library_dirs=libdirs,
    extra_compile_args=compile_args(),
    extra_link_args=(["-fopenmp"] if OPENMP else []) + SANITIZE_ARGS,
    define_macros=[("DPU_PIPE_MARCH", '"%s"' % (MARCH or "default")),
                   ("DPU_PIPE_DEBUG", str(int(DEBUG)))]
                  + ([("Py_LIMITED_API", "0x%02X%02X0000" % LIMITED_API_MIN),
                      ("CYTHON_LIMITED_API", "1")] if LIMITED_API else []),
    py_limited_api=LIMITED_API,
)

def kernel_extension(name, pyx):
    """Extension `name` from the Cython file `pyx` with the kernels' compiler and link flags.
    tests/kernel_probes.py builds the tests' own extensions (tests/kernels/) with it, so they
    are compiled exactly like the modules they call into."""
    return Extension(name, [pyx], libraries=libs, **common)


def cythonize_kernels(extensions, build_dir=None):
    """cythonize with the kernels' directives, from the directory of setup.py; the .pxd files
    of src/dpu_pipe/ are cimportable."""
    if build_dir is None:
        build_dir = "build/cython-debug" if DEBUG else "build/cython"
    # Translating the modules to C in parallel too: about half the time on two CPUs here.
    return cythonize(extensions, include_path=["src"],
                     compiler_directives=DIRECTIVES, compile_time_env={"DPU_PIPE_DEBUG": DEBUG},
                     build_dir=build_dir, nthreads=BUILD_JOBS if len(extensions) > 1 else 0)


if __name__ == "__main__":  # as setuptools runs it; tests/kernel_probes.py only reads the flags
    # Every kernel module in src/dpu_pipe/ becomes dpu_pipe.<name>; .pxd files beside them are
    # cimported across modules through include_path.
    sources = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                           "src", "dpu_pipe", "*.pyx")))
    if not sources:
        # Without this check a source tree missing its kernels builds a pure-Python wheel that
        # installs "successfully" and then cannot be imported.
        sys.exit("dpu_pipe: no Cython sources (src/dpu_pipe/*.pyx) next to setup.py; the "
                 "source distribution is incomplete. Build from a git checkout or a complete "
                 "sdist.")
    # An in-place build (pip install -e .) of one ABI leaves the other's extension files
    # beside it, and the interpreter would import a stale cp3X one before a new abi3 one.
    for stale in glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "dpu_pipe",
                                        "_*.cpython-*.so" if LIMITED_API else "_*.abi3.so")):
        os.remove(stale)
    setup(ext_modules=cythonize_kernels(
        [kernel_extension(f"dpu_pipe.{os.path.basename(p)[:-4]}", os.path.relpath(p))
         for p in sources]),
        # The wheel's tag: cp311-abi3 (installs on 3.11 and later) rather than cp3X-cp3X.
        options={"build_ext": {"parallel": BUILD_JOBS},
                 **({"bdist_wheel": {"py_limited_api": "cp%d%d" % LIMITED_API_MIN}}
                    if LIMITED_API else {})})
