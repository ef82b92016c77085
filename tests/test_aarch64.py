"""The aarch64 wheel for BlueField DPUs, checked from an x86-64 machine.

* the wheels' manylinux tags (glibc <= 2.31, Ubuntu 20.04 DPU images), bundled libraries and the
  glibc symbol versions their extensions reference;
* NEON: the aarch64 extension is disassembled and every hot kernel (resampling, flip,
  normalize/convert) must contain ASIMD vector instructions; the counts are printed;
* emulation: the kernel, decode and local-Loader tests run inside an isolated arm64 userland
  (scripts/aarch64_env.sh: Debian arm64 .debs in a chroot, ``qemu-aarch64-static -cpu
  cortex-a72``) against the aarch64 wheel, and against the tests' own extensions
  (tests/kernels/) cross-compiled with it, since no compiler runs there;
* bit-identity: the same decodes, transforms, fused batches, epoch permutations and shards,
  and Loader batches (seed, epoch, samples) from the aarch64 wheel under emulation and from
  the x86-64 wheel are byte-identical; so are the x86-64 wheel's with its AVX2 copies of the
  hot passes (natively) and with its SSE2 ones (``qemu-x86_64 -cpu Nehalem``).

The wheels come from ``scripts/build_wheels.sh`` (``$DPU_PIPE_AARCH64_WHEEL`` /
``$DPU_PIPE_X86_64_WHEEL``, else ``dist/`` when newer than the sources, else built here). The
module is skipped only when the cross toolchain or the emulator is absent.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
BUILD_SH = REPO / "scripts" / "build_wheels.sh"
ENV_SH = REPO / "scripts" / "aarch64_env.sh"
DIGEST = REPO / "scripts" / "cross" / "batch_digest.py"
OBJDUMP = "aarch64-linux-gnu-objdump"
MAX_GLIBC = (2, 31)          # Ubuntu 20.04, the oldest DPU OS image
VER = f"{sys.version_info[0]}.{sys.version_info[1]}"


def wheel_tag(ver):
    """The python-abi tags of the wheel CPython ``ver`` installs: cp39-cp39, cp310-cp310,
    and from 3.11 on the one stable-ABI wheel, cp311-abi3."""
    major, minor = map(int, ver.split("."))
    return "cp311-abi3" if (major, minor) >= (3, 11) else f"cp{major}{minor}-cp{major}{minor}"


PY = wheel_tag(VER)


def _missing_tools():
    missing = [t for t in ("aarch64-linux-gnu-gcc", OBJDUMP, "qemu-aarch64-static")
               if shutil.which(t) is None]
    if os.geteuid() != 0 and shutil.which("unshare") is None:
        missing.append("root or unshare (for chroot)")
    return missing


_MISSING = _missing_tools()
if _MISSING and os.environ.get("CI") == "true":
    # CI runs this file from scripts/cross/ci.sh once build_wheels.sh has installed the
    # toolchain: a skip there would hide that the NEON and emulation checks did not run.
    pytest.fail(f"CI=true but the cross toolchain/emulator is absent ({', '.join(_MISSING)}): "
                f"scripts/build_wheels.sh installs them", pytrace=False)
pytestmark = [
    # Minutes of wheel builds and emulation: the slow tier.
    pytest.mark.slow,
    pytest.mark.skipif(bool(_MISSING), reason=f"cross toolchain/emulator absent ({', '.join(_MISSING)})"
                       f": scripts/build_wheels.sh installs them"),
    pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                       reason="cross-build checks run on an x86-64 Linux host"),
    pytest.mark.timeout(3600),
]


# scripts/cross/ci.sh (CI) builds only the cp311-abi3 wheels and sets "short": the checks of the
# other wheels and interpreters skip with this reason (the SSE2 copies are checked in both);
# `scripts/cross/ci.sh --all` ("all", as a hand run) runs them.
SHORT = os.environ.get("DPU_PIPE_CROSS_TESTS", "all") == "short"
LONG_FORM = "the wheel step's long form runs it: scripts/cross/ci.sh --all"


def _version():
    text = (REPO / "pyproject.toml").read_text()
    return re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)


def _sources_mtime():
    paths = [REPO / "setup.py", REPO / "pyproject.toml", *REPO.glob("src/dpu_pipe/*.p*"),
             *REPO.glob("dpu_pipe/*.py"), *REPO.glob("tests/kernels/*.pyx"),
             REPO / "tests" / "kernel_probes.py"]
    return max(p.stat().st_mtime for p in paths if p.exists())


def _find_wheel(directory, arch):
    pattern = f"dpu_pipe-{_version()}-{PY}-*manylinux*_{arch}.whl"
    found = sorted(Path(directory).glob(pattern), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _run(cmd, timeout, **kw):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    return proc


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    """{"aarch64": path, "x86_64": path} of this checkout's cp3X wheels."""
    got = {}
    for arch, var in (("aarch64", "DPU_PIPE_AARCH64_WHEEL"), ("x86_64", "DPU_PIPE_X86_64_WHEEL")):
        if os.environ.get(var):
            got[arch] = Path(os.environ[var])
        else:
            w = _find_wheel(REPO / "dist", arch)
            if w is not None and w.stat().st_mtime >= _sources_mtime():
                got[arch] = w
    need = [a for a in ("aarch64", "x86_64") if a not in got]
    if need:
        out = tmp_path_factory.mktemp("wheels")
        proc = _run(["bash", BUILD_SH, "--arch", ",".join(need), "--python",
                     f"{sys.version_info[0]}.{sys.version_info[1]}", "--out", out, "--no-resolve"],
                    timeout=3000, cwd=REPO)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        for arch in need:
            got[arch] = _find_wheel(out, arch)
    for arch, w in got.items():
        assert w is not None and w.exists(), f"no {arch} wheel"
    print("\nwheels:", *(f"{w.name} ({w.stat().st_size // 1024} KiB)" for w in got.values()),
          sep="\n  ")
    return got


