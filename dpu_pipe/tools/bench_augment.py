"""The end-to-end augmentation benchmark: JPEG bytes → RandomResizedCrop 224 → flip →
normalize → float32 CHW, images per second on one core, dpu_pipe against the baselines users
have (Pillow + numpy, OpenCV), all producing the same crops and flips.

Every method runs in one process pinned to one core; the methods take turns every
``chunk`` images within each round (the machine is shared, so load bursts fall on all of
them alike) and the median round is reported. Threads are measured separately, unpinned.
"""

import argparse
import io
import os
import statistics
import threading
import time

import numpy as np

from .. import rng
from ..batch import BatchProcessor
from .bench import _pin, load_buffers
from ..jpeg import decode_batch, read_header
from ..transforms import IMAGENET_MEAN, IMAGENET_STD, TransformConfig

__all__ = ["augment_benchmark", "format_augment_table", "add_args", "run"]

SIZE = 224
MEAN = np.array(IMAGENET_MEAN, np.float32).reshape(3, 1, 1)
STD = np.array(IMAGENET_STD, np.float32).reshape(3, 1, 1)


def _params(buffers, seed, epoch):
    """Crop box (top, left, h, w) and flip of every sample, from dpu_pipe's RNG twin — the
    same ones the kernel draws, so every method does identical work."""
    sizes = [read_header(b)[:2] for b in buffers]
    boxes = [rng.random_resized_crop(seed, epoch, i, h, w) for i, (w, h) in enumerate(sizes)]
    flips = [bool(rng.random_flip(seed, epoch, i)) for i in range(len(buffers))]
    return boxes, flips


def _baselines(buffers, boxes, flips):
    from PIL import Image
    import cv2

    cv2.setNumThreads(1)

    def pillow(i, out):
        img = Image.open(io.BytesIO(buffers[i])).convert("RGB")
        t, l, h, w = boxes[i]
        img = img.resize((SIZE, SIZE), Image.BILINEAR, box=(l, t, l + w, t + h))
        if flips[i]:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        a = np.asarray(img, dtype=np.float32).transpose(2, 0, 1)
        np.subtract(a * (1 / 255.0), MEAN, out=out)
        out /= STD

    def opencv(i, out):
        img = cv2.imdecode(np.frombuffer(buffers[i], np.uint8), cv2.IMREAD_COLOR)
        t, l, h, w = boxes[i]
        crop = img[t:t + h, l:l + w]
        interp = cv2.INTER_AREA if h > SIZE and w > SIZE else cv2.INTER_LINEAR
        crop = cv2.resize(crop, (SIZE, SIZE), interpolation=interp)
        crop = cv2.cvtColor(crop, cv2.COLOR_BGR2RGB)
        if flips[i]:
            crop = crop[:, ::-1]
        a = crop.astype(np.float32).transpose(2, 0, 1)
        np.subtract(a * (1 / 255.0), MEAN, out=out)
        out /= STD

    return {"Pillow + numpy": pillow, "OpenCV (full decode) + numpy": opencv}


def _time_methods(methods, n, chunk, repeat):
    """{name: [seconds per round]}: methods take turns every `chunk` images."""
    times = {name: [] for name in methods}
    for _ in range(repeat):
        spent = dict.fromkeys(methods, 0.0)
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            for name, fn in methods.items():
                t0 = time.perf_counter()
                fn(start, stop)
                spent[name] += time.perf_counter() - t0
        for name in methods:
            times[name].append(spent[name])
    return times


