"""Packing: images/s and memory of ``dpu_pipe.pack`` with and without transcoding, and the
memory a rank spends opening a packed dataset and reading from it, against its size.

    python bench/bench_pack.py [--data DIR] [--n 1000] [--rounds 3] [--threads 1]
                               [--lazy 100000,1000000,3000000] [--json PATH]

Pack: each round packs the first ``--n`` images of ``--data`` (default: the ImageNet-like
sample dataset made once under ``.cache/`` from real photographs, as ``pytest bench`` does)
once per mode, the modes interleaved, each in a fresh process so peak memory is its own:

* ``img/s``: images per second of wall time for the whole ``pack`` (read, header check,
  transcode, write, fsync, re-read and CRC check of every shard), median and min–max of the
  rounds;
* ``growth``: bytes stored / bytes read from the source, minus 1;
* ``peak MB``: the process's peak resident memory (``ru_maxrss``) minus its resident memory
  once imports are done and the source is listed — what packing itself holds.

Lazy opening: a dataset of N tiny records is packed (64 MB shards), then a fresh process opens
it and reads 200 random records; reported are the Python heap allocated by opening
(tracemalloc), private (anonymous) resident memory after opening and after the reads, the
file-backed resident memory (mapped pages, reclaimable; the kernel maps 64 kB around each page
touched) and the index blocks checked. The whole index (48 + 8 bytes per record: entry,
label) is shown for scale. Numbers only; nothing is asserted.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache"

_PACK_CHILD = r"""
import json, os, resource, sys, time
from dpu_pipe import pack
from dpu_pipe.sources import FileList, ImageFolder

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

root, n, out, mode, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
folder = ImageFolder(root)
src = FileList([(folder.describe(i), int(folder.labels[i])) for i in range(min(n, len(folder)))])
base = rss()
t0 = time.perf_counter()
packed = pack(src, out, transcode=mode == "transcode", threads=threads, progress=False,
              shard_size=64 * 2**20)
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
meta = packed.dataset.meta
print(json.dumps({"seconds": dt, "count": len(packed), "data_bytes": meta["data_bytes"],
                  "orig_bytes": meta["orig_bytes"], "peak_over_base": peak - base,
                  "transcoded": int(packed.dataset.shards["transcoded"].sum())}))
"""

_LAZY_CHILD = r"""
import json, os, sys, tracemalloc
import numpy as np
from dpu_pipe.sources import PackedSource

def rss():
    with open("/proc/self/status") as f:
        kv = dict(line.split(":", 1) for line in f)
    return {k: int(kv[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile")}

path, n = sys.argv[1], int(sys.argv[2])
warm = PackedSource(path); warm.read(0); warm.close()
tracemalloc.start()
r0 = rss()
src = PackedSource(path)
r1, heap = rss(), tracemalloc.get_traced_memory()[0]
picks = np.random.default_rng(0).choice(n, 200, replace=False)
for i in picks:
    src.read(int(i))
r2 = rss()
print(json.dumps({"open_heap": heap, "open_anon": r1["RssAnon"] - r0["RssAnon"],
                  "read_anon": r2["RssAnon"] - r0["RssAnon"],
                  "read_file": r2["RssFile"] - r0["RssFile"],
                  "blocks_checked": sum(int(s._checked.sum()) for s in src.dataset._open.values()),
                  "shards": src.dataset.num_shards}))
"""


def _child(code, *args):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env,
                       capture_output=True, text=True, timeout=3600)
    if r.returncode:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout)


def _dataset(data):
    if data:
        return Path(data)
    sys.path.insert(0, str(REPO))
    from dpu_pipe.tools.sample_data import make_imagenet_like
    root = CACHE / "dpu_pipe" / "imagenet_like_n1000_s0"
    if not (root / "dpu_pipe_sample.json").exists():
        make_imagenet_like(root, n=1000, classes=10, seed=0)
    return root


def bench_pack(root, n, rounds, threads, tmp):
    sys.path.insert(0, str(REPO))
    from dpu_pipe import jpeg
    modes = ["no-transcode"] + (["transcode"] if hasattr(jpeg, "transcode") else [])
    runs = {m: [] for m in modes}
    for r in range(rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            out = os.path.join(tmp, f"{mode}-{r}")
            runs[mode].append(_child(_PACK_CHILD, root, n, out, mode, threads))
            shutil.rmtree(out)
    rows = {}
    for mode, rs in runs.items():
        rates = sorted(x["count"] / x["seconds"] for x in rs)
        rows[mode] = {
            "img_s": rates[len(rates) // 2], "img_s_min": rates[0], "img_s_max": rates[-1],
            "growth": rs[0]["data_bytes"] / rs[0]["orig_bytes"] - 1,
            "transcoded": rs[0]["transcoded"], "count": rs[0]["count"],
            "peak_mb": max(x["peak_over_base"] for x in rs) / 2**20,
        }
    return rows


def bench_lazy(sizes, tmp):
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from dpu_pipe import pack
    from helpers import TinySource
    rows = {}
    for n in sizes:
        out = os.path.join(tmp, f"tiny-{n}")
        pack(TinySource(n), out, shard_size=64 * 2**20, progress=False, verify=False)
        rows[n] = _child(_LAZY_CHILD, out, n)
        rows[n]["index_mb"] = n * 56 / 2**20
        shutil.rmtree(out)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="ImageFolder to pack (default: the cached sample dataset)")
    p.add_argument("--n", type=int, default=1000, help="images packed per run (default 1000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, modes interleaved (default 3)")
    p.add_argument("--threads", type=int, default=1, help="pack threads (default 1)")
    p.add_argument("--lazy", default="100000,1000000,3000000",
                   help="record counts of the lazy-opening table, comma-separated ('' skips)")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    root = _dataset(args.data)
    results = {}
    with tempfile.TemporaryDirectory(dir=CACHE if CACHE.exists() else None) as tmp:
        results["pack"] = bench_pack(root, args.n, args.rounds, args.threads, tmp)
        print(f"pack: {args.n} images of {root}, {args.threads} thread(s), "
              f"{args.rounds} rounds interleaved")
        print(f"{'mode':<14}{'img/s':>9}{'min-max':>16}{'transcoded':>12}{'growth':>9}"
              f"{'peak MB':>9}")
        for mode, r in results["pack"].items():
            print(f"{mode:<14}{r['img_s']:>9.0f}{r['img_s_min']:>8.0f}-{r['img_s_max']:<7.0f}"
                  f"{r['transcoded']:>12}{100 * r['growth']:>+8.1f}%{r['peak_mb']:>9.1f}")
        sizes = [int(x) for x in args.lazy.split(",") if x]
        if sizes:
            results["lazy"] = bench_lazy(sizes, tmp)
            print("\nopen + 200 random reads, fresh process")
            print(f"{'records':>10}{'index MB':>10}{'shards':>8}{'open heap kB':>14}"
                  f"{'anon open MB':>14}{'anon read MB':>14}{'file read MB':>14}{'blocks':>8}")
            for n, r in results["lazy"].items():
                print(f"{n:>10}{r['index_mb']:>10.1f}{r['shards']:>8}{r['open_heap'] / 1024:>14.1f}"
                      f"{r['open_anon'] / 2**20:>14.2f}{r['read_anon'] / 2**20:>14.2f}"
                      f"{r['read_file'] / 2**20:>14.2f}{r['blocks_checked']:>8}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
