"""Host side of the DPULoader scenarios, run under mpiexec (MPMD) by ``test_offload.py``::

    mpiexec -n H python -m mpi4py tests/mpi/offload_host.py SCENARIO ... \\
          : -n P python -m mpi4py -m dpu_pipe.worker

Scenarios (each host rank runs the same one):

``stream``
    For every slot count of ``--slots``: a DPULoader over ``--epochs`` epochs, each batch
    compared bit for bit with the local :class:`~dpu_pipe.Loader` built with the same
    arguments in this process; per epoch the labels of all hosts (label = sample index in
    the datasets of ``tests/helpers.py``'s ``make_dataset``) are gathered over a
    communicator of the host ranks only and must cover the dataset exactly once. Epoch 1 of
    the first slot count is consumed in two ``for`` loops (break, then continue). ``--local`` and ``--torch`` add
    one epoch of ``mode="local"`` and of ``output="torch"``.
    Then one epoch of batch 5, ``drop_last=False`` (a short last batch), float32 HWC, the
    validation transform.
``resume``
    Consume ``--take`` batches (optionally after ``--load`` of a state file), save them to an
    ``.npz``, write ``state_dict()`` as JSON; without ``--take``, consume up to the end of
    epoch ``--epochs - 1``.
``bad``
    ``on_error="skip"`` stream against the Loader's, with the bad-sample records; then
    ``on_error="raise"``: the DecodeError is recorded (with what a further ``next()`` on the
    same iterator raises) and re-raised (the job must fail).
``kill``
    After ``--kill-after`` batches the host sends ``--signal`` (KILL, or STOP for a hung
    producer) to one ``dpu_pipe.worker`` rank of this job (a child of the same MPI process
    manager) and keeps consuming; the error that ends it is recorded and re-raised.
``labels``
    FileLists over the dataset's files with float, multi-label and multi-float labels (each
    unique to its sample) and a metadata column, ``on_error="skip"``, ``return_meta=True``:
    offload and hybrid DPULoaders equal to the Loader in images, labels and metadata, batch
    by batch, over an epoch and a mid-epoch resume in a new loader; each row's metadata
    names the sample whose label the row carries.
``interleave``
    Mid-epoch validation: after 3 training batches a second DPULoader (validation transform)
    is iterated to its end, then training continues; both streams checked against the Loader.

Every host writes ``<out>/host<i>.json`` (results) or ``<out>/error<i>.json`` (the exception
that ended it) and prints ``OK host=<i>`` on success.

``worker`` is not a host scenario: it runs ``python -m dpu_pipe.worker`` with a random delay
of up to ``--delay`` seconds before each batch, for slow-producer tests.
"""
import argparse
import json
import logging
import os
import random
import signal
import sys
import time
import traceback

import numpy as np


# --- label lists (also used by the test process, which must not import mpi4py.MPI) ---------

def label_lists(src):
    """{kind: FileList} over the files of ``src`` with labels of another kind, each one unique
    to its sample (so a label names its sample), and a ``caption`` metadata column."""
    from dpu_pipe.sources import FileList

    n = len(src)
    kinds = {"float": [i + 0.25 for i in range(n)],
             "multi": [(i, i % 3, -i) for i in range(n)],
             "multi-float": [(0.5 * i, -i) for i in range(n)]}
    paths = [src.describe(i) for i in range(n)]
    return {kind: FileList([(p, lab, f"sample {i}") for i, (p, lab) in
                            enumerate(zip(paths, labels))], meta_columns=["caption"])
            for kind, labels in kinds.items()}


def check_meta(meta, ref, src, labels, where):
    """``meta`` equals the Loader's ``ref``, and names for each row the sample whose label
    the row carries (``labels``, as yielded)."""
    index = as_numpy(meta["index"])
    assert np.array_equal(index, as_numpy(ref["index"])), \
        f"{where}: indices {index.tolist()}, Loader gives {as_numpy(ref['index']).tolist()}"
    assert np.array_equal(as_numpy(meta["valid"]), as_numpy(ref["valid"])), \
        f"{where}: valid rows differ"
    assert {k: v for k, v in meta.items() if k not in ("index", "valid")} == \
        {k: v for k, v in ref.items() if k not in ("index", "valid")}, f"{where}: metadata differs"
    assert np.array_equal(src.labels[index], as_numpy(labels)), f"{where}: index vs label"
    assert meta["caption"] == [f"sample {i}" for i in index.tolist()], where
    assert meta["path"] == [src.relpath(i) for i in index.tolist()], where


# --- helpers ----------------------------------------------------------------------------------

def loader_kwargs(args):
    return dict(size=args.size, dtype=args.dtype, seed=args.seed, **json.loads(args.recipe))


