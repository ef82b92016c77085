"""Decode throughput of dpu_pipe against Pillow and OpenCV, measured fairly on a shared machine.

    python bench/bench_decode.py [--data PATH] [-n 1000] [--repeat 3] [--methods a,b]
                                 [--core C | --no-pin] [--json [PATH]] [--plots DIR]

Everything runs in one process pinned to one core, OpenCV on one thread, on file bytes already
in memory. Every method decodes the same images; the methods take turns every 64 images within
each round and round by round (:func:`dpu_pipe.tools.harness.interleaved`), so that load from
other processes hits all of them alike, and the median round is reported.

The region methods decode the boxes torchvision's ``RandomResizedCrop`` would cut (scale
0.08-1, aspect 3/4-4/3, 10 attempts then a central crop), drawn once with a fixed seed before
timing, so every method and every round sees the same boxes.
"""

import argparse
import io
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpu_pipe import jpeg  # noqa: E402
from dpu_pipe.errors import ConfigError, DpuPipeError  # noqa: E402
from dpu_pipe.tools import cli  # noqa: E402
from dpu_pipe.tools.harness import interleaved, load_buffers, one_core, rate_stats  # noqa: E402

#: name -> description, in table order. Pillow is the reference of the ratio column.
METHODS = {
    "pillow": "Pillow full decode",
    "pillow_draft": "Pillow reduced-size decode (draft) + crop, crop >= 224",
    "opencv": "OpenCV full decode",
    "dpu": "dpu_pipe full decode",
    "dpu_region": "dpu_pipe region decode (RandomResizedCrop box)",
    "dpu_region_min224": "dpu_pipe region decode, min_size=(224, 224)",
    "dpu_fast": "dpu_pipe full decode, fast",
    "dpu_region_fast": "dpu_pipe region decode, fast",
    "dpu_region_min224_fast": "dpu_pipe region decode, min_size=(224, 224), fast",
    "dpu_batch_region_min224": "dpu_pipe decode_batch of 64, regions, min_size=(224, 224)",
}
REFERENCE = "pillow"
MIN_SIZE = (224, 224)
BATCH = 64


