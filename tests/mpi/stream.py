"""One transport scenario, run under ``mpiexec -n N python -m mpi4py tests/mpi/stream.py``.

Ranks ``0 .. hosts-1`` are hosts, the others producers. Every host requests ``epochs x steps``
batches whose bytes are a function of (epoch, step), checks each byte, the order, and (with the
producers' reports) that every step was produced exactly once. Fault options make one producer
publish an error, stop answering (SIGSTOP) or die (SIGKILL) when it gets a given step.
Hosts print ``OK host=<rank> ...`` on success; the exit code says the rest.
"""
import argparse
import os
import signal
import time

import numpy as np
from mpi4py import MPI

from dpu_pipe.errors import DecodeError, ProducerError
from dpu_pipe.transport import Consumer, Producer, discover_roles, host_comm

LABELS = 16  # int64 labels per batch, sent as a second part after the image bytes


def batch_bytes(epoch, step, nbytes):
    """Image bytes of a batch: a pattern no other (epoch, step) shares at the same offsets."""
    i = np.arange(nbytes, dtype=np.uint64)
    return ((i * np.uint64(31) + np.uint64(epoch * 7919 + step * 131 + 17)) % np.uint64(251)).astype(np.uint8)


def batch_labels(epoch, step):
    return np.arange(LABELS, dtype=np.int64) + epoch * 1_000_003 + step * 1009


def image_bytes(args, step):
    # Sizes vary by step so payload_bytes is exercised; at most the slot capacity.
    return args.image_bytes - (step % 3) * 17


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=1)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--image-bytes", type=int, default=10_000)
    ap.add_argument("--producer-delay", type=float, default=0.0, help="max random delay per batch, s")
    ap.add_argument("--consumer-delay", type=float, default=0.0, help="host sleep per batch, s")
    ap.add_argument("--fail-at", type=int, default=-1, help="step whose producer raises")
    ap.add_argument("--fail-kind", choices=("decode", "runtime"), default="decode")
    ap.add_argument("--kill-at", type=int, default=-1, help="step whose producer SIGKILLs itself")
    ap.add_argument("--freeze-at", type=int, default=-1, help="step whose producer SIGSTOPs itself")
    ap.add_argument("--liveness", type=float, default=20.0)
    ap.add_argument("--host-timeout", type=float, default=None)
    ap.add_argument("--freeze-host-at", type=int, default=-1,
                    help="the host SIGSTOPs itself after receiving this step")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--progress", choices=("thread", "none"), default="thread")
    ap.add_argument("--serve", action="store_true", help="producers use Producer.serve()")
    ap.add_argument("--report", default=None,
                    help="every rank writes the error that ends it to <report>.<rank>: the "
                         "launcher may cut its stderr short when it aborts the job")
    ap.add_argument("--sleep-fill", type=float, default=0.0,
                    help="host requests `slots` steps, sleeps this long without MPI calls, and "
                         "reports whether every slot was filled during the sleep")
    args = ap.parse_args()

    world = MPI.COMM_WORLD
    role = "host" if world.Get_rank() < args.hosts else "producer"
    roles = discover_roles(world, role)
    comm = host_comm(world, roles)
    try:
        if role == "host":
            start = time.monotonic()
            try:
                run_host(comm, args, roles)
            except BaseException as exc:
                if args.report:
                    with open(f"{args.report}.{world.Get_rank()}", "w") as f:
                        f.write(f"{type(exc).__name__} after {time.monotonic() - start:.2f}s: {exc}\n")
                raise
        else:
            try:
                run_producer(comm, args)
            except BaseException as exc:
                if args.report:
                    with open(f"{args.report}.{world.Get_rank()}", "w") as f:
                        f.write(f"{type(exc).__name__}: {exc}\n")
                raise
    finally:
        comm.Free()


def run_producer(comm, args):
    rng = np.random.default_rng(1000 + MPI.COMM_WORLD.Get_rank())
    done = []  # (ticket, epoch, step, time published)

    def produce(work):
        for at, sig in ((args.kill_at, signal.SIGKILL), (args.freeze_at, signal.SIGSTOP)):
            if work.step == at and work.epoch == 0:
                if args.report:
                    with open(f"{args.report}.victim", "w") as f:
                        f.write(f"world rank {MPI.COMM_WORLD.Get_rank()} on")
                os.kill(os.getpid(), sig)
        if args.producer_delay:
            time.sleep(rng.uniform(0, args.producer_delay))
        if work.step == args.fail_at and work.epoch == 0:
            if args.fail_kind == "decode":
                raise DecodeError("Corrupt JPEG data: premature end of data segment",
                                  index=1000 + work.step, path=f"/data/train/{work.step}.jpg")
            raise KeyError(f"no sample for step {work.step}")
        return batch_bytes(work.epoch, work.step, image_bytes(args, work.step)), \
            batch_labels(work.epoch, work.step)

    with Producer(comm) as producer:
        if args.serve:
            def produce_and_log(work):
                done.append((work.ticket, work.epoch, work.step, None))
                return produce(work)
            producer.serve(produce_and_log)
        else:
            # The loop serve() runs, spelled out to record when each step was published.
            while (work := producer.claim()) is not None:
                try:
                    parts = produce(work)
                except Exception as exc:
                    producer.publish_error(work, exc)
                else:
                    producer.publish(work, *parts)
                done.append((work.ticket, work.epoch, work.step, time.time()))
    comm.gather(done, root=0)


