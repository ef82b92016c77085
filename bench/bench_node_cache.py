"""The producers' node cache: offload with 2 producers on one node, a shared cache against no
cache, and RemoteValidation's second snapshot against its first.

    python bench/bench_node_cache.py [--n 300] [--epochs 4] [--rounds 2] [--json PATH]

Launches one MPI job per configuration and round (MPMD: this file with ``--host`` as the host,
``python -m dpu_pipe.worker`` x 2 producers), over the first ``--n`` images of the ImageNet-like
sample dataset at their original sizes (``dpu_pipe.tools.sample_data``), classic train recipe
(RandomResizedCrop 224 + flip, float32 CHW), batch 50, the host consuming as fast as it can.
The configurations run interleaved, one job each per round:

- ``default``: today's default offload (region decode of each crop);
- ``max_side``: ``decode_max_side=256``, no cache (a whole decode and reduction every epoch);
- ``cached``: ``decode_max_side=256, cache_bytes=...`` (room for every sample): epoch 1
  fills the node cache, later epochs are served from it by both producers.

Per configuration: img/s of wall time of epoch 1 and of the later epochs (median over epochs
and rounds), and for ``cached`` the hit rate of each epoch (from ``stats()["cache"]``) and the
samples made in epoch 2 by another producer than in epoch 1 (each a hit on what the other
decoded). The host and both producers share this machine's cores.

``--validation``: RemoteValidation of a small ResNet (``resnet_tiny``, 64 px) over the same
images with ``decode_max_side=256``, with and without ``cache_bytes``, two snapshots each:
the producers' seconds making batches (``make_s``, summed) and wall seconds of each.
Numbers only; nothing is asserted.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BATCH = 50
MAX_SIDE = 256
CONFIGS = ("default", "max_side", "cached")


def _dataset(n):
    from dpu_pipe.sources import FileList, ImageFolder
    from dpu_pipe.tools.sample_data import sample_dataset

    folder = ImageFolder(str(sample_dataset(max(n, 1000), progress=False)))
    return FileList([(folder.describe(i), int(folder.labels[i]))
                     for i in range(min(n, len(folder)))])


def _cache_bytes(n):
    from dpu_pipe.cache import table_bytes

    return table_bytes(n) + n * (MAX_SIDE * MAX_SIDE * 3 + 16)


def host(args):
    """The host rank of one job: ``args.config`` over ``args.epochs`` epochs."""
    from mpi4py import MPI  # noqa: F401
    from dpu_pipe import Loader
    from dpu_pipe.engines import offload

    src = _dataset(args.n)
    n = len(src)
    made = []
    unpack = offload.OffloadEngine._unpack

    def recording(self, d, *rest):
        out = unpack(self, d, *rest)
        made.append((int(d.producer), out[2].tolist()))
        return out

    offload.OffloadEngine._unpack = recording
    kw = dict(size=224, seed=0, mode="offload", slots=4, rank=0, world_size=1)
    if args.config != "default":
        kw["decode_max_side"] = MAX_SIDE
    if args.config == "cached":
        kw["cache_bytes"] = _cache_bytes(n)
    ld = Loader(src, BATCH, **kw)
    epochs, who = [], []
    last = None
    for e in range(args.epochs):
        del made[:]
        t0 = time.perf_counter()
        count = sum(len(y) for _, y in ld)
        wall = time.perf_counter() - t0
        rec = {"images": count, "seconds": wall, "img_s": count / wall}
        st = ld.stats()
        if "cache" in st:
            c = st["cache"]
            if last is not None:
                hits, misses = c["hits"] - last["hits"], c["misses"] - last["misses"]
                rec["hit_rate"] = hits / max(1, hits + misses)
            else:
                rec["hit_rate"] = c["hits"] / max(1, c["hits"] + c["misses"])
            rec["cache"] = c
            last = c
        epochs.append(rec)
        who.append({i: p for p, idx in made for i in idx})
    crossed = sum(1 for i, p in who[1].items() if who[0].get(i, p) != p) if len(who) > 1 else 0
    out = {"config": args.config, "epochs": epochs, "crossed": crossed,
           "steps_per_producer": ld.stats()["steps_per_producer"]}
    if args.validation:
        out["validation"] = _validation(src)
    ld.close()
    print("RESULT " + json.dumps(out), flush=True)


def _validation(src):
    import torch
    from dpu_pipe import RemoteValidation
    from dpu_pipe.models import resnet_tiny

    classes = int(max(src.labels)) + 1
    kw = {"classes": classes, "width": 8, "seed": 1}
    torch.manual_seed(0)
    state = resnet_tiny(**kw).state_dict()
    res = {}
    for name, cache in (("uncached", 0), ("cached", _cache_bytes(len(src)))):
        rv = RemoteValidation(src, BATCH, model="dpu_pipe.models:resnet_tiny", model_kwargs=kw,
                              size=64, decode_max_side=MAX_SIDE, cache_bytes=cache, timeout=900)
        runs = []
        for k in range(2):
            t0 = time.perf_counter()
            r = rv.submit(state, tag=k).result()
            runs.append({"wall_s": time.perf_counter() - t0,
                         "make_s": sum(p["make_s"] for p in r["by_rank"]),
                         "model_s": sum(p["model_s"] for p in r["by_rank"]),
                         "top1": r["top1"],
                         "cache": [p.get("cache") for p in r["by_rank"]]})
        rv.close()
        res[name] = runs
    return res


def launch(config, args, validation=False):
    from dpu_pipe.mpi import mpiexec_argv

    argv = mpiexec_argv(1, os.path.abspath(__file__), "--host", "--config", config,
                        "--n", args.n, "--epochs", args.epochs,
                        *(["--validation"] if validation else []))
    argv += [":", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "dpu_pipe.worker"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(["timeout", "1200", *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{config}: no result (exit {proc.returncode})\n{proc.stderr[-3000:]}")


def main(argv=None):
    from dpu_pipe.tools.plan import cpu_name

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--validation", action="store_true")
    p.add_argument("--json")
    p.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.host:
        return host(args)
    _dataset(args.n)            # made once, before the jobs
    runs = {c: [] for c in CONFIGS}
    for r in range(args.rounds):
        order = CONFIGS[r % 3:] + CONFIGS[:r % 3]
        for c in order:
            runs[c].append(launch(c, args))
    result = {"cpu": cpu_name(), "images": args.n, "epochs": args.epochs,
              "rounds": args.rounds, "configs": {}}
    print(f"{args.n} images, batch {BATCH}, 2 producers + 1 host on one node "
          f"({os.cpu_count()} cores, {cpu_name()}), {args.rounds} rounds")
    print(f"{'config':<10} {'epoch 1 img/s':>14} {'later img/s':>12} {'hit rate later':>15} "
          f"{'crossed':>8}")
    for c in CONFIGS:
        first = statistics.median(x["epochs"][0]["img_s"] for x in runs[c])
        later = statistics.median(e["img_s"] for x in runs[c] for e in x["epochs"][1:])
        hits = [e["hit_rate"] for x in runs[c] for e in x["epochs"][1:] if "hit_rate" in e]
        crossed = [x["crossed"] for x in runs[c]]
        result["configs"][c] = {"first_img_s": first, "later_img_s": later,
                                "later_hit_rate": statistics.median(hits) if hits else None,
                                "crossed": crossed, "runs": runs[c]}
        print(f"{c:<10} {first:>14.1f} {later:>12.1f} "
              f"{(f'{statistics.median(hits):.3f}' if hits else '-'):>15} "
              f"{(str(crossed) if c == 'cached' else '-'):>8}")
    if args.validation:
        v = launch("default", argparse.Namespace(n=args.n, epochs=1), validation=True)
        result["validation"] = v["validation"]
        for name, rs in v["validation"].items():
            print(f"validation {name:<9} " + "  ".join(
                f"snapshot {k + 1}: make {x['make_s']:.2f} s, wall {x['wall_s']:.2f} s"
                for k, x in enumerate(rs)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
