"""bfloat16 batches: written by the kernel against float32 from the kernel converted by torch
(``.to(torch.bfloat16)``), one thread, methods alternating every round
(``dpu_pipe.tools.harness.interleaved``); median and min-max of the rounds. Not run by
pytest: ``python bench/bench_bfloat16.py --data DIR [-n N]``."""

import argparse

import numpy as np
import torch

from dpu_pipe.kernel import BatchProcessor
from dpu_pipe.tools.harness import interleaved, load_buffers, rate_stats
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
    for fn in methods.values():
        fn()                                # warm-up
    times = interleaved({name: (lambda fn: lambda a, b: fn())(fn)
                         for name, fn in methods.items()}, 1, chunk=1, repeat=args.repeat)
    print(f"{n} images, batches of {BATCH}, one thread, {args.repeat} rounds\n")
    print("| method | img/s | min–max |\n|---|---:|---:|")
    for name, ts in times.items():
        med, lo, hi = rate_stats(ts, n)
        print(f"| {name} | {med:.0f} | {lo:.0f}–{hi:.0f} |")


if __name__ == "__main__":
    main()