def _beside_wheel(whl, kind):
    """build/wheels/<kind>/<wheel name>/ that scripts/build_wheels.sh wrote with whl (debug
    info, test extensions): beside the dist/ directory holding it, else in this checkout."""
    found = Path(whl).parent.parent / "build" / "wheels" / kind / Path(whl).name
    return found if found.is_dir() else REPO / "build" / "wheels" / kind / Path(whl).name


@pytest.fixture(scope="module")
def userland(wheels):
    """The arm64 userland's root, with the aarch64 wheel and its test extensions installed."""
    ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    proc = _run(["bash", ENV_SH, "setup", "--python", ver], timeout=1800)
    assert proc.returncode == 0, proc.stderr[-5000:]
    root = Path(proc.stdout.strip().splitlines()[-1])
    kernels = _beside_wheel(wheels["aarch64"], "test-kernels")
    built = sorted(p.name for p in kernels.glob("*.so"))
    wanted = sorted(p.stem for p in (REPO / "tests" / "kernels").glob("*.pyx"))
    assert [n.split(".")[0] for n in built] == wanted, (
        f"{kernels} holds {built}, not the test extensions {wanted}: scripts/build_wheels.sh "
        f"cross-compiles them with the aarch64 wheel")
    proc = _run(["bash", ENV_SH, "install", "--python", ver, wheels["aarch64"], kernels],
                timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return root


def emulated_python(*args, timeout=900, ver=None):
    ver = ver or f"{sys.version_info[0]}.{sys.version_info[1]}"
    return _run(["bash", ENV_SH, "python", "--python", ver, *args], timeout=timeout)


# --- the wheels ---------------------------------------------------------------------------------

ELF_MACHINE = {"aarch64": 0xB7, "x86_64": 0x3E}
# What a manylinux extension may link against without bundling it.
SYSTEM_LIBS = re.compile(r"^(libc|libm|libdl|libpthread|librt|libgcc_s|ld-linux-aarch64|ld-linux-x86-64)"
                         r"\.so\.\d+$")


def _glibc_of_tag(tag):
    m = re.match(r"manylinux_(\d+)_(\d+)_", tag)
    if m:
        return int(m.group(1)), int(m.group(2))
    return {"manylinux2014": (2, 17), "manylinux2010": (2, 12), "manylinux1": (2, 5)}[tag.split("_")[0]]


@pytest.mark.parametrize("arch", ["aarch64", "x86_64"])
def test_wheel_tags_and_bundled_libraries(wheels, arch, tmp_path):
    whl = wheels[arch]
    plat_tags = whl.stem.split("-")[-1].split(".")
    assert all(t.endswith("_" + arch) for t in plat_tags), whl.name
    glibc = max(_glibc_of_tag(t) for t in plat_tags)
    assert glibc <= MAX_GLIBC, f"{whl.name} needs glibc {glibc}, DPUs run {MAX_GLIBC}"
    objdump = OBJDUMP if arch == "aarch64" else "objdump"
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        z.extractall(tmp_path)
    exts = [n for n in names if n.startswith("dpu_pipe/") and n.endswith(".so")]
    libs = [n for n in names if n.startswith("dpu_pipe.libs/") and not n.endswith("/")]
    # Exactly the kernels: the tests' own extensions (tests/kernels/) never enter a wheel.
    kernels = {p.stem for p in (REPO / "src" / "dpu_pipe").glob("*.pyx")}
    assert kernels == {Path(n).name.split(".")[0] for n in exts}, exts
    assert any(Path(n).name.startswith("libjpeg") for n in libs), f"libjpeg-turbo not bundled: {libs}"
    bundled = {Path(n).name for n in libs}
    newest = (0, 0)
    for so in exts + libs:
        data = (tmp_path / so).read_bytes()
        assert data[:4] == b"\x7fELF" and int.from_bytes(data[18:20], "little") == ELF_MACHINE[arch], so
        dyn = _run([objdump, "-p", tmp_path / so], timeout=60).stdout
        for needed in re.findall(r"NEEDED\s+(\S+)", dyn):
            assert needed in bundled or SYSTEM_LIBS.match(needed), f"{so} needs {needed}, not bundled"
        syms = _run([objdump, "-T", tmp_path / so], timeout=60).stdout
        for major, minor in re.findall(r"GLIBC_(\d+)\.(\d+)", syms):
            newest = max(newest, (int(major), int(minor)))
    assert newest <= MAX_GLIBC, f"symbols need glibc {newest}"
    print(f"\n{whl.name}: tags {plat_tags}, newest glibc symbol {newest[0]}.{newest[1]}, "
          f"bundled {sorted(bundled)}")


# --- NEON ---------------------------------------------------------------------------------------

# Hot kernels of dpu_pipe._ops (the fused batch kernel calls them) -> the functions that hold
# their loops, by role: the horizontal (_h_*, ops_h_*) and vertical (_v_*, ops_v_*) resampling
# passes (Cython, and the C of _resample.h); the output conversion (_fin*/_emit*/ops_fin*:
# normalize to float32, round to uint8, float16, layout). Flip has no loop of its own: a
# flipped axis mirrors the output positions in the coefficient plan and the horizontal pass
# writes the pixels mirrored, so its code is the horizontal pass.
KERNELS = {
    "resize": r"^(_|ops_)(h|v)_",
    "flip": r"^(_|ops_)h_",
    "normalize/convert": r"^_(fin|finish|emit|to_u8|to_f16|u8_to_f32|round_u8|norm|convert)"
                         r"|^ops_(fin|to_u8|round)",
}
# An Advanced SIMD instruction on a vector of two or more lanes (v0.4s, v1.16b, {v2.8h-v4.8h}).
ASIMD = re.compile(r"\bv\d+\.(?:8b|16b|4h|8h|2s|4s|2d)\b")
PYX_PREFIX = re.compile(r"^__pyx_f_8dpu_pipe_4_ops_")
SUFFIX = re.compile(r"(?:\.(?:isra|constprop|part|cold)\.\d+)+$")


def _name(symbol):
    return SUFFIX.sub("", PYX_PREFIX.sub("", symbol))


def _text_section(path, objdump, tmp_path):
    """Bytes of .text, to check the debug copy carries the wheel's exact code."""
    out = tmp_path / (Path(path).name + f".{abs(hash(str(path)))}.text")
    proc = _run([objdump.replace("objdump", "objcopy"), "-O", "binary", "--only-section=.text",
                 path, out], timeout=60)
    assert proc.returncode == 0, proc.stderr
    return out.read_bytes()


def _asimd_instructions(so):
    """[(functions, mnemonic)] for every ASIMD vector instruction of so, where functions is the
    set of functions whose code it is: the function that holds it plus every function
    inlined on the way to it (DWARF inline records, as objdump --inlines prints them)."""
    # Disassemble only the span of the module's own functions (its cdef functions and the C
    # passes of _resample.h): the rest is Cython glue.
    nm = _run([OBJDUMP.replace("objdump", "nm"), "-S", "--defined-only", so], timeout=60).stdout
    spans = [(int(a, 16), int(a, 16) + int(n, 16)) for a, n, name in
             re.findall(r"^([0-9a-f]+) ([0-9a-f]+) [tT] (__pyx_f_8dpu_pipe_4_ops_\S+|ops_\S+)$",
                        nm, re.M)]
    span = ([f"--start-address={min(a for a, _ in spans):#x}",
             f"--stop-address={max(b for _, b in spans):#x}"] if spans else [])
    dis = _run([OBJDUMP, "-d", "-l", "--inlines", "--no-show-raw-insn", *span, so],
               timeout=900).stdout
    found, chain, block = [], [], []
    for line in dis.splitlines():
        m = re.match(r"^\s+[0-9a-f]+:\s+(\S+)\s*(.*)$", line)
        if not m:
            block.append(line)
            continue
        if block:
            heads = [re.match(r"^(\S+)\(\):$", b) for b in block]
            heads = [h.group(1) for h in heads if h]
            callers = re.findall(r"^inlined by .* \((\S+)\)$", "\n".join(block), re.M)
            if heads:
                chain = [_name(heads[-1])] + [_name(c) for c in callers]
            elif callers:
                chain = chain[:1] + [_name(c) for c in callers]
            block = []
        if ASIMD.search(m.group(2)):
            found.append((frozenset(chain), m.group(1)))
    return found


def test_neon_in_hot_kernels(wheels, tmp_path):
    whl = wheels["aarch64"]
    with zipfile.ZipFile(whl) as z:
        z.extractall(tmp_path)
    shipped = next((tmp_path / "dpu_pipe").glob("_ops.*.so"))
    # Debug info is split off by build_wheels.sh; its copy must hold the shipped code exactly.
    debug = Path(os.environ.get("DPU_PIPE_DEBUG_DIR", _beside_wheel(whl, "debug")))
    dbg_so = debug / shipped.name
    assert dbg_so.exists(), (f"{dbg_so} missing: the wheel's debug info is written by "
                             f"scripts/build_wheels.sh beside its build")
    assert _text_section(dbg_so, OBJDUMP, tmp_path) == _text_section(shipped, OBJDUMP, tmp_path), \
        f"{dbg_so} is not the build of {whl.name}"
    insns = _asimd_instructions(dbg_so)
    print(f"\nASIMD vector instructions in {shipped.name} of {whl.name}, per hot kernel:")
    failed, per_func = [], {}
    for funcs, _ in insns:
        for f in funcs:
            per_func[f] = per_func.get(f, 0) + 1
    for kernel, pattern in KERNELS.items():
        funcs = sorted(f for f in per_func if re.match(pattern, f))
        mine = [mn for fs, mn in insns if any(re.match(pattern, f) for f in fs)]
        top = {}
        for mn in mine:
            top[mn] = top.get(mn, 0) + 1
        detail = ", ".join(f"{f} {per_func[f]}" for f in funcs)
        top_s = " ".join(f"{mn}:{c}" for mn, c in sorted(top.items(), key=lambda x: -x[1])[:10])
        print(f"  {kernel:18s} {len(mine):5d}  ({detail})\n  {'':18s}        {top_s}")
        if not mine:
            failed.append(kernel)
    assert not failed, (f"no ASIMD vector instructions in: {failed}; ASIMD per function: "
                        f"{per_func}")
    # The bundled libjpeg-turbo decodes with its NEON code.
    lib = next((tmp_path / "dpu_pipe.libs").glob("libjpeg*"))
    dis = _run([OBJDUMP, "-d", "--no-show-raw-insn", lib], timeout=600).stdout
    neon = len([ln for ln in dis.splitlines() if ASIMD.search(ln)])
    print(f"  {'libjpeg-turbo':18s} {neon:5d}   (bundled {lib.name}: IDCT, upsampling, colour)")
    assert neon > 1000


# --- emulation ----------------------------------------------------------------------------------

# The kernel, decode, sampler and local-Loader tests. Deselected under emulation: arithmetic-coded
# test files (made by a helper program in a subprocess), torch output (no torch for the DPU here),
# streams compared with a child process (no subprocesses under emulation), and tests that take
# minutes under qemu and check integer or bit-exact code whose outputs the digest below compares
# against x86-64, where those tests run: the corpus-wide identity tests of transcoded files, the
# permutation's exhaustive, sampled-bijectivity, twin and chi-square tests. The transcoder's
# error and damaged-stream tests do run emulated.
EMULATED_TESTS = ["test_jpeg.py", "test_transcode.py", "test_batch.py", "test_loader.py",
                  "test_rng.py", "test_sampler.py", "test_permutation.py"]
# The short form (CI) emulates the batch kernel's, the RNG's and the transcoder's tests (about
# 2 of the 13 minutes the whole list takes under qemu here); the bit-identity digest below
# covers the decoder's, the sampler's and the Loader's outputs on aarch64 in both forms.
EMULATED_TESTS_SHORT = ["test_batch.py", "test_rng.py", "test_transcode.py"]
EMULATED_DESELECT = ("not arith and not torch and not interval_region_decode_is_bit_identical"
                     " and not transcode_decodes_identically and not over_transcoded_bytes"
                     " and not another_process and not exhaustively and not quality"
                     " and not sampled_beyond and not twins_and_reference")


def test_emulated_userland_is_isolated_and_aarch64(userland):
    proc = emulated_python("-c", """if 1:
        import json, os, platform, sys, dpu_pipe
        info = dpu_pipe.build_info()
        info["platform"] = platform.machine()
        info["host_libs_visible"] = [p for p in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu/libjpeg.so.62", "/usr/lib/aarch64-linux-gnu/libjpeg.so.8")
            if os.path.exists(p)]
        info["dpu_pipe_from"] = os.path.dirname(dpu_pipe.__file__)
        print(json.dumps(info))""", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    print("\nemulated build_info:", info)
    assert info["platform"] == "aarch64" and info["machine"] == "aarch64"
    assert info["simd"] == "NEON" and info["march"] == "armv8-a"
    assert info["host_libs_visible"] == []       # only the wheel's own libjpeg-turbo exists
    assert info["dpu_pipe_from"] == "/opt/dpu_pipe/dpu_pipe"
    # What `dpu-pipe info` tells a DPU user: the wheel, its ABI, the bundled libjpeg-turbo.
    assert info["abi"] == PY.split("-")[1] and info["installed_from"] == "manylinux wheel"
    assert info["wheel"].startswith(PY + "-manylinux") and info["wheel"].endswith("_aarch64")
    assert info["libjpeg_bundled"] and "/opt/dpu_pipe/dpu_pipe.libs/libjpeg" in info["libjpeg_library"]
    # From AT_HWCAP, as qemu reports cortex-a72's (its /proc/cpuinfo is the x86-64 host's).
    assert info["cpu_ok"] is True, info["cpu_check"]


def test_emulated_kernel_decode_loader_tests(userland):
    files = [f for f in (EMULATED_TESTS_SHORT if SHORT else EMULATED_TESTS)
             if (REPO / "tests" / f).exists()]
    ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    proc = _run(["bash", ENV_SH, "pytest", "--python", ver, *files, "--", "-q", "-rfE",
                 "-k", EMULATED_DESELECT, "-o", "timeout=1200", "-p", "no:randomly"], timeout=3000)
    tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
    print(f"\nemulated pytest ({', '.join(files)}; -k '{EMULATED_DESELECT}') on cortex-a72:\n{tail}")
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
    assert re.search(r"\d+ passed", proc.stdout)


# --- bit-identity -------------------------------------------------------------------------------

def _make_dataset(root):
    """An ImageFolder of JPEGs covering the decoder's paths: sizes off the iMCU grid, 4:2:0,
    4:2:2, 4:4:4, grayscale, progressive, several qualities."""
    from PIL import Image

    rng = np.random.default_rng(20240611)
    specs = [((37, 53), "4:2:0", False, "RGB", 90), ((120, 90), "4:2:2", False, "RGB", 75),
             ((257, 199), "4:4:4", False, "RGB", 95), ((64, 80), None, False, "L", 85),
             ((181, 243), "4:2:0", True, "RGB", 80), ((96, 128), "4:4:4", True, "RGB", 60),
             ((240, 320), "4:2:0", False, "RGB", 70), ((75, 301), "4:2:2", True, "RGB", 88),
             ((33, 33), "4:2:0", False, "RGB", 50)]
    for i, ((h, w), sub, prog, mode, q) in enumerate(specs):
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        base = np.stack([128 + 100 * np.sin(x / (5 + i) + c) * np.cos(y / (7 + c)) for c in range(3)], -1)
        img = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        pil = Image.fromarray(img).convert(mode)
        d = root / f"class{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        kw = dict(quality=q, progressive=prog)
        if sub is not None:
            kw["subsampling"] = sub
        pil.save(d / f"img{i:02d}.jpg", **kw)


def _load(path):
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    report = json.loads(arrays.pop("__report__").tobytes())
    return arrays, report


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    pytest.importorskip("PIL")
    data = tmp_path_factory.mktemp("digest") / "data"
    _make_dataset(data)
    return data


@pytest.fixture(scope="module")
def x86_digest(wheels, dataset):
    """The digest of the x86-64 wheel, installed into a directory of its own."""
    tmp = dataset.parent
    target = tmp / "x86"
    proc = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target,
                 wheels["x86_64"]], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = dict(os.environ, PYTHONPATH=str(target), OMP_NUM_THREADS="2")
    proc = _run([sys.executable, DIGEST, dataset, tmp / "x86.npz"],
                timeout=900, env=env, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _load(tmp / "x86.npz")


def _emulated_digest(root, dataset, ver):
    work = root / "work" / "digest"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shutil.copytree(dataset, work / "data")
    shutil.copy(DIGEST, work / "batch_digest.py")
    proc = emulated_python("/work/digest/batch_digest.py", "/work/digest/data",
                           "/work/digest/arm.npz", timeout=1800, ver=ver)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _load(work / "arm.npz")


def _compare(x86_digest, arm_digest, names=("x86-64", "aarch64")):
    (x86, x86_report), (arm, arm_report) = x86_digest, arm_digest
    print(f"\n{names[0]} build: {x86_report['build']}\n{names[1]} build: {arm_report['build']}")
    for name in x86_report["sections"]:
        print(f"  {name:8s} {names[0]}: {x86_report['sections'][name][:70]!s:40s} "
              f"{names[1]}: {arm_report['sections'][name][:70]}")
    for rep in (x86_report, arm_report):
        errors = {k: v for k, v in rep["sections"].items() if v.startswith("error")}
        assert not errors, errors
    assert x86_report["sections"]["decode"].endswith("arrays")
    assert x86_report["sections"]["permutation"].endswith("arrays")
    assert x86_report["sections"]["transcode"].endswith("arrays")
    assert x86_report["sections"]["cache"].endswith("arrays")
    assert sorted(x86) == sorted(arm), set(x86) ^ set(arm)
    differ = []
    for key in sorted(x86):
        a, b = x86[key], arm[key]
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            diff = (np.abs(a.astype(np.float64) - b.astype(np.float64)).max()
                    if a.shape == b.shape else "shape")
            differ.append(f"{key}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}, max |diff| {diff}")
    nbytes = sum(a.nbytes for a in x86.values())
    print(f"  compared {len(x86)} arrays, {nbytes / 1e6:.1f} MB: {len(differ)} differ")
    for d in differ[:20]:
        print("   ", d)
    assert not differ, f"{len(differ)} of {len(x86)} arrays differ between {names[0]} and {names[1]}"


def test_bit_identity_x86_64_vs_aarch64(userland, dataset, x86_digest):
    """Decodes, transforms, fused batches (seeds, epochs, 1 and 2 threads), permutations and
    shards, Loader batches, and batches cut from the decoded-sample cache."""
    _compare(x86_digest, _emulated_digest(userland, dataset, None))


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(ln for ln in f if ln.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return set()


#: The x86-64 levels the kernels have a copy for: the CPU flags each needs, and the qemu CPU
#: model that has them and none of the next level's.
X86_LEVELS = {"SSE2": ((), "Nehalem"), "AVX2": (("avx2",), "Haswell"),
              "AVX-512": (("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"), None)}


def _x86_level(flags):
    return [name for name, (need, _) in X86_LEVELS.items() if set(need) <= flags][-1]


@pytest.mark.parametrize("level", ["SSE2", "AVX2"])
def test_bit_identity_x86_64_copies(dataset, x86_digest, level):
    """On x86-64 the hot passes are built for the SSE2 baseline, for AVX2 and (the clones of
    src/dpu_pipe/_clones.h) for AVX-512, and the CPU's features pick the copy (at load time for
    the clones, at each call for _resample.h's horizontal pass and _augment.pyx's gray and hue
    passes). The x86-64 wheel under ``qemu-x86_64 -cpu Nehalem`` (SSE4.2, no AVX) runs the SSE2
    copies, under ``-cpu Haswell`` (AVX2, no AVX-512) the AVX2 ones: each digest must equal the
    native one's, which ran the copies of this CPU's level. The short form runs it too: it is
    the only check of the copies most x86-64 hosts skip."""
    native = _x86_level(_cpu_flags())
    if list(X86_LEVELS).index(native) <= list(X86_LEVELS).index(level):
        pytest.skip(f"this CPU's level is {native}: the native digest ran the {level} copies")
    qemu = shutil.which("qemu-x86_64-static")
    if qemu is None:
        pytest.skip("qemu-x86_64-static absent (apt-get install qemu-user-static)")
    tmp = dataset.parent
    env = dict(os.environ, PYTHONPATH=str(tmp / "x86"), OMP_NUM_THREADS="2")
    out = tmp / f"{level}.npz"
    proc = _run([qemu, "-cpu", X86_LEVELS[level][1], sys.executable, DIGEST, dataset, out],
                timeout=1800, env=env, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _compare(x86_digest, _load(out), (f"x86-64 {native}", f"x86-64 {level}"))


# --- every wheel, every Python ------------------------------------------------------------------

def _current_wheel(tag, arch):
    """dist/'s newest wheel with python-abi tags ``tag`` for ``arch``, if built from the current
    sources (scripts/build_wheels.sh --python all)."""
    found = sorted((REPO / "dist").glob(f"dpu_pipe-{_version()}-{tag}-*manylinux*_{arch}.whl"),
                   key=lambda p: p.stat().st_mtime)
    if not found or found[-1].stat().st_mtime < _sources_mtime():
        return None
    return found[-1]


def _x86_python(ver):
    """An x86-64 CPython ``ver`` of this machine, as scripts/cross/common.sh finds one."""
    proc = _run(["bash", "-c", f'source "{REPO}/scripts/cross/common.sh"; x86_python {ver}'],
                timeout=60)
    return proc.stdout.strip() if proc.returncode == 0 else None


def test_aarch64_pyconfig_from_an_x86_64_one(tmp_path):
    """No Debian suite ships CPython 3.10's arm64 headers; build_wheels.sh makes its pyconfig.h
    from an x86-64 one (scripts/cross/common.sh aarch64_pyconfig). The edit must turn each of
    Debian's amd64 pyconfig.h (3.9, 3.11, 3.13) into its arm64 one exactly; the rest of the
    headers is the same on both."""
    script = f"""source "{REPO}/scripts/cross/common.sh"
    for sv in bullseye:3.9 bookworm:3.11 trixie:3.13; do
        s=${{sv%%:*}}; v=${{sv##*:}}
        for a in amd64 arm64; do unpack_debs "{tmp_path}/$a-$v" $(fetch_debs_nodeps $s $a libpython$v-dev); done
        aarch64_pyconfig "{tmp_path}/amd64-$v/usr/include/x86_64-linux-gnu/python$v/pyconfig.h" "{tmp_path}/made-$v.h"
        cmp "{tmp_path}/made-$v.h" "{tmp_path}/arm64-$v/usr/include/aarch64-linux-gnu/python$v/pyconfig.h"
        diff -r "{tmp_path}/amd64-$v/usr/include/python$v" "{tmp_path}/arm64-$v/usr/include/python$v"
        echo "$v identical"
    done"""
    proc = _run(["bash", "-c", script], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == ["3.9 identical", "3.11 identical", "3.13 identical"]


@pytest.mark.parametrize("tag", ["cp39-cp39", "cp310-cp310"])
@pytest.mark.parametrize("arch", ["aarch64", "x86_64"])
def test_per_version_wheel_tags(tag, arch, tmp_path):
    """The wheels below the stable ABI's 3.11: same checks as the abi3 one's."""
    if SHORT:
        pytest.skip(LONG_FORM)
    whl = _current_wheel(tag, arch)
    if whl is None:
        pytest.skip(f"no current {tag} {arch} wheel in dist/ (scripts/build_wheels.sh --python all)")
    test_wheel_tags_and_bundled_libraries({arch: whl}, arch, tmp_path)


# Where an arm64 interpreter exists (Debian's): 3.9 is bullseye's, glibc 2.31 as on Ubuntu 20.04
# DPUs; 3.13 trixie's (the abi3 wheel on a second interpreter). The x86-64 wheel of each version
# runs natively in a venv of this machine's CPython of that version (3.12's is the abi3 wheel).
# Every digest must equal the x86-64 abi3 wheel's on 3.11.
ARM64_PYTHONS = {"3.9", "3.11", "3.13"}
OTHER_PYTHONS = ["3.9", "3.10", "3.12", "3.13"]


def _native_digest(ver, whl, dataset, tmp):
    py = _x86_python(ver)
    if py is None:
        pytest.skip(f"no x86-64 CPython {ver} here (pyenv install {ver})")
    env_dir = tmp / f"venv{ver}"
    for cmd in ([py, "-m", "venv", env_dir],
                [env_dir / "bin" / "python", "-m", "pip", "install", "-q",
                 "--disable-pip-version-check", "numpy", whl]):
        proc = _run(cmd, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "2"
    out = tmp / f"x86-{ver}.npz"
    proc = _run([env_dir / "bin" / "python", DIGEST, dataset, out],
                timeout=900, env=env, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _load(out)


@pytest.mark.parametrize("ver", OTHER_PYTHONS)
def test_wheel_of_each_python(ver, wheels, dataset, x86_digest, tmp_path):
    if SHORT:
        pytest.skip(LONG_FORM)
    tag = wheel_tag(ver)
    x86 = _current_wheel(tag, "x86_64")
    arm = _current_wheel(tag, "aarch64")
    if x86 is None and arm is None:
        pytest.skip(f"no current {tag} wheels in dist/ (scripts/build_wheels.sh --python all)")
    if x86 is not None:
        print(f"\n{x86.name} natively on x86-64 CPython {ver}:")
        _compare(x86_digest, _native_digest(ver, x86, dataset, tmp_path))
    if arm is not None and ver in ARM64_PYTHONS:
        proc = _run(["bash", ENV_SH, "setup", "--python", ver], timeout=1800)
        assert proc.returncode == 0, proc.stderr[-5000:]
        root = Path(proc.stdout.strip().splitlines()[-1])
        proc = _run(["bash", ENV_SH, "install", "--python", ver, arm], timeout=600)
        assert proc.returncode == 0, proc.stderr[-5000:]
        proc = emulated_python("-c", "import os, sys; print(sys.version.split()[0], "
                               "os.confstr('CS_GNU_LIBC_VERSION'))", ver=ver, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        print(f"\n{arm.name} in the {root.name} userland: Python, glibc = {proc.stdout.strip()}")
        _compare(x86_digest, _emulated_digest(root, dataset, ver))
    elif arm is not None:
        print(f"\n{arm.name}: no arm64 CPython {ver} to run it under emulation (Debian ships "
              f"none); its tags, libraries and symbols are checked by test_per_version_wheel_tags")
