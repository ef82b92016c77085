"""The benchmark harness of ``dpu-pipe bench``, ``dpu-pipe bench-train``, the demo and the
developer benchmarks under ``bench/``: throughput (JPEG bytes in memory, CPU pinning, methods
interleaved chunk by chunk and round by round) and training runs (a small ResNet fed by a
loader, timed per step, as a JSON-serialisable record; the offloaded configurations in an MPI
job, host rank on ``HOST_CORE``, producers on ``PRODUCER_CORE``).

A *job* is a dict describing a training run: ``epochs``, ``steps``, ``batch_size``, ``size``,
``seed``, ``lr``, ``model_kwargs``, ``train``/``val`` (source specs), ``val_count``,
``producers``, ``progress``, ``tick`` (called after each epoch). Configuration numbers are
those of :data:`CONFIGS`.
"""

import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import ConfigError
from .progress import bar

#: What :func:`load_buffers` takes for a JPEG file when it searches a directory.
JPEG_EXTENSIONS = (".jpeg", ".jpg", ".jpe", ".jfif")


# -- throughput benchmarks ----------------------------------------------------------------

def load_buffers(root, n=None):
    """Read up to ``n`` images (default: all) into memory; returns ``(paths, buffers)``.

    ``root`` is a directory (one made by :func:`~dpu_pipe.tools.sample_data.make_imagenet_like`
    is read in sample order; any other is searched recursively for :data:`JPEG_EXTENSIONS`
    files, in path order), a packed dataset or a file list (its samples in order, with the
    source's descriptions as paths).
    """
    from ..packed.reader import is_packed
    from .sample_data import MANIFEST_NAME, dataset_files

    if (Path(root) / MANIFEST_NAME).is_file():
        files = dataset_files(root)[0]
    elif Path(root).is_dir() and not is_packed(root):
        files = sorted(p for p in Path(root).rglob("*") if p.suffix.lower() in JPEG_EXTENSIONS)
    else:
        from ..sources import as_source
        src = as_source(root)
        count = len(src) if n is None else min(n, len(src))
        return [src.describe(i) for i in range(count)], [src.read(i) for i in range(count)]
    if not files:
        raise ConfigError(f"no JPEG files ({', '.join(JPEG_EXTENSIONS)}) in {root}")
    files = files[:n]
    return files, [f.read_bytes() for f in files]


def pin(cores, *, strict=True):
    """Restrict this process (its calling thread and the threads it starts later) to ``cores``:
    True for the last core it may use, None for every core of the machine, an int or ints for
    those; False, or an OS without an affinity call (not Linux), leaves the affinity alone.

    Cores this process may not use raise a ConfigError when ``strict`` (unless ``cores`` is
    None), else the request is ignored (a 1-core machine shares its core). Returns the previous
    affinity (what :func:`pinned` restores), or None when nothing changed.
    """
    if cores is False or not hasattr(os, "sched_setaffinity"):
        return None
    previous = os.sched_getaffinity(0)
    if cores is True:
        wanted = {max(previous)}
    elif cores is None:
        wanted = set(range(os.cpu_count() or 1))
    else:
        wanted = {cores} if isinstance(cores, int) else {int(c) for c in cores}
    try:
        os.sched_setaffinity(0, wanted)
    except (OSError, ValueError):
        if strict and cores is not None:
            raise ConfigError(f"cannot run on cores {sorted(wanted)}: this process may only "
                              f"run on {sorted(previous)}") from None
        return None
    return previous


@contextlib.contextmanager
def pinned(cores=True, *, strict=True):
    """``with pinned(cores) as allowed:`` :func:`pin` for the block, the affinity restored
    afterwards; ``allowed`` is the sorted list of cores the block may run on."""
    previous = pin(cores, strict=strict)
    try:
        yield (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else list(range(os.cpu_count() or 1)))
    finally:
        if previous is not None:
            os.sched_setaffinity(0, previous)


@contextlib.contextmanager
def one_core(core=True):
    """``with one_core():`` :func:`pinned` to ``core`` (False leaves the affinity alone) with
    OpenCV, when installed, on one thread; both restored afterwards. Yields the cores now
    allowed."""
    try:
        import cv2
        threads = cv2.getNumThreads()
        cv2.setNumThreads(1)
    except ImportError:
        cv2 = None
    try:
        with pinned(core) as cores:
            yield cores
    finally:
        if cv2 is not None:
            cv2.setNumThreads(threads)


