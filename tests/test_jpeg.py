"""dpu_pipe.jpeg against Pillow as the reference decoder (same libjpeg semantics).

Every image is made here (tests/jpeg_corpus.py): scikit-image's bundled photographs encoded by
Pillow and OpenCV, arithmetic-coded files transcoded through the system libjpeg, and broken
files cut, patched and bit-flipped from them. Sizes are written height x width.
"""

import io
from functools import lru_cache

import numpy as np
import pytest

import dpu_pipe
from dpu_pipe import ConfigError, DecodeError, _jpeg, jpeg

import jpeg_corpus as jc
from helpers import rss_bytes

pytest.importorskip("skimage.data", reason="the test images are made from scikit-image's "
                    "bundled photographs (pip install scikit-image)")
pytestmark = pytest.mark.timeout(60)

ARITH_DECODING = dpu_pipe.build_info()["arithmetic_decoding"]


# --- the corpus of valid images ------------------------------------------------------------------

def _pil(photo, size=None, gray=False, **kw):
    def make():
        img = jc.photo(photo) if size is None else jc.photo_sized(photo, *size)
        if gray:
            img = np.ascontiguousarray(img[..., 1])
        return jc.pil_jpeg(img, **kw)
    return make


def _cv(photo, size=None, **kw):
    return lambda: jc.cv_jpeg(jc.photo(photo) if size is None else jc.photo_sized(photo, *size),
                              **kw)


def _arith(base, progressive=False):
    return lambda: jc.to_arithmetic(case(base), progressive=progressive)


def _then(base, fn):
    return lambda: fn(case(base))


SMALL = (157, 203)     # not a multiple of any iMCU size
MEDIUM = (229, 331)    # ~15 iMCU rows: skipping rows goes through several of them

CASES = {}
# Qualities x subsamplings on whole photographs (Pillow's encoder).
for _ss, _photo in (("444", "astronaut"), ("422", "coffee"), ("420", "chelsea")):
    for _q in (50, 75, 95):
        CASES[f"ycc{_ss}-q{_q}"] = _pil(_photo, quality=_q, subsampling=_ss)
    CASES[f"progressive-{_ss}"] = _pil(_photo, subsampling=_ss, progressive=True)
# OpenCV's encoder, every sampling it writes, with and without restart markers.
for _ss in ("444", "422", "420", "440", "411"):
    CASES[f"cv-{_ss}"] = _cv("coffee", SMALL, subsampling=_ss)
    CASES[f"cv-{_ss}-rst1"] = _cv("coffee", SMALL, subsampling=_ss, restart=1)
CASES["cv-420-rst7"] = _cv("astronaut", subsampling="420", restart=7)
CASES["cv-progressive-420-rst3"] = _cv("astronaut", subsampling="420", restart=3,
                                       progressive=True)
# Grayscale, CMYK and its variants, RGB colour space.
CASES["gray"] = _pil("coffee", gray=True)
CASES["gray-progressive"] = _pil("chelsea", gray=True, progressive=True)
CASES["cmyk-adobe"] = _pil("chelsea", SMALL, mode="CMYK", quality=90)
CASES["cmyk-adobe-progressive"] = _pil("coffee", SMALL, mode="CMYK", progressive=True)
CASES["ycck-adobe"] = _then("cmyk-adobe", lambda d: jc.set_adobe_transform(d, 2))
CASES["cmyk-no-adobe"] = _then("cmyk-adobe", lambda d: jc.strip_segment(d, jc.APP14))
# Three components with Adobe transform 0 and no JFIF marker: stored as RGB, no YCbCr transform.
CASES["rgb-adobe"] = _then("cv-444", lambda d: jc.insert_adobe(jc.strip_all(d, 0xE0), 0))
# Arithmetic coding (lossless transcodes of Huffman-coded files).
CASES["arith-420"] = _arith("ycc420-q75")
CASES["arith-422-progressive"] = _arith("ycc422-q75", progressive=True)
CASES["arith-gray"] = _arith("gray")
# Odd and tiny sizes, where the image is smaller than or not a multiple of an iMCU.
ODD_SIZES = [(1, 1), (17, 9), (4000, 3), (3, 4000), (8, 8), (16, 16), (9, 17)]
for _h, _w in ODD_SIZES:
    for _ss in ("444", "422", "420"):
        CASES[f"size-{_h}x{_w}-{_ss}"] = _pil("astronaut", (_h, _w), subsampling=_ss)
    CASES[f"size-{_h}x{_w}-gray"] = _pil("astronaut", (_h, _w), gray=True)
# Images the region and min_size tests cut up (odd sizes, every layout the decoder handles).
for _ss in ("444", "422", "420"):
    CASES[f"medium-{_ss}"] = _pil("chelsea", MEDIUM, subsampling=_ss)
CASES["medium-progressive-420"] = _pil("chelsea", MEDIUM, progressive=True)
CASES["medium-progressive-444"] = _pil("chelsea", MEDIUM, progressive=True, subsampling="444")
CASES["medium-440"] = _cv("chelsea", MEDIUM, subsampling="440")
CASES["medium-411-rst2"] = _cv("chelsea", MEDIUM, subsampling="411", restart=2)
CASES["medium-420-rst1"] = _cv("chelsea", MEDIUM, subsampling="420", restart=1)
CASES["medium-gray"] = _pil("chelsea", MEDIUM, gray=True)
CASES["medium-cmyk"] = _pil("chelsea", MEDIUM, mode="CMYK")
CASES["medium-ycck"] = _then("medium-cmyk", lambda d: jc.set_adobe_transform(d, 2))
CASES["medium-arith-420"] = _arith("medium-420")
CASES["medium-arith-progressive"] = _arith("medium-444", progressive=True)

