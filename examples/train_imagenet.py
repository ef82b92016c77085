"""ImageNet-style training with DistributedDataParallel and dpu_pipe: the reference script.

The same file runs on a laptop's CPU (gloo) and on GPU nodes (NCCL, AMP, channels_last), with
the batches made on the host (``--mode local``), on DPU producer ranks (``offload``) or both
(``hybrid``). Offloaded, hosts and producers are one MPMD job::

    mpiexec -n 2 python -m mpi4py examples/train_imagenet.py --train T --val V --mode offload \\
        : -n 4 python -m mpi4py -m dpu_pipe.worker

Local mode also runs under ``torchrun --nproc_per_node 2 examples/train_imagenet.py ...``
or as a single ``python examples/train_imagenet.py ...``. See docs/guides/training.md.

Each epoch: train (DDP), then validate — on the producers with
:class:`~dpu_pipe.RemoteValidation` (the snapshot is evaluated while the next epoch trains;
its result is collected at the end of that epoch), or on the host in local mode (exact over the
ranks). A checkpoint (model, optimizer, AMP scaler, every rank's loader position, the
epoch's partial sums) is written every epoch and when SIGTERM or SIGUSR1 arrives (Slurm's
preemption signals; the ranks agree on the step to stop at), and ``--resume`` continues from
it with the same weights an uninterrupted run would have. ``--json PATH`` keeps one record per
epoch.

Progressive resolution, FFCV's knobs: ``--min-res 160 --max-res 192 --start-ramp 65
--end-ramp 76 --val-res 256`` trains at 160 px up to epoch 65, at 192 px from epoch 76 and in
between at the linear ramp rounded to a multiple of 32 (:func:`dpu_pipe.progressive_size`);
validation runs at ``--val-res``. The schedule is part of the loader's stream, so a
checkpoint resumes at the size its epoch has.
"""
import argparse
import json
import math
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import dpu_pipe
from dpu_pipe import distributed as dpu_dist
from dpu_pipe import evaluate, models
from dpu_pipe.offload.group import started_group
from dpu_pipe.sources import as_source

try:
    from tqdm import tqdm
except ImportError:    # the bar is a nicety
    tqdm = None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", required=True, help="training set: ImageFolder dir or packed")
    p.add_argument("--val", required=True, help="validation set: ImageFolder dir or packed")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=256, help="per host rank")
    p.add_argument("--val-batch-size", type=int, default=None,
                   help="default: --batch-size")
    p.add_argument("--size", type=int, default=224,
                   help="training crop (pixels), and the default of the four below")
    p.add_argument("--min-res", type=int, default=None,
                   help="progressive resolution (FFCV's): training size up to --start-ramp")
    p.add_argument("--max-res", type=int, default=None,
                   help="progressive resolution: training size from --end-ramp on")
    p.add_argument("--start-ramp", type=int, default=0, metavar="EPOCH",
                   help="last epoch at --min-res (default 0)")
    p.add_argument("--end-ramp", type=int, default=0, metavar="EPOCH",
                   help="first epoch at --max-res (default 0; an epoch <= --start-ramp "
                        "stays at --min-res, as in FFCV)")
    p.add_argument("--val-res", type=int, default=None, help="validation size (pixels)")
    p.add_argument("--arch", default="resnet50",
                   help="a dpu_pipe.models factory (resnet_tiny) or a torchvision model name")
    p.add_argument("--width", type=int, default=16, help="resnet_tiny's first-stage width")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate (cosine decay)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--label-smoothing", type=float, default=0.0)
    add_run_options(p)
    p.add_argument("--amp", action="store_true", help="mixed precision (CUDA)")
    p.add_argument("--log-every", type=int, default=50, metavar="N",
                   help="interval log on rank 0 every N steps (0: never)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a batch or a validation result may take")
    return p.parse_args(argv)