def as_numpy(x):
    return x.numpy() if hasattr(x, "numpy") and not isinstance(x, np.ndarray) else x


def check_same(got, ref, where):
    x, y = (as_numpy(v) for v in got)
    u, v = ref
    assert x.dtype == u.dtype and x.shape == u.shape, \
        f"{where}: images {x.dtype}{x.shape}, Loader gives {u.dtype}{u.shape}"
    assert np.array_equal(y, v), f"{where}: labels {y.tolist()}, Loader gives {v.tolist()}"
    if not np.array_equal(x, u):
        bad = np.flatnonzero(x.reshape(-1) != u.reshape(-1))
        raise AssertionError(f"{where}: {bad.size} image values differ from the Loader's, "
                             f"first at flat index {bad[0]}")


def reference_epochs(src, batch_size, epochs, **kw):
    """The local Loader's stream, copied: [[(images, labels)] per epoch]."""
    from dpu_pipe import Loader

    with Loader(src, batch_size, **kw) as ref:
        return [[(x.copy(), y.copy()) for x, y in ref] for _ in range(epochs)]


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class Hosts:
    """This host's place among the host ranks, and a communicator of the hosts only (the
    producers never call into it). In the MPMD launch the hosts are world ranks 0..H-1."""

    def __init__(self, loader):
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        self.index = loader._group.host_index
        self.count = loader._group.num_hosts
        assert self.index == world.Get_rank(), "hosts must be the first ranks of the launch"
        group = world.Get_group().Incl(list(range(self.count)))
        self.comm = world.Create_group(group, tag=77)
        group.Free()

    def all_labels(self, labels):
        """Every host's labels of an epoch, concatenated in host order."""
        return [v for part in self.comm.allgather(list(labels)) for v in part]


def write_json(path, data):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def record_error(args, host, exc, **extra):
    notes = list(getattr(exc, "__notes__", []))
    cause = exc.__cause__
    write_json(os.path.join(args.out, f"error{host}.json"), {
        "type": type(exc).__name__, "message": str(exc), "notes": notes,
        "index": getattr(exc, "index", None), "path": getattr(exc, "path", None),
        "cause_type": type(cause).__name__ if cause is not None else None,
        "cause_producer": getattr(cause, "producer", None),
        "traceback": traceback.format_exc(), **extra})


# --- scenarios --------------------------------------------------------------------------------

def run_stream(args, src, warnings):
    from dpu_pipe import DPULoader

    kw = loader_kwargs(args)
    n = len(src)
    result = {"runs": []}
    hosts = None
    ref = None
    for k, slots in enumerate(args.slots):
        t0 = time.monotonic()
        dl = DPULoader(src, args.batch, slots=slots, liveness_timeout=args.liveness, **kw)
        if hosts is None:
            hosts = Hosts(dl)
            result.update(host=hosts.index, hosts=hosts.count, mode=dl.mode)
            ref = reference_epochs(src, args.batch, args.epochs, rank=hosts.index,
                                   world_size=hosts.count, **kw)
        assert dl.maker.sampler.rank == hosts.index
        assert dl.maker.sampler.world_size == hosts.count
        assert len(dl) == len(ref[0]), (len(dl), len(ref[0]))
        for e in range(args.epochs):
            assert dl.epoch == e
            labels = []

            def take(limit=None):
                for x, y in dl:
                    step = len(labels) // args.batch
                    check_same((x, y), ref[e][step], f"slots={slots} epoch {e} step {step}")
                    labels.extend(as_numpy(y).tolist())
                    if args.sleep:
                        time.sleep(args.sleep)      # "training"
                    if limit is not None and step + 1 == limit:
                        break

            if k == 0 and e == 1:
                take(limit=3)                       # break mid-epoch ...
                assert dl.epoch == 1 and dl.state_dict()["step"] == 3
            take()                                  # ... and continue where it stopped
            assert len(labels) == len(ref[e]) * args.batch, (e, len(labels))
            assert dl.epoch == e + 1
            everyone = hosts.all_labels(labels)
            assert sorted(everyone) == list(range(n)), \
                f"epoch {e}: samples not delivered exactly once over the hosts: {sorted(everyone)}"
        s = dl.stats()
        run = {"slots": slots, "seconds": round(time.monotonic() - t0, 3), "mode": dl.mode,
               "batches": s.get("batches"), "bytes_received": s.get("bytes_received"),
               "steps_per_producer": s.get("steps_per_producer"),
               "producer_process_s": s.get("producer_process_s"), "wait_s": s["wait_s"]}
        if dl.mode == "offload":
            assert s["batches"] == args.epochs * len(dl), s
            assert sum(s["steps_per_producer"].values()) == s["batches"], s
            assert s["bytes_received"] >= s["batches"] * args.batch * dl.transform.sample_bytes
            assert s["producer_process_s"] > 0, s
        result["runs"].append(run)
        dl.close()
    # Partial last batch (drop_last=False), float32 HWC, validation transform, other batch size.
    other = dict(kw, dtype="float32", layout="HWC", train=False, drop_last=False)
    ref_other = reference_epochs(src, 5, 1, rank=hosts.index, world_size=hosts.count, **other)[0]
    got, counted = [], []
    with DPULoader(src, 5, slots=2, **other) as dl:
        for x, y in dl:
            got.append((x.copy(), y.copy()))
            counted += y[:dl.valid_rows].tolist()   # train=False: the padding does not count
    assert len(got) == len(ref_other), (len(got), len(ref_other))
    for j, b in enumerate(got):
        check_same(b, ref_other[j], f"float32 HWC drop_last=False step {j}")
    everyone = hosts.all_labels(counted)
    assert sorted(everyone) == list(range(n)), f"drop_last=False: {sorted(everyone)}"
    result["partial_batch"] = [len(y) for _, y in got]
    if args.local:
        with DPULoader(src, args.batch, mode="local", **kw) as dl:
            # Documented default shard: this host's index among the hosts, and their count.
            result["local_default_shard"] = [dl.maker.sampler.rank,
                                             dl.maker.sampler.world_size]
        with DPULoader(src, args.batch, mode="local", rank=hosts.index,
                       world_size=hosts.count, **kw) as dl:
            assert dl.mode == "local"
            for e in range(2):
                got = [(x.copy(), y.copy()) for x, y in dl]
                assert len(got) == len(ref[e])
                for j, b in enumerate(got):
                    check_same(b, ref[e][j], f"mode=local epoch {e} step {j}")
        result["local_checked"] = True
    if args.torch:
        import torch

        with DPULoader(src, args.batch, output="torch", **kw) as dl:
            j = 0
            for x, y in dl:
                assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                assert y.dtype == torch.int64
                check_same((x, y), ref[0][j], f"torch epoch 0 step {j}")
                j += 1
            assert j == len(ref[0])
        result["torch_checked"] = True
    result["warnings"] = list(warnings.messages)
    return result


