"""Images per second of the local Loader against the usual DataLoader path (Pillow + numpy in a
thread pool and in a process pool), the same batches for every method.

    python bench/bench_loader.py [--data PATH] [-n 200] [--batch-size 32] [--threads 1,2]
                                 [--repeat 3] [--json [PATH]]

Every method produces the same batches: the Loader's (``EpochSampler`` order, ``drop_last``),
RandomResizedCrop with the boxes and flips of :mod:`dpu_pipe.rng`, normalized float32 CHW.
Methods, each with k of ``threads``:

* ``loader``: :class:`dpu_pipe.loader.Loader` (``num_threads=k``, prefetch 2), files read from
  disk (page cache) by its producer thread;
* ``kernel``: :meth:`BatchProcessor.run` on the same batches, bytes already in memory, into
  preallocated outputs — the Loader's floor; the gap is its overhead;
* ``pillow_threads``: a thread pool of k, one batch per task: file read, then
  :func:`dpu_pipe.tools.bench_augment.pillow_augment` (full decode, box resized bilinearly,
  flip, normalize) into a preallocated batch;
* ``pillow_processes``: the same in a process pool of k (spawned once, kept across rounds like
  ``persistent_workers``), writing into shared-memory batches as DataLoader workers do; 2k
  batches in flight (``prefetch_factor=2``).

The Pillow methods get each epoch's boxes precomputed (vectorized) before timing; the dpu_pipe
methods draw theirs inside. Methods are interleaved round by round
(:func:`dpu_pipe.tools.harness.interleaved`), each round one epoch over the first ``n`` JPEG
files of a directory, one untimed warm-up epoch first; the median round counts. Nothing is
asserted about the timings.
"""

import argparse
import concurrent.futures as cf
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpu_pipe.errors import ConfigError, DpuPipeError  # noqa: E402
from dpu_pipe.tools import cli  # noqa: E402
from dpu_pipe.tools.bench_augment import pillow_augment  # noqa: E402
from dpu_pipe.tools.harness import interleaved, load_buffers, pinned, rate_stats  # noqa: E402

__all__ = ["loader_benchmark", "format_loader_table", "LOADER_METHODS", "pillow_batch"]

#: name -> description, in table order (``{k}`` is the thread or worker count).
LOADER_METHODS = {
    "loader": "dpu_pipe Loader, num_threads={k}",
    "kernel": "dpu_pipe BatchProcessor.run alone, {k} thread(s), bytes in memory",
    "pillow_threads": "Pillow + numpy, thread pool of {k}",
    "pillow_processes": "Pillow + numpy, process pool of {k} (shared-memory batches)",
}
#: The epoch of the untimed warm-up pass (no timed round uses it).
WARM_UP = 2**31


def pillow_batch(paths, indices, boxes, flips, out):
    """One batch the DataLoader way: per sample, the file read and :func:`pillow_augment`.
    ``boxes``/``flips`` are the batch's own rows (position j is sample ``indices[j]``);
    returns ``indices``."""
    for j, i in enumerate(indices.tolist()):
        pillow_augment(Path(paths[i]).read_bytes(), boxes[j], flips[j], out[j])
    return indices


_worker = {}


def _worker_init(paths, shm_name, slots_shape):
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=shm_name)
    _worker.update(paths=paths, shm=shm,
                   slots=np.ndarray(slots_shape, dtype=np.float32, buffer=shm.buf))


def _worker_batch(slot, indices, boxes, flips):
    """One batch in a worker process, written into shared-memory slot ``slot``."""
    return pillow_batch(_worker["paths"], indices, boxes, flips, _worker["slots"][slot])


