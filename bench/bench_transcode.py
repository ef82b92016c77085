"""What lossless transcoding to restart intervals buys: file size against region-decode speed.

    python bench/bench_transcode.py [-n 1000] [--repeat 5] [--data PATH] [--json [PATH]]

On an ImageNet-like dataset made from real photographs (:mod:`dpu_pipe.tools.sample_data`),
one process pinned to one core, file bytes in memory, the crop boxes of RandomResizedCrop
(dpu_pipe's own RNG, the boxes the batch kernel draws) decoded at ``min_size=(224, 224)`` as
the batch kernel does. Every table interleaves its methods chunk by chunk, round by round
(:func:`dpu_pipe.tools.harness.interleaved`, this thread's CPU time: two cores shared by many
processes preempt a wall clock far more than they slow a method down), and reports the median
round:

1. interval choice: size growth and region-decode rate for a restart marker every 1, 2, 4 MCUs
   and every MCU row, on the baseline files and on the progressive ones;
2. decode anchors: Pillow + numpy (full decode, crop), a hand-written C region decode over
   jpeglib (``jpeg_crop_scanline`` + ``jpeg_skip_scanlines`` + early stop, same DCT scale;
   compiled on first use with the system C compiler against the libjpeg dpu_pipe links),
   dpu_pipe's region decode of the originals, of the transcoded files without and with the
   interval assembly;
3. the cost of finding the restart markers and assembling the sub-stream, against the decode;
4. end to end: the fused batch kernel (decode + RandomResizedCrop + flip + normalize to float32
   CHW 224×224) over original and transcoded bytes, with Pillow + numpy as the anchor, and where
   the time of one image goes.
"""

import argparse
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpu_pipe import _jpeg, jpeg, rng  # noqa: E402
from dpu_pipe.kernel import BatchProcessor  # noqa: E402
from dpu_pipe.tools import cli  # noqa: E402
from dpu_pipe.tools.bench_augment import pillow_augment  # noqa: E402
from dpu_pipe.tools.harness import interleaved, load_buffers, pin  # noqa: E402
from dpu_pipe.transforms import TransformConfig  # noqa: E402

MIN_SIZE = (224, 224)
INTERVALS = (1, 2, 4, "row")
BUDGET = (jpeg.DEFAULT_MAX_PIXELS, jpeg.DEFAULT_MAX_SCANS)


