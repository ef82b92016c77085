"""Host side of the node-cache scenarios (``test_node_cache.py``), run under mpiexec (MPMD)::

    mpiexec -n 1 python -m mpi4py tests/mpi/cache_host.py SCENARIO --data DIR --out DIR \\
          : -n P python -m mpi4py -m dpu_pipe.worker

Scenarios:

``stream``
    For each mode of ``--modes``: a DPULoader with ``decode_max_side`` and ``cache_bytes``
    over ``--epochs`` epochs, every batch compared bit for bit with an uncached local Loader
    (on_error as ``--on-error``); epoch 1 is broken off after 3 batches, its state saved and
    resumed in a new DPULoader (the producers keep their cache: same source and transform),
    which runs to the end. Records per mode the cache counters after each epoch, and which
    producer made each sample in each epoch (from the batches received).
``fault``
    Hybrid mode, the producers started with ``DPU_PIPE_TEST_FILL_STALL`` (one sample's fill
    held in FILLING): the producer that fills it stalls mid-fill and is taken over; every
    epoch must still equal the uncached Loader's. The host then writes its results, prints
    OK and SIGKILLs the stalled producer — still mid-fill — which ends the job (MPICH's
    Hydra ends a job when a rank dies).
``memory``
    Each producer's resident memory after an uncached epoch and after two epochs of the same
    stream with the node cache.
``validation``
    RemoteValidation with and without ``cache_bytes``, the same snapshot twice each: all
    four results equal the host's own evaluation; the cached one's second run reads from the
    node cache (its counters in ``by_rank``).

The host writes ``<out>/host0.json`` and prints ``OK host=0``.
"""
import argparse
import json
import os
import re
import signal
import sys
import time

import numpy as np

from offload_host import as_numpy, check_same, job_workers, write_json, Warnings


def kwargs(args):
    return dict(size=args.size, dtype="uint8", seed=11, decode_max_side=args.max_side,
                on_error=args.on_error)


def reference(src, args, epochs):
    from dpu_pipe import Loader

    with Loader(src, args.batch, **kwargs(args)) as ref:
        return [[(x.copy(), y.copy()) for x, y in ref] for _ in range(epochs)], \
            dict(ref.bad_samples)


def record_producers(made):
    """Patch the offload engine so that every batch received records (producer, epoch
    position, sample indices) in ``made``."""
    from dpu_pipe.engines import offload

    unpack = offload.OffloadEngine._unpack

    def recording(self, d, *rest):
        images, labels, indices = unpack(self, d, *rest)
        made.append((int(d.producer), as_numpy(indices).tolist()))
        return images, labels, indices

    offload.OffloadEngine._unpack = recording


def run_stream(args, src, warnings):
    from dpu_pipe import DPULoader

    made = []
    record_producers(made)
    ref, ref_bad = reference(src, args, args.epochs)
    out = {}
    for k, mode in enumerate(args.modes):
        # A cache of its own for each mode (another size is another node cache): each mode's
        # counters start from an empty cache.
        kw = dict(kwargs(args), mode=mode, slots=3, cache_bytes=args.cache_bytes + 4096 * k)
        dl = DPULoader(src, args.batch, **kw)
        assert dl.mode == mode and dl.cache is None, (dl.mode, dl.cache)
        per_epoch, by_producer = [], []
        for e in range(args.epochs):
            del made[:]
            steps = list(range(len(ref[e])))
            if e == 1:
                # Mid-epoch: 3 batches, the state saved, a new loader resumes from it.
                it = iter(dl)
                for j in range(3):
                    check_same(next(it), ref[e][j], f"{mode} epoch {e} step {j}")
                state = dl.state_dict()
                dl.close()
                dl = DPULoader(src, args.batch, **kw)
                dl.load_state_dict(state)
                steps = steps[3:]
            for j, (x, y) in zip(steps, dl):
                check_same((x, y), ref[e][j], f"{mode} epoch {e} step {j}")
            per_epoch.append(dl.stats()["cache"])
            by_producer.append([[p, idx] for p, idx in made])
        s = dl.stats()
        assert {int(k): v for k, v in dl.bad_samples.items()}.keys() == ref_bad.keys(), \
            (dl.bad_samples, ref_bad)
        dl.close()
        out[mode] = {"cache": per_epoch, "made": by_producer,
                     "steps_per_producer": s["steps_per_producer"],
                     "host_samples": s["host_samples"], "bad": sorted(ref_bad)}
    return out