def run_resume(args, src, warnings):
    from dpu_pipe import DPULoader

    dl = DPULoader(src, args.batch, slots=args.slots[0], **loader_kwargs(args))
    if args.load:
        with open(args.load) as f:
            dl.load_state_dict(json.load(f))
    start = dl.state_dict()
    images, labels, where = [], [], []
    done = (lambda: len(images) == args.take) if args.take else (lambda: dl.epoch >= args.epochs)
    while not done():
        for x, y in dl:
            where.append((dl.epoch, dl.state_dict()["step"] - 1))
            images.append(np.array(x))
            labels.append(np.array(y))
            if args.take and len(images) == args.take:
                break
    np.savez(os.path.join(args.out, "batches0.npz"), images=np.stack(images),
             labels=np.stack(labels), where=np.array(where))
    write_json(os.path.join(args.out, "state0.json"), dl.state_dict())
    result = {"start": start, "end": dl.state_dict(), "batches": len(images),
              "steps_per_producer": dl.stats().get("steps_per_producer")}
    if args.close:
        dl.close()
    return result


def run_bad(args, src, warnings):
    from dpu_pipe import DecodeError, DPULoader, DpuPipeError, Loader

    kw = loader_kwargs(args)
    bad = set(args.bad)
    result = {}
    # on_error="skip": same stream as the Loader's, full batches, the bad files recorded.
    ref_loader = Loader(src, args.batch, on_error="skip", **kw)
    ref = [[(x.copy(), y.copy()) for x, y in ref_loader] for _ in range(args.epochs)]
    with DPULoader(src, args.batch, on_error="skip", slots=args.slots[0], **kw) as dl:
        for e in range(args.epochs):
            j = 0
            for x, y in dl:
                assert len(y) == (args.batch if j + 1 < len(ref[e]) else len(ref[e][j][1]))
                assert not bad & set(y.tolist()), f"a bad sample was delivered: {y.tolist()}"
                check_same((x, y), ref[e][j], f"skip epoch {e} step {j}")
                j += 1
            assert j == len(ref[e])
        result["skip_bad_samples"] = {int(i): m for i, m in dl.bad_samples.items()}
        result["loader_bad_samples"] = {int(i): m for i, m in ref_loader.bad_samples.items()}
        result["skip_warnings"] = [m for m in warnings.messages if "skipped" in m]
    ref_loader.close()
    # on_error="raise": the Loader's batches up to the bad one, then the same DecodeError.
    expected = None
    ref_batches = []
    try:
        for x, y in Loader(src, args.batch, **kw):
            ref_batches.append((x.copy(), y.copy()))
    except DecodeError as exc:
        expected = exc
    assert expected is not None, "the Loader did not raise on the bad file"
    result["expected"] = {"step": len(ref_batches), "index": expected.index,
                          "path": expected.path}
    write_json(os.path.join(args.out, "host0.json"), result)
    dl = DPULoader(src, args.batch, on_error="raise", slots=args.slots[0], **kw)
    it = iter(dl)
    j = 0
    try:
        for x, y in it:
            check_same((x, y), ref_batches[j], f"raise epoch 0 step {j}")
            j += 1
    except DecodeError as exc:
        # Asking the same iterator again: the Loader answers with a ProducerError.
        try:
            next(it)
            again = None
        except Exception as exc2:  # noqa: BLE001 - recorded for the test
            again = exc2
        record_error(args, 0, exc, step=j,
                     again_type=type(again).__name__ if again is not None else None,
                     again_is_dpu_pipe_error=isinstance(again, DpuPipeError))
        raise
    raise AssertionError("DPULoader(on_error='raise') went through a bad file")


