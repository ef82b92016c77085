"""``dpu-pipe bench``: JPEG bytes → RandomResizedCrop 224 → flip → normalize → float32 CHW,
images per second on one core, dpu_pipe against the baselines users have (Pillow + numpy,
OpenCV), all making the same crops and flips (drawn by dpu_pipe's RNG, as its kernel draws
them). The methods take turns within each round on one pinned core
(:func:`~dpu_pipe.tools.harness.interleaved`); the kernel's thread scaling is measured
afterwards, on every core.
"""

import functools
import io
import os
import statistics
import sys

import numpy as np

from .. import rng
from ..kernel import BatchProcessor
from ..errors import ConfigError, DpuPipeError
from ..jpeg import decode_batch, read_header
from ..transforms import IMAGENET_MEAN, IMAGENET_STD, TransformConfig
from .harness import interleaved, load_buffers, median_time, one_core, rate_stats

__all__ = ["augment_benchmark", "format_augment_table", "pillow_augment", "opencv_augment",
           "add_args", "run"]

SIZE = 224
PILLOW = "Pillow + numpy"
ACCURATE = "dpu_pipe (accurate)"
DECODE_ONLY = "dpu_pipe region decode only"
MEAN = np.array(IMAGENET_MEAN, np.float32).reshape(3, 1, 1)
STD = np.array(IMAGENET_STD, np.float32).reshape(3, 1, 1)


def pillow_augment(data, box, flip, out):
    """torchvision's PIL path by hand on the JPEG file ``data``: full decode to RGB, the box
    ``(top, left, height, width)`` (4 ints, pixels of the full image) resized bilinearly to
    ``out``'s size, mirrored left-right when ``flip``, ToTensor + Normalize into ``out``, a
    float32 array (3, H, W)."""
    from PIL import Image

    img = Image.open(io.BytesIO(data)).convert("RGB")
    t, l, h, w = (int(v) for v in box)
    img = img.resize((out.shape[2], out.shape[1]), Image.BILINEAR, box=(l, t, l + w, t + h))
    if flip:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    np.subtract(np.asarray(img, dtype=np.float32).transpose(2, 0, 1) * (1 / 255.0), MEAN,
                out=out)
    out /= STD


def opencv_augment(data, box, flip, out):
    """The same with OpenCV: full decode, crop, resize (area filter when shrinking both
    sides), BGR to RGB, flip, normalize; arguments as :func:`pillow_augment`'s."""
    import cv2

    t, l, h, w = (int(v) for v in box)
    crop = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)[t:t + h, l:l + w]
    size = (out.shape[2], out.shape[1])
    interp = cv2.INTER_AREA if h > size[1] and w > size[0] else cv2.INTER_LINEAR
    crop = cv2.cvtColor(cv2.resize(crop, size, interpolation=interp), cv2.COLOR_BGR2RGB)
    if flip:
        crop = crop[:, ::-1]
    np.subtract(crop.astype(np.float32).transpose(2, 0, 1) * (1 / 255.0), MEAN, out=out)
    out /= STD


def _decodable(buffer):
    """Whether the JPEG header of ``buffer`` reads (a user's dataset may hold other files)."""
    try:
        read_header(buffer)
        return True
    except DpuPipeError:
        return False


