"""``dpu_pipe.build_info()`` and ``dpu-pipe info``: the ABI, the libjpeg the kernels call, and
the check that this CPU has the instructions the kernels were compiled for."""
import importlib
import os
import subprocess

import pytest

import dpu_pipe
from dpu_pipe import _jpeg
from dpu_pipe.tools import cli

# The module (the package's ``build_info`` attribute is its function).
bi = importlib.import_module("dpu_pipe.build_info")


def test_cpu_check_names_what_is_missing(monkeypatch):
    ok, line = bi.cpu_check("NEON", "armv8-a", {"fp", "asimd", "crc32"})
    assert ok is True and "asimd" in line
    ok, line = bi.cpu_check("AVX2", "haswell", {"sse2", "avx"})
    assert ok is False and "lacks avx2" in line and "-march=haswell" in line
    ok, _ = bi.cpu_check("SSE2", "default", {"sse2"})
    assert ok is True
    assert bi.cpu_check("RVV", "rv64gcv", {"v"})[0] is None        # a level it does not know
    monkeypatch.setattr(bi, "cpu_flags", lambda: None)            # flags unreadable
    ok, line = bi.cpu_check("NEON", "armv8-a")
    assert ok is None and "cannot read" in line


def test_simd_copies_follow_the_cpu_flags():
    v4 = set(bi.X86_64_V4) | {"sse2", "avx2"}
    assert bi.simd_copies("SSE2", "gcc 12.2.0", "x86_64", v4).startswith("AVX-512")
    assert bi.simd_copies("SSE2", "gcc 12.2.0", "x86_64", v4 - {"avx512vl"}) == "AVX2"
    assert bi.simd_copies("SSE2", "gcc 12.2.0", "x86_64", {"sse2"}) == "SSE2"
    assert bi.simd_copies("SSE2", "clang 16", "x86_64", v4) == "SSE2"      # no clones
    assert bi.simd_copies("NEON", "gcc 12.2.0", "aarch64", {"asimd"}) == "NEON"
    assert "cannot be read" in bi.simd_copies("SSE2", "gcc 12.2.0", "x86_64", None)


def test_this_build_holds_the_copies_it_reports():
    info = dpu_pipe.build_info()
    if info["machine"] != "x86_64" or not info["compiler"].startswith("gcc"):
        pytest.skip("the AVX2 and AVX-512 copies are built by GCC for x86-64 only")
    from dpu_pipe import _ops

    nm = subprocess.run(["nm", _ops.__file__], capture_output=True, text=True)
    if nm.returncode != 0:
        pytest.skip("nm cannot read the extension")
    names = nm.stdout.split()
    assert {"ops_v_row_u8.avx2", "ops_v_row_u8.arch_x86_64_v4"} <= set(names), info["simd_copies"]


def test_this_cpu_passes_its_own_build():
    info = dpu_pipe.build_info()
    assert info["cpu_ok"] is True, info["cpu_check"]
    flags = bi.cpu_flags()
    assert set(bi.CPU_FLAGS[info["simd"]]) <= flags


def test_abi_and_origin_of_this_build():
    info = dpu_pipe.build_info()
    suffix_abi3 = os.path.basename(_jpeg.__file__).endswith(".abi3.so")
    assert (info["abi"] == "abi3") == suffix_abi3
    # The test suite runs against the checkout's in-place build (./run.sh setup).
    assert info["installed_from"] == "source tree" and info["wheel"] is None


def test_libjpeg_is_the_one_the_kernels_link_even_with_pillows_loaded():
    pytest.importorskip("PIL.Image").new("RGB", (8, 8)).save(open(os.devnull, "wb"), "JPEG")
    info = dpu_pipe.build_info()
    lib = info["libjpeg_library"]
    assert lib and os.path.exists(lib) and "pillow" not in lib.lower()
    ldd = subprocess.run(["ldd", _jpeg.__file__], capture_output=True, text=True).stdout
    linked = [ln.split("=>")[1].split()[0] for ln in ldd.splitlines()
              if "libjpeg" in ln and "=>" in ln]
    assert [os.path.realpath(p) for p in linked] == [os.path.realpath(lib)]


def test_info_exits_1_when_the_cpu_lacks_the_build_instructions(monkeypatch, capsys):
    monkeypatch.setattr(bi, "cpu_flags", lambda: set())
    assert cli.main(["info"]) == 1
    out = capsys.readouterr().out
    assert "cpu check: FAILS: this" in out and "lacks" in out
    monkeypatch.undo()
    assert cli.main(["info"]) == 0
    assert "cpu check: ok: " in capsys.readouterr().out
