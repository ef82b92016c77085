"""What this installation of dpu_pipe was built with, and whether this machine can run it."""

import json
import os
import platform
import sys
import sysconfig

#: CPU flags (as /proc/cpuinfo names them) that a build's SIMD level needs; the level comes from
#: the compiler's predefined macros when the kernels were compiled (``build_flags()["simd"]``).
CPU_FLAGS = {"NEON": ("asimd",), "SSE2": ("sse2",), "SSE4.2": ("sse4_2",), "AVX": ("avx",),
             "AVX2": ("avx2",), "AVX-512": ("avx512f",), "none": ()}


def _distribution(package_file):
    """(wheel tags, how it was installed) of the distribution holding ``package_file``;
    ``(None, "source tree")`` for a checkout or an editable install."""
    from importlib import metadata

    try:
        dist = metadata.distribution("dpu_pipe")
    except metadata.PackageNotFoundError:
        return None, "source tree"
    where = os.path.realpath(str(dist.locate_file("dpu_pipe/__init__.py")))
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if where != os.path.realpath(package_file) or direct.get("dir_info", {}).get("editable"):
        return None, "source tree"
    tags = [line.split(":", 1)[1].strip() for line in (dist.read_text("WHEEL") or "").splitlines()
            if line.startswith("Tag:")]
    # A wheel built by pip from the sdist on this machine carries the plain linux_<arch> tag;
    # a published wheel, a manylinux one.
    origin = ("manylinux wheel" if any("manylinux" in t for t in tags)
              else "built here from the source distribution")
    return tags or None, origin


def _library_of(ext_path, symbol):
    """Path of the library the dynamic linker bound ``symbol`` of the extension ``ext_path`` to
    (Pillow, say, may load another copy of it), or None where /proc/self/maps cannot tell."""
    import ctypes

    try:
        addr = ctypes.cast(getattr(ctypes.CDLL(ext_path), symbol), ctypes.c_void_p).value
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(None, 5)
                low, high = (int(x, 16) for x in fields[0].split("-"))
                if low <= addr < high and len(fields) == 6:
                    return fields[5].strip()
    except (OSError, AttributeError, ValueError):
        pass
    return None


#: Bits of the aarch64 Linux AT_HWCAP word (asm/hwcap.h), named as /proc/cpuinfo names them.
AARCH64_HWCAP = ("fp", "asimd", "evtstrm", "aes", "pmull", "sha1", "sha2", "crc32", "atomics",
                 "fphp", "asimdhp", "cpuid", "asimdrdm", "jscvt", "fcma", "lrcpc", "dcpop",
                 "sha3", "sm3", "sm4", "asimddp", "sha512", "sve")
AT_HWCAP = 16


def cpu_flags():
    """The instruction-set flags of this CPU: on aarch64 from the kernel's AT_HWCAP (what a
    user-mode emulator reports for the CPU it emulates, where /proc/cpuinfo would describe the
    host's), elsewhere the "flags" of /proc/cpuinfo. None where neither can be read."""
    if platform.machine() in ("aarch64", "arm64"):
        import ctypes

        try:
            getauxval = ctypes.CDLL(None).getauxval
        except (OSError, AttributeError):
            return None
        getauxval.restype, getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
        hwcap = getauxval(AT_HWCAP)
        return {name for bit, name in enumerate(AARCH64_HWCAP) if hwcap >> bit & 1}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return set(value.split())
    except OSError:
        pass
    return None


def cpu_check(simd, march, flags=None):
    """(ok, one line) telling whether this CPU has the instructions the kernels were compiled
    for: ``simd`` and ``march`` as ``build_info()`` reports them; ``flags`` defaults to
    :func:`cpu_flags`. ok is None when the CPU's flags cannot be read."""
    need = CPU_FLAGS.get(simd)
    flags = cpu_flags() if flags is None else flags
    what = f"{simd} build, -march={march}"
    if need is None:
        return None, f"unknown SIMD level {simd!r} ({what})"
    if flags is None:
        return None, f"cannot read this CPU's flags (/proc/cpuinfo) to check for {what}"
    missing = [f for f in need if f not in flags]
    if missing:
        return False, (f"this {platform.machine()} CPU lacks {', '.join(missing)}, which the "
                       f"{what} needs: install a wheel for a baseline CPU or build from source")
    return True, (f"this {platform.machine()} CPU has {', '.join(need) or 'what it needs'} "
                  f"({what})")


#: The CPU flags of x86-64-v4, the level of the AVX-512 copies (src/dpu_pipe/_clones.h).
X86_64_V4 = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


def simd_copies(simd, compiler, machine, flags):
    """Which copies of the hot passes this CPU runs (one line). A GCC build for x86-64 holds an
    AVX2 copy of each beside the ``simd`` baseline and an AVX-512 one of the auto-vectorized
    ones, picked at load time by the CPU's ``flags``; other builds run ``simd`` only."""
    if machine not in ("x86_64", "AMD64") or not compiler.startswith("gcc"):
        return simd
    if flags is None:
        return f"{simd}, or the AVX2 and AVX-512 copies (this CPU's flags cannot be read)"
    if set(X86_64_V4) <= flags:
        return "AVX-512 (auto-vectorized passes) and AVX2 (the others)"
    return "AVX2" if "avx2" in flags else simd


def build_info():
    """A dict describing the installation: dpu_pipe, its ABI (``abi3`` or ``cp3X``) and wheel
    tags, libjpeg-turbo (headers it was compiled against, library file in use), SIMD target
    and the copies this CPU runs, compiler, Cython, numpy and Python versions, machine, and a
    CPU check. ``dpu-pipe info`` prints it."""
    import numpy

    from . import _jpeg
    from ._version import __version__

    info = {"dpu_pipe": __version__}
    info.update(_jpeg.build_flags())
    # A stable-ABI build serves CPython 3.11 and later; another, one CPython version.
    abi3 = _jpeg.__file__.endswith(".abi3.so")
    info["abi"] = "abi3" if abi3 else "cp%d%d" % sys.version_info[:2]
    tags, origin = _distribution(os.path.join(os.path.dirname(_jpeg.__file__), "__init__.py"))
    info["wheel"] = ", ".join(tags) if tags else None
    info["installed_from"] = origin
    lib = info["libjpeg_library"] = _library_of(_jpeg.__file__, "jpeg_std_error")
    info["libjpeg_bundled"] = bool(lib) and (os.path.basename(os.path.dirname(lib))
                                             == "dpu_pipe.libs")
    try:
        import Cython
        info["cython"] = Cython.__version__
    except ImportError:  # installed from a wheel: Cython is a build-time dependency only
        info["cython"] = None
    info.update(numpy=numpy.__version__, python=sys.version.split()[0],
                platform=sysconfig.get_platform(), machine=platform.machine())
    info["cpu_ok"], info["cpu_check"] = cpu_check(info["simd"], info["march"])
    info["simd_copies"] = simd_copies(info["simd"], info["compiler"], info["machine"],
                                      cpu_flags())
    return info