def run_fault(args, src, warnings):
    from dpu_pipe import DPULoader

    ref, _ = reference(src, args, args.epochs)
    dl = DPULoader(src, args.batch, mode="hybrid", host_threads=1, slots=3,
                   cache_bytes=args.cache_bytes, **kwargs(args))
    for e in range(args.epochs):
        labels = []
        for j, (x, y) in enumerate(dl):
            check_same((x, y), ref[e][j], f"hybrid epoch {e} step {j}")
            labels.extend(as_numpy(y).tolist())
        assert sorted(labels) == list(range(len(src))), f"epoch {e}: not exactly once"
    taken = [w for w in warnings.messages if "takes over" in w]
    pids = [int(p) for w in taken for p in re.findall(r"pid (\d+)", w)]
    result = {"takeover_warnings": taken, "stalled": pids[0] if pids else None,
              "workers": job_workers(), "cache": dl.stats()["cache"],
              "steps_per_producer": dl.stats()["steps_per_producer"]}
    return result


def run_validation(args, src, warnings):
    import torch
    from dpu_pipe import Loader, RemoteValidation
    from dpu_pipe.evaluate import evaluate_loader
    from dpu_pipe.models import resnet_tiny
    from validation_host import KW, MODEL

    # Label == sample index in these datasets: one class per sample.
    kw = dict(KW, classes=len(src))
    torch.manual_seed(3)
    model = resnet_tiny(**kw).eval()
    tkw = dict(size=args.size, decode_max_side=args.max_side)
    with Loader(src, args.batch, train=False, **tkw) as ld:
        local = evaluate_loader(model, ld).result()
    state = model.state_dict()
    out = {"local": local}
    for name, cache in (("uncached", 0), ("cached", args.cache_bytes)):
        rv = RemoteValidation(src, args.batch, model=MODEL, model_kwargs=kw,
                              cache_bytes=cache, timeout=120, **tkw)
        runs = []
        for k in range(2):
            res = rv.submit(state, tag=k).result()
            runs.append({"count": res["count"], "loss": res["loss"], "top1": res["top1"],
                         "top5": res["top5"], "cache": [p.get("cache") for p in res["by_rank"]]})
        rv.close()
        out[name] = runs
    return out


def _rss(pid):
    """Resident bytes of process ``pid`` (its own pages and the shared ones it touched)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_memory(args, src, warnings):
    """The producers' resident memory: one uncached epoch (what a producer holds today, its
    batch buffers and decoders warm), then the same stream with the node cache over two
    epochs; each producer's growth, against cache_bytes and what the cache stores."""
    from dpu_pipe import DPULoader

    kw = dict(size=args.size, dtype="uint8", seed=3, decode_max_side=args.max_side,
              mode="offload", slots=2)
    workers = job_workers()
    with DPULoader(src, args.batch, **kw) as dl:
        for _ in dl:
            pass
        before = {p: _rss(p) for p in workers}
    with DPULoader(src, args.batch, cache_bytes=args.cache_bytes, **kw) as dl:
        for _ in range(2):
            for _ in dl:
                pass
        after = {p: _rss(p) for p in workers}
        cache = dl.stats()["cache"]
    return {"growth": [after[p] - before[p] for p in workers], "cache": cache,
            "cache_bytes": args.cache_bytes}


SCENARIOS = {"stream": run_stream, "fault": run_fault, "validation": run_validation,
             "memory": run_memory}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=list(SCENARIOS))
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--max-side", type=int, default=40)
    ap.add_argument("--cache-bytes", type=int, default=1 << 20)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--modes", default="offload,hybrid", type=lambda s: s.split(","))
    ap.add_argument("--on-error", default="raise")
    ap.add_argument("--kill", action="store_true",
                    help="fault: SIGKILL the stalled producer once the results are written")
    args = ap.parse_args()

    from mpi4py import MPI  # noqa: F401  (MPI up before the loaders)
    from dpu_pipe.sources import open_path

    import logging
    warnings = Warnings()
    logging.getLogger("dpu_pipe").addHandler(warnings)
    src = open_path(args.data)
    t0 = time.monotonic()
    result = SCENARIOS[args.scenario](args, src, warnings)
    result["elapsed"] = round(time.monotonic() - t0, 3)
    write_json(os.path.join(args.out, "host0.json"), result)
    print(f"OK host=0 {args.scenario} elapsed={result['elapsed']:.2f}s", flush=True)
    if args.kill and result.get("stalled"):
        # Still in FILLING (its stall outlasts the run): killing it ends the job.
        os.kill(result["stalled"], signal.SIGKILL)
        time.sleep(30)


if __name__ == "__main__":
    sys.exit(main())
