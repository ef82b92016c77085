"""``dpu-pipe bench-train``: what offloading buys a training run, end to end.

The host (pinned to core 0, PyTorch on one thread) trains a small ResNet
(:func:`dpu_pipe.models.resnet_tiny`) for the same number of steps, from the same initial
weights and seed, under each configuration:

1. host only, serial: torchvision's transforms in the training process (the baseline);
2. PyTorch ``DataLoader(num_workers=1)`` + torchvision, its worker pinned to core 0 too (every
   piece of work on the host's cores, as on a host without DPUs);
3. :class:`~dpu_pipe.Loader` on the host (core 0);
4. :class:`~dpu_pipe.DPULoader` offload (producer ranks pinned to core 1), validation batches
   made by the producers and evaluated on the host;
5. :class:`~dpu_pipe.DPULoader` offload + :class:`~dpu_pipe.RemoteValidation` (the producers
   evaluate a snapshot of the model while the host keeps training);
6. ``DPULoader(mode="hybrid")``, where the installed dpu_pipe has it.

at two operating points, set by calibrating the model's width (and depth, when the narrowest
model is still too slow) against the measured cost of the
torchvision augmentation of one batch on one core: ``aug-bound`` (augmentation ≈ 2× a training
step) and ``research`` (augmentation ≈ 17.5 % of a serial step, validation ≈ 10 % of a serial
epoch, as in Jain et al., IEEE Micro 2022). Every configuration runs once, configurations in
order within an operating point.

When torchvision cannot be imported (its wheels are built against one torch build), configs
1–2 use the same recipe written with Pillow and torch: full PIL decode, RandomResizedCrop's
parameters drawn as torchvision draws them, PIL bilinear resize of the crop, flip, to-tensor,
normalize; the report says which ran.

Outputs: a markdown table on stdout, every figure in ``--json PATH``, and PNG plots in
``--plots DIR`` (epoch-time breakdown per configuration; per-step timelines of host compute,
host wait and producer busy time for configurations 2 and 5).
"""

import argparse
import io
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np

from .._torch import torch_module
from ..errors import ConfigError
from . import pinning
from .progress import bar

CONFIGS = {
    1: "host serial + torchvision",
    2: "DataLoader(num_workers=1) + torchvision",
    3: "Loader on the host",
    4: "DPULoader offload, validation on host",
    5: "DPULoader offload + RemoteValidation",
    6: "DPULoader hybrid + RemoteValidation",
}
HOST_CONFIGS = (1, 2, 3)
MPI_CONFIGS = (4, 5, 6)
#: Operating points: target (augmentation seconds per batch) / (training step seconds).
POINTS = {"aug-bound": 2.0, "research": 0.175 / 0.825}
#: Validation's share of a serial epoch at every operating point (dataset made on the spot).
VAL_SHARE = 0.10
#: Model depths tried in this order (stages of residual blocks), and the narrowest width.
ARCHS = ((1, 1, 1), (1, 1), (1,))
MIN_WIDTH = 2
HOST_CORE, PRODUCER_CORE = 0, 1
MODEL = "dpu_pipe.models:resnet_tiny"


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
    p.add_argument("--epochs", type=positive_int, default=None,
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
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.add_argument("--mpi-host", metavar="JOB", help=argparse.SUPPRESS)
    p.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)


# -- pinning and the clock --------------------------------------------------------------------

def pin(core):
    """Pin this process to ``core`` when the machine has it (a 1-core machine shares)."""
    pinning.pin(core, strict=False)


def _torch():
    torch = torch_module("bench-train")
    torch.set_num_threads(1)
    return torch


now = time.perf_counter


# -- torchvision's recipe ---------------------------------------------------------------------

def _torchvision():
    try:
        import torchvision.transforms as T
        return T
    except Exception:  # noqa: BLE001 - any import failure means: not usable here
        return None


