"""Host side of the thread-safety scenarios of the offloaded modes, run under mpiexec (MPMD)
by ``test_threads_offload.py``::

    mpiexec -n 1 python -m mpi4py tests/mpi/threads_host.py SCENARIO --data D --out O ... \\
          : -n P python -m mpi4py -m dpu_pipe.worker

Scenarios:

``stress``
    A DPULoader of ``--mode`` (offload or hybrid) hammered from several threads for
    ``--seconds`` while one thread consumes it and another moves it (set_epoch, state_dict,
    load_state_dict, close, iter) — the harness of ``tests/test_threads.py`` — every batch
    checked against a fresh local Loader's stream, every describe() against a fresh
    loader's. Then two DPULoaders (a train and a validation stream, which share the host
    window) are iterated in two threads at once, ``--batches`` batches each, both checked.
``validation``
    RemoteValidation used from three threads while the main thread iterates a DPULoader for
    two epochs (checked against the Loader's stream; ``--data`` must have 5 classes): two threads submit two snapshots each, a third
    polls every future's ``done()``; each result must equal the host's own evaluation of its
    snapshot. Then ``close()`` from another thread: a later ``submit`` raises ConfigError.
``exit``
    Leave the interpreter while a daemon thread iterates a DPULoader of ``--mode`` and the
    main thread holds an iteration of another one in the middle of an epoch: the job must
    end cleanly (the host group releases the producers at exit).
``loop``
    Iterate a DPULoader of ``--mode`` epoch after epoch, forever; print ``READY`` after two
    batches (the test then sends SIGINT).

Writes ``<out>/host0.json`` and prints ``OK host=0`` on success; an exception ends the job
(``python -m mpi4py``).
"""
import argparse
import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path

# The local harness and its checks: one definition of the contract's stress test.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_threads import DEADLINE, KW, N, check_batch, join_all, reference, stress  # noqa: E402


def run_stress(args, src):
    from dpu_pipe import DPULoader, Loader

    ref = reference(src)
    with Loader(src, 4, **KW) as fresh:
        fresh_describe = {(e, i): fresh.describe(e, i) for e in range(2) for i in range(N)}
    check = Loader(src, 4, **KW)
    # copy=True: a batch in a window slot is valid until the next one is requested, from
    # any thread; the threads here check theirs while the others move on.
    ld = DPULoader(src, 4, mode=args.mode, slots=3, copy=True, **KW)
    consumed, moved = stress(ld, ref, args.seconds, fresh_describe, check.load_state_dict)
    assert consumed >= 20 and moved >= 10, (consumed, moved)
    stats = ld.stats()
    # Two loaders of one process, two threads: they take turns on the host window.
    val_kw = dict(KW, train=False)
    ref_val = reference(src, train=False)
    # copy=True: iterating one loader gives back the other's held slot (one stream at a
    # time in the window).
    loaders = [DPULoader(src, 4, mode=args.mode, slots=3, copy=True, **KW),
               DPULoader(src, 4, mode=args.mode, slots=3, copy=True, **val_kw)]
    refs = [ref, ref_val]
    counts, errors = [0, 0], []

    def iterate(k):
        try:
            while counts[k] < args.batches:
                it = iter(loaders[k])
                for x, y in it:
                    check_batch(refs[k], it, x, y)
                    counts[k] += 1
                    if counts[k] >= args.batches:
                        break
                loaders[k].set_epoch(0)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=iterate, args=(k,), name=f"loader{k}") for k in (0, 1)]
    for t in threads:
        t.start()
    join_all(threads, DEADLINE)
    for dl in loaders:
        dl.close()
    if errors:
        raise errors[0]
    return {"consumed": consumed, "moved": moved, "two_loaders": counts,
            "producer_samples": stats.get("producer_samples"),
            "host_samples": stats.get("host_samples")}