def run_labels(args, src, warnings):
    from dpu_pipe import DPULoader, Loader

    kw = dict(loader_kwargs(args), on_error="skip", return_meta=True)
    bad = set(args.bad)
    runs = []
    for kind, lst in label_lists(src).items():
        with Loader(lst, args.batch, **kw) as ref_loader:
            ref = [[(x.copy(), y.copy(), m) for x, y, m in ref_loader] for _ in range(2)]
        for mode in ("offload", "hybrid"):
            where = f"{kind} {mode}"
            got = []
            # Two host threads in hybrid mode: bad files either of them meets are reported.
            extra = {"host_threads": 2} if mode == "hybrid" else {}
            with DPULoader(lst, args.batch, mode=mode, slots=args.slots[0], **extra,
                           **kw) as dl:
                got += [(0, (x.copy(), y, m)) for x, y, m in dl]
                for x, y, m in dl:             # epoch 1: broken off after 2 batches
                    got.append((1, (x.copy(), y, m)))
                    if len(got) == len(ref[0]) + 2:
                        state = dl.state_dict()
                        break
                stats = dl.stats()
                skipped = sorted(dl.bad_samples)       # an epoch meets every bad file
            with DPULoader(lst, args.batch, mode=mode, slots=args.slots[0], **extra,
                           **kw) as dl:
                dl.load_state_dict(state)      # a new loader resumes epoch 1
                got += [(1, (x.copy(), y, m)) for x, y, m in dl]
                stats2 = dl.stats()
            want = [(e, b) for e in range(2) for b in ref[e]]
            assert len(got) == len(want), (where, len(got), len(want))
            seen = []
            for j, ((e, (x, y, m)), (_, (u, v, rm))) in enumerate(zip(got, want)):
                check_same((x, y), (u, v), f"{where} batch {j}")
                assert y.dtype == lst.labels.dtype and y.shape[1:] == lst.labels.shape[1:]
                check_meta(m, rm, lst, y, f"{where} batch {j}")
                seen += as_numpy(m["index"]).tolist()
            assert not bad & set(seen), f"{where}: a bad sample was delivered"
            runs.append({"kind": kind, "mode": mode, "batches": len(got),
                         "skipped": skipped,
                         "samples": stats["samples"] + stats2["samples"],
                         "host_samples": stats["host_samples"] + stats2["host_samples"],
                         "producer_samples": stats["producer_samples"]
                         + stats2["producer_samples"]})
    return {"runs": runs}


def run_interleave(args, src, warnings):
    """Two DPULoaders sharing the producers: validation in the middle of a training epoch (a
    second DPULoader iterated to its end while the first one's iteration is open, then the
    first one continues), then whole epochs of each in turn."""
    from dpu_pipe import DPULoader

    kw = loader_kwargs(args)
    val_kw = dict(kw, train=False, shuffle=False)
    ref_train = reference_epochs(src, args.batch, 2, **kw)
    ref_val = reference_epochs(src, args.batch, 1, **val_kw)[0]
    opts = dict(slots=args.slots[0], timeout=args.timeout, liveness_timeout=args.liveness)
    train = DPULoader(src, args.batch, **opts, **kw)
    val = DPULoader(src, args.batch, **opts, **val_kw)
    t0 = time.monotonic()
    j = vals = 0

    def validate():
        k = 0
        for vx, vy in val:
            check_same((vx, vy), ref_val[k], f"val step {k}")
            k += 1
        assert k == len(ref_val), k
        return 1

    try:
        for epoch in range(2):
            j = 0
            for x, y in train:
                check_same((x, y), ref_train[epoch][j], f"train epoch {epoch} step {j}")
                j += 1
                if epoch == 0 and j == 3:
                    vals += validate()
            assert j == len(ref_train[epoch]), j
            vals += validate()
    except Exception as exc:
        record_error(args, 0, exc, train_steps=j, seconds=time.monotonic() - t0)
        raise
    return {"train_steps": j, "val_steps": len(ref_val), "validations": vals}


