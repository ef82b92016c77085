"""The decoded-sample cache beyond the classic recipe: the heavy training recipes against
torchvision v2, validation, where a cache hit's time goes, and resident memory.

    nice -n 5 python bench/bench_cache_recipes.py [--only recipes,profile,val,rss] [--n 300]
        [--rounds 3] [--core 0] [--data DIR] [--val-max-side 342] [--json PATH]

One core (``--core``; every loader has one thread, torchvision's DataLoader one worker, all
pinned there), the first ``--n`` ImageNet-like photographs at their original sizes
(``dpu_pipe.tools.sample_data``) as a FileList, RandomResizedCrop 224 / centre crop 224,
float32 CHW. Methods are interleaved in rounds (``dpu_pipe.tools.harness.interleaved``), one
epoch each per round, on the CPU-time clock of ``bench_cache.cpu_seconds`` (this process and
its DataLoader workers); wall rates are printed too. Sections:

``recipes``
    The heavy recipes of ``dpu_pipe.tools.harness.RECIPES``, per sample (MixUp / CutMix, batch
    ops on float tensors, left out as in ``bench_recipes.py``): ``tv-new`` (TrivialAugmentWide +
    RandomErasing 0.1) and ``vit`` (bicubic, RandAugment(2, 9, mstd 0.5), ColorJitter 0.4,
    RandomErasing 0.25). Per recipe: ``torchvision`` (``bench_recipes.py``'s torchvision v2
    method: a DataLoader worker decoding the original files' bytes with Pillow every epoch, as
    torchvision users do), ``dpu_pipe`` (today's ``Loader`` with the recipe, no cache) and
    ``cache`` (``decode_max_side=256`` and a cache holding every sample, epochs >= 2).
``profile``
    Where a cached epoch's time goes: loaders with a full, warm cache, the recipe built up
    step by step — ``crop uint8`` (the hit's crop resampling and flip, uint8 HWC out), then
    float32 CHW normalized (``+ normalize``), then each heavy recipe in uint8 and in float32.
``val``
    An evaluation ``Loader(train=False)`` (resize 256, centre crop 224): today's (``default``),
    ``decode_max_side=S`` without a cache, and with a cache (``cache_first``: a new loader's
    first epoch; ``cache_warm``: epochs >= 2). ``S`` (``--val-max-side``, default 342) keeps
    a 4:3 photograph's shorter side at 256, so validation does not upsample.
``rss``
    Resident memory (``VmRSS``) of a fresh process running three epochs of the classic
    recipe at ``decode_max_side=256``: without a cache, with a cache holding every sample, and
    with a cache of half the pixel bytes (the rest decoded every epoch), against
    ``cache_bytes``.

Numbers only; nothing is asserted.
"""

import argparse
import json
import os
import subprocess
import sys

import bench_cache as bc
from bench_recipes import _torchvision_method

BATCH = bc.BATCH
MAX_SIDE = bc.MAX_SIDE
#: bench_recipes.py's name of each recipe of dpu_pipe.tools.harness.RECIPES.
TV_NAMES = {"tv-new": "tv-new", "vit": "timm-vit"}
SECTIONS = ("recipes", "profile", "val", "rss")


def recipe(name):
    """dpu_pipe's per-sample options of training recipe ``name`` (its batch ops left out)."""
    from dpu_pipe.tools.harness import RECIPES
    return {k: v for k, v in RECIPES[name].items() if k not in ("mixup_alpha", "cutmix_alpha")}


def warm_loader(src, cache_bytes, **options):
    """A loader with a cache (``decode_max_side=256`` unless ``options`` give another), the
    cache filled by one epoch, and its epoch runner (:func:`bench_cache.epochs`)."""
    from dpu_pipe import Loader
    options = {"num_threads": 1, "seed": 0, "decode_max_side": MAX_SIDE, **options}
    loader = Loader(src, BATCH, cache_bytes=cache_bytes, **options)
    run = bc.epochs(loader)
    run()
    stats = loader.stats()["cache"]
    if stats["entries"] != len(src) or stats["did_not_fit"]:
        raise SystemExit(f"the cache of {cache_bytes} bytes did not take every sample: {stats}")
    return loader, run


def section_recipes(src, rounds):
    """The heavy recipes: torchvision, today's Loader and the warm cache; the table rows."""
    from dpu_pipe import Loader

    bufs = [src.read(i) for i in range(len(src))]
    cache_bytes = bc.full_cache_bytes(len(src))
    methods = {}
    for name in ("tv-new", "vit"):
        methods[f"torchvision {name}"] = _tv_epochs(bufs, TV_NAMES[name])
        methods[f"dpu_pipe {name}"] = bc.epochs(Loader(src, BATCH, num_threads=1, seed=0,
                                                       **recipe(name)))
        methods[f"cache {name}"] = warm_loader(src, cache_bytes, **recipe(name))[1]
    for name in methods:
        if not name.startswith("cache"):
            methods[name]()             # warm-up: worker start, first allocations
    rates = bc.measure(methods, rounds)
    rows = {}
    for name in ("tv-new", "vit"):
        part = {k: v for k, v in rates.items() if k.endswith(" " + name)}
        rows.update(bc.report(part, f"torchvision {name}", f"-- recipe {name}"))
    return rows


def _tv_epochs(bufs, tv_name):
    """bench_recipes.py's torchvision method as an epoch runner returning its image count."""
    run = _torchvision_method(bufs, tv_name)

    def epoch():
        run()
        return len(bufs)
    return epoch


