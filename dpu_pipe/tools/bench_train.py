"""``dpu-pipe bench-train``: what offloading buys a training run, end to end.

The host (core 0, PyTorch on one thread) trains a small ResNet
(:func:`dpu_pipe.models.resnet_tiny`) for the same steps, from the same weights and seed,
under each configuration of :data:`dpu_pipe.tools.harness.CONFIGS` (producer ranks on core 1;
when torchvision cannot be imported, 1-2 run its recipe written with Pillow and torch, and the
report says so). The operating points (:data:`POINTS`) are set by calibrating the model's width
and depth against the measured cost of torchvision's augmentation of a batch on one core:
``aug-bound`` (augmentation ≈ 2× a training step) and ``research`` (augmentation ≈ 17.5 % of a
serial step, validation ≈ 10 % of a serial epoch, as in Jain et al., IEEE Micro 2022).
Outputs: a markdown table, ``--json``, ``--plots`` (:func:`~dpu_pipe.tools.plots.write_plots`).
"""

import math
import os
import sys

from ..errors import ConfigError
from .baselines import Recipe, run_dataloader, run_serial
from .harness import (CONFIGS, HOST_CORE, PRODUCER_CORE, RECIPES, launch_mpi, load_torch,
                      median_time, now, pin, run_loader)
from .plots import write_plots
from .progress import bar

POINTS = {"aug-bound": 2.0, "research": 0.175 / 0.825}
#: Validation's share of a serial epoch at every operating point (dataset made on the spot).
VAL_SHARE = 0.10
#: Model depths tried in this order (stages of residual blocks), and the narrowest width.
ARCHS = ((1, 1, 1), (1, 1), (1,))
MIN_WIDTH = 2


