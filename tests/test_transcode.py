"""Lossless transcoding to baseline Huffman with restart markers, and the region decode that reads
only the restart intervals covering a region.

The reference is the original file's own decode (itself checked against Pillow in
test_jpeg.py): a transcoded file decodes to the same pixels, whole, by region, at every DCT
scale and in fast mode; its region decode, which assembles the covering intervals into a
sub-stream, equals the plain region decode of the original bit for bit; damaged streams take the
plain path and behave exactly as they do without the assembly.
"""

import io
import pickle
import struct

import numpy as np
import pytest

from dpu_pipe import ConfigError, DecodeError, _jpeg, _pipeline, jpeg
from dpu_pipe.kernel import BatchProcessor
from dpu_pipe.errors import ProducerError, TranscodeUnsupported
from dpu_pipe.transforms import TransformConfig

import jpeg_corpus as jc
import test_jpeg as tj
from helpers import rss_bytes

pytestmark = pytest.mark.timeout(120)
BUDGET = (jpeg.DEFAULT_MAX_PIXELS, jpeg.DEFAULT_MAX_SCANS)
RST = tuple(range(0xD0, 0xD8))


def transcoded(name, interval=1, optimize=True):
    return _transcoded(name, interval, optimize)


_CACHE = {}


def _transcoded(name, interval, optimize):
    key = (name, interval, optimize)
    if key not in _CACHE:
        _CACHE[key] = jpeg.transcode(tj.case(name), restart_interval=interval, optimize=optimize)
    return _CACHE[key]


def region_decode(data, region, min_size=None, fast=False, strict=False, intervals=True):
    """(pixels, whether the covering intervals were assembled) of one region decode."""
    min_h, min_w = (0, 0) if min_size is None else min_size
    out, _, assembled = _jpeg.decode(data, region, min_h, min_w, fast, strict, *BUDGET,
                                     intervals, True)
    return out, assembled


def restart_markers(data):
    """(DRI interval, [RST codes in order]) of a single-scan stream."""
    dri = jc.find_segment(data, jc.DRI)
    interval = struct.unpack(">H", data[dri[0] + 4:dri[0] + 6])[0] if dri else 0
    start = jc.first_scan_data(data)
    codes = [data[i + 1] for i in range(start, len(data) - 1)
             if data[i] == 0xFF and data[i + 1] in RST]
    return interval, codes


# --- transcode: the same coefficients, so the same pixels ---------------------------------------

TRANSCODE_CASES = [n for n in tj.CASES if not n.startswith("size-") or n.endswith(("-420", "-gray"))]


