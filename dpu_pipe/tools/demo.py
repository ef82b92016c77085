"""``dpu-pipe demo``: a short real training run, host-only and then offloaded, with a per-phase
report and the speed-up measured in the same invocation.

It makes an ImageNet-like dataset from real photographs (train and val, once, under the
cache), then trains the same small ResNet from the same initial weights on the same stream
twice: with :class:`~dpu_pipe.Loader` on the host's core and validation on the host
(configuration 3 of :data:`~dpu_pipe.tools.harness.CONFIGS`), then in an MPI job whose producer
ranks, standing in for DPU cores, make the training batches and evaluate each epoch's
snapshot of the model while the host trains on (configuration 5). The host is pinned to core 0,
the producers to core 1, as in ``dpu-pipe bench-train``.
"""

import os
import sys
import time

from ..errors import ConfigError


def add_args(p):
    from .cli import add_json, add_plots, add_seed, positive_int

    p.add_argument("-n", "--images", type=positive_int, default=512,
                   help="training images (default: 512)")
    p.add_argument("--val-images", type=positive_int, default=256,
                   help="validation images (default: 256)")
    p.add_argument("--classes", type=positive_int, default=8, help="classes (default: 8)")
    p.add_argument("--epochs", type=positive_int, default=3, help="epochs (default: 3)")
    p.add_argument("--batch-size", type=positive_int, default=32,
                   help="batch size (default: 32)")
    p.add_argument("--size", type=positive_int, default=112,
                   help="crop size in pixels (default: 112)")
    p.add_argument("--width", type=positive_int, default=8,
                   help="channels of the ResNet's first stage (default: 8)")
    p.add_argument("--producers", type=positive_int, default=1,
                   help="producer ranks, pinned to core 1 (default: 1)")
    p.add_argument("--cache", metavar="DIR", default=None,
                   help="where the demo dataset is made (default: demo/ under "
                        "$XDG_CACHE_HOME/dpu_pipe)")
    add_seed(p)
    add_json(p)
    p.set_defaults(plots="demo_plots")
    add_plots(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def _make_data(args):
    from ..sources import ImageFolder
    from .sample_data import default_cache_dir, make_imagenet_like

    t = time.perf_counter()
    root = args.cache or os.path.join(default_cache_dir(), "demo")
    train = make_imagenet_like(os.path.join(root, "train"), n=args.images,
                               classes=args.classes, seed=args.seed, progress=not args.quiet)
    val = make_imagenet_like(os.path.join(root, "val"), n=args.val_images,
                             classes=args.classes, seed=args.seed + 1, progress=not args.quiet)
    print(f"dataset: {train['count']} train + {val['count']} val JPEGs, mean "
          f"{train['mean_width']:.0f}x{train['mean_height']:.0f} px, "
          f"{train['mean_bytes'] / 1024:.0f} KB, from {len(train['corpus'])} photographs "
          f"({time.perf_counter() - t:.1f} s, reused when already made)", flush=True)
    return ImageFolder(os.path.join(root, "train")), ImageFolder(os.path.join(root, "val"))


def run(args):
    from . import harness
    from .cli import write_json
    from .plots import write_plots
    from .progress import bar

    harness.load_torch()
    if args.images < args.batch_size:
        raise ConfigError(f"--images ({args.images}) must be at least --batch-size "
                          f"({args.batch_size})")
    train_src, val_src = _make_data(args)
    harness.pin(harness.HOST_CORE, strict=False)
    steps = args.images // args.batch_size
    job = {"point": "demo", "epochs": args.epochs, "steps": steps,
           "batch_size": args.batch_size, "size": args.size, "seed": args.seed, "lr": 0.05,
           "producers": args.producers,
           "progress": not args.quiet and sys.stderr.isatty(),
           "model_kwargs": {"classes": args.classes, "width": args.width, "seed": args.seed},
           "train": train_src.spec(), "val": val_src.spec(), "val_count": len(val_src)}
    print(f"training a ResNet (width {args.width}) for {args.epochs} epochs x {steps} steps, "
          f"batch {args.batch_size}, {args.size}x{args.size}; host on core {harness.HOST_CORE}, "
          f"{args.producers} producer rank(s) on core {harness.PRODUCER_CORE}", flush=True)
    t = time.perf_counter()
    with bar(args.epochs, "host only", unit="epoch", enabled=not args.quiet) as b:
        job["tick"] = lambda: b.update(1)
        host = harness.run_loader(job, train_src, val_src)
    host["name"] = "host only (Loader, validation on the host)"
    print(f"host-only run: {time.perf_counter() - t:.1f} s", flush=True)
    print(f"launching: mpiexec -n 1 <host> : -n {args.producers} python -m mpi4py -m "
          "dpu_pipe.worker", flush=True)
    t = time.perf_counter()
    (off,) = harness.launch_mpi(job, [5], limit_s=1800)
    if "skipped" in off:
        raise ConfigError(f"the offloaded run could not run: {off['skipped']}")
    off["name"] = "offloaded (DPULoader + RemoteValidation)"
    print(f"offloaded run: {time.perf_counter() - t:.1f} s (MPI start-up included)", flush=True)
    for r in (host, off):
        r["epochs_run"] = args.epochs
    results = {"runs": [host, off], "speedup": host["wall_s"] / off["wall_s"],
               "points": {"demo": {"configs": [host, off]}}}
    _report(host, off, results["speedup"])
    if args.json:
        write_json(args.json, results)
    if args.plots:
        for p in write_plots(results, args.plots):
            print(f"wrote {p}")
    return 0


def _report(host, off, speedup):
    print("\nper-phase report (seconds over the whole run; the host's view)")
    print(f"| {'phase':<34} | {'host only':>9} | {'offloaded':>9} |")
    print(f"|{'-' * 36}|{'-' * 11}|{'-' * 11}|")
    rows = (("compute (training steps)", "compute_s"), ("waiting for training batches", "wait_s"),
            ("validation on the host's path", "val_host_s"), ("other", "other_s"),
            ("total", "wall_s"))
    for label, key in rows:
        print(f"| {label:<34} | {host[key]:9.2f} | {off[key]:9.2f} |")
    if off.get("drain_s"):
        print(f"  (offloaded: {off['drain_s']:.2f} s of its validation time is waiting for "
              "the last epoch's result, which has no training left to overlap)")
    print(f"\nhost only: the Loader's thread on the host's core spent "
          f"{host['producer_busy_s']:.2f} s making batches (train + val)")
    s = off.get("train_stats", {})
    if s:
        print(f"offloaded: producers made {s.get('batches', 0)} training batches "
              f"({s.get('bytes_received', 0) / 2**20:.0f} MiB over RMA): read "
              f"{s.get('producer_read_s', 0):.2f} s, decode+augment "
              f"{s.get('producer_process_s', 0):.2f} s, publish "
              f"{s.get('producer_publish_s', 0):.2f} s; steps per producer "
              f"{s.get('steps_per_producer')}; validation on the producers "
              f"{off.get('remote_val_s', 0):.2f} s ({off.get('remote_val_cpu_s', 0):.2f} s of "
              f"CPU); busy "
              f"{off['producer_busy_s'] / (off['wall_s'] * off['producers']):.0%} of their core")
    print("\naccuracy after each epoch (top-1 on the validation set)")
    for a, b in zip(host["epochs"], off["epochs"]):
        same = "same" if a["top1"] == b["top1"] and a["count"] == b["count"] else "DIFFERENT"
        print(f"  epoch {a['epoch']}: host only {a['top1']:.4f} ({a['count']} images), "
              f"offloaded {b['top1']:.4f} ({b['count']} images) — {same}")
    print(f"\nspeed-up of the offloaded run over the host-only run: {speedup:.2f}x "
          f"({host['wall_s']:.2f} s -> {off['wall_s']:.2f} s)")