def sibling_pids(match):
    """Sorted pids of the other processes started by this rank's parent (the MPI process
    manager of this job on this node) whose argv (a list of bytes) satisfies ``match``."""
    me, parent = os.getpid(), os.getppid()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and match(argv):
            pids.append(int(entry))
    return sorted(pids)


def job_workers():
    """pids of the ``dpu_pipe.worker`` ranks of this job (plain, or this file's delaying
    ``worker`` wrapper)."""
    return sibling_pids(lambda argv: b"dpu_pipe.worker" in argv or (
        any(c.endswith(b"offload_host.py") for c in argv) and b"worker" in argv))


def run_kill(args, src, warnings):
    from dpu_pipe import DPULoader

    dl = DPULoader(src, args.batch, slots=args.slots[0], liveness_timeout=args.liveness,
                   **loader_kwargs(args))
    consumed = 0
    killed = None

    def kill():
        workers = job_workers()
        assert workers, "no dpu_pipe.worker process found in this job"
        write_json(os.path.join(args.out, "killed.json"),
                   {"pid": workers[-1], "workers": workers, "after": consumed,
                    "signal": args.signal})
        os.kill(workers[-1], getattr(signal, f"SIG{args.signal}"))
        return workers[-1], time.monotonic()

    try:
        for e in range(args.epochs):
            if args.between and e == 1:
                killed = kill()     # between two epochs: the host is not in next()
                time.sleep(args.sleep)
            for x, y in dl:
                consumed += 1
                if not args.between and not args.no_signal and consumed == args.kill_after:
                    killed = kill()
                time.sleep(args.sleep)
    except Exception as exc:
        record_error(args, 0, exc, consumed=consumed, killed_pid=killed and killed[0],
                     seconds_after_kill=killed and time.monotonic() - killed[1])
        raise
    return {"consumed": consumed, "killed": killed and killed[0], "no_error": True}


def run_matrix(args, src, warnings):
    """For slots {1, 3} x modes {offload, hybrid}: one DPULoader over 3 epochs with a
    set_epoch jump (epoch 0, then 5 from a break mid-epoch, then 2) and a mid-epoch resume
    (load_state_dict of a state saved 4 batches in, also across loaders), each batch equal
    to the Loader's and each epoch's labels exactly once."""
    from dpu_pipe import DPULoader, Loader

    kw = loader_kwargs(args)
    ref = Loader(src, args.batch, **kw)

    def epoch_of(e, start=0):
        ref.set_epoch(e)
        out = [(x.copy(), y.copy()) for x, y in ref]
        return out[start:]

    runs = []
    for mode in ("offload", "hybrid"):
        for slots in (1, 3):
            dl = DPULoader(src, args.batch, mode=mode, slots=slots, **kw)
            where = f"{mode} slots={slots}"
            got = {}
            # epoch 0 in full; epoch 5 by a jump, broken off after 4 batches (state saved);
            # epoch 2 by a jump; then the saved state resumed to the end of epoch 5.
            for e, stop in ((0, None), (5, 4), (2, None)):
                dl.set_epoch(e)
                batches = []
                for x, y in dl:
                    batches.append((x.copy(), y.copy()))
                    if stop is not None and len(batches) == stop:
                        state = dl.state_dict()
                        break
                got[e] = batches
            dl.load_state_dict(state)
            got["5-rest"] = [(x.copy(), y.copy()) for x, y in dl]
            assert dl.epoch == 6, dl.epoch
            for key, start, e in ((0, 0, 0), (5, 0, 5), (2, 0, 2), ("5-rest", 4, 5)):
                want = epoch_of(e, start)
                if key == 5:
                    want = want[:4]
                assert len(got[key]) == len(want), (where, key, len(got[key]), len(want))
                for j, (b, w) in enumerate(zip(got[key], want)):
                    check_same(b, w, f"{where} epoch {key} batch {j}")
            for e, labels in ((0, got[0]), (2, got[2]), (5, got[5] + got["5-rest"])):
                flat = sorted(v for _, y in labels for v in y.tolist())
                assert flat == list(range(len(src))), f"{where} epoch {e}: not exactly once"
            s = dl.stats()
            runs.append({"mode": mode, "slots": slots, "host_samples": s["host_samples"],
                         "producer_samples": s["producer_samples"]})
            dl.close()
    return {"runs": runs}