@pytest.mark.parametrize("name", TRANSCODE_CASES)
def test_transcode_decodes_identically(name):
    tj.needs_arith(name)
    data = tj.case(name)
    t = transcoded(name)
    hdr, thdr = jpeg.read_header(data), jpeg.read_header(t)
    assert thdr._replace(progressive=False) == hdr._replace(progressive=False)
    assert not thdr.progressive
    assert np.array_equal(jpeg.decode(t), tj.full(name))
    assert np.array_equal(jpeg.decode(t, fast=True), tj.full(name, True))
    # One scan (baseline, SOF0 or SOF1 for 16-bit quantization tables), a restart marker
    # after every MCU, numbered 0..7 in turn.
    segs = jc.segments(t)
    assert sum(m == jc.SOS for m, _, _ in segs) == 1
    assert {m for m, _, _ in segs} & jc.SOF_MARKERS <= {0xC0, 0xC1}
    interval, codes = restart_markers(t)
    my, mx = (8, 8) if hdr.components == 1 else jc.imcu_size(data)
    mcus = -(-hdr.height // my) * -(-hdr.width // mx)
    assert interval == 1 and codes == [0xD0 + i % 8 for i in range(mcus - 1)]


@pytest.mark.parametrize("scale", [1, 2, 4])
@pytest.mark.parametrize("name", ["ycc420-q75", "ycc422-q50", "progressive-444", "cv-411",
                                  "cv-440", "gray-progressive", "cmyk-adobe", "ycck-adobe",
                                  "size-17x9-420"])
def test_transcode_scaled_decode_identical(name, scale):
    h, w = tj.full(name).shape[:2]
    ms = tj.min_size_for_scale(h, w, scale)
    assert np.array_equal(jpeg.decode(transcoded(name), min_size=ms),
                          jpeg.decode(tj.case(name), min_size=ms))


@pytest.mark.parametrize("interval", [2, 4, 7, "row", 65535])
@pytest.mark.parametrize("optimize", [True, False], ids=["optimized", "standard-tables"])
def test_transcode_options(interval, optimize):
    name = "medium-420"
    t = transcoded(name, interval, optimize)
    assert np.array_equal(jpeg.decode(t), tj.full(name))
    dri, codes = restart_markers(t)
    mpr = -(-229 // 16), -(-331 // 16)
    assert dri == (mpr[1] if interval == "row" else interval)
    assert len(codes) == -(-mpr[0] * mpr[1] // dri) - 1
    # Standard tables are the JPEG spec's (Annex K): the DHT segments are their fixed size.
    dht = sum(e - s for m, s, e in jc.segments(t) if m == jc.DHT)
    assert (dht == 2 * (4 + 17 + 12) + 2 * (4 + 17 + 162)) != optimize


def test_optimized_tables_are_smaller():
    for name in ("ycc420-q75", "ycc444-q95", "progressive-420"):
        assert len(transcoded(name, 4, True)) < len(transcoded(name, 4, False))


def _with_metadata():
    from PIL import Image

    im = Image.fromarray(jc.photo_sized("coffee", 64, 80))
    exif = Image.Exif()
    exif[0x010F] = "dpu_pipe test camera"
    icc = b"\0\0\2\30" + bytes(range(256)) * 2
    buf = io.BytesIO()
    im.save(buf, format="JPEG", exif=exif.tobytes(), icc_profile=icc, comment=b"a comment")
    return buf.getvalue()


def _payloads(data, marker):
    return [data[s + 4:e] for m, s, e in jc.segments(data) if m == marker]


def test_transcode_copies_metadata_markers():
    data = _with_metadata()
    t = jpeg.transcode(data)
    for marker in (0xE1, 0xE2, 0xFE):       # EXIF, ICC profile, comment
        assert _payloads(t, marker) == _payloads(data, marker) != []
    assert len(_payloads(t, 0xE0)) == 1     # one JFIF APP0, libjpeg's own
    bare = jpeg.transcode(data, copy_markers=False)
    assert all(not _payloads(bare, m) for m in (0xE1, 0xE2, 0xFE))
    for d in (t, bare):
        assert np.array_equal(jpeg.decode(d), jpeg.decode(data))


@pytest.mark.parametrize("name", ["cmyk-adobe", "cmyk-no-adobe", "ycck-adobe", "rgb-adobe"])
def test_transcode_keeps_the_colour_space(name):
    assert jpeg.read_header(transcoded(name)).colorspace == jpeg.read_header(tj.case(name)).colorspace


# --- what transcode refuses ----------------------------------------------------------------------

def _truncated():
    d = tj.case("small-420")
    return d[:len(d) * 2 // 3]


def _garbage_before_eoi():
    d = tj.case("small-420")
    return d[:-2] + b"\x12\x34" * 32 + d[-2:]


UNSUPPORTED = {
    "truncated": _truncated,
    "truncated-progressive": lambda: tj.case("small-progressive-420")[:-300],
    "extraneous-bytes": _garbage_before_eoi,
    "scan-bomb": lambda: tj.case("gray-progressive-small-bomb"),
}


@pytest.mark.parametrize("kind", list(UNSUPPORTED))
def test_transcode_unsupported_keeps_damaged_files(kind):
    """Files libjpeg reads only with a warning stay as they are: rewriting them would turn the
    decoder's repair into data, and strict mode would stop seeing the damage."""
    data = UNSUPPORTED[kind]()
    with pytest.raises(TranscodeUnsupported) as info:
        jpeg.transcode(data)
    assert isinstance(info.value, DecodeError) and info.value.message.strip()
    if kind != "extraneous-bytes":      # the decoder stops before the bytes after the scan
        with pytest.raises(DecodeError):
            jpeg.decode(data, strict=True)


def test_transcode_arithmetic():
    data = tj.case("arith-420")
    if not tj.ARITH_DECODING:
        with pytest.raises(TranscodeUnsupported, match="rithmetic"):
            jpeg.transcode(data)
        return
    assert np.array_equal(jpeg.decode(jpeg.transcode(data)), tj.full("ycc420-q75"))


@pytest.mark.parametrize("name", ["empty", "png", "soi-eoi", "no-sof", "no-sos", "no-dqt",
                                  "header-only", "sof3-lossless", "sof-12-bit",
                                  "sof-2-components", "sos-bad-component", "dht-bogus",
                                  "sof-65535x65535"])
def test_transcode_undecodable_raises_decode_error(name):
    data = tj.BROKEN[name]()
    with pytest.raises(DecodeError) as info:
        jpeg.transcode(data)
    assert info.value.message.strip()
    with pytest.raises(DecodeError):
        jpeg.decode(data)


def test_transcode_budgets_and_arguments():
    data = tj.case("size-17x9-420")
    with pytest.raises(DecodeError, match="pixel budget"):
        jpeg.transcode(data, max_pixels=17 * 9 - 1)
    prog = tj.case("progressive-420")
    with pytest.raises(DecodeError, match="scan limit"):
        jpeg.transcode(prog, max_scans=2)
    for bad in (0, -1, 65536, 1.5, "rows", None, True):
        with pytest.raises(ConfigError):
            jpeg.transcode(data, restart_interval=bad)
    with pytest.raises(ConfigError):
        jpeg.transcode("not bytes")


# --- region decode from the covering restart intervals -------------------------------------------

# (corpus image, restart intervals): every sampling layout, odd sizes, widths that are not a
# multiple of the MCU, progressive and CMYK sources, and files with the encoder's own markers.
GRID = [("medium-420", (1, 2, "row", 3)), ("medium-422", (1, 4)), ("medium-444", (1, 3)),
        ("medium-440", (1,)), ("medium-411-rst2", (1, 2)), ("medium-gray", (1, 2, "row")),
        ("medium-progressive-420", (1,)), ("medium-cmyk", (1,)), ("size-17x9-422", (1,)),
        ("size-3x4000-420", (1, 2)), ("size-4000x3-420", (1, "row"))]
GRID_IDS = [f"{n}-{i}" for n, ivs in GRID for i in ivs]
MIN_SIZES = [None, (224, 224), (56, 56), (16, 16)]


def _grid_regions(name, h, w):
    data = tj.case(name)
    rng = np.random.default_rng([h, w, 7])
    boxes = []
    for group in tj.REGION_GROUPS:
        boxes += tj._regions(group, h, w, jc.imcu_size(data), rng)[::2]
    return boxes


@pytest.mark.parametrize("fast", [False, True], ids=["accurate", "fast"])
@pytest.mark.parametrize("name, interval", [(n, i) for n, ivs in GRID for i in ivs],
                         ids=GRID_IDS)
def test_interval_region_decode_is_bit_identical(name, interval, fast):
    data, t = tj.case(name), transcoded(name, interval)
    h, w = tj.full(name).shape[:2]
    bad, assembled, total = [], 0, 0
    for box in _grid_regions(name, h, w):
        for ms in MIN_SIZES:
            want, _ = region_decode(data, box, ms, fast, intervals=False)
            got, used = region_decode(t, box, ms, fast)
            total += 1
            assembled += used
            if got.shape != want.shape or not np.array_equal(got, want):
                bad.append((box, ms, got.shape, want.shape))
    assert not bad, f"{len(bad)} of {total} region decodes differ, e.g. {bad[:4]}"
    # Boxes away from the top-left corner are read from the covering intervals (a box whose
    # intervals start at the first MCU row and span every column reads no less either way).
    assert assembled >= total // 3 if min(h, w) > 16 else True, (assembled, total)


def test_plain_and_interval_paths_agree_on_encoder_restart_markers():
    """Any baseline file with a DRI, not only transcoded ones: OpenCV's restart markers."""
    for name in ("cv-420-rst1", "cv-444-rst1", "cv-411-rst1", "medium-420-rst1",
                 "cv-420-rst7"):
        data = tj.case(name)
        h, w = tj.full(name).shape[:2]
        used_any = False
        for box in _grid_regions(name, h, w)[:60]:
            got, used = region_decode(data, box)
            want, _ = region_decode(data, box, intervals=False)
            used_any |= used
            assert np.array_equal(got, want), (name, box)
        assert used_any, name


def test_whole_image_and_top_rows_use_the_plain_decode():
    t = transcoded("medium-420")
    assert not region_decode(t, (0, 0, 229, 331))[1]
    assert not region_decode(t, (0, 0, 20, 331))[1]
    assert region_decode(t, (0, 100, 20, 50))[1]        # columns skipped
    assert region_decode(t, (100, 0, 20, 331))[1]       # rows above skipped


def test_assembled_sub_stream_is_a_small_valid_jpeg():
    name = "medium-420"
    t = transcoded(name)
    box = (120, 150, 40, 60)
    sub, (top, left, rh, rw), scale, origin = _jpeg.assemble(t, box, 0, 0)
    assert scale == 8 and len(sub) < len(t) // 3
    hdr = jpeg.read_header(sub)
    # MCU rows 7..10 and columns 9..13: those of the box and two pixels around it.
    assert (hdr.height, hdr.width) == (4 * 16, 5 * 16)
    assert (top, left) == (120 - 7 * 16, 150 - 9 * 16) and origin == (7 * 16, 9 * 16)
    assert np.array_equal(jpeg.decode(sub)[top:top + rh, left:left + rw],
                          tj.full(name)[120:160, 150:210])
    # Metadata segments are not copied into the sub-stream.
    meta = jpeg.transcode(_with_metadata())
    sub = _jpeg.assemble(meta, (40, 40, 8, 8), 0, 0)[0]
    assert all(not _payloads(sub, m) for m in (0xE1, 0xE2, 0xFE))


# --- untrusted streams: any inconsistency takes the plain path ----------------------------------

def _scan_markers(data):
    start = jc.first_scan_data(data)
    return [i for i in range(start, len(data) - 1) if data[i] == 0xFF and data[i + 1] in RST]


def _same_outcome(data, box, **kw):
    """The assembled and the plain region decode agree: same pixels, or both DecodeError.
    Returns whether the sub-stream was used."""
    try:
        want, _ = region_decode(data, box, intervals=False, **kw)
    except ValueError:
        want = None
    try:
        got, used = region_decode(data, box, **kw)
    except ValueError:
        got, used = None, False
    assert (got is None) == (want is None), box
    assert got is None or np.array_equal(got, want), box
    return used


def _damaged(base):
    t = transcoded(base)
    rst = _scan_markers(t)
    mid = rst[len(rst) // 2]
    return {
        "misnumbered": jc.patch_byte(t, mid + 1, 0xD0 + (t[mid + 1] - 0xD0 + 3) % 8),
        "missing": t[:mid] + t[mid + 2:],
        "extra": t[:mid] + b"\xff" + bytes([t[mid + 1]]) + t[mid:],
        "not-a-restart": jc.patch_byte(t, mid + 1, 0xC4),
        "cut-short": t[:mid - 5],
        "cut-at-marker": t[:mid],
        "eoi-early": t[:mid] + b"\xff\xd9",
        "dri-says-2": jc.patch_byte(t, jc.find_segment(t, jc.DRI)[0] + 5, 2),
        "dri-says-0": jc.patch_byte(t, jc.find_segment(t, jc.DRI)[0] + 5, 0),
        "sof-height-smaller": jc.patch_size(t, 100, 331),
        "sof-width-smaller": jc.patch_size(t, 229, 200),
    }


@pytest.mark.parametrize("kind", [
    "misnumbered", "missing", "extra", "not-a-restart", "cut-short", "cut-at-marker",
    "eoi-early", "dri-says-2", "dri-says-0", "sof-height-smaller", "sof-width-smaller"])
def test_damaged_restart_structure_takes_the_plain_path(kind):
    data = _damaged("medium-420")[kind]
    rng = np.random.default_rng(len(kind))
    try:
        hdr = jpeg.read_header(data)
    except DecodeError:
        # An unreadable header is an error on both paths, for any box.
        hdr = None
    height, width = (hdr.height, hdr.width) if hdr else (230, 332)
    for _ in range(30):
        top, left = int(rng.integers(0, height)), int(rng.integers(0, width))
        box = (top, left, int(rng.integers(1, height - top + 1)),
               int(rng.integers(1, width - left + 1)))
        _same_outcome(data, box)
        _same_outcome(data, box, strict=True)


def test_bit_flips_in_entropy_data():
    """A flipped bit anywhere in the entropy-coded data: the region decode's result is the plain
    region decode's (pixels or DecodeError), never a crash or an out-of-bounds read."""
    for name in ("small-420", "small-gray"):
        t = jpeg.transcode(tj.case(name))
        scan = jc.first_scan_data(t)
        rng = np.random.default_rng(list(name.encode()))
        used = 0
        for i in range(150):
            m = bytearray(t)
            for _ in range(1 + i % 3):
                m[int(rng.integers(scan, len(t) - 2))] ^= 1 << int(rng.integers(0, 8))
            top, left = int(rng.integers(0, 90)), int(rng.integers(0, 120))
            used += _same_outcome(bytes(m), (top, left, int(rng.integers(1, 97 - top)),
                                             int(rng.integers(1, 125 - left))))
        assert used > 20, used


def _first_interval_damaged():
    t = transcoded("medium-420")
    first = jc.first_scan_data(t)
    rst0 = _scan_markers(t)[0]
    return t[:first] + b"\x00" + t[rst0:]     # the first MCU's interval: one byte


def test_strict_mode_reads_only_the_covering_intervals():
    """Damage in an interval far from the region: the plain region decode Huffman-decodes it
    and strict mode fails; the interval decode never reads it."""
    damaged = _first_interval_damaged()
    box = (150, 200, 40, 60)
    with pytest.raises(DecodeError):
        jpeg.decode(damaged, strict=True)
    with pytest.raises(ValueError):
        region_decode(damaged, box, strict=True, intervals=False)
    got, used = region_decode(damaged, box, strict=True)
    assert used and np.array_equal(got, tj.full("medium-420")[150:190, 200:260])
    # The batch kernels take the same path: strict decode_batch and the fused pipeline.
    out, shapes, errors = jpeg.decode_batch([damaged], regions=np.array([box]), strict=True,
                                            on_error="return")
    assert not errors and np.array_equal(out[0, :40, :60], got)


def test_fused_pipeline_reads_only_the_covering_intervals():
    damaged = _first_interval_damaged()
    original = tj.case("medium-420")
    cfg = dict(TransformConfig(train=True, size=32).to_dict(), strict=True)
    kernel = _pipeline.Pipeline(cfg, 1)
    idx = np.arange(40, dtype=np.int64)
    outs = {}
    for which, data in (("damaged", damaged), ("original", original)):
        bufs = _jpeg.BufferList.from_buffers([data] * len(idx))
        out = np.empty((len(idx), 3, 32, 32), np.float32)
        info = np.zeros((len(idx), 7), np.int32)
        outs[which] = (out, info, kernel.run(bufs, idx, 0, 0, out, info))
    out, info, errors = outs["damaged"]
    ref, ref_info, ref_errors = outs["original"]
    assert not ref_errors
    # Crops whose intervals avoid the first MCU decode (identically to the original); a crop
    # that needs it fails in strict mode, as it must.
    ok = [i for i in range(len(idx)) if i not in errors]
    assert len(ok) >= 10 and len(errors) >= 1, (len(ok), sorted(errors))
    assert np.array_equal(out[ok], ref[ok]) and np.array_equal(info[ok], ref_info[ok])


# --- the batch kernels over transcoded bytes -----------------------------------------------------

BATCH_NAMES = ["medium-420", "medium-422", "medium-444", "medium-gray", "medium-411-rst2",
               "medium-progressive-420", "medium-cmyk", "size-17x9-420", "ycc420-q95",
               "progressive-444", "size-1x1-420"]


@pytest.mark.parametrize("config", [
    dict(train=True, size=224), dict(train=True, size=56, fast=True),
    dict(train=True, size=(16, 24), dtype="uint8", layout="HWC"),
    dict(train=False, size=64), dict(train=False, size=224, resize=256),
], ids=["train224", "train56-fast", "train16x24-u8", "val64", "val224"])
def test_batch_over_transcoded_bytes_is_bit_identical(config):
    originals = [tj.case(n) for n in BATCH_NAMES]
    trans = [transcoded(n) for n in BATCH_NAMES]
    proc = BatchProcessor(TransformConfig(**config), num_threads=2)
    idx = np.arange(len(BATCH_NAMES), dtype=np.int64) * 13 + 5
    for epoch in (0, 1, 2):
        a, ia, ea = proc.run(originals, idx, epoch=epoch, seed=3)
        b, ib, eb = proc.run(trans, idx, epoch=epoch, seed=3)
        assert not ea and not eb
        assert np.array_equal(ia, ib)
        assert a.tobytes() == b.tobytes(), epoch


def test_decode_batch_over_transcoded_bytes():
    originals = [tj.case(n) for n in BATCH_NAMES]
    trans = [transcoded(n) for n in BATCH_NAMES]
    regions = tj._batch_regions(originals, seed=11)
    for kw in ({}, {"min_size": (24, 24)}, {"fast": True}):
        a, sa = jpeg.decode_batch(originals, regions=regions, **kw)
        b, sb = jpeg.decode_batch(trans, regions=regions, **kw)
        assert np.array_equal(sa, sb)
        for i, (h, w, _) in enumerate(sa):
            assert np.array_equal(a[i, :h, :w], b[i, :h, :w]), BATCH_NAMES[i]


def test_transcode_paths_do_not_leak():
    """Every outcome frees the decoder, the compressor and the output buffer."""
    cases = [tj.case("size-16x16-420"), _truncated(), b"\xff\xd8" + bytes(100),
             tj.case("gray-progressive-small-bomb")]

    def run(n):
        for i in range(n):
            try:
                jpeg.transcode(cases[i % len(cases)])
            except DecodeError:
                pass

    run(400)
    before = rss_bytes()
    run(4000)
    growth = rss_bytes() - before
    # A leaked decompress or compress object is several KB: 4000 of them would be > 8 MB.
    assert growth < 4 << 20, f"RSS grew by {growth / 2**20:.1f} MiB over 4000 transcodes"


def test_truncated_stream_decodes_regions_it_holds():
    """A cut after the intervals a region needs: the region's pixels are the file's (the plain
    decode may report the cut: it reads one iMCU row further); past the cut, an error."""
    t = transcoded("medium-420")
    rst = _scan_markers(t)
    mpr = -(-331 // 16)
    cut = t[:rst[8 * mpr - 1] + 2 + 7]        # seven bytes into MCU row 8's first interval
    full = tj.full("medium-420")
    for box in ((40, 100, 60, 50), (0, 200, 100, 131), (10, 0, 80, 331)):
        got, used = region_decode(cut, box)
        top, left, h, w = box
        assert np.array_equal(got, full[top:top + h, left:left + w]), box
        assert used == (box[1] > 0 or box[0] >= 16), box
    for box in ((100, 100, 40, 40), (0, 0, 229, 331)):
        with pytest.raises(ValueError, match="Premature end"):
            region_decode(cut, box)


@pytest.mark.parametrize("exc", [
    DecodeError("bad Huffman code", index=7, path="a/b.jpg"),
    TranscodeUnsupported("premature end of data", index=3),
    ProducerError("batch failed", producer="producer rank 2", remote_traceback="Traceback"),
])
def test_errors_pickle_with_their_type_and_fields(exc):
    """Errors are pickled when they cross processes: a TranscodeUnsupported stays one (its
    handlers keep the original bytes), and index, path and producer survive."""
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert vars(back) == vars(exc)
