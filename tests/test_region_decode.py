"""dpu_pipe's own region decode (src/dpu_pipe/_idct.h over the entropy decoder of _huffman.h)
against today's region decode over libjpeg-turbo (dpu_pipe._jpeg.decode): the same pixels, bit
for bit, for every sampling layout, grey, odd sizes, boxes on every edge, 1x1 boxes, every DCT
scale, fast on and off, with and without restart markers, on photographs; where it does not
decode itself (streams it leaves to libjpeg-turbo, damaged data) the answer is
libjpeg-turbo's."""

import numpy as np
import pytest

import jpeg_corpus as jc
from dpu_pipe import _huffman, _jpeg, jpeg
from dpu_pipe.errors import ConfigError, DecodeError

MAX_PIXELS = 1 << 28
SUBSAMPLINGS = ["444", "422", "420", "440", "411", "grey"]
SIZES = [(1, 1), (7, 13), (16, 16), (33, 47), (121, 203)]
SCALES = [1, 2, 4, 8]


def _u8(data):
    return np.frombuffer(data, np.uint8)


def _encode(sub, size, quality=87, photo="chelsea"):
    img = jc.photo_sized(photo, *size)
    if sub == "grey":
        return jc.pil_jpeg(np.ascontiguousarray(img[..., 1]), quality=quality)
    return jc.cv_jpeg(img, quality=quality, subsampling=sub)


def _restarts(data, mode):
    return data if mode == "none" else jpeg.transcode(data, restart_interval=mode)


def _libjpeg(data, region, min_h, min_w, fast):
    return _jpeg.decode(_u8(data), region, min_h, min_w, fast, False, MAX_PIXELS, 100)


def assert_same_region(data, region, min_h, min_w, fast, *, expect_own=None):
    """The own decoder's answer (or its libjpeg-turbo fallback) equals today's region decode;
    returns whether the own decoder produced it."""
    ref, ref_scale = _libjpeg(data, region, min_h, min_w, fast)
    got, scale, own = _huffman.decode(_u8(data), region, min_h, min_w, fast, False,
                                      MAX_PIXELS, 100)
    assert scale == ref_scale
    assert got.shape == ref.shape
    if not np.array_equal(got, ref):
        bad = np.argwhere(got != ref)
        raise AssertionError(f"region {region} scale {scale}/8 fast={fast}: {len(bad)} values "
                             f"differ, first at {bad[:4].tolist()}")
    if expect_own is not None:
        assert own == expect_own, (region, scale, fast)
    return own


