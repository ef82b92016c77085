"""The decoded-sample cache: ``Loader(decode_max_side=256, cache_bytes=...)`` against today's
default ``Loader`` (classic train recipe: RandomResizedCrop 224 + flip, float32 CHW), images
per CPU second on one core.

    nice -n 5 python bench/bench_cache.py [--data DIR] [--n 300] [--rounds 3] [--core 0]
                                          [--json PATH]

The first ``--n`` images of ``--data`` (default: the ImageNet-like sample dataset of
``dpu_pipe.tools.sample_data`` at original sizes, made once under the user's cache directory)
are read as a FileList. The process is pinned to one core (``--core``) and every loader has
one thread. Methods, interleaved in rounds by ``dpu_pipe.tools.harness.interleaved`` (their
order rotated from round to round), one epoch each per round:

- ``default``: ``Loader(..., size=224)``, today's default (region decode at the best DCT scale);
- ``max_side``: ``decode_max_side=256`` without a cache (whole decode + reduction every epoch);
- ``cache_first``: a new loader with ``decode_max_side=256, cache_bytes=...``: its first epoch
  (decodes, reduces and fills the cache);
- ``cache_warm``: one loader with the cache, filled before the rounds: an epoch >= 2 (all
  hits: crops cut from the cached reduced images).

The clock is :func:`cpu_seconds`: the CPU time of this process (every thread: the loader's
maker thread does the work) and of its live child processes (a DataLoader's workers, for
``bench_cache_recipes.py``), which other work on a shared machine does not inflate, unlike wall
time. Reported per method: median and min-max images per CPU second (what one core delivers)
and images per wall second (which includes the other work's share of the core), with each
method's ratio to ``default``. Numbers only; nothing is asserted.

The helpers here (:func:`cpu_seconds`, :func:`file_list`, :func:`full_cache_bytes`,
:func:`epochs`, :func:`measure`, :func:`report`, :func:`machine`, :func:`pin`) serve
``bench/bench_cache_recipes.py`` too.
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
# Linux's CPU-time clock of another process: MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED).
_CPUCLOCK_SCHED = 2


def _descendants():
    """Process ids of this process's live descendants, from ``/proc`` (Linux)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # pid (comm) state ppid ...: comm may hold spaces and parentheses.
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):   # ended while listed
                pass
    found, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        kids = [c for c, pp in parent.items() if pp == pid]
        found += kids
        todo += kids
    return found


def cpu_seconds(pids=None):
    """CPU seconds spent so far by this process (all threads) and its live descendant
    processes.

    A child's time counts only while it lives (a DataLoader's persistent workers live for the
    whole benchmark), so differences of this clock are exact for the methods measured here.

    Parameters
    ----------
    pids : list of int, optional
        The descendants to count (default: those alive now; listing them reads ``/proc`` and
        takes milliseconds, so a clock read between short intervals takes a fixed list).

    Returns
    -------
    float
        Seconds.
    """
    total = time.process_time()
    for pid in _descendants() if pids is None else pids:
        try:
            total += time.clock_gettime((~pid << 3) | _CPUCLOCK_SCHED)
        except OSError:             # ended between the listing and the read
            pass
    return total


def file_list(data, n):
    """A FileList of the first ``n`` images of the ImageFolder ``data`` (default: the
    ImageNet-like sample dataset at original sizes).

    Parameters
    ----------
    data : str or None
        ImageFolder root.
    n : int
        Images.

    Returns
    -------
    FileList
    """
    from dpu_pipe.sources import FileList, ImageFolder
    from dpu_pipe.tools.sample_data import sample_dataset

    root = data or sample_dataset(max(n, 1000), progress=False)
    folder = ImageFolder(str(root))
    return FileList([(folder.describe(i), int(folder.labels[i]))
                     for i in range(min(n, len(folder)))])


def full_cache_bytes(num_samples, max_side=MAX_SIDE):
    """``cache_bytes`` with room for every sample reduced to ``max_side`` (at most
    ``max_side``² pixels each, plus alignment) and the table.

    Parameters
    ----------
    num_samples : int
        Samples of the source.
    max_side : int
        ``decode_max_side`` (pixels).

    Returns
    -------
    int
        Bytes.
    """
    from dpu_pipe.cache import ALIGN, table_bytes
    return table_bytes(num_samples) + num_samples * (max_side * max_side * 3 + ALIGN)


def epochs(loader):
    """A function that runs the next epoch of ``loader`` (``set_epoch`` 0, 1, ...) and returns
    the images it yielded."""
    done = [0]

    def run():
        loader.set_epoch(done[0])
        done[0] += 1
        return sum(len(y) for _, y in loader)
    return run