# Files only the error tests use (not in the Pillow comparison).
EXTRA = {
    "gray-progressive-small": _pil("chelsea", (16, 16), gray=True, progressive=True),
    "gray-progressive-small-bomb": _then("gray-progressive-small",
                                         lambda d: jc.repeat_last_scan(d, 3)),
    "scan-bomb": lambda: jc.repeat_last_scan(
        jc.pil_jpeg(jc.photo_sized("coffee", 40, 56), progressive=True), 1200),
    # Small files for the tests that decode hundreds of mutants of each.
    "small-420": _pil("chelsea", (96, 124)),
    "small-progressive-420": _pil("chelsea", (96, 124), progressive=True),
    "small-420-rst1": _cv("chelsea", (96, 124), restart=1),
    "small-gray": _pil("chelsea", (96, 124), gray=True),
    "small-cmyk": _pil("chelsea", (96, 124), mode="CMYK"),
    "small-arith-420": _arith("small-420"),
    "small-arith-progressive": _arith("small-420", progressive=True),
}


@lru_cache(maxsize=None)
def case(name):
    """The bytes of one corpus image (skips the test when it needs a missing tool)."""
    make = CASES.get(name) or EXTRA[name]
    try:
        return make()
    except jc.ToolUnavailable as exc:
        pytest.skip(str(exc))


def _frozen(a):
    a.setflags(write=False)  # cached: shared by every test
    return a


@lru_cache(maxsize=None)
def full(name, fast=False):
    """dpu_pipe's full decode of a corpus image."""
    return _frozen(jpeg.decode(case(name), fast=fast))


@lru_cache(maxsize=None)
def reference(name, scale=8):
    """Pillow's decode of a corpus image."""
    return _frozen(np.array(jc.pil_decode(case(name), scale)))


def needs_arith(name):
    if "arith" in name and not ARITH_DECODING:
        pytest.skip("this libjpeg-turbo build does not decode arithmetic coding "
                    "(test_arithmetic_unsupported covers that)")


