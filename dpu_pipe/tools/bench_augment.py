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
from ..errors import ConfigError, DpuPipeError
from . import pinning
from .bench_decode import load_buffers
from ..jpeg import decode_batch, read_header
from ..transforms import IMAGENET_MEAN, IMAGENET_STD, TransformConfig

__all__ = ["augment_benchmark", "format_augment_table", "add_args", "run"]

SIZE = 224
DECODE_ONLY = "dpu_pipe region decode only"
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


def _time_methods(methods, n, chunk, repeat, progress=None):
    """{name: [seconds per round]}: methods take turns every `chunk` images."""
    times = {name: [] for name in methods}
    order = list(methods)
    for r in range(repeat):
        spent = dict.fromkeys(methods, 0.0)
        for c, start in enumerate(range(0, n, chunk)):
            stop = min(n, start + chunk)
            k = (r + c) % len(order)    # each method leads in turn: no fixed neighbour
            for name in order[k:] + order[:k]:
                fn = methods[name]
                t0 = time.perf_counter()
                fn(start, stop)
                spent[name] += time.perf_counter() - t0
        for name in methods:
            times[name].append(spent[name])
        if progress is not None:
            progress()
    return times


def augment_benchmark(root_or_files, *, n=1000, repeat=5, chunk=64, seed=0, epoch=0,
                      threads=2, progress=None):
    """Run the benchmark on up to ``n`` images of ``root_or_files`` (see
    :func:`dpu_pipe.tools.bench_decode.load_buffers`); returns a JSON-serialisable dict: ``rows``
    (method, median img/s, min and max over rounds, ratio to Pillow), ``split_ms`` (decode,
    augment and total milliseconds per image of the accurate kernel), thread scaling.
    ``progress`` is called after each timing round."""
    _, buffers = load_buffers(root_or_files, n)
    usable = []
    for b in buffers:   # a user's dataset may hold files that are not decodable JPEGs
        try:
            read_header(b)
            usable.append(b)
        except DpuPipeError:
            pass
    skipped = len(buffers) - len(usable)
    buffers = usable
    n = len(buffers)
    if n == 0:
        raise ConfigError(f"no decodable JPEG among the images of {root_or_files}")
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
    regions = np.ascontiguousarray(info[:, 1:5], dtype=np.int64)
    # The decode slot is sized for the largest decoded region of this dataset and touched
    # once before timing: a fresh buffer's first-touch page faults would otherwise be
    # charged to the decode.
    scale = info[:, 6].astype(np.int64)
    hmax = int((-(-regions[:, 2] * scale // 8) + 1).max())
    wmax = int((-(-regions[:, 3] * scale // 8) + 1).max())
    slot = np.zeros((min(chunk, n), hmax, wmax, 3), np.uint8)

    def decode_only(start, stop):
        _, _, errors = decode_batch(buffers[start:stop], slot[:stop - start],
                                    regions=regions[start:stop], min_size=(SIZE, SIZE),
                                    on_error="return")
        assert not errors, errors

    methods = {name: per_image(fn) for name, fn in _baselines(buffers, boxes, flips).items()}
    methods.update({name: kernel_method(bp) for name, bp in kernels.items()})
    methods[DECODE_ONLY] = decode_only
    # Equal outputs first: the same crop and flip everywhere (up to interpolation details).
    ref = np.empty((1, 3, SIZE, SIZE), np.float32)
    _baselines(buffers, boxes, flips)["Pillow + numpy"](0, ref[0])
    kernels["dpu_pipe (accurate)"].run(buffers[:1], indices[:1], epoch=epoch, seed=seed,
                                       out=out[:1])
    mad = float(np.abs(out[0] - ref[0]).mean())
    for fn in methods.values():   # warm-up pass: code paths, caches, allocations
        fn(0, min(chunk, n))

    with pinning.pinned(True):
        times = _time_methods(methods, n, chunk, repeat, progress)
    ref_rate = n / statistics.median(times["Pillow + numpy"])
    rows = []
    for name, ts in times.items():
        rates = [n / t for t in ts]
        rows.append({"method": name, "img_per_s": statistics.median(rates),
                     "min": min(rates), "max": max(rates),
                     "vs_pillow": statistics.median(rates) / ref_rate})

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
    # Per-image time of the fused kernel = its region decode + the rest (resample, flip,
    # normalize, layout), both medians of the same interleaved rounds.
    total_ms = 1000 * statistics.median(times["dpu_pipe (accurate)"]) / n
    decode_ms = 1000 * statistics.median(times[DECODE_ONLY]) / n
    return {"benchmark": "augment", "data": str(root_or_files), "n": n, "repeat": repeat,
            "rows": rows, "threads": {str(k): v for k, v in scaling.items()},
            "python_threads": pythreads,
            "split_ms": {"decode": decode_ms, "augment": total_ms - decode_ms,
                         "total": total_ms},
            "mad_vs_pillow": mad, "cores": len(os.sched_getaffinity(0)),
            "skipped_undecodable": skipped}


def format_augment_table(result):
    lines = [f"decode → RandomResizedCrop {SIZE} → flip → normalize, float32 CHW, "
             f"{result['n']} images of {result['data']}, one core, median (min–max) of "
             f"{result['repeat']} interleaved rounds:", "",
             "| method | img/s | min–max | vs Pillow + numpy |", "|---|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['method']} | {r['img_per_s']:.0f} | {r['min']:.0f}–{r['max']:.0f} "
                     f"| {r['vs_pillow']:.2f}x |")
    t = {int(k): v for k, v in result["threads"].items()}
    one, many = min(t), max(t)
    sp = result["split_ms"]
    lines += ["", f"threads: {t[one]:.0f} img/s on {one}, {t[many]:.0f} img/s on {many} "
              f"({t[many] / t[one]:.2f}x, {result['cores']} cores available); "
              f"{many} Python threads with a one-thread kernel each: "
              f"{result['python_threads'] or 0:.0f} img/s",
              f"per image, dpu_pipe (accurate): region decode {sp['decode']:.2f} ms + "
              f"resample/flip/normalize {sp['augment']:.2f} ms = {sp['total']:.2f} ms",
              f"mean |dpu_pipe - Pillow| on a sample: {result['mad_vs_pillow']:.4f} "
              f"(normalized units)"]
    return "\n".join(lines)


def add_args(p):
    from .cli import add_data, add_images, add_json, add_plots, add_seed, positive_int

    add_data(p, "JPEG dataset to measure (only read, never written)")
    add_images(p, 1000)
    p.add_argument("--repeat", type=positive_int, default=5,
                   help="interleaved timing rounds (default: 5)")
    p.add_argument("--threads", type=positive_int, default=2,
                   help="threads of the scaling measurement (default: 2)")
    add_seed(p)
    add_json(p)
    add_plots(p)


def run(args):
    import sys

    from .cli import write_json
    from .sample_data import sample_dataset

    data = args.data
    if data is None:
        data = sample_dataset(args.images, seed=args.seed, progress=True)
        print(f"sample dataset: {data}", file=sys.stderr)
    from .progress import bar
    with bar(args.repeat, "timing rounds", unit="round") as b:
        result = augment_benchmark(data, n=args.images, repeat=args.repeat, seed=args.seed,
                                   threads=args.threads, progress=lambda: b.update(1))
    if args.json:
        write_json(args.json, result)
    if args.json != "-":
        print(format_augment_table(result))
    if args.plots:
        from .plots import plot_rates, plot_split
        os.makedirs(args.plots, exist_ok=True)
        for path in (plot_rates(result, os.path.join(args.plots, "augment_rates.png")),
                     plot_split(result, os.path.join(args.plots, "augment_split.png"))):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="dpu-pipe bench", description=__doc__)
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
