"""Images per second of the local Loader against the usual DataLoader path (Pillow + numpy in a
thread pool and in a process pool), the same batches for every method
(``dpu_pipe.tools.bench_loader.loader_benchmark``). The decode benchmark is
:mod:`dpu_pipe.tools.bench_decode`.
"""

import os
import time

import numpy as np

from ..errors import ConfigError, DpuPipeError
from . import pinning
from .baselines import pil, pillow_batch_returning, pillow_worker_batch, pillow_worker_init

__all__ = ["loader_benchmark", "format_loader_table", "LOADER_METHODS"]

#: name -> description, in table order (``{k}`` is the thread or worker count).
LOADER_METHODS = {
    "loader": "dpu_pipe Loader, num_threads={k}",
    "kernel": "dpu_pipe BatchProcessor.run alone, {k} thread(s), bytes in memory",
    "pillow_threads": "Pillow + numpy, thread pool of {k}",
    "pillow_processes": "Pillow + numpy, process pool of {k} (shared-memory batches)",
}



def loader_benchmark(root, *, n=200, batch_size=32, size=224, threads=(1, 2), repeat=3,
                     seed=0, cores=None, methods=None, progress=None):
    """Images per second of the local Loader against a torch-free DataLoader equivalent.

    Every method produces the same batches: the Loader's (``EpochSampler`` order, seed
    ``seed``, ``drop_last``), RandomResizedCrop(``size``) with the boxes and flips of
    :mod:`dpu_pipe.rng`, normalized float32 CHW. Methods, each with 1..k of ``threads``:

    * ``loader``: :class:`dpu_pipe.loader.Loader` (``num_threads=k``, prefetch 2), files
      read from disk (page cache) by its producer thread;
    * ``kernel``: :meth:`BatchProcessor.run` on the same batches, bytes already in memory,
      into preallocated outputs — the Loader's floor; the gap is its overhead;
    * ``pillow_threads``: a ``concurrent.futures`` thread pool of k, one batch per task:
      file read, Pillow full decode, resize of the box (bilinear), flip, numpy normalize into
      a preallocated batch;
    * ``pillow_processes``: the same in a process pool of k (spawned once, kept across
      rounds like ``persistent_workers``), writing into shared-memory batches as DataLoader
      workers do; 2k batches in flight (``prefetch_factor=2``).

    The Pillow methods get each epoch's boxes precomputed (vectorized) before timing; the
    dpu_pipe methods draw theirs inside. Methods are interleaved round by round (starting at
    a different method each round), each round is one epoch over the first ``n`` samples of
    ``root`` (a :func:`dpu_pipe.tools.sample_data.make_imagenet_like` dataset), one untimed warm-up
    epoch first; the median round counts. Nothing is asserted about the timings.

    ``cores``: the cores to run on (None: every core of the machine; False: leave the
    affinity as it is). Returns a dict: ``rows`` (one per method and k, table order: method,
    workers, description, img_per_s, img_per_s_min, img_per_s_max, seconds, vs_pillow_1 —
    ratio to the Pillow thread pool of 1 — and vs_pillow_processes — ratio to the process pool
    of the same k), ``overhead`` (per k: loader_s, kernel_s, overhead_pct, read_pct — the
    share of the Loader's time its producer spent reading files, wait_pct — the consumer's
    waiting), and ``images``, ``batch_size``, ``batches``, ``size``, ``rounds``, ``cores``.
    """
    import concurrent.futures as cf
    import multiprocessing
    from multiprocessing import shared_memory

    from ..batch import BatchProcessor
    from ..loader import Loader
    from ..rng import random_flip, random_resized_crop
    from ..sampler import EpochSampler
    from .sample_data import dataset_files
    from ..sources import FileList
    from ..transforms import IMAGENET_MEAN, IMAGENET_STD, TransformConfig

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
    Image = pil()
    paths, labels = dataset_files(root)
    paths, labels = [str(p) for p in paths[:n]], labels[:n]
    count = len(paths)
    if count < batch_size:
        raise ConfigError(f"{count} images make no batch of {batch_size}")
    source = FileList(list(zip(paths, labels)))
    cfg = TransformConfig(train=True, size=size)
    out_size = cfg.size
    mean = np.asarray(IMAGENET_MEAN, np.float32)
    std = np.asarray(IMAGENET_STD, np.float32)
    sampler = EpochSampler(count, seed=seed)
    nbatches = count // batch_size
    images_per_pass = nbatches * batch_size
    batch_shape = (batch_size,) + cfg.sample_shape
    heights = np.empty(count, np.int64)
    widths = np.empty(count, np.int64)
    for i, p in enumerate(paths):
        with Image.open(p) as im:  # header only
            widths[i], heights[i] = im.size
    buffers = [open(p, "rb").read() for p in paths]
    index = np.arange(count, dtype=np.int64)

    def plan(epoch):
        """Per epoch: batches of indices, and every sample's box and flip."""
        batches = [sampler.batch(epoch, s, batch_size, True) for s in range(nbatches)]
        top, left, h, w = random_resized_crop(seed, epoch, index, heights, widths,
                                              cfg.scale, cfg.ratio)
        return batches, np.stack([top, left, h, w], axis=1), random_flip(seed, epoch, index)

    previous_affinity = pinning.pin(cores)
    used_cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    resources = []          # closed in the finally below
    passes = {}             # (method, k) -> fn(epoch, plan) running one epoch

    def add_loader(k):
        loader = Loader(source, batch_size, size=size, seed=seed, num_threads=k, prefetch=2)
        resources.append(loader.close)

        def run(epoch, _plan):
            loader.set_epoch(epoch)
            got = 0
            for images, _ in loader:
                got += len(images)
            return got
        run.loader = loader
        passes[("loader", k)] = run

    def add_kernel(k):
        # The kernel runs in a thread of its own, started with the widened affinity, so its
        # OpenMP team is not bound to an affinity the calling thread had before.
        bp = BatchProcessor(cfg, k)
        pool = cf.ThreadPoolExecutor(1)
        resources.append(pool.shutdown)
        ring = [bp.empty(batch_size) for _ in range(2)]

        def epoch_pass(epoch, batches):
            for s, idx in enumerate(batches):
                _, _, errors = bp.run([buffers[i] for i in idx.tolist()], idx, epoch=epoch,
                                      seed=seed, out=ring[s % 2])
                if errors:
                    raise next(iter(errors.values()))
            return len(batches) * batch_size

        passes[("kernel", k)] = lambda epoch, p: pool.submit(epoch_pass, epoch, p[0]).result()

    def add_pillow_threads(k):
        pool = cf.ThreadPoolExecutor(k)
        resources.append(pool.shutdown)
        inflight = 2 * k
        ring = [np.empty(batch_shape, np.float32) for _ in range(inflight + 1)]

        def run(epoch, p):
            batches, boxes, flips = p
            pending = []
            got = 0
            for s, idx in enumerate(batches):
                if len(pending) == inflight:
                    got += len(pending.pop(0).result())
                pending.append(pool.submit(pillow_batch_returning, Image, paths, idx, boxes,
                                           flips, out_size, mean, std,
                                           ring[s % len(ring)]))
            for f in pending:
                got += len(f.result())
            return got
        passes[("pillow_threads", k)] = run

    def add_pillow_processes(k):
        inflight = 2 * k
        nslots = inflight + 1
        shm = shared_memory.SharedMemory(create=True,
                                         size=nslots * int(np.prod(batch_shape)) * 4)
        resources.append(shm.unlink)
        resources.append(shm.close)
        ctx = multiprocessing.get_context("spawn")
        pool = cf.ProcessPoolExecutor(k, mp_context=ctx, initializer=pillow_worker_init,
                                      initargs=(paths, out_size, mean, std, shm.name,
                                                batch_shape, nslots))
        resources.append(pool.shutdown)
        slots = np.ndarray((nslots,) + batch_shape, dtype=np.float32, buffer=shm.buf)

        def run(epoch, p):
            batches, boxes, flips = p
            pending = []
            got = 0
            for s, idx in enumerate(batches):
                if len(pending) == inflight:
                    got += len(pending.pop(0).result())
                pending.append(pool.submit(pillow_worker_batch, s % nslots, idx, boxes[idx],
                                           flips[idx]))
            for f in pending:
                got += len(f.result())
            return got
        run.slots = slots
        passes[("pillow_processes", k)] = run

    adders = {"loader": add_loader, "kernel": add_kernel, "pillow_threads": add_pillow_threads,
              "pillow_processes": add_pillow_processes}
    try:
        for m in LOADER_METHODS:
            if m in methods:
                for k in threads:
                    adders[m](k)
        order = list(passes)
        # Warm-up epoch (untimed): page cache, process start-up, first allocations. It also
        # checks that every method makes every image of the epoch.
        warm = plan(2**31)
        for key in order:
            got = passes[key](2**31, warm)
            if got != images_per_pass:
                raise DpuPipeError(f"loader benchmark method {key} made {got} images, "
                                   f"expected {images_per_pass}")
        times = {key: [] for key in order}
        stats0 = {k: passes[("loader", k)].loader.stats() for k in threads
                  if ("loader", k) in passes}
        for r in range(repeat):
            p = plan(r)
            for key in order[r % len(order):] + order[:r % len(order)]:
                t0 = time.perf_counter()
                passes[key](r, p)
                times[key].append(time.perf_counter() - t0)
            if progress is not None:
                progress(f"round {r + 1}/{repeat} done")
        stats1 = {k: passes[("loader", k)].loader.stats() for k in stats0}
    finally:
        for close in reversed(resources):
            try:
                close()
            except Exception:  # noqa: BLE001 - clean-up must go on
                pass
        pinning.restore(previous_affinity)

    med = {key: float(np.median(t)) for key, t in times.items()}
    base = med.get(("pillow_threads", 1))
    rows = []
    for (m, k), t in med.items():
        dl = med.get(("pillow_processes", k))
        rows.append(dict(method=m, workers=k, description=LOADER_METHODS[m].format(k=k),
                         img_per_s=images_per_pass / t, seconds=t,
                         img_per_s_min=images_per_pass / max(times[(m, k)]),
                         img_per_s_max=images_per_pass / min(times[(m, k)]),
                         vs_pillow_1=None if base is None else base / t,
                         vs_pillow_processes=None if dl is None else dl / t))
    overhead = []
    for k in threads:
        if ("loader", k) in med and ("kernel", k) in med:
            lt, kt = med[("loader", k)], med[("kernel", k)]
            total = sum(times[("loader", k)])
            d = {key: stats1[k][key] - stats0[k][key] for key in ("read_s", "wait_s")}
            overhead.append(dict(workers=k, loader_s=lt, kernel_s=kt,
                                 overhead_pct=100.0 * (lt - kt) / kt,
                                 read_pct=100.0 * d["read_s"] / total,
                                 wait_pct=100.0 * d["wait_s"] / total))
    return dict(rows=rows, overhead=overhead, images=images_per_pass, batch_size=batch_size,
                batches=nbatches, size=out_size, rounds=repeat, cores=used_cores)



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
