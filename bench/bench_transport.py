"""Delivery bandwidth of the RMA transport and the host CPU it costs.

    python bench/bench_transport.py [--steps 30] [--slots 2] [--ranks 2]

launches one MPI job per configuration (1 host + producers, one batch of 256x224x224x3 uint8
images + 256 int64 labels ~ 38.5 MB per step) and prints, per configuration:

* ``put GB/s``: the producer's ``Put`` + ``Flush`` of one payload (median over steps);
* ``stream GB/s``: payload bytes delivered per second of the host's consume loop (get +
  release, nothing else), i.e. end-to-end transport throughput;
* ``host cpu/batch``: ``time.process_time()`` of the host process per batch while it waits
  (consume loop) and, separately, while it "trains" (sleeps ``--train`` seconds per batch, no
  MPI calls): what the protocol costs the host;
* numpy ``memcpy`` of the same bytes on one core in the same job, for scale: into private
  memory, and into MPI shared memory (``Win.Allocate_shared``, where an on-node ``Put``
  writes), to tell the memory's cost from the cost of the Put path.

Configurations: shared memory on one node; MPICH ``MPIR_CVAR_NOLOCAL=1`` (an off-node DPU:
UCX does the RMA through its own shared-memory transports, one-sided like an RDMA NIC);
NOLOCAL with ``UCX_TLS=tcp,self`` (TCP loopback: RMA emulated in software, so deliveries
wait for the host's next MPI call — the "late/batch" column shows it). Numbers only; nothing
is asserted.
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
    # name, environment
    ("one node (shm)", {}),
    ("NOLOCAL (UCX shm RMA)", NOLOCAL),
    ("NOLOCAL+UCX tcp", TCP),
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


def shm_memcpy_gbps(nbytes, repeats=10):
    """Best-of copy bandwidth into MPI shared memory (``Win.Allocate_shared``, what an
    on-node ``Put`` writes into), GB/s: separates the cost of the memory itself from the
    cost of MPI's Put path."""
    from mpi4py import MPI

    win = MPI.Win.Allocate_shared(nbytes, 1, comm=MPI.COMM_SELF)
    try:
        dst = np.frombuffer(win.tomemory(), np.uint8)[:nbytes]
        src = np.full(nbytes, 7, np.uint8)
        dst[:] = 0  # first touch outside the timing
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - t)
    finally:
        win.Free()
    return nbytes / best / 1e9


def worker(args):
    from mpi4py import MPI

    from dpu_pipe.offload.transport import HostTransport, ProducerTransport

    comm = MPI.COMM_WORLD
    slot_bytes = IMAGE_BYTES + LABEL_BYTES
    if comm.Get_rank() == 0:
        # Copies of the same bytes in the same job, for scale: private memory, and MPI
        # shared memory (what an on-node Put writes into).
        results = {"memcpy_gbps": memcpy_gbps(slot_bytes),
                   "shm_memcpy_gbps": shm_memcpy_gbps(slot_bytes)}
        t = HostTransport(comm, buffers=args.slots, slot_bytes=slot_bytes, timeout=120,
                          liveness_timeout=60)
        total = args.warmup + 2 * args.steps
        tickets = [t.submit(0, 0, s) for s in range(total)]
        it = iter(tickets)

        def take():
            tk = next(it)
            t.wait(tk)
            t.release(tk)

        for _ in range(args.warmup):
            take()
        # Consume loop: the host does nothing but wait for and release batches.
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            take()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        results["stream_gbps"] = args.steps * slot_bytes / wall / 1e9
        results["wait_cpu_ms"] = 1e3 * cpu / args.steps
        # Training loop: the host computes (here: sleeps, no MPI calls) between batches.
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            time.sleep(args.train)
            take()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        results["train_cpu_ms"] = 1e3 * cpu / args.steps
        results["train_wall_over_ms"] = 1e3 * (wall / args.steps - args.train)
        puts = t.request("puts")
        results["put_gbps"] = float(np.median([g for r in puts for g in r.result(60)]))
        t.close()
        print("RESULT " + json.dumps(results), flush=True)
    else:
        # The transport's own loop, without a pipeline: the payload is ready-made, so only
        # Put/Flush and the protocol are measured.
        images = np.full(IMAGE_BYTES, 3, np.uint8)
        labels = np.arange(BATCH, dtype=np.int64)
        put_gbps = []
        t = ProducerTransport(comm)
        made = []
        while not t.stop_requested():
            for rid, kind, payload in t.requests():
                t.reply(rid, True, put_gbps)
            for work in list(made):
                g = t.granted(work)
                if g is not None:
                    made.remove(work)
                    ns = t.publish(work, *g)
                    put_gbps.append(slot_bytes / ns)
            if len(made) < 2 and (work := t.next_work()) is not None:
                work.parts = [images, labels]
                made.append(work)
            t.beat(done=min([w.seq for w in made], default=t.next_seq))
            time.sleep(1e-5)
        t.close()


def driver(args):
    from dpu_pipe.mpi import mpiexec_argv

    print(f"payload {IMAGE_BYTES + LABEL_BYTES} bytes per step ({BATCH}x{H}x{W}x{C} uint8 + "
          f"{BATCH} int64 labels), {args.slots} slots, {args.ranks - 1} producer(s), "
          f"{args.steps} steps per loop, train {args.train * 1e3:.0f} ms/step")
    print()
    head = (f"{'configuration':32s} {'memcpy':>7s} {'to shm':>7s} {'put GB/s':>9s} "
            f"{'stream GB/s':>12s} "
            f"{'cpu/batch waiting':>18s} {'cpu/batch training':>19s} {'late/batch':>11s}")
    print(head)
    print("-" * len(head))
    for name, env in CONFIGS:
        full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), **env)
        argv = ["timeout", "-k", "5", str(args.limit),
                *mpiexec_argv(args.ranks, os.path.abspath(__file__), "--worker",
                              "--steps", args.steps, "--slots", args.slots,
                              "--warmup", args.warmup, "--train", args.train)]
        proc = subprocess.run(argv, env=full_env, capture_output=True, text=True)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"{name:32s} failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
            continue
        r = json.loads(lines[-1][len("RESULT "):])
        print(f"{name:32s} {r['memcpy_gbps']:7.2f} {r['shm_memcpy_gbps']:7.2f} "
              f"{r['put_gbps']:9.2f} {r['stream_gbps']:12.2f} "
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