class _Epochs:
    """The benchmark's data: the first n samples of a dataset, their bytes and sizes, and per
    epoch the batches, boxes and flips every method makes."""

    def __init__(self, root, n, batch_size, size, seed):
        from dpu_pipe import jpeg
        from dpu_pipe.sampler import EpochSampler
        from dpu_pipe.sources import FileList
        from dpu_pipe.transforms import TransformConfig

        paths, self.buffers = load_buffers(root, n)
        self.paths = [str(p) for p in paths]
        count = len(self.paths)
        if count < batch_size:
            raise ConfigError(f"{count} images make no batch of {batch_size}")
        self.source = FileList([(p, 0) for p in self.paths])
        self.cfg = TransformConfig(train=True, size=size)
        self.batch_size, self.seed, self.size = batch_size, seed, size
        self.sampler = EpochSampler(count, seed=seed)
        self.nbatches = count // batch_size
        self.images = self.nbatches * batch_size
        headers = [jpeg.read_header(b) for b in self.buffers]
        self.heights = np.array([h.height for h in headers], np.int64)
        self.widths = np.array([h.width for h in headers], np.int64)
        self.batch_shape = (batch_size,) + self.cfg.sample_shape

    def plan(self, epoch):
        """(batches of indices, every sample's (top, left, h, w) box, every flip)."""
        from dpu_pipe.rng import random_flip, random_resized_crop

        index = np.arange(len(self.paths), dtype=np.int64)
        batches = [self.sampler.batch(epoch, s, self.batch_size, True)
                   for s in range(self.nbatches)]
        # The Loader's default scale and ratio, which random_resized_crop's are.
        top, left, h, w = random_resized_crop(self.seed, epoch, index, self.heights,
                                              self.widths)
        return batches, np.stack([top, left, h, w], axis=1), random_flip(self.seed, epoch,
                                                                         index)


def _loader_pass(data, k, resources):
    from dpu_pipe.loader import Loader

    loader = Loader(data.source, data.batch_size, size=data.size, seed=data.seed,
                    num_threads=k, prefetch=2)
    resources.append(loader.close)

    def run(epoch, _plan):
        loader.set_epoch(epoch)
        return sum(len(images) for images, _ in loader)
    run.loader = loader
    return run


def _kernel_pass(data, k, resources):
    from dpu_pipe.kernel import BatchProcessor

    # The kernel runs in a thread of its own, started with the widened affinity, so its
    # OpenMP team is not bound to an affinity the calling thread had before.
    bp = BatchProcessor(data.cfg, k)
    pool = cf.ThreadPoolExecutor(1)
    resources.append(pool.shutdown)
    ring = [bp.empty(data.batch_size) for _ in range(2)]

    def epoch_pass(epoch, batches):
        for s, idx in enumerate(batches):
            errors = bp.run([data.buffers[i] for i in idx.tolist()], idx, epoch=epoch,
                            seed=data.seed, out=ring[s % 2])[2]
            if errors:
                raise next(iter(errors.values()))
        return len(batches) * data.batch_size
    return lambda epoch, p: pool.submit(epoch_pass, epoch, p[0]).result()


def _submit_all(batches, inflight, submit):
    """Submit every batch with at most ``inflight`` pending; returns the images made."""
    pending, got = [], 0
    for s, idx in enumerate(batches):
        if len(pending) == inflight:
            got += len(pending.pop(0).result())
        pending.append(submit(s, idx))
    return got + sum(len(f.result()) for f in pending)


def _pillow_threads_pass(data, k, resources):
    pool = cf.ThreadPoolExecutor(k)
    resources.append(pool.shutdown)
    ring = [np.empty(data.batch_shape, np.float32) for _ in range(2 * k + 1)]

    def run(epoch, p):
        batches, boxes, flips = p
        return _submit_all(batches, 2 * k, lambda s, idx: pool.submit(
            pillow_batch, data.paths, idx, boxes[idx], flips[idx], ring[s % len(ring)]))
    return run


def _pillow_processes_pass(data, k, resources):
    import multiprocessing
    from multiprocessing import shared_memory

    nslots = 2 * k + 1
    shm = shared_memory.SharedMemory(create=True,
                                     size=nslots * int(np.prod(data.batch_shape)) * 4)
    resources += [shm.unlink, shm.close]
    pool = cf.ProcessPoolExecutor(k, mp_context=multiprocessing.get_context("spawn"),
                                  initializer=_worker_init,
                                  initargs=(data.paths, shm.name, (nslots,) + data.batch_shape))
    resources.append(pool.shutdown)

    def run(epoch, p):
        batches, boxes, flips = p
        return _submit_all(batches, 2 * k, lambda s, idx: pool.submit(
            _worker_batch, s % nslots, idx, boxes[idx], flips[idx]))
    return run