def run_mix(args, src, warnings):
    """A mixing recipe (``--recipe``; num_classes defaults to the dataset's size, a class per
    sample) in offload and hybrid mode: every batch of two epochs equal to the Loader's,
    images and float32 labels, each sample once per epoch; then, per mode, a batch_hook that
    raises: the error the host raises names the hook and the batch."""
    from dpu_pipe import DPULoader, Loader
    from dpu_pipe.errors import DpuPipeError

    kw = dict(loader_kwargs(args), return_meta=True)
    kw.setdefault("num_classes", len(src))

    def stream(loader):
        out = []
        for e in range(args.epochs):
            loader.set_epoch(e)
            out.append([(x.copy(), y.copy(), np.array(m["index"])) for x, y, m in loader])
        return out

    with Loader(src, args.batch, **kw) as ref:
        want = stream(ref)
    runs, errors = [], {}
    for mode in ("offload", "hybrid"):
        with DPULoader(src, args.batch, mode=mode, **kw) as dl:
            got = stream(dl)
            s = dl.stats()
        for e, (g, w) in enumerate(zip(got, want)):
            assert len(g) == len(w), (mode, e, len(g), len(w))
            for j, (b, r) in enumerate(zip(g, w)):
                check_same(b[:2], r[:2], f"{mode} epoch {e} batch {j}")
                assert b[1].dtype == np.float32 and b[1].shape[1] == kw["num_classes"]
            flat = sorted(v for b in g for v in b[2].tolist())
            assert flat == list(range(len(src))), f"{mode} epoch {e}: not exactly once"
        runs.append({"mode": mode, "host_samples": s["host_samples"],
                     "producer_samples": s["producer_samples"]})
        bad = dict(kw, batch_hook="tests.batch_hooks:always_fails")
        t0 = time.monotonic()
        with DPULoader(src, args.batch, mode=mode, **bad) as dl:
            try:
                next(iter(dl))
                errors[mode] = None
            except DpuPipeError as exc:
                errors[mode] = {"type": type(exc).__name__, "message": str(exc),
                                "seconds": time.monotonic() - t0}
    return {"runs": runs, "errors": errors}


def run_concurrency(args, src, warnings):
    """Batches/s of a DPULoader whose producers take ``--fixed-delay`` s per batch (the
    worker wrapper), the host consuming as fast as it can, after one warm-up batch."""
    from dpu_pipe import DPULoader

    dl = DPULoader(src, args.batch, slots=args.slots[0], **loader_kwargs(args))
    it = iter(dl)
    next(it)
    t0 = time.monotonic()
    count = 0
    for _ in range(args.epochs):
        for x, y in it:
            count += 1
        it = iter(dl)
    seconds = time.monotonic() - t0
    stats = dl.stats()
    return {"batches": count, "seconds": seconds, "rate": count / seconds,
            "steps_per_producer": stats["steps_per_producer"], "polls": stats["host_polls"],
            "all_batches": stats["batches"]}


def run_misc(args, src, warnings):
    """The request channel (ping, an unknown kind), the last batch read after the loop, and a
    host holding the GIL in a C call while the producers fill the window."""
    import ctypes

    from dpu_pipe import DPULoader, Loader
    from dpu_pipe.offload.group import host_group
    from dpu_pipe.offload.transport import RemoteError

    kw = loader_kwargs(args)
    dl = DPULoader(src, args.batch, slots=args.slots[0], **kw)
    ref = Loader(src, args.batch, **kw)
    result = {}
    t = host_group().transport
    replies = t.request("ping", {"x": [1, 2, 3]})
    result["ping"] = [r.result(timeout=10) for r in replies]
    if args.bulk:
        # A generator handler fed by a bulk point-to-point transfer, while batches flow.
        data = np.arange(3_000_000, dtype=np.float64)
        replies = t.request("bulk-sum", {"n": data.size, "tag": 77})
        sends = [t.comm.Isend(data, dest=r.to, tag=77) for r in replies]
        it = iter(dl)
        made = sum(1 for _ in zip(range(5), it))
        result["bulk"] = [r.result(timeout=30) for r in replies]
        result["bulk_expected"] = float(data.sum())
        result["batches_meanwhile"] = made
        for s_ in sends:
            s_.Wait()
        # Back to the start of epoch 0 for the checks below (set_epoch(0) would keep the
        # position: epoch 0 is the current one).
        dl.load_state_dict(dict(dl.state_dict(), step=0))
    try:
        t.request("no-such-kind", None, to=1).result(timeout=10)
        result["unknown"] = None
    except RemoteError as exc:
        result["unknown"] = {"message": str(exc), "producer": exc.producer,
                             "traceback": exc.remote_traceback}
    for e in range(2):
        for (x, y), (u, v) in zip(dl, ref):
            pass
        # After the loop: the last yielded batch is still the Loader's last batch.
        check_same((x, y), (u, v), f"last batch of epoch {e} after the loop")
    result["last_batch_checked"] = True
    # The GIL held for 2 s in one C call (PyDLL keeps it), no MPI call meanwhile.
    it = iter(dl)
    next(it)
    before = sum(t.state(tk) == "ready" for tk, _, _ in dl._engine.pending)
    ctypes.PyDLL(None).sleep(2)
    t.win.Sync()
    for tk, _, _ in dl._engine.pending:
        tt = t.tickets[tk]
        if tt.ready is None and tt.buffer >= 0:
            t._read_header(tt)
    result["ready_before_hold"] = before
    result["ready_after_hold"] = sum(t.state(tk) == "ready" for tk, _, _ in dl._engine.pending)
    result["granted"] = sum(t.tickets[tk].buffer >= 0 for tk, _, _ in dl._engine.pending)
    for (x, y), (u, v) in zip(it, [(u.copy(), v.copy()) for u, v in ref][1:]):
        check_same((x, y), (u, v), "after the GIL hold")
    dl.close()
    return result


