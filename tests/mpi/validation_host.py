"""Host side of the RemoteValidation scenarios, run under mpiexec (MPMD) by
``test_validation.py``::

    mpiexec -n H python -m mpi4py tests/mpi/validation_host.py SCENARIO --data DIR --out DIR \\
          : -n P python -m mpi4py -m dpu_pipe.worker

Scenarios (each host rank runs the same one):

``equal``
    Two snapshots submitted back to back (the second queued behind the first); each result
    must equal the same snapshot evaluated on this process with ``Loader(train=False)`` over
    the whole validation set: count and top-k exactly, loss to 1e-6 relative.
``overlap``
    A DPULoader training stream runs; after 2 batches a snapshot of a slow model is submitted
    and training goes on. Events are recorded in order (submit returned, each batch, result
    ready) with the future's state at each.
``failures``
    A factory that raises, a forward that raises, weights of another model: each comes back
    through the future as ProducerError with the producer's traceback; a good snapshot still
    works afterwards. Then one producer is stopped (SIGSTOP) after a good snapshot; the
    next one's ``result(timeout=3)`` raises PipeTimeout naming it; after SIGCONT the same
    future completes.

Every host writes ``<out>/host<i>.json`` and prints ``OK host=<i>``.
"""
import argparse
import json
import os
import signal
import sys
import time
import traceback

import numpy as np

from offload_host import sibling_pids

CLASSES = 5
KW = {"classes": CLASSES, "width": 8, "seed": 1}
MODEL = "dpu_pipe.models:resnet_tiny"
SIZE = 32


def snapshot(seed):
    """resnet_tiny moved by two SGD steps on random data keyed by ``seed`` (the same on
    every host)."""
    import torch
    from dpu_pipe.models import resnet_tiny

    model = resnet_tiny(**KW)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(
            model(torch.randn(8, 3, SIZE, SIZE, generator=g)),
            torch.randint(0, CLASSES, (8,), generator=g)).backward()
        opt.step()
    return model.eval()


def host_metrics(model, src, batch_size):
    from dpu_pipe import Loader
    from dpu_pipe.evaluate import Metrics, evaluate_batch

    m = Metrics((1, 5))
    # The whole set on this process: Loader(train=False)'s defaults (in order, every sample
    # once), one rank.
    with Loader(src, batch_size, train=False, size=SIZE, rank=0, world_size=1,
                output="torch") as loader:
        for images, labels in loader:
            evaluate_batch(model, images, labels, m)
    return m.result()


def producer_pids():
    """PIDs of this job's dpu_pipe.worker ranks."""
    return sibling_pids(lambda argv: b"dpu_pipe.worker" in argv)


def scenario_equal(args, src):
    from dpu_pipe import RemoteValidation

    rv = RemoteValidation(src, args.batch_size, model=MODEL, model_kwargs=KW, size=SIZE)
    a, b = snapshot(1), snapshot(2)
    fa = rv.submit(a.state_dict(), tag="a")
    fb = rv.submit(b.state_dict(), tag="b")      # queued behind the first
    out = {}
    for name, fut, model in (("a", fa, a), ("b", fb, b)):
        got = fut.result(timeout=args.timeout)
        out[name] = {"remote": {k: v for k, v in got.items() if k != "by_rank"},
                     "host": host_metrics(model, src, args.batch_size),
                     "parts": [(p["host"], p["producer"], p["metrics"]["count"])
                               for p in got["by_rank"]],
                     "times": [(p["seconds"], p["cpu_s"]) for p in got["by_rank"]]}
    return out


