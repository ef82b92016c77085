"""Host side of the reliability scenarios, run under mpiexec (MPMD)::

    mpiexec -n 1 python -m mpi4py tests/mpi/reliability_host.py SCENARIO ... \\
          : -n P python -m mpi4py -m dpu_pipe.worker

``hostile``
    The hostile dataset (``--list``, a FileList) through ``DPULoader`` with
    ``on_error="skip"`` over ``--epochs``, each batch compared bit for bit with the local
    Loader's and the bad-sample records compared; then ``on_error="raise"``: the DecodeError
    (index, path) must be the Loader's. Writes ``host0.json``.
``soak``
    A train and a val DPULoader (and a local Loader with 1 and 2 threads) alternating every
    epoch for ``--epochs``, with a ``set_epoch`` jump and a resume from ``state_dict`` into a
    fresh DPULoader half-way. After each epoch: RSS, open fds, threads of every rank of the
    job on this node (host and producers), files under ``$TMPDIR``; the last epoch's stream is
    compared with a fresh Loader's. Writes ``soak.json``.
``fault``
    One cell of the fault matrix (``--fault``): the error that ends the host (type, message,
    seconds from injection to detection) goes to ``error0.json``, the job's pids to
    ``pids.json``; see fault_matrix.py.

``worker`` is not a host scenario: a ``python -m dpu_pipe.worker`` wrapper that injects a
producer-side fault (``--fault slow|raise|unreachable``).
"""
import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np

from offload_host import sibling_pids, write_json


def job_pids():
    """(host pid, [producer pids]) of this job on this node: the producers are the
    ``dpu_pipe.worker`` processes (or the fault wrapper) started by this rank's parent."""
    return os.getpid(), sibling_pids(lambda argv: b"dpu_pipe.worker" in argv or any(
        b"reliability_host" in c for c in argv))


def _status(pid):
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":", 1) for line in f if ":" in line)


def proc_stats(pid):
    """RSS (bytes), open fds and threads of process ``pid``.

    Threads are the fewest seen over 0.5 s: the OpenMP team of a loader thread that just
    ended exits on its own a moment later, while a leaked thread stays in every sample."""
    status = _status(pid)
    threads = int(status["Threads"])
    for _ in range(10):
        time.sleep(0.05)
        threads = min(threads, int(_status(pid)["Threads"]))
    return {"rss": int(status["VmRSS"].split()[0]) * 1024,
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": threads}


def tmp_files():
    root = os.environ.get("TMPDIR", "/tmp")
    return sum(len(files) for _, _, files in os.walk(root))


def kw(args):
    return dict(size=args.size, dtype="uint8", seed=args.seed)


def copy_epoch(loader):
    return [(np.asarray(x).copy(), np.asarray(y).copy()) for x, y in loader]


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, u) and np.array_equal(y, v)
                                    for (x, y), (u, v) in zip(a, b))


# --- hostile ---------------------------------------------------------------------------------------

def run_hostile(args, src):
    from dpu_pipe import DecodeError, DPULoader, Loader

    res = {}
    with Loader(src, args.batch, on_error="skip", shuffle=False, drop_last=False,
                **kw(args)) as ref:
        want = [copy_epoch(ref) for _ in range(args.epochs)]
        res["loader_bad"] = {int(i): m for i, m in ref.bad_samples.items()}
    with DPULoader(src, args.batch, on_error="skip", shuffle=False, drop_last=False,
                   slots=2, **kw(args)) as dl:
        for e in range(args.epochs):
            got = copy_epoch(dl)
            assert same(got, want[e]), f"skip: epoch {e} differs from the Loader's"
        res["dpu_bad"] = {int(i): m for i, m in dl.bad_samples.items()}
    expected = None
    try:
        with Loader(src, args.batch, shuffle=False, drop_last=False, **kw(args)) as ref:
            copy_epoch(ref)
    except DecodeError as exc:
        expected = exc
    assert expected is not None
    res["expected"] = {"index": expected.index, "path": expected.path}
    try:
        with DPULoader(src, args.batch, shuffle=False, drop_last=False, slots=2,
                       **kw(args)) as dl:
            copy_epoch(dl)
        res["raised"] = None
    except DecodeError as exc:
        res["raised"] = {"index": exc.index, "path": exc.path, "message": str(exc)}
    return res