class Recipe:
    """torchvision's ImageNet transforms for one sample: ``(bytes, key) -> float32 CHW tensor``.

    Train: RandomResizedCrop(size) + RandomHorizontalFlip + ToTensor + Normalize; val:
    Resize(size / 0.875) + CenterCrop(size) + ToTensor + Normalize. With torchvision
    importable, its own transforms run (randomness from torch's generator, seeded per sample
    from ``key``); otherwise the same steps with Pillow and torch, parameters drawn as
    torchvision draws them from ``random.Random(key)``.
    """

    def __init__(self, size, train):
        from ..transforms import IMAGENET_MEAN, IMAGENET_STD

        self.size, self.train = int(size), bool(train)
        self.resize = int(round(self.size / 0.875))
        self.T = _torchvision()
        self.kind = "torchvision" if self.T is not None else "Pillow + torch (torchvision's recipe)"
        torch = _torch()
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
        if self.T is not None:
            T = self.T
            head = ([T.RandomResizedCrop(self.size), T.RandomHorizontalFlip()] if train
                    else [T.Resize(self.resize), T.CenterCrop(self.size)])
            self.tf = T.Compose(head + [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])

    def __call__(self, data, key):
        from PIL import Image

        torch = _torch()
        img = Image.open(io.BytesIO(data)).convert("RGB")
        if self.T is not None:
            torch.manual_seed(key)
            return self.tf(img)
        if self.train:
            rng = random.Random(key)
            i, j, h, w = self._crop_params(img.height, img.width, rng)
            img = img.crop((j, i, j + w, i + h)).resize((self.size, self.size),
                                                        Image.BILINEAR)
            if rng.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
        else:
            scale = self.resize / min(img.width, img.height)
            img = img.resize((max(self.resize, round(img.width * scale)),
                              max(self.resize, round(img.height * scale))), Image.BILINEAR)
            top = int(round((img.height - self.size) / 2.0))
            left = int(round((img.width - self.size) / 2.0))
            img = img.crop((left, top, left + self.size, top + self.size))
        x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float().div_(255)
        return x.sub_(self.mean).div_(self.std)

    @staticmethod
    def _crop_params(height, width, rng, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        """torchvision's RandomResizedCrop.get_params."""
        area = height * width
        log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return rng.randint(0, height - h), rng.randint(0, width - w), h, w
        in_ratio = width / height
        if in_ratio < ratio[0]:
            w, h = width, int(round(width / ratio[0]))
        elif in_ratio > ratio[1]:
            h, w = height, int(round(height * ratio[1]))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w


class RecipeDataset:
    """Map-style dataset for ``torch.utils.data.DataLoader``: sample i of a dpu_pipe source
    through :class:`Recipe`; yields (image, label, seconds spent on it)."""

    def __init__(self, source, recipe, seed, epoch):
        self.source, self.recipe, self.seed, self.epoch = source, recipe, seed, epoch

    def __len__(self):
        return len(self.source)

    def __getitem__(self, i):
        t = now()
        x = self.recipe(self.source.read(i), _key(self.seed, self.epoch, i))
        return x, int(self.source.labels[i]), now() - t


def _key(seed, epoch, index):
    return (int(seed) * 1_000_003 + int(epoch)) * 1_000_000_007 + int(index)


def _order(n, seed, epoch):
    return np.random.default_rng([seed, epoch]).permutation(n)


# -- training ---------------------------------------------------------------------------------

class Run:
    """One configuration's training run: the model, its optimizer, the per-step timeline
    and per-epoch accuracy."""

    def __init__(self, job, config):
        from ..models import resnet_tiny

        torch = self.torch = _torch()
        self.job, self.config = job, config
        self.model = resnet_tiny(**job["model_kwargs"])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=job["lr"], momentum=0.9)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.t0 = now()
        #: per step: seconds since start at wait start, batch in hand, step done; producer s.
        self.timeline = {"wait_start": [], "ready": [], "done": [], "producer_s": []}
        self.val_host_s = 0.0
        self.epochs = []           # per epoch: {"epoch", "top1", "loss", "known_at"}

    def train_epoch(self, batches, producer_s=None):
        """Consume ``job["steps"]`` batches of ``batches`` (an iterable of (images, labels))
        with one optimizer step each. ``producer_s()``, when given, returns the producers'
        cumulative busy seconds (sampled per step for the timeline)."""
        torch, tl = self.torch, self.timeline
        self.model.train()
        steps = self.job["steps"]
        done = 0
        before = producer_s() if producer_s else 0.0
        t = now()
        for images, labels in batches:
            t1 = now()
            self.opt.zero_grad()
            loss = self.loss_fn(self.model(images), torch.as_tensor(labels))
            loss.backward()
            self.opt.step()
            t2 = now()
            tl["wait_start"].append(t - self.t0)
            tl["ready"].append(t1 - self.t0)
            tl["done"].append(t2 - self.t0)
            if producer_s:
                cur = producer_s()
                tl["producer_s"].append(cur - before)
                before = cur
            done += 1
            if done == steps:
                break
            t = now()
        if done < steps:
            raise ConfigError(f"the training data gave {done} batches per epoch; "
                              f"--steps {steps} needs more images or a smaller --steps")

    def validate_host(self, epoch, batches):
        """Evaluate on this host (batches: (images, labels)); record the epoch's metrics."""
        from ..evaluate import Metrics, evaluate_batch

        t = now()
        self.model.eval()
        m = Metrics((1, 5))
        for images, labels in batches:
            evaluate_batch(self.model, images, labels, m)
        self.model.train()
        self.val_host_s += now() - t
        self.record(epoch, m.result())

    def record(self, epoch, result, known_at=None):
        self.epochs.append({"epoch": epoch, "count": result["count"],
                            "top1": result["top1"], "loss": result["loss"],
                            "known_at": (now() if known_at is None else known_at) - self.t0})

    def result(self, extra):
        tl = self.timeline
        wall = now() - self.t0
        compute = float(sum(d - r for d, r in zip(tl["done"], tl["ready"])))
        wait = float(sum(r - w for r, w in zip(tl["ready"], tl["wait_start"])))
        images = self.job["steps"] * self.job["epochs"] * self.job["batch_size"]
        k = self.job["steps"]
        # Seconds of the training loops alone (first wait to last step, per epoch).
        train_s = float(sum(tl["done"][e + k - 1] - tl["wait_start"][e]
                            for e in range(0, len(tl["done"]), k)))
        out = {"config": self.config, "name": CONFIGS[self.config],
               "wall_s": wall, "epoch_s": wall / self.job["epochs"],
               "images_per_s": images / wall, "compute_s": compute, "wait_s": wait,
               "wait_share": wait / wall, "val_host_s": self.val_host_s, "train_s": train_s,
               "other_s": max(0.0, wall - compute - wait - self.val_host_s),
               "epochs": sorted(self.epochs, key=lambda e: e["epoch"]),
               "timeline": tl}
        last = out["epochs"][-1] if out["epochs"] else None
        out["final_top1"] = last["top1"] if last else None
        out["time_to_accuracy_s"] = last["known_at"] if last else None
        out.update(extra)
        return out


