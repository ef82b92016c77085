"""Delivery bandwidth of the RMA transport and the host CPU it costs.

    python bench/bench_transport.py [--steps 30] [--slots 2] [--ranks 2]

launches one MPI job per configuration (1 host + producers, one batch of 256x224x224x3 uint8
images + 256 int64 labels ~ 38.5 MB per step) and prints, per configuration:

* ``put GB/s``: the producer's ``Put`` + ``Flush`` of one payload (median over steps);
* ``stream GB/s``: payload bytes delivered per second of the host's consume loop (get +
  release, nothing else), i.e. end-to-end transport throughput;
* ``host cpu/batch``: ``time.process_time()`` of the host process (all its threads) per batch
  while it waits in ``get()`` (consume loop) and, separately, while it "trains" (sleeps
  ``--train`` seconds per batch, no MPI calls) — the cost of the progress mechanism;
* numpy ``memcpy`` of the same bytes on one core, for scale.

Configurations: shared memory on one node; MPICH ``MPIR_CVAR_NOLOCAL=1`` (an off-node DPU,
UCX may still use its own shared-memory transports); NOLOCAL with ``UCX_TLS=tcp,self``
(TCP loopback, the slowest honest emulation of a network); each with the host's progress
thread at two poll intervals, with MPICH's ``MPIR_CVAR_ASYNC_PROGRESS=1`` instead, and with
no progress mechanism at all (then a "training" host delays every delivery). Numbers only;
nothing is asserted.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, H, W, C = 256, 224, 224, 3
IMAGE_BYTES = BATCH * H * W * C
LABEL_BYTES = BATCH * 8

NOLOCAL = {"MPIR_CVAR_NOLOCAL": "1"}
TCP = {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self"}
CONFIGS = [
    # name, environment, progress, progress thread's poll interval (s)
    ("one node (shm), thread 0.5 ms", {}, "thread", 5e-4),
    ("one node (shm), no progress", {}, "none", 5e-4),
    ("NOLOCAL, thread 0.5 ms", NOLOCAL, "thread", 5e-4),
    ("NOLOCAL, thread 2 ms", NOLOCAL, "thread", 2e-3),
    ("NOLOCAL, ASYNC_PROGRESS=1", dict(NOLOCAL, MPIR_CVAR_ASYNC_PROGRESS="1"), "none", 5e-4),
    ("NOLOCAL, no progress", NOLOCAL, "none", 5e-4),
    ("NOLOCAL+UCX tcp, thread 0.5 ms", TCP, "thread", 5e-4),
    ("NOLOCAL+UCX tcp, thread 2 ms", TCP, "thread", 2e-3),
]


def memcpy_gbps(nbytes, repeats=10):
    """Best-of-``repeats`` single-core numpy copy bandwidth, GB/s (1e9 bytes)."""
    src = np.full(nbytes, 7, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def worker(args):
    from mpi4py import MPI

    from dpu_pipe.transport import Consumer, Producer

    comm = MPI.COMM_WORLD
    slot_bytes = IMAGE_BYTES + LABEL_BYTES
    if comm.Get_rank() == 0:
        results = {}
        with Consumer(comm, slots=args.slots, slot_bytes=slot_bytes, progress=args.progress,
                      progress_interval=args.interval, timeout=120, liveness_timeout=60) as consumer:
            for s in range(args.warmup + 2 * args.steps):
                consumer.request(0, s)
            for _ in range(args.warmup):
                consumer.get().release()
            # Consume loop: the host does nothing but wait for and release batches.
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                consumer.get().release()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            results["stream_gbps"] = args.steps * slot_bytes / wall / 1e9
            results["wait_cpu_ms"] = 1e3 * cpu / args.steps
            # Training loop: the host computes (here: sleeps, no MPI calls) between batches;
            # its CPU time then is what the transport and progress mechanism cost.
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                time.sleep(args.train)
                consumer.get().release()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            results["train_cpu_ms"] = 1e3 * cpu / args.steps
            results["train_wall_over_ms"] = 1e3 * (wall / args.steps - args.train)
        puts = comm.gather(None, root=0)[1:]
        results["put_gbps"] = float(np.median([g for p in puts for g in p]))
        print("RESULT " + json.dumps(results), flush=True)
    else:
        images = np.full(IMAGE_BYTES, 3, np.uint8)
        labels = np.arange(BATCH, dtype=np.int64)
        put_gbps = []
        with Producer(comm) as producer:
            while (work := producer.claim()) is not None:
                t = time.perf_counter()
                producer.publish(work, images, labels)
                put_gbps.append(slot_bytes / (time.perf_counter() - t) / 1e9)
        comm.gather(put_gbps, root=0)


def driver(args):
    from dpu_pipe.mpi import mpiexec_argv

    print(f"payload {IMAGE_BYTES + LABEL_BYTES} bytes per step ({BATCH}x{H}x{W}x{C} uint8 + "
          f"{BATCH} int64 labels), {args.slots} slots, {args.ranks - 1} producer(s), "
          f"{args.steps} steps per loop, train {args.train * 1e3:.0f} ms/step")
    print(f"numpy memcpy, one core: {memcpy_gbps(IMAGE_BYTES + LABEL_BYTES):.2f} GB/s\n")
    head = (f"{'configuration':32s} {'put GB/s':>9s} {'stream GB/s':>12s} "
            f"{'cpu/batch waiting':>18s} {'cpu/batch training':>19s} {'late/batch':>11s}")
    print(head)
    print("-" * len(head))
    for name, env, progress, interval in CONFIGS:
        full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), **env)
        argv = ["timeout", "-k", "5", str(args.limit),
                *mpiexec_argv(args.ranks, os.path.abspath(__file__), "--worker",
                              "--steps", args.steps, "--slots", args.slots,
                              "--warmup", args.warmup, "--train", args.train,
                              "--progress", progress, "--interval", interval)]
        proc = subprocess.run(argv, env=full_env, capture_output=True, text=True)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"{name:32s} failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
            continue
        r = json.loads(lines[-1][len("RESULT "):])
        print(f"{name:32s} {r['put_gbps']:9.2f} {r['stream_gbps']:12.2f} "
              f"{r['wait_cpu_ms']:15.1f} ms {r['train_cpu_ms']:16.2f} ms "
              f"{r['train_wall_over_ms']:8.1f} ms", flush=True)
    print("\ncpu/batch: process_time of the whole host process (all threads) per batch; "
          "late/batch: how much longer than the simulated training step each step took.")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="batches per measured loop")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2, help="MPI ranks: 1 host + producers")
    ap.add_argument("--train", type=float, default=0.1, help="simulated training s per batch")
    ap.add_argument("--progress", default="thread")
    ap.add_argument("--interval", type=float, default=5e-4)
    ap.add_argument("--limit", type=int, default=300, help="wall-clock limit per job, s")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    else:
        sys.path.insert(0, ROOT)
        driver(args)


if __name__ == "__main__":
    main()
