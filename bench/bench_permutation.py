"""The epoch order: memory and epoch-start time against the dataset size, and shuffle quality,
for the keyed Feistel permutation and for the sort-based permutation it replaced.

    python bench/bench_permutation.py [--sizes 1e6,1e8,1e9] [--old-max 1e7] [--json PATH]

Cost: every (method, size) runs in a fresh process, methods interleaved per size, rank 3 of
8, batch 256: the sampler is built, epoch 1 set, and the first batch's indices computed —
"epoch start", the time before a producer can read its first sample — then the whole shard
of that rank; peak RSS above the process's baseline (numpy and dpu_pipe imported) is
reported for each. The sort-based method runs up to ``--old-max`` samples: it allocates
~60 bytes per sample at its peak, so 10**8 needs ~6 GB and 10**9 ~60 GB.

Quality: the chi-square tests of tests/test_permutation.py (p-values over 20000 keys; a
uniform random permutation gives p-values uniform on [0, 1]; tiny ones reject), for both
methods. Numbers only; nothing is asserted.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 256
RANK, WORLD = 3, 8


def sort_permutation(n, seed, epoch):
    """The sort-based permutation dpu_pipe used before the Feistel one: each sample's 64-bit
    Philox word (STREAM_SHUFFLE, block 0) as its sort key, the low bits replaced by the index
    so that keys are distinct."""
    from dpu_pipe.rng import STREAM_SHUFFLE, _block

    bits = max(1, int(n - 1).bit_length())
    mask = np.uint64((1 << bits) - 1)
    index = np.arange(n, dtype=np.uint64)
    x0, x1, _, _ = _block(np.uint64(seed), np.uint64(epoch), index, STREAM_SHUFFLE, 0)
    keys = (x1 << np.uint64(32)) | x0
    keys &= ~mask
    keys |= index
    keys.sort()
    keys &= mask
    return keys.astype(np.int64)


def old_quality_perm(pos, n, seed, epoch):
    """sort_permutation in the (positions, n, seed, epoch) form of the quality tests, with
    the per-key loop the broadcast keys need."""
    seed, epoch, pos = np.broadcast_arrays(np.asarray(seed, np.uint64),
                                           np.asarray(epoch, np.uint64), np.asarray(pos, np.int64))
    out = np.empty(pos.shape, np.int64)
    keys = {}
    for idx in np.ndindex(pos.shape):
        k = (int(seed[idx]), int(epoch[idx]))
        if k not in keys:
            keys[k] = sort_permutation(n, *k)
        out[idx] = keys[k][pos[idx]]
    return out


def _rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(method, n):
    """In this process: (epoch start s, whole shard s, peak RSS above baseline bytes)."""
    from dpu_pipe.sampler import EpochSampler

    base = _rss()
    t0 = time.perf_counter()
    if method == "feistel":
        s = EpochSampler(n, seed=2024, rank=RANK, world_size=WORLD)
        s.set_epoch(1)
        first = s.batch(1, 0, BATCH)
        t1 = time.perf_counter()
        start_rss = _rss()
        shard = s.indices(1)
    else:
        order = sort_permutation(n, 2024, 1)
        per_rank = -(-n // WORLD)
        shard = np.resize(order, per_rank * WORLD)[RANK::WORLD].copy()
        first = shard[:BATCH]
        t1 = time.perf_counter()
        start_rss = _rss()
        del order
    t2 = time.perf_counter()
    assert len(first) == BATCH and len(shard) == -(-n // WORLD)
    return {"epoch_start_s": t1 - t0, "shard_s": t2 - t0,
            "start_rss_bytes": start_rss - base, "peak_rss_bytes": _rss() - base}


def run_child(method, n):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"import numpy, dpu_pipe.sampler, bench_permutation as b; "
            f"print(json.dumps(b.measure({method!r}, {n})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=3600)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def quality(methods):
    """{method: {test: min p-value}} from the chi-square tests of tests/test_permutation.py."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import test_permutation as tp

    rows = {}
    for name, perm in methods.items():
        r = {}
        for n in (5, 16, 1000):
            r[f"position n={n}"] = float(tp.position_pvalues(perm, n, "epochs").min())
            r[f"pair n={n}"] = float(tp.pair_pvalues(perm, n, "epochs").min())
        p, corr = tp.epoch_pvalue(perm, 1000, epochs=40)
        r["epochs n=1000"] = float(p)
        r["epoch corr n=1000"] = float(corr)
        rows[name] = r
    return rows


def _mb(b):
    return f"{b / 2**20:.1f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1e6,1e8,1e9",
                    help="dataset sizes, comma-separated (default: 1e6,1e8,1e9)")
    ap.add_argument("--old-max", type=float, default=1e7,
                    help="largest size the sort-based method runs at (default: 1e7)")
    ap.add_argument("--no-quality", action="store_true", help="skip the chi-square table")
    ap.add_argument("--json", help="write every figure to this JSON file")
    args = ap.parse_args(argv)
    sizes = [int(float(x)) for x in args.sizes.split(",")]
    result = {"cost": [], "quality": None}
    print(f"rank {RANK} of {WORLD}, batch {BATCH}; one fresh process per cell\n")
    print("| samples | method | epoch start (first batch) | whole shard | RSS at epoch start "
          "| peak RSS |")
    print("|---|---|---|---|---|---|")
    for n in sizes:
        for method in ("feistel", "sort"):
            if method == "sort" and n > args.old_max:
                print(f"| {n:.0e} | {method} | not run (~{60 * n / 2**30:.0f} GB) | | | |")
                continue
            m = run_child(method, n)
            result["cost"].append({"samples": n, "method": method, **m})
            print(f"| {n:.0e} | {method} | {m['epoch_start_s'] * 1e3:.2f} ms "
                  f"| {m['shard_s']:.2f} s | {_mb(m['start_rss_bytes'])} MB "
                  f"| {_mb(m['peak_rss_bytes'])} MB |", flush=True)
    if not args.no_quality:
        sys.path.insert(0, REPO)
        from dpu_pipe import _rng
        q = quality({"feistel": _rng.permute, "sort": old_quality_perm})
        result["quality"] = q
        print("\nsmallest chi-square p-value per test (20000 keys = epochs of one seed; "
              "tiny values reject)\n")
        print("| test | feistel | sort |")
        print("|---|---|---|")
        for test in q["feistel"]:
            print(f"| {test} | {q['feistel'][test]:.3g} | {q['sort'][test]:.3g} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
