"""Seed inputs for the fuzz targets: small real JPEGs of every kind the decoder handles (and a
few it refuses), made from scikit-image's photographs, plus a packed file and file lists.

Small images keep each execution fast (the fuzzer's speed is executions per second); the
variety gives it a start inside every decoder path: baseline and progressive, Huffman and
arithmetic coding, restart markers, every chroma subsampling (4:1:1 and 4:4:0 included),
grayscale, RGB, CMYK and YCCK, 12-bit (refused by an 8-bit libjpeg), EXIF blocks.

    python tests/fuzz/seeds.py OUTDIR       writes OUTDIR/<target>/<name> for every target
"""

import io
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for jpeg_corpus

import jpeg_corpus as jc  # noqa: E402


def _ppm(img):
    h, w = img.shape[:2]
    if img.ndim == 2:
        return b"P5\n%d %d\n255\n" % (w, h) + img.tobytes()
    return b"P6\n%d %d\n255\n" % (w, h) + img.tobytes()


def _run(cmd, data):
    return subprocess.run(cmd, input=data, capture_output=True, check=True, timeout=30).stdout


def _cjpeg(img, *args):
    return _run(["cjpeg", *args], _ppm(img))


def _jpegtran(data, *args):
    return _run(["jpegtran", *args], data)


def _exif_app1():
    # A minimal TIFF block: little-endian, one IFD with an Orientation tag.
    tiff = b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 1) \
        + struct.pack("<HHII", 0x0112, 3, 1, 6) + struct.pack("<I", 0)
    body = b"Exif\x00\x00" + tiff
    return b"\xff\xe1" + struct.pack(">H", len(body) + 2) + body


def jpegs():
    """{name: bytes} of the seed JPEGs (deterministic)."""
    a = jc.photo_sized("astronaut", 40, 56)
    c = jc.photo_sized("coffee", 33, 47)
    k = jc.photo_sized("chelsea", 24, 24)
    gray = np.ascontiguousarray(a.mean(axis=2).astype(np.uint8))
    out = {
        "baseline_420": jc.pil_jpeg(a, subsampling="420"),
        "baseline_444_odd": jc.pil_jpeg(c, subsampling="444", quality=90),
        "baseline_422_opt": jc.pil_jpeg(k, subsampling="422", optimize=True),
        "progressive": jc.pil_jpeg(a, progressive=True),
        "progressive_odd": jc.pil_jpeg(c, progressive=True, subsampling="444"),
        "gray": jc.pil_jpeg(gray),
        "cmyk": jc.pil_jpeg(k, mode="CMYK"),
        "tiny_1x1": jc.pil_jpeg(a[:1, :1]),
        "tiny_9x17": jc.pil_jpeg(c[:9, :17]),
    }
    out["ycck"] = jc.set_adobe_transform(out["cmyk"], 2)
    out["exif"] = out["baseline_420"][:2] + _exif_app1() + out["baseline_420"][2:]
    out["exif_only"] = b"\xff\xd8" + _exif_app1() + b"\xff\xd9"
    if shutil.which("cjpeg"):
        out["s411"] = _cjpeg(a, "-sample", "4x1,1x1,1x1")
        out["s440"] = _cjpeg(c, "-sample", "1x2,1x1,1x1")
        out["s_odd_factors"] = _cjpeg(k, "-sample", "2x2,1x2,2x1")
        out["rgb"] = _cjpeg(k, "-rgb")
        out["restart_1block"] = _cjpeg(a, "-restart", "1B")
        out["restart_1row_prog"] = _cjpeg(c, "-restart", "1", "-progressive")
        out["restart_huge"] = _cjpeg(k, "-restart", "65535B")
        out["arith"] = _cjpeg(a, "-arithmetic")
        out["arith_prog_411"] = _cjpeg(c, "-arithmetic", "-progressive", "-sample", "4x1,1x1,1x1")
        out["arith_gray"] = _cjpeg(gray, "-arithmetic")
    if shutil.which("jpegtran"):
        out["cmyk_arith"] = _jpegtran(out["cmyk"], "-arithmetic")
        out["cmyk_prog"] = _jpegtran(out["cmyk"], "-progressive")
    cjpeg12 = os.environ.get("DPU_PIPE_CJPEG12")
    if cjpeg12 and os.path.exists(cjpeg12):
        out["precision12"] = _run([cjpeg12], _ppm(k))
    else:
        # A 12-bit frame header (SOF1, P=12) on 8-bit data: what the decoder sees first of
        # a real 12-bit file, and refuses.
        b = bytearray(out["baseline_420"])
        start, _ = jc.find_segment(bytes(b), 0xC0)
        b[start + 1], b[start + 4] = 0xC1, 12
        out["precision12_header"] = bytes(b)
    return out