def markdown_table(rows, columns):
    """A markdown table of ``rows`` (dicts; a missing key is an empty cell), one column per
    key of ``columns``, in that order."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)

_ANCHOR_C = r"""
/* Region decode over jpeglib as one would write it by hand: DCT scale, jpeg_crop_scanline,
   jpeg_skip_scanlines, stop after the region's last row. Mode "coef": jpeg_read_coefficients
   only (entropy decoding without IDCT, upsampling or colour conversion).
   usage: anchor region|coef BLOB  -> CPU seconds for one pass over every image of BLOB */
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <jpeglib.h>
struct err { struct jpeg_error_mgr pub; jmp_buf jump; };
static void on_error(j_common_ptr c) { longjmp(((struct err *)c->err)->jump, 1); }
static void quiet(j_common_ptr c) { (void)c; }
int main(int argc, char **argv) {
  FILE *f = fopen(argv[2], "rb");
  fseek(f, 0, SEEK_END); long size = ftell(f); fseek(f, 0, SEEK_SET);
  unsigned char *blob = malloc(size);
  if (fread(blob, 1, size, f) != (size_t)size) return 2;
  fclose(f);
  int coef = strcmp(argv[1], "coef") == 0, scan = strcmp(argv[1], "scan") == 0;
  uint32_t n; memcpy(&n, blob, 4);
  unsigned char *row = malloc(3 * 65536 * 4);
  struct jpeg_decompress_struct cinfo; struct err jerr;
  cinfo.err = jpeg_std_error(&jerr.pub);
  jerr.pub.error_exit = on_error; jerr.pub.output_message = quiet;
  jpeg_create_decompress(&cinfo);
  struct timespec t0, t1; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t0);
  long pos = 4, checksum = 0;
  for (uint32_t i = 0; i < n; i++) {
    uint32_t len; int32_t b[5];
    memcpy(&len, blob + pos, 4); memcpy(b, blob + pos + 4, 20);
    unsigned char *data = blob + pos + 24; pos += 24 + len;
    if (scan) {  /* every 0xFF of the file, memchr to memchr, as the decoder finds markers */
      for (unsigned char *q = data, *e = data + len; (q = memchr(q, 0xFF, e - q)) != NULL; q += 2)
        checksum++;
      continue;
    }
    if (setjmp(jerr.jump)) { jpeg_abort_decompress(&cinfo); return 3; }
    jpeg_mem_src(&cinfo, data, len);
    jpeg_read_header(&cinfo, TRUE);
    if (coef) { jpeg_read_coefficients(&cinfo); jpeg_abort_decompress(&cinfo); continue; }
    cinfo.scale_num = b[4]; cinfo.scale_denom = 8;
    jpeg_start_decompress(&cinfo);
    JDIMENSION x = b[1] > 4 ? b[1] - 4 : 0, w = b[1] + b[3] + 4 - x;
    if (x + w > cinfo.output_width) w = cinfo.output_width - x;
    jpeg_crop_scanline(&cinfo, &x, &w);
    if (b[0] > 0) jpeg_skip_scanlines(&cinfo, b[0]);
    while ((int)cinfo.output_scanline < b[0] + b[2]) {
      JSAMPROW r = row; jpeg_read_scanlines(&cinfo, &r, 1); checksum += row[0];
    }
    jpeg_abort_decompress(&cinfo);
  }
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t1);
  printf("%.9f %ld\n", (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec), checksum);
  return 0;
}
"""


@lru_cache(maxsize=None)
def _anchor_exe():
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    work = Path(tempfile.mkdtemp(prefix="dpu_pipe_anchor_"))
    (work / "anchor.c").write_text(_ANCHOR_C)
    proc = subprocess.run([cc, "-O2", "-o", str(work / "anchor"), str(work / "anchor.c"),
                           "-ljpeg"], capture_output=True, text=True)
    return str(work / "anchor") if proc.returncode == 0 else None


def _blob(path, buffers, regions):
    """Images and their scaled regions (top, left, height, width, scale) for the C anchor."""
    with open(path, "wb") as f:
        f.write(struct.pack("<I", len(buffers)))
        for data, reg in zip(buffers, regions):
            f.write(struct.pack("<I5i", len(data), *reg))
            f.write(data)


def _scaled_region(data, box):
    """The pixels dpu_pipe decodes for box at min_size 224: (top, left, height, width, scale)."""
    top, left, h, w = box
    hdr = jpeg.read_header(data)
    s = jpeg.choose_scale(h, w, MIN_SIZE)
    r0, c0 = top * s // 8, left * s // 8
    r1 = min(-(-(top + h) * s // 8), -(-hdr.height * s // 8))
    c1 = min(-(-(left + w) * s // 8), -(-hdr.width * s // 8))
    return r0, c0, r1 - r0, c1 - c0, s


def _medians(methods, n, chunk, repeat):
    """{name: median seconds over all n items} of :func:`interleaved` in CPU time."""
    times = interleaved(methods, n, chunk=chunk, repeat=repeat, clock=time.thread_time)
    return {k: statistics.median(v) for k, v in times.items()}


def _region_fn(buffers, boxes, intervals=True):
    dec = _jpeg.decode

    def run(a, b):
        for i in range(a, b):
            dec(buffers[i], boxes[i], MIN_SIZE[0], MIN_SIZE[1], False, False, *BUDGET,
                intervals)
    return run


def _pillow_region_fn(buffers, boxes):
    import io

    from PIL import Image

    def run(a, b):
        for i in range(a, b):
            top, left, h, w = boxes[i]
            im = Image.open(io.BytesIO(buffers[i])).convert("RGB")
            np.asarray(im)[top:top + h, left:left + w].copy()
    return run


def _anchor_fn(exe, mode, buffers, regions, workdir, tag):
    """A method whose time is the C program's own (one pass over the images per round)."""
    path = os.path.join(workdir, f"{tag}.bin")
    _blob(path, buffers, regions)
    seconds = []

    def run_all():
        out = subprocess.run([exe, mode, path], capture_output=True, text=True, check=True)
        seconds.append(float(out.stdout.split()[0]))
    return run_all, seconds