def _stack(torch, items):
    xs, ys, secs = zip(*items)
    return torch.stack(xs), torch.tensor(ys, dtype=torch.int64), float(sum(secs))


def run_serial(job, train_src, val_src):
    """Configuration 1: the recipe in the training loop."""
    run = Run(job, 1)
    torch = run.torch
    train_rec, val_rec = Recipe(job["size"], True), Recipe(job["size"], False)
    ds_val = RecipeDataset(val_src, val_rec, job["seed"], 0)
    B = job["batch_size"]
    busy = [0.0]

    def batches(epoch):
        ds = RecipeDataset(train_src, train_rec, job["seed"], epoch)
        order = _order(len(ds), job["seed"], epoch)
        for s in range(len(order) // B):
            images, labels, sec = _stack(torch, [ds[int(i)] for i in order[s * B:(s + 1) * B]])
            busy[0] += sec
            yield images, labels

    def val_batches():
        for s in range(0, len(ds_val), B):
            images, labels, _ = _stack(torch, [ds_val[i] for i in
                                               range(s, min(len(ds_val), s + B))])
            yield images, labels

    for epoch in range(job["epochs"]):
        run.train_epoch(batches(epoch))
        run.validate_host(epoch, val_batches())
        job["tick"]()
    return run.result({"recipe": train_rec.kind, "producer_busy_s": busy[0],
                       "producers": 0, "name": f"host serial + {train_rec.kind}"})


def _pin_worker(_):
    pin(HOST_CORE)
    import torch
    torch.set_num_threads(1)


def run_dataloader(job, train_src, val_src):
    """Configuration 2: DataLoader(num_workers=1), the worker pinned to the host's core."""
    run = Run(job, 2)
    torch = run.torch
    from torch.utils.data import DataLoader

    train_rec, val_rec = Recipe(job["size"], True), Recipe(job["size"], False)
    busy = [0.0]

    def collate(items):
        images, labels, sec = _stack(torch, items)
        return images, labels, torch.tensor(sec)

    def loader(ds, shuffle, epoch):
        g = torch.Generator().manual_seed(job["seed"] * 1000 + epoch)
        return DataLoader(ds, batch_size=job["batch_size"], shuffle=shuffle, generator=g,
                          num_workers=1, worker_init_fn=_pin_worker, collate_fn=collate,
                          drop_last=shuffle, prefetch_factor=2)

    def strip(it):
        for images, labels, sec in it:
            busy[0] += float(sec)
            run.timeline.setdefault("batch_s", []).append(float(sec))
            yield images, labels

    for epoch in range(job["epochs"]):
        run.train_epoch(strip(iter(loader(RecipeDataset(train_src, train_rec, job["seed"],
                                                        epoch), True, epoch))))
        run.validate_host(epoch, strip(iter(loader(RecipeDataset(val_src, val_rec,
                                                                 job["seed"], 0),
                                                   False, 0))))
        job["tick"]()
    # The worker's seconds per delivered training batch, for the timeline.
    bs = run.timeline.pop("batch_s", [])
    per_epoch_val = len(bs) // job["epochs"] - job["steps"] if job["epochs"] else 0
    train_bs = []
    for e in range(job["epochs"]):
        start = e * (job["steps"] + per_epoch_val)
        train_bs += bs[start:start + job["steps"]]
    run.timeline["producer_s"] = train_bs
    return run.result({"recipe": train_rec.kind, "producer_busy_s": busy[0], "producers": 1,
                       "name": f"DataLoader(num_workers=1) + {train_rec.kind}"})


def run_loader(job, train_src, val_src):
    """Configuration 3: dpu_pipe's Loader, its thread on the host's core."""
    from ..loader import Loader

    run = Run(job, 3)
    kw = dict(size=job["size"], seed=job["seed"], output="torch", num_threads=1)
    train = Loader(train_src, job["batch_size"], train=True, **kw)
    val = Loader(val_src, job["batch_size"], train=False, shuffle=False, drop_last=False, **kw)

    def made():
        s = train.stats()
        return s["read_s"] + s["process_s"]

    with train, val:
        for epoch in range(job["epochs"]):
            train.set_epoch(epoch)
            run.train_epoch(train, producer_s=made)
            val.set_epoch(0)
            run.validate_host(epoch, val)
            job["tick"]()
        busy = sum(s["read_s"] + s["process_s"] for s in (train.stats(), val.stats()))
    return run.result({"producer_busy_s": busy, "producers": 0})


def run_offload(job, train_src, val_src, config):
    """Configurations 4-6 on the host rank of an MPI job whose producers are pinned to
    core 1."""
    from ..offload import DPULoader

    run = Run(job, config)
    kw = dict(size=job["size"], seed=job["seed"], output="torch")
    mode = "hybrid" if config == 6 else "offload"
    extra = {"producers": job["producers"]}
    if config == 6:
        kw["host_threads"] = 1
    train = DPULoader(train_src, job["batch_size"], train=True, mode=mode, **kw)
    rv = val = None
    if config == 4:
        val = DPULoader(val_src, job["batch_size"], train=False, shuffle=False,
                        drop_last=False, **kw)
    else:
        from ..offload.validation import RemoteValidation
        rv = RemoteValidation(val_src, job["batch_size"], model=MODEL,
                              model_kwargs=job["model_kwargs"], size=job["size"],
                              topk=(1, 5))

    def made():
        s = train.stats()
        return s.get("producer_read_s", 0.0) + s.get("producer_process_s", 0.0) \
            + s.get("producer_publish_s", 0.0)

    pending = []
    extra["drain_s"] = 0.0

    def collect(block):
        """Results that are in (or, at the end, all of them: the last epoch's validation
        has no training left to hide behind, so its wait is the run's drain)."""
        while pending and (block or pending[0][1].done()):
            epoch, fut = pending.pop(0)
            t = now()
            res = fut.result(timeout=600)
            waited = now() - t
            run.val_host_s += waited
            if block:
                extra["drain_s"] += waited
            run.record(epoch, res)
            extra.setdefault("remote_val_s", 0.0)
            extra["remote_val_s"] += sum(p["seconds"] for p in res["by_rank"])
            extra.setdefault("remote_val_cpu_s", 0.0)
            extra["remote_val_cpu_s"] += sum(p["cpu_s"] for p in res["by_rank"])

    try:
        for epoch in range(job["epochs"]):
            train.set_epoch(epoch)
            run.train_epoch(train, producer_s=made)
            if val is not None:
                val.set_epoch(0)
                run.validate_host(epoch, val)
            else:
                t = now()
                pending.append((epoch, rv.submit(run.model.state_dict(), tag=epoch)))
                run.val_host_s += now() - t
                collect(False)
            job["tick"]()
        collect(True)
        extra["train_stats"] = {k: v for k, v in train.stats().items()
                                if isinstance(v, (int, float, dict))}
        busy = made()
        if val is not None:
            s = val.stats()
            busy += s["producer_read_s"] + s["producer_process_s"] + s["producer_publish_s"]
        # CPU seconds for validation: its wall seconds include the batch making it yields to.
        busy += extra.get("remote_val_cpu_s", 0.0)
        extra["producer_busy_s"] = busy
        if config == 6:
            extra["made_by"] = {k: v for k, v in train.stats().items() if "made" in k}
    finally:
        train.close()
        if val is not None:
            val.close()
        if rv is not None:
            rv.close()
    return run.result(extra)


# -- operating points -------------------------------------------------------------------------

def _median_time(fn, reps):
    times = []
    for _ in range(reps):
        t = now()
        fn()
        times.append(now() - t)
    return float(np.median(times))


def calibrate(train_src, args, classes, quick):
    """Seconds per batch of the torchvision recipe on one core, and model widths that put
    the training step at each operating point's ratio."""
    from ..models import resnet_tiny

    torch = _torch()
    B, size = args.batch_size, args.size
    rec = Recipe(size, True)
    n = min(len(train_src), B)
    datas = [train_src.read(i) for i in range(n)]
    val_rec = Recipe(size, False)
    aug = _median_time(lambda: [rec(d, i) for i, d in enumerate(datas)], 1 if quick else 2) \
        * B / n
    val_aug = _median_time(lambda: [val_rec(d, i) for i, d in enumerate(datas)], 1) * B / n
    x = torch.randn(B, 3, size, size)
    y = torch.randint(0, classes, (B,))

    def step_time(width, blocks):
        model = resnet_tiny(classes=classes, width=width, blocks=blocks)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        step()
        train = _median_time(step, 2 if quick else 3)
        model.eval()
        with torch.no_grad():
            fwd = _median_time(lambda: model(x), 2)
        return train, fwd

    def fit_width(target, blocks, width):
        """Width whose step takes about ``target`` seconds, with ``blocks``, searched from
        ``width``."""
        for _ in range(2 if quick else 5):
            t, _ = step_time(width, blocks)
            new = max(MIN_WIDTH, int(round(width * math.sqrt(target / t))))
            if quick:   # a smoke run: the ratio may fall short, the report says by how much
                new = min(new, 48)
            if new == width:
                break
            width = new
        return width

    points = {}
    for name in args.points:
        target = aug / POINTS[name]
        # Shallower models when even the narrowest is too slow: a cheap augmentation (small
        # crops, a fast machine) would otherwise never reach the augmentation-bound point.
        width = 16
        for blocks in ARCHS:
            width = fit_width(target, blocks, width)
            t, fwd = step_time(width, blocks)
            if t <= target * 1.25:
                break
        points[name] = {"width": width, "blocks": list(blocks), "aug_batch_s": aug,
                        "train_step_s": t, "val_batch_s": val_aug + fwd,
                        "target_ratio": POINTS[name], "measured_ratio": aug / t,
                        "aug_share_of_serial_step": aug / (aug + t)}
    return points


# -- data -------------------------------------------------------------------------------------

def _open(path):
    from ..sources import open_path
    return open_path(path)


def prepare_data(args):
    """(train source, point -> val source or None, description). For the made dataset the
    validation set is made once the operating points are known (:func:`val_for_points`)."""
    from .sample_data import make_imagenet_like

    if args.data:
        train_path, val_path = args.data, args.val_data
        if os.path.isdir(os.path.join(args.data, "train")):
            train_path = os.path.join(args.data, "train")
            if val_path is None and os.path.isdir(os.path.join(args.data, "val")):
                val_path = os.path.join(args.data, "val")
        train = _open(train_path)
        val = _open(val_path or train_path)
        return train, (lambda point: val), f"{train_path} ({len(train)} images), " \
                                           f"val {val_path or train_path} ({len(val)})"
    n = args.steps * args.batch_size
    train_root = os.path.join(args.cache, "train")
    make_imagenet_like(train_root, n=n, classes=args.classes, seed=args.seed,
                       progress=not args.quiet)
    train = _open(train_root)
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


# -- MPI jobs ---------------------------------------------------------------------------------

def launch_mpi(job, args):
    """Run configurations 4-6 of one operating point in one MPI job (host rank on core 0,
    ``--producers`` ranks on core 1); returns their results."""
    from ..mpi import mpiexec_path

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "job.json")
        job = dict(job, out=os.path.join(tmp, "result.json"))
        with open(path, "w") as f:
            json.dump(job, f)
        me = [sys.executable, "-m", "mpi4py", "-m", "dpu_pipe.tools.bench_train"]
        cmd = [mpiexec_path(), "-n", "1", *me, "--mpi-host", path, ":",
               "-n", str(job["producers"]), *me, "--mpi-worker"]
        env = dict(os.environ)
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in env.get("PYTHONPATH", "")
                                                      .split(os.pathsep) if p])
        proc = subprocess.run(cmd, env=env, timeout=job["limit_s"])
        if proc.returncode != 0 or not os.path.exists(job["out"]):
            raise ConfigError(f"the offload run failed (exit {proc.returncode}); its output "
                              "is above")
        with open(job["out"]) as f:
            return json.load(f)