def _methods(buffers, seed, epoch, chunk, out):
    """{name: fn(start, stop)} of every timed method, writing into ``out`` (n, 3, 224, 224)."""
    n = len(buffers)
    sizes = [read_header(b)[:2] for b in buffers]
    boxes = [rng.random_resized_crop(seed, epoch, i, h, w) for i, (w, h) in enumerate(sizes)]
    flips = [bool(rng.random_flip(seed, epoch, i)) for i in range(n)]
    indices = np.arange(n, dtype=np.int64)

    def per_image(fn):
        def loop(start, stop):
            for i in range(start, stop):
                fn(buffers[i], boxes[i], flips[i], out[i])
        return loop

    def kernel(fast):
        bp = BatchProcessor(TransformConfig(size=SIZE, fast=fast), 1)

        def fn(start, stop):
            errors = bp.run(buffers[start:stop], indices[start:stop], epoch=epoch, seed=seed,
                            out=out[start:stop])[2]
            if errors:
                raise next(iter(errors.values()))
        return fn, bp

    accurate, bp = kernel(False)
    # Decode alone (the kernel's regions and DCT scales) tells what the fused kernel costs
    # after it. Its slot fits the largest scaled region and is touched before timing, so no
    # first-touch page fault is charged to the decode.
    info = bp.run(buffers, indices, epoch=epoch, seed=seed)[1]
    regions = np.ascontiguousarray(info[:, 1:5], dtype=np.int64)
    scale = info[:, 6].astype(np.int64)
    slot = np.zeros((min(chunk, n), int((-(-regions[:, 2] * scale // 8) + 1).max()),
                     int((-(-regions[:, 3] * scale // 8) + 1).max()), 3), np.uint8)

    def decode_only(start, stop):
        decode_batch(buffers[start:stop], slot[:stop - start], regions=regions[start:stop],
                     min_size=(SIZE, SIZE))

    return {PILLOW: per_image(pillow_augment),
            "OpenCV (full decode) + numpy": per_image(opencv_augment),
            ACCURATE: accurate, "dpu_pipe (fast)": kernel(True)[0], DECODE_ONLY: decode_only}


def _thread_scaling(buffers, seed, epoch, threads, repeat):
    """{threads: img/s} of one kernel batch call on 1 and ``threads`` OpenMP threads, on every
    core this process may use (median of ``repeat`` calls)."""
    indices = np.arange(len(buffers), dtype=np.int64)
    scaling = {}
    for t in sorted({1, threads}):
        bp = BatchProcessor(TransformConfig(size=SIZE), t)
        batch = functools.partial(bp.run, buffers, indices, epoch=epoch, seed=seed,
                                  out=bp.empty(len(buffers)))
        scaling[str(t)] = len(buffers) / median_time(batch, repeat)
    return scaling


def augment_benchmark(root_or_files, *, n=1000, repeat=5, chunk=64, seed=0, epoch=0,
                      threads=2, progress=None):
    """Run the benchmark on up to ``n`` images of ``root_or_files``.

    Parameters
    ----------
    root_or_files : path
        What :func:`dpu_pipe.tools.harness.load_buffers` reads; files that are not decodable
        JPEGs are skipped (and counted).
    n, repeat, chunk, seed, epoch, threads : int
        Images, interleaved rounds, images per turn, seed and epoch of the crops and flips,
        kernel threads of the scaling measurement.
    progress : callable, optional
        Called after each timing round.

    Returns
    -------
    dict
        JSON-serialisable: ``rows`` (method, median img/s, ``min`` and ``max`` over the
        rounds, ``vs_pillow`` ratio), ``split_ms`` (decode, augment and total ms per image of
        the accurate kernel), ``threads`` (img/s per thread count), ``mad_vs_pillow`` (mean
        absolute difference of one sample, normalized units), ``n``, ``repeat``, ``data``,
        ``cores``, ``skipped_undecodable``.

    Raises
    ------
    ConfigError
        Pillow or OpenCV missing, or no decodable JPEG.
    """
    try:
        import cv2  # noqa: F401
        import PIL  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"dpu-pipe bench compares against Pillow and OpenCV ({exc}): pip "
                          "install pillow opencv-python-headless") from None
    loaded = load_buffers(root_or_files, n)[1]
    buffers = [b for b in loaded if _decodable(b)]
    n = len(buffers)
    if n == 0:
        raise ConfigError(f"no decodable JPEG among the images of {root_or_files}")
    out = np.empty((n, 3, SIZE, SIZE), np.float32)
    methods = _methods(buffers, seed, epoch, chunk, out)
    # The same crop and flip everywhere (up to the interpolation's details).
    methods[PILLOW](0, 1)
    ref = out[0].copy()
    methods[ACCURATE](0, 1)
    mad = float(np.abs(out[0] - ref).mean())
    for fn in methods.values():   # warm-up: code paths, caches, allocations
        fn(0, min(chunk, n))
    with one_core():
        times = interleaved(methods, n, chunk=chunk, repeat=repeat,
                            progress=progress and (lambda r: progress()))
    ref_rate = rate_stats(times[PILLOW], n)[0]
    rows = []
    for name, ts in times.items():
        med, lo, hi = rate_stats(ts, n)
        rows.append({"method": name, "img_per_s": med, "min": lo, "max": hi,
                     "vs_pillow": med / ref_rate})
    total_ms = 1000 * statistics.median(times[ACCURATE]) / n
    decode_ms = 1000 * statistics.median(times[DECODE_ONLY]) / n
    return {"benchmark": "augment", "data": str(root_or_files), "n": n, "repeat": repeat,
            "rows": rows, "threads": _thread_scaling(buffers, seed, epoch, threads, repeat),
            "split_ms": {"decode": decode_ms, "augment": total_ms - decode_ms,
                         "total": total_ms},
            "mad_vs_pillow": mad, "cores": len(os.sched_getaffinity(0)),
            "skipped_undecodable": len(loaded) - n}


def format_augment_table(result):
    """The markdown report of :func:`augment_benchmark`'s result."""
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
    lines += ["", f"kernel threads: {t[one]:.0f} img/s on {one}, {t[many]:.0f} img/s on {many} "
              f"({t[many] / t[one]:.2f}x, {result['cores']} cores available)",
              f"per image, {ACCURATE}: region decode {sp['decode']:.2f} ms + "
              f"resample/flip/normalize {sp['augment']:.2f} ms = {sp['total']:.2f} ms",
              f"mean |dpu_pipe - Pillow| on a sample: {result['mad_vs_pillow']:.4f} "
              f"(normalized units)"]
    return "\n".join(lines)


def add_args(p):
    """The arguments of ``dpu-pipe bench`` on an argparse (sub)parser."""
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
    """``dpu-pipe bench``: print (or write as JSON) the report; returns the exit status."""
    from .cli import write_json
    from .progress import bar
    from .sample_data import sample_dataset

    data = args.data
    if data is None:
        data = sample_dataset(args.images, seed=args.seed, progress=True)
        print(f"sample dataset: {data}", file=sys.stderr)
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
