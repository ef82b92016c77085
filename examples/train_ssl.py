"""Self-supervised pretraining, DINO style, with DistributedDataParallel and dpu_pipe's views.

Each image gives two global views and ``--local-crops`` local views (``dpu_pipe.views.dino``:
DINO's multi-crop recipe, every view cut from one decode of the image). A student network sees
every view; a teacher, the exponential moving average of the student, sees the two global views;
the loss is the cross-entropy between the teacher's centred, sharpened distribution and the
student's, over every (global view, other view) pair, as in Caron et al., "Emerging Properties
in Self-Supervised Vision Transformers" (2021). The backbone is a ``dpu_pipe.models`` ResNet or
a torchvision model, the head a small MLP.

The multi-view recipe is the most CPU-hungry one people train with: offloaded, the producers
make the views and the host only trains. Like examples/train_imagenet.py, the batches are made
on the host (``--mode local``), on DPU producer ranks (``offload``) or both (``hybrid``)::

    mpiexec -n 2 python -m mpi4py examples/train_ssl.py --train T --mode offload \\
        : -n 4 python -m mpi4py -m dpu_pipe.worker

A checkpoint (student, teacher, centre, optimizer, every rank's loader position, the epoch's
partial sums) is written every epoch and on SIGTERM/SIGUSR1; ``--resume`` continues from it
with the weights an uninterrupted run would have, bit for bit. ``--json PATH`` keeps one
record per epoch. See docs/guides/recipes.md ("Views").
"""
import argparse
import copy
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import dpu_pipe
from dpu_pipe import distributed as dpu_dist
from dpu_pipe import evaluate, models, views
from dpu_pipe.sources import as_source

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_imagenet import (Stopper, add_run_options, gather, learning_rate,  # noqa: E402
                            pick_device, restore_loader, save_checkpoint, write_json)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", required=True, help="ImageFolder dir, packed dataset, ...")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64, help="images per host rank")
    p.add_argument("--global-size", type=int, default=224, help="global views (pixels)")
    p.add_argument("--local-size", type=int, default=96, help="local views (pixels)")
    p.add_argument("--local-crops", type=int, default=8, help="local views per image")
    p.add_argument("--arch", default="resnet50",
                   help="a dpu_pipe.models factory (resnet_tiny) or a torchvision model name")
    p.add_argument("--width", type=int, default=16, help="resnet_tiny's first-stage width")
    p.add_argument("--out-dim", type=int, default=4096, help="prototypes of the head")
    p.add_argument("--lr", type=float, default=0.0005, help="peak learning rate (AdamW, cosine)")
    p.add_argument("--weight-decay", type=float, default=0.04)
    p.add_argument("--teacher-momentum", type=float, default=0.996)
    p.add_argument("--teacher-temp", type=float, default=0.04)
    p.add_argument("--student-temp", type=float, default=0.1)
    p.add_argument("--center-momentum", type=float, default=0.9)
    add_run_options(p)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a batch may take")
    return p.parse_args(argv)


def build_student(args):
    """Backbone (its classifier dropped) + MLP head to ``--out-dim`` logits; the same weights
    on every rank (seeded)."""
    if hasattr(models, args.arch):
        net = getattr(models, args.arch)(classes=1, width=args.width, seed=args.seed)
        backbone = torch.nn.Sequential(*list(net)[:-1])     # up to the pooled features
        dim = net[-1].in_features
    else:
        torch.manual_seed(args.seed)
        backbone = evaluate.load_factory(f"torchvision.models:{args.arch}")()
        dim = backbone.fc.in_features
        backbone.fc = torch.nn.Identity()
    torch.manual_seed(args.seed + 1)
    head = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(),
                               torch.nn.Linear(2 * dim, args.out_dim))
    return torch.nn.Sequential(backbone, head)


def forward_views(net, images):
    """Logits (sum of batch sizes, out_dim) of every view, views of one size in one pass (the
    global views, then the local ones), in view order."""
    out, start = [], 0
    while start < len(images):
        stop = start
        while stop < len(images) and images[stop].shape[-2:] == images[start].shape[-2:]:
            stop += 1
        out.append(net(torch.cat(images[start:stop])))
        start = stop
    return torch.cat(out)


