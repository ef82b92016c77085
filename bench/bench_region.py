"""dpu_pipe's own region decode (dpu_pipe._huffman.decode: the entropy decoder of _huffman.h
and the IDCT, upsampling and colour conversion of _idct.h) against today's region decode over
libjpeg-turbo (dpu_pipe._jpeg.decode), on the crop boxes a training Loader decodes.

    python bench/bench_region.py [--n 200] [--rounds 3] [--seed 0] [--size 224] [--fast]

One core (the calling thread), on the ImageNet-like dataset of real photographs
(dpu_pipe.tools.sample_data), each file transcoded as a pack stores it (baseline, a restart
marker every MCU); each box is torchvision's RandomResizedCrop box of (seed, epoch 0, sample
index), decoded at the smallest power-of-two DCT scale keeping it at least --size pixels (as
the Loader does). Methods interleaved image by image within each round, so machine load falls
on all of them alike. Columns (µs per image, median over rounds):

  box/libjpeg      today's region decode (covering restart intervals assembled into a
                   sub-stream, libjpeg-turbo's Huffman + IDCT + upsampling + colour)
  box/own-entropy  the own entropy decoder alone on the MCUs covering the box
  box/own Ln       the own decoder with the pixel stages' kernels of level n
                   (dpu_pipe._huffman.simd_levels: 0 the scalar reference, 1 the build's
                   baseline SIMD - SSE2 / NEON, 2 AVX2; the decoder runs the highest), falling
                   back to libjpeg-turbo for the boxes it hands over (none here)
  pixels Ln        box/own Ln - box/own-entropy: dequantization, IDCT, upsampling, colour
"""

import argparse

import numpy as np

from dpu_pipe import _huffman, _jpeg, jpeg
from dpu_pipe.rng import random_resized_crop
from dpu_pipe.tools.sample_data import dataset_files, sample_dataset

from bench_entropy import mcu_rect, print_table, time_interleaved  # bench/, beside this one

MAX_PIXELS = 1 << 28


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--fast", action="store_true", help="fast IDCT and plain upsampling")
    args = ap.parse_args(argv)
    paths, _ = dataset_files(sample_dataset(args.n, progress=False))
    items = []
    for i, p in enumerate(paths[:args.n]):
        packed = np.frombuffer(jpeg.transcode(p.read_bytes(), restart_interval=1), np.uint8)
        hdr = _huffman.header(packed)
        box = tuple(int(x) for x in random_resized_crop(args.seed, 0, i, hdr["height"],
                                                         hdr["width"]))
        items.append((packed, box, mcu_rect(hdr, *box)))
    s, fast = args.size, args.fast
    levels = _huffman.simd_levels()
    own_count = 0
    for packed, box, _ in items:
        ref, _ = _jpeg.decode(packed, box, s, s, fast, False, MAX_PIXELS, 100)
        for lv in levels:
            got, _, own = _huffman.decode(packed, box, s, s, fast, False, MAX_PIXELS, 100, lv)
            assert np.array_equal(got, ref), (box, lv)
        own_count += own
    methods = {
        "box/libjpeg": lambda it: _jpeg.decode(it[0], it[1], s, s, fast, False, MAX_PIXELS,
                                               100),
        "box/own-entropy": lambda it: _huffman.read_coefficients(it[0], it[2]),
    }
    for lv in levels:
        methods[f"box/own L{lv}"] = (lambda lv: lambda it: _huffman.decode(
            it[0], it[1], s, s, fast, False, MAX_PIXELS, 100, lv))(lv)
    totals = time_interleaved(methods, items, args.rounds)
    for lv in levels:
        totals[f"pixels L{lv}"] = [a - b for a, b in zip(totals[f"box/own L{lv}"],
                                                         totals["box/own-entropy"])]

    print(f"{len(items)} transcoded records (restart every MCU), {own_count} decoded by the own "
          f"decoder (bit-identical, checked), {args.rounds} rounds, one core, methods "
          f"interleaved per image, min size {s}, fast={fast}")
    med = print_table(totals)
    own = f"box/own L{levels[-1]}"
    print(f"own / libjpeg speed = {med['box/libjpeg'] / med[own]:.2f}x; entropy is "
          f"{med['box/own-entropy'] / med[own]:.0%} of the own decode ({own})")


if __name__ == "__main__":
    main()