def mpi_host(path):
    """The host rank of an offload job: run its configurations, write their results."""
    pin(HOST_CORE)
    with open(path) as f:
        job = json.load(f)
    train_src = _open_spec(job["train"])
    val_src = _open_spec(job["val"])
    results = []
    with bar(len(job["configs"]) * job["epochs"], f"{job['point']}: offload", unit="epoch",
             enabled=job["progress"]) as b:
        job["tick"] = lambda: b.update(1)
        for config in job["configs"]:
            try:
                results.append(run_offload(job, train_src, val_src, config))
            except (ConfigError, ImportError, TypeError, AttributeError) as exc:
                if config == 4:
                    raise
                # Configurations whose feature this build lacks are reported, not faked.
                results.append({"config": config, "name": CONFIGS[config],
                                "skipped": f"{type(exc).__name__}: {exc}"})
    with open(job["out"], "w") as f:
        json.dump(results, f)


def mpi_worker():
    pin(PRODUCER_CORE)
    _torch()
    from ..worker import serve
    serve()


def _open_spec(spec):
    from ..sources import open_source
    return open_source(spec)


# -- report -----------------------------------------------------------------------------------

def summarize(point_results, point):
    """Ratios the targets are stated in, from one operating point's results."""
    by = {r["config"]: r for r in point_results if "skipped" not in r}
    out = {}
    if 5 in by:
        r5 = by[5]
        host_train = r5["compute_s"]
        producer = r5["producer_busy_s"] / max(1, r5["producers"])
        ideal = max(host_train, producer)
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
    lines = []
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