class SSLTraining:
    """One run: student (DDP), teacher, centre, optimizer, loader; :meth:`run` trains from the
    start or from a checkpoint."""

    def __init__(self, args):
        self.args = args
        info = dpu_dist.init_process_group()
        self.rank, self.world = info.rank, info.world_size
        self.device = pick_device(args, info.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.student = build_student(args).to(self.device)
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.ddp = DistributedDataParallel(
            self.student, device_ids=[self.device.index] if self.device.type == "cuda"
            else None)
        self.opt = torch.optim.AdamW(self.student.parameters(), lr=args.lr,
                                     weight_decay=args.weight_decay)
        self.center = torch.zeros(1, args.out_dim, device=self.device)
        self.views = views.dino(global_size=args.global_size, local_size=args.local_size,
                                local_crops=args.local_crops)
        self.loader = dpu_pipe.Loader(
            as_source(args.train), args.batch_size, views=self.views, mode=args.mode,
            seed=args.seed, num_threads=args.threads, host_threads=max(1, args.threads),
            output="torch", device=self.device if self.device.type == "cuda" else None,
            timeout=args.timeout)
        self.full_steps = len(self.loader)
        self.ckpt = os.path.join(args.checkpoint, "last.pt") if args.checkpoint else None
        self.records = []
        self.stopper = Stopper(args.stop_after_steps)
        self.stopping = False

    # --- the DINO objective ---------------------------------------------------------------

    def loss(self, images):
        a = self.args
        n = images[0].shape[0]
        student = forward_views(self.ddp, images) / a.student_temp
        with torch.no_grad():
            teacher = forward_views(self.teacher, images[:2])
            targets = F.softmax((teacher - self.center) / a.teacher_temp, dim=-1).chunk(2)
        logp = F.log_softmax(student, dim=-1).chunk(len(images))
        total, pairs = 0.0, 0
        for t, q in enumerate(targets):
            for v, lp in enumerate(logp):
                if v != t:          # a global view is not compared with itself
                    total = total + torch.sum(-q * lp, dim=-1).mean()
                    pairs += 1
        self.update_center(teacher, n)
        return total / pairs

    @torch.no_grad()
    def update_center(self, teacher, n):
        """EMA of the teacher's mean output over every rank's global views."""
        batch = teacher.sum(dim=0, keepdim=True)
        dist.all_reduce(batch)
        batch /= 2 * n * self.world
        self.center.mul_(self.args.center_momentum).add_(batch,
                                                         alpha=1 - self.args.center_momentum)

    @torch.no_grad()
    def update_teacher(self):
        m = self.args.teacher_momentum
        for ps, pt in zip(self.student.parameters(), self.teacher.parameters()):
            pt.mul_(m).add_(ps.detach(), alpha=1 - m)
        for bs, bt in zip(self.student.buffers(), self.teacher.buffers()):
            bt.copy_(bs)

    # --- checkpoints ----------------------------------------------------------------------

    def resume(self):
        """(start epoch, the epoch's partial sums) of the checkpoint, or of a fresh start."""
        if not (self.args.resume and self.ckpt and os.path.exists(self.ckpt)):
            return 0, None
        state = torch.load(self.ckpt, map_location=self.device, weights_only=False)
        self.student.load_state_dict(state["student"])
        self.teacher.load_state_dict(state["teacher"])
        self.center.copy_(state["center"])
        self.opt.load_state_dict(state["optimizer"])
        partial = restore_loader(self.loader, state, self.rank, self.world)
        self.records = state["records"]
        return self.loader.epoch, partial

    def checkpoint(self, epoch, partial_now):
        loaders, partials = gather(self.loader.state_dict()), gather(partial_now)
        if self.rank == 0 and self.ckpt:
            os.makedirs(self.args.checkpoint, exist_ok=True)
            save_checkpoint(self.ckpt, {
                "student": self.student.state_dict(), "teacher": self.teacher.state_dict(),
                "center": self.center, "optimizer": self.opt.state_dict(), "loader": loaders,
                "partial": partials, "records": list(self.records), "epoch": epoch,
                "args": vars(self.args)})
        dist.barrier()

    # --- training -------------------------------------------------------------------------

    def train_epoch(self, epoch, steps, partial):
        """Train the rest of ``epoch``: its sums ``(loss, images, wait s, train s)``, or None
        when the run stopped mid-epoch (checkpoint written)."""
        loss_sum, seen, wait_s, train_s = partial if partial else (0.0, 0, 0.0, 0.0)
        skipped = self.full_steps - steps
        it = iter(self.loader)
        for step in range(self.loader.state_dict()["step"], steps):
            t0 = time.perf_counter()
            images, _ = next(it)
            t1 = time.perf_counter()
            for g in self.opt.param_groups:
                g["lr"] = learning_rate(self.args, epoch, skipped + step, self.full_steps)
            loss = self.loss(images)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.update_teacher()
            n = int(images[0].shape[0])
            loss_sum += float(loss.detach()) * n
            seen += n
            wait_s += t1 - t0
            train_s += time.perf_counter() - t0
            if self.stopper.should_stop(self.device):
                self.stopping = True
                if step + 1 < steps:
                    self.checkpoint(epoch, (loss_sum, seen, wait_s, train_s))
                    return None
        next(it, None)              # ends the epoch: the loader's position moves to the next
        return loss_sum, seen, wait_s, train_s

    def end_epoch(self, epoch, sums):
        sums = torch.tensor(sums, dtype=torch.float64, device=self.device)
        dist.all_reduce(sums)
        loss_all, seen_all, wait_all, train_all = sums.tolist()
        record = {"epoch": epoch, "train_loss": loss_all / seen_all,
                  "img_per_s": seen_all / (train_all / self.world),
                  "views_per_s": seen_all * len(self.views) / (train_all / self.world),
                  "data_wait_share": wait_all / train_all, "world_size": self.world}
        self.records.append(record)
        if self.rank == 0:
            print(json.dumps(record), flush=True)
            if self.args.json:
                write_json(self.args.json, self.records)
        self.checkpoint(epoch + 1, None)

    def finish(self, final):
        if final and self.rank == 0 and self.ckpt:
            weights = {k: v.cpu() for k, v in self.teacher.state_dict().items()}
            torch.save(weights, os.path.join(self.args.checkpoint, "final_teacher.pt"))
        elif not final and self.rank == 0:
            print("stopped; checkpoint saved", flush=True)
        self.loader.close()
        dist.destroy_process_group()
        return 0

    def run(self):
        start_epoch, partial = self.resume()
        self.ddp.train()
        for epoch in range(start_epoch, self.args.epochs):
            self.loader.set_epoch(epoch)
            sums = self.train_epoch(epoch, len(self.loader), partial)
            partial = None
            if sums is None:
                return self.finish(False)
            self.end_epoch(epoch, sums)
            if self.stopping:
                return self.finish(False)
        return self.finish(True)


def main(argv=None):
    return SSLTraining(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