def run_takeover(args, src, warnings):
    """Hybrid mode: SIGSTOP one producer (mid-epoch after ``--kill-after`` batches, or between
    epochs with ``--between``), go on: every epoch equals the Loader's and delivers every
    sample once; SIGCONT it two epochs later (its late Puts must land nowhere that matters)
    and check two more epochs."""
    from dpu_pipe import DPULoader

    kw = loader_kwargs(args)
    ref = reference_epochs(src, args.batch, args.epochs, **kw)
    dl = DPULoader(src, args.batch, mode="hybrid", host_threads=1, slots=args.slots[0],
                   liveness_timeout=args.liveness, **kw)
    stopped = None
    consumed = 0
    for e in range(args.epochs):
        if args.between and e == 1:
            stopped = job_workers()[-1]
            os.kill(stopped, signal.SIGSTOP)
        if stopped and e == 3:
            os.kill(stopped, signal.SIGCONT)
        if args.no_signal and stopped is None:
            stopped = job_workers()[-1]      # the slow one (last world rank), not stopped
        labels = []
        for j, (x, y) in enumerate(dl):
            check_same((x, y), ref[e][j], f"hybrid epoch {e} step {j}")
            labels.extend(y.tolist())
            consumed += 1
            if not args.between and not args.no_signal and consumed == args.kill_after:
                stopped = job_workers()[-1]
                os.kill(stopped, signal.SIGSTOP)
            time.sleep(args.sleep)
        assert sorted(labels) == list(range(len(src))), f"epoch {e}: not exactly once"
    s = dl.stats()
    dl.close()
    return {"stopped": stopped, "host_samples": s["host_samples"],
            "producer_samples": s["producer_samples"],
            "steps_per_producer": s["steps_per_producer"],
            "takeover_warnings": [w for w in warnings.messages if "takes over" in w]}


def run_hybrid_stats(args, src, warnings):
    """Hybrid mode with three host threads and slow producers: the loader's stats count the
    samples and seconds of every host thread, as counted here around each make()."""
    import threading

    from dpu_pipe import DPULoader, batch

    made = {}                       # thread id -> samples made on this host
    make = batch.BatchMaker.make

    def counted(self, *a, **kw):
        n = make(self, *a, **kw)
        made[threading.get_ident()] = made.get(threading.get_ident(), 0) + n
        return n

    batch.BatchMaker.make = counted
    kw = loader_kwargs(args)
    ref = reference_epochs(src, args.batch, 1, **kw)
    made.clear()                    # the reference was made on this host too
    dl = DPULoader(src, args.batch, mode="hybrid", host_threads=3, slots=args.slots[0], **kw)
    for j, (x, y) in enumerate(dl):
        check_same((x, y), ref[0][j], f"hybrid step {j}")
    threads = list(dl._engine.threads)
    dl.close()
    for th in threads:              # every make() counted on both sides before the stats
        th.join(timeout=60)
    s = dl.stats()
    batch.BatchMaker.make = make
    return {"samples": s["samples"], "producer_samples": s["producer_samples"],
            "host_samples": s["host_samples"], "made_here": sum(made.values()),
            "threads_that_made": len(made), "read_s": s["read_s"],
            "process_s": s["process_s"]}


def run_close_early(args, src, warnings):
    """Two batches, then close() and leave: the producers must stop and the job end."""
    from dpu_pipe import DPULoader

    dl = DPULoader(src, args.batch, slots=args.slots[0], **loader_kwargs(args))
    it = iter(dl)
    next(it)
    next(it)
    dl.close()
    return {"workers": job_workers()}


