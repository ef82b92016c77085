"""The pixel stages' kernel levels of the own region decode (src/dpu_pipe/_idct.h, px_kern:
0 the scalar reference, 1 the build's baseline SIMD, 2 AVX2) against each other and against
libjpeg-turbo: the IDCTs block for block on random coefficients (extreme values included,
where SIMD IDCTs would differ), the same fallback decisions, the region decode at every
level, the run-time dispatch; and the same kernels built for aarch64 (NEON) equal to x86-64
under qemu."""

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import jpeg_corpus as jc
from dpu_pipe import _huffman, _jpeg, jpeg
from dpu_pipe.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
LEVELS = _huffman.simd_levels()
MAX_PIXELS = 1 << 28


def _blocks(rng, n):
    """n quantized blocks shaped like photographs' (amplitude falling with frequency), their
    overall amplitude spread over 2^-2 .. 2^12 so that a part crosses every range limit, plus
    blocks of int16 extremes."""
    u, v = np.divmod(np.arange(64), 8)
    amp = np.exp2(rng.uniform(-2, 12, (n, 1)))
    c = rng.standard_normal((n, 64)) * amp / (1 + u + v) * (rng.random((n, 64)) < 0.4)
    c = np.round(c).clip(-32768, 32767).astype(np.int16)
    k = n // 16
    c[:k] = rng.choice(np.array([-32768, -32767, -8192, -8191, -4096, -1, 0, 1, 4095, 8191,
                                 32767], np.int16), (k, 64))
    c[k:2 * k, 1:] = 0                              # DC only, every DC value's range
    c[k:2 * k, 0] = rng.integers(-32768, 32768, k)
    return np.ascontiguousarray(c)


QUANTIZERS = {
    "ones": np.ones(64, np.uint16),
    "fine": np.random.default_rng(1).integers(1, 9, 64).astype(np.uint16),
    "coarse": np.random.default_rng(2).integers(1, 120, 64).astype(np.uint16),
    "max": np.full(64, 255, np.uint16),
}


@pytest.mark.parametrize("fast", [False, True], ids=["islow", "ifast"])
@pytest.mark.parametrize("qname", list(QUANTIZERS))
def test_idct_levels_equal_the_reference(fast, qname):
    q = QUANTIZERS[qname]
    coef = _blocks(np.random.default_rng(7), 30000)
    ref, ref_fb = _huffman.idct_blocks(coef, q, 8, fast, 0)
    # Both outcomes occur, so both the pixels and the fallback decisions are compared.
    assert 0.02 < ref_fb.mean() < 0.98, ref_fb.mean()
    for level in LEVELS[1:]:
        got, fb = _huffman.idct_blocks(coef, q, 8, fast, level)
        np.testing.assert_array_equal(fb, ref_fb, err_msg=f"fallback decisions, level {level}")
        keep = ~ref_fb
        np.testing.assert_array_equal(got[keep], ref[keep], err_msg=f"pixels, level {level}")


@pytest.mark.parametrize("size", [4, 2, 1])
def test_reduced_idcts_at_every_level(size):
    coef = _blocks(np.random.default_rng(size), 5000)
    ref, ref_fb = _huffman.idct_blocks(coef, QUANTIZERS["fine"], size, False, 0)
    for level in LEVELS[1:]:
        got, fb = _huffman.idct_blocks(coef, QUANTIZERS["fine"], size, False, level)
        np.testing.assert_array_equal(fb, ref_fb)
        np.testing.assert_array_equal(got[~ref_fb], ref[~ref_fb])


def _cpu_has_avx2():
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return " avx2" in flags


def test_dispatch():
    assert LEVELS[:2] == [0, 1]
    assert _huffman.simd_default() in LEVELS
    machine = os.uname().machine
    if machine == "x86_64":
        avx2 = _cpu_has_avx2()
        assert (2 in LEVELS) == avx2
        assert _huffman.simd_default() == (2 if avx2 else 0)
    elif machine == "aarch64":
        assert LEVELS == [0, 1] and _huffman.simd_default() == 1
    coef = np.zeros((1, 64), np.int16)
    with pytest.raises(ConfigError, match="kernel level"):
        _huffman.idct_blocks(coef, QUANTIZERS["ones"], 8, False, LEVELS[-1] + 1)
    data = np.frombuffer(jc.cv_jpeg(jc.photo_sized("chelsea", 16, 16)), np.uint8)
    with pytest.raises(ConfigError, match="kernel level"):
        _huffman.decode_box(data, (0, 0, 8, 8), 8, simd=LEVELS[-1] + 1)


