"""bfloat16 batches: written by the kernel against float32 from the kernel converted by torch
(``.to(torch.bfloat16)``), one thread, methods alternating every round; median and min-max of
the rounds. Not run by pytest: ``python bench/bench_bfloat16.py --data DIR [-n N]``."""

import argparse
import statistics
import time

import numpy as np
import torch

from dpu_pipe.batch import BatchProcessor
from dpu_pipe.tools.bench_decode import load_buffers
from dpu_pipe.tools.sample_data import sample_dataset
from dpu_pipe.transforms import TransformConfig

BATCH = 64


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", help="JPEG dataset (default: the generated ImageNet-like one)")
    p.add_argument("-n", "--images", type=int, default=256, help="images (default: 256)")
    p.add_argument("--repeat", type=int, default=5, help="rounds (default: 5)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    _, bufs = load_buffers(args.data or sample_dataset(args.images), args.images)
    n, idx = len(bufs), np.arange(len(bufs))
    f32 = BatchProcessor(TransformConfig(size=224), 1)
    bf = BatchProcessor(TransformConfig(size=224, dtype="bfloat16"), 1)
    out32, outbf = f32.empty(BATCH), bf.empty(BATCH)

    def convert_after():
        for s in range(0, n, BATCH):
            k = min(BATCH, n - s)
            f32.run(bufs[s:s + k], idx[s:s + k], out=out32[:k])
            torch.from_numpy(out32[:k]).to(torch.bfloat16)

    def in_kernel():
        for s in range(0, n, BATCH):
            k = min(BATCH, n - s)
            bf.run(bufs[s:s + k], idx[s:s + k], out=outbf[:k])
            torch.from_numpy(outbf[:k]).view(torch.bfloat16)

    methods = {"float32 kernel + torch .to(bfloat16)": convert_after,
               "bfloat16 kernel": in_kernel}
    times = {name: [] for name in methods}
    for fn in methods.values():
        fn()                                # warm-up
    for r in range(args.repeat):
        order = list(methods) if r % 2 == 0 else list(methods)[::-1]
        for name in order:
            t0 = time.perf_counter()
            methods[name]()
            times[name].append(time.perf_counter() - t0)
    print(f"{n} images, batches of {BATCH}, one thread, {args.repeat} rounds\n")
    print("| method | img/s | min–max |\n|---|---:|---:|")
    for name, ts in times.items():
        rates = [n / t for t in ts]
        print(f"| {name} | {statistics.median(rates):.0f} | {min(rates):.0f}–{max(rates):.0f} |")


if __name__ == "__main__":
    main()