def run_validation(args, src):
    from dpu_pipe import ConfigError, DPULoader, RemoteValidation
    from validation_host import KW as MODEL_KW
    from validation_host import MODEL, SIZE, host_metrics, snapshot

    rv = RemoteValidation(src, 4, model=MODEL, model_kwargs=MODEL_KW, size=SIZE)
    models = {seed: snapshot(seed) for seed in (1, 2)}
    futures, errors = [], []
    submitted = threading.Event()
    lock = threading.Lock()

    def submitter(k):
        try:
            for seed in (1, 2):
                fut = rv.submit(models[seed].state_dict(), tag=f"t{k}-{seed}")
                with lock:
                    futures.append((seed, fut))
                    if len(futures) == 4:
                        submitted.set()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            submitted.set()

    def poller():
        try:
            assert submitted.wait(DEADLINE)
            end = time.monotonic() + DEADLINE * 2
            while not all(f.done() for _, f in list(futures)):
                assert time.monotonic() < end, "validation results never came"
                time.sleep(0.01)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=submitter, args=(k,), name=f"submit{k}")
               for k in (0, 1)] + [threading.Thread(target=poller, name="poller")]
    for t in threads:
        t.start()
    ref = reference(src, epochs=2)
    train = DPULoader(src, 4, slots=2, **KW)
    batches = 0
    # Two epochs while the threads submit and poll; the producers evaluate in the gaps
    # training leaves them (their validation thread runs at nice 19), so the rest after.
    for _ in range(2):
        it = iter(train)
        for x, y in it:
            check_batch(ref, it, x, y)
            batches += 1
    join_all(threads, DEADLINE * 2)
    train.close()
    if errors:
        raise errors[0]
    want = {seed: host_metrics(m, src, 4) for seed, m in models.items()}
    for seed, fut in futures:
        got = fut.result(timeout=DEADLINE)
        assert got["count"] == want[seed]["count"] == len(src), (got, want[seed])
        for key in ("top1", "top5"):
            assert got[key] == want[seed][key], (seed, key, got[key], want[seed][key])
        assert abs(got["loss"] - want[seed]["loss"]) <= 1e-6 * abs(want[seed]["loss"]), seed
    closer = threading.Thread(target=rv.close, name="closer")
    closer.start()
    join_all([closer])
    try:
        rv.submit(models[1].state_dict())
        raise AssertionError("submit after close() from another thread was accepted")
    except ConfigError as exc:
        assert "closed" in str(exc), exc
    return {"futures": len(futures), "batches": batches}


def run_exit(args, src):
    from dpu_pipe import DPULoader

    held = DPULoader(src, 4, mode=args.mode, slots=3, **KW)
    it = iter(held)
    next(it)
    busy = DPULoader(src, 4, mode=args.mode, slots=3, copy=True, **KW)
    running = threading.Event()

    def spin():
        while True:
            for _ in busy:
                running.set()

    threading.Thread(target=spin, name="spinner", daemon=True).start()
    assert running.wait(DEADLINE)
    # The objects stay referenced from this frame's caller until the interpreter exits.
    globals()["_kept"] = (held, it, busy)
    return {"exiting": True}


def run_loop(args, src):
    from dpu_pipe import DPULoader

    ld = DPULoader(src, 4, mode=args.mode, slots=3, **KW)
    n = 0
    while True:
        for _ in ld:
            n += 1
            if n == 2:
                print(f"READY pid={os.getpid()}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=("stress", "validation", "exit", "loop"))
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", default="offload", choices=("offload", "hybrid"))
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--batches", type=int, default=12)
    args = ap.parse_args()

    from dpu_pipe.sources import open_path

    # The reference Loaders of this host rank read the whole dataset, as the DPULoader does.
    warnings.filterwarnings("ignore", message="this process is one of")

    src = open_path(args.data)
    t0 = time.monotonic()
    result = {"stress": run_stress, "validation": run_validation, "exit": run_exit,
              "loop": run_loop}[args.scenario](args, src)
    result["elapsed"] = round(time.monotonic() - t0, 3)
    with open(os.path.join(args.out, "host0.json"), "w") as f:
        json.dump(result, f)
    print(f"OK host=0 {args.scenario} elapsed={result['elapsed']:.2f}s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
