"""What lossless transcoding to restart intervals buys: file size against region-decode speed.

    dpu-pipe bench-transcode [-n 1000] [--repeat 5] [--data PATH] [--json [PATH]]

On an ImageNet-like dataset made from real photographs (:mod:`dpu_pipe.tools.sample_data`),
one process pinned to one core, file bytes in memory, the crop boxes of RandomResizedCrop
(dpu_pipe's own RNG, the boxes the batch kernel draws) decoded at ``min_size=(224, 224)`` as
the batch kernel does. Every table interleaves its methods chunk by chunk, round by round, and
reports the median round:

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

from .. import _jpeg, jpeg, rng
from ..batch import BatchProcessor
from ..transforms import TransformConfig
from . import pinning
from .bench_decode import load_buffers
from .bench_augment import _baselines

MIN_SIZE = (224, 224)
INTERVALS = (1, 2, 4, "row")
BUDGET = (jpeg.DEFAULT_MAX_PIXELS, jpeg.DEFAULT_MAX_SCANS)

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


def _interleaved(methods, n, chunk, repeat):
    """{name: median seconds over all n images}: methods take turns every `chunk` images, the
    first method of each round rotating. Seconds of this thread's CPU time: two cores shared
    by many processes preempt a wall clock far more than they slow a method down."""
    names = list(methods)
    times = {k: [] for k in names}
    for rnd in range(repeat):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        spent = dict.fromkeys(names, 0.0)
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            for k in order:
                fn = methods[k]
                t0 = time.thread_time()
                fn(start, stop)
                spent[k] += time.thread_time() - t0
        for k in names:
            times[k].append(spent[k])
    return {k: statistics.median(v) for k, v in times.items()}, times


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


def _table(rows, cols):
    widths = [max(len(str(r.get(c, ""))) for r in rows + [dict(zip(cols, cols))]) for c in cols]
    line = lambda r: "| " + " | ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)) + " |"
    return "\n".join([line(dict(zip(cols, cols))), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [line(r) for r in rows])


def run_benchmark(root, n=1000, repeat=5, chunk=16, seed=0, log=print):
    """Run every table on the first ``n`` JPEGs of the dataset at ``root`` (only read)."""
    buffers = load_buffers(root, n)[1]
    headers = [jpeg.read_header(b) for b in buffers]
    boxes = [tuple(int(v) for v in rng.random_resized_crop(seed, 0, i, h.height, h.width))
             for i, h in enumerate(headers)]
    subsets = {"baseline": [i for i, h in enumerate(headers) if not h.progressive],
               "progressive": [i for i, h in enumerate(headers) if h.progressive]}
    result = {"n": len(buffers), "subsets": {k: len(v) for k, v in subsets.items()},
              "build": _jpeg.build_flags()}
    log(f"{len(buffers)} images: {result['subsets']}")

    # Transcoding: every interval, timed (one core), sizes.
    trans, t_rate = {}, {}
    for iv in INTERVALS + ("1-std",):
        t0 = time.thread_time()
        if iv == "1-std":
            trans[iv] = [jpeg.transcode(b, restart_interval=1, optimize=False) for b in buffers]
        else:
            trans[iv] = [jpeg.transcode(b, restart_interval=iv) for b in buffers]
        t_rate[iv] = len(buffers) / (time.thread_time() - t0)
    result["transcode_img_per_s"] = {str(k): v for k, v in t_rate.items()}
    log("transcode rate (img/s, one core, CPU time; 1-std: restart 1 with the standard Huffman "
        "tables): " + ", ".join(f"{k}: {v:.0f}" for k, v in t_rate.items()))

    # The transcoded files decode to the same region pixels (a sample of them, before timing).
    for i in range(0, len(buffers), max(1, len(buffers) // 50)):
        ref = jpeg.decode(buffers[i], region=boxes[i], min_size=MIN_SIZE)
        for iv in INTERVALS:
            assert np.array_equal(jpeg.decode(trans[iv][i], region=boxes[i], min_size=MIN_SIZE),
                                  ref), (i, iv)

    exe = _anchor_exe()
    work = tempfile.mkdtemp(prefix="dpu_pipe_bench_transcode_")
    tables = {}
    try:
        for subset, idx in subsets.items():
            if not idx:
                continue
            orig = [buffers[i] for i in idx]
            bx = [boxes[i] for i in idx]
            m = len(idx)
            size0 = sum(map(len, orig))
            methods = {"Pillow full decode + crop": _pillow_region_fn(orig, bx),
                       "region decode, original": _region_fn(orig, bx)}
            for iv in INTERVALS + ("1-std",):
                tr = [trans[iv][i] for i in idx]
                methods[f"region decode, restart {iv}"] = _region_fn(tr, bx)
            methods["restart 1, plain region decode"] = _region_fn([trans[1][i] for i in idx],
                                                                  bx, False)
            anchors = {}
            if exe:
                regions = [_scaled_region(b, x) for b, x in zip(orig, bx)]
                anchors["C region decode over jpeglib, original"] = _anchor_fn(
                    exe, "region", orig, regions, work, subset + "-orig")
                anchors["C region decode over jpeglib, restart 1 (plain)"] = _anchor_fn(
                    exe, "region", [trans[1][i] for i in idx], regions, work, subset + "-t1")
            # One anchor pass per round, between the rounds of the Python methods.
            med, rounds = {}, {k: [] for k in methods}
            for rnd in range(repeat):
                for fn, _ in anchors.values():
                    fn()
                one, _ = _interleaved(methods, m, chunk, 1)
                for k, v in one.items():
                    rounds[k].append(v)
            med = {k: statistics.median(v) for k, v in rounds.items()}
            for k, (_, secs) in anchors.items():
                med[k] = statistics.median(secs)
            ref = med["region decode, original"]
            rows = []
            for k, v in med.items():
                iv = next((x for x in INTERVALS + ("1-std",)
                           if k == f"region decode, restart {x}"), None)
                grow = (sum(len(trans[iv][i]) for i in idx) / size0 - 1) if iv else None
                rows.append({"method": k, "img/s": f"{m / v:.0f}", "vs original": f"{ref / v:.2f}x",
                             "size growth": f"{100 * grow:+.1f} %" if grow is not None else ""})
            tables[subset] = rows
            log(f"\n{subset}: {m} images, {size0 / m / 1024:.1f} KiB mean, region at min_size 224")
            log(_table(rows, ["method", "img/s", "vs original", "size growth"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["decode"] = tables

    # The cost of the approach: a region decode of a restart-1 file (header, marker scan,
    # assembly, then the sub-stream's decode) against decoding the same sub-stream prepared
    # beforehand; the difference is the header read, the scan and the copy.
    t1 = trans[1]
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

    med, _ = _interleaved({"region decode of the file": via_intervals,
                           "decode of the prepared sub-stream": prepared}, len(pick), chunk,
                          repeat)
    per = {k: 1e6 * v / len(pick) for k, v in med.items()}
    overhead = per["region decode of the file"] - per["decode of the prepared sub-stream"]
    scan_us, c_sub = None, {}
    if exe:
        def c_us(mode, files, regions):
            path = os.path.join(tempfile.gettempdir(), f"dpu_pipe_{mode}_{os.getpid()}.bin")
            try:
                _blob(path, files, regions)
                return 1e6 * statistics.median(
                    float(subprocess.run([exe, mode, path], capture_output=True, text=True,
                                         check=True).stdout.split()[0])
                    for _ in range(repeat)) / len(files)
            finally:
                os.unlink(path)
        scan_us = c_us("scan", t1, [(0, 0, 0, 0, 8)] * len(t1))
        # libjpeg's own work on the sub-streams: entropy decoding alone, and the region decode
        sub_files = [subs[i][0] for i in pick]
        sub_regions = [(*subs[i][1], subs[i][2]) for i in pick]
        c_sub = {"entropy decode (jpeg_read_coefficients)": c_us("coef", sub_files, sub_regions),
                 "region decode (C over jpeglib)": c_us("region", sub_files, sub_regions)}
        result["sub_stream_libjpeg_us"] = c_sub
    result["assembly"] = {"region_decode_us": per["region decode of the file"],
                          "prepared_sub_stream_us": per["decode of the prepared sub-stream"],
                          "overhead_us": overhead, "full_marker_scan_us": scan_us,
                          "sub_stream_share": sum(len(subs[i][0]) for i in pick)
                          / sum(len(t1[i]) for i in pick), "assembled": len(pick)}
    log(f"\nrestart 1, {len(pick)} of {len(t1)} boxes assembled: region decode "
        f"{per['region decode of the file']:.0f} us per image, decode of the same sub-stream "
        f"prepared beforehand {per['decode of the prepared sub-stream']:.0f} us: header read + "
        f"marker scan + assembly {overhead:.0f} us "
        f"({100 * overhead / per['region decode of the file']:.1f} %); a marker scan of the "
        f"whole file alone (C, memchr) {scan_us or float('nan'):.1f} us; sub-streams hold "
        f"{100 * result['assembly']['sub_stream_share']:.0f} % of the files' bytes")

    # End to end: the fused batch kernel, original vs transcoded bytes, Pillow + numpy anchor.
    cfg = TransformConfig(train=True, size=224)
    proc = BatchProcessor(cfg, num_threads=1)
    flips = [bool(rng.random_flip(seed, 0, i)) for i in range(len(buffers))]
    pil = _baselines(buffers, boxes, flips)["Pillow + numpy"]
    out = proc.empty(chunk)

    def e2e(idx):
        """Methods over the samples idx (sample index = position in the dataset)."""
        ids = np.asarray(idx, dtype=np.int64)

        def kernel(all_bufs):
            bufs = [all_bufs[i] for i in idx]

            def run(a, b):
                proc.run(bufs[a:b], ids[a:b], epoch=0, seed=seed, out=out[:b - a])
            return run

        def pillow(a, b):
            for j in range(a, b):
                pil(int(ids[j]), out[j - a])

        methods = {"Pillow + numpy": pillow, "batch kernel, original": kernel(buffers)}
        for iv in (1, 4, "row"):
            methods[f"batch kernel, restart {iv}"] = kernel(trans[iv])
        return methods

    rows = {}
    for subset, idx in [("all", list(range(len(buffers))))] + list(subsets.items()):
        if not idx:
            continue
        med, _ = _interleaved(e2e(idx), len(idx), chunk, repeat)
        ref = med["batch kernel, original"]
        for k, v in med.items():
            r = rows.setdefault(k, {"method": k})
            r[f"{subset} img/s"] = f"{len(idx) / v:.0f}"
            r[f"{subset} vs original"] = f"{ref / v:.2f}x"
            if subset == "all":
                r["vs Pillow"] = f"{med['Pillow + numpy'] / v:.2f}x"
    rows = list(rows.values())
    result["end_to_end"] = rows
    log("\nend to end, one thread (decode + RandomResizedCrop + flip + normalize, float32 "
        "3x224x224):")
    log(_table(rows, ["method", "all img/s", "all vs original", "vs Pillow",
                      "baseline img/s", "baseline vs original", "progressive img/s",
                      "progressive vs original"]))

    # Where one image's time goes, restart 1, the kernel's path.
    dec = {k: v for k, v in _interleaved({
        "decode, original": _region_fn(buffers, boxes),
        "decode, restart 1": _region_fn(t1, boxes),
        "kernel, restart 1": e2e(list(range(len(buffers))))["batch kernel, restart 1"]},
        len(buffers), chunk, repeat)[0].items()}
    us = {k: 1e6 * v / len(buffers) for k, v in dec.items()}
    split = {"header read + marker scan + assembly": overhead,
             "libjpeg decode of the sub-stream (header, Huffman, IDCT, upsampling, colour)":
                 us["decode, restart 1"] - overhead,
             "resize + flip + normalize": us["kernel, restart 1"] - us["decode, restart 1"]}
    result["time_split_us"] = split
    result["time_split_total_us"] = us["kernel, restart 1"]
    log(f"\nper image, restart 1, batch kernel: {us['kernel, restart 1']:.0f} us "
        f"(region decode of the original: {us['decode, original']:.0f} us)")
    for k, v in split.items():
        log(f"  {k}: {v:.0f} us ({100 * v / us['kernel, restart 1']:.0f} %)")
    if c_sub:
        log("  of which libjpeg, by a C program over the same sub-streams: " + ", ".join(
            f"{k} {v:.0f} us" for k, v in c_sub.items()))
    return result


def add_args(p):
    from .cli import add_data, add_images, add_json, add_seed, positive_int

    add_data(p, "JPEGs to measure (only read)")
    add_images(p, 1000)
    add_seed(p)
    add_json(p)
    p.add_argument("--repeat", type=positive_int, default=5,
                   help="timing rounds; each table reports the median (default: 5)")
    p.add_argument("--no-pin", action="store_true",
                   help="do not pin the process to one core")


def run(args):
    from .cli import write_json
    from .sample_data import sample_dataset

    if not args.no_pin:
        pinning.pin(True)
    root = args.data or sample_dataset(args.images, args.seed)
    result = run_benchmark(root, n=args.images, repeat=args.repeat, seed=args.seed)
    if args.json:
        write_json(args.json, result)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
