"""Pack-time downscale (``dpu-pipe pack --max-side N``): pack size and ``Loader`` images/s
over packs with and without it.

    python bench/bench_max_side.py [--data DIR] [--n 1000] [--sides 256,320] [--rounds 3]
                                   [--json PATH]

The first ``--n`` images of ``--data`` (default: the ImageNet-like sample dataset made once
under ``.cache/`` from real photographs, as ``pytest bench`` does) are packed once per
setting (transcoded, a restart marker every MCU; without ``--max-side`` and with each of
``--sides``). Each round then reads every pack once with ``Loader(num_threads=1)`` (train
recipe: RandomResizedCrop 224, flip, float32 CHW, batch 50), the packs interleaved and their
order rotated from round to round; reported are the median and min–max images/s of the
rounds. Numbers only; nothing is asserted.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache"
sys.path.insert(0, str(REPO))


def _dataset(data, n):
    from dpu_pipe.sources import FileList, ImageFolder
    from dpu_pipe.tools.sample_data import make_imagenet_like

    if data:
        root = Path(data)
    else:
        root = CACHE / "dpu_pipe" / "imagenet_like_n1000_s0"
        if not (root / "dpu_pipe_sample.json").exists():
            make_imagenet_like(root, n=1000, classes=10, seed=0)
    folder = ImageFolder(str(root))
    return FileList([(folder.describe(i), int(folder.labels[i]))
                     for i in range(min(n, len(folder)))])


def _loader_rate(path):
    from dpu_pipe.loader import Loader

    ld = Loader(path, 50, train=True, size=224, num_threads=1, seed=0)
    t0 = time.perf_counter()
    n = sum(len(y) for _, y in ld)
    return n / (time.perf_counter() - t0)


def main(argv=None):
    from dpu_pipe import jpeg
    from dpu_pipe.packed.writer import pack

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="ImageFolder to pack (default: the cached sample dataset)")
    p.add_argument("--n", type=int, default=1000, help="images (default 1000)")
    p.add_argument("--sides", default="256,320", help="--max-side values (default 256,320)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, packs interleaved")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    src = _dataset(args.data, args.n)
    settings = [None] + [int(s) for s in args.sides.split(",") if s]
    rows = {}
    with tempfile.TemporaryDirectory(dir=CACHE if CACHE.exists() else None) as tmp:
        paths = {}
        for side in settings:
            out = os.path.join(tmp, f"side-{side}")
            t0 = time.perf_counter()
            ds = pack(src, out, max_side=side, threads=1, progress=False).dataset
            sizes = [max(jpeg.read_header(ds.record(i))[:2]) for i in range(len(ds))]
            rows[side] = {"pack_s": time.perf_counter() - t0, "count": len(ds),
                          "data_bytes": ds.meta["data_bytes"],
                          "orig_bytes": ds.meta["orig_bytes"],
                          "max_longer_side": max(sizes),
                          "resized": (ds.meta["max_side"] or {}).get("resized", 0),
                          "rates": []}
            paths[side] = out
        _loader_rate(paths[settings[0]])      # warm the page cache and the imports
        for r in range(args.rounds):
            k = r % len(settings)
            for side in settings[k:] + settings[:k]:
                rows[side]["rates"].append(_loader_rate(paths[side]))
        for side in settings:
            shutil.rmtree(paths[side])
    base = rows[None]
    print(f"{len(src)} images, Loader(num_threads=1) train 224, {args.rounds} rounds, packs "
          f"interleaved; load average {os.getloadavg()[0]:.1f}")
    print(f"{'max side':<10}{'resized':>8}{'longest':>8}{'pack MB':>9}{'vs none':>9}"
          f"{'img/s':>8}{'min-max':>14}{'vs none':>9}")
    med = {s: sorted(r["rates"])[len(r["rates"]) // 2] for s, r in rows.items()}
    for side, r in rows.items():
        print(f"{str(side or 'none'):<10}{r['resized']:>8}{r['max_longer_side']:>8}"
              f"{r['data_bytes'] / 1e6:>9.1f}{r['data_bytes'] / base['data_bytes']:>8.2f}x"
              f"{med[side]:>8.0f}"
              f"{min(r['rates']):>7.0f}-{max(r['rates']):<6.0f}{med[side] / med[None]:>8.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in rows.items()}, indent=2))


if __name__ == "__main__":
    main()
