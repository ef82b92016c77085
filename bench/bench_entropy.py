"""Entropy (Huffman) decoding rate of dpu_pipe's own decoder (dpu_pipe._huffman) against
libjpeg-turbo's (jpeg_read_coefficients through tests/kernels/_coef_probe.pyx), and what a
RandomResizedCrop box costs in entropy decoding alone against today's whole region decode.

    python bench/bench_entropy.py [--n 200] [--rounds 3] [--seed 0]

One core (the calling thread), on the ImageNet-like dataset of real photographs
(dpu_pipe.tools.sample_data), methods interleaved image by image within each round so machine
load falls on all of them alike. Columns (µs per image, median over rounds):

  whole/libjpeg    jpeg_read_coefficients of the original file (libjpeg-turbo's entropy decode)
  whole/own        the same coefficients from dpu_pipe._huffman
  box/region       today's region decode of a crop box from the restart-per-MCU transcoded
                   file (dpu_pipe.jpeg.decode: restart intervals assembled, libjpeg-turbo's
                   Huffman + IDCT + colour, full scale)
  box/own-entropy  dpu_pipe._huffman's coefficients of the MCUs covering that box, read from
                   the covering intervals (entropy only; no IDCT or colour yet)

With --lanes L1,L2,... the box is decoded once per lane count instead (box/K=<L>: that many
restart intervals interleaved per thread), and the original files (no restart markers) are
decoded from their scan start up to the bottom of each crop box, one image at a time
(orig-crop/1) and --group images at a time interleaved (orig-crop/batch=<L>,
read_coefficients_batch with L lanes; µs per image). These two tables are CPU time of the
process (time.process_time), so other jobs on a shared machine do not inflate them.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import kernel_probes  # noqa: E402
from dpu_pipe import _huffman, jpeg  # noqa: E402
from dpu_pipe.rng import random_resized_crop  # noqa: E402
from dpu_pipe.tools.sample_data import dataset_files, sample_dataset  # noqa: E402


def mcu_rect(hdr, top, left, height, width):
    """The MCU rectangle (row0, row1, col0, col1), ends exclusive, covering a pixel box."""
    comps = hdr["components"]
    mh = 8 * (max(v for _, _, v, _ in comps) if len(comps) > 1 else 1)
    mw = 8 * (max(h for _, h, _, _ in comps) if len(comps) > 1 else 1)
    return top // mh, -(-(top + height) // mh), left // mw, -(-(left + width) // mw)


def time_interleaved(methods, items, rounds, clock=time.perf_counter):
    """{method: [µs per item of each round]}: every method runs on an item before the next
    item, so machine noise falls on all of them alike; the order rotates from item to item,
    so no method is always the one that brings the item into the cache. ``clock``: wall
    time, or ``time.process_time`` for the CPU time of this process alone (other jobs
    excluded)."""
    totals = {m: [] for m in methods}
    names = list(methods)
    for _ in range(rounds):
        acc = dict.fromkeys(methods, 0.0)
        for j, it in enumerate(items):
            for m in names[j % len(names):] + names[:j % len(names)]:
                fn = methods[m]
                t0 = clock()
                fn(it)
                acc[m] += clock() - t0
        for m in methods:
            totals[m].append(acc[m] / len(items) * 1e6)
    return totals


def print_table(totals):
    """Print the median and every round of each method; returns {method: median µs}."""
    print(f"{'method':<18}{'median µs/img':>14}{'rounds':>30}")
    for m, v in totals.items():
        print(f"{m:<18}{statistics.median(v):>14.0f}   " + " ".join(f"{x:.0f}" for x in v))
    return {m: statistics.median(v) for m, v in totals.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lanes", help="comma-separated lane counts to compare, e.g. 1,2,4,8")
    ap.add_argument("--group", type=int, default=8, help="images per batch (with --lanes)")
    args = ap.parse_args(argv)
    probe = kernel_probes.load("_coef_probe")
    paths, _ = dataset_files(sample_dataset(args.n, progress=False))
    items = []
    for i, p in enumerate(paths[:args.n]):
        data = np.frombuffer(p.read_bytes(), np.uint8)
        if _huffman.header(data) is None:
            continue     # progressive files: libjpeg-turbo's path
        packed = np.frombuffer(jpeg.transcode(data.tobytes(), restart_interval=1), np.uint8)
        hdr = _huffman.header(packed)
        top, left, h, w = (int(x) for x in random_resized_crop(args.seed, 0, i, hdr["height"],
                                                                hdr["width"]))
        items.append((data, packed, (top, left, h, w), mcu_rect(hdr, top, left, h, w),
                      mcu_rect(_huffman.header(data), top, left, h, w)))
    if args.lanes:
        return compare_lanes(items, [int(x) for x in args.lanes.split(",")], args)
    methods = {
        "whole/libjpeg": lambda it: probe.coefficients(it[0]),
        "whole/own": lambda it: _huffman.read_coefficients(it[0]),
        "box/region": lambda it: jpeg.decode(it[1], region=it[2]),
        "box/own-entropy": lambda it: _huffman.read_coefficients(it[1], it[3]),
    }
    totals = time_interleaved(methods, items, args.rounds)
    print(f"{len(items)} baseline images of {args.n} (progressive ones left out), "
          f"{args.rounds} rounds, one core, methods interleaved per image")
    med = print_table(totals)
    print(f"whole: own / libjpeg speed = {med['whole/libjpeg'] / med['whole/own']:.2f}x; "
          f"box: own entropy is {med['box/own-entropy'] / med['box/region']:.0%} of today's "
          f"region decode")


def compare_lanes(items, lanes, args):
    """box/K=<L> over the transcoded files, orig-crop/* over groups of the original files."""
    for it in items:     # every lane count gives the same coefficients
        ref = _huffman.read_coefficients(it[1], it[3], lanes=1)
        for k in lanes:
            got = _huffman.read_coefficients(it[1], it[3], lanes=k)
            assert all(np.array_equal(a, b) for a, b in zip(ref, got))
    methods = {f"box/K={k}": (lambda it, k=k: _huffman.read_coefficients(it[1], it[3], lanes=k))
               for k in lanes}
    totals = time_interleaved(methods, items, args.rounds, time.process_time)
    print(f"{len(items)} transcoded records (restart every MCU), crop boxes' MCUs, entropy "
          f"only, {args.rounds} rounds, one core, methods interleaved per image, CPU time")
    print_table(totals)
    g = args.group
    groups = [([it[0] for it in items[i:i + g]], [it[4] for it in items[i:i + g]])
              for i in range(0, len(items) - g + 1, g)]
    methods = {"orig-crop/1": lambda gr: [_huffman.read_coefficients(d, r, lanes=1)
                                          for d, r in zip(*gr)]}
    methods.update({f"orig-crop/batch={k}": (lambda gr, k=k: _huffman.read_coefficients_batch(
        gr[0], gr[1], lanes=k)) for k in lanes if k > 1})
    totals = time_interleaved(methods, groups, args.rounds, time.process_time)
    totals = {m: [x / g for x in v] for m, v in totals.items()}
    print(f"{len(groups) * g} original files (no restart markers) in groups of {g}, scan start "
          f"to the bottom of the crop box, µs per image")
    print_table(totals)


if __name__ == "__main__":
    main()