def packed_dataset(jpeg_list, tmp):
    """(manifest bytes, shard bytes) of a one-shard packed dataset written by dpu_pipe.pack,
    with 2 records per index block so the seed has several blocks."""
    from dpu_pipe import FileList, pack
    from dpu_pipe.packed import format as fmt

    rows = []
    for i, data in enumerate(jpeg_list):
        p = os.path.join(tmp, f"r{i}.jpg")
        with open(p, "wb") as f:
            f.write(data)
        rows.append((f"r{i}.jpg", i % 2))
    out = os.path.join(tmp, "ds")
    pack(FileList(rows, root=tmp), out, progress=False, block_records=2)
    with open(os.path.join(out, fmt.MANIFEST_NAME), "rb") as f:
        manifest = f.read()
    with open(os.path.join(out, fmt.shard_name(0)), "rb") as f:
        shard = f.read()
    return manifest, shard


def tar_shards(images):
    """Small WebDataset shards: .cls labels (ustar and GNU), and JSON labels (the target
    reads ``json:label`` for an input starting with ``j``: a leading member named so)."""
    import io
    import json
    import tarfile

    def shard(fmt, label, lead=None):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
            members = [(lead, b"x")] if lead else []
            for i, data in enumerate(images):
                members.append((f"s/{i:03d}.jpg", data))
                members.append((f"s/{i:03d}.{label}",
                                json.dumps({"label": i}).encode() if label == "json"
                                else str(i).encode()))
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        # tarfile pads to 10240 bytes; the end-of-archive marker is two zero blocks.
        body = buf.getvalue().rstrip(b"\0")
        return body + b"\0" * (-len(body) % 512 + 1024)

    return {"ustar_cls": shard(tarfile.USTAR_FORMAT, "cls"),
            "gnu_cls": shard(tarfile.GNU_FORMAT, "cls"),
            "json": shard(tarfile.USTAR_FORMAT, "json", lead="j" * 99)}


def row_files(images):
    """A Parquet file (struct {bytes, path} column) and Arrow IPC file and stream files."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    image = pa.StructArray.from_arrays([pa.array(images, pa.binary()),
                                        pa.array([f"{i}.jpg" for i in range(len(images))])],
                                       names=["bytes", "path"])
    table = pa.table({"image": image, "label": pa.array(range(len(images)), pa.int64())})
    out = {}
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=2)
    out["parquet_struct"] = buf.getvalue()
    for name, new in (("arrow_file", pa.ipc.new_file), ("arrow_stream", pa.ipc.new_stream)):
        sink = pa.BufferOutputStream()
        with new(sink, table.schema) as w:
            for b in table.to_batches(max_chunksize=2):
                w.write_batch(b)
        out[name] = sink.getvalue().to_pybytes()
    return out


FILE_LISTS = {
    "plain": b"a.jpg 0\nb/c.jpg 1\n",
    "csv_header": b"path,label\n\"x, y.jpg\",3\nz.jpg,-1\n",
    "comments": b"# list\n\n  spaced name.jpg   7  \n/abs/p.jpg 2\n",
}


def write_all(outdir):
    """Write the seeds of every target under outdir/<target>/. Returns {target: count}."""
    from dpu_pipe.packed import format as fmt
    from targets import BATCH_TRAILER, DECODE_TRAILER, _frame

    seeds = jpegs()
    dirs = {}

    def put(target, name, data):
        d = dirs.setdefault(target, os.path.join(outdir, target))
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)

    for name, data in seeds.items():
        put("header", name, data)
        put("decode", name, data + DECODE_TRAILER)
        put("batch", name, data + BATCH_TRAILER)
    with tempfile.TemporaryDirectory() as tmp:
        manifest, shard = packed_dataset([seeds["baseline_420"], seeds["progressive"],
                                          seeds["tiny_9x17"]], tmp)
    put("packed", "three", _frame(manifest, shard, 0))
    put("packed", "three_crc_fixed", _frame(manifest, shard, 1))
    # A version-3 pack, whose shards end with the restart-interval index it still reads.
    v3 = os.path.join(os.path.dirname(HERE), "data", "packed_v3")
    with open(os.path.join(v3, fmt.MANIFEST_NAME), "rb") as f:
        manifest = f.read()
    with open(os.path.join(v3, fmt.shard_name(0)), "rb") as f:
        shard = f.read()
    put("packed", "v3_crc_fixed", _frame(manifest, shard, 1))
    for name in ("baseline_420", "progressive", "tiny_1x1"):
        data = seeds[name]
        pairs = np.array([[0, len(data)], [1, len(data) - 1], [0, len(data) // 2]], "<i8")
        put("bufferlist", name, data + pairs.tobytes() + bytes([3]))
    for name, data in FILE_LISTS.items():
        put("filelist", name, data)
    small = [seeds["tiny_9x17"], seeds["tiny_1x1"], seeds["tiny_9x17"]]
    for name, data in tar_shards(small).items():
        put("tar", name, data)
    for name, data in row_files(small[1:2] * 2).items():
        put("parquet", name, data)
    return {t: len(os.listdir(d)) for t, d in dirs.items()}


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    print(write_all(sys.argv[1]))