def run_worker(args):
    """``python -m dpu_pipe.worker`` with a delay before each batch: random up to
    ``--delay`` s, or exactly ``--fixed-delay`` s."""
    from dpu_pipe import batch, worker
    from mpi4py import MPI

    rng = random.Random(1234 + MPI.COMM_WORLD.Get_rank())
    produce = batch.BatchMaker.make

    made = [0]
    intervals = []      # (start, end) of each batch made, CLOCK_MONOTONIC (node-wide)

    def slow_produce(self, *a, **kw):
        made[0] += 1
        start = time.monotonic()
        if args.slow_rank == MPI.COMM_WORLD.Get_rank() and made[0] == 5:
            time.sleep(args.slow_delay)      # one batch far slower than the others'
        time.sleep(args.fixed_delay or rng.uniform(0, args.delay))
        try:
            return produce(self, *a, **kw)
        finally:
            intervals.append((start, time.monotonic()))

    batch.BatchMaker.make = slow_produce

    from dpu_pipe.worker import handler

    @handler("bulk-sum")
    def bulk_sum(ctx, payload):
        """Receive ``payload["n"]`` float64 by a non-blocking receive, in pieces between
        batches, and return their sum."""
        buf = np.empty(payload["n"], np.float64)
        req = ctx.comm.Irecv(buf, source=0, tag=payload["tag"])
        while not req.Test():
            yield
        return float(buf.sum())
    worker.serve()
    if args.intervals:
        write_json(os.path.join(args.intervals, f"made{MPI.COMM_WORLD.Get_rank()}.json"),
                   intervals)


SCENARIOS = {"stream": run_stream, "resume": run_resume, "bad": run_bad, "kill": run_kill,
             "interleave": run_interleave, "matrix": run_matrix, "mix": run_mix, "labels": run_labels, "concurrency": run_concurrency, "misc": run_misc,
             "takeover": run_takeover, "close-early": run_close_early,
             "hybrid-stats": run_hybrid_stats}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=[*SCENARIOS, "worker"])
    ap.add_argument("--data", help="dataset: a path open_path takes, or a source spec (JSON)")
    ap.add_argument("--out", help="directory for results")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--dtype", default="uint8")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--recipe", default="{}", help="transform options (JSON), e.g. auto_augment")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--slots", default="3", type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--sleep", type=float, default=0.0, help="host sleep per batch, s")
    ap.add_argument("--liveness", type=float, default=60.0)
    ap.add_argument("--timeout", type=float, default=300.0, help="DPULoader timeout, s")
    ap.add_argument("--local", action="store_true")
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--take", type=int, default=0)
    ap.add_argument("--load", default=None)
    ap.add_argument("--close", action="store_true", help="resume: close() before exiting")
    ap.add_argument("--bad", default="", type=lambda s: [int(v) for v in s.split(",") if v])
    ap.add_argument("--kill-after", type=int, default=3)
    ap.add_argument("--signal", choices=("KILL", "STOP"), default="KILL",
                    help="kill: SIGKILL the worker, or SIGSTOP it (hung, not dead)")
    ap.add_argument("--delay", type=float, default=0.0, help="worker: max delay per batch, s")
    ap.add_argument("--fixed-delay", type=float, default=0.0, help="worker: delay per batch, s")
    ap.add_argument("--intervals", default=None,
                    help="worker: write the (start, end) of every batch made into this directory")
    ap.add_argument("--between", action="store_true", help="takeover: stop between epochs")
    ap.add_argument("--bulk", action="store_true", help="misc: bulk-sum request (wrapper)")
    ap.add_argument("--slow-rank", type=int, default=-1,
                    help="worker: this world rank's 5th batch takes --slow-delay s more")
    ap.add_argument("--slow-delay", type=float, default=0.0)
    ap.add_argument("--no-signal", action="store_true",
                    help="takeover: stop nobody (a slow producer is the fault)")
    args = ap.parse_args()
    if args.scenario == "worker":
        return run_worker(args)

    from mpi4py import MPI
    from dpu_pipe.sources import open_path, open_source

    warnings = Warnings()
    logging.getLogger("dpu_pipe").addHandler(warnings)
    # A JSON object is a source spec ({"factory": ..., "args": ...}), anything else a path.
    src = open_source(json.loads(args.data)) if args.data.startswith("{") else \
        open_path(args.data)
    me = MPI.COMM_WORLD.Get_rank()
    t0 = time.monotonic()
    result = SCENARIOS[args.scenario](args, src, warnings)
    result["elapsed"] = round(time.monotonic() - t0, 3)
    write_json(os.path.join(args.out, f"host{me}.json"), result)
    print(f"OK host={me} {args.scenario} elapsed={result['elapsed']:.2f}s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
