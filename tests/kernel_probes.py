"""The tests' own Cython extensions (tests/kernels/*.pyx), built on demand like the kernels.

What only tests need to see inside a kernel (its coefficient tables, a forced pass order, one
conversion on its own, one RNG kernel over an array) lives in these extensions, not in the
wheel. They cimport the package's .pxd files and call the installed kernel through its C API or
compile the .pxd's inline kernels, so they must be compiled like it. ``load(name)`` does that
the first time a test asks: it compiles tests/kernels/<name>.pyx with setup.py's flags and
directives (``kernel_extension``, ``cythonize_kernels``) for the build of dpu_pipe that is
imported — debug or not, -march and OpenMP as ``dpu_pipe.build_info()`` reports them — into
build/test-kernels/ of this checkout, and imports it. Later runs reuse the build while its key
holds: the .pyx, the package's .pxd files, setup.py, this file, those flags, the compiler
environment, the Python ABI and the dpu_pipe extension files it may link to. So
`./run.sh test`, a debug rebuild (.ci/run) and `pytest tests/test_ops.py` after
`pip install .` each get a matching build. The extension is compiled against this checkout's
.pxd files: the dpu_pipe under test must be built from the same sources (Cython checks the
signatures of the functions it imports, not the layout of the structs). A failed build raises
with the compiler's output: the tests that need it error out, they are never skipped.

Where no compiler runs (the aarch64 wheel's tests under emulation), $DPU_PIPE_TEST_KERNELS
names a directory of extensions built beforehand by ``--prebuild``, which scripts/build_wheels.sh
runs with the cross compiler and the flags of the wheel it builds; ``load`` then takes them from
there, after checking that each was compiled from this checkout's .pyx for the imported build's
flavour (debug, -march, OpenMP), and never compiles. A missing or mismatched one raises.

    python tests/kernel_probes.py [NAME...]   build (or find) them, print their paths
    python tests/kernel_probes.py --prebuild DIR [NAME...]
                 build them into DIR for the target the environment describes (CC, CFLAGS,
                 SETUPTOOLS_EXT_SUFFIX, setup.py's DPU_PIPE_* switches), without importing
                 dpu_pipe; all of tests/kernels/ when no NAME is given
"""

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "tests" / "kernels"
CACHE = REPO / "build" / "test-kernels"
PREBUILT = "DPU_PIPE_TEST_KERNELS"   # directory of extensions built by --prebuild
BUILD_TIMEOUT = 900          # seconds; a cold -O3 build takes ~30 s on a loaded 2-core machine
KEEP = 4                     # builds kept per extension (normal and debug flavours alternate)


def _build_env():
    """setup.py's switches for the imported build of dpu_pipe."""
    import dpu_pipe

    info = dpu_pipe.build_info()
    march = info["march"]
    return {"DPU_PIPE_DEBUG": "1" if info["debug_build"] else "0",
            "DPU_PIPE_MARCH": "" if march == "default" else march,
            "DPU_PIPE_OPENMP": "1" if info["openmp"] else "0",
            "DPU_PIPE_LIMITED_API": "1" if info["abi"] == "abi3" else "0",
            # Not recorded by the build; it changes instruction scheduling, never results.
            "DPU_PIPE_MTUNE": os.environ.get("DPU_PIPE_MTUNE", "")}


def _suffix(limited_api):
    """File name suffix of an extension of this interpreter, stable ABI or not."""
    return ".abi3.so" if limited_api else sysconfig.get_config_var("EXT_SUFFIX")


def _flavour(env):
    """The build flavour setup.py makes of its switches env (read as setup.py reads them)."""
    return {"debug": env.get("DPU_PIPE_DEBUG", "") not in ("", "0"),
            "march": env.get("DPU_PIPE_MARCH", "") or "default",
            "openmp": env.get("DPU_PIPE_OPENMP", "1") not in ("", "0")}


def _pyx_sha256(name):
    return hashlib.sha256((KERNELS / f"{name}.pyx").read_bytes()).hexdigest()


