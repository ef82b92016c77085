"""dpu_pipe's own baseline Huffman entropy decoder (src/dpu_pipe/_huffman.h) against
libjpeg-turbo's jpeg_read_coefficients (tests/kernels/_coef_probe.pyx): the same quantized DCT
coefficients, block for block, for every sampling layout, odd size, grey, with and without
restart markers, for whole images and for MCU rectangles read from the covering restart
intervals; damaged data either raises DecodeError or decodes exactly as libjpeg-turbo decodes
it without a warning."""

import numpy as np
import pytest

import jpeg_corpus as jc
import kernel_probes
from dpu_pipe import _huffman
from dpu_pipe import jpeg
from dpu_pipe.errors import ConfigError, DecodeError

SUBSAMPLINGS = ["444", "422", "420", "440", "411"]
SIZES = [(1, 1), (7, 13), (16, 16), (33, 47), (121, 203)]


@pytest.fixture(scope="module")
def probe():
    return kernel_probes.load("_coef_probe")


def _u8(data):
    return np.frombuffer(data, np.uint8)


def _reference(probe, data):
    arrays, own, warnings, message = probe.coefficients(_u8(data))
    assert warnings == 0, message
    return arrays, own


def assert_same_coefficients(probe, data):
    """Whole-image coefficients equal libjpeg-turbo's; returns them."""
    ref, own = _reference(probe, data)
    got = _huffman.read_coefficients(_u8(data))
    assert got is not None, "decoder refused a baseline Huffman stream"
    assert len(got) == len(ref)
    for ci, (a, b, (rows, cols)) in enumerate(zip(got, ref, own)):
        if len(ref) == 1:
            # A single-component scan codes only the component's own blocks; libjpeg's array
            # keeps zero padding to the sampling factors beyond them.
            b = b[:rows, :cols]
        assert a.shape == b.shape, (ci, a.shape, b.shape)
        np.testing.assert_array_equal(a, b, err_msg=f"component {ci}")
    return got


def _restarts(data, mode):
    if mode == "none":
        return data
    return jpeg.transcode(data, restart_interval=mode)


@pytest.mark.parametrize("restart", ["none", 1, 5, "row"])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("sub", SUBSAMPLINGS)
def test_coefficients_equal_libjpeg(probe, sub, size, restart):
    img = jc.photo_sized("chelsea", *size)
    data = _restarts(jc.cv_jpeg(img, quality=87, subsampling=sub), restart)
    assert_same_coefficients(probe, data)


@pytest.mark.parametrize("restart", ["none", 1, 3])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_grey_coefficients_equal_libjpeg(probe, size, restart):
    img = np.ascontiguousarray(jc.photo_sized("coffee", *size)[..., 1])
    data = _restarts(jc.pil_jpeg(img, quality=91), restart)
    assert _huffman.header(_u8(data))["components"][0][1:3] == (1, 1)
    assert_same_coefficients(probe, data)


@pytest.mark.parametrize("optimize", [False, True], ids=["annex_k_tables", "optimized_tables"])
@pytest.mark.parametrize("quality", [30, 75, 95, 100])
def test_tables_and_qualities(probe, quality, optimize):
    img = jc.photo_sized("astronaut", 97, 131)
    assert_same_coefficients(probe, jc.pil_jpeg(img, quality=quality, optimize=optimize))


def test_encoder_restart_markers(probe):
    # Restart intervals written by the encoder itself, not dividing an MCU row.
    img = jc.photo_sized("coffee", 150, 211)
    for n in (1, 2, 7, 100):
        data = jc.cv_jpeg(img, quality=80, subsampling="420", restart=n)
        assert _huffman.header(_u8(data))["restart_interval"] == n
        assert_same_coefficients(probe, data)


def _random_rects(rng, mcuy, mcux, n):
    for _ in range(n):
        r0 = int(rng.integers(0, mcuy))
        c0 = int(rng.integers(0, mcux))
        yield r0, int(rng.integers(r0 + 1, mcuy + 1)), c0, int(rng.integers(c0 + 1, mcux + 1))


