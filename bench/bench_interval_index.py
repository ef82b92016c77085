"""What the packed restart-interval index saves the own region decoder: a RandomResizedCrop
box of each record of a transcoded pack, decoded by dpu_pipe._huffman.decode_box after the
marker scan and from the record's index entry.

    python bench/bench_interval_index.py [--n 200] [--rounds 3] [--seed 0]

One core (the calling thread), on the ImageNet-like dataset of real photographs packed with a
restart marker every MCU, methods interleaved image by image within each round; CPU time of
the thread, so that a shared machine's preemptions do not land on one method. Columns (µs per
image, median over rounds):

  locate/scan    hp_find_intervals over the whole record (_huffman.find_intervals)
  locate/index   the index entry decoded and checked against the record (interval_offsets)
  box/scan       decode_box of the box at the DCT scale Loader would pick for 224 output,
                 intervals from the marker scan (up to the last one the box needs)
  box/index      the same box, intervals from the index entry
"""

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_entropy import print_table, time_interleaved  # noqa: E402
from dpu_pipe import _huffman, jpeg  # noqa: E402
from dpu_pipe.packed.writer import pack  # noqa: E402
from dpu_pipe.rng import random_resized_crop  # noqa: E402
from dpu_pipe.sources import FileList  # noqa: E402
from dpu_pipe.tools.sample_data import dataset_files, sample_dataset  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    paths, labels = dataset_files(sample_dataset(args.n, progress=False))
    rows = [(str(p), int(y)) for p, y in zip(paths[:args.n], labels[:args.n])]
    with tempfile.TemporaryDirectory() as tmp:
        ds = pack(FileList(rows), os.path.join(tmp, "ds"), progress=False).dataset
        items = []
        for i in range(len(ds)):
            entry = ds.interval_entry(i)
            if entry is None:
                continue
            rec = np.frombuffer(ds.record(i), np.uint8)
            hdr = _huffman.header(rec)
            H, W = hdr["height"], hdr["width"]
            top, left, h, w = (int(x) for x in random_resized_crop(args.seed, 0, i, H, W))
            scale = jpeg.choose_scale(h, w, (224, 224))
            sh, sw = -(-H * scale // 8), -(-W * scale // 8)
            t, l = top * scale // 8, left * scale // 8
            box = (t, l, min(-(-(top + h) * scale // 8), sh) - t,
                   min(-(-(left + w) * scale // 8), sw) - l)
            items.append((rec, bytes(entry), box, scale))
        methods = {
            "locate/scan": lambda it: _huffman.find_intervals(it[0]),
            "locate/index": lambda it: _huffman.interval_offsets(it[0], it[1]),
            "box/scan": lambda it: _huffman.decode_box(it[0], it[2], it[3]),
            "box/index": lambda it: _huffman.decode_box(it[0], it[2], it[3], intervals=it[1]),
        }
        for it in items:
            a = _huffman.decode_box(it[0], it[2], it[3])
            b = _huffman.decode_box(it[0], it[2], it[3], intervals=it[1])
            assert (a is None) == (b is None) and (a is None or np.array_equal(a, b))
        totals = time_interleaved(methods, items, args.rounds, clock=time.thread_time)
        print(f"{len(items)} records with an interval index of {len(ds)}, {args.rounds} "
              f"rounds, one core, methods interleaved per image; load average "
              f"{os.getloadavg()[0]:.1f}")
        med = print_table(totals)
        print(f"index vs scan: locating {med['locate/scan'] - med['locate/index']:.1f} µs "
              f"less per image, box decode {med['box/scan'] / med['box/index']:.3f}x")


if __name__ == "__main__":
    main()
