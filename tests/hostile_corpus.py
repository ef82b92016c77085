"""Hostile files: what an untrusted dataset can hold, generated from a few real photographs.

Each entry is ``(name, data, expect)``: ``data`` the file's bytes; ``expect`` one of

- ``"bad"``: must be reported (raise names it; skip replaces and records it), never delivered;
- ``"good"``: a valid file the decoder must deliver, close to an independent reference
  (Pillow's decode, cropped and resampled by ``dpu_pipe.ops``);
- ``"cut"``: a truncated copy of a good file: reported, or delivered bit-identical to what the
  intact file gives (a crop that ends before the cut is decoded correctly; anything else is
  an error, never grey padding);
- ``"either"``: an image in another format posing as ``.jpg``: delivered close to the
  reference (when the build decodes that format), or reported — never garbage;
- ``"corrupt"``: corrupted entropy-coded data (bit flips, bogus markers inside a scan): JPEG
  has no checksum, so it is reported or delivered; delivered output must be deterministic.
"""

import io
import struct

import numpy as np
from PIL import Image

import jpeg_corpus as jc

BASE_SHAPE = (72, 96)


def base_jpeg():
    return jc.pil_jpeg(jc.photo_sized("astronaut", *BASE_SHAPE), quality=90)


def _pil(img, fmt, **kw):
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format=fmt, **kw)
    return buf.getvalue()


def _segment(marker, body):
    return bytes([0xFF, marker]) + struct.pack(">H", len(body) + 2) + body


def _exif():
    tiff = b"II*\x00" + struct.pack("<IH", 8, 1) + struct.pack("<HHII", 0x0112, 3, 1, 6) \
        + struct.pack("<I", 0)
    return _segment(0xE1, b"Exif\x00\x00" + tiff)


def _with_dri(data, interval):
    """Insert a DRI (restart interval) segment before the first SOS."""
    start, _ = jc.find_segment(data, jc.SOS)
    return data[:start] + _segment(jc.DRI, struct.pack(">H", interval)) + data[start:]


def truncations(data, points=16):
    """``points`` prefixes of ``data``, cut at evenly spaced offsets from inside the
    header to just before the EOI marker."""
    cuts = np.linspace(1, len(data) - 2, points).astype(int)
    return [(f"cut{k:02d}_at{c}", data[:c]) for k, c in enumerate(cuts)]


def bit_flips(data, count=6, seed=1):
    """Copies of ``data`` with one bit flipped in the entropy-coded data."""
    rng = np.random.default_rng(seed)
    lo, hi = jc.first_scan_data(data), len(data) - 2
    out = []
    for k in range(count):
        pos = int(rng.integers(lo, hi))
        b = bytearray(data)
        b[pos] ^= 1 << int(rng.integers(0, 8))
        out.append((f"flip{k}_at{pos}", bytes(b)))
    return out


def corpus():
    """[(name, bytes, expect)] — deterministic."""
    good = base_jpeg()
    img = jc.photo_sized("coffee", 64, 80)
    gray = np.ascontiguousarray(img[..., 1])
    prog = jc.pil_jpeg(jc.photo_sized("chelsea", 80, 64), progressive=True)
    sos, _ = jc.find_segment(good, jc.SOS)
    items = [("good_base", good, "good")]
    items += [(n, d, "cut") for n, d in truncations(good)]
    items += [(n, d, "corrupt") for n, d in bit_flips(good)]
    items += [
        # Without EOI, libjpeg's bit reader meets the end of data while prefetching past the
        # last MCU: a crop reaching the bottom rows is "truncated", any other decodes.
        ("missing_eoi", good[:-2], "cut"),
        ("duplicated_app_markers", good[:2] + _exif() + _exif()
         + _segment(0xE0, b"JFIF\x00\x01\x02\x00\x00\x01\x00\x01\x00\x00") + good[2:], "good"),
        ("exif", good[:2] + _exif() + good[2:], "good"),
        ("exif_only", b"\xff\xd8" + _exif() + b"\xff\xd9", "bad"),
        ("bogus_marker_in_header", good[:sos] + b"\xff\x4f\x00\x04ab" + good[sos:], "bad"),
        ("duplicated_sof", good[:sos] + good[slice(*jc.find_segment(good, 0xC0))] + good[sos:],
         "bad"),
        ("bogus_marker_in_scan", good[:sos + 40] + b"\xff\xd5" + good[sos + 40:], "corrupt"),
        ("two_soi", b"\xff\xd8" + good, "bad"),
        ("header_65535x65535", jc.patch_size(good, 65535, 65535), "bad"),
        ("header_0_height", jc.patch_size(good, 0, 96), "bad"),
        ("progressive_scan_bomb", jc.repeat_last_scan(prog, 1500), "bad"),
        ("progressive", prog, "good"),
        ("zero_length", b"", "bad"),
        ("soi_only", b"\xff\xd8", "bad"),
        ("text", b"this is not an image\n" * 10, "bad"),
        ("html", b"<!DOCTYPE html><html><body>404 Not Found</body></html>", "bad"),
        ("png_as_jpg", _pil(img, "PNG"), "either"),
        ("gif_as_jpg", _pil(img, "GIF"), "either"),
        ("webp_as_jpg", _pil(img, "WEBP", lossless=True), "either"),
        ("bmp_as_jpg", _pil(img, "BMP"), "either"),
        ("cmyk", jc.pil_jpeg(img, mode="CMYK"), "good"),
        ("ycck", jc.set_adobe_transform(jc.pil_jpeg(img, mode="CMYK"), 2), "either"),
        ("gray", jc.pil_jpeg(gray), "good"),
        ("huge_restart_interval", _with_dri(good, 65535), "good"),
        ("restart_every_mcu", jc.cv_jpeg(img, restart=1), "good"),
    ]
    try:
        items.append(("arithmetic", jc.to_arithmetic(good), "good"))
        items.append(("arithmetic_progressive", jc.to_arithmetic(good, progressive=True),
                      "good"))
    except jc.ToolUnavailable:
        pass
    # A 12-bit frame (SOF1, precision 12): an 8-bit libjpeg refuses it by name.
    b = bytearray(good)
    start, _ = jc.find_segment(good, 0xC0)
    b[start + 1], b[start + 4] = 0xC1, 12
    items.append(("precision12", bytes(b), "bad"))
    # Lossless JPEG (SOF3): not decodable by an 8-bit DCT decoder.
    b = bytearray(good)
    b[start + 1] = 0xC3
    items.append(("lossless_sof3", bytes(b), "bad"))
    return items


def reference(data):
    """An independent RGB decode of ``data`` (uint8 (H, W, 3)): Pillow's, else OpenCV's
    (which accepts a stream without its EOI marker); None when neither decodes it."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            return np.asarray(im.convert("RGB"))
    except Exception:  # noqa: BLE001 - any failure means "try the other decoder"
        pass
    import cv2

    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    return None if img is None else np.ascontiguousarray(img[..., ::-1])
