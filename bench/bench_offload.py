"""DPULoader: what the host pays per offloaded batch, and images/s delivered.

    python bench/bench_offload.py [--n 320] [--batch 32] [--size 64] [--train 0.05]

launches one MPI job per configuration (MPMD: 1 host running this file with ``--host``,
plus ``python -m dpu_pipe.worker`` producer ranks) over the first ``--n`` images of the
ImageNet-like sample dataset (made once under ``.cache/``, as ``pytest bench`` does), with
RandomResizedCrop to ``--size`` px, flip, float32 CHW, and prints one row per configuration:

* ``img/s``: images per second of wall time when the host consumes as fast as it can (after
  one warm-up epoch that also opens the source on the producers);
* ``host cpu/batch``: ``time.process_time()`` of the whole host process (all its threads:
  host threads included) per batch while it "trains", i.e. sleeps ``--train`` seconds per
  batch without MPI calls; ``in step``: the part of it spent while the training step runs
  (background threads), the rest is spent in ``next()``;
* ``make/batch``: the producer's own read + decode/augment seconds per batch, from
  ``stats()`` (the local Loader's thread, for the Loader rows);
* ``host/make``: the ratio of the two — the share of the batch's production cost the host
  still pays; the offload's target is <= 1 %;
* ``late/batch``: how much longer than the training step each step took (waiting for data).

Configurations: the local Loader (1 thread) on the host; DPULoader with 1 and 2 producers on
one node with shared memory, and with MPICH ``MPIR_CVAR_NOLOCAL=1`` (an off-node DPU); hybrid
mode with 2 producers. Every rank shares this machine's cores, so producers compete with each
other and with the host. Numbers only; nothing is asserted.

The scaling sweep (batches/s against 1, 2, 4, 8, 16 producers, with 0.2 s injected per batch
and with real decode, slots 2 and 3; ``--before`` runs an earlier checkout alternately)::

    python bench/bench_offload.py --scaling --before /work/main

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
    ("DPULoader, 1 producer, shm", {}, "dpu", 1, ()),
    ("DPULoader, 2 producers, shm", {}, "dpu", 2, ()),
    ("DPULoader, 1 producer, NOLOCAL", NOLOCAL, "dpu", 1, ()),
    ("DPULoader, 2 producers, NOLOCAL", NOLOCAL, "dpu", 2, ()),
    ("DPULoader hybrid, 2 producers", {}, "dpu", 2, ("--mode", "hybrid")),
]
PRODUCERS = (1, 2, 4, 8, 16)


def host(args):
    """One configuration, on the host rank: warm-up epoch, full-speed epochs, training
    epochs; prints ``RESULT {json}``."""
    from dpu_pipe import DPULoader, FileList, Loader

    src = FileList(args.list)
    kw = dict(size=args.size, dtype="float32", layout="CHW", seed=0, num_threads=1)
    if args.loader == "loader":
        loader = Loader(src, args.batch, **kw)
    elif args.mode != "offload":
        loader = DPULoader(src, args.batch, slots=args.slots, mode=args.mode, **kw)
    else:   # the plain call, which the earlier transport understands too (--scaling)
        loader = DPULoader(src, args.batch, slots=args.slots, **kw)

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
        result = {"img_s": images / wall, "batch_s": images / args.batch / wall}
        if args.scaling:
            print("RESULT " + json.dumps(result), flush=True)
            return
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
            # cwd: `-m dpu_pipe.worker` imports from the current directory first.
            proc = subprocess.run(["timeout", "-k", "5", str(args.limit), *argv], env=full_env,
                                  cwd=ROOT, capture_output=True, text=True,
                                  timeout=args.limit + 20)
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
          "trains;\nin step: the part of it spent during the training steps (background "
          "threads; the rest is\nspent in next(): waiting, unpacking, grants); make/batch: "
          "producer read + decode/augment\ntime per batch; host/make: host cpu/batch over "
          "make/batch (target <= 1 % for DPULoader);\nlate/batch: step time beyond the "
          "training step (the host waited for data).")


def delayed_worker(args):
    """A producer rank whose batches take ``--delay`` s more (the scaling sweep's injected
    delay), for the current and the earlier worker module alike."""
    import importlib

    from dpu_pipe import worker

    # Earlier checkouts keep BatchMaker in dpu_pipe.steps, or name it StepProducer and its
    # method produce.
    mod = importlib.import_module("dpu_pipe.batch")
    if not hasattr(mod, "BatchMaker"):
        mod = importlib.import_module("dpu_pipe.steps")
    cls = getattr(mod, "BatchMaker", None) or mod.StepProducer
    name = "make" if cls.__name__ == "BatchMaker" else "produce"
    produce = getattr(cls, name)

    def slow(self, *a, **kw):
        time.sleep(args.delay)
        return produce(self, *a, **kw)

    setattr(cls, name, slow)
    worker.main([])


def scaling(args):
    """Batches/s against producer count, delay-injected and real decode, slots 2 and 3,
    this checkout ("after") against ``--before`` (a checkout of the earlier transport),
    run alternately configuration by configuration."""
    from dpu_pipe.mpi import mpiexec_argv

    listing = dataset_list(args.n)
    trees = [("after", ROOT)] + ([("before", args.before)] if args.before else [])
    print(f"batches/s, 1 host + P producers, batch {args.batch}, {args.size} px float32; "
          f"delay: producers sleep {args.delay} s per batch on top of the decode "
          f"(ideal P/{args.delay:g} batches/s); {os.cpu_count()} cores shared by all ranks\n")
    head = f"{'work':6s} {'slots':>5s} " + " ".join(
        f"{f'P={p} ' + name:>13s}" for p in PRODUCERS for name, _ in trees)
    print(head)
    print("-" * len(head))
    for work in ("delay", "decode"):
        for slots in (2, 3):
            cells = []
            for p in PRODUCERS:
                for name, tree in trees:
                    env = dict(os.environ, PYTHONPATH=tree)
                    host = mpiexec_argv(1, os.path.abspath(__file__), "--host", "--scaling",
                                        "--list", listing, "--batch", args.batch, "--size",
                                        args.size, "--slots", slots, "--epochs", args.epochs)
                    tail = ["-m", "dpu_pipe.worker"] if work == "decode" else \
                        [os.path.abspath(__file__), "--delayed-worker", "--delay", str(args.delay)]
                    argv = host + [":", "-n", str(p), sys.executable, "-m", "mpi4py", *tail]
                    try:
                        # cwd: `-m dpu_pipe.worker` imports from the current directory first.
                        proc = subprocess.run(["timeout", "-k", "5", str(args.limit), *argv],
                                              env=env, cwd=tree, capture_output=True,
                                              text=True, timeout=args.limit + 20)
                        lines = [l for l in proc.stdout.splitlines()
                                 if l.startswith("RESULT ")]
                        rate = json.loads(lines[-1][7:])["batch_s"] if lines else None
                    except subprocess.TimeoutExpired:
                        rate = None
                    cells.append("failed" if rate is None else f"{rate:.1f}")
            print(f"{work:6s} {slots:5d} " + " ".join(f"{c:>13s}" for c in cells), flush=True)


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
    ap.add_argument("--mode", default="offload", help=argparse.SUPPRESS)
    ap.add_argument("--scaling", action="store_true",
                    help="batches/s against producers 1..16 (delay-injected and real decode, "
                         "slots 2 and 3) instead of the host-cost table")
    ap.add_argument("--before", default=None,
                    help="--scaling: also run this checkout of dpu_pipe (e.g. /work/main), "
                         "alternating with this one")
    ap.add_argument("--delay", type=float, default=0.2, help="--scaling: injected s/batch")
    ap.add_argument("--delayed-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--loader", choices=("loader", "dpu"), default="dpu", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.delayed_worker:
        delayed_worker(args)
    elif args.host:
        host(args)
    elif args.scaling:
        sys.path.insert(0, ROOT)
        scaling(args)
    else:
        sys.path.insert(0, ROOT)
        driver(args)


if __name__ == "__main__":
    main()
