"""Images per second on one core for the self-supervised multi-view recipes: dpu_pipe's views
(one decode per sample, every view cut from it) against torchvision, per image of the dataset
(so a DINO image is its 2 + 8 views).

Methods:
  dino      dpu_pipe.views.dino()
  dino-pil  DINO's DataAugmentationDINO as facebookresearch/dino writes it (torchvision v1
            transforms on PIL images, Pillow's GaussianBlur of radius U(0.1, 2), ImageOps
            solarize), PIL decode
  dino-v2   the same recipe with torchvision.transforms.v2 on uint8 tensors
            (torchvision.io.decode_jpeg; GaussianBlur(9, (0.1, 2)) as DINOv2 writes it)
  simclr    dpu_pipe.views.simclr()
  simclr-v2 SimCLR's two views with torchvision.transforms.v2 on uint8 tensors: RRC(224), flip,
            ColorJitter(0.8, 0.8, 0.8, 0.2) p 0.8, grayscale p 0.2, GaussianBlur(23, (0.1, 2))
            p 0.5
  dino-v2-ftz, simclr-v2-ftz  the same under torch.set_flush_denormal(True). v2's blur is one
            2-D convolution whose outer weights (products of two small 1-D weights) are
            subnormal at most sigmas; on CPUs that take a microcode assist per subnormal
            operand (Intel's) it runs several times slower than with them flushed
  dino-cache, simclr-cache  the presets with decode_max_side=256 and a decoded-sample cache
            holding every sample (epochs >= 2 of a cached run: no decode)
  simclr-pack  dpu_pipe.views.simclr() on the same files transcoded as `dpu-pipe pack` stores
            them (a restart marker every MCU: the region decode reads fewer bytes)
  simclr-crops  SimCLR's two crops, flipped and normalized, with no colour op and no blur: the
            decode and resampling alone, a bound on what any SimCLR implementation that
            decodes the same region can reach against the baseline
  classic   dpu_pipe's classic recipe (RRC 224 + flip), for a DINO sample's cost against a
            classic sample's

Every method ends in float32 normalized (CHW) batches of 32 per view, torch tensors stacked as
a DataLoader's collate would. One core: the process is pinned to --cpu, torch and OpenCV to one
thread, dpu_pipe to one thread. Methods run interleaved batch by batch within each round, the
first one rotating, on the same files; the clock is this thread's CPU time, which other
processes on the machine do not inflate. Data: dpu_pipe.tools.sample_data (ImageNet-like JPEGs
made from real photographs).

    .venv/bin/python bench/bench_views.py --n 128 --repeat 3
    .venv/bin/python bench/bench_views.py --methods simclr,simclr-v2   # a subset
"""

import argparse
import io
import json
import os
import random
import time

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")

BATCH = 32
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _dpu_pipe_method(bufs, views, max_side=None):
    """dpu_pipe's batch kernel; with ``max_side``, ``decode_max_side`` and a cache with room
    for every sample, filled by the warm-up (so every timed epoch is served from it)."""
    from dpu_pipe.cache import DecodedCache
    from dpu_pipe.kernel import BatchProcessor
    from dpu_pipe.transforms import TransformConfig

    from bench_cache import full_cache_bytes

    cache = DecodedCache(full_cache_bytes(len(bufs), max_side), len(bufs)) if max_side else None
    proc = BatchProcessor(TransformConfig(views=views, decode_max_side=max_side),
                          num_threads=1, cache=cache)
    idx = np.arange(len(bufs), dtype=np.int64)
    epoch = [0]

    def run(start, stop):
        if start == 0:
            epoch[0] += 1
        proc.run(bufs[start:stop], idx[start:stop], epoch=epoch[0])
    return run


def _torch_batches(bufs, per_image, ftz=False):
    """run(start, stop) that applies ``per_image(bytes) -> [view tensors]`` and stacks each
    view's tensors into a batch; with ``ftz``, under ``torch.set_flush_denormal(True)`` (set
    and cleared around each call, so the interleaved methods keep the default)."""
    import torch

    def run(start, stop):
        torch.set_flush_denormal(ftz)
        try:
            outs = [per_image(b) for b in bufs[start:stop]]
            [torch.stack(v) for v in zip(*outs)]
        finally:
            torch.set_flush_denormal(False)
    return run