def min_size_for_scale(h, w, scale):
    """A min_size for which ``scale`` (eighths) is the choice for a whole h x w image: the
    larger side's size at that scale."""
    return (max(1, h * scale // 8), 0) if h >= w else (0, max(1, w * scale // 8))


def mad(a, b):
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


# --- accurate mode equals Pillow -----------------------------------------------------------------

ACCURATE = list(CASES)


@pytest.mark.parametrize("name", ACCURATE)
def test_accurate_equals_pillow(name):
    needs_arith(name)
    data = case(name)
    out = jpeg.decode(data)
    ref = reference(name)
    assert out.dtype == np.uint8 and out.flags.c_contiguous
    assert out.shape == ref.shape
    diff = np.abs(out.astype(np.int16) - ref)
    assert np.array_equal(out, ref), f"MAD {diff.mean():.3f}, max {diff.max()}"
    # A file without corrupt-data warnings decodes identically in strict mode.
    assert np.array_equal(jpeg.decode(data, strict=True), out)


@pytest.mark.parametrize("name", ["arith-420", "arith-422-progressive", "arith-gray"])
def test_arithmetic_decodes_like_its_huffman_source(name):
    """The arithmetic-coded file holds the Huffman file's coefficients: same pixels."""
    needs_arith(name)
    source = {"arith-420": "ycc420-q75", "arith-422-progressive": "ycc422-q75",
              "arith-gray": "gray"}[name]
    assert jpeg.read_header(case(name)).progressive == name.endswith("progressive")
    assert np.array_equal(full(name), full(source))


def test_arithmetic_unsupported():
    if ARITH_DECODING:
        pytest.skip("this build decodes arithmetic coding (the corpus tests cover it)")
    with pytest.raises(DecodeError, match="rithmetic"):
        jpeg.decode(case("arith-420"))


@pytest.mark.parametrize("scale", [1, 2, 4])
@pytest.mark.parametrize("name", ["ycc444-q75", "ycc422-q75", "ycc420-q75", "progressive-420",
                                  "cv-440", "cv-411-rst1", "gray", "cmyk-adobe", "ycck-adobe",
                                  "arith-420", "size-17x9-420", "size-16x16-422"])
def test_scaled_decode_equals_pillow_draft(name, scale):
    """min_size picks the DCT scale; the whole image at scale s/8 is Pillow's draft decode."""
    needs_arith(name)
    h, w = full(name).shape[:2]
    min_size = min_size_for_scale(h, w, scale)
    assert jpeg.choose_scale(h, w, min_size) == scale
    out = jpeg.decode(case(name), min_size=min_size)
    ref = reference(name, scale)
    assert out.shape == (-(-h * scale // 8), -(-w * scale // 8), 3) == ref.shape
    assert np.array_equal(out, ref), f"MAD {mad(out, ref):.3f}"


# --- region decode equals the full decode sliced -------------------------------------------------

def _regions(group, h, w, imcu, rng):
    """Boxes (top, left, height, width) inside an h x w image."""
    def box(top, left, bottom, right):  # half-open, clipped to the image
        top, left = min(max(top, 0), h - 1), min(max(left, 0), w - 1)
        return (top, left, max(1, min(bottom, h) - top), max(1, min(right, w) - left))

    def rand_span(n):
        a = int(rng.integers(0, n))
        return a, int(rng.integers(a + 1, n + 1))

    out = []
    if group == "random":
        for _ in range(40):
            (t, b), (l, r) = rand_span(h), rand_span(w)
            out.append(box(t, l, b, r))
    elif group == "1x1":
        out += [(0, 0, 1, 1), (0, w - 1, 1, 1), (h - 1, 0, 1, 1), (h - 1, w - 1, 1, 1)]
        out += [(int(rng.integers(0, h)), int(rng.integers(0, w)), 1, 1) for _ in range(24)]
    elif group == "edges":
        out.append((0, 0, h, w))
        for _ in range(4):
            (t, b), (l, r) = rand_span(h), rand_span(w)
            out += [box(t, 0, b, w), box(0, l, h, r),          # full width / full height
                    box(0, l, b, r), box(t, l, h, r),          # touching top / bottom
                    box(t, 0, b, r), box(t, l, b, w)]          # touching left / right
        out += [(h - 1, 0, 1, w), (0, w - 1, h, 1), (0, 0, 1, w), (0, 0, h, 1)]
    elif group == "imcu":
        rows = sorted({min(max(k * imcu[0] + d, 0), h) for k in range(h // imcu[0] + 2)
                       for d in (-1, 0, 1)})
        cols = sorted({min(max(k * imcu[1] + d, 0), w) for k in range(w // imcu[1] + 2)
                       for d in (-1, 0, 1)})
        for _ in range(40):
            t, b = sorted(rng.choice(rows, 2, replace=len(rows) < 2))
            l, r = sorted(rng.choice(cols, 2, replace=len(cols) < 2))
            out.append(box(int(t), int(l), int(b) if b > t else int(t) + 1,
                           int(r) if r > l else int(l) + 1))
    return out


REGION_CASES = ["medium-444", "medium-422", "medium-420", "medium-440", "medium-411-rst2",
                "medium-420-rst1", "medium-progressive-420", "medium-progressive-444",
                "medium-gray", "medium-cmyk", "medium-ycck", "medium-arith-420",
                "medium-arith-progressive", "size-3x4000-420", "size-4000x3-420",
                "size-17x9-422", "size-1x1-420"]


REGION_GROUPS = ["random", "1x1", "edges", "imcu"]


@pytest.mark.parametrize("fast", [False, True], ids=["accurate", "fast"])
@pytest.mark.parametrize("group", REGION_GROUPS)
@pytest.mark.parametrize("name", REGION_CASES)
def test_region_equals_full_decode_sliced(name, group, fast):
    needs_arith(name)
    data = case(name)
    ref = full(name, fast)
    h, w = ref.shape[:2]
    rng = np.random.default_rng([h, w, REGION_GROUPS.index(group)])
    bad = []
    for top, left, rh, rw in _regions(group, h, w, jc.imcu_size(data), rng):
        got = jpeg.decode(data, region=(top, left, rh, rw), fast=fast)
        want = ref[top:top + rh, left:left + rw]
        if got.shape != want.shape or not np.array_equal(got, want):
            bad.append(((top, left, rh, rw), got.shape))
    assert not bad, f"{len(bad)} regions differ from the full decode, e.g. {bad[:5]}"


# --- min_size: DCT scale choice and scaled regions -----------------------------------------------

def _smallest_scale(h, w, min_h, min_w):
    """The contract: the smallest of 1/8, 2/8, 4/8, 8/8 keeping h x w at least min_h x min_w."""
    if min_h == 0 and min_w == 0:
        return 8  # no constraint: full resolution
    for s in (1, 2, 4):
        if h * s / 8 >= min_h and w * s / 8 >= min_w:
            return s
    return 8


@pytest.mark.parametrize("h, w, min_size, scale", [
    (224, 224, (224, 224), 8), (448, 448, (224, 224), 4), (896, 896, (224, 224), 2),
    (1792, 1792, (224, 224), 1), (5000, 5000, (224, 224), 1), (447, 448, (224, 224), 8),
    (1792, 448, (224, 224), 4), (1792, 448, (224, 0), 1), (1792, 448, (0, 224), 4),
    (100, 100, (300, 300), 8), (8, 8, (1, 1), 1), (7, 8, (1, 1), 2), (1, 1, (1, 1), 8),
    (100, 100, (0, 0), 8), (100, 100, None, 8), (100, 100, (1, 0), 1),
])
def test_choose_scale(h, w, min_size, scale):
    assert jpeg.choose_scale(h, w, min_size) == scale
    if min_size is not None:
        assert _smallest_scale(h, w, *min_size) == scale


MIN_SIZE_CASES = ["medium-444", "medium-420", "medium-422", "medium-440", "medium-411-rst2",
                  "medium-progressive-420", "medium-gray", "medium-cmyk", "medium-arith-420",
                  "size-3x4000-420"]


@pytest.mark.parametrize("fast", [False, True], ids=["accurate", "fast"])
@pytest.mark.parametrize("name", MIN_SIZE_CASES)
def test_min_size_region_equals_scaled_decode_sliced(name, fast):
    needs_arith(name)
    data = case(name)
    H, W = full(name).shape[:2]
    scaled = {}
    for s in (1, 2, 4, 8):  # the whole image at each scale, min_size set so that s is chosen
        ms = min_size_for_scale(H, W, s)
        assert jpeg.choose_scale(H, W, ms) == s
        scaled[s] = jpeg.decode(data, min_size=ms, fast=fast)
        assert scaled[s].shape == (-(-H * s // 8), -(-W * s // 8), 3)
    rng = np.random.default_rng([H, W])
    bad, used = [], set()
    for i in range(100):
        top, bottom = sorted(int(v) for v in rng.integers(0, H + 1, 2))
        left, right = sorted(int(v) for v in rng.integers(0, W + 1, 2))
        top, left = min(top, H - 1), min(left, W - 1)
        rh, rw = max(1, bottom - top), max(1, right - left)
        target = (1, 2, 4, 8)[i % 4]  # spread the choices over every scale
        min_h = int(rng.integers(0, rh * target // 8 + 1))
        min_w = int(rng.integers(0, rw * target // 8 + 1))
        if i % 10 == 0:
            min_h, min_w = rh + 1, rw  # not reachable: full resolution
        s = jpeg.choose_scale(rh, rw, (min_h, min_w))
        used.add(s)
        got = jpeg.decode(data, region=(top, left, rh, rw), min_size=(min_h, min_w), fast=fast)
        # floor(top·s/8) .. ceil((top+h)·s/8), likewise for columns
        want = scaled[s][top * s // 8:-(-(top + rh) * s // 8),
                         left * s // 8:-(-(left + rw) * s // 8)]
        problems = []
        if s != _smallest_scale(rh, rw, min_h, min_w):
            problems.append(f"scale {s}")
        if not np.array_equal(got, want):
            problems.append(f"pixels (shape {got.shape}, want {want.shape})")
        if min_h <= rh and min_w <= rw and (got.shape[0] < min_h or got.shape[1] < min_w):
            problems.append(f"smaller than min_size: {got.shape}")
        if problems:
            bad.append(((top, left, rh, rw), (min_h, min_w), problems))
    assert not bad, f"{len(bad)} regions wrong, e.g. {bad[:4]}"
    if H >= 64 and W >= 64:
        assert used == {1, 2, 4, 8}, f"scales exercised: {sorted(used)}"


def test_min_size_none_and_zero_mean_full_resolution():
    data = case("medium-420")
    assert np.array_equal(jpeg.decode(data, min_size=(0, 0)), full("medium-420"))
    assert np.array_equal(jpeg.decode(data, min_size=None), full("medium-420"))


# --- fast mode -----------------------------------------------------------------------------------

# Mean absolute difference of fast mode (JDCT_IFAST + plain chroma replication) from the accurate
# decode on whole photographs. Measured here (libjpeg-turbo 2.1.5, astronaut/coffee/chelsea,
# q50/75/95): gray <= 1.00, 4:4:4 <= 1.31, 4:2:2 <= 1.53, 4:2:0 <= 1.65 — the highest at q95,
# where the fast IDCT's rounding is large next to the fine quantization steps. Bounds ~1.5x that.
FAST_MAD_BOUND = {"gray": 1.5, "444": 2.0, "422": 2.3, "420": 2.5}


@pytest.mark.parametrize("quality", [50, 75, 95])
@pytest.mark.parametrize("kind", ["444", "422", "420", "gray"])
@pytest.mark.parametrize("photo", jc.PHOTOS)
def test_fast_mode_error_bound(photo, kind, quality):
    img = jc.photo(photo)
    if kind == "gray":
        data = jc.pil_jpeg(np.ascontiguousarray(img[..., 1]), quality=quality)
    else:
        data = jc.pil_jpeg(img, quality=quality, subsampling=kind)
    accurate = jpeg.decode(data)
    fast = jpeg.decode(data, fast=True)
    assert fast.shape == accurate.shape
    err = mad(fast, accurate)
    assert 0 < err < FAST_MAD_BOUND[kind], f"fast-mode MAD {err:.3f}"


# --- read_header ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name, components, colorspace, progressive", [
    ("ycc420-q75", 3, "YCbCr", False), ("progressive-444", 3, "YCbCr", True),
    ("cv-411-rst1", 3, "YCbCr", False), ("cv-progressive-420-rst3", 3, "YCbCr", True),
    ("gray", 1, "GRAY", False), ("gray-progressive", 1, "GRAY", True),
    ("cmyk-adobe", 4, "CMYK", False), ("cmyk-adobe-progressive", 4, "CMYK", True),
    ("cmyk-no-adobe", 4, "CMYK", False), ("ycck-adobe", 4, "YCCK", False),
    ("rgb-adobe", 3, "RGB", False), ("arith-420", 3, "YCbCr", False),
    ("arith-422-progressive", 3, "YCbCr", True), ("size-1x1-420", 3, "YCbCr", False),
    ("size-4000x3-gray", 1, "GRAY", False),
])
def test_read_header(name, components, colorspace, progressive):
    data = case(name)
    hdr = jpeg.read_header(data)
    assert isinstance(hdr, jpeg.JpegHeader)
    assert (hdr.components, hdr.colorspace, hdr.progressive) == (components, colorspace,
                                                                  progressive)
    assert (hdr.height, hdr.width) == reference(name).shape[:2]
    assert hdr._fields == ("width", "height", "components", "colorspace", "progressive")


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "ndarray", "ndarray-2d"])
def test_accepts_bytes_like(kind):
    data = case("ycc420-q75")
    arr = np.frombuffer(data, dtype=np.uint8)
    padded = np.frombuffer(data + b"\0" * (len(data) % 2), dtype=np.uint8)  # bytes after EOI
    obj = {"bytes": data, "bytearray": bytearray(data), "memoryview": memoryview(data),
           "ndarray": arr, "ndarray-2d": padded.reshape(-1, 2)}[kind]
    assert jpeg.read_header(obj) == jpeg.read_header(data)
    assert np.array_equal(jpeg.decode(obj), full("ycc420-q75"))


# --- decode_batch --------------------------------------------------------------------------------

BATCH_NAMES = ["size-17x9-420", "cv-411-rst1", "gray-progressive", "cmyk-adobe", "ycck-adobe",
               "medium-progressive-420", "size-1x1-gray", "cv-440"]


def _batch():
    return [case(n) for n in BATCH_NAMES]


def _batch_regions(datas, seed):
    rng = np.random.default_rng(seed)
    regs = []
    for d in datas:
        hdr = jpeg.read_header(d)
        top, left = int(rng.integers(0, hdr.height)), int(rng.integers(0, hdr.width))
        regs.append((top, left, int(rng.integers(1, hdr.height - top + 1)),
                     int(rng.integers(1, hdr.width - left + 1))))
    return np.array(regs, dtype=np.int64)


@pytest.mark.parametrize("variant", ["default", "out", "regions", "min_size", "regions-min_size",
                                     "fast", "buffer-list", "mixed-buffers"])
def test_decode_batch_equals_decode(variant):
    datas = _batch()
    n = len(datas)
    kw = {}
    if "regions" in variant or variant == "buffer-list":
        kw["regions"] = _batch_regions(datas, seed=len(variant))
    if "min_size" in variant or variant == "buffer-list":
        kw["min_size"] = (9, 13)
    if variant == "fast":
        kw["fast"] = True
    buffers = datas
    out = None
    if variant in ("out", "regions-min_size", "buffer-list"):
        out = np.full((n, 320, 460, 3), 77, dtype=np.uint8)
    if variant == "buffer-list":
        lengths = np.array([len(d) for d in datas], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) + 5
        packed = np.frombuffer(b"\0" * 5 + b"".join(datas), dtype=np.uint8)
        buffers = _jpeg.BufferList.from_packed(packed, offsets, lengths)
        assert len(buffers) == n
    if variant == "mixed-buffers":
        buffers = [datas[0], bytearray(datas[1]), memoryview(datas[2]),
                   np.frombuffer(datas[3], dtype=np.uint8)] + datas[4:]
    result, shapes = jpeg.decode_batch(buffers, out, **kw)
    if out is not None:
        assert result is out
    assert result.dtype == np.uint8 and result.shape[0] == n and result.shape[3] == 3
    assert shapes.shape == (n, 3)
    regions = kw.get("regions")
    for i, d in enumerate(datas):
        region = None if regions is None else tuple(int(v) for v in regions[i])
        one = jpeg.decode(d, region=region, min_size=kw.get("min_size"),
                          fast=kw.get("fast", False))
        h, w = one.shape[:2]
        hdr = jpeg.read_header(d)
        rh, rw = region[2:] if region else (hdr.height, hdr.width)
        assert tuple(shapes[i]) == (h, w, jpeg.choose_scale(rh, rw, kw.get("min_size"))), i
        assert np.array_equal(result[i, :h, :w], one), f"image {i} ({BATCH_NAMES[i]})"
        if out is not None:  # the rest of the slot is left as it was
            assert (result[i, h:] == 77).all() and (result[i, :, w:] == 77).all(), i


def test_decode_batch_empty():
    out, shapes = jpeg.decode_batch([])
    assert out.shape[0] == 0 and shapes.shape == (0, 3)


def test_decode_batch_raise_names_the_bad_image():
    datas = _batch()
    datas[3] = datas[3][:len(datas[3]) // 2]
    datas[5] = b"not a jpeg"
    with pytest.raises(DecodeError) as info:
        jpeg.decode_batch(datas)
    assert info.value.index == 3
    assert "sample 3" in str(info.value) and info.value.message


def test_decode_batch_return_errors_and_good_images():
    datas = _batch()
    bad = {1: b"", 4: datas[4][:len(datas[4]) * 2 // 3], 6: b"\x89PNG\r\n\x1a\n" + bytes(40)}
    for i, b in bad.items():
        datas[i] = b
    out, shapes, errors = jpeg.decode_batch(datas, on_error="return")
    assert sorted(errors) == sorted(bad)
    for i, err in errors.items():
        assert isinstance(err, DecodeError) and isinstance(err, ValueError)
        assert err.index == i and err.message
        assert tuple(shapes[i]) == (0, 0, 0)
    for i, d in enumerate(datas):
        if i not in bad:
            one = jpeg.decode(d)
            assert np.array_equal(out[i, :one.shape[0], :one.shape[1]], one), i


def test_decode_batch_budget_is_per_image():
    datas = _batch()
    big = [i for i, d in enumerate(datas)
           if jpeg.read_header(d).width * jpeg.read_header(d).height > 100_000]
    assert 0 < len(big) < len(datas)
    out, shapes, errors = jpeg.decode_batch(datas, max_pixels=100_000, on_error="return")
    assert sorted(errors) == big
    assert all("pixel budget" in errors[i].message for i in big)


def test_decode_batch_region_outside_is_a_per_image_error():
    datas = _batch()
    regions = _batch_regions(datas, seed=1)
    regions[2] = (0, 0, 10_000, 1)
    out, shapes, errors = jpeg.decode_batch(datas, regions=regions, on_error="return")
    assert list(errors) == [2] and "region" in errors[2].message


def test_decode_batch_region_beyond_int_range_is_rejected():
    datas = _batch()[:2]
    regions = np.array([(0, 0, 1, 1), (2**32, 0, 1, 1)], dtype=np.int64)
    out = np.zeros((2, 8, 8, 3), dtype=np.uint8)
    with pytest.raises(ValueError):
        result, shapes, errors = jpeg.decode_batch(datas, out, regions=regions,
                                                   on_error="return")
        if errors:
            raise errors[min(errors)]


@pytest.mark.parametrize("missing", ["DQT", "DHT"])
def test_decode_batch_does_not_carry_tables_between_images(missing):
    """A batch decodes each image as decode() does, whatever came before it."""
    img = jc.photo_sized("coffee", 40, 48)
    # The first image has its own (optimized Huffman, low-quality) tables.
    first = jc.pil_jpeg(img, quality=30, optimize=True)
    # Without DHT libjpeg uses the standard Huffman tables Pillow encoded with: it decodes.
    # Without DQT it cannot decode.
    second = jc.strip_all(jc.pil_jpeg(jc.photo_sized("chelsea", 40, 48), quality=90),
                          jc.DQT if missing == "DQT" else jc.DHT)
    try:
        alone = jpeg.decode(second)
    except DecodeError:
        alone = None
    assert (alone is None) == (missing == "DQT")
    out, shapes, errors = jpeg.decode_batch([first, second], on_error="return")
    if alone is None:
        assert list(errors) == [1], "decoded with the previous image's quantization tables"
    else:
        assert not errors and np.array_equal(out[1, :40, :48], alone)


def test_decode_batch_out_slot_too_small():
    """Slots smaller than an image: that image fails (with its index), the others decode."""
    datas = _batch()
    out = np.zeros((len(datas), 20, 20, 3), dtype=np.uint8)
    out, shapes, errors = jpeg.decode_batch(datas, out, on_error="return")
    large = {i for i, d in enumerate(datas)
             if jpeg.read_header(d).height > 20 or jpeg.read_header(d).width > 20}
    assert set(errors) == large and large
    assert all("output slot" in errors[i].message for i in large)


def _readonly(shape):
    a = np.zeros(shape, dtype=np.uint8)
    a.setflags(write=False)
    return a


BAD_OUTS = {
    "float32": lambda n: np.zeros((n, 400, 500, 3), dtype=np.float32),
    "3d": lambda n: np.zeros((n, 400, 1500), dtype=np.uint8),
    "too-few-images": lambda n: np.zeros((n - 1, 400, 500, 3), dtype=np.uint8),
    "4-channels": lambda n: np.zeros((n, 400, 500, 4), dtype=np.uint8),
    "not-contiguous": lambda n: np.zeros((n, 800, 500, 3), dtype=np.uint8)[:, ::2],
    "read-only": lambda n: _readonly((n, 400, 500, 3)),
    "list": lambda n: [[0]] * n,
}


@pytest.mark.parametrize("kind", list(BAD_OUTS))
def test_decode_batch_wrong_out(kind):
    datas = _batch()
    with pytest.raises(ConfigError, match="out must be"):
        jpeg.decode_batch(datas, BAD_OUTS[kind](len(datas)))


@pytest.mark.parametrize("kind", ["on_error", "regions-shape", "buffer-list-without-out",
                                  "text-item", "min_size"])
def test_decode_batch_bad_arguments(kind):
    datas = _batch()
    kw = {}
    if kind == "on_error":
        kw["on_error"] = "skip"
    elif kind == "regions-shape":
        kw["regions"] = np.zeros((len(datas) - 1, 4), dtype=np.int64)
    elif kind == "buffer-list-without-out":
        datas = _jpeg.BufferList.from_buffers(datas)
    elif kind == "text-item":
        datas = datas[:2] + ["a file name, not data"]
    elif kind == "min_size":
        kw["min_size"] = (-1, 4)
    with pytest.raises(ConfigError):
        jpeg.decode_batch(datas, **kw)


def test_buffer_list_from_packed_checks_records():
    data = np.frombuffer(case("gray"), dtype=np.uint8)
    with pytest.raises(ValueError, match="outside"):
        _jpeg.BufferList.from_packed(data, np.array([0], np.int64),
                                     np.array([len(data) + 1], np.int64))


# --- broken inputs -------------------------------------------------------------------------------

def _png():
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(jc.photo_sized("coffee", 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _base():
    return case("size-17x9-420")


def _patch(marker, offset, value):
    """The base file with one byte of its first `marker` segment (or SOF) replaced."""
    def make():
        d = _base()
        start = next(s for m, s, _ in jc.segments(d)
                     if m == marker or (marker == "SOF" and m in jc.SOF_MARKERS))
        return jc.patch_byte(d, start + offset, value)
    return make


def _duplicate_sof():
    d = _base()
    start, end = jc.find_segment(d, 0xC0)
    return d[:end] + d[start:end] + d[end:]


def _huge_marker_length():
    d = _base()
    start, _ = jc.find_segment(d, 0xE0)  # APP0 (JFIF) claims 65535 bytes
    return d[:start + 2] + b"\xff\xff" + d[start + 4:]


_NOISE = np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8).tobytes()

BROKEN = {
    # not a JPEG at all
    "empty": lambda: b"",
    "one-byte": lambda: b"\xff",
    "soi-only": lambda: b"\xff\xd8",
    "soi-ff": lambda: b"\xff\xd8\xff",
    "png": _png,
    "text": lambda: b"this is a text file, not an image\n" * 20,
    "zeros": lambda: bytes(1000),
    "noise": lambda: _NOISE,
    "soi-then-zeros": lambda: b"\xff\xd8" + bytes(1000),
    "soi-then-noise": lambda: b"\xff\xd8" + _NOISE,
    # wrong markers and marker contents
    "soi-eoi": lambda: b"\xff\xd8\xff\xd9",
    "eoi-first": lambda: b"\xff\xd8\xff\xd9" + _base()[2:],
    "soi-twice": lambda: b"\xff\xd8" + _base(),
    "unknown-marker": lambda: _base()[:2] + b"\xff\x4f" + _base()[2:],
    "no-sof": lambda: jc.strip_segment(_base(), 0xC0),
    "two-sof": _duplicate_sof,
    "no-sos": lambda: _base()[:jc.find_segment(_base(), jc.SOS)[0]] + b"\xff\xd9",
    "no-dqt": lambda: jc.strip_all(_base(), jc.DQT),
    "header-only": lambda: _base()[:jc.first_scan_data(_base())],
    "sof3-lossless": _patch("SOF", 1, 0xC3),
    "sof-12-bit": _patch("SOF", 4, 12),
    "sof-0-components": _patch("SOF", 9, 0),
    "sof-2-components": _patch("SOF", 9, 2),
    "sof-sampling-0": _patch("SOF", 11, 0x00),
    "sof-sampling-5": _patch("SOF", 11, 0x55),
    "sof-height-0": lambda: jc.patch_size(_base(), 0, 9),
    "sof-65535x65535": lambda: jc.patch_size(_base(), 65535, 65535),
    "sos-bad-component": _patch(jc.SOS, 5, 9),
    "dht-bogus": _patch(jc.DHT, 5, 0xFF),
    "dqt-bad-index": _patch(jc.DQT, 4, 0x0F),
    "marker-length-huge": _huge_marker_length,
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_input_raises_decode_error(name):
    data = BROKEN[name]()
    with pytest.raises(DecodeError) as info:
        jpeg.decode(data)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value.message, str) and info.value.message.strip()
    # The header reader either accepts it (the damage is past the header) or says why not.
    try:
        hdr = jpeg.read_header(data)
    except DecodeError as exc:
        assert exc.message.strip()
    else:
        assert hdr.width > 0 and hdr.height > 0
    # In a batch: the same error for that image, and the next image still decodes.
    out, _, errors = jpeg.decode_batch([data, case("size-17x9-420")],
                                       np.zeros((2, 17, 9, 3), np.uint8), on_error="return")
    assert list(errors) == [0] and errors[0].message == info.value.message
    assert np.array_equal(out[1], full("size-17x9-420"))


TRUNCATED_KINDS = ["small-420", "small-progressive-420", "small-420-rst1", "small-gray",
                   "small-cmyk", "small-arith-420", "small-arith-progressive"]


@pytest.mark.parametrize("percent", range(0, 100, 3))
@pytest.mark.parametrize("name", TRUNCATED_KINDS)
def test_truncated(name, percent):
    needs_arith(name)
    data = case(name)
    cut = len(data) * percent // 100
    short = data[:cut]
    with pytest.raises(DecodeError, match="."):
        jpeg.decode(short)
    with pytest.raises(DecodeError):
        jpeg.decode(short, fast=True, min_size=(10, 10))
    # The header is there once the first SOS header is.
    if cut < jc.first_scan_data(data):
        with pytest.raises(DecodeError):
            jpeg.read_header(short)
    else:
        assert jpeg.read_header(short) == jpeg.read_header(data)
    # A region decode stops early: if the data it needs is all there, its pixels are right
    # (never libjpeg's grey padding); otherwise it is an error.
    try:
        top_left = jpeg.decode(short, region=(0, 0, 16, 16))
    except DecodeError:
        pass
    else:
        assert np.array_equal(top_left, full(name)[:16, :16])


def test_truncated_at_every_byte_of_a_small_file():
    data = case("size-17x9-420")
    for cut in range(len(data)):
        with pytest.raises(DecodeError):
            jpeg.decode(data[:cut])


def test_pixel_budget_from_the_header_alone():
    data = jc.patch_size(case("ycc420-q75"), 60000, 60000)
    # Cut right after the SOS header: the budget error must come before any pixel data.
    header_only = data[:jc.first_scan_data(data)]
    for d in (data, header_only):
        with pytest.raises(DecodeError, match="pixel budget"):
            jpeg.decode(d)
        with pytest.raises(DecodeError, match="pixel budget"):
            jpeg.read_header(d)


def test_max_pixels_boundary():
    data = case("size-17x9-420")
    assert jpeg.decode(data, max_pixels=17 * 9).shape == (17, 9, 3)
    with pytest.raises(DecodeError, match="pixel budget"):
        jpeg.decode(data, max_pixels=17 * 9 - 1)
    with pytest.raises(DecodeError, match="pixel budget"):
        jpeg.read_header(data, max_pixels=17 * 9 - 1)
    with pytest.raises(DecodeError, match="pixel budget"):
        jpeg.decode_batch([data], max_pixels=100)


@pytest.mark.parametrize("name", ["progressive-420", "gray-progressive", "cv-progressive-420-rst3",
                                  "arith-422-progressive"])
def test_scan_limit_boundary(name):
    needs_arith(name)
    data = case(name)
    scans = sum(1 for m, _, _ in jc.segments(data) if m == jc.SOS)
    assert scans > 2
    assert np.array_equal(jpeg.decode(data, max_scans=scans), full(name))
    for kw in ({}, {"region": (0, 0, 1, 1)}, {"min_size": (1, 1)}):
        with pytest.raises(DecodeError, match="scan limit"):
            jpeg.decode(data, max_scans=scans - 1, **kw)
    with pytest.raises(DecodeError, match="scan limit"):
        jpeg.decode(data, max_scans=1)


def test_baseline_file_has_one_scan():
    assert np.array_equal(jpeg.decode(case("medium-420"), max_scans=1), full("medium-420"))


def test_scan_bomb_hits_the_default_scan_limit():
    """A progressive file whose last scan repeats 1200 times (libjpeg reads every copy)."""
    bomb = case("scan-bomb")
    assert sum(1 for m, _, _ in jc.segments(bomb) if m == jc.SOS) > jpeg.DEFAULT_MAX_SCANS
    with pytest.raises(DecodeError, match="scan limit"):
        jpeg.decode(bomb)
    assert "scan limit" in jpeg.decode_batch([bomb], on_error="return")[2][0].message
    # With a larger budget it decodes (each repeat is only a corrupt-data warning)...
    assert jpeg.decode(bomb, max_scans=1300).shape == (40, 56, 3)
    # ...which strict mode turns into an error at the first repeat.
    with pytest.raises(DecodeError, match="progression"):
        jpeg.decode(bomb, strict=True, max_scans=1300)


FLIP_KINDS = ["small-420", "small-progressive-420", "small-420-rst1", "small-gray",
              "small-cmyk", "small-arith-420", "small-arith-progressive"]


@pytest.mark.parametrize("name", FLIP_KINDS)
def test_bit_flips(name, record_property):
    """No checksum in JPEG: a flipped bit gives DecodeError or a correctly-shaped image;
    strict mode turns some of the silently-decoded ones into errors."""
    needs_arith(name)
    data = case(name)
    rng = np.random.default_rng(list(name.encode()))
    scan = jc.first_scan_data(data)
    budget = 4 * full(name).shape[0] * full(name).shape[1]
    counts = {"error": 0, "decoded": 0, "strict-only-error": 0}
    for i in range(150):
        mutant = bytearray(data)
        lo = 2 if i % 2 else scan  # anywhere after SOI, or only in entropy-coded data
        for _ in range(1 + i % 3):
            pos = int(rng.integers(lo, len(data) - 2))
            mutant[pos] ^= 1 << int(rng.integers(0, 8))
        mutant = bytes(mutant)
        try:
            out = jpeg.decode(mutant, max_pixels=budget)
        except DecodeError as exc:
            assert exc.message.strip()
            counts["error"] += 1
            with pytest.raises(DecodeError):
                jpeg.decode(mutant, strict=True, max_pixels=budget)
            continue
        counts["decoded"] += 1
        hdr = jpeg.read_header(mutant)
        assert out.shape == (hdr.height, hdr.width, 3)
        if lo == scan:
            assert out.shape == full(name).shape
        try:
            assert np.array_equal(jpeg.decode(mutant, strict=True, max_pixels=budget), out)
        except DecodeError:
            counts["strict-only-error"] += 1
    record_property("bit_flip_outcomes", counts)
    assert counts["strict-only-error"] > 0, counts


# --- every error path frees its decoder ----------------------------------------------------------

LEAK_CASES = {
    "not-a-jpeg": lambda: jpeg.decode(b"\x89PNG\r\n\x1a\n" + bytes(64)),
    "header-error": lambda: jpeg.read_header(case("size-17x9-420")[:200]),
    "truncated-scan": lambda: jpeg.decode(case("size-16x16-420")[:-40]),
    "pixel-budget": lambda: jpeg.decode(case("size-16x16-420"), max_pixels=100),
    "region-outside": lambda: jpeg.decode(case("size-16x16-420"), region=(0, 0, 17, 1)),
    "scan-limit": lambda: jpeg.decode(case("gray-progressive-small"), max_scans=2),
    "strict-warning": lambda: jpeg.decode(case("gray-progressive-small-bomb"), strict=True),
    "batch": lambda: jpeg.decode_batch([b"xx", case("size-16x16-420")[:-40], b""],
                                       LEAK_OUT, on_error="return"),
}
LEAK_OUT = np.zeros((3, 16, 16, 3), dtype=np.uint8)


@pytest.mark.parametrize("kind", list(LEAK_CASES))
def test_error_paths_do_not_leak(kind):
    fn = LEAK_CASES[kind]
    per_call = 3 if kind == "batch" else 1  # failed decodes per call

    def run(n):
        for _ in range(n // per_call):
            try:
                fn()
            except (DecodeError, ConfigError):
                pass
            else:
                if kind != "batch":
                    raise AssertionError("expected an error")

    run(500)  # warm up allocator pools
    before = rss_bytes()
    run(20_000)
    growth = rss_bytes() - before
    # A leaked libjpeg decompress object is several KB: 20 000 of them would be > 40 MB.
    assert growth < 4 << 20, f"RSS grew by {growth / 2**20:.1f} MiB over 20 000 failed decodes"


# --- bad arguments -------------------------------------------------------------------------------

@pytest.mark.parametrize("region", [
    pytest.param((0, 0, 301, 451), id="taller"), pytest.param((0, 0, 300, 452), id="wider"),
    pytest.param((-1, 0, 1, 1), id="negative-top"),
    pytest.param((0, -1, 1, 1), id="negative-left"),
    pytest.param((300, 0, 1, 1), id="top-at-height"),
    pytest.param((0, 451, 1, 1), id="left-at-width"),
    pytest.param((0, 0, 0, 5), id="zero-height"), pytest.param((0, 0, 5, 0), id="zero-width"),
    pytest.param((10, 10, -5, 5), id="negative-height"),
    pytest.param((299, 450, 2, 2), id="past-bottom-right"),
    pytest.param((1, 2, 3), id="three-values"),
    pytest.param((1, 2, 3, 4, 5), id="five-values"),
    pytest.param("abcd", id="string"),
    pytest.param((None, 0, 1, 1), id="none-value"),
    pytest.param(5, id="int"),
    pytest.param((0, 0, 2**40, 1), id="huge-height"),
    pytest.param((2**31, 0, 1, 1), id="huge-top"),
    pytest.param((0.5, 0, 1, 1), id="float-value"),
    pytest.param(("1", 0, 1, 1), id="string-value"),
])
def test_bad_region(region):
    data = case("ycc420-q75")  # 300 x 451
    with pytest.raises(ConfigError):
        jpeg.decode(data, region=region)


@pytest.mark.parametrize("min_size", [
    pytest.param((1,), id="one-value"), pytest.param((1, 2, 3), id="three-values"),
    pytest.param((-1, 5), id="negative"), pytest.param("ab", id="string"),
    pytest.param(7, id="int"), pytest.param((None, 1), id="none-value"),
    pytest.param((2**40, 1), id="huge"),
])
def test_bad_min_size(min_size):
    with pytest.raises(ConfigError):
        jpeg.decode(case("ycc420-q75"), min_size=min_size)


@pytest.mark.parametrize("data", [
    pytest.param(12345, id="int"), pytest.param(None, id="none"), pytest.param("text", id="str"),
    pytest.param([0xFF, 0xD8], id="list"), pytest.param(3.5, id="float"),
    pytest.param(np.zeros((8, 8), np.uint8)[:, ::2], id="non-contiguous-array"),
])
@pytest.mark.parametrize("fn", [
    pytest.param(jpeg.decode, id="decode"),
    pytest.param(jpeg.read_header, id="read_header"),
])
def test_data_not_bytes_like(fn, data):
    with pytest.raises(ConfigError):
        fn(data)


@pytest.mark.parametrize("kw", [
    pytest.param({"max_pixels": 0}, id="max_pixels-0"),
    pytest.param({"max_pixels": -5}, id="max_pixels-negative"),
    pytest.param({"max_scans": 0}, id="max_scans-0"),
    pytest.param({"max_pixels": 2**70}, id="max_pixels-huge"),
    pytest.param({"max_scans": 2**40}, id="max_scans-huge"),
])
def test_bad_budgets(kw):
    with pytest.raises(ConfigError):
        jpeg.decode(case("gray"), **kw)
