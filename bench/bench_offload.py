"""DPULoader: what the host pays per offloaded batch, and images/s delivered.

    python bench/bench_offload.py [--n 320] [--batch 32] [--size 64] [--train 0.05]

launches one MPI job per configuration (MPMD: 1 host running this file with ``--host``,
plus ``python -m dpu_pipe.worker`` producer ranks) over the first ``--n`` images of the
ImageNet-like sample dataset (made once under ``.cache/``, as ``pytest bench`` does), with
RandomResizedCrop to ``--size`` px, flip, float32 CHW, and prints one row per configuration:

* ``img/s``: images per second of wall time when the host consumes as fast as it can (after
  one warm-up epoch that also opens the source on the producers);
* ``host cpu/batch``: ``time.process_time()`` of the whole host process (all its threads:
  the MPI progress thread included) per batch while it "trains", i.e. sleeps ``--train``
  seconds per batch without MPI calls; ``in step``: the part of it spent while the training
  step runs (the progress thread's polling), the rest is spent in ``next()``;
* ``make/batch``: the producer's own read + decode/augment seconds per batch, from
  ``stats()`` (the local Loader's thread, for the Loader rows);
* ``host/make``: the ratio of the two — the share of the batch's production cost the host
  still pays; the offload's target is <= 1 %;
* ``late/batch``: how much longer than the training step each step took (waiting for data).

Configurations: the local Loader (1 thread) on the host; DPULoader with 1 and 2 workers on
one node with shared memory, and with MPICH ``MPIR_CVAR_NOLOCAL=1`` (an off-node DPU); then,
to show where the host's CPU goes, 2 workers without the MPI progress thread (shared memory
needs none) and with the thread polling every 5 ms instead of the transport's 0.5 ms (set
through the transport's default: DPULoader has no argument for it). Every rank shares this
machine's cores, so producers compete with each other and with the host.
Numbers only; nothing is asserted.

The host side alone, under mpiexec::

    mpiexec -n 1 python -m mpi4py bench/bench_offload.py --host --list LIST \\
          : -n 2 python -m mpi4py -m dpu_pipe.worker
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".cache", "dpu_pipe")

NOLOCAL = {"MPIR_CVAR_NOLOCAL": "1"}
CONFIGS = [
    # name, environment, loader ("loader" | "dpu"), producer ranks, host options
    ("Loader, 1 thread (local)", {}, "loader", 0, ()),
    ("DPULoader, 1 worker, shm", {}, "dpu", 1, ()),
    ("DPULoader, 2 workers, shm", {}, "dpu", 2, ()),
    ("DPULoader, 1 worker, NOLOCAL", NOLOCAL, "dpu", 1, ()),
    ("DPULoader, 2 workers, NOLOCAL", NOLOCAL, "dpu", 2, ()),
    # Where the host's CPU goes: without the progress thread (enough with shared memory),
    # and with the thread polling every 5 ms instead of 0.5 ms.
    ("  2 workers, shm, no progress", {}, "dpu", 2, ("--progress", "none")),
    ("  2 workers, NOLOCAL, poll 5 ms", NOLOCAL, "dpu", 2, ("--progress-interval", "0.005")),
]


def host(args):
    """One configuration, on the host rank: warm-up epoch, full-speed epochs, training
    epochs; prints ``RESULT {json}``."""
    from dpu_pipe import DPULoader, FileList, Loader

    src = FileList(args.list)
    kw = dict(size=args.size, dtype="float32", layout="CHW", seed=0, num_threads=1)
    if args.progress_interval is not None:
        # DPULoader has no argument for it: change the transport's default.
        from dpu_pipe.transport import Consumer
        Consumer.__init__.__kwdefaults__["progress_interval"] = args.progress_interval
    if args.loader == "loader":
        loader = Loader(src, args.batch, **kw)
    else:
        loader = DPULoader(src, args.batch, slots=args.slots, progress=args.progress, **kw)

    def made():
        s = loader.stats()
        if args.loader == "loader":
            return s["read_s"] + s["process_s"]
        return s["producer_read_s"] + s["producer_process_s"]

    with loader:
        for _ in loader:                      # warm-up: page cache, producers open the source
            pass
        images, wall = 0, time.perf_counter()
        for _ in range(args.epochs):
            for x, y in loader:
                images += len(y)
        wall = time.perf_counter() - wall
        result = {"img_s": images / wall}
        batches, made0, in_step = 0, made(), 0.0
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.epochs):
            for x, y in loader:
                c = time.process_time()
                time.sleep(args.train)        # "training": no MPI calls, no Python work
                in_step += time.process_time() - c
                batches += 1
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        result.update(host_cpu_ms=1e3 * cpu / batches, step_cpu_ms=1e3 * in_step / batches,
                      make_ms=1e3 * (made() - made0) / batches,
                      late_ms=1e3 * (wall / batches - args.train), batches=batches)
        if args.loader == "dpu":
            result["steps_per_producer"] = loader.stats()["steps_per_producer"]
    print("RESULT " + json.dumps(result), flush=True)


def dataset_list(n):
    """A file list of the first ``n`` images of the cached ImageNet-like dataset."""
    from dpu_pipe.tools.sample_data import dataset_files, make_imagenet_like

    root = os.path.join(CACHE, "imagenet_like_n1000_s0")
    make_imagenet_like(root, n=1000, classes=10, seed=0)
    paths, labels = dataset_files(root)
    path = os.path.join(CACHE, f"bench_offload_n{n}.txt")
    with open(path, "w") as f:
        for p, label in list(zip(paths, labels))[:n]:
            f.write(f"{p} {label}\n")
    return path


def driver(args):
    from dpu_pipe.mpi import mpiexec_argv

    listing = dataset_list(args.n)
    print(f"{args.n} ImageNet-like JPEGs, batch {args.batch}, RandomResizedCrop {args.size} px "
          f"float32 CHW, {args.slots} slots, {args.epochs} epochs per phase, training step "
          f"{args.train * 1e3:.0f} ms, {os.cpu_count()} cores shared by all ranks\n")
    head = (f"{'configuration':31s} {'img/s':>7s} {'host cpu/batch':>15s} {'in step':>9s} "
            f"{'make/batch':>11s} {'host/make':>10s} {'late/batch':>11s}  steps per producer")
    print(head)
    print("-" * len(head))
    for name, env, loader, producers, options in CONFIGS:
        full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), **env)
        argv = mpiexec_argv(1, os.path.abspath(__file__), "--host", "--list", listing,
                            "--loader", loader, "--batch", args.batch, "--size", args.size,
                            "--slots", args.slots, "--epochs", args.epochs,
                            "--train", args.train, *options)
        if producers:
            argv += [":", "-n", str(producers), sys.executable, "-m", "mpi4py",
                     "-m", "dpu_pipe.worker"]
        try:
            proc = subprocess.run(["timeout", "-k", "5", str(args.limit), *argv], env=full_env,
                                  capture_output=True, text=True, timeout=args.limit + 20)
        except subprocess.TimeoutExpired:
            print(f"{name:31s} hung past {args.limit + 20} s")
            continue
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"{name:31s} failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
            continue
        r = json.loads(lines[-1][len("RESULT "):])
        spread = r.get("steps_per_producer")
        spread = ", ".join(f"{k}: {v}" for k, v in sorted(spread.items())) if spread else "-"
        print(f"{name:31s} {r['img_s']:7.0f} {r['host_cpu_ms']:12.2f} ms "
              f"{r['step_cpu_ms']:6.2f} ms {r['make_ms']:8.1f} ms "
              f"{100 * r['host_cpu_ms'] / r['make_ms']:9.1f}% {r['late_ms']:8.1f} ms  {spread}",
              flush=True)
    print("\nhost cpu/batch: process_time of the host process (all threads) per batch while it "
          "trains;\nin step: the part of it spent during the training steps (the progress "
          "thread; the rest is\nspent in next(): waiting, unpacking, credits); make/batch: "
          "producer read + decode/augment\ntime per batch; host/make: host cpu/batch over "
          "make/batch (target <= 1 % for DPULoader);\nlate/batch: step time beyond the "
          "training step (the host waited for data).")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=320, help="images of the sample dataset used")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=64, help="output size, px")
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2, help="epochs per measured phase")
    ap.add_argument("--train", type=float, default=0.05, help="simulated training s per batch")
    ap.add_argument("--limit", type=int, default=300, help="wall-clock limit per job, s")
    ap.add_argument("--host", action="store_true", help="run as the host rank of one job")
    ap.add_argument("--list", help=argparse.SUPPRESS)
    ap.add_argument("--progress", default="thread", help=argparse.SUPPRESS)
    ap.add_argument("--progress-interval", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--loader", choices=("loader", "dpu"), default="dpu", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.host:
        host(args)
    else:
        sys.path.insert(0, ROOT)
        driver(args)


if __name__ == "__main__":
    main()
