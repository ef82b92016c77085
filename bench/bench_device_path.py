"""Host time per batch of the two ways a batch reaches the device (``dpu_pipe.device``):

    python bench/bench_device_path.py [--batches 20] [--batch 256] [--size 224]

* ``staging``: ``DeviceStage.send`` copies the batch from the ring buffer (the RMA window
  slot) into a staging buffer, then starts the device copy;
* ``window``: the batch lies in a registered region and the device copy starts from there.

The device runtime is a stand-in whose copies complete at once and move no bytes, so the
numbers are the host-side work of each path alone (on a machine without a GPU the staging
buffers are ordinary memory: pinning does not change memcpy speed on the host). Methods are
interleaved batch by batch; per method the median and min–max of ``time.perf_counter`` per
batch are printed, for bfloat16 channels-last and float32 batches. Numbers only; nothing is
asserted.
"""
import argparse
import statistics
import time

import numpy as np
import torch

from dpu_pipe.device import DeviceStage, PinnedRegion


class Done:
    def query(self):
        return True


class NoCopy:
    """Copies that complete at once; staging buffers are plain memory; registration
    accepted."""

    def empty_pinned(self, like, dtype):
        return torch.empty_like(like, dtype=dtype, device="cpu")

    def copy_to_device(self, src):
        return src, Done()

    def register(self, ptr, nbytes):
        pass

    def unregister(self, ptr):
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args()
    cpu = torch.device("cpu")
    print(f"| batch | MB | staging ms/batch (min-max) | window ms/batch (min-max) |")
    print("|---|---|---|---|")
    for name, np_dtype, view in (("bfloat16 channels_last", np.uint16, torch.bfloat16),
                                 ("float32", np.float32, None)):
        shape = (args.batch, args.size, args.size, 3) if view else \
            (args.batch, 3, args.size, args.size)
        nbytes = int(np.prod(shape)) * np.dtype(np_dtype).itemsize
        mem = np.zeros(nbytes + 8 * args.batch, np.uint8)   # a window slot: images, labels
        images = mem[:nbytes].view(np_dtype).reshape(shape)
        images[...] = np.random.default_rng(0).integers(0, 60000, shape).astype(np_dtype)
        x = torch.from_numpy(images)
        if view is not None:
            x = x.view(view).permute(0, 3, 1, 2)
        y = torch.from_numpy(mem[nbytes:].view(np.int64))
        region = PinnedRegion(NoCopy())
        region.attach(mem)
        staged = DeviceStage(torch, cpu, backend=NoCopy())
        direct = DeviceStage(torch, cpu, backend=NoCopy())
        direct.window = region
        times = {"staging": [], "window": []}
        for _ in range(args.batches + 2):      # the first two fill the staging ring
            for method, stage in (("staging", staged), ("window", direct)):
                t0 = time.perf_counter()
                stage.send(x, y, x.dtype)
                stage.fence()
                times[method].append(time.perf_counter() - t0)
        assert staged.staged and direct.direct and not direct.staged
        cells = []
        for method in ("staging", "window"):
            t = [1e3 * v for v in times[method][2:]]
            cells.append(f"{statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f})")
        print(f"| {args.batch}x3x{args.size}x{args.size} {name} | {nbytes / 1e6:.1f} | "
              f"{cells[0]} | {cells[1]} |")
        region.detach()


if __name__ == "__main__":
    main()