def augment_benchmark(root_or_files, *, n=1000, repeat=5, chunk=64, seed=0, epoch=0,
                      threads=2):
    """Run the benchmark; returns a dict with rows of (method, img/s, ratio vs Pillow)."""
    _, buffers = load_buffers(root_or_files, n)
    n = len(buffers)
    boxes, flips = _params(buffers, seed, epoch)
    out = np.empty((n, 3, SIZE, SIZE), np.float32)
    indices = np.arange(n, dtype=np.int64)
    kernels = {"dpu_pipe (accurate)": BatchProcessor(TransformConfig(size=SIZE), 1),
               "dpu_pipe (fast)": BatchProcessor(TransformConfig(size=SIZE, fast=True), 1)}

    def kernel_method(bp):
        def fn(start, stop):
            _, _, errors = bp.run(buffers[start:stop], indices[start:stop], epoch=epoch,
                                  seed=seed, out=out[start:stop])
            assert not errors, errors
        return fn

    def per_image(fn):
        def loop(start, stop):
            for i in range(start, stop):
                fn(i, out[i])
        return loop

    # Decode alone (same regions, same DCT scales) tells what the fused kernel costs after it.
    info = kernels["dpu_pipe (accurate)"].run(buffers, indices, epoch=epoch, seed=seed)[1]
    regions = info[:, 1:5].astype(np.int64)
    slot = np.empty((chunk, 1100, 1100, 3), np.uint8)

    def decode_only(start, stop):
        decode_batch(buffers[start:stop], slot[:stop - start], regions=regions[start:stop],
                     min_size=(SIZE, SIZE))

    methods = {name: per_image(fn) for name, fn in _baselines(buffers, boxes, flips).items()}
    methods.update({name: kernel_method(bp) for name, bp in kernels.items()})
    methods["dpu_pipe region decode only"] = decode_only
    # Equal outputs first: the same crop and flip everywhere (up to interpolation details).
    ref = np.empty((1, 3, SIZE, SIZE), np.float32)
    _baselines(buffers, boxes, flips)["Pillow + numpy"](0, ref[0])
    kernels["dpu_pipe (accurate)"].run(buffers[:1], indices[:1], epoch=epoch, seed=seed,
                                       out=out[:1])
    mad = float(np.abs(out[0] - ref[0]).mean())

    previous, _ = _pin(True)
    try:
        times = _time_methods(methods, n, chunk, repeat)
    finally:
        if previous:
            os.sched_setaffinity(0, previous)
    rows = []
    ref_rate = n / statistics.median(times["Pillow + numpy"])
    for name, ts in times.items():
        rate = n / statistics.median(ts)
        rows.append((name, rate, rate / ref_rate))

    # Threads, on all cores, one batch call each: the kernel's OpenMP threads against the
    # other way to use them — one single-threaded kernel per Python thread, each on a share.
    scaling, pythreads = {}, None
    for t in (1, threads):
        bp = BatchProcessor(TransformConfig(size=SIZE), t)
        runs = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            bp.run(buffers, indices, epoch=epoch, seed=seed, out=out)
            runs.append(time.perf_counter() - t0)
        scaling[t] = n / statistics.median(runs)
    if threads > 1:
        bps = [BatchProcessor(TransformConfig(size=SIZE), 1) for _ in range(threads)]
        outs = [np.empty((len(indices[k::threads]), 3, SIZE, SIZE), np.float32)
                for k in range(threads)]
        runs = []
        for _ in range(repeat):
            pool = [threading.Thread(target=bps[k].run,
                                     args=(buffers[k::threads], indices[k::threads]),
                                     kwargs=dict(epoch=epoch, seed=seed, out=outs[k]))
                    for k in range(threads)]
            t0 = time.perf_counter()
            for th in pool:
                th.start()
            for th in pool:
                th.join()
            runs.append(time.perf_counter() - t0)
        pythreads = n / statistics.median(runs)
    rate = {name: r for name, r, _ in rows}
    kernel_share = 1 - rate["dpu_pipe (accurate)"] / rate["dpu_pipe region decode only"]
    return {"n": n, "rows": rows, "threads": scaling, "python_threads": pythreads,
            "kernel_share": kernel_share,
            "mad_vs_pillow": mad, "cores": len(os.sched_getaffinity(0))}


def format_augment_table(result):
    lines = [f"decode → RandomResizedCrop {SIZE} → flip → normalize, float32 CHW, "
             f"{result['n']} images, one core:", "",
             "| method | img/s | vs Pillow + numpy |", "|---|---:|---:|"]
    for name, rate, ratio in result["rows"]:
        lines.append(f"| {name} | {rate:.0f} | {ratio:.2f}x |")
    t = result["threads"]
    one, many = min(t), max(t)
    lines += ["", f"threads: {t[one]:.0f} img/s on {one}, {t[many]:.0f} img/s on {many} "
              f"({t[many] / t[one]:.2f}x, {result['cores']} cores available); "
              f"{many} Python threads with a one-thread kernel each: "
              f"{result['python_threads'] or 0:.0f} img/s",
              f"fused resample+flip+normalize after decode: {result['kernel_share']:.1%} of "
              f"the per-image time",
              f"mean |dpu_pipe - Pillow| on a sample: {result['mad_vs_pillow']:.4f} "
              f"(normalized units)"]
    return "\n".join(lines)


def add_args(p):
    p.add_argument("--data", default=os.path.join(".cache", "dpu_pipe", "imagenet_like_n1000_s0"),
                   help="ImageNet-like dataset to use (made from real photographs when absent)")
    p.add_argument("-n", "--images", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=5)


def run(args):
    from .sample_data import make_imagenet_like

    make_imagenet_like(args.data, n=max(args.images, 1000), seed=0)
    print(format_augment_table(augment_benchmark(args.data, n=args.images,
                                                 repeat=args.repeat)))
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="dpu-pipe bench", description=__doc__)
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