def _dino_pil(bufs):
    """facebookresearch/dino's DataAugmentationDINO (main_dino.py, utils.GaussianBlur and
    utils.Solarization), global scale (0.4, 1), local scale (0.05, 0.4), 8 local crops."""
    from PIL import Image, ImageFilter, ImageOps
    from torchvision import transforms as T

    def blur(p):
        def f(img):
            if random.random() <= p:
                return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(0.1, 2.0)))
            return img
        return f

    def solarize(p):
        return lambda img: ImageOps.solarize(img) if random.random() < p else img

    flip_jitter = T.Compose([
        T.RandomHorizontalFlip(p=0.5),
        T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
        T.RandomGrayscale(p=0.2)])
    norm = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    bic = T.InterpolationMode.BICUBIC
    g1 = T.Compose([T.RandomResizedCrop(224, scale=(0.4, 1), interpolation=bic), flip_jitter,
                    T.Lambda(blur(1.0)), norm])
    g2 = T.Compose([T.RandomResizedCrop(224, scale=(0.4, 1), interpolation=bic), flip_jitter,
                    T.Lambda(blur(0.1)), T.Lambda(solarize(0.2)), norm])
    loc = T.Compose([T.RandomResizedCrop(96, scale=(0.05, 0.4), interpolation=bic),
                     flip_jitter, T.Lambda(blur(0.5)), norm])

    def per_image(b):
        img = Image.open(io.BytesIO(b)).convert("RGB")
        return [g1(img), g2(img)] + [loc(img) for _ in range(8)]
    return _torch_batches(bufs, per_image)


def _v2_views(specs):
    """torchvision.transforms.v2 views on a uint8 tensor decoded by torchvision.io."""
    import torch
    from torchvision.io import decode_jpeg
    from torchvision.transforms import v2 as T

    bic = T.InterpolationMode.BICUBIC
    tail = [T.ToDtype(torch.float32, scale=True), T.Normalize(MEAN, STD)]
    views = []
    for s in specs:
        ops = [T.RandomResizedCrop(s["size"], scale=s["scale"],
                                   interpolation=bic if s.get("bicubic") else
                                   T.InterpolationMode.BILINEAR, antialias=True),
               T.RandomHorizontalFlip(0.5),
               T.RandomApply([T.ColorJitter(*s["jitter"])], p=0.8),
               T.RandomGrayscale(0.2)]
        if s["blur_p"]:
            ops.append(T.RandomApply([T.GaussianBlur(s["kernel"], (0.1, 2.0))], p=s["blur_p"]))
        if s.get("solarize_p"):
            ops.append(T.RandomSolarize(128, p=s["solarize_p"]))
        views.append(T.Compose(ops + tail))

    def per_image(b):
        img = decode_jpeg(torch.frombuffer(bytearray(b), dtype=torch.uint8))
        return [v(img) for v in views]
    return per_image


def _dino_v2(bufs, ftz=False):
    g = dict(size=224, scale=(0.4, 1.0), bicubic=True, jitter=(0.4, 0.4, 0.2, 0.1), kernel=9)
    loc = dict(g, size=96, scale=(0.05, 0.4), blur_p=0.5)
    specs = [dict(g, blur_p=1.0), dict(g, blur_p=0.1, solarize_p=0.2)] + [loc] * 8
    return _torch_batches(bufs, _v2_views(specs), ftz)