def section_profile(src, rounds):
    """Warm-cache loaders, the recipe built up step by step; the table rows."""
    cache_bytes = bc.full_cache_bytes(len(src))
    uint8 = dict(dtype="uint8", layout="HWC")
    methods = {"crop uint8": warm_loader(src, cache_bytes, **uint8)[1],
               "+ normalize": warm_loader(src, cache_bytes)[1]}
    for name in ("tv-new", "vit"):
        methods[f"{name} uint8"] = warm_loader(src, cache_bytes, **uint8, **recipe(name))[1]
        methods[f"{name}"] = warm_loader(src, cache_bytes, **recipe(name))[1]
    rates = bc.measure(methods, rounds)
    return bc.report(rates, "+ normalize", "-- where a cached epoch's time goes "
                     "(every loader: a full, warm cache)")


def section_val(src, rounds, max_side):
    """Evaluation loaders without and with a cache (first and later epochs); the rows."""
    from dpu_pipe import Loader

    cache_bytes = bc.full_cache_bytes(len(src), max_side)
    common = dict(train=False, num_threads=1, seed=0)
    methods = {
        "default": bc.epochs(Loader(src, BATCH, **common)),
        "max_side": bc.epochs(Loader(src, BATCH, decode_max_side=max_side, **common)),
        "cache_first": lambda: bc.epochs(Loader(src, BATCH, decode_max_side=max_side,
                                                cache_bytes=cache_bytes, **common))(),
        "cache_warm": warm_loader(src, cache_bytes, decode_max_side=max_side, **common)[1]}
    methods["default"](), methods["max_side"]()
    rates = bc.measure(methods, rounds)
    return bc.report(rates, "default", f"-- validation, decode_max_side={max_side}, "
                     f"cache_bytes={cache_bytes}")


def _rss_kib():
    """This process's resident memory now and at its peak (KiB)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM")}


def rss_child(data, n, cache_bytes):
    """Run in a fresh process: three epochs, resident memory after each step (KiB)."""
    from dpu_pipe import Loader

    src = bc.file_list(data, n)
    points = {"start": _rss_kib()}
    loader = Loader(src, BATCH, num_threads=1, seed=0, decode_max_side=MAX_SIDE,
                    cache_bytes=cache_bytes)
    points["built"] = _rss_kib()
    run = bc.epochs(loader)
    for e in range(3):
        run()
        points[f"epoch {e}"] = _rss_kib()
    return {"cache_bytes": cache_bytes, "rss_kib": points,
            "cache": loader.stats().get("cache")}


def section_rss(data, n, core):
    """:func:`rss_child` without a cache, with a full one and with a half one; the runs."""
    def child(cache_bytes):
        out = subprocess.run(
            [sys.executable, __file__, "--rss-child", str(cache_bytes), "--n", str(n),
             "--core", str(core)] + (["--data", data] if data else []),
            check=True, capture_output=True, text=True, timeout=600)
        return json.loads(out.stdout.splitlines()[-1])

    from dpu_pipe.cache import table_bytes

    runs = {"no cache": child(0)}
    runs["cache full"] = child(bc.full_cache_bytes(n))
    stored = runs["cache full"]["cache"]["bytes"]
    runs["cache half"] = child(table_bytes(n) + stored // 2)
    base = runs["no cache"]["rss_kib"]
    print(f"-- resident memory, {n} samples, decode_max_side={MAX_SIDE}, 3 epochs (MiB)")
    print(f"{'run':<11} {'cache_bytes':>11} {'stored':>7} {'entries':>7} {'no fit':>6} "
          f"{'built':>6} {'ep 0':>6} {'ep 1':>6} {'ep 2':>6} {'peak':>6} {'ep 2 - none':>11}")
    mib = 1 << 20
    for name, r in runs.items():
        p, c = r["rss_kib"], r["cache"] or {}
        r["growth_over_no_cache_bytes"] = (p["epoch 2"]["VmRSS"] - base["epoch 2"]["VmRSS"]) * 1024
        print(f"{name:<11} {r['cache_bytes'] / mib:>11.1f} {c.get('bytes', 0) / mib:>7.1f} "
              f"{c.get('entries', 0):>7} {c.get('did_not_fit', 0):>6} "
              + " ".join(f"{p[k]['VmRSS'] / 1024:>6.1f}" for k in
                         ("built", "epoch 0", "epoch 1", "epoch 2"))
              + f" {p['epoch 2']['VmHWM'] / 1024:>6.1f}"
              + f" {r['growth_over_no_cache_bytes'] / mib:>11.1f}")
    return runs


def main(argv=None):
    p = bc.argument_parser(__doc__)
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections of {SECTIONS} (default: all)")
    p.add_argument("--val-max-side", type=int, default=342)
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--rss-child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    bc.pin(args.core)
    if args.rss_child is not None:
        print(json.dumps(rss_child(args.data, args.n, args.rss_child)))
        return 0
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    src = bc.file_list(args.data, args.n)
    before = bc.machine()
    print(f"{len(src)} images, {args.rounds} rounds, one core ({before['cpu']}), "
          f"{before['date']}, load {' '.join(before['loadavg'])}")
    result = {"images": len(src), "rounds": args.rounds, "before": before}
    for section in only:
        if section == "recipes":
            result[section] = section_recipes(src, args.rounds)
        elif section == "profile":
            result[section] = section_profile(src, args.rounds)
        elif section == "val":
            result[section] = section_val(src, args.rounds, args.val_max_side)
        else:
            result[section] = section_rss(args.data, len(src), args.core)
        result[f"after {section}"] = bc.machine()
        print(f"(load {' '.join(result[f'after {section}']['loadavg'])}, "
              f"{result[f'after {section}']['date']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