def measure(methods, rounds):
    """Time ``methods`` (name -> ``fn()`` running one epoch and returning its image count)
    interleaved in ``rounds`` rounds, on the :func:`cpu_seconds` clock of this process and the
    child processes alive when it is called (the methods' workers, started by a warm-up
    epoch); wall time too.

    Returns
    -------
    dict
        name -> ``{"cpu": [img/CPU-s per round], "wall": [img/s per round]}``.
    """
    from dpu_pipe.tools.harness import interleaved

    counts = {k: [] for k in methods}
    walls = {k: [] for k in methods}

    def timed(name, fn):
        def run(start, stop):
            t0 = time.perf_counter()
            counts[name].append(fn())
            walls[name].append(time.perf_counter() - t0)
        return run

    pids = _descendants()           # a DataLoader's workers start in the methods' warm-up
    cpu = interleaved({k: timed(k, fn) for k, fn in methods.items()}, 1, chunk=1,
                      repeat=rounds, clock=lambda: cpu_seconds(pids))
    return {k: {"cpu": [c / t for c, t in zip(counts[k], cpu[k])],
                "wall": [c / t for c, t in zip(counts[k], walls[k])]} for k in methods}


def machine():
    """``{"cpu", "loadavg", "date"}`` of this run (load average: 1, 5, 15 minutes)."""
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    return {"cpu": cpu_name(), "loadavg": load,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def report(rates, base, title):
    """Print one table of :func:`measure`'s ``rates``, ratios against method ``base``;
    return the rows as dicts (medians, min-max and ratios)."""
    ref = {k: statistics.median(rates[base][k]) for k in ("cpu", "wall")}
    print(title)
    print(f"{'method':<16} {'img/CPU-s (min-max)':>24} {'x ' + base:>12} "
          f"{'img/s wall (min-max)':>24} {'x ' + base:>12}")
    rows = {}
    for name, r in rates.items():
        mc, mw = statistics.median(r["cpu"]), statistics.median(r["wall"])
        rows[name] = {"median_cpu": mc, "median_wall": mw, "cpu_img_s": r["cpu"],
                      "wall_img_s": r["wall"], "ratio_cpu": mc / ref["cpu"],
                      "ratio_wall": mw / ref["wall"]}
        print(f"{name:<16} {mc:>8.0f} ({min(r['cpu']):6.0f}-{max(r['cpu']):6.0f}) "
              f"{mc / ref['cpu']:>11.2f}x {mw:>8.0f} ({min(r['wall']):6.0f}-"
              f"{max(r['wall']):6.0f}) {mw / ref['wall']:>11.2f}x")
    return rows


def pin(core):
    """Pin this process (and the threads and processes it starts later) to ``core``."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})


def argument_parser(doc):
    """The options every cache benchmark takes: --data, --n, --rounds, --core."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--data", help="ImageFolder (default: the ImageNet-like sample dataset)")
    p.add_argument("--n", type=int, default=300, help="images (default 300)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--core", type=int, default=0, help="the core to pin to (default 0)")
    return p


def main(argv=None):
    from dpu_pipe import Loader

    p = argument_parser(__doc__)
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)

    pin(args.core)
    src = file_list(args.data, args.n)
    n = len(src)
    cache_bytes = full_cache_bytes(n)
    common = dict(size=224, num_threads=1, seed=0)
    warm = Loader(src, BATCH, decode_max_side=MAX_SIDE, cache_bytes=cache_bytes, **common)
    methods = {"default": epochs(Loader(src, BATCH, **common)),
               "max_side": epochs(Loader(src, BATCH, decode_max_side=MAX_SIDE, **common)),
               "cache_first": lambda: epochs(Loader(src, BATCH, decode_max_side=MAX_SIDE,
                                                    cache_bytes=cache_bytes, **common))(),
               "cache_warm": epochs(warm)}
    for name in ("default", "max_side", "cache_warm"):
        methods[name]()                             # warm-up; fills the cache: epoch 0
    if warm.stats()["cache"]["entries"] != n:
        raise SystemExit(f"the cache did not take every sample: {warm.stats()['cache']}")

    before = machine()
    rates = measure(methods, args.rounds)
    after = machine()
    st = warm.stats()["cache"]
    rows = report(rates, "default",
                  f"{n} images, {args.rounds} rounds, one core ({before['cpu']}), "
                  f"{before['date']}, load {' '.join(before['loadavg'])} -> "
                  f"{' '.join(after['loadavg'])}")
    print(f"cache: {st}, cache_bytes {cache_bytes}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"images": n, "rounds": args.rounds, "batch": BATCH,
                       "max_side": MAX_SIDE, "cache_bytes": cache_bytes, "before": before,
                       "after": after, "cache_stats": st, "methods": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