@pytest.mark.parametrize("restart", ["none", 1, 4, "row"])
@pytest.mark.parametrize("sub", ["444", "422", "420", "grey"])
def test_rectangles_are_slices_of_the_whole(probe, sub, restart):
    """An MCU rectangle read from the covering intervals (or the scan up to its last MCU) is
    the slice of the whole image's coefficients, including rectangles on every edge and single
    MCUs."""
    img = jc.photo_sized("rocket", 101, 163)
    if sub == "grey":
        data = jc.pil_jpeg(np.ascontiguousarray(img[..., 0]), quality=88)
    else:
        data = jc.cv_jpeg(img, quality=88, subsampling=sub)
    data = _restarts(data, restart)
    whole = assert_same_coefficients(probe, data)
    h = _huffman.header(_u8(data))
    mcuy, mcux = h["mcus"]
    comps = [(1, 1)] if len(whole) == 1 else [c[1:3] for c in h["components"]]
    rng = np.random.default_rng(7)
    rects = list(_random_rects(rng, mcuy, mcux, 60))
    rects += [(0, 1, 0, 1), (mcuy - 1, mcuy, mcux - 1, mcux), (0, mcuy, mcux - 1, mcux),
              (mcuy - 1, mcuy, 0, mcux), (0, 1, 0, mcux), (0, mcuy, 0, 1)]
    for r0, r1, c0, c1 in rects:
        got = _huffman.read_coefficients(_u8(data), (r0, r1, c0, c1))
        for a, full, (hh, vv) in zip(got, whole, comps):
            np.testing.assert_array_equal(a, full[r0 * vv:r1 * vv, c0 * hh:c1 * hh],
                                          err_msg=f"rect {(r0, r1, c0, c1)}")


def test_rectangle_outside_the_image():
    data = jc.pil_jpeg(jc.photo_sized("coffee", 40, 40))
    for rect in [(0, 4, 0, 4), (1, 1, 0, 1), (-1, 1, 0, 1), (0, 1, 2, 1)]:
        with pytest.raises(ConfigError, match="not inside"):
            _huffman.read_coefficients(_u8(data), rect)


def test_streams_it_does_not_take():
    img = jc.photo_sized("coffee", 40, 56)
    assert _huffman.read_coefficients(_u8(jc.pil_jpeg(img, progressive=True))) is None
    assert _huffman.header(_u8(jc.pil_jpeg(img, progressive=True))) is None
    try:
        arith = jc.to_arithmetic(jc.pil_jpeg(img))
    except jc.ToolUnavailable:
        arith = None
    if arith is not None:
        assert _huffman.read_coefficients(_u8(arith)) is None
    # CMYK (4 components): libjpeg-turbo's path.
    assert _huffman.read_coefficients(_u8(jc.pil_jpeg(img, mode="CMYK"))) is None