def _simclr_v2(bufs, ftz=False):
    s = dict(size=224, scale=(0.08, 1.0), jitter=(0.8, 0.8, 0.8, 0.2), blur_p=0.5, kernel=23)
    return _torch_batches(bufs, _v2_views([s, s]), ftz)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=128, help="images per round")
    ap.add_argument("--repeat", type=int, default=3, help="rounds")
    ap.add_argument("--cpu", type=int, default=0, help="core to pin to")
    ap.add_argument("--data", help="JPEG directory (default: the sample dataset)")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    ap.add_argument("--methods", help="comma-separated subset of the methods (default: all)")
    args = ap.parse_args(argv)
    # Called only once bufs, views and transcode are bound below (after the argument check,
    # which so needs neither torch nor the data).
    makers = {
        "dino": lambda: _dpu_pipe_method(bufs, views.dino()),
        "dino-pil": lambda: _dino_pil(bufs),
        "dino-v2": lambda: _dino_v2(bufs),
        "simclr": lambda: _dpu_pipe_method(bufs, views.simclr()),
        "simclr-v2": lambda: _simclr_v2(bufs),
        "dino-v2-ftz": lambda: _dino_v2(bufs, ftz=True),
        "simclr-v2-ftz": lambda: _simclr_v2(bufs, ftz=True),
        "dino-cache": lambda: _dpu_pipe_method(bufs, views.dino(), 256),
        "simclr-cache": lambda: _dpu_pipe_method(bufs, views.simclr(), 256),
        "simclr-pack": lambda: _dpu_pipe_method([transcode(b) for b in bufs], views.simclr()),
        "simclr-crops": lambda: _dpu_pipe_method(
            bufs, [views.View(size=224, scale=(0.08, 1.0))] * 2),
        "classic": lambda: _dpu_pipe_method(bufs, None),
    }
    chosen = args.methods.split(",") if args.methods else list(makers)
    unknown = sorted(set(chosen) - set(makers))
    if unknown:
        ap.error(f"--methods: unknown {', '.join(unknown)}; methods: {', '.join(makers)}")

    import torch

    from dpu_pipe import views
    from dpu_pipe.jpeg import transcode
    from dpu_pipe.tools.harness import interleaved, load_buffers, one_core, rate_stats
    from dpu_pipe.tools.plan import cpu_name
    from dpu_pipe.tools.sample_data import sample_dataset

    torch.set_num_threads(1)
    _, bufs = load_buffers(args.data or sample_dataset(args.n, progress=False), args.n)
    methods = {name: makers[name]() for name in chosen}
    with one_core(args.cpu):
        for name, run in methods.items():   # warm-up: allocations, imports, cache fills
            run(0, len(bufs) if name.endswith("-cache") else min(BATCH, len(bufs)))
        times = interleaved(methods, len(bufs), chunk=BATCH, repeat=args.repeat,
                            clock=time.thread_time)
    rate = {k: rate_stats(v, len(bufs))[0] for k, v in times.items()}
    load = os.getloadavg()
    print(f"{len(bufs)} images x {args.repeat} rounds, median img/s on one core (CPU time), "
          f"{cpu_name()}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    rows = [("DINO (2x224 + 8x96)", "dino", "dino-pil"), ("DINO", "dino", "dino-v2"),
            ("SimCLR (2x224)", "simclr", "simclr-v2"),
            ("DINO", "dino", "dino-v2-ftz"), ("SimCLR (2x224)", "simclr", "simclr-v2-ftz"),
            ("SimCLR, packed", "simclr-pack", "simclr-v2"),
            ("SimCLR crops alone", "simclr-crops", "simclr-v2"),
            ("DINO, cached", "dino-cache", "dino-v2"),
            ("SimCLR, cached", "simclr-cache", "simclr-v2")]
    print(f"{'recipe':22s} {'baseline':13s} {'dpu_pipe':>9s} {'baseline':>9s} {'ratio':>6s}")
    for name, ours, theirs in rows:
        if ours not in rate or theirs not in rate:
            continue
        print(f"{name:22s} {theirs:13s} {rate[ours]:9.1f} {rate[theirs]:9.1f} "
              f"{rate[ours] / rate[theirs]:6.2f}")
    print("img/s: " + ", ".join(f"{k} {v:.1f}" for k, v in rate.items()))
    if "classic" in rate and "dino" in rate:
        print(f"a DINO sample costs {rate['classic'] / rate['dino']:.2f} classic samples "
              f"(classic {rate['classic']:.0f} img/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": len(bufs), "rounds": args.repeat, "img_per_s": rate,
                       "cpu": cpu_name(), "load": load}, f, indent=1)


if __name__ == "__main__":
    main()
