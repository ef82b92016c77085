"""The region decode over libjpeg-turbo (dpu_pipe._jpeg.decode) on the crop boxes a training
Loader decodes, from the restart intervals covering each box and by the plain region decode.

    python bench/bench_region.py [--n 200] [--rounds 3] [--seed 0] [--size 224] [--fast]

One core (the calling thread), on the ImageNet-like dataset of real photographs
(dpu_pipe.tools.sample_data), each file transcoded as a pack stores it (baseline, a restart
marker every MCU); each box is torchvision's RandomResizedCrop box of (seed, epoch 0, sample
index), decoded at the smallest power-of-two DCT scale keeping it at least --size pixels (as
the Loader does). Methods interleaved image by image within each round (the order rotating
from image to image), so machine load falls on both alike. Columns (µs per image, median over
rounds):

  box/intervals  the covering restart intervals assembled into a sub-stream, then
                 libjpeg-turbo's Huffman + IDCT + upsampling + colour (what the Loader runs)
  box/plain      the plain region decode: crop the columns, skip the rows above, stop after
                 the last (every MCU row above the box entropy-decoded)
"""

import argparse
import statistics

import numpy as np

from dpu_pipe import _jpeg, jpeg
from dpu_pipe.rng import random_resized_crop
from dpu_pipe.tools.harness import interleaved
from dpu_pipe.tools.sample_data import dataset_files, sample_dataset

MAX_PIXELS = 1 << 28


def per_item(methods, items, rounds):
    """{method: [µs per item of each round]} of ``fn(item)`` methods, timed by the harness
    item by item (the order rotating from item to item, so that no method always brings the
    item into the cache)."""
    times = interleaved({m: (lambda fn: lambda start, stop: fn(items[start]))(fn)
                         for m, fn in methods.items()}, len(items), chunk=1, repeat=rounds)
    return {m: [t / len(items) * 1e6 for t in v] for m, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--fast", action="store_true", help="fast IDCT and plain upsampling")
    args = ap.parse_args(argv)
    paths, _ = dataset_files(sample_dataset(args.n, progress=False))
    s, fast = args.size, args.fast
    items = []
    for i, p in enumerate(paths[:args.n]):
        packed = np.frombuffer(jpeg.transcode(p.read_bytes(), restart_interval=1), np.uint8)
        hdr = jpeg.read_header(packed)
        box = tuple(int(x) for x in random_resized_crop(args.seed, 0, i, hdr.height,
                                                         hdr.width))
        a = _jpeg.decode(packed, box, s, s, fast, False, MAX_PIXELS, 100, True)
        b = _jpeg.decode(packed, box, s, s, fast, False, MAX_PIXELS, 100, False)
        assert np.array_equal(a[0], b[0]) and a[1] == b[1], box
        items.append((packed, box))
    methods = {
        "box/intervals": lambda it: _jpeg.decode(it[0], it[1], s, s, fast, False, MAX_PIXELS,
                                                 100, True),
        "box/plain": lambda it: _jpeg.decode(it[0], it[1], s, s, fast, False, MAX_PIXELS,
                                             100, False),
    }
    totals = per_item(methods, items, args.rounds)
    print(f"{len(items)} transcoded records (restart every MCU), both paths bit-identical "
          f"(checked), {args.rounds} rounds, one core, methods interleaved per image, min "
          f"size {s}, fast={fast}")
    print(f"{'method':<16}{'median µs/img':>14}{'rounds':>30}")
    for m, v in totals.items():
        print(f"{m:<16}{statistics.median(v):>14.0f}   " + " ".join(f"{x:.0f}" for x in v))
    med = {m: statistics.median(v) for m, v in totals.items()}
    print(f"plain / intervals time = {med['box/plain'] / med['box/intervals']:.2f}x")


if __name__ == "__main__":
    main()