def plot_breakdown(results, path):
    """Stacked bars per configuration and operating point: host compute, host waiting for
    data, validation on the host's path, the rest — seconds per epoch."""
    from .plots import _pyplot

    plt = _pyplot()
    points = list(results["points"])
    fig, axes = plt.subplots(1, len(points), figsize=(6 * len(points), 4), squeeze=False)
    parts = (("compute_s", "host compute"), ("wait_s", "host waits for data"),
             ("val_host_s", "validation on host"), ("other_s", "other"))
    for ax, point in zip(axes[0], points):
        rs = [r for r in results["points"][point]["configs"] if "skipped" not in r]
        x = np.arange(len(rs))
        bottom = np.zeros(len(rs))
        for key, label in parts:
            v = np.array([r[key] / r["epochs_run"] for r in rs])
            ax.bar(x, v, bottom=bottom, label=label)
            bottom += v
        ax.set_xticks(x, [str(r["config"]) for r in rs])
        ax.set_xlabel("configuration")
        ax.set_ylabel("seconds per epoch")
        ax.set_title(point)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_timeline(result, path, title):
    """Per step: host compute and host wait as time spans on the host's row, and the
    producer's busy seconds for the batch that step consumed (drawn ending when it arrived)."""
    from .plots import _pyplot

    plt = _pyplot()
    tl = result["timeline"]
    fig, ax = plt.subplots(figsize=(10, 2.8))
    ax.broken_barh([(w, r - w) for w, r in zip(tl["wait_start"], tl["ready"])], (20, 8),
                   color="tab:orange", label="host waits")
    ax.broken_barh([(r, d - r) for r, d in zip(tl["ready"], tl["done"])], (20, 8),
                   color="tab:blue", label="host computes")
    if tl.get("producer_s"):
        ax.broken_barh([(r - p, p) for r, p in zip(tl["ready"], tl["producer_s"])], (8, 8),
                       color="tab:green", label="producer busy (per batch)")
    ax.set_yticks([12, 24], ["producer", "host"])
    ax.set_xlabel("seconds since start")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(results, outdir):
    os.makedirs(outdir, exist_ok=True)
    paths = [os.path.join(outdir, "breakdown.png")]
    plot_breakdown(results, paths[0])
    for point, res in results["points"].items():
        for r in res["configs"]:
            if r["config"] in (2, 5) and "skipped" not in r:
                p = os.path.join(outdir, f"timeline_{point}_config{r['config']}.png")
                plot_timeline(r, p, f"{point}, configuration {r['config']}: {r['name']}")
                paths.append(p)
    return paths