def add_args(p):
    from .cli import add_data, add_json, add_plots, add_seed, positive_int

    p.add_argument("--quick", action="store_true",
                   help="small images, few steps: a smoke run of every configuration (CI)")
    add_data(p, "training data (a directory holding train/ and val/ gives both)")
    p.add_argument("--val-data", metavar="PATH",
                   help="validation data (default: --data's val/, else --data itself)")
    p.add_argument("--cache", metavar="DIR", default=None,
                   help="where the made dataset is kept (default: bench_train/ under "
                        "$XDG_CACHE_HOME/dpu_pipe)")
    p.add_argument("--epochs", type=positive_int, default=2,
                   help="epochs per configuration (default: 2)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="training steps per epoch (default: 24; --quick 3)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="batch size (default: 32; --quick 8)")
    p.add_argument("--size", type=positive_int, default=None,
                   help="crop size in pixels (default: 160; --quick 64)")
    p.add_argument("--classes", type=positive_int, default=10,
                   help="classes of the made dataset (default: 10)")
    p.add_argument("--producers", type=positive_int, default=1,
                   help="producer ranks, all pinned to core 1 (default: 1)")
    p.add_argument("--points", default="aug-bound,research",
                   help="operating points to run, comma-separated (default: "
                        + ",".join(POINTS) + ")")
    p.add_argument("--configs", default="1,2,3,4,5,6",
                   help="configurations to run, comma-separated (default: 1,2,3,4,5,6)")
    add_seed(p)
    add_json(p)
    add_plots(p)
    p.add_argument("--recipe", default="classic", choices=sorted(RECIPES),
                   help="training recipe of every configuration: classic (RandomResizedCrop + "
                        "flip), tv-new (torchvision's new recipe: + TrivialAugmentWide, "
                        "RandomErasing 0.1, MixUp/CutMix) or vit (timm's: bicubic, "
                        "RandAugment m9, ColorJitter 0.4, RandomErasing 0.25, MixUp/CutMix); "
                        "the models are calibrated on the classic recipe, so two recipes' "
                        "runs train the same model (default: classic)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


# -- operating points -------------------------------------------------------------------------

def _step_time(torch, classes, width, blocks, x, y, reps):
    """(seconds of a training step, of a forward pass) of a model of that width and depth."""
    from ..models import resnet_tiny

    model = resnet_tiny(classes=classes, width=width, blocks=blocks)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    step()
    train = median_time(step, reps)
    model.eval()
    with torch.no_grad():
        return train, median_time(lambda: model(x), 2)


def calibrate(train_src, args, classes):
    """Seconds per batch of the torchvision recipe on one core, and per operating point the
    model width and depth that put the training step at the point's ratio."""
    torch, quick = load_torch(), args.quick
    B = args.batch_size
    n = min(len(train_src), B)
    datas = [train_src.read(i) for i in range(n)]
    rec, val_rec = Recipe(args.size, True), Recipe(args.size, False)
    aug = median_time(lambda: [rec(d, i) for i, d in enumerate(datas)], 1 if quick else 2) \
        * B / n
    val_aug = median_time(lambda: [val_rec(d, i) for i, d in enumerate(datas)], 1) * B / n
    x, y = torch.randn(B, 3, args.size, args.size), torch.randint(0, classes, (B,))
    reps = 2 if quick else 3
    points = {}
    for name in args.points:
        target = aug / POINTS[name]
        # Shallower models when even the narrowest is too slow: a cheap augmentation (small
        # crops, a fast machine) would otherwise never reach the augmentation-bound point.
        width = 16
        for blocks in ARCHS:
            for _ in range(2 if quick else 5):   # the width whose step takes about target
                t, _ = _step_time(torch, classes, width, blocks, x, y, reps)
                new = max(MIN_WIDTH, int(round(width * math.sqrt(target / t))))
                if quick:   # a smoke run: the ratio may fall short, the report says by how much
                    new = min(new, 48)
                if new == width:
                    break
                width = new
            t, fwd = _step_time(torch, classes, width, blocks, x, y, reps)
            if t <= target * 1.25:
                break
        points[name] = {"width": width, "blocks": list(blocks), "aug_batch_s": aug,
                        "train_step_s": t, "val_batch_s": val_aug + fwd,
                        "target_ratio": POINTS[name], "measured_ratio": aug / t,
                        "aug_share_of_serial_step": aug / (aug + t)}
    return points


# -- data -------------------------------------------------------------------------------------

def prepare_data(args):
    """(train source, point -> val source or None, description). For the made dataset the
    validation set is made once the operating points are known (:func:`val_for_points`)."""
    from ..sources import open_path
    from .sample_data import make_imagenet_like

    if args.data:
        train_path, val_path = args.data, args.val_data
        if os.path.isdir(os.path.join(args.data, "train")):
            train_path = os.path.join(args.data, "train")
            if val_path is None and os.path.isdir(os.path.join(args.data, "val")):
                val_path = os.path.join(args.data, "val")
        train = open_path(train_path)
        val = open_path(val_path or train_path)
        return train, (lambda point: val), f"{train_path} ({len(train)} images), " \
                                           f"val {val_path or train_path} ({len(val)})"
    n = args.steps * args.batch_size
    train_root = os.path.join(args.cache, "train")
    make_imagenet_like(train_root, n=n, classes=args.classes, seed=args.seed,
                       progress=not args.quiet)
    train = open_path(train_root)
    return train, None, f"made on the spot: {n} train images in {args.classes} classes"


def val_for_points(args, points):
    """The made validation set, and per point the first k of its files (FileList)."""
    from ..sources import FileList
    from .sample_data import dataset_files, make_imagenet_like

    need = {}
    for name, p in points.items():
        serial_epoch = args.steps * (p["aug_batch_s"] + p["train_step_s"])
        batches = serial_epoch * VAL_SHARE / (1 - VAL_SHARE) / p["val_batch_s"]
        need[name] = max(args.batch_size, int(round(batches * args.batch_size)))
    root = os.path.join(args.cache, "val")
    make_imagenet_like(root, n=max(need.values()), classes=args.classes, seed=args.seed + 1,
                       progress=not args.quiet)
    paths, labels = dataset_files(root)
    return {name: FileList(list(zip(map(str, paths[:k]), labels[:k])))
            for name, k in need.items()}


# -- report -----------------------------------------------------------------------------------

def summarize(point_results):
    """Ratios the targets are stated in, from one operating point's results."""
    by = {r["config"]: r for r in point_results if "skipped" not in r}
    out = {}
    if 5 in by:
        r5 = by[5]
        ideal = max(r5["compute_s"], r5["producer_busy_s"] / max(1, r5["producers"]))
        out["ideal_wall_s"] = ideal
        out["overlap_recovered"] = ideal / r5["wall_s"]
        if 4 in by and by[4]["val_host_s"] > 0:
            # Per epoch in steady state: the last epoch's drain is excluded (in a long run
            # every other validation overlaps the next epoch's training).
            out["val_host_5_over_4"] = (r5["val_host_s"] - r5["drain_s"]) / by[4]["val_host_s"]
            # What validating on the producers' cores costs the training stream.
            out["train_slowdown_5_vs_4"] = r5["train_s"] / by[4]["train_s"] - 1
        if 2 in by:
            out["images_per_s_5_over_2"] = r5["images_per_s"] / by[2]["images_per_s"]
    if 1 in by:
        out["speedup_over_serial"] = {c: by[1]["wall_s"] / r["wall_s"] for c, r in by.items()}
    tops = {c: r["final_top1"] for c, r in by.items() if c >= 3}
    out["same_accuracy_dpu_pipe_stream"] = len(set(tops.values())) <= 1
    return out


def table(results):
    """The markdown report of a bench-train run's results."""
    lines = [f"Training recipe: {results.get('recipe_name', 'classic')} ({results['recipe']})."]
    for point, res in results["points"].items():
        p = results["calibration"][point]
        lines.append(f"\n### {point}: width {p['width']}, blocks {p['blocks']}, augmentation "
                     f"{p['aug_batch_s'] * 1e3:.0f} ms/batch, training step "
                     f"{p['train_step_s'] * 1e3:.0f} ms (augmentation "
                     f"{p['aug_share_of_serial_step']:.0%} of a serial step)\n")
        lines.append("| # | configuration | epoch s | img/s | host wait | val s on host "
                     "(last drain) | producer busy | top-1 per epoch | time to final acc. s |")
        lines.append("|---|---|---:|---:|---:|---:|---:|---|---:|")
        for r in res["configs"]:
            if "skipped" in r:
                lines.append(f"| {r['config']} | {r['name']} | n/a: {r['skipped'][:80]} "
                             "| | | | | | |")
                continue
            busy = r["producer_busy_s"] / (r["wall_s"] * r["producers"]) if r["producers"] \
                else None
            accs = " ".join(f"{e['top1']:.3f}" for e in r["epochs"])
            lines.append(f"| {r['config']} | {r['name']} | {r['epoch_s']:.2f} | "
                         f"{r['images_per_s']:.0f} | {r['wait_share']:.1%} | "
                         f"{r['val_host_s']:.2f}"
                         f"{' (%.2f)' % r['drain_s'] if 'drain_s' in r else ''} | "
                         f"{'—' if busy is None else f'{busy:.0%}'} | {accs} | "
                         f"{r['time_to_accuracy_s']:.1f} |")
        s = res["summary"]
        bits = []
        if "overlap_recovered" in s:
            bits.append(f"offload + remote validation recovers {s['overlap_recovered']:.0%} of "
                        f"the ideal overlap (ideal {s['ideal_wall_s']:.1f} s)")
        if "val_host_5_over_4" in s:
            bits.append(f"validation on the host's path, last drain excluded: "
                        f"{s['val_host_5_over_4']:.1%} of configuration 4's")
        if "train_slowdown_5_vs_4" in s:
            d = s["train_slowdown_5_vs_4"]
            bits.append(f"training loops {abs(d):.1%} {'slower' if d >= 0 else 'faster'} "
                        "than configuration 4's while validation shares the producers")
        if "images_per_s_5_over_2" in s:
            bits.append(f"img/s {s['images_per_s_5_over_2']:.2f}x configuration 2's")
        bits.append("configurations 3-6 reach the same accuracy (same stream): "
                    + ("yes" if s["same_accuracy_dpu_pipe_stream"] else "NO"))
        lines.append("\n" + "; ".join(bits) + ".")
    return "\n".join(lines)


# -- entry point ------------------------------------------------------------------------------

def _defaults(args):
    for name, full, quick in (("steps", 24, 3), ("batch_size", 32, 8), ("size", 160, 64)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.cache is None:
        from .sample_data import default_cache_dir
        args.cache = os.path.join(default_cache_dir(), "bench_train")
    args.points = [p.strip() for p in args.points.split(",") if p.strip()]
    bad = [p for p in args.points if p not in POINTS]
    if bad or not args.points:
        raise ConfigError(f"--points: choose among {', '.join(POINTS)}, got {bad}")
    try:
        args.configs = sorted({int(c) for c in args.configs.split(",") if c.strip()})
    except ValueError:
        raise ConfigError(f"--configs must be numbers 1-6, got {args.configs!r}") from None
    if not args.configs or not set(args.configs) <= set(CONFIGS):
        raise ConfigError(f"--configs must be numbers 1-6, got {args.configs}")


def _run_point(args, point, cal, train_src, val_src, classes):
    """Every configuration of ``args.configs`` at one operating point; their records."""
    job = {"point": point, "epochs": args.epochs, "steps": args.steps,
           "batch_size": args.batch_size, "size": args.size, "seed": args.seed, "lr": 0.05,
           "producers": args.producers, "recipe": args.recipe,
           # The MPI job's stderr is a pipe; its bars show when ours would.
           "progress": not args.quiet and sys.stderr.isatty(),
           "model_kwargs": {"classes": classes, "width": cal["width"],
                            "blocks": cal["blocks"], "seed": args.seed},
           "train": train_src.spec(), "val": val_src.spec(), "val_count": len(val_src)}
    host_runs = {1: run_serial, 2: run_dataloader, 3: run_loader}
    host = [c for c in args.configs if c in host_runs]
    res = []
    with bar(len(host) * args.epochs, f"{point}: host", unit="epoch",
             enabled=not args.quiet) as b:
        job["tick"] = lambda: b.update(1)
        for c in host:
            res.append(host_runs[c](job, train_src, val_src))
    mpi = [c for c in args.configs if c not in host_runs]
    if mpi:
        res += launch_mpi(job, mpi, limit_s=3600)
    for r in res:
        r["epochs_run"] = args.epochs
    return res


def run(args):
    """``dpu-pipe bench-train``: calibrate, run, report; returns the exit status."""
    from .cli import write_json

    _defaults(args)
    torch = load_torch()
    pin(HOST_CORE, strict=False)
    t_start = now()
    train_src, val_of, data_desc = prepare_data(args)
    classes = int(train_src.labels.max()) + 1
    out = sys.stderr if args.json == "-" else sys.stdout
    print(f"data: {data_desc}", file=out, flush=True)
    calibration = calibrate(train_src, args, classes)
    if val_of is None:
        val_of = val_for_points(args, calibration).__getitem__
    results = {"args": dict(vars(args)),
               "machine": {"cores": os.cpu_count(), "host_core": HOST_CORE,
                           "producer_core": PRODUCER_CORE, "torch": torch.__version__,
                           "torch_threads": torch.get_num_threads()},
               "recipe": Recipe(args.size, True, args.recipe, classes).kind,
               "recipe_name": args.recipe,
               "data": data_desc, "calibration": calibration, "points": {}}
    for point in args.points:
        cal, val_src = calibration[point], val_of(point)
        print(f"{point}: model width {cal['width']}, blocks {cal['blocks']}, "
              f"{len(val_src)} validation images", file=out, flush=True)
        res = _run_point(args, point, cal, train_src, val_src, classes)
        results["points"][point] = {"configs": res, "summary": summarize(res),
                                    "val_count": len(val_src)}
    results["seconds"] = now() - t_start
    if args.json != "-":
        print(table(results), flush=True)
    if args.json:
        write_json(args.json, results)
    for p in write_plots(results, args.plots) if args.plots else ():
        print(f"wrote {p}", file=out)
    return 0