def _c_us(exe, mode, files, regions, repeat):
    """Microseconds per image of the C program in ``mode`` over ``files`` (median run)."""
    path = os.path.join(tempfile.gettempdir(), f"dpu_pipe_{mode}_{os.getpid()}.bin")
    try:
        _blob(path, files, regions)
        return 1e6 * statistics.median(
            float(subprocess.run([exe, mode, path], capture_output=True, text=True,
                                 check=True).stdout.split()[0])
            for _ in range(repeat)) / len(files)
    finally:
        os.unlink(path)


def _inputs(root, n, seed):
    """(buffers, boxes, subsets): the first n JPEGs, their crop boxes of epoch 0 and the
    indices of the baseline and of the progressive ones."""
    buffers = load_buffers(root, n)[1]
    headers = [jpeg.read_header(b) for b in buffers]
    boxes = [tuple(int(v) for v in rng.random_resized_crop(seed, 0, i, h.height, h.width))
             for i, h in enumerate(headers)]
    subsets = {"baseline": [i for i, h in enumerate(headers) if not h.progressive],
               "progressive": [i for i, h in enumerate(headers) if h.progressive]}
    return buffers, boxes, subsets


def _transcode_all(buffers, boxes):
    """{interval: transcoded files} for every interval ("1-std": restart 1 with the standard
    Huffman tables), and {interval: img/s on one core, CPU time}; checks on a sample that the
    transcoded files decode to the same region pixels."""
    trans, rate = {}, {}
    for iv in INTERVALS + ("1-std",):
        t0 = time.thread_time()
        if iv == "1-std":
            trans[iv] = [jpeg.transcode(b, restart_interval=1, optimize=False) for b in buffers]
        else:
            trans[iv] = [jpeg.transcode(b, restart_interval=iv) for b in buffers]
        rate[iv] = len(buffers) / (time.thread_time() - t0)
    for i in range(0, len(buffers), max(1, len(buffers) // 50)):
        ref = jpeg.decode(buffers[i], region=boxes[i], min_size=MIN_SIZE)
        for iv in INTERVALS:
            got = jpeg.decode(trans[iv][i], region=boxes[i], min_size=MIN_SIZE)
            if not np.array_equal(got, ref):
                raise AssertionError(f"image {i}, restart {iv}: other pixels than the original")
    return trans, rate


def _subset_methods(orig, trans, idx, bx):
    """The region-decode methods of one subset's table."""
    methods = {"Pillow full decode + crop": _pillow_region_fn(orig, bx),
               "region decode, original": _region_fn(orig, bx)}
    for iv in INTERVALS + ("1-std",):
        methods[f"region decode, restart {iv}"] = _region_fn([trans[iv][i] for i in idx], bx)
    methods["restart 1, plain region decode"] = _region_fn([trans[1][i] for i in idx], bx,
                                                          False)
    return methods


def _subset_table(buffers, boxes, trans, idx, exe, work, tag, chunk, repeat):
    """Rows of one subset's decode table: img/s, ratio to the original's region decode and
    size growth, with the C anchors (one pass per round, between the Python rounds)."""
    orig, bx = [buffers[i] for i in idx], [boxes[i] for i in idx]
    methods = _subset_methods(orig, trans, idx, bx)
    anchors = {}
    if exe:
        regions = [_scaled_region(b, x) for b, x in zip(orig, bx)]
        anchors["C region decode over jpeglib, original"] = _anchor_fn(
            exe, "region", orig, regions, work, tag + "-orig")
        anchors["C region decode over jpeglib, restart 1 (plain)"] = _anchor_fn(
            exe, "region", [trans[1][i] for i in idx], regions, work, tag + "-t1")
    times = interleaved(methods, len(idx), chunk=chunk, repeat=repeat, clock=time.thread_time,
                        before_round=lambda r: [fn() for fn, _ in anchors.values()])
    med = {k: statistics.median(v) for k, v in times.items()}
    med.update({k: statistics.median(secs) for k, (_, secs) in anchors.items()})
    ref, size0 = med["region decode, original"], sum(map(len, orig))
    rows = []
    for k, v in med.items():
        iv = next((x for x in INTERVALS + ("1-std",) if k == f"region decode, restart {x}"),
                  None)
        grow = (sum(len(trans[iv][i]) for i in idx) / size0 - 1) if iv else None
        rows.append({"method": k, "img/s": f"{len(idx) / v:.0f}",
                     "vs original": f"{ref / v:.2f}x",
                     "size growth": f"{100 * grow:+.1f} %" if grow is not None else ""})
    return rows


def _decode_tables(buffers, boxes, trans, subsets, chunk, repeat, log):
    """{subset: rows} of the decode tables (anchors compiled on first use, when a C compiler
    and libjpeg's headers are there)."""
    exe = _anchor_exe()
    work = tempfile.mkdtemp(prefix="dpu_pipe_bench_transcode_")
    tables = {}
    try:
        for subset, idx in subsets.items():
            if not idx:
                continue
            rows = _subset_table(buffers, boxes, trans, idx, exe, work, subset, chunk, repeat)
            tables[subset] = rows
            size = sum(len(buffers[i]) for i in idx) / len(idx) / 1024
            log(f"\n{subset}: {len(idx)} images, {size:.1f} KiB mean, region at min_size 224")
            log(markdown_table(rows, ["method", "img/s", "vs original", "size growth"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return tables


def _assembly(t1, boxes, chunk, repeat):
    """The cost of the approach on restart-1 files: a region decode of the file (header,
    marker scan, assembly, then the sub-stream's decode) against decoding the same sub-stream
    prepared beforehand. Returns (us per image of both, picked indices, sub-streams)."""
    subs = [_jpeg.assemble(t1[i], boxes[i], *MIN_SIZE) for i in range(len(t1))]
    pick = [i for i, sub in enumerate(subs) if sub is not None]

    def via_intervals(a, b):
        for i in pick[a:b]:
            _jpeg.decode(t1[i], boxes[i], MIN_SIZE[0], MIN_SIZE[1], False, False, *BUDGET)

    def prepared(a, b):
        for i in pick[a:b]:
            sub, _, _, (y0, x0) = subs[i]
            top, left, h, w = boxes[i]
            _jpeg.decode(sub, (top - y0, left - x0, h, w), MIN_SIZE[0], MIN_SIZE[1], False,
                         False, *BUDGET, False)

    med = _medians({"region decode of the file": via_intervals,
                    "decode of the prepared sub-stream": prepared}, len(pick), chunk, repeat)
    return {k: 1e6 * v / len(pick) for k, v in med.items()}, pick, subs


def _assembly_report(t1, boxes, chunk, repeat, log):
    """The ``assembly`` record (and the C program's view of the sub-streams, when it builds);
    returns (record, {what: us} of libjpeg on the sub-streams)."""
    per, pick, subs = _assembly(t1, boxes, chunk, repeat)
    whole, sub = per["region decode of the file"], per["decode of the prepared sub-stream"]
    exe, scan_us, c_sub = _anchor_exe(), None, {}
    if exe:
        scan_us = _c_us(exe, "scan", t1, [(0, 0, 0, 0, 8)] * len(t1), repeat)
        files = [subs[i][0] for i in pick]
        regions = [(*subs[i][1], subs[i][2]) for i in pick]
        c_sub = {"entropy decode (jpeg_read_coefficients)": _c_us(exe, "coef", files, regions,
                                                                  repeat),
                 "region decode (C over jpeglib)": _c_us(exe, "region", files, regions, repeat)}
    share = sum(len(subs[i][0]) for i in pick) / sum(len(t1[i]) for i in pick)
    record = {"region_decode_us": whole, "prepared_sub_stream_us": sub,
              "overhead_us": whole - sub, "full_marker_scan_us": scan_us,
              "sub_stream_share": share, "assembled": len(pick)}
    log(f"\nrestart 1, {len(pick)} of {len(t1)} boxes assembled: region decode {whole:.0f} us "
        f"per image, decode of the same sub-stream prepared beforehand {sub:.0f} us: header "
        f"read + marker scan + assembly {whole - sub:.0f} us ({100 * (whole - sub) / whole:.1f}"
        f" %); a marker scan of the whole file alone (C, memchr) "
        f"{scan_us or float('nan'):.1f} us; sub-streams hold {100 * share:.0f} % of the files' "
        f"bytes")
    return record, c_sub


def _e2e_methods(buffers, boxes, trans, idx, seed, chunk):
    """End-to-end methods over the samples idx (sample index = position in the dataset): the
    fused batch kernel over original and transcoded bytes, and Pillow + numpy."""
    proc = BatchProcessor(TransformConfig(train=True, size=224), num_threads=1)
    out = proc.empty(chunk)
    ids = np.asarray(idx, dtype=np.int64)
    flips = [bool(rng.random_flip(seed, 0, i)) for i in range(len(buffers))]

    def kernel(all_bufs):
        bufs = [all_bufs[i] for i in idx]
        return lambda a, b: proc.run(bufs[a:b], ids[a:b], epoch=0, seed=seed, out=out[:b - a])

    def pillow(a, b):
        for j in range(a, b):
            i = int(ids[j])
            pillow_augment(buffers[i], boxes[i], flips[i], out[j - a])

    methods = {"Pillow + numpy": pillow, "batch kernel, original": kernel(buffers)}
    for iv in (1, 4, "row"):
        methods[f"batch kernel, restart {iv}"] = kernel(trans[iv])
    return methods


def _end_to_end(buffers, boxes, trans, subsets, seed, chunk, repeat, log):
    """Rows of the end-to-end table: per subset, img/s and the ratio to the original."""
    rows = {}
    for subset, idx in [("all", list(range(len(buffers))))] + list(subsets.items()):
        if not idx:
            continue
        med = _medians(_e2e_methods(buffers, boxes, trans, idx, seed, chunk), len(idx), chunk,
                       repeat)
        ref = med["batch kernel, original"]
        for k, v in med.items():
            r = rows.setdefault(k, {"method": k})
            r[f"{subset} img/s"] = f"{len(idx) / v:.0f}"
            r[f"{subset} vs original"] = f"{ref / v:.2f}x"
            if subset == "all":
                r["vs Pillow"] = f"{med['Pillow + numpy'] / v:.2f}x"
    rows = list(rows.values())
    log("\nend to end, one thread (decode + RandomResizedCrop + flip + normalize, float32 "
        "3x224x224):")
    log(markdown_table(rows, ["method", "all img/s", "all vs original", "vs Pillow",
                              "baseline img/s", "baseline vs original", "progressive img/s",
                              "progressive vs original"]))
    return rows


def _time_split(buffers, boxes, trans, seed, overhead, c_sub, chunk, repeat, log):
    """Where one image's time goes, restart 1, the kernel's path: {part: us}, total us."""
    n = len(buffers)
    us = {k: 1e6 * v / n for k, v in _medians({
        "decode, original": _region_fn(buffers, boxes),
        "decode, restart 1": _region_fn(trans[1], boxes),
        "kernel, restart 1": _e2e_methods(buffers, boxes, trans, list(range(n)), seed,
                                          chunk)["batch kernel, restart 1"]},
        n, chunk, repeat).items()}
    total = us["kernel, restart 1"]
    split = {"header read + marker scan + assembly": overhead,
             "libjpeg decode of the sub-stream (header, Huffman, IDCT, upsampling, colour)":
                 us["decode, restart 1"] - overhead,
             "resize + flip + normalize": total - us["decode, restart 1"]}
    log(f"\nper image, restart 1, batch kernel: {total:.0f} us (region decode of the "
        f"original: {us['decode, original']:.0f} us)")
    for k, v in split.items():
        log(f"  {k}: {v:.0f} us ({100 * v / total:.0f} %)")
    if c_sub:
        log("  of which libjpeg, by a C program over the same sub-streams: " + ", ".join(
            f"{k} {v:.0f} us" for k, v in c_sub.items()))
    return split, total


def run_benchmark(root, n=1000, repeat=5, chunk=16, seed=0, log=print):
    """Run every table on the first ``n`` JPEGs of the dataset at ``root`` (only read).

    Parameters
    ----------
    root : path
        What :func:`dpu_pipe.tools.harness.load_buffers` reads.
    n, repeat, chunk : int
        Images, rounds, images per turn.
    seed : int
        Of the crop boxes and flips.
    log : callable
        Receives the report's lines.

    Returns
    -------
    dict, JSON-serialisable: ``n``, ``subsets``, ``build``, ``transcode_img_per_s``,
    ``decode`` (rows per subset), ``assembly``, ``sub_stream_libjpeg_us`` (with a C
    compiler), ``end_to_end`` (rows), ``time_split_us`` and ``time_split_total_us``.
    """
    buffers, boxes, subsets = _inputs(root, n, seed)
    result = {"n": len(buffers), "subsets": {k: len(v) for k, v in subsets.items()},
              "build": _jpeg.build_flags()}
    log(f"{len(buffers)} images: {result['subsets']}")
    trans, rate = _transcode_all(buffers, boxes)
    result["transcode_img_per_s"] = {str(k): v for k, v in rate.items()}
    log("transcode rate (img/s, one core, CPU time; 1-std: restart 1 with the standard Huffman "
        "tables): " + ", ".join(f"{k}: {v:.0f}" for k, v in rate.items()))
    result["decode"] = _decode_tables(buffers, boxes, trans, subsets, chunk, repeat, log)
    result["assembly"], c_sub = _assembly_report(trans[1], boxes, chunk, repeat, log)
    if c_sub:
        result["sub_stream_libjpeg_us"] = c_sub
    result["end_to_end"] = _end_to_end(buffers, boxes, trans, subsets, seed, chunk, repeat, log)
    result["time_split_us"], result["time_split_total_us"] = _time_split(
        buffers, boxes, trans, seed, result["assembly"]["overhead_us"], c_sub, chunk, repeat,
        log)
    return result


def main(argv=None):
    """Print the tables (and write them as JSON with --json); returns the exit status."""
    p = argparse.ArgumentParser(prog="bench_transcode.py",
                                description=__doc__.split("\n\n")[0])
    cli.add_data(p, "JPEGs to measure (only read)")
    cli.add_images(p, 1000)
    cli.add_seed(p)
    cli.add_json(p)
    p.add_argument("--repeat", type=cli.positive_int, default=5,
                   help="timing rounds; each table reports the median (default: 5)")
    p.add_argument("--no-pin", action="store_true",
                   help="do not pin the process to one core")
    args = p.parse_args(argv)
    if not args.no_pin:
        pin(True)
    if args.data is None:
        from dpu_pipe.tools.sample_data import sample_dataset
        args.data = sample_dataset(args.images, args.seed)
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json == "-" else print
    result = run_benchmark(args.data, n=args.images, repeat=args.repeat, seed=args.seed,
                           log=log)
    if args.json:
        cli.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