def interleaved(methods, n, *, chunk, repeat, clock=time.perf_counter, before_round=None,
                progress=None):
    """Time methods that share the machine fairly: every round runs every method over items
    ``0..n-1``, the methods taking turns every ``chunk`` items (the first one rotating with
    the chunk and the round), so a burst of load from other processes falls on all of them
    alike. The garbage collector is off during a round (a collection would be charged to
    whichever method it lands in).

    Parameters
    ----------
    methods : dict
        name -> ``fn(start, stop)`` doing items ``start..stop-1``.
    n, chunk, repeat : int
        Items per round, items per turn, rounds.
    clock : callable
        Seconds (``time.thread_time`` counts this thread's CPU time only, which preemption on
        a loaded machine does not inflate).
    before_round, progress : callable, optional
        Called with the round's number before it (untimed) and after it.

    Returns
    -------
    dict
        name -> list of seconds, one per round.
    """
    names = list(methods)
    times = {name: [] for name in names}
    enabled = gc.isenabled()
    try:
        for r in range(repeat):
            if before_round is not None:
                before_round(r)
            gc.disable()
            spent = dict.fromkeys(names, 0.0)
            for c, start in enumerate(range(0, n, chunk)):
                k = (r + c) % len(names)
                for name in names[k:] + names[:k]:
                    t0 = clock()
                    methods[name](start, min(n, start + chunk))
                    spent[name] += clock() - t0
            if enabled:
                gc.enable()
            for name in names:
                times[name].append(spent[name])
            if progress is not None:
                progress(r)
    finally:
        if enabled:
            gc.enable()
    return times


def rate_stats(seconds, n):
    """``(median, slowest, fastest)`` items per second of rounds that took ``seconds`` each
    for ``n`` items."""
    rates = [n / t for t in seconds]
    return statistics.median(rates), min(rates), max(rates)


def median_time(fn, reps):
    """Median seconds of ``reps`` calls of ``fn()``."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# -- training runs ------------------------------------------------------------------------

#: The configurations a training run can be, by number (``dpu-pipe bench-train`` runs them all;
#: the demo runs 3 and 5). 1-2 are the baselines of :mod:`dpu_pipe.tools.baselines`; 4-6 run
#: in an MPI job (:func:`launch_mpi`).
CONFIGS = {
    1: "host serial + torchvision",
    2: "DataLoader(num_workers=1) + torchvision",
    3: "Loader on the host",
    4: "DPULoader offload, validation on host",
    5: "DPULoader offload + RemoteValidation",
    6: "DPULoader hybrid + RemoteValidation",
}
HOST_CORE, PRODUCER_CORE = 0, 1
MODEL = "dpu_pipe.models:resnet_tiny"
now = time.perf_counter


def load_torch():
    """torch, on one thread (or a ConfigError saying to install it)."""
    from ..evaluate import require_torch
    torch = require_torch()
    torch.set_num_threads(1)
    return torch


#: The training recipes ``bench-train --recipe`` compares: dpu_pipe's transform options
#: (``TransformConfig`` keywords; mixing also needs ``num_classes``) and what torchvision runs.
#: ``tv-new`` is torchvision's classification reference "new recipe" (TrivialAugmentWide,
#: RandomErasing 0.1, MixUp 0.2 / CutMix 1.0); ``vit`` the timm/DeiT one (bicubic, RandAugment
#: m9 — timm's mstd 0.5, which torchvision lacks, only in dpu_pipe —, ColorJitter 0.4,
#: RandomErasing 0.25, MixUp 0.8 / CutMix 1.0).
RECIPES = {
    "classic": {},
    "tv-new": {"auto_augment": "ta_wide", "random_erase": 0.1, "mixup_alpha": 0.2,
               "cutmix_alpha": 1.0},
    "vit": {"interpolation": "bicubic", "auto_augment": "ra", "ra_magnitude": 9,
            "ra_mstd": 0.5, "color_jitter": (0.4, 0.4, 0.4, 0.0), "random_erase": 0.25,
            "mixup_alpha": 0.8, "cutmix_alpha": 1.0},
}


def recipe_options(name, num_classes):
    """dpu_pipe's transform keywords for training recipe ``name`` (see :data:`RECIPES`)."""
    if name not in RECIPES:
        raise ConfigError(f"unknown recipe {name!r}; choose one of {sorted(RECIPES)}")
    opts = dict(RECIPES[name])
    if opts.get("mixup_alpha") or opts.get("cutmix_alpha"):
        opts["num_classes"] = int(num_classes)
    return opts


def train_options(job):
    """The job's training recipe as dpu_pipe transform keywords."""
    return recipe_options(job.get("recipe", "classic"), job["model_kwargs"]["classes"])


