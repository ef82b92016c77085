"""The Gaussian blur and solarize ops (dpu_pipe.ops.gaussian_blur / solarize) against references.

References:
  * torchvision v2's ``gaussian_blur`` on a uint8 tensor (2-D float32 convolution of the
    reflect-padded image, rounded half to even): at most one level apart anywhere, and equal
    on all but a small fraction of values (the two sum float32 products in different orders,
    so they can round a value that lies within float32 error of a half apart; dpu_pipe leaves
    out the outer taps whose weights sum to at most 2**-24 per end).
  * A float64 numpy reference (np.pad "reflect", the separable kernel as a dense sum): equal
    to its rounding wherever it lies further than 1e-3 from a half.
  * torchvision v2's ``solarize``: equal.
Bit identity of the passes across targets (x86-64 SSE2 and AVX2 copies, aarch64 NEON) is
checked on a small C driver of src/dpu_pipe/_blur.h built for each, when the cross compiler and
qemu are installed.
"""

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from dpu_pipe import ConfigError, ops

import helpers
import jpeg_corpus as jc

torch = pytest.importorskip("torch")
F = pytest.importorskip("torchvision.transforms.v2.functional")

PHOTOS = jc.PHOTOS
SHAPES = [(224, 224), (37, 53), (13, 101), (96, 31)]
KERNELS = [1, 3, 9, 23]
SIGMAS = [0.1, 0.5, 1.0, 1.37, 2.0]
# Fraction of values allowed to differ (by one level) from torchvision, per photo and shape
# over the kernel sizes and sigmas below; measured: at most 1.7e-5.
TV_DIFF_FRACTION = 2e-4


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def photo(name, h, w):
    return jc.photo_sized(name, h, w)


def tv_blur(img, kernel_size, sigma=None):
    t = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)
    return F.gaussian_blur(t, kernel_size, sigma).permute(1, 2, 0).numpy()


def ref_kernel(ksize, sigma):
    r = ksize // 2
    k = np.exp(-0.5 * ((np.arange(ksize) - r) / sigma) ** 2)
    return k / k.sum()


def ref_blur(img, kx, ky, sx, sy):
    """float64 separable convolution of the reflect-padded image (not rounded)."""
    rx, ry = kx // 2, ky // 2
    p = np.pad(img.astype(np.float64), ((ry, ry), (rx, rx), (0, 0)), mode="reflect")
    h, w = img.shape[:2]
    wy, wx = ref_kernel(ky, sy), ref_kernel(kx, sx)
    v = sum(wy[t] * p[t:t + h] for t in range(ky))
    return sum(wx[t] * v[:, t:t + w] for t in range(kx))


# --- torchvision parity -----------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", PHOTOS)
def test_matches_torchvision(name, shape):
    img = photo(name, *shape)
    differ = total = 0
    for k in KERNELS:
        if k // 2 >= min(shape):
            continue
        for s in SIGMAS:
            ref = tv_blur(img, [k, k], [s, s])
            got = ops.gaussian_blur(img, k, s)
            d = np.abs(ref.astype(np.int16) - got)
            assert d.max() <= 1, (k, s, d.max())
            differ += int(np.count_nonzero(d))
            total += d.size
    assert differ <= TV_DIFF_FRACTION * total, differ / total


@pytest.mark.parametrize("kernel_size,sigma", [((23, 9), (2.0, 0.7)), ((3, 23), (0.3, 1.9)),
                                               ((9, 1), 1.1), (23, None), ((5, 7), None),
                                               (9, [0.8])])
def test_matches_torchvision_per_axis(kernel_size, sigma):
    """x first, as torchvision: kernel_size (kx, ky) and sigma (sx, sy); None: its default."""
    img = photo("coffee", 61, 88)
    ks = list(kernel_size) if isinstance(kernel_size, tuple) else kernel_size
    sg = list(sigma) if isinstance(sigma, tuple) else sigma
    ref = tv_blur(img, ks, sg)
    got = ops.gaussian_blur(img, kernel_size, sigma)
    assert np.abs(ref.astype(np.int16) - got).max() <= 1


@pytest.mark.parametrize("k", [3, 9, 23])
def test_equals_float64_reference_away_from_halves(k):
    img = photo("astronaut", 57, 73)
    for s in (0.1, 0.6, 2.0):
        exact = ref_blur(img, k, k, s, s)
        got = ops.gaussian_blur(img, k, s)
        frac = exact - np.floor(exact)
        clear = np.abs(frac - 0.5) > 1e-3
        assert np.array_equal(got[clear], np.round(exact[clear]).astype(np.uint8))
        assert np.abs(got.astype(np.float64) - exact).max() <= 0.5 + 1e-3