def run_host(comm, args, roles):
    me = MPI.COMM_WORLD.Get_rank()
    slot_bytes = args.image_bytes + LABELS * 8
    expected = [(e, s) for e in range(args.epochs) for s in range(args.steps)]
    got, producers, caught = [], {}, []
    t0 = time.monotonic()
    cpu0 = time.process_time()
    with Consumer(comm, slots=args.slots, slot_bytes=slot_bytes, timeout=args.timeout,
                  liveness_timeout=args.liveness, host_timeout=args.host_timeout,
                  progress=args.progress) as consumer:
        sleep_end = None
        if args.sleep_fill:
            for e, s in expected[:args.slots]:
                consumer.request(e, s)
            time.sleep(args.sleep_fill)  # "training": no MPI calls on this thread
            sleep_end = time.time()
            for e, s in expected[args.slots:]:
                consumer.request(e, s)
        else:
            for e, s in expected:
                consumer.request(e, s)
        for e, s in expected:
            try:
                batch = consumer.get()
            except DecodeError as exc:
                assert (e, s) == (0, args.fail_at) and args.fail_kind == "decode", (e, s, exc)
                assert exc.index == 1000 + s and exc.path == f"/data/train/{s}.jpg", exc
                assert isinstance(exc.__cause__, ProducerError), exc.__cause__
                assert "producer rank" in exc.__cause__.producer
                assert "Corrupt JPEG" in str(exc) and "raise DecodeError" in exc.__cause__.remote_traceback
                caught.append(f"DecodeError index={exc.index} path={exc.path} by {exc.__cause__.producer}")
                got.append((e, s))
                continue
            except ProducerError as exc:
                assert (e, s) == (0, args.fail_at) and args.fail_kind == "runtime", (e, s, exc)
                assert "KeyError" in str(exc) and "producer rank" in exc.producer
                assert "raise KeyError" in exc.remote_traceback
                assert isinstance(exc.__cause__, KeyError)
                caught.append(f"ProducerError by {exc.producer}")
                got.append((e, s))
                continue
            with batch:
                assert (batch.epoch, batch.step) == (e, s), (batch, e, s)
                n = image_bytes(args, s)
                assert batch.payload.nbytes == n + LABELS * 8, batch
                if not np.array_equal(batch.payload[:n], batch_bytes(e, s, n)):
                    bad = np.flatnonzero(batch.payload[:n] != batch_bytes(e, s, n))
                    raise AssertionError(f"{batch}: {bad.size} wrong bytes, first at {bad[0]}")
                labels = batch.payload[n:].view(np.int64)
                assert np.array_equal(labels, batch_labels(e, s)), (batch, labels)
                producers[batch.producer] = producers.get(batch.producer, 0) + 1
                got.append((e, s))
            if args.consumer_delay:
                time.sleep(args.consumer_delay)
            if s == args.freeze_host_at:
                os.kill(os.getpid(), signal.SIGSTOP)
        elapsed = time.monotonic() - t0
    cpu = time.process_time() - cpu0
    assert got == expected, "steps out of order or missing"
    reports = comm.gather(None, root=0)[1:]
    tickets = sorted(t for rep in reports for t, *_ in rep)
    # Every ticket up to the last requested one produced exactly once (producers may hold
    # one more claimed but ungranted ticket each, which they never produce).
    assert tickets == list(range(len(expected))), f"tickets produced: {tickets}"
    pairs = sorted((e, s) for rep in reports for _, e, s, _ in rep)
    assert pairs == expected, "a step was produced twice or never"
    fill = ""
    if sleep_end is not None:
        first = sorted(rep_t for rep in reports for t, _, _, rep_t in rep if t < args.slots)
        during = sum(t <= sleep_end for t in first)
        fill = f" filled_during_sleep={during}/{args.slots}"
    print(f"OK host={me} group={comm.Get_size()} steps={len(got)} by_producer={producers} "
          f"caught={caught} elapsed={elapsed:.2f}s cpu={cpu:.2f}s{fill}", flush=True)


if __name__ == "__main__":
    main()
