"""JPEG test images made by the tests themselves: encoders, a reference decoder, marker surgery.

Everything here is deterministic. Pixel content comes from photographs bundled with
scikit-image (on disk, no download); files are written by Pillow's and OpenCV's encoders, and
arithmetic-coded files by a lossless transcode through the system libjpeg (``jpegtran
-arithmetic`` when installed, else a 30-line C program compiled on first use against the same
headers the decoder is built with). The reference decode is Pillow's
(``Image.open(...).convert("RGB")``), which uses the same libjpeg semantics as the decoder.
"""

import atexit
import io
import os
import shutil
import struct
import subprocess
import tempfile
from functools import lru_cache

import numpy as np
from PIL import Image

# --- pixels --------------------------------------------------------------------------------------

PHOTOS = ("astronaut", "coffee", "chelsea")


@lru_cache(maxsize=None)
def photo(name):
    """An RGB uint8 photograph from scikit-image's bundled sample data (read-only)."""
    import skimage.data

    img = np.ascontiguousarray(getattr(skimage.data, name)()[..., :3])
    img.setflags(write=False)
    return img


def photo_sized(name, height, width):
    """The photograph resampled to height x width (area averaging: keeps photo statistics)."""
    import cv2

    src = photo(name)
    shrink = height <= src.shape[0] and width <= src.shape[1]
    interp = cv2.INTER_AREA if shrink else cv2.INTER_LINEAR
    return np.ascontiguousarray(cv2.resize(src, (width, height), interpolation=interp))


# --- encoders ------------------------------------------------------------------------------------

# Pillow's ``subsampling`` argument.
PIL_SUBSAMPLING = {"444": 0, "422": 1, "420": 2}
# OpenCV's sampling-factor codes (luma h/v factors; chroma 1x1).
CV_SUBSAMPLING = {"444": 0x111111, "422": 0x211111, "420": 0x221111, "440": 0x121111,
                  "411": 0x411111}


def pil_jpeg(img, *, quality=75, subsampling="420", progressive=False, mode=None,
             optimize=False):
    """Encode an RGB (or 2-D grayscale) array with Pillow. ``mode="CMYK"`` converts first
    (Pillow writes Adobe-inverted CMYK with an APP14 marker, transform 0). Without
    ``optimize`` the Huffman tables are the standard ones (JPEG spec, Annex K)."""
    im = Image.fromarray(img)
    if mode is not None:
        im = im.convert(mode)
    buf = io.BytesIO()
    kw = {"quality": quality, "progressive": progressive, "optimize": optimize}
    if im.mode in ("RGB", "YCbCr"):
        kw["subsampling"] = PIL_SUBSAMPLING[subsampling]
    im.save(buf, format="JPEG", **kw)
    return buf.getvalue()


def cv_jpeg(img, *, quality=75, subsampling="420", restart=0, progressive=False):
    """Encode an RGB array with OpenCV (its own libjpeg-turbo), optionally with restart
    markers every ``restart`` MCUs."""
    import cv2

    params = [cv2.IMWRITE_JPEG_QUALITY, quality,
              cv2.IMWRITE_JPEG_SAMPLING_FACTOR, CV_SUBSAMPLING[subsampling],
              cv2.IMWRITE_JPEG_PROGRESSIVE, int(progressive)]
    if restart:
        params += [cv2.IMWRITE_JPEG_RST_INTERVAL, restart]
    ok, enc = cv2.imencode(".jpg", np.ascontiguousarray(img[..., ::-1]), params)
    assert ok
    return enc.tobytes()


# --- reference decoder ---------------------------------------------------------------------------