class Run:
    """One configuration's training run: the model, its optimizer, the per-step timeline
    and per-epoch accuracy."""

    def __init__(self, job, config):
        from ..models import resnet_tiny

        torch = self.torch = load_torch()
        self.job, self.config = job, config
        self.model = resnet_tiny(**job["model_kwargs"])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=job["lr"], momentum=0.9)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.t0 = now()
        #: per step: seconds since start at wait start, batch in hand, step done; producer s.
        self.timeline = {"wait_start": [], "ready": [], "done": [], "producer_s": []}
        self.val_host_s = 0.0
        self.epochs = []           # per epoch: {"epoch", "count", "top1", "loss", "known_at"}

    def train_epoch(self, batches, producer_s=None):
        """Consume ``job["steps"]`` batches of ``batches`` (an iterable of (images, labels))
        with one optimizer step each. ``producer_s()``, when given, returns the producers'
        cumulative busy seconds (sampled per step for the timeline)."""
        tl, steps = self.timeline, self.job["steps"]
        self.model.train()
        done = 0
        before = producer_s() if producer_s else 0.0
        t = now()
        for done, (images, labels) in enumerate(batches, 1):
            t1 = now()
            self.opt.zero_grad()
            self.loss_fn(self.model(images), self.torch.as_tensor(labels)).backward()
            self.opt.step()
            t2 = now()
            tl["wait_start"].append(t - self.t0)
            tl["ready"].append(t1 - self.t0)
            tl["done"].append(t2 - self.t0)
            if producer_s:
                cur = producer_s()
                tl["producer_s"].append(cur - before)
                before = cur
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

    def record(self, epoch, result):
        self.epochs.append({"epoch": epoch, "count": result["count"],
                            "top1": result["top1"], "loss": result["loss"],
                            "known_at": now() - self.t0})

    def result(self, extra):
        """The run's record: seconds (wall, per epoch, computing, waiting, validating on the
        host, the rest), images/s, accuracy per epoch, the timeline; ``extra`` added."""
        tl, k = self.timeline, self.job["steps"]
        wall = now() - self.t0
        compute = float(sum(d - r for d, r in zip(tl["done"], tl["ready"])))
        wait = float(sum(r - w for r, w in zip(tl["ready"], tl["wait_start"])))
        images = k * self.job["epochs"] * self.job["batch_size"]
        # Seconds of the training loops alone (first wait to last step, per epoch).
        train_s = float(sum(tl["done"][e + k - 1] - tl["wait_start"][e]
                            for e in range(0, len(tl["done"]), k)))
        epochs = sorted(self.epochs, key=lambda e: e["epoch"])
        return {"config": self.config, "name": CONFIGS[self.config],
                "wall_s": wall, "epoch_s": wall / self.job["epochs"],
                "images_per_s": images / wall, "compute_s": compute, "wait_s": wait,
                "wait_share": wait / wall, "val_host_s": self.val_host_s, "train_s": train_s,
                "other_s": max(0.0, wall - compute - wait - self.val_host_s),
                "epochs": epochs, "timeline": tl,
                "final_top1": epochs[-1]["top1"] if epochs else None,
                "time_to_accuracy_s": epochs[-1]["known_at"] if epochs else None, **extra}


def run_loader(job, train_src, val_src):
    """Configuration 3: dpu_pipe's Loader, its thread on the host's core."""
    from ..loader import Loader

    run = Run(job, 3)
    kw = dict(size=job["size"], seed=job["seed"], output="torch", num_threads=1)
    train = Loader(train_src, job["batch_size"], train=True, **kw, **train_options(job))
    val = Loader(val_src, job["batch_size"], train=False, shuffle=False, drop_last=False, **kw)

    def made(loader):
        s = loader.stats()
        return s["read_s"] + s["process_s"]

    with train, val:
        for epoch in range(job["epochs"]):
            train.set_epoch(epoch)
            run.train_epoch(train, producer_s=lambda: made(train))
            val.set_epoch(0)
            run.validate_host(epoch, val)
            job["tick"]()
        busy = made(train) + made(val)
    return run.result({"producer_busy_s": busy, "producers": 0})


def _producer_s(stats):
    """The producers' busy seconds in a DPULoader's stats."""
    return sum(stats.get(f"producer_{k}_s", 0.0) for k in ("read", "process", "publish"))