PASSES = {"loader": _loader_pass, "kernel": _kernel_pass,
          "pillow_threads": _pillow_threads_pass, "pillow_processes": _pillow_processes_pass}


def _time(passes, data, repeat, progress):
    """{(method, k): [seconds per round]} and the Loaders' stats before and after."""
    warm = data.plan(WARM_UP)
    for key, fn in passes.items():   # page cache, process start-up, first allocations
        got = fn(WARM_UP, warm)
        if got != data.images:
            raise DpuPipeError(f"loader benchmark method {key} made {got} images, expected "
                               f"{data.images}")
    plan = {}
    loaders = {k: fn.loader for (m, k), fn in passes.items() if m == "loader"}
    stats0 = {k: loader.stats() for k, loader in loaders.items()}
    times = interleaved({key: (lambda fn: lambda a, b: fn(plan["r"], plan["p"]))(fn)
                         for key, fn in passes.items()}, 1, chunk=1, repeat=repeat,
                        before_round=lambda r: plan.update(r=r, p=data.plan(r)),
                        progress=progress and (lambda r: progress(
                            f"round {r + 1}/{repeat} done")))
    return times, stats0, {k: loader.stats() for k, loader in loaders.items()}


def _rows(times, images):
    """One table row per (method, k), with the ratios to the Pillow pools."""
    med = {key: statistics.median(t) for key, t in times.items()}
    base = med.get(("pillow_threads", 1))
    rows = []
    for (m, k), t in med.items():
        dl = med.get(("pillow_processes", k))
        _, slow, fast = rate_stats(times[(m, k)], images)
        rows.append(dict(method=m, workers=k, description=LOADER_METHODS[m].format(k=k),
                         img_per_s=images / t, seconds=t, img_per_s_min=slow,
                         img_per_s_max=fast, vs_pillow_1=None if base is None else base / t,
                         vs_pillow_processes=None if dl is None else dl / t))
    return rows


def _overhead(times, stats0, stats1, threads):
    """Per k: the Loader's seconds against the raw kernel's, and its producer's reading and
    its consumer's waiting as shares of its time."""
    out = []
    for k in threads:
        if ("loader", k) in times and ("kernel", k) in times:
            lt = statistics.median(times[("loader", k)])
            kt = statistics.median(times[("kernel", k)])
            total = sum(times[("loader", k)])
            d = {key: stats1[k][key] - stats0[k][key] for key in ("read_s", "wait_s")}
            out.append(dict(workers=k, loader_s=lt, kernel_s=kt,
                            overhead_pct=100.0 * (lt - kt) / kt,
                            read_pct=100.0 * d["read_s"] / total,
                            wait_pct=100.0 * d["wait_s"] / total))
    return out