@pytest.mark.parametrize("restart", ["none", 1])
def test_truncated_stream_raises(probe, restart):
    data = _restarts(jc.pil_jpeg(jc.photo_sized("astronaut", 64, 96), quality=90), restart)
    start = _huffman.header(_u8(data))["scan_start"]
    for cut in (start + 1, (start + len(data)) // 2, len(data) - 40):
        with pytest.raises(DecodeError):
            _huffman.read_coefficients(_u8(data[:cut]))
    with pytest.raises(DecodeError):
        _huffman.read_coefficients(_u8(data[:start - 3]))


@pytest.mark.parametrize("restart", ["none", 1, "row"])
def test_damaged_data_raises_or_matches_libjpeg(probe, restart):
    """Random byte changes in the entropy-coded data: the decoder either raises DecodeError
    (the caller then falls back to libjpeg-turbo) or returns exactly what libjpeg-turbo reads
    with no corrupt-data warning."""
    data = _restarts(jc.cv_jpeg(jc.photo_sized("chelsea", 48, 64), quality=85), restart)
    start = _huffman.header(_u8(data))["scan_start"]
    rng = np.random.default_rng(11)
    decoded = raised = 0
    for _ in range(300):
        bad = bytearray(data)
        for _ in range(int(rng.integers(1, 4))):
            bad[int(rng.integers(start, len(data) - 2))] = int(rng.integers(0, 256))
        bad = bytes(bad)
        try:
            got = _huffman.read_coefficients(_u8(bad))
        except DecodeError:
            raised += 1
            continue
        decoded += 1
        ref, own, warnings, message = probe.coefficients(_u8(bad))
        assert warnings == 0, message
        for a, b in zip(got, ref):
            np.testing.assert_array_equal(a, b)
    assert decoded and raised


LANES = [1, 2, 3, 4, 6, 8]


@pytest.mark.parametrize("restart", ["none", 1, 3, "row"])
@pytest.mark.parametrize("sub", ["444", "420", "411", "grey"])
def test_interleaved_lanes_give_the_same_coefficients(probe, sub, restart):
    """Any number of restart intervals decoded interleaved: libjpeg-turbo's coefficients for
    the whole image, the slices for rectangles (edges, single MCUs, random)."""
    img = jc.photo_sized("chelsea", 83, 149)
    if sub == "grey":
        data = jc.pil_jpeg(np.ascontiguousarray(img[..., 2]), quality=90)
    else:
        data = jc.cv_jpeg(img, quality=90, subsampling=sub)
    data = _restarts(data, restart)
    whole = assert_same_coefficients(probe, data)
    h = _huffman.header(_u8(data))
    mcuy, mcux = h["mcus"]
    comps = [(1, 1)] if len(whole) == 1 else [c[1:3] for c in h["components"]]
    rects = list(_random_rects(np.random.default_rng(3), mcuy, mcux, 12))
    rects += [(0, 1, 0, 1), (mcuy - 1, mcuy, mcux - 1, mcux), (0, mcuy, 0, mcux)]
    for lanes in LANES:
        for r0, r1, c0, c1 in rects:
            got = _huffman.read_coefficients(_u8(data), (r0, r1, c0, c1), lanes=lanes)
            for a, full, (hh, vv) in zip(got, whole, comps):
                np.testing.assert_array_equal(a, full[r0 * vv:r1 * vv, c0 * hh:c1 * hh],
                                              err_msg=f"lanes {lanes} rect {(r0, r1, c0, c1)}")


@pytest.mark.parametrize("restart", ["none", 1])
def test_interleaved_lanes_detect_damage(restart):
    """A truncated stream, or one with a restart marker out of its order, is DecodeError
    with every lane count (each interval's end is a hard bound)."""
    data = _restarts(jc.pil_jpeg(jc.photo_sized("astronaut", 64, 96), quality=90), restart)
    start = _huffman.header(_u8(data))["scan_start"]
    for lanes in LANES:
        for cut in (start + 1, (start + len(data)) // 2, len(data) - 40):
            with pytest.raises(DecodeError):
                _huffman.read_coefficients(_u8(data[:cut]), lanes=lanes)
    if restart == 1:
        at = data.index(b"\xff\xd3", start)
        bad = data[:at] + b"\xff\xd5" + data[at + 2:]
        for lanes in LANES:
            with pytest.raises(DecodeError):
                _huffman.read_coefficients(_u8(bad), lanes=lanes)
    with pytest.raises(ConfigError, match="lanes"):
        _huffman.read_coefficients(_u8(data), lanes=0)
    with pytest.raises(ConfigError, match="lanes"):
        _huffman.read_coefficients(_u8(data), lanes=9)


def test_batch_of_images_interleaved(probe):
    """Several images' rectangles decoded in one thread, their scans interleaved: each equals
    its own read_coefficients (so libjpeg-turbo's), streams the decoder does not take are
    None, and a damaged image raises naming its position."""
    imgs = [jc.cv_jpeg(jc.photo_sized(jc.PHOTOS[i % 3], 40 + 13 * i, 70 - 5 * i),
                       quality=70 + 3 * i, subsampling=("420", "444", "422")[i % 3])
            for i in range(7)]
    imgs[2] = jpeg.transcode(imgs[2], restart_interval=1)
    imgs[4] = jc.pil_jpeg(jc.photo_sized("coffee", 40, 56), progressive=True)
    datas = [_u8(d) for d in imgs]
    rects = []
    for i, d in enumerate(datas):
        h = _huffman.header(d)
        if h is None:
            rects.append(None)
            continue
        mcuy, mcux = h["mcus"]
        rects.append(None if i == 0 else (mcuy // 3, mcuy, mcux // 4, mcux - mcux // 4))
    want = [_huffman.read_coefficients(d, r, lanes=1) for d, r in zip(datas, rects)]
    assert want[4] is None and all(w is not None for i, w in enumerate(want) if i != 4)
    for lanes in LANES:
        got = _huffman.read_coefficients_batch(datas, rects, lanes=lanes)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if w is None:
                assert g is None
                continue
            for a, b in zip(g, w):
                np.testing.assert_array_equal(a, b)
    start = _huffman.header(datas[5])["scan_start"]
    cut = list(datas)
    cut[5] = _u8(imgs[5][:start + 30])
    for lanes in (1, 4):
        with pytest.raises(DecodeError, match="image 5"):
            _huffman.read_coefficients_batch(cut, rects, lanes=lanes)
    with pytest.raises(ConfigError):
        _huffman.read_coefficients_batch(datas, rects[:3])


@pytest.mark.slow
def test_imagenet_like_photographs(probe, tmp_path):
    """Real-photo ImageNet-like files (sizes, qualities, 4:2:0/4:2:2/4:4:4, grey, progressive
    mix), as they are and transcoded as a pack transcodes them."""
    from dpu_pipe.tools.sample_data import dataset_files, make_imagenet_like

    make_imagenet_like(tmp_path, n=48, classes=4, seed=5)
    paths, _ = dataset_files(tmp_path)
    taken = 0
    for p in paths:
        data = p.read_bytes()
        if _huffman.header(_u8(data)) is not None:
            assert_same_coefficients(probe, data)
            taken += 1
        assert_same_coefficients(probe, jpeg.transcode(data, restart_interval=1))
    assert taken >= len(paths) // 2