class _Remote:
    """The epochs whose remote validation is pending, collected as they come in."""

    def __init__(self, run, rv, extra):
        self.run, self.rv, self.extra, self.pending = run, rv, extra, []
        extra.update(remote_val_s=0.0, remote_val_cpu_s=0.0)

    def submit(self, epoch):
        t = now()
        self.pending.append((epoch, self.rv.submit(self.run.model.state_dict(), tag=epoch)))
        self.run.val_host_s += now() - t
        self.collect(False)

    def collect(self, block):
        """Results that are in (with ``block``, all of them: the last epoch's validation has
        no training left to hide behind, so its wait is the run's drain)."""
        while self.pending and (block or self.pending[0][1].done()):
            epoch, fut = self.pending.pop(0)
            t = now()
            res = fut.result(timeout=600)
            waited = now() - t
            self.run.val_host_s += waited
            self.extra["drain_s"] += waited if block else 0.0
            self.run.record(epoch, res)
            self.extra["remote_val_s"] += sum(p["seconds"] for p in res["by_rank"])
            self.extra["remote_val_cpu_s"] += sum(p["cpu_s"] for p in res["by_rank"])


def run_offload(job, train_src, val_src, config):
    """Configurations 4-6 on the host rank of an MPI job whose producers are pinned to
    ``PRODUCER_CORE``."""
    from ..loader import DPULoader
    from ..offload.validation import RemoteValidation

    run = Run(job, config)
    extra = {"producers": job["producers"], "drain_s": 0.0}
    kw = dict(size=job["size"], seed=job["seed"], output="torch")
    if config == 6:
        kw["host_threads"] = 1
    train = DPULoader(train_src, job["batch_size"], train=True,
                      mode="hybrid" if config == 6 else "offload", **kw, **train_options(job))
    val = rv = remote = None
    try:
        if config == 4:
            val = DPULoader(val_src, job["batch_size"], train=False, shuffle=False,
                            drop_last=False, **kw)
        else:
            rv = RemoteValidation(val_src, job["batch_size"], model=MODEL,
                                  model_kwargs=job["model_kwargs"], size=job["size"],
                                  topk=(1, 5))
            remote = _Remote(run, rv, extra)
        for epoch in range(job["epochs"]):
            train.set_epoch(epoch)
            run.train_epoch(train, producer_s=lambda: _producer_s(train.stats()))
            if val is not None:
                val.set_epoch(0)
                run.validate_host(epoch, val)
            else:
                remote.submit(epoch)
            job["tick"]()
        if remote is not None:
            remote.collect(True)
        stats = train.stats()
        extra["train_stats"] = {k: v for k, v in stats.items()
                                if isinstance(v, (int, float, dict))}
        # CPU seconds for validation: its wall seconds include the batch making it yields to.
        extra["producer_busy_s"] = _producer_s(stats) + extra.get("remote_val_cpu_s", 0.0) \
            + (_producer_s(val.stats()) if val is not None else 0.0)
        if config == 6:
            extra["made_by"] = {k: v for k, v in stats.items() if "made" in k}
    finally:
        for closeable in (train, val, rv):
            if closeable is not None:
                closeable.close()
    return run.result(extra)


# -- MPI jobs ---------------------------------------------------------------------------------

def launch_mpi(job, configs, limit_s):
    """Run ``configs`` (4-6) of ``job`` in one MPI job (host rank on ``HOST_CORE``,
    ``job["producers"]`` ranks on ``PRODUCER_CORE``) within ``limit_s`` seconds; returns their
    records."""
    from ..mpi import mpiexec_path

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "job.json")
        job = {k: v for k, v in job.items() if k != "tick"}
        job.update(configs=configs, out=os.path.join(tmp, "result.json"))
        with open(path, "w") as f:
            json.dump(job, f)
        me = [sys.executable, "-m", "mpi4py", "-m", "dpu_pipe.tools.harness"]
        cmd = [mpiexec_path(), "-n", "1", *me, "--mpi-host", path, ":",
               "-n", str(job["producers"]), *me, "--mpi-worker"]
        # The ranks import this dpu_pipe, installed or not.
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        paths = [here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
        proc = subprocess.run(cmd, env=env, timeout=limit_s)
        if proc.returncode != 0 or not os.path.exists(job["out"]):
            raise ConfigError(f"the offload run failed (exit {proc.returncode}); its output "
                              "is above")
        with open(job["out"]) as f:
            return json.load(f)


def mpi_host(path):
    """The host rank of an offload job: run its configurations, write their results."""
    from ..sources import open_source

    pin(HOST_CORE, strict=False)
    with open(path) as f:
        job = json.load(f)
    train_src, val_src = open_source(job["train"]), open_source(job["val"])
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
    """A producer rank of an offload job."""
    from ..worker import serve

    pin(PRODUCER_CORE, strict=False)
    load_torch()
    serve()


if __name__ == "__main__":
    # The ranks launch_mpi starts: --mpi-host JOB_PATH or --mpi-worker.
    if sys.argv[1:2] == ["--mpi-worker"]:
        mpi_worker()
    else:
        mpi_host(sys.argv[2])
