"""The decoded-sample cache: ``Loader(decode_max_side=256, cache_bytes=...)`` against today's
default ``Loader`` (classic train recipe: RandomResizedCrop 224 + flip, float32 CHW), images/s
on one core.

    python bench/bench_cache.py [--data DIR] [--n 300] [--rounds 3] [--core 0] [--json PATH]

The first ``--n`` images of ``--data`` (default: the ImageNet-like sample dataset of
``dpu_pipe.tools.sample_data`` at original sizes, made once under the user's cache directory)
are read as a FileList. The process is pinned to one core (``--core``) and every loader has
one thread. Methods, interleaved in rounds (their order rotated from round to round), one
epoch each per round:

- ``default``: ``Loader(..., size=224)``, today's default (region decode at the best DCT scale);
- ``max_side``: ``decode_max_side=256`` without a cache (whole decode + reduction every epoch);
- ``cache_first``: a new loader with ``decode_max_side=256, cache_bytes=...``: its first epoch
  (decodes, reduces and fills the cache);
- ``cache_warm``: one loader with the cache, filled before the rounds: an epoch >= 2 (all
  hits: crops cut from the cached reduced images).

Reported per method: median and min-max images/s of wall time, and images per CPU second of
the process (what one core delivers, less sensitive to other load on the machine), with each
method's ratio to ``default``. Numbers only; nothing is asserted.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dpu_pipe.tools.plan import cpu_name  # noqa: E402 - after the checkout joins the path

BATCH = 50
MAX_SIDE = 256


def _dataset(data, n):
    from dpu_pipe.sources import FileList, ImageFolder
    from dpu_pipe.tools.sample_data import sample_dataset

    root = data or sample_dataset(max(n, 1000), progress=False)
    folder = ImageFolder(str(root))
    return FileList([(folder.describe(i), int(folder.labels[i]))
                     for i in range(min(n, len(folder)))])


def _epoch(loader):
    """(images, wall seconds, CPU seconds of the process) of one epoch of ``loader``."""
    t0, c0 = time.perf_counter(), time.process_time()
    n = sum(len(y) for _, y in loader)
    return n, time.perf_counter() - t0, time.process_time() - c0


def main(argv=None):
    from dpu_pipe import Loader
    from dpu_pipe.cache import table_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="ImageFolder (default: the ImageNet-like sample dataset)")
    p.add_argument("--n", type=int, default=300, help="images (default 300)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--core", type=int, default=0, help="the core to pin to (default 0)")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.core})
    src = _dataset(args.data, args.n)
    n = len(src)
    # Room for every reduced sample (at most MAX_SIDE^2 pixels each) and the table.
    cache_bytes = table_bytes(n) + n * (MAX_SIDE * MAX_SIDE * 3 + 16)
    common = dict(size=224, num_threads=1, seed=0)
    warm = Loader(src, BATCH, decode_max_side=MAX_SIDE, cache_bytes=cache_bytes, **common)
    _epoch(warm)                                    # fill the cache: epoch 0
    assert warm.stats()["cache"]["entries"] == n

    def default():
        return _epoch(Loader(src, BATCH, **common))

    def max_side():
        return _epoch(Loader(src, BATCH, decode_max_side=MAX_SIDE, **common))

    def cache_first():
        return _epoch(Loader(src, BATCH, decode_max_side=MAX_SIDE, cache_bytes=cache_bytes,
                             **common))

    def cache_warm():
        return _epoch(warm)

    methods = {"default": default, "max_side": max_side, "cache_first": cache_first,
               "cache_warm": cache_warm}
    names = list(methods)
    rates = {k: {"wall": [], "cpu": []} for k in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            count, wall, cpu = methods[name]()
            rates[name]["wall"].append(count / wall)
            rates[name]["cpu"].append(count / cpu)
    st = warm.stats()["cache"]
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    result = {"images": n, "rounds": args.rounds, "batch": BATCH, "max_side": MAX_SIDE,
              "cache_bytes": cache_bytes, "cpu": cpu_name(), "loadavg": load,
              "cache_stats": st, "methods": {}}
    base = {k: statistics.median(rates["default"][k]) for k in ("wall", "cpu")}
    print(f"{n} images, {args.rounds} rounds, one core ({cpu_name()}), load {' '.join(load)}")
    print(f"{'method':<12} {'img/s wall (min-max)':>26} {'x default':>9} "
          f"{'img/CPU-s':>10} {'x default':>9}")
    for name in names:
        w, c = rates[name]["wall"], rates[name]["cpu"]
        mw, mc = statistics.median(w), statistics.median(c)
        result["methods"][name] = {"wall_img_s": w, "cpu_img_s": c, "median_wall": mw,
                                   "median_cpu": mc, "ratio_wall": mw / base["wall"],
                                   "ratio_cpu": mc / base["cpu"]}
        print(f"{name:<12} {mw:>9.1f} ({min(w):7.1f}-{max(w):7.1f}) {mw / base['wall']:>8.2f}x "
              f"{mc:>10.1f} {mc / base['cpu']:>8.2f}x")
    print(f"cache: {st}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