@pytest.mark.parametrize("sub", ["444", "422", "420", "440", "411", "grey"])
def test_region_decode_at_every_level(sub):
    """Every level's region decode equals libjpeg-turbo's: the upsamplers and the colour
    conversion of each level (odd box edges, rows shorter and longer than 16 pixels)."""
    img = jc.photo_sized("astronaut", 75, 113)
    if sub == "grey":
        raw = jc.pil_jpeg(np.ascontiguousarray(img[..., 1]), quality=92)
    else:
        raw = jc.cv_jpeg(img, quality=92, subsampling=sub)
    data = np.frombuffer(jpeg.transcode(raw, restart_interval=1), np.uint8)
    rng = np.random.default_rng(3)
    boxes = [(0, 0, 75, 113), (1, 1, 1, 1), (74, 112, 1, 1), (3, 5, 17, 33), (40, 61, 35, 52)]
    boxes += [(int(t), int(l), int(rng.integers(1, 76 - t)), int(rng.integers(1, 114 - l)))
              for t, l in zip(rng.integers(0, 75, 6), rng.integers(0, 113, 6))]
    for top, left, h, w in boxes:
        for scale in (8, 4, 2, 1):
            min_h, min_w = max(1, h * scale // 8), max(1, w * scale // 8)
            for fast in (False, True):
                ref, ref_scale = _jpeg.decode(data, (top, left, h, w), min_h, min_w, fast,
                                              False, MAX_PIXELS, 100)
                for level in LEVELS:
                    got, got_scale, own = _huffman.decode(data, (top, left, h, w), min_h,
                                                          min_w, fast, False, MAX_PIXELS, 100,
                                                          level)
                    assert own and got_scale == ref_scale
                    np.testing.assert_array_equal(
                        got, ref, err_msg=f"box {(top, left, h, w)} scale {scale} "
                                          f"fast={fast} level {level}")


def test_colour_conversion_of_every_chroma_pair_at_every_level():
    """Flat blocks at quality 100 decode to their exact Y, Cb, Cr: all 65,536 (Cb, Cr) pairs
    through each level's colour conversion, against libjpeg-turbo."""
    from PIL import Image
    import io

    cb, cr = np.meshgrid(np.arange(256, dtype=np.uint8), np.arange(256, dtype=np.uint8))
    ycc = np.stack([np.full_like(cb, 128), cb, cr], -1)
    ycc = np.repeat(np.repeat(ycc, 8, 0), 8, 1)
    buf = io.BytesIO()
    Image.fromarray(ycc, "YCbCr").save(buf, "JPEG", quality=100, subsampling=0)
    data = np.frombuffer(buf.getvalue(), np.uint8)
    ref, _ = _jpeg.decode(data, None, 0, 0, False, False, MAX_PIXELS, 100)
    for level in LEVELS:
        got, _, own = _huffman.decode(data, None, 0, 0, False, False, MAX_PIXELS, 100, level)
        assert own
        np.testing.assert_array_equal(got, ref, err_msg=f"level {level}")


def _sysroot():
    cache = Path(os.environ.get("DPU_PIPE_CROSS_CACHE",
                                Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                                / "dpu_pipe-cross"))
    root = cache / "sysroot" / "bullseye-arm64"
    return root if (root / "usr" / "include" / "stdio.h").exists() else None


def _build_and_run(cmd, run, tmp_path):
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    out = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.slow   # two builds and an emulated run, like tests/test_aarch64.py
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="cross-checks run on x86-64")
@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None
                    or shutil.which("qemu-aarch64-static") is None or _sysroot() is None,
                    reason="aarch64 cross compiler, qemu or sysroot absent "
                           "(scripts/build_wheels.sh installs them)")
def test_neon_kernels_equal_x86_under_qemu(tmp_path):
    """tests/kernels/pixel_levels.c built for x86-64 (levels 0-2) and for aarch64 (levels 0-1,
    NEON) with the build's flags: every level equals the scalar reference on its machine and
    the reference's outputs hash alike on both."""
    src = ROOT / "tests" / "kernels" / "pixel_levels.c"
    flags = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno",
             "-I", str(ROOT / "src" / "dpu_pipe")]
    cc = sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc"
    x86 = _build_and_run([cc, *flags, str(src), "-o", str(tmp_path / "x86"), "-lm"],
                         [str(tmp_path / "x86")], tmp_path)
    root = _sysroot()
    arm = _build_and_run(["aarch64-linux-gnu-gcc", f"--sysroot={root}", "-march=armv8-a",
                          *flags, str(src), "-o", str(tmp_path / "arm"), "-lm"],
                         ["qemu-aarch64-static", "-L", str(root), str(tmp_path / "arm")],
                         tmp_path)
    assert "mismatches between levels: 0 (levels 0..1)" in arm
    assert "mismatches between levels: 0" in x86

    def reference_hashes(text):
        return [line for line in text.splitlines() if "level 0" in line or "rgb" in line]

    assert reference_hashes(arm) == reference_hashes(x86)
    assert len(reference_hashes(x86)) == 5      # four IDCTs and the colour rows