# --- soak -------------------------------------------------------------------------------------------

def run_soak(args, src):
    from dpu_pipe import DPULoader, Loader

    host, producers = job_pids()
    extra = {}
    if args.mode != "offload":
        extra = {"mode": args.mode, "host_threads": 1}
    common = dict(on_error="skip", timeout=args.timeout, **kw(args))
    train = DPULoader(src, args.batch, slots=3, **extra, **common)
    val = DPULoader(src, args.batch, train=False, shuffle=False, slots=2, **extra, **common)
    local = {t: Loader(src, args.batch, num_threads=t, rank=0, world_size=1, **common)
             for t in (1, 2)}
    rows = []
    last = None
    bad_before = {}
    t0 = time.monotonic()
    for e in range(args.epochs):
        if e == args.epochs // 2:
            # A set_epoch jump back and forth, then a resume mid-epoch into a new loader.
            train.set_epoch(e + 7)
            next(iter(train))
            train.set_epoch(e)
            it = iter(train)
            next(it), next(it)
            state = train.state_dict()
            bad_before = {int(i): m for i, m in train.bad_samples.items()}
            train.close()
            train = DPULoader(src, args.batch, slots=3, **extra, **common)
            train.load_state_dict(state)
        stream = copy_epoch(train)
        copy_epoch(val)
        for loader in local.values():
            loader.set_epoch(e)
            copy_epoch(loader)
        if e == args.epochs - 1:
            last = stream
        row = {"epoch": e + 1, "seconds": round(time.monotonic() - t0, 2),
               "tmp_files": tmp_files(), "ranks": {}}
        for name, pid in [("host", host)] + [(f"producer{k}", p)
                                             for k, p in enumerate(producers)]:
            try:
                row["ranks"][name] = proc_stats(pid)
                if pid == os.getpid():   # names the thread when one is left behind
                    row["ranks"][name]["thread_names"] = sorted(
                        t.name for t in threading.enumerate())
            except OSError:
                row["ranks"][name] = None
        rows.append(row)
    bad = {int(i): m for i, m in train.bad_samples.items()}
    val_bad = {int(i): m for i, m in val.bad_samples.items()}
    train.close()
    val.close()
    for loader in local.values():
        loader.close()
    with Loader(src, args.batch, rank=0, world_size=1, **common) as fresh:
        fresh.set_epoch(args.epochs - 1)
        same_last = same(copy_epoch(fresh), last)
    return {"rows": rows, "last_epoch_equals_fresh_loader": same_last, "bad": bad,
            "bad_before_resume": bad_before, "val_bad": val_bad,
            "host_pid": host, "producer_pids": producers, "mode": args.mode}


# --- fault matrix --------------------------------------------------------------------------------

def _fail_window_allocation():
    """Make the host's ``MPI.Win.Allocate`` fail as it does when /dev/shm (or memory) is
    full, without filling the machine's /dev/shm: every dpu_pipe module's ``MPI`` (and
    ``load_mpi``) gives a view of mpi4py whose ``Win.Allocate`` raises ERR_NO_MEM."""
    import importlib

    from mpi4py import MPI

    class FailingWin:
        def __getattr__(self, name):
            return getattr(MPI.Win, name)

        @staticmethod
        def Allocate(*a, **k):
            raise MPI.Exception(MPI.ERR_NO_MEM)

    failing = FailingWin()

    class View:
        Win = failing

        def __getattr__(self, name):
            return getattr(MPI, name)

    importlib.import_module("dpu_pipe.offload.transport")
    view = View()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("dpu_pipe"):
            continue
        if getattr(mod, "MPI", None) is MPI:
            mod.MPI = view
        if callable(getattr(mod, "load_mpi", None)):   # the transports' lazy import
            mod.load_mpi = lambda *a, **k: view