# -- entry point ------------------------------------------------------------------------------

def _defaults(args):
    quick = args.quick
    for name, full, small in (("epochs", 2, 2), ("steps", 24, 3), ("batch_size", 32, 8),
                              ("size", 160, 64)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
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
    if args.producers < 1:
        raise ConfigError("--producers must be >= 1")


def run(args):
    if args.mpi_worker:
        mpi_worker()
        return 0
    if args.mpi_host:
        mpi_host(args.mpi_host)
        return 0
    from .cli import write_json

    _defaults(args)
    torch = _torch()
    pin(HOST_CORE)
    t_start = now()
    train_src, val_of, data_desc = prepare_data(args)
    classes = int(train_src.labels.max()) + 1
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json == "-" \
        else (lambda *a: print(*a, flush=True))
    say(f"data: {data_desc}")
    calibration = calibrate(train_src, args, classes, args.quick)
    if val_of is None:
        vals = val_for_points(args, calibration)
        val_of = vals.__getitem__
    results = {"args": {k: v for k, v in vars(args).items() if k not in ("mpi_host",
                                                                            "mpi_worker")},
               "machine": {"cores": os.cpu_count(), "host_core": HOST_CORE,
                           "producer_core": PRODUCER_CORE, "torch": torch.__version__,
                           "torch_threads": torch.get_num_threads()},
               "recipe": Recipe(args.size, True).kind,
               "data": data_desc, "calibration": calibration, "points": {}}
    host_runs = {1: run_serial, 2: run_dataloader, 3: run_loader}
    for point in args.points:
        cal = calibration[point]
        val_src = val_of(point)
        job = {"point": point, "epochs": args.epochs, "steps": args.steps,
               "batch_size": args.batch_size, "size": args.size, "seed": args.seed,
               "lr": 0.05, "producers": args.producers,
               # The MPI job's stderr is a pipe; its bars show when ours would.
               "progress": not args.quiet and sys.stderr.isatty(),
               "model_kwargs": {"classes": classes, "width": cal["width"],
                                "blocks": cal["blocks"], "seed": args.seed},
               "train": train_src.spec(), "val": val_src.spec(), "val_count": len(val_src)}
        say(f"{point}: model width {cal['width']}, blocks {cal['blocks']}, "
            f"{len(val_src)} validation images")
        res = []
        host = [c for c in args.configs if c in HOST_CONFIGS]
        with bar(len(host) * args.epochs, f"{point}: host", unit="epoch",
                 enabled=not args.quiet) as b:
            job["tick"] = lambda: b.update(1)
            for c in host:
                res.append(host_runs[c](job, train_src, val_src))
        mpi = [c for c in args.configs if c in MPI_CONFIGS]
        if mpi:
            mjob = {k: v for k, v in job.items() if k != "tick"}
            mjob.update(configs=mpi, limit_s=3600)
            res += launch_mpi(mjob, args)
        for r in res:
            r["epochs_run"] = args.epochs
        results["points"][point] = {"configs": res, "summary": summarize(res, point),
                                    "val_count": len(val_src)}
    results["seconds"] = now() - t_start
    if args.json != "-":
        print(table(results), flush=True)
    if args.json:
        write_json(args.json, results)
    if args.plots:
        for p in write_plots(results, args.plots):
            print(f"wrote {p}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="dpu-pipe bench-train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