def _key(name, env):
    import dpu_pipe

    h = hashlib.sha256()
    kernels = []
    for so in sorted(Path(dpu_pipe.__file__).resolve().parent.glob("_*.so")):
        st = so.stat()
        kernels.append([str(so), st.st_size, st.st_mtime_ns])
    compiler = {k: os.environ.get(k, "") for k in ("CC", "CFLAGS", "CPPFLAGS", "LDSHARED",
                                                    "LDFLAGS", "JPEG_INCLUDE_DIR",
                                                    "JPEG_LIB_DIR")}
    h.update(json.dumps([env, compiler, sys.version, sysconfig.get_config_var("EXT_SUFFIX"),
                         kernels]).encode())
    for path in [KERNELS / f"{name}.pyx", REPO / "setup.py", Path(__file__),
                 *sorted((REPO / "src" / "dpu_pipe").glob("*.pxd"))]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _prune(name, keep):
    builds = sorted((p for p in CACHE.glob(f"{name}-*") if p.is_dir() and ".tmp" not in p.name),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for old in builds[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def build(name):
    """Path of the compiled tests/kernels/<name>.pyx for the imported dpu_pipe, built if
    missing. RuntimeError with the build's output when it cannot be built."""
    if not (KERNELS / f"{name}.pyx").is_file():
        raise RuntimeError(f"no test extension {KERNELS / name}.pyx")
    env = _build_env()
    out = CACHE / f"{name}-{_key(name, env)}"
    target = out / f"{name}{_suffix(env['DPU_PIPE_LIMITED_API'] == '1')}"
    if target.is_file():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = CACHE / f"{out.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        proc = subprocess.run([sys.executable, __file__, "--build-into", str(tmp), name],
                              cwd=REPO, env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"building the test extension {name} took over {e.timeout} s") from e
    if proc.returncode != 0 or not (tmp / target.name).is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(
            f"could not build the test extension tests/kernels/{name}.pyx with dpu_pipe's "
            f"flags ({' '.join(f'{k}={v}' for k, v in env.items())}), exit code "
            f"{proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    try:
        os.rename(tmp, out)
    except OSError:          # another process finished the same build first: use that one
        shutil.rmtree(tmp, ignore_errors=True)
    _prune(name, KEEP)
    return target


def prebuilt(name, directory):
    """Path of the extension <name> that --prebuild left in directory, after checking it was
    built from this checkout's tests/kernels/<name>.pyx for the imported dpu_pipe's flavour.
    RuntimeError naming what is missing or differs."""
    import dpu_pipe

    directory = Path(directory)
    target = directory / f"{name}{_suffix(dpu_pipe.build_info()['abi'] == 'abi3')}"
    stamp = directory / f"{name}.json"
    if not (target.is_file() and stamp.is_file()):
        raise RuntimeError(
            f"${PREBUILT} is {directory}, which holds no {target.name} with its {stamp.name}: "
            f"scripts/build_wheels.sh builds the test extensions beside an aarch64 wheel "
            f"(build/wheels/test-kernels/<wheel>/), `scripts/aarch64_env.sh install WHEEL DIR` "
            f"puts them into the emulated userland")
    made = json.loads(stamp.read_text())
    info = dpu_pipe.build_info()
    want = {"debug": bool(info["debug_build"]), "march": info["march"],
            "openmp": bool(info["openmp"])}
    if made["pyx_sha256"] != _pyx_sha256(name):
        raise RuntimeError(f"{target} was built from another tests/kernels/{name}.pyx than "
                           f"this checkout's: rebuild the wheel and its test extensions")
    if made["flavour"] != want:
        raise RuntimeError(f"{target} was built for {made['flavour']}, the imported dpu_pipe "
                           f"({dpu_pipe.__file__}) is {want}")
    return target


def prebuild(directory, names):
    """Build each tests/kernels/<name>.pyx into directory with the compiler and setup.py
    switches of this process's environment (a cross-build's), each with <name>.json recording
    its .pyx and flavour for ``prebuilt``. Does not import dpu_pipe. Returns the paths."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in names:
        tmp = directory / f"{name}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        proc = subprocess.run([sys.executable, __file__, "--build-into", str(tmp), name],
                              cwd=REPO, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        built = sorted(tmp.glob(f"{name}.*so")) if proc.returncode == 0 else []
        if len(built) != 1:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"could not build tests/kernels/{name}.pyx into {directory}, "
                               f"exit code {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                               f"{proc.stderr[-6000:]}")
        target = directory / built[0].name
        os.replace(built[0], target)
        shutil.rmtree(tmp, ignore_errors=True)
        (directory / f"{name}.json").write_text(json.dumps(
            {"pyx_sha256": _pyx_sha256(name), "flavour": _flavour(os.environ)}))
        paths.append(target)
    return paths


@functools.lru_cache(maxsize=None)
def load(name):
    """The module compiled from tests/kernels/<name>.pyx (see the module docstring)."""
    directory = os.environ.get(PREBUILT)
    path = prebuilt(name, directory) if directory else build(name)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_into(out, name):
    """In a child process, from the checkout's root with setup.py's switches in the
    environment: cythonize and compile one extension into out."""
    import runpy

    from setuptools import Distribution

    flags = runpy.run_path(str(REPO / "setup.py"), run_name="dpu_pipe_build_flags")
    ext = flags["kernel_extension"](name, os.path.relpath(KERNELS / f"{name}.pyx", REPO))
    if sys.platform.startswith("linux"):
        # Linked only to the libraries it calls (the kernels' flags name libjpeg and libgomp):
        # where a wheel bundles them under other names, as in the emulated userland, a probe
        # that calls neither still loads. LDFLAGS come before the objects and libraries.
        os.environ["LDFLAGS"] = " ".join(["-Wl,--as-needed", os.environ.get("LDFLAGS", "")])
    exts = flags["cythonize_kernels"]([ext], build_dir=os.path.join(out, "cython"))
    dist = Distribution({"name": "dpu_pipe_test_kernels", "ext_modules": exts})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = out
    cmd.build_temp = os.path.join(out, "obj")
    dist.run_command("build_ext")
    shutil.rmtree(os.path.join(out, "obj"), ignore_errors=True)


if __name__ == "__main__":
    every = sorted(p.stem for p in KERNELS.glob("*.pyx"))
    if sys.argv[1:2] == ["--build-into"]:
        _build_into(sys.argv[2], sys.argv[3])
    elif sys.argv[1:2] == ["--prebuild"]:
        for p in prebuild(sys.argv[2], sys.argv[3:] or every):
            print(p)
    else:
        for n in sys.argv[1:] or every:
            print(build(n))