def test_tiny_sigma_and_one_tap_are_identity():
    img = photo("chelsea", 40, 50)
    assert np.array_equal(ops.gaussian_blur(img, 1, 1.0), img)
    assert np.array_equal(ops.gaussian_blur(img, 23, 0.1), img)
    assert np.array_equal(ops.gaussian_blur(img, (1, 1)), img)


def test_constant_image_stays_constant():
    img = np.full((30, 40, 3), (0, 128, 255), np.uint8)
    for k in (3, 23):
        assert np.array_equal(ops.gaussian_blur(img, k, 1.7), img)


# --- small images: torch's reflect padding needs pad < size ------------------------------------

@pytest.mark.parametrize("shape,k", [((11, 40), 23), ((40, 11), 23), ((1, 5), 3), ((5, 1), 3),
                                     ((4, 4), 9), ((2, 30), 5)])
def test_refuses_where_torchvision_refuses(shape, k):
    img = photo("rocket", 64, 64)[:shape[0], :shape[1]]
    with pytest.raises(RuntimeError):
        tv_blur(img, [k, k], [1.0, 1.0])
    with pytest.raises(ConfigError, match="too large"):
        ops.gaussian_blur(img, k, 1.0)


@pytest.mark.parametrize("shape,k", [((12, 40), 23), ((40, 12), 23), ((1, 1), 1), ((2, 2), 3),
                                     ((5, 1), (1, 9)), ((1, 7), (13, 1)), ((5, 5), 9)])
def test_smallest_images_torchvision_takes(shape, k):
    """kernel_size // 2 == size - 1: every reflected index is used."""
    img = photo("rocket", 64, 64)[:shape[0], :shape[1]]
    ks = list(k) if isinstance(k, tuple) else [k, k]
    ref = tv_blur(img, ks, [1.3, 1.3])
    got = ops.gaussian_blur(img, k, 1.3)
    assert np.abs(ref.astype(np.int16) - got).max() <= 1
    exact = ref_blur(img, ks[0], ks[1], 1.3, 1.3)
    assert np.abs(got.astype(np.float64) - exact).max() <= 0.5 + 1e-3


def test_empty_image_gives_empty_output():
    img = np.zeros((0, 5, 3), np.uint8)
    assert ops.gaussian_blur(img, 3, 1.0).shape == (0, 5, 3)


# --- arguments --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(kernel_size=4), "odd"), (dict(kernel_size=0), "kernel_size"),
    (dict(kernel_size=-3), "kernel_size"), (dict(kernel_size=3.0), "integer"),
    (dict(kernel_size=True), "integer"), (dict(kernel_size=(3, 5, 7)), "pair"),
    (dict(kernel_size=(3, 4)), "odd"), (dict(kernel_size="3"), "integer"),
    (dict(kernel_size=3, sigma=0.0), "sigma"), (dict(kernel_size=3, sigma=-1.0), "sigma"),
    (dict(kernel_size=3, sigma=float("nan")), "sigma"),
    (dict(kernel_size=3, sigma=float("inf")), "sigma"),
    (dict(kernel_size=3, sigma=(1.0, 2.0, 3.0)), "pair"),
    (dict(kernel_size=3, sigma="1"), "sigma"), (dict(kernel_size=3, sigma=(1.0, 0.0)), "sigma"),
])
def test_argument_errors(kwargs, match):
    img = photo("coffee", 20, 20)
    with pytest.raises(ConfigError, match=match):
        ops.gaussian_blur(img, **kwargs)


@pytest.mark.parametrize("img", [np.zeros((8, 8), np.uint8), np.zeros((8, 8, 4), np.uint8),
                                 np.zeros((8, 8, 3), np.float32), [[[0, 0, 0]]]],
                         ids=["2d", "rgba", "float32", "list"])
def test_image_errors(img):
    for fn in (lambda: ops.gaussian_blur(img, 3, 1.0), lambda: ops.solarize(img, 128)):
        with pytest.raises(ConfigError, match="img must be a uint8 array"):
            fn()