def _force_scale(h, w, scale):
    """min_h, min_w making choose_scale pick `scale` for an h x w region (when it can)."""
    return max(1, h * scale // 8), max(1, w * scale // 8)


def _edge_boxes(H, W):
    """Boxes touching each edge and corner, 1x1 boxes at the corners and the centre, a row
    and a column, and the whole image (full-resolution pixels: top, left, height, width)."""
    hh, ww = max(1, H // 3), max(1, W // 3)
    boxes = {(0, 0, H, W), (0, 0, 1, 1), (H - 1, W - 1, 1, 1), (0, W - 1, 1, 1),
             (H - 1, 0, 1, 1), (H // 2, W // 2, 1, 1), (0, 0, hh, ww), (H - hh, W - ww, hh, ww),
             (0, W - ww, hh, ww), (H - hh, 0, hh, ww), (H // 3, 0, hh, W), (0, W // 3, H, ww),
             (H - 1, 0, 1, W), (0, W - 1, H, 1)}
    return sorted(boxes)


@pytest.mark.parametrize("restart", ["none", 1])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("sub", SUBSAMPLINGS)
def test_edges_and_scales(sub, size, restart):
    data = _restarts(_encode(sub, size), restart)
    H, W = size
    for box in _edge_boxes(H, W):
        for scale in SCALES:
            min_h, min_w = _force_scale(box[2], box[3], scale)
            for fast in (False, True):
                assert_same_region(data, box, min_h, min_w, fast,
                                   expect_own=True)


@pytest.mark.parametrize("restart", ["none", 1, 3, "row"])
@pytest.mark.parametrize("sub", SUBSAMPLINGS)
def test_random_boxes(sub, restart):
    rng = np.random.default_rng(11)
    data = _restarts(_encode(sub, (149, 211), quality=93, photo="astronaut"), restart)
    own = 0
    for _ in range(80):
        h = int(rng.integers(1, 150))
        w = int(rng.integers(1, 212))
        top, left = int(rng.integers(0, 150 - h)), int(rng.integers(0, 212 - w))
        scale = int(rng.choice(SCALES))
        min_h, min_w = _force_scale(h, w, scale)
        for fast in (False, True):
            own += assert_same_region(data, (top, left, h, w), min_h, min_w, fast,
                                      expect_own=True)
    assert own == 160


@pytest.mark.parametrize("optimize", [False, True], ids=["annex_k_tables", "optimized_tables"])
@pytest.mark.parametrize("quality", [30, 75, 95, 100])
def test_qualities(quality, optimize):
    img = jc.photo_sized("coffee", 97, 131)
    data = jpeg.transcode(jc.pil_jpeg(img, quality=quality, optimize=optimize),
                          restart_interval=1)
    for scale in SCALES:
        assert_same_region(data, (5, 9, 80, 100), *_force_scale(80, 100, scale), False,
                           expect_own=True)


def test_colour_conversion_of_every_chroma_pair():
    """Flat 8x8 blocks at quality 100 (every quantizer 1) decode to their exact Y, Cb, Cr, so
    one 4:4:4 image covers the RGB conversion of all 65,536 (Cb, Cr) pairs, at two lumas."""
    from PIL import Image
    import io

    cb, cr = np.meshgrid(np.arange(256, dtype=np.uint8), np.arange(256, dtype=np.uint8))
    for luma in (40, 200):
        ycc = np.stack([np.full_like(cb, luma), cb, cr], -1)
        ycc = np.repeat(np.repeat(ycc, 8, 0), 8, 1)
        buf = io.BytesIO()
        Image.fromarray(ycc, "YCbCr").save(buf, "JPEG", quality=100, subsampling=0)
        data = buf.getvalue()
        assert assert_same_region(data, None, 0, 0, False, expect_own=True)


def test_rgb_and_adobe_colour_spaces():
    """Three-component streams libjpeg-turbo reads as RGB (Adobe transform 0) are copied, not
    converted; a transform it warns about is left to it."""
    img = jc.photo_sized("chelsea", 40, 56)
    data = jc.pil_jpeg(img, quality=90, subsampling="444")
    data = jc.strip_segment(data, 0xE0)                  # no JFIF: the Adobe marker decides
    rgb = jc.insert_adobe(data, 0)
    assert_same_region(rgb, (3, 5, 20, 30), 20, 30, False, expect_own=True)
    odd = jc.insert_adobe(data, 2)
    assert assert_same_region(odd, (3, 5, 20, 30), 20, 30, False) is False


def test_box_outside_the_scaled_image():
    data = _encode("420", (33, 47))
    with pytest.raises(ConfigError, match="not inside"):
        _huffman.decode_box(_u8(data), (0, 0, 34, 47), 8)
    with pytest.raises(ConfigError, match="not inside"):
        _huffman.decode_box(_u8(data), (5, 0, 1, 1), 1)     # the 1/8 image is 5 x 6
    with pytest.raises(ConfigError, match="DCT scale"):
        _huffman.decode_box(_u8(data), (0, 0, 1, 1), 3)


def test_streams_left_to_libjpeg():
    img = jc.photo_sized("coffee", 40, 56)
    prog = jc.pil_jpeg(img, progressive=True)
    assert _huffman.decode_box(_u8(prog), (0, 0, 8, 8), 8) is None
    assert assert_same_region(prog, (1, 2, 30, 40), 30, 40, False) is False
    big = _encode("420", (33, 47))
    assert _huffman.decode_box(_u8(big), (0, 0, 8, 8), 8, max_pixels=33 * 47 - 1) is None


@pytest.mark.parametrize("restart", [1, "none"])
def test_damaged_data_raises_or_matches_libjpeg(restart):
    """Random byte damage: the own decoder either hands over to libjpeg-turbo (which decodes or
    raises DecodeError) or returns exactly what libjpeg-turbo returns."""
    rng = np.random.default_rng(3)
    base = _restarts(_encode("420", (64, 80), quality=90), restart)
    start = _huffman.header(_u8(base))["scan_start"]
    outcomes = set()
    for _ in range(150):
        data = bytearray(base)
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(start, len(data) - 2))] = int(rng.integers(0, 256))
        data = bytes(data)
        box = (int(rng.integers(0, 40)), int(rng.integers(0, 50)), 20, 24)
        try:
            ref, _ = _libjpeg(data, box, 20, 24, False)
        except DecodeError:
            ref = None
        try:
            got, _, own = _huffman.decode(_u8(data), box, 20, 24, False, False, MAX_PIXELS, 100)
        except DecodeError:
            assert ref is None
            outcomes.add("raised")
            continue
        if ref is not None:
            np.testing.assert_array_equal(got, ref)
            outcomes.add("own" if own else "libjpeg")
        else:
            # libjpeg-turbo's sub-stream took an interval the own decoder did not need.
            assert own
            outcomes.add("own-where-libjpeg-raised")
    assert outcomes & {"libjpeg", "raised"}     # the damage was seen, and handed over


def _photo_records(tmp_path, n):
    from dpu_pipe.tools.sample_data import dataset_files, make_imagenet_like

    make_imagenet_like(tmp_path, n=n, classes=4, seed=5)
    paths, _ = dataset_files(tmp_path)
    out = []
    for p in paths:
        data = p.read_bytes()
        out.append(data)
        try:
            out.append(jpeg.transcode(data, restart_interval=1))   # as a pack stores it
        except Exception:
            pass
    return out


def _photo_boxes(data, rng, n, max_area):
    """RandomResizedCrop-like boxes (area fraction up to max_area, aspect 3/4..4/3) with an
    output size of 224, 112, 56, 28 or 1 pixels, so that every DCT scale occurs."""
    W, H = _jpeg.read_header(_u8(data), MAX_PIXELS, 100)[:2]
    for _ in range(n):
        area = rng.uniform(0.002, max_area) * W * H
        ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        bw = int(min(W, max(1, round(np.sqrt(area * ratio)))))
        bh = int(min(H, max(1, round(np.sqrt(area / ratio)))))
        top, left = int(rng.integers(0, H - bh + 1)), int(rng.integers(0, W - bw + 1))
        size = int(rng.choice([224, 112, 56, 28, 1]))
        yield (top, left, bh, bw), min(size, bh), min(size, bw)


def _scaled_box(box, scale, H, W):
    """dpu_pipe._jpeg.scale_region: the scaled image's pixels covering a full-size box."""
    top, left, h, w = box
    sh, sw = -(-H * scale // 8), -(-W * scale // 8)
    r0, c0 = top * scale // 8, left * scale // 8
    return r0, c0, min(-(-(top + h) * scale // 8), sh) - r0, min(-(-(left + w) * scale // 8), sw) - c0


def _check_photos(tmp_path, n_files, boxes_per_record, max_area, every):
    """Each box's own decode against the slice of libjpeg-turbo's whole decode at its scale,
    and every `every`-th box also against today's region decode of it (itself the slice)."""
    rng = np.random.default_rng(17)
    checked = own = 0
    for data in _photo_records(tmp_path, n_files):
        W, H = _jpeg.read_header(_u8(data), MAX_PIXELS, 100)[:2]
        whole = {}
        for k, (box, min_h, min_w) in enumerate(_photo_boxes(data, rng, boxes_per_record,
                                                            max_area)):
            for fast in (False, True):
                got, scale, by_own = _huffman.decode(_u8(data), box, min_h, min_w, fast, False,
                                                     MAX_PIXELS, 100)
                if (scale, fast) not in whole:
                    whole[scale, fast], s = _libjpeg(data, None, H * scale // 8,
                                                     W * scale // 8, fast)
                    assert s == scale
                t, l, h, w = _scaled_box(box, scale, H, W)
                np.testing.assert_array_equal(got, whole[scale, fast][t:t + h, l:l + w],
                                              err_msg=f"box {box} scale {scale} fast {fast}")
                if k % every == 0:
                    assert_same_region(data, box, min_h, min_w, fast)
                own += by_own
                checked += 1
    return checked, own


def test_photographs(tmp_path):
    checked, own = _check_photos(tmp_path, 6, 12, 1.0, 1)
    assert own >= checked * 3 // 4       # the progressive originals are libjpeg-turbo's


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_photographs_dense(tmp_path):
    """At least 30,000 boxes on ImageNet-like files from real photographs, original and
    transcoded with a restart marker every MCU, fast on and off."""
    checked, own = _check_photos(tmp_path, 60, 130, 0.3, 10)
    assert checked >= 30_000
    assert own >= checked * 3 // 4
