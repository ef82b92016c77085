"""The Gaussian blur of the self-supervised recipes (SimCLR, BYOL, DINO) on one 224x224 RGB view:
dpu_pipe.ops.gaussian_blur against torchvision v2's gaussian_blur (uint8 tensor) and Pillow's
ImageFilter.GaussianBlur.

    python bench/bench_blur.py [--rounds 5] [--n 8] [--cpu 0] [--no-pin] [--json]

One core: the process is pinned to --cpu and torch to one thread. Images are photographs
(scikit-image's, resampled to 224x224); methods run interleaved image by image within each
round, the order rotating from image to image, so machine load falls on all alike. Columns: µs
per image, median over rounds, per (kernel_size, sigma): 23 is SimCLR's (10 % of 224, odd),
sigma drawn from 0.1..2.0 in the recipes. Pillow's filter is its own approximation (three box
blurs of the radius ``sigma``, not a truncated kernel): the same job, not the same output.
"""

import argparse
import json
import os
import statistics

import numpy as np

from dpu_pipe import ops
from dpu_pipe.tools.plan import cpu_name

from bench_region import per_item

SIZE = 224
CASES = [(3, 1.0), (9, 1.0), (23, 1.0), (23, 2.0)]


def photos(n):
    import cv2
    import skimage.data

    names = ("astronaut", "coffee", "chelsea", "rocket")
    out = []
    for i in range(n):
        src = np.ascontiguousarray(getattr(skimage.data, names[i % 4])()[..., :3])
        out.append(np.ascontiguousarray(cv2.resize(src, (SIZE, SIZE),
                                                   interpolation=cv2.INTER_AREA)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=8, help="images per round")
    ap.add_argument("--cpu", type=int, default=0, help="core to pin to")
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--json", action="store_true", help="JSON on stdout instead of a table")
    args = ap.parse_args(argv)
    if not args.no_pin:
        os.sched_setaffinity(0, {args.cpu})
    import torch
    from PIL import Image, ImageFilter
    from torchvision.transforms.v2 import functional as F

    torch.set_num_threads(1)
    imgs = photos(args.n)
    items = [(a, torch.from_numpy(a).permute(2, 0, 1).contiguous(), Image.fromarray(a))
             for a in imgs]
    out = np.empty((SIZE, SIZE, 3), np.uint8)
    result = {"cpu": cpu_name(), "size": SIZE, "rounds": args.rounds, "n": args.n,
              "pinned": None if args.no_pin else args.cpu, "us_per_image": {}}
    for k, s in CASES:
        methods = {
            "dpu_pipe": lambda it: ops.gaussian_blur(it[0], k, s, out=out),
            "torchvision": lambda it: F.gaussian_blur(it[1], [k, k], [s, s]),
            "pillow": lambda it: it[2].filter(ImageFilter.GaussianBlur(s)),
        }
        for m in methods.values():      # warm-up: first calls allocate and load code
            m(items[0])
        times = per_item(methods, items, args.rounds)
        result["us_per_image"][f"k{k}-s{s}"] = {m: statistics.median(v) for m, v in times.items()}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{result['cpu']}, {SIZE}x{SIZE} RGB, one core, µs per image (median of "
          f"{args.rounds} rounds of {args.n} images)")
    print(f"{'kernel, sigma':14s} {'dpu_pipe':>10s} {'torchvision':>12s} {'pillow':>10s} "
          f"{'tv/dpu':>7s} {'pil/dpu':>8s}")
    for case, r in result["us_per_image"].items():
        print(f"{case:14s} {r['dpu_pipe']:10.0f} {r['torchvision']:12.0f} {r['pillow']:10.0f} "
              f"{r['torchvision'] / r['dpu_pipe']:7.1f} {r['pillow'] / r['dpu_pipe']:8.1f}")


if __name__ == "__main__":
    main()