def add_run_options(p):
    """The options of a run that every training example takes: seed, where the batches are
    made, device, checkpoints and the record file."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=("local", "offload", "hybrid"), default="local")
    p.add_argument("--threads", type=int, default=1,
                   help="threads decoding on the host (local mode, hybrid's host threads)")
    p.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK when available")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="write DIR/last.pt every epoch and on SIGTERM/SIGUSR1")
    p.add_argument("--resume", action="store_true", help="continue from DIR/last.pt")
    p.add_argument("--stop-after-steps", type=int, default=None, metavar="N",
                   help="save a checkpoint after N steps of this run and exit 0")
    p.add_argument("--json", default=None, metavar="PATH", help="one record per epoch")


def build_model(args, classes):
    """The model and the ``"module:factory"`` + arguments producers rebuild it from."""
    if hasattr(models, args.arch):
        spec = f"dpu_pipe.models:{args.arch}"
        kwargs = {"classes": classes, "width": args.width, "seed": args.seed}
    else:
        spec = f"torchvision.models:{args.arch}"
        kwargs = {"num_classes": classes}
        torch.manual_seed(args.seed)
    return evaluate.load_factory(spec)(**kwargs), spec, kwargs


def train_size(args):
    """The training loader's ``size``: ``--size``, or with ``--min-res``/``--max-res`` FFCV's
    progressive schedule over ``--start-ramp`` .. ``--end-ramp``."""
    if args.min_res is None and args.max_res is None:
        return args.size
    return dpu_pipe.progressive_size(args.min_res or args.size, args.max_res or args.size,
                                     args.start_ramp, args.end_ramp)


def learning_rate(args, epoch, step, steps):
    """Cosine decay over the whole run, a pure function of the position (nothing to save)."""
    t = (epoch * steps + step) / max(1, args.epochs * steps)
    return 0.5 * args.lr * (1 + math.cos(math.pi * t))


class Stopper:
    """SIGTERM/SIGUSR1 (Slurm preemption) and --stop-after-steps: every rank stops after the
    same step, agreed with one tiny all-reduce per step."""

    def __init__(self, limit):
        self.limit = limit
        self.steps = 0
        self.signalled = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        self.signalled = True

    def should_stop(self, device):
        self.steps += 1
        flag = torch.tensor([1 if self.signalled else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item()) or (self.limit is not None and self.steps >= self.limit)


def validate_on_host(model, loader, device):
    """Exact metrics of the whole validation set over every rank: each rank evaluates its
    shard — the same number of batches on every rank, the padding rows not counted
    (``Loader(train=False)``'s ``shard_tail="mask"``) — the sums are added with one
    all-reduce."""
    model.eval()
    m = evaluate.evaluate_loader(model, loader, device=device)
    # On the training device: NCCL reduces CUDA tensors only.
    sums = torch.tensor([m.count, m.loss_sum, m.correct[1], m.correct[5]], dtype=torch.float64,
                        device=device)
    dist.all_reduce(sums)
    count, loss, c1, c5 = sums.tolist()
    model.train()
    return {"count": int(count), "loss": loss / count, "top1": c1 / count, "top5": c5 / count}


def save_checkpoint(path, state):
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def restore_loader(loader, state, rank, world):
    """Put ``loader`` where a checkpoint left it and return this rank's partial epoch sums
    (None at an epoch's start). ``state["loader"]`` and ``state["partial"]`` hold every rank's,
    gathered. A job of another size (a node lost or added) shards the rest of the saved epoch
    over this job's ranks, each sample once; its partial sums go to rank 0."""
    if len(state["loader"]) == world:
        loader.load_state_dict(state["loader"][rank])
        return state["partial"][rank]
    loader.load_state_dict(state["loader"], elastic=True)
    parts = [p for p in state["partial"] if p is not None]
    if not parts:
        return None
    return tuple(map(sum, zip(*parts))) if rank == 0 else (0.0, 0, 0.0, 0.0)


def write_json(path, obj):
    """Replace ``path`` with ``obj`` as JSON in one rename (a reader never sees half)."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def pick_device(args, local_rank):
    if args.device:
        device = torch.device(args.device)
        # "cuda" alone means this rank's GPU: torch.cuda.set_device needs the index.
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", local_rank)
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class Training:
    """One run: the model, its optimizer and AMP scaler, the loaders, the epoch records and
    the remote validation in flight; :meth:`run` trains from the start or from a checkpoint."""

    def __init__(self, args):
        self.args = args
        info = dpu_dist.init_process_group()
        self.rank, self.world = info.rank, info.world_size
        self.device = device = pick_device(args, info.local_rank)
        self.cuda = cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(device)
            torch.backends.cudnn.benchmark = True
        train_src, val_src = as_source(args.train), as_source(args.val)
        classes = len(train_src.classes) if train_src.classes \
            else int(train_src.labels.max()) + 1
        model, spec, model_kwargs = build_model(args, classes)
        self.model = model.to(device, memory_format=torch.channels_last if cuda
                              else torch.contiguous_format)
        self.ddp = DistributedDataParallel(self.model,
                                           device_ids=[device.index] if cuda else None)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr,
                                   momentum=args.momentum, weight_decay=args.weight_decay)
        self.scaler = torch.amp.GradScaler("cuda", enabled=args.amp and cuda)
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
        out = dict(output="torch", device=device if cuda else None, timeout=args.timeout,
                   memory_format=torch.channels_last if cuda else None)
        self.size = train_size(args)
        val_size = args.val_res or args.size
        self.loader = dpu_pipe.Loader(train_src, args.batch_size, mode=args.mode,
                                      size=self.size, seed=args.seed, num_threads=args.threads,
                                      host_threads=max(1, args.threads), **out)
        group = started_group()     # init_process_group started it in an MPI job
        self.producers = int(sum(gather(group.producers if group is not None else 0)))
        vbs = args.val_batch_size or args.batch_size
        self.remote = self.val_loader = None
        if args.mode != "local" and self.producers:
            self.remote = dpu_pipe.RemoteValidation(
                val_src, vbs, model=spec, model_kwargs=model_kwargs, size=val_size,
                timeout=args.timeout)
        else:
            self.val_loader = dpu_pipe.Loader(val_src, vbs, train=False, size=val_size, **out)
        self.full_steps = len(self.loader)   # of a whole epoch: the schedule's unit
        self.ckpt = os.path.join(args.checkpoint, "last.pt") if args.checkpoint else None
        self.records = []
        self.stopper = Stopper(args.stop_after_steps)
        self.stopping = False
        self.pending = None     # (record, future) of the remote validation in flight

    # --- checkpoints ----------------------------------------------------------------------

    def resume(self):
        """``(start epoch, the epoch's partial sums, the record whose validation was in
        flight)`` of the checkpoint, or of a fresh start."""
        if not (self.args.resume and self.ckpt and os.path.exists(self.ckpt)):
            return 0, None, None
        state = torch.load(self.ckpt, map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        partial = restore_loader(self.loader, state, self.rank, self.world)
        self.records = state["records"]
        return self.loader.epoch, partial, state["pending_record"]

    def checkpoint(self, epoch, partial_now, pending_record=None):
        loaders, partials = gather(self.loader.state_dict()), gather(partial_now)
        if self.rank == 0 and self.ckpt:
            os.makedirs(self.args.checkpoint, exist_ok=True)
            save_checkpoint(self.ckpt, {
                "model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "scaler": self.scaler.state_dict(), "loader": loaders, "partial": partials,
                "records": list(self.records), "pending_record": pending_record,
                "epoch": epoch, "args": vars(self.args)})
        dist.barrier()

    def stop(self, epoch, step):
        if self.rank == 0:
            print(f"stopped after epoch {epoch} step {step + 1}; checkpoint saved", flush=True)
        return self.close()

    def close(self):
        """Close the loaders and the remote validation, then the process group."""
        for part in (self.loader, self.val_loader, self.remote):
            if part is not None:
                part.close()
        dist.destroy_process_group()
        return 0

    # --- validation and records -----------------------------------------------------------

    def validate(self, record):
        """Validate the current weights for ``record``: submitted to the producers (result
        collected later by finish_pending), or evaluated here."""
        if self.remote is not None:
            self.pending = (record, self.remote.submit(self.model.state_dict(),
                                                       tag=record["epoch"]))
            if self.stopping:
                self.finish_pending()
            return
        self.log_record(record, validate_on_host(self.model, self.val_loader, self.device))

    def finish_pending(self):
        if self.pending is not None:
            (record, fut), self.pending = self.pending, None
            self.log_record(record, fut.result())

    def log_record(self, record, metrics):
        record.update(val_top1=metrics["top1"], val_top5=metrics["top5"],
                      val_loss=metrics["loss"], val_count=metrics["count"])
        self.records.append(record)
        if self.rank == 0:
            print(json.dumps(record), flush=True)
            if self.args.json:
                write_json(self.args.json, self.records)

    # --- training -------------------------------------------------------------------------

    def train_step(self, images, labels, lr):
        for g in self.opt.param_groups:
            g["lr"] = lr
        with torch.autocast(self.device.type,
                            dtype=torch.float16 if self.cuda else torch.bfloat16,
                            enabled=self.args.amp):
            loss = self.criterion(self.ddp(images), labels)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        return loss

    def log_interval(self, epoch, step, steps, loss):
        if self.args.log_every and (step + 1) % self.args.log_every == 0 and self.rank == 0:
            s = self.loader.stats(interval=True)     # rates since the previous log line
            print(f"epoch {epoch} step {step + 1}/{steps}: loss {loss.item():.4f}, "
                  f"{s['img_per_s'] * self.world:.1f} img/s, data wait "
                  f"{s['data_wait_share']:.1%}, batch makers busy "
                  f"{s['producer_busy_share']:.0%}, bad samples {s['bad_samples']}",
                  flush=True)

    def train_epoch(self, epoch, steps, partial):
        """Train the rest of ``epoch`` (``steps`` batches in all): its sums ``(loss, samples,
        wait s, train s)``, or None when the run stopped mid-epoch (checkpoint written)."""
        loader = self.loader
        loss_sum, seen, wait_s, train_s = partial if partial else (0.0, 0, 0.0, 0.0)
        skipped = self.full_steps - steps
        first = loader.state_dict()["step"]
        it = iter(loader)
        bar = tqdm(total=steps, initial=first, desc=f"epoch {epoch}", unit="step",
                   disable=None if self.rank == 0 else True) if tqdm else None
        for step in range(first, steps):
            t0 = time.perf_counter()
            images, labels = next(it)
            t1 = time.perf_counter()
            loss = self.train_step(images, labels, learning_rate(
                self.args, epoch, skipped + step, self.full_steps))
            n = int(labels.shape[0])
            loss_sum += float(loss.detach()) * n
            seen += n
            wait_s += t1 - t0
            train_s += time.perf_counter() - t0
            if bar is not None:
                bar.update(1)
            self.log_interval(epoch, step, steps, loss)
            if self.stopper.should_stop(self.device):
                self.stopping = True
                if step + 1 < steps:
                    # Mid-epoch: the snapshot in validation is older than these weights,
                    # so its result goes into the checkpoint first.
                    self.finish_pending()
                    self.checkpoint(epoch, (loss_sum, seen, wait_s, train_s))
                    self.stop(epoch, step)
                    return None
        if bar is not None:
            bar.close()
        next(it, None)              # ends the epoch: the loader's position moves to the next
        return loss_sum, seen, wait_s, train_s

    def end_epoch(self, epoch, sums):
        """All-reduce the epoch's sums into its record, validate, write the checkpoint."""
        sums = torch.tensor(sums, dtype=torch.float64, device=self.device)   # NCCL: on the GPU
        dist.all_reduce(sums)
        loss_all, seen_all, wait_all, train_all = sums.tolist()
        record = {"epoch": epoch, "train_loss": loss_all / seen_all,
                  "img_per_s": seen_all / (train_all / self.world),
                  "data_wait_share": wait_all / train_all,
                  "world_size": self.world, "producers": self.producers}
        self.finish_pending()
        if self.remote is None or self.stopping:
            self.validate(record)
            self.checkpoint(epoch + 1, None)
        else:
            # These weights are the snapshot: a run resumed from this checkpoint submits it
            # again if its result never arrived.
            self.checkpoint(epoch + 1, None, pending_record=record)
            self.validate(record)

    def run(self):
        start_epoch, partial, resubmit = self.resume()
        if resubmit is not None:
            self.validate(resubmit)     # the checkpoint's weights are that epoch's snapshot
        self.ddp.train()
        for epoch in range(start_epoch, self.args.epochs):
            self.loader.set_epoch(epoch)    # keeps a restored position within this epoch
            steps = len(self.loader)        # fewer in an epoch continued by an elastic resume
            if isinstance(self.size, dpu_pipe.ProgressiveSize) and self.rank == 0:
                side = self.size.size_at(epoch)
                print(f"epoch {epoch}: training at {side}x{side}", flush=True)
            sums = self.train_epoch(epoch, steps, partial)
            partial = None
            if sums is None:
                return 0
            self.end_epoch(epoch, sums)
            if self.stopping:
                return self.stop(epoch, steps - 1)
        self.finish_pending()
        if self.rank == 0 and self.ckpt:
            final = {k: v.cpu() for k, v in self.model.state_dict().items()}
            torch.save(final, os.path.join(self.args.checkpoint, "final_weights.pt"))
        return self.close()


def main(argv=None):
    return Training(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