def test_out_errors():
    img = photo("coffee", 20, 30)
    ro = np.zeros_like(img)
    ro.flags.writeable = False
    bad = [(np.zeros((20, 31, 3), np.uint8), "shape"), (np.zeros((20, 30, 3), np.int16), "uint8"),
           (np.zeros((20, 60, 3), np.uint8)[:, ::2], "C-contiguous"), (ro, "writable"),
           ("x", "uint8 array")]
    for out, match in bad:
        with pytest.raises(ConfigError, match=match):
            ops.gaussian_blur(img, 3, 1.0, out=out)
        with pytest.raises(ConfigError, match=match):
            ops.solarize(img, 128, out=out)


# --- out=, layouts, determinism ------------------------------------------------------------------

def test_out_is_filled_and_returned():
    img = photo("chelsea", 45, 67)
    want = ops.gaussian_blur(img, 9, 1.2)
    out = np.full_like(img, 7)
    assert ops.gaussian_blur(img, 9, 1.2, out=out) is out
    assert np.array_equal(out, want)
    same = img.copy()
    assert ops.gaussian_blur(same, 9, 1.2, out=same) is same     # in place: input copied first
    assert np.array_equal(same, want)


def test_strided_and_noncompact_inputs():
    big = photo("astronaut", 90, 120)
    view = big[10:70, 20:100]                   # rows strided, pixels compact: read in place
    assert np.array_equal(ops.gaussian_blur(view, 23, 2.0),
                          ops.gaussian_blur(np.ascontiguousarray(view), 23, 2.0))
    step = big[:, ::2]                          # pixel step: copied first
    assert np.array_equal(ops.gaussian_blur(step, 9, 1.0),
                          ops.gaussian_blur(np.ascontiguousarray(step), 9, 1.0))
    flipped = big[::-1]                         # negative row stride: read in place
    assert np.array_equal(ops.gaussian_blur(flipped, 9, 1.4),
                          ops.gaussian_blur(np.ascontiguousarray(flipped), 9, 1.4))
    planar = np.ascontiguousarray(big.transpose(2, 0, 1)).transpose(1, 2, 0)
    assert np.array_equal(ops.gaussian_blur(planar, 3, 0.8), ops.gaussian_blur(big, 3, 0.8))


def test_deterministic_across_calls_and_threads():
    imgs = [photo(n, 224, 224) for n in PHOTOS]
    jobs = [(i, k, s) for i in range(len(imgs)) for k in (3, 23) for s in (0.4, 1.9)]
    first = {j: ops.gaussian_blur(imgs[j[0]], j[1], j[2]) for j in jobs}
    with ThreadPoolExecutor(4) as pool:
        again = list(pool.map(lambda j: ops.gaussian_blur(imgs[j[0]], j[1], j[2]), jobs * 3))
    for j, got in zip(jobs * 3, again):
        assert np.array_equal(got, first[j])


# --- solarize ---------------------------------------------------------------------------------

@pytest.mark.parametrize("threshold", [0, 1, 127.5, 128, 200.0001, 255, -3.0, 254.99999999])
def test_solarize_matches_torchvision(threshold):
    img = photo("coffee", 33, 47)
    img[0, :3] = [[0, 255, 128], [127, 128, 129], [254, 255, 1]]
    ref = F.solarize(torch.from_numpy(img).permute(2, 0, 1), threshold).permute(1, 2, 0).numpy()
    assert np.array_equal(ops.solarize(img, threshold), ref)


def test_solarize_out_and_errors():
    img = photo("chelsea", 20, 30)
    want = np.where(img >= 128, 255 - img, img)
    out = np.zeros_like(img)
    assert ops.solarize(img, 128, out=out) is out and np.array_equal(out, want)
    same = img.copy()
    assert ops.solarize(same, 128, out=same) is same and np.array_equal(same, want)
    assert np.array_equal(ops.solarize(img[:, ::2], 128), want[:, ::2])
    for bad in (255.5, 300, float("nan"), "128", None, True):
        with pytest.raises(ConfigError, match="threshold"):
            ops.solarize(img, bad)


# --- bit identity of the passes across targets ---------------------------------------------

DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include "_blur.h"
/* stdin: int32 h, w, kx, ky; kx + ky float32 weights; h*w*3 bytes. stdout: h*w*3 bytes. */
int main(void) {
    int32_t hd[4];
    if (fread(hd, 4, 4, stdin) != 4) return 2;
    int h = hd[0], w = hd[1], kx = hd[2], ky = hd[3];
    float *wts = malloc(sizeof(float) * ((size_t)kx + ky + blur_scratch_floats(w, kx, ky)));
    uint8_t *src = malloc((size_t)h * w * 3), *dst = malloc((size_t)h * w * 3);
    if (fread(wts, 4, (size_t)kx + ky, stdin) != (size_t)kx + ky) return 2;
    if (fread(src, 1, (size_t)h * w * 3, stdin) != (size_t)h * w * 3) return 2;
    if (blur_rgb_u8(src, 3 * w, h, w, dst, 3 * w, wts, kx, wts + kx, ky, wts + kx + ky)) return 3;
    fwrite(dst, 1, (size_t)h * w * 3, stdout);
    return 0;
}
"""
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c11", "-Wall", "-Werror"]


def _driver_inputs():
    cases = []
    for i, (name, shape) in enumerate((n, s) for n in PHOTOS for s in SHAPES):
        img = photo(name, *shape)
        for kx, ky, sx, sy in ((3, 3, 0.7, 0.7), (23, 9, 1.9, 0.45), (9, 23, 1.3, 2.0)):
            if kx // 2 >= shape[1] or ky // 2 >= shape[0]:
                continue
            wts = np.concatenate([ref_kernel(kx, sx), ref_kernel(ky, sy)]).astype(np.float32)
            hdr = np.array([shape[0], shape[1], kx, ky], np.int32)
            cases.append(hdr.tobytes() + wts.tobytes() + img.tobytes())
    return cases


def arm64_sysroot():
    """The arm64 glibc sysroot scripts/build_wheels.sh unpacks (with C headers and the
    dynamic loader), or None."""
    cache = Path(os.environ.get("DPU_PIPE_CROSS_CACHE",
                                Path.home() / ".cache" / "dpu_pipe-cross"))
    for root in sorted(cache.glob("sysroot/*-arm64")):
        if (root / "usr" / "include" / "stdio.h").exists():
            return root
    return None


@pytest.mark.parametrize("target", ["aarch64", "x86-64-sse2"])
def test_passes_bit_identical_across_targets(target, tmp_path):
    """The driver built natively (on an AVX2 CPU: the AVX2 copies) and for the target (aarch64
    NEON under qemu-aarch64 -cpu cortex-a72; the x86-64 build under qemu-x86_64 -cpu Nehalem,
    which has no AVX and so runs the SSE2 copies) gives the same bytes."""
    src = tmp_path / "driver.c"
    src.write_text(DRIVER)
    inc = f"-I{helpers.ROOT / 'src' / 'dpu_pipe'}"
    native = tmp_path / "native"
    helpers.run(["gcc", *CFLAGS, inc, src, "-o", native], timeout=300)
    if target == "aarch64":
        need = ("aarch64-linux-gnu-gcc", "qemu-aarch64-static")
        if any(shutil.which(t) is None for t in need):
            pytest.skip(f"needs {' and '.join(need)}")
        root = arm64_sysroot()
        other = tmp_path / "arm"
        sysroot = ([f"--sysroot={root}", "-isystem", f"{root}/usr/include/aarch64-linux-gnu"]
                   if root else [])
        proc = helpers.run(["aarch64-linux-gnu-gcc", *CFLAGS, *sysroot, inc, src, "-o", other],
                           timeout=300, check=False)
        if proc.returncode != 0 and root is None and "No such file" in proc.stderr:
            pytest.skip("no arm64 C library headers: scripts/build_wheels.sh unpacks a sysroot "
                        "(or apt-get install libc6-dev-arm64-cross)")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runner = ["qemu-aarch64-static", "-cpu", "cortex-a72", "-L",
                  str(root or "/usr/aarch64-linux-gnu"), other]
    else:
        if shutil.which("qemu-x86_64-static") is None:
            pytest.skip("needs qemu-x86_64-static")
        runner = ["qemu-x86_64-static", "-cpu", "Nehalem", native]
    cases = _driver_inputs()
    assert len(cases) > 30
    for data in cases:
        want = subprocess.run([native], input=data, capture_output=True, timeout=120)
        got = subprocess.run(runner, input=data, capture_output=True, timeout=300)
        assert want.returncode == 0 and got.returncode == 0, (want.stderr, got.stderr)
        h, w = np.frombuffer(data[:8], np.int32)
        assert len(want.stdout) == h * w * 3
        assert got.stdout == want.stdout
