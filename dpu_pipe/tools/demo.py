"""``dpu-pipe demo``: a short real training run fed by dpu_pipe, with a per-phase report.

It makes an ImageNet-like dataset from real photographs on the spot (train and val splits),
then launches an MPI job — one host rank that trains a small CNN with PyTorch, and producer
ranks (``python -m dpu_pipe.worker``, standing in for DPU cores) that decode and augment the
training and validation batches into the host's memory with one-sided RMA — and reports where
the time went: waiting for data, computing, validating, plus the producers' own counters.
``--mode local`` runs the same training with batches made by host threads instead.
"""

import argparse
import os
import subprocess
import sys
import time

from ..errors import ConfigError

DEFAULT_ROOT = os.path.join(".cache", "dpu_pipe", "demo")


def add_args(p):
    p.add_argument("--data", default=DEFAULT_ROOT,
                   help="where the demo dataset is made (reused when already there)")
    p.add_argument("--images", type=int, default=1024, help="training images")
    p.add_argument("--val-images", type=int, default=256, help="validation images")
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=128, help="crop size in pixels")
    p.add_argument("--threads", type=int, default=1,
                   help="loader threads (the rest of the cores train)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=("offload", "local"), default="offload",
                   help="offload: producer ranks under mpiexec make the batches; "
                        "local: host threads do")
    p.add_argument("--producers", type=int, default=2, help="producer ranks (offload mode)")
    p.add_argument("--mpi-host", action="store_true", help=argparse.SUPPRESS)


def _model(torch, classes):
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 16, 5, stride=2, padding=2), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes))


def _make_data(args):
    from .sample_data import make_imagenet_like

    t = time.perf_counter()
    train = make_imagenet_like(os.path.join(args.data, "train"), n=args.images,
                               classes=args.classes, seed=args.seed)
    val = make_imagenet_like(os.path.join(args.data, "val"), n=args.val_images,
                             classes=args.classes, seed=args.seed + 1)
    print(f"dataset: {train['count']} train + {val['count']} val JPEGs, mean "
          f"{train['mean_width']:.0f}x{train['mean_height']:.0f} px, "
          f"{train['mean_bytes'] / 1024:.0f} KB, from {len(train['corpus'])} photographs "
          f"({time.perf_counter() - t:.1f} s)")


def _launch(args):
    """Run this demo's host rank and the producer ranks under mpiexec."""
    from ..mpi import mpiexec_path

    host = [sys.executable, "-m", "mpi4py", "-m", "dpu_pipe", "demo", "--mpi-host"]
    for name in ("data", "images", "val_images", "classes", "epochs", "batch_size", "size",
                 "threads", "seed", "producers"):
        host += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    worker = [sys.executable, "-m", "mpi4py", "-m", "dpu_pipe.worker"]
    cmd = [mpiexec_path(), "-n", "1", *host, ":", "-n", str(args.producers), *worker]
    print("launching: mpiexec -n 1 python -m mpi4py -m dpu_pipe demo ... : "
          f"-n {args.producers} python -m mpi4py -m dpu_pipe.worker", flush=True)
    # The job's wall-clock bound: the dataset is made, so training a few epochs takes minutes.
    proc = subprocess.run(cmd, timeout=3600)
    return proc.returncode


def run(args):
    try:
        import torch
    except ImportError:
        raise ConfigError("the demo trains with PyTorch: pip install torch "
                          "(./run.sh demo installs it)") from None
    if args.mode == "offload" and not args.mpi_host:
        _make_data(args)
        return _launch(args)
    from .. import DPULoader, ImageFolder, Loader

    if not args.mpi_host:
        _make_data(args)
    train_src = ImageFolder(os.path.join(args.data, "train"))
    val_src = ImageFolder(os.path.join(args.data, "val"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, cores - args.threads))
    model = _model(torch, len(train_src.classes))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()

    common = dict(size=args.size, seed=args.seed, num_threads=args.threads, output="torch")
    if args.mpi_host:
        make = DPULoader
        torch.set_num_threads(max(1, cores - args.producers))
    else:
        make = Loader
    train = make(train_src, args.batch_size, train=True, **common)
    val = make(val_src, args.batch_size, train=False, shuffle=False, drop_last=False, **common)
    phases = {"data wait (train)": 0.0, "compute (train)": 0.0, "validation": 0.0}
    where = (f"{args.producers} producer ranks" if args.mpi_host
             else f"{args.threads} host loader thread(s)")
    print(f"training {args.epochs} epochs x {len(train)} steps, batch {args.batch_size}, "
          f"{args.size}x{args.size}, batches made by {where}, torch threads "
          f"{torch.get_num_threads()}", flush=True)
    t_start = time.perf_counter()
    with train, val:
        for epoch in range(args.epochs):
            train.set_epoch(epoch)
            model.train()
            seen, loss_sum = 0, 0.0
            t = time.perf_counter()
            for images, labels in train:
                t1 = time.perf_counter()
                phases["data wait (train)"] += t1 - t
                opt.zero_grad()
                loss = loss_fn(model(images), labels)
                loss.backward()
                opt.step()
                seen += len(labels)
                loss_sum += loss.item() * len(labels)
                t = time.perf_counter()
                phases["compute (train)"] += t - t1
            t_val = time.perf_counter()
            model.eval()
            correct = total = 0
            with torch.no_grad():
                val.set_epoch(0)
                for images, labels in val:
                    correct += int((model(images).argmax(1) == labels).sum())
                    total += len(labels)
            phases["validation"] += time.perf_counter() - t_val
            print(f"epoch {epoch}: train loss {loss_sum / seen:.3f} over {seen} images, "
                  f"val accuracy {correct / total:.3f} ({total} images)", flush=True)
        wall = time.perf_counter() - t_start
        _report(phases, wall, train, val, args)


def _report(phases, wall, train, val, args):
    print("\nper-phase report (seconds)")
    print(f"| {'phase':<22} | {'seconds':>8} | {'share':>6} |")
    print(f"|{'-' * 24}|{'-' * 10}|{'-' * 8}|")
    for name, sec in phases.items():
        print(f"| {name:<22} | {sec:8.2f} | {sec / wall:6.1%} |")
    print(f"| {'total':<22} | {wall:8.2f} | {1:6.1%} |")
    for name, loader in (("train loader", train), ("val loader", val)):
        s = loader.stats()
        if "producer_process_s" in s:
            rate = s["samples"] / s["producer_process_s"] if s["producer_process_s"] else 0.0
            print(f"{name}: {s['batches']} batches, {s['samples']} images, "
                  f"{s['bytes_received'] / 2**20:.0f} MiB received over RMA; producers: read "
                  f"{s['producer_read_s']:.2f} s, decode+augment {s['producer_process_s']:.2f} s "
                  f"({rate:.0f} img/s per producer), publish {s['producer_publish_s']:.2f} s, "
                  f"steps per producer rank {s['steps_per_producer']}; host waited "
                  f"{s['wait_s']:.2f} s")
        else:
            rate = s["samples"] / s["process_s"] if s["process_s"] else 0.0
            print(f"{name}: {s['batches']} batches, {s['samples']} images; read "
                  f"{s['read_s']:.2f} s, decode+augment {s['process_s']:.2f} s ({rate:.0f} img/s "
                  f"on {args.threads} thread(s)), consumer waited {s['wait_s']:.2f} s")


def main(argv=None):
    p = argparse.ArgumentParser(prog="dpu-pipe demo", description=__doc__)
    add_args(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