def scenario_overlap(args, src):
    from dpu_pipe import DPULoader, RemoteValidation

    # The producer's evaluation waits for this file, which the host creates once two training
    # batches have arrived after submit() (or training ended): batches during an unfinished
    # evaluation are then guaranteed, whatever the machine's load.
    gate = os.path.join(args.out, "gate")
    rv = RemoteValidation(src, args.batch_size, model="valmodels:gated",
                          model_kwargs=dict(KW, gate=gate), size=SIZE)
    train = DPULoader(src, 4, train=True, size=SIZE, seed=3, slots=2)
    state = snapshot(1).state_dict()
    events = []
    t0 = time.monotonic()
    fut = None
    after = 0
    with train:
        for epoch in range(2):
            train.set_epoch(epoch)
            for step, (images, labels) in enumerate(train):
                events.append(["batch", epoch, step, fut is not None and fut.done(),
                               time.monotonic() - t0])
                if fut is not None:
                    after += 1
                    if after == 2:
                        open(gate, "w").close()
                if fut is None and len(events) == 2:
                    t = time.monotonic()
                    fut = rv.submit(state, tag="overlap")
                    events.append(["submitted", fut.done(), time.monotonic() - t0,
                                   time.monotonic() - t])
    open(gate, "a").close()
    res = fut.result(timeout=120)
    events.append(["result", res["count"], time.monotonic() - t0])
    return {"events": events, "seconds": res["seconds"]}


def scenario_errors(args, src):
    from dpu_pipe import ProducerError, RemoteValidation

    out = {}
    cases = (("factory", "valmodels:broken_factory", KW, 1),
             ("forward", "valmodels:bad_forward", KW, 1),
             ("weights", MODEL, dict(KW, width=16), 1))
    for name, model, kwargs, seed in cases:
        rv = RemoteValidation(src, args.batch_size, model=model, model_kwargs=kwargs,
                              size=SIZE)
        try:
            rv.submit(snapshot(seed).state_dict()).result(timeout=60)
            out[name] = {"raised": None}
        except ProducerError as exc:
            out[name] = {"raised": type(exc).__name__, "message": str(exc),
                         "producer": exc.producer, "traceback": exc.remote_traceback}
    rv = RemoteValidation(src, args.batch_size, model=MODEL, model_kwargs=KW, size=SIZE)
    out["after"] = rv.submit(snapshot(1).state_dict()).result(timeout=60)["count"]
    return out


def scenario_failures(args, src):
    return {"errors": scenario_errors(args, src), "silent": silent(args, src)}


def silent(args, src):
    from dpu_pipe import PipeTimeout, RemoteValidation

    rv = RemoteValidation(src, args.batch_size, model=MODEL, model_kwargs=KW, size=SIZE)
    first = rv.submit(snapshot(1).state_dict()).result(timeout=60)
    part = min(first["by_rank"], key=lambda p: p["producer"])
    pid = part["pid"]
    assert pid in producer_pids(), (pid, producer_pids())
    os.kill(pid, signal.SIGSTOP)
    out = {"stopped": part["producer"]}
    try:
        fut = rv.submit(snapshot(2).state_dict())
        t = time.monotonic()
        try:
            fut.result(timeout=3)
            out["raised"] = None
        except PipeTimeout as exc:
            out["raised"] = str(exc)
        out["waited"] = time.monotonic() - t
    finally:
        os.kill(pid, signal.SIGCONT)
    out["after_resume"] = fut.result(timeout=60)["count"]
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=("equal", "overlap", "failures"))
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120)
    args = p.parse_args()
    import torch
    torch.set_num_threads(1)
    from mpi4py import MPI
    from dpu_pipe import ImageFolder
    from dpu_pipe.offload.group import host_group

    src = ImageFolder(args.data)
    session = host_group(MPI.COMM_WORLD)
    me = session.host_index
    try:
        result = globals()[f"scenario_{args.scenario}"](args, src)
    except BaseException as exc:
        with open(os.path.join(args.out, f"error{me}.json"), "w") as f:
            json.dump({"type": type(exc).__name__, "message": str(exc),
                       "traceback": traceback.format_exc()}, f)
        raise
    with open(os.path.join(args.out, f"host{me}.json"), "w") as f:
        json.dump(result, f)
    print(f"OK host={me}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