def pil():
    """Pillow's Image module, or a ConfigError saying to install it."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise ConfigError("the decode benchmark compares against Pillow: pip install pillow") \
            from exc
    return Image


def random_resized_crop_boxes(sizes, *, seed=0, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """Boxes that torchvision's ``RandomResizedCrop.get_params`` would draw, one per image.

    ``sizes`` is a sequence of ``(height, width)`` in pixels. Each box takes up to 10 attempts
    at an area share uniform in ``scale`` and a log-uniform aspect ratio (width / height) in
    ``ratio``; if none fits, the central crop with the aspect clamped to ``ratio``. torchvision's
    algorithm, drawn with ``numpy.random.default_rng(seed)`` instead of torch's generator.
    Returns an int64 array of shape ``(N, 4)``: ``(top, left, height, width)`` in pixels.
    """
    rng = np.random.default_rng(seed)
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    boxes = np.empty((len(sizes), 4), dtype=np.int64)
    for k, (height, width) in enumerate(sizes):
        area = height * width
        for _ in range(10):
            target_area = area * rng.uniform(scale[0], scale[1])
            aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top = int(rng.integers(0, height - h + 1))
                left = int(rng.integers(0, width - w + 1))
                boxes[k] = top, left, h, w
                break
        else:
            in_ratio = width / height
            if in_ratio < min(ratio):
                w, h = width, int(round(width / min(ratio)))
            elif in_ratio > max(ratio):
                h, w = height, int(round(height * max(ratio)))
            else:
                w, h = width, height
            boxes[k] = (height - h) // 2, (width - w) // 2, h, w
    return boxes


def _reduction(h, w, min_size):
    """Largest power-of-two reduction (1, 2, 4, 8) keeping an h × w box at least min_size."""
    for k in (8, 4, 2):
        if -(-h // k) >= min_size[0] and -(-w // k) >= min_size[1]:
            return k
    return 1


def _pillow_methods(buffers, regions):
    """{name: fn(i)} of the Pillow methods (full decode; reduced-size decode + crop)."""
    Image = pil()

    def pillow(i):
        return np.asarray(Image.open(io.BytesIO(buffers[i])).convert("RGB"))

    def pillow_draft(i):
        top, left, h, w = regions[i]
        k = _reduction(h, w, MIN_SIZE)
        im = Image.open(io.BytesIO(buffers[i]))
        full_width, s = im.size[0], 1
        if k > 1:
            # draft() may reduce by another factor than asked when the size does not divide
            # evenly: scale the box by the one it reports, (mode, (0, 0, width / s, height / s)).
            applied = im.draft("RGB", (max(1, im.size[0] // k), max(1, im.size[1] // k)))
            if applied is not None:
                s = round(full_width / applied[1][2])
        crop = im.crop((left // s, top // s, min(im.size[0], -(-(left + w) // s)),
                        min(im.size[1], -(-(top + h) // s))))
        return np.asarray(crop.convert("RGB"))
    return {"pillow": pillow, "pillow_draft": pillow_draft}


def _batch_method(buffers, boxes, regions):
    """``fn(i)`` decoding the batch of :data:`BATCH` images starting at ``i`` into an output
    allocated here, sized for the batch's largest scaled region (a loader keeps its batch
    buffers for the whole run, so no allocation is timed)."""
    batches = {}
    for start in range(0, len(buffers), BATCH):
        sl = slice(start, start + BATCH)
        hmax = wmax = 1
        for top, left, h, w in regions[sl]:
            s = jpeg.choose_scale(h, w, MIN_SIZE)
            hmax, wmax = max(hmax, -(-h * s // 8) + 1), max(wmax, -(-w * s // 8) + 1)
        out = np.zeros((len(buffers[sl]), hmax, wmax, 3), np.uint8)
        batches[start] = (list(buffers[sl]), np.ascontiguousarray(boxes[sl]), out)

    def dpu_batch(i):
        bufs, regs, out = batches[i]
        return jpeg.decode_batch(bufs, out, regions=regs, min_size=MIN_SIZE)[1]
    return dpu_batch


def decode_methods(buffers, boxes, names=None):
    """Decoding functions over in-memory JPEGs, ready to be timed.

    Parameters
    ----------
    buffers : list of bytes
        The JPEG files.
    boxes : int array (N, 4)
        Regions ``(top, left, height, width)``, from :func:`random_resized_crop_boxes`.
    names : list of str, optional
        Methods of :data:`METHODS` (default: all whose library is installed; OpenCV is
        optional, Pillow is not). Unknown or unavailable names raise :class:`ConfigError`.

    Returns
    -------
    dict: name -> (description, fn), in :data:`METHODS` order; ``fn(i)`` decodes image ``i``
    and returns an RGB ``uint8`` array (H, W, 3), except the batch method's, which decodes
    the batch starting at image ``i`` (call it for ``i`` in steps of :data:`BATCH`) and
    returns decode_batch's (n, 3) shapes (height, width, scale).
    """
    try:
        import cv2
    except ImportError:
        cv2 = None
    if names is None:
        names = [m for m in METHODS if cv2 is not None or m != "opencv"]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise ConfigError(f"unknown decode methods {unknown}; choose from {list(METHODS)}")
    if "opencv" in names and cv2 is None:
        raise ConfigError("method 'opencv' needs OpenCV: pip install opencv-python-headless")
    regions = [tuple(int(v) for v in b) for b in boxes]
    fns = _pillow_methods(buffers, regions)
    if cv2 is not None:
        fns["opencv"] = lambda i: cv2.cvtColor(
            cv2.imdecode(np.frombuffer(buffers[i], np.uint8), cv2.IMREAD_COLOR),
            cv2.COLOR_BGR2RGB)
    decode = jpeg.decode
    fns["dpu"] = lambda i: decode(buffers[i])
    fns["dpu_region"] = lambda i: decode(buffers[i], region=regions[i])
    fns["dpu_region_min224"] = lambda i: decode(buffers[i], region=regions[i], min_size=MIN_SIZE)
    fns["dpu_fast"] = lambda i: decode(buffers[i], fast=True)
    fns["dpu_region_fast"] = lambda i: decode(buffers[i], region=regions[i], fast=True)
    fns["dpu_region_min224_fast"] = lambda i: decode(buffers[i], region=regions[i],
                                                     min_size=MIN_SIZE, fast=True)
    if "dpu_batch_region_min224" in names:
        fns["dpu_batch_region_min224"] = _batch_method(buffers, boxes, regions)
    return {m: (METHODS[m], fns[m]) for m in METHODS if m in names}


def _expected_shape(name, hw, box):
    """(H, W) a method must return for an image of full size hw and region box, or None when
    only a lower bound applies (scaled decodes)."""
    if name in ("pillow", "opencv", "dpu", "dpu_fast"):
        return hw
    if name in ("dpu_region", "dpu_region_fast"):
        return tuple(box[2:])
    return None


def _check(name, fn, sizes, boxes, count):
    """Run ``fn`` on the first images and check the shapes, so a broken method is not timed."""
    for i in range(count):
        out = fn(i)
        want = _expected_shape(name, sizes[i], boxes[i])
        h, w = out.shape[:2]
        ok = out.dtype == np.uint8 and out.ndim == 3 and out.shape[2] == 3
        if want is not None:
            ok = ok and (h, w) == tuple(want)
        else:  # a scaled region covers the box at >= min_size, or the whole box when smaller
            need_h = min(MIN_SIZE[0], boxes[i][2])
            need_w = min(MIN_SIZE[1], boxes[i][3])
            ok = ok and h >= need_h and w >= need_w and h <= boxes[i][2] + 1 and w <= boxes[i][3] + 1
        if not ok:
            raise DpuPipeError(f"decode method {name!r} returned {out.dtype} {out.shape} for "
                               f"image {i} ({sizes[i][0]}x{sizes[i][1]}, box {list(boxes[i])})")



def _timed(name, fn):
    """``fn(start, stop)`` of a :func:`decode_methods` function, for the harness."""
    if name == "dpu_batch_region_min224":
        # The harness's turns are BATCH images long: one batch call per turn.
        return lambda start, stop: fn(start)

    def images(start, stop):
        for i in range(start, stop):
            fn(i)
    return images


def decode_benchmark(root_or_files, *, n=1000, repeat=3, pin_core=True, methods=None, seed=0,
                     progress=None):
    """Time JPEG decoding by dpu_pipe, Pillow and OpenCV on the same in-memory files.

    Parameters
    ----------
    root_or_files : path
        What :func:`dpu_pipe.tools.harness.load_buffers` reads.
    n, repeat : int
        Images (the first ``n``), rounds (the median round counts).
    pin_core : bool or int
        True: the last core this process may use; an int: that core; False: no pinning.
    methods : list of str, optional
        Names from :data:`METHODS` (default: all available).
    seed : int
        Seed of the RandomResizedCrop boxes.
    progress : callable, optional
        Called with a short text line after each round.

    Returns
    -------
    list of dict, one per method in :data:`METHODS` order: ``method``, ``description``,
    ``images``, ``img_per_s`` (median round), ``seconds`` (median round time),
    ``img_per_s_min`` / ``img_per_s_max`` (slowest/fastest round), ``vs_pillow`` (img/s ratio
    to the Pillow full decode, None when that was not run), ``mpix_per_s`` (millions of output
    pixels per second, median round), ``core`` (the pinned core or None), ``rounds``.
    """
    for name, v in (("n", n), ("repeat", repeat)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    _, buffers = load_buffers(root_or_files, int(n))
    count = len(buffers)
    sizes = [(h.height, h.width) for h in map(jpeg.read_header, buffers)]
    boxes = random_resized_crop_boxes(sizes, seed=seed)
    table = decode_methods(buffers, boxes, methods)
    pixels = {}
    for name, (_, fn) in table.items():
        if name != "dpu_batch_region_min224":
            _check(name, fn, sizes, boxes, min(count, 16))
        # Output pixels per pass, for the Mpix/s column; also warms caches and code paths.
        starts = range(0, count, BATCH if name == "dpu_batch_region_min224" else 1)
        pixels[name] = sum(_out_pixels(fn(i), name) for i in starts)
    timed = {name: _timed(name, fn) for name, (_, fn) in table.items()}
    with one_core(pin_core) as cores:
        times = interleaved(timed, count, chunk=BATCH, repeat=repeat,
                            progress=progress and (lambda r: progress(
                                f"round {r + 1}/{repeat} done")))
    core = cores[0] if pin_core is not False else None
    ref = float(np.median(times[REFERENCE])) if REFERENCE in times else None
    rows = []
    for name, (desc, _) in table.items():
        t = float(np.median(times[name]))
        _, slow, fast = rate_stats(times[name], count)
        rows.append(dict(method=name, description=desc, images=count, img_per_s=count / t,
                         seconds=t, img_per_s_min=slow, img_per_s_max=fast,
                         vs_pillow=None if ref is None else ref / t,
                         mpix_per_s=pixels[name] / t / 1e6, core=core, rounds=repeat))
    return rows


def _out_pixels(out, name):
    if name == "dpu_batch_region_min224":  # out is the batch's shapes: height, width, scale
        return int((out[:, 0].astype(np.int64) * out[:, 1]).sum())
    return out.shape[0] * out.shape[1]


def format_table(rows):
    """Markdown table of :func:`decode_benchmark` rows: method, img/s (median round), the
    slowest-fastest round range, ratio to Pillow and output megapixels per second."""
    lines = ["| method | img/s | rounds min-max | vs Pillow | Mpix/s out |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        ratio = "" if r["vs_pillow"] is None else f"{r['vs_pillow']:.2f}x"
        mpix = f"{r['mpix_per_s']:.1f}"
        lines.append(f"| {r['description']} | {r['img_per_s']:.0f} | "
                     f"{r['img_per_s_min']:.0f}-{r['img_per_s_max']:.0f} | {ratio} | {mpix} |")
    if rows:
        r = rows[0]
        where = f"pinned to core {r['core']}" if r["core"] is not None else "not pinned"
        lines.append("")
        lines.append(f"{r['images']} images in memory, one process {where}, median of "
                     f"{r['rounds']} interleaved rounds.")
    return "\n".join(lines)


def main(argv=None):
    """Print the decode benchmark table (or write it as JSON); returns the exit status."""
    p = argparse.ArgumentParser(prog="bench_decode.py", description=__doc__.split("\n\n")[0])
    cli.add_data(p, "JPEG dataset to measure (only read, never written)")
    cli.add_images(p, 1000)
    p.add_argument("--repeat", type=cli.positive_int, default=3,
                   help="interleaved timing rounds (default: 3)")
    p.add_argument("--core", type=cli.nonnegative_int,
                   help="core to pin to (default: the last allowed one)")
    p.add_argument("--no-pin", action="store_true", help="do not pin to one core")
    p.add_argument("--methods", help=f"comma-separated subset of: {', '.join(METHODS)}")
    cli.add_seed(p)
    cli.add_json(p)
    cli.add_plots(p)
    args = p.parse_args(argv)
    methods = None if not args.methods else [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in methods or () if m not in METHODS]
    if unknown:  # before the dataset is made, which takes a minute
        p.error(f"--methods: unknown decode methods {unknown}; choose from {list(METHODS)}")
    path = args.data
    if path is None:
        from dpu_pipe.tools.sample_data import sample_dataset
        path = sample_dataset(args.images, seed=args.seed, progress=True)
        print(f"sample dataset: {path}", file=sys.stderr)
    pin = False if args.no_pin else (True if args.core is None else args.core)
    rows = decode_benchmark(path, n=args.images, repeat=args.repeat, pin_core=pin,
                            methods=methods, seed=args.seed,
                            progress=lambda s: print(s, file=sys.stderr))
    result = {"benchmark": "decode", "data": str(path), "n": rows[0]["images"] if rows else 0,
              "repeat": args.repeat, "rows": rows}
    if args.json:
        cli.write_json(args.json, result)
    if args.json != "-":
        print(format_table(rows))
    if args.plots:
        from dpu_pipe.tools.plots import plot_rates
        os.makedirs(args.plots, exist_ok=True)
        print(f"wrote {plot_rates(result, os.path.join(args.plots, 'decode_rates.png'))}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