def loader_benchmark(root, *, n=200, batch_size=32, size=224, threads=(1, 2), repeat=3,
                     seed=0, cores=None, methods=None, progress=None):
    """Images per second of the local Loader against a torch-free DataLoader equivalent (see
    the module's docstring for the methods).

    Parameters
    ----------
    root : path
        A directory of JPEG files (what :func:`dpu_pipe.tools.harness.load_buffers` reads
        there; a :func:`dpu_pipe.tools.sample_data.make_imagenet_like` dataset in its order).
    n, batch_size, size, repeat, seed : int
        Images per epoch (the first n), batch size, crop size (pixels), rounds, seed.
    threads : sequence of int
        Thread or worker counts k of every method.
    cores : set of int, None or False
        The cores to run on (None: every core of the machine; False: leave the affinity).
    methods : list of str, optional
        Names of :data:`LOADER_METHODS` (default: all).
    progress : callable, optional
        Called with a short text after each round.

    Returns
    -------
    dict: ``rows`` (per method and k: method, workers, description, img_per_s,
    img_per_s_min, img_per_s_max, seconds, vs_pillow_1, vs_pillow_processes), ``overhead``
    (per k: loader_s, kernel_s, overhead_pct, read_pct, wait_pct), ``images``,
    ``batch_size``, ``batches``, ``size``, ``rounds``, ``cores``.
    """
    for name, v in (("n", n), ("repeat", repeat), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    threads = tuple(int(k) for k in threads)
    if not threads or min(threads) < 1:
        raise ConfigError(f"threads must be positive counts, got {threads!r}")
    methods = list(LOADER_METHODS) if methods is None else list(methods)
    unknown = [m for m in methods if m not in LOADER_METHODS]
    if unknown:
        raise ConfigError(f"unknown loader methods {unknown}; choose from {list(LOADER_METHODS)}")
    data = _Epochs(root, n, batch_size, size, seed)
    resources = []
    with pinned(cores) as used:
        try:
            passes = {(m, k): PASSES[m](data, k, resources) for m in LOADER_METHODS
                      if m in methods for k in threads}
            times, stats0, stats1 = _time(passes, data, repeat, progress)
        finally:
            for close in reversed(resources):
                try:
                    close()
                except Exception:  # noqa: BLE001 - clean-up must go on
                    pass
    return dict(rows=_rows(times, data.images), overhead=_overhead(times, stats0, stats1,
                                                                   threads),
                images=data.images, batch_size=batch_size, batches=data.nbatches,
                size=tuple(data.batch_shape[2:]), rounds=repeat, cores=used)


def format_loader_table(result):
    """Markdown tables of :func:`loader_benchmark`: throughput and the Loader's overhead."""
    lines = ["| method | img/s | rounds min-max | vs Pillow 1 thread | vs Pillow processes, "
             "same count |", "|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        a = "" if r["vs_pillow_1"] is None else f"{r['vs_pillow_1']:.2f}x"
        b = "" if r["vs_pillow_processes"] is None else f"{r['vs_pillow_processes']:.2f}x"
        lines.append(f"| {r['description']} | {r['img_per_s']:.0f} | {r['img_per_s_min']:.0f}-"
                     f"{r['img_per_s_max']:.0f} | {a} | {b} |")
    if result["overhead"]:
        lines += ["", "| Loader vs raw kernel | Loader s/epoch | kernel s/epoch | overhead | "
                  "producer reading files | consumer waiting |", "|---|---:|---:|---:|---:|---:|"]
        for o in result["overhead"]:
            lines.append(f"| num_threads={o['workers']} | {o['loader_s']:.3f} | "
                         f"{o['kernel_s']:.3f} | {o['overhead_pct']:+.1f} % | "
                         f"{o['read_pct']:.1f} % | {o['wait_pct']:.1f} % |")
    h, w = result["size"]
    lines += ["", f"{result['images']} images per epoch ({result['batches']} batches of "
              f"{result['batch_size']}), RandomResizedCrop {h}x{w}, float32 CHW; cores "
              f"{result['cores']}; median of {result['rounds']} interleaved epochs."]
    return "\n".join(lines)


def main(argv=None):
    """Print the tables (or write them as JSON); returns the exit status."""
    p = argparse.ArgumentParser(prog="bench_loader.py", description=__doc__.split("\n\n")[0])
    cli.add_data(p, "a directory of JPEG files (only read)")
    cli.add_images(p, 200)
    p.add_argument("--batch-size", type=cli.positive_int, default=32,
                   help="batch size (default: 32)")
    p.add_argument("--threads", default="1,2",
                   help="thread or worker counts, comma-separated (default: 1,2)")
    p.add_argument("--repeat", type=cli.positive_int, default=3,
                   help="interleaved epochs (default: 3)")
    cli.add_seed(p)
    cli.add_json(p)
    args = p.parse_args(argv)
    try:
        threads = [cli.positive_int(k) for k in args.threads.split(",")]
    except argparse.ArgumentTypeError as exc:
        p.error(f"argument --threads: {exc}")
    if args.data is None:
        from dpu_pipe.tools.sample_data import sample_dataset
        args.data = sample_dataset(args.images, seed=args.seed, progress=True)
    result = loader_benchmark(args.data, n=args.images, batch_size=args.batch_size,
                              threads=threads,
                              repeat=args.repeat, seed=args.seed,
                              progress=lambda s: print(s, file=sys.stderr))
    if args.json:
        cli.write_json(args.json, result)
    if args.json != "-":
        print(format_loader_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