def run_fault(args, src):
    from dpu_pipe import DPULoader

    host, producers = job_pids()
    write_json(os.path.join(args.out, "pids.json"), {"host": host, "producers": producers})
    extra = {} if args.mode == "offload" else {"mode": args.mode, "host_threads": 1}
    if args.fault == "window_alloc":
        _fail_window_allocation()
    injected = None
    consumed = 0
    epochs = []
    try:
        dl = DPULoader(src, args.batch, slots=2, liveness_timeout=args.liveness,
                       timeout=args.timeout, size=args.size, dtype="uint8", seed=args.seed,
                       **extra)
        if args.fault in ("window_alloc", "unreachable", "raise", "slow"):
            injected = time.monotonic()  # producer-side faults act from the first batch
        for e in range(args.epochs):
            labels = []
            for x, y in dl:
                labels += np.asarray(y).tolist()
                consumed += 1
                if consumed == args.after and injected is None and args.fault in (
                        "kill", "stop_mid", "host_raise", "host_killed"):
                    injected = time.monotonic()
                    write_json(os.path.join(args.out, "injected.json"), {"t": time.time()})
                    if args.fault in ("kill", "stop_mid"):
                        sig = signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP
                        if args.fault == "stop_mid":
                            # Stopped while it makes a batch: wait until it is busy.
                            time.sleep(0.05)
                        os.kill(producers[-1], sig)
                    elif args.fault == "host_raise":
                        raise RuntimeError("injected host failure mid-epoch")
                    elif args.fault == "host_killed":
                        os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(args.sleep)
            epochs.append(sorted(labels) == list(range(len(src))))
            if args.fault == "stop_between" and injected is None and e == 0:
                injected = time.monotonic()
                write_json(os.path.join(args.out, "injected.json"), {"t": time.time()})
                os.kill(producers[-1], signal.SIGSTOP)
        dl.close()
    except BaseException as exc:
        write_json(os.path.join(args.out, "error0.json"), {
            "type": type(exc).__name__, "message": str(exc)[:2000], "consumed": consumed,
            "seconds_after_injection": (time.monotonic() - injected) if injected else None,
            "traceback": traceback.format_exc()[-4000:]})
        raise
    return {"consumed": consumed, "completed": True, "exactly_once": all(epochs),
            "seconds_after_injection": (time.monotonic() - injected) if injected else None}


def run_worker(args):
    """The producer with a fault injected into its decode path."""
    from dpu_pipe import batch, worker
    from mpi4py import MPI

    me = MPI.COMM_WORLD.Get_rank()
    victim = me == MPI.COMM_WORLD.Get_size() - 1
    produce = batch.BatchMaker.make
    if args.fault == "slow" and victim:
        def slow(self, *a, **k):
            t = time.perf_counter()
            n = produce(self, *a, **k)
            time.sleep(9 * (time.perf_counter() - t) + 0.05)
            return n
        batch.BatchMaker.make = slow
    elif args.fault == "raise" and victim:
        def boom(self, epoch, step, *a, **k):
            if step >= 2:
                raise RuntimeError("injected failure in the decode path (not a DecodeError)")
            return produce(self, epoch, step, *a, **k)
        batch.BatchMaker.make = boom
    elif args.fault == "unreachable":
        # The dataset's file system is not mounted on the producers' node.
        import builtins

        def hidden(real):
            def opener(path, *a, **k):
                if isinstance(path, (str, bytes, os.PathLike)) \
                        and os.fsdecode(path).startswith(args.data_root):
                    raise FileNotFoundError(2, "No such file or directory", path)
                return real(path, *a, **k)
            return opener
        os.open, builtins.open = hidden(os.open), hidden(builtins.open)
    worker.serve()


SCENARIOS = {"hostile": run_hostile, "soak": run_soak, "fault": run_fault}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=[*SCENARIOS, "worker"])
    ap.add_argument("--data", help="dataset: a FileList file or an ImageFolder directory")
    ap.add_argument("--data-root", default="", help="worker: root the 'unreachable' fault hides")
    ap.add_argument("--out")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--mode", default="offload")
    ap.add_argument("--fault", default="")
    ap.add_argument("--after", type=int, default=3)
    ap.add_argument("--sleep", type=float, default=0.02)
    ap.add_argument("--liveness", type=float, default=5.0)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    if args.scenario == "worker":
        return run_worker(args)
    from mpi4py import MPI  # noqa: F401
    from dpu_pipe.sources import open_path

    logging.basicConfig(level=logging.ERROR)
    src = open_path(args.data)
    result = SCENARIOS[args.scenario](args, src)
    write_json(os.path.join(args.out, f"{args.scenario}.json"), result)
    print(f"OK {args.scenario}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