def pil_decode(data, scale=8):
    """Pillow's decode to RGB; ``scale`` in eighths (8, 4, 2, 1) uses Pillow's DCT-scaled
    draft mode, which keeps the accurate IDCT and fancy upsampling."""
    im = Image.open(io.BytesIO(data))
    if scale != 8:
        im.draft(im.mode, (max(1, im.width * scale // 8), max(1, im.height * scale // 8)))
        assert im.decoderconfig[0] == 8 // scale, "Pillow picked another DCT scale"
    return np.asarray(im.convert("RGB"))


# --- marker surgery ------------------------------------------------------------------------------

SOI, EOI, SOS, DHT, DQT, DRI, APP14 = 0xD8, 0xD9, 0xDA, 0xC4, 0xDB, 0xDD, 0xEE
SOF_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def segments(data):
    """[(marker, start, end)] of every marker segment, SOI to EOI. A scan's entry spans its SOS
    header and the entropy-coded data up to the next marker (RSTn markers stay inside it)."""
    out = []
    assert data[:2] == b"\xff\xd8"
    out.append((SOI, 0, 2))
    pos = 2
    n = len(data)
    while pos < n:
        assert data[pos] == 0xFF, f"no marker at {pos}"
        while data[pos + 1] == 0xFF:  # fill bytes
            pos += 1
        marker = data[pos + 1]
        if marker == EOI:
            out.append((EOI, pos, pos + 2))
            break
        length = struct.unpack(">H", data[pos + 2:pos + 4])[0]
        end = pos + 2 + length
        if marker == SOS:
            while end < n - 1 and not (data[end] == 0xFF and data[end + 1] not in
                                       (0x00, 0xD0, 0xD1, 0xD2, 0xD3, 0xD4, 0xD5, 0xD6, 0xD7)):
                end += 1
        out.append((marker, pos, end))
        pos = end
    return out


def find_segment(data, marker):
    """(start, end) of the first segment with this marker, or None."""
    for m, start, end in segments(data):
        if m == marker:
            return start, end
    return None


def first_scan_data(data):
    """Offset of the first entropy-coded byte (just after the first SOS header)."""
    start, _ = find_segment(data, SOS)
    return start + 2 + struct.unpack(">H", data[start + 2:start + 4])[0]


def imcu_size(data):
    """(rows, columns) of one iMCU at full scale: 8 x the largest sampling factors in SOF."""
    for m, start, _ in segments(data):
        if m in SOF_MARKERS:
            ncomp = data[start + 9]
            factors = [data[start + 11 + 3 * i] for i in range(ncomp)]
            return 8 * max(f & 15 for f in factors), 8 * max(f >> 4 for f in factors)
    raise AssertionError("no SOF marker")


def patch_size(data, height, width):
    """The same stream with the frame header (SOF) claiming height x width."""
    for m, start, _ in segments(data):
        if m in SOF_MARKERS:
            b = bytearray(data)
            b[start + 5:start + 9] = struct.pack(">HH", height, width)
            return bytes(b)
    raise AssertionError("no SOF marker")


def set_adobe_transform(data, transform):
    """Rewrite the Adobe APP14 colour-transform byte (0: none — RGB/CMYK, 1: YCbCr, 2: YCCK)."""
    start, _ = find_segment(data, APP14)
    assert data[start + 4:start + 9] == b"Adobe"
    b = bytearray(data)
    b[start + 15] = transform
    return bytes(b)


def strip_segment(data, marker):
    """The stream without its first segment of this marker."""
    start, end = find_segment(data, marker)
    return data[:start] + data[end:]


def strip_all(data, marker):
    """The stream without any segment of this marker."""
    return b"".join(data[s:e] for m, s, e in segments(data) if m != marker)


def patch_byte(data, offset, value):
    b = bytearray(data)
    b[offset] = value
    return bytes(b)


def insert_adobe(data, transform):
    """Insert an Adobe APP14 segment right after SOI (as Adobe applications write it)."""
    body = b"Adobe" + struct.pack(">HHHB", 100, 0, 0, transform)
    return data[:2] + b"\xff\xee" + struct.pack(">H", len(body) + 2) + body + data[2:]


def repeat_last_scan(data, times):
    """A progressive stream whose last scan is repeated ``times`` more times: libjpeg reads
    each copy (a corrupt-data warning, "inconsistent progression"), so the stream has as
    many scans as the attacker wants."""
    scans = [(s, e) for m, s, e in segments(data) if m == SOS]
    start, end = scans[-1]
    return data[:end] + data[start:end] * times + data[end:]


# --- arithmetic coding ---------------------------------------------------------------------------

_TRANSCODER_C = r"""
/* Lossless JPEG transcode to arithmetic coding (what `jpegtran -arithmetic` does).
   usage: arith_transcode [p] < in.jpg > out.jpg   (p: progressive scan script) */
#include <stdio.h>
#include <jpeglib.h>
int main(int argc, char **argv) {
  struct jpeg_decompress_struct src;
  struct jpeg_compress_struct dst;
  struct jpeg_error_mgr esrc, edst;
  jvirt_barray_ptr *coefs;
  src.err = jpeg_std_error(&esrc);
  jpeg_create_decompress(&src);
  dst.err = jpeg_std_error(&edst);
  jpeg_create_compress(&dst);
  jpeg_stdio_src(&src, stdin);
  jpeg_read_header(&src, TRUE);
  coefs = jpeg_read_coefficients(&src);
  jpeg_copy_critical_parameters(&src, &dst);
  dst.arith_code = TRUE;
  if (argc > 1 && argv[1][0] == 'p') jpeg_simple_progression(&dst);
  jpeg_stdio_dest(&dst, stdout);
  jpeg_write_coefficients(&dst, coefs);
  jpeg_finish_compress(&dst);
  jpeg_destroy_compress(&dst);
  jpeg_finish_decompress(&src);
  jpeg_destroy_decompress(&src);
  return 0;
}
"""


class ToolUnavailable(RuntimeError):
    """No way to write arithmetic-coded JPEGs on this machine (the message says why)."""


@lru_cache(maxsize=None)
def _arith_command():
    jpegtran = shutil.which("jpegtran")
    if jpegtran:
        return (jpegtran, "-copy", "all", "-arithmetic"), "-progressive"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise ToolUnavailable("neither jpegtran (libjpeg-turbo-progs) nor a C compiler is "
                              "installed to write arithmetic-coded JPEGs")
    workdir = tempfile.mkdtemp(prefix="dpu_pipe_arith_")
    atexit.register(shutil.rmtree, workdir, True)
    src = os.path.join(workdir, "arith_transcode.c")
    exe = os.path.join(workdir, "arith_transcode")
    with open(src, "w") as f:
        f.write(_TRANSCODER_C)
    proc = subprocess.run([cc, "-O1", "-o", exe, src, "-ljpeg"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ToolUnavailable("cannot build an arithmetic-coding transcoder against the system "
                              "libjpeg (and jpegtran is not installed): " + proc.stderr[-300:])
    return (exe,), "p"


def to_arithmetic(data, *, progressive=False):
    """Losslessly transcode a JPEG to arithmetic coding (same DCT coefficients, so it decodes
    to the same pixels as ``data``). Raises ToolUnavailable when no encoder is available."""
    cmd, prog_flag = _arith_command()
    args = list(cmd) + ([prog_flag] if progressive else [])
    proc = subprocess.run(args, input=data, capture_output=True, timeout=30)
    if proc.returncode != 0 or not proc.stdout:
        raise ToolUnavailable("arithmetic transcode failed: "
                              + proc.stderr.decode("utf-8", "replace")[-300:])
    return proc.stdout


# --- datasets on disk ----------------------------------------------------------------------------

def write_file(path, data):
    """Write ``data`` to ``path``, making its parent directories."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def indexed_jpeg(i):
    """Sample ``i`` of :func:`write_indexed_folder`: a photo at a size of its own (64-125 px)
    and one of three chroma subsamplings, so every sample differs."""
    h, w = 64 + (i * 37) % 62, 64 + (i * 53) % 62
    return pil_jpeg(photo_sized(PHOTOS[i % 3], h, w), quality=90,
                    subsampling=("420", "444", "422")[i % 3])


def write_indexed_folder(root, n):
    """An ImageFolder of ``n`` samples under ``root``, one class folder each
    (``c<i:03d>/img.jpg``), so label == sample index; returns ``root``."""
    for i in range(n):
        write_file(os.path.join(str(root), f"c{i:03d}", "img.jpg"), indexed_jpeg(i))
    return root


def assert_same_samples(a, b):
    """Two sources hold the same samples: count, labels, classes, bytes and paths."""
    assert len(a) == len(b)
    assert np.array_equal(a.labels, b.labels)
    assert a.classes == b.classes
    for i in range(len(a)):
        assert a.read(i) == b.read(i), i
        assert a.relpath(i) == b.relpath(i)
