"""The thread-safety contract of the local Loader (docs/guides/threads.md): every public method
from any thread at any moment — or a clear ConfigError — never a crash, a hang or a changed
stream; a forked child runs its own loader; Ctrl-C ends a loop.

Every wait has a deadline; the interleavings come from events and counters. Crashes are
caught in subprocesses (a segfault fails the test instead of ending pytest). The stress test
runs ``DPU_PIPE_STRESS_SECONDS`` seconds (default 8; set it to hours for a soak run).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dpu_pipe import ConfigError, DpuPipeError, Loader
from dpu_pipe.sources import FileList, ImageFolder

import jpeg_corpus as jc

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
N = 24
KW = dict(size=32, dtype="uint8", seed=3)
EPOCHS = 3
STEPS = N // 4
#: Seconds each stress test hammers the loader (a short CI run by default).
STRESS_SECONDS = float(os.environ.get("DPU_PIPE_STRESS_SECONDS", "8"))
DEADLINE = 60.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """ImageFolder of N samples, one class folder each: label == sample index."""
    return ImageFolder(jc.write_indexed_folder(tmp_path_factory.mktemp("threads") / "folder", N))


def reference(src, epochs=EPOCHS + 3, **kw):
    """{(epoch, step): (images, labels)} of a fresh loader, copied."""
    out = {}
    with Loader(src, 4, **{**KW, **kw}) as ref:
        for e in range(epochs):
            ref.set_epoch(e)
            for s, (x, y) in enumerate(ref):
                out[e, s] = (x.copy(), y.copy())
    return out


def check_batch(ref, it, x, y):
    """The batch ``it`` just yielded equals the fresh loader's batch of that position."""
    key = (it.epoch, it.next_step - 1)
    u, v = ref[key]
    assert np.array_equal(y, v), f"batch {key}: labels {y.tolist()} != {v.tolist()}"
    assert np.array_equal(x, u), f"batch {key}: images differ from a fresh loader's"


def run_python(code, *args, timeout=DEADLINE, env=None):
    """Run ``code`` in a fresh interpreter with the checkout importable; (rc, out, err)."""
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    full.update(env or {})
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def join_all(threads, deadline=DEADLINE):
    end = time.monotonic() + deadline
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"threads still running after {deadline:g} s: {alive}"


class GatedList(FileList):
    """A file list whose reads wait for ``gate`` once ``armed``: the loader's maker is then
    stuck in a read and a consumer is surely waiting for a batch."""

    def __init__(self, entries):
        super().__init__(entries)
        self.gate = threading.Event()
        self.armed = False
        self.waiting = threading.Event()
        self.free_reads = 0             # reads that pass while armed, before the gate holds
        self.hold = DEADLINE            # how long a read waits for the gate
        self._count = threading.Lock()

    def read(self, i):
        with self._count:
            free = self.free_reads > 0
            self.free_reads -= free
        if self.armed and not free:
            self.waiting.set()
            assert self.gate.wait(self.hold), "gate never opened"
        return super().read(i)


def gated(src):
    return GatedList([(src.describe(i), i) for i in range(len(src))])


def wait_busy(loader):
    """Return once another thread holds ``loader`` (a next() waiting for its batch)."""
    end = time.monotonic() + DEADLINE
    while loader._lock.acquire(blocking=False):
        loader._lock.release()
        assert time.monotonic() < end, "no thread took the loader"
        time.sleep(0.001)


# --- describe while batches are made (the segfault) -------------------------------------------

DESCRIBE_REPRO = r"""
import sys, dpu_pipe
ld = dpu_pipe.Loader(sys.argv[1], 16, train=True, size=96, seed=0, num_threads=1)
it = iter(ld); next(it)
for i in range(64):
    ld.describe(0, i % int(sys.argv[2]))
print("OK")
"""


def test_describe_during_iteration_does_not_crash(folder):
    # The kernel describe() used was the one the maker thread was running: a segfault.
    rc, out, err = run_python(DESCRIBE_REPRO, folder.root, N)
    assert rc == 0 and "OK" in out, f"exit {rc}\n{err[-3000:]}"


@pytest.mark.parametrize("train,extra", [(True, {}), (False, {}),
                                         (True, dict(mixup_alpha=0.4, num_classes=N))],
                         ids=["train", "val", "mix"])
def test_describe_from_threads_equals_a_fresh_loader(folder, train, extra):
    kw = dict(KW, train=train, num_threads=2, **extra)
    with Loader(folder, 4, **kw) as fresh:
        want = {(e, i): fresh.describe(e, i) for e in range(2) for i in range(N)}
    got, errors = {}, []
    with Loader(folder, 4, **kw) as ld:
        stop = threading.Event()

        def hammer(k):
            try:
                n = 0
                while not stop.is_set() or n < N:
                    e, i = n % 2, (n * 7 + k) % N
                    got[e, i, k, n] = (ld.describe(e, i), want[e, i])
                    n += 1
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=hammer, args=(k,), name=f"describe{k}")
                   for k in range(3)]
        for t in threads:
            t.start()
        for _ in range(2):
            for _ in ld:
                pass
        stop.set()
        join_all(threads)
    assert not errors, errors
    assert got and all(a == b for a, b in got.values())


# --- the moving parts from another thread -----------------------------------------------------

@pytest.mark.parametrize("how", ["close", "set_epoch", "iter", "load_state_dict"])
def test_another_thread_ends_an_iteration_that_waits_for_a_batch(folder, how):
    src = gated(folder)
    ref = reference(src)
    ld = Loader(src, 4, prefetch=1, **KW)
    it = iter(ld)
    first = next(it)
    check_batch(ref, it, *first)
    saved = ld.state_dict()
    src.armed = True
    outcome, received = [], []

    def consume():
        try:
            while True:
                next(it)
                # A batch the maker made before the gate closed may still arrive first.
                received.append(ld.state_dict()["step"])
        except BaseException as exc:  # noqa: BLE001 - what the waiting consumer saw
            outcome.append(exc)

    consumer = threading.Thread(target=consume, name="consumer")
    consumer.start()
    assert src.waiting.wait(DEADLINE)      # the maker is stuck in a read
    wait_busy(ld)                           # and the consumer's next() waits for it
    other = {}

    def move():
        other["result"] = {"close": ld.close, "set_epoch": lambda: ld.set_epoch(2),
                           "iter": lambda: iter(ld),
                           "load_state_dict": lambda: ld.load_state_dict(saved)}[how]()

    mover = threading.Thread(target=move, name="mover")
    mover.start()
    consumer.join(DEADLINE)
    assert not consumer.is_alive(), "the waiting next() did not let go"
    src.gate.set()                          # the maker finishes its batch and stops
    join_all([mover])
    exc = outcome[0]
    assert isinstance(exc, ConfigError) and "no longer current" in str(exc) \
        and "mover" in str(exc), repr(exc)
    # The stream goes on from where the loader stands.
    src.armed = False
    it = other["result"] if how == "iter" else iter(ld)
    x, y = next(it)
    check_batch(ref, it, x, y)
    # The loader stands after the last batch the consumer received.
    here = (0, received[-1] if received else 1)
    expect = {"close": here, "set_epoch": (2, 0), "iter": here, "load_state_dict": (0, 1)}
    assert (it.epoch, it.next_step - 1) == expect[how]
    ld.close()


def test_a_next_behind_a_move_that_waits_for_the_maker_lets_go(folder):
    """The move came first: set_epoch holds the loader while the engine finishes the batch
    under way (here stuck in a read). A next() from another thread that then waits for the
    loader raises at once instead of waiting behind it."""
    src = gated(folder)
    src.free_reads = 4                      # the first batch; the maker then sticks
    src.hold = 4 * DEADLINE                 # past the consumer's deadline below
    src.armed = True
    ld = Loader(src, 4, prefetch=1, **KW)
    it = iter(ld)
    next(it)
    assert src.waiting.wait(DEADLINE)      # the maker is stuck in a read
    mover = threading.Thread(target=lambda: ld.set_epoch(2), name="mover")
    mover.start()
    wait_busy(ld)                           # the move holds the loader, waiting for the maker
    outcome = []
    consumer = threading.Thread(target=lambda: outcome.append(_raised(next, it)),
                                name="consumer")
    consumer.start()
    consumer.join(DEADLINE)
    alive = consumer.is_alive()
    src.gate.set()
    join_all([mover, consumer])
    assert not alive, "next() waited behind the move"
    exc = outcome[0]
    assert isinstance(exc, ConfigError) and "no longer current" in str(exc) \
        and "mover" in str(exc), repr(exc)
    ld.close()


def _raised(fn, *args):
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - what the caller saw
        return exc
    return None


def test_readers_never_wait_for_a_batch(folder):
    # state_dict, stats, len, epoch, bad_samples, describe: answered while the consumer
    # holds the loader waiting for a batch that cannot come yet.
    src = gated(folder)
    ld = Loader(src, 4, prefetch=1, **KW)
    it = iter(ld)
    next(it)
    src.armed = True
    # Through the batch made before the gate closed (if any) into the wait for the next.
    got = []
    consumer = threading.Thread(target=lambda: [got.append(b) for b in it], name="consumer")
    consumer.start()
    assert src.waiting.wait(DEADLINE)
    wait_busy(ld)
    answers = {}

    def read_all():
        answers.update(state=ld.state_dict(), stats=ld.stats(), rates=ld.stats(interval=True),
                       len=len(ld), epoch=ld.epoch, bad=ld.bad_samples, taken=1 + len(got))
        src.armed = False                  # describe reads a sample itself
        answers["describe"] = ld.describe(0, 3)

    reader = threading.Thread(target=read_all, name="reader")
    reader.start()
    reader.join(DEADLINE)
    assert not reader.is_alive(), "a reader waited for the batch"
    src.gate.set()
    join_all([consumer])
    assert answers["state"]["epoch"] == 0 and answers["state"]["step"] == answers["taken"]
    assert answers["stats"]["batches"] >= 1 and answers["len"] == STEPS
    ld.close()


def test_two_iterators_in_two_threads(folder):
    # Each iter() supersedes the other thread's iteration: the superseded one raises a
    # ConfigError naming it; every batch either yields is the stream's.
    ref = reference(folder)
    ld = Loader(folder, 4, **KW)
    turns = [threading.Event(), threading.Event()]
    seen = [[], []]
    errors = []

    def run(k):
        try:
            it = None
            for _ in range(4):
                assert turns[k].wait(DEADLINE)
                turns[k].clear()
                if it is not None:          # the other thread's iter() superseded ours
                    with pytest.raises(ConfigError, match=f"a new iter.*worker{1 - k}"):
                        next(it)
                it = iter(ld)
                x, y = next(it)
                check_batch(ref, it, x, y)
                seen[k].append((it.epoch, it.next_step - 1))
                turns[1 - k].set()          # the other thread starts its own iteration
            if k == 0:                      # worker1 iterated after worker0's last turn
                assert turns[0].wait(DEADLINE)
                with pytest.raises(ConfigError, match="a new iter.*worker1"):
                    next(it)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            for t in turns:
                t.set()

    threads = [threading.Thread(target=run, args=(k,), name=f"worker{k}") for k in (0, 1)]
    for t in threads:
        t.start()
    turns[0].set()
    join_all(threads)
    ld.close()
    assert not errors, errors
    # The batches alternate between the threads and follow one another in the stream.
    order = sorted(seen[0] + seen[1])
    assert order == [(e, s) for e in range(2) for s in range(STEPS)][:8], order


# --- the stress test --------------------------------------------------------------------------

def stress(ld, ref, seconds, fresh_describe, fresh_state):
    """Hammer ``ld`` from several threads for ``seconds`` while one thread consumes it and
    another moves it (set_epoch, load_state_dict, close, iter) every few batches. Returns
    the counters; raises what any thread saw that breaks the contract."""
    errors, stop = [], threading.Event()
    consumed = [0]
    moved = [0]
    tick = threading.Event()        # set by the consumer every batch; the mover acts on it
    states = []

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
                stop.set()
        return run

    @guard
    def consumer():
        while not stop.is_set():
            it = iter(ld)
            try:
                for x, y in it:
                    check_batch(ref, it, x, y)
                    consumed[0] += 1
                    tick.set()
                    if stop.is_set():
                        break
            except ConfigError as exc:
                assert "no longer current" in str(exc), exc
            if ld.epoch >= EPOCHS:
                ld.set_epoch(0)

    @guard
    def mover():
        ops = ["set_epoch", "state", "close", "iter", "load", "set_epoch_same"]
        k = 0
        while not stop.is_set():
            if not tick.wait(1.0):
                continue
            tick.clear()
            op = ops[k % len(ops)]
            k += 1
            if op == "set_epoch":
                ld.set_epoch(k % EPOCHS)
            elif op == "set_epoch_same":
                ld.set_epoch(ld.epoch)
            elif op == "state":
                states.append(ld.state_dict())
            elif op == "close":
                ld.close()
            elif op == "load" and states:
                ld.load_state_dict(states[-1])
            elif op == "iter" and ld.epoch < EPOCHS:
                it = iter(ld)
                try:
                    x, y = next(it)
                    check_batch(ref, it, x, y)
                except (ConfigError, StopIteration):
                    pass
            moved[0] += 1

    @guard
    def reader():
        last = 0
        while not stop.is_set():
            st = ld.stats()
            assert st["batches"] >= last, (st["batches"], last)
            last = st["batches"]
            ld.stats(interval=True)
            state = ld.state_dict()
            fresh_state(state)
            assert 0 <= state["step"] <= len(ld) and len(ld) == STEPS
            assert ld.bad_samples == {} and ld.epoch >= 0

    @guard
    def describer():
        n = 0
        while not stop.is_set():
            e, i = n % 2, (n * 5) % N
            assert ld.describe(e, i) == fresh_describe[e, i], (e, i)
            n += 1

    threads = [threading.Thread(target=f, name=f.__name__)
               for f in (consumer, mover, reader, describer, describer)]
    for t in threads:
        t.start()
    # At least ``seconds``, and at least 20 batches and 10 moves however loaded the machine.
    end, hard = time.monotonic() + seconds, time.monotonic() + seconds + DEADLINE
    while not stop.is_set() and (time.monotonic() < end or consumed[0] < 20 or moved[0] < 10):
        if time.monotonic() > hard:
            errors.append(AssertionError(f"only {consumed[0]} batches and {moved[0]} moves "
                                         f"in {seconds + DEADLINE:g} s"))
            break
        stop.wait(0.1)
    stop.set()
    tick.set()
    join_all(threads)
    ld.close()
    if errors:
        raise errors[0]
    return consumed[0], moved[0]


@pytest.mark.parametrize("num_threads", [1, 2])
def test_stress_every_method_from_every_thread(folder, num_threads):
    ref = reference(folder)
    with Loader(folder, 4, **KW) as fresh:
        fresh_describe = {(e, i): fresh.describe(e, i) for e in range(2) for i in range(N)}
    check = Loader(folder, 4, **KW)

    def fresh_state(state):
        check.load_state_dict(state)      # a state another thread saw is a valid state

    # copy=True: a yielded batch is valid until the next next() — from any thread — and the
    # threads here check theirs while the others move on.
    ld = Loader(folder, 4, num_threads=num_threads, prefetch=2, copy=True, **KW)
    consumed, moved = stress(ld, ref, STRESS_SECONDS / 2, fresh_describe, fresh_state)
    assert consumed >= 20 and moved >= 10, (consumed, moved)


# --- interpreter exit, KeyboardInterrupt, Ctrl-C ---------------------------------------------

EXIT_WITH_THREADS = r"""
import sys, threading, dpu_pipe
path = sys.argv[1]
ld = dpu_pipe.Loader(path, 4, size=32, num_threads=2, prefetch=3)
it = iter(ld); next(it)                       # maker thread alive, ring not full
other = dpu_pipe.Loader(path, 4, size=32, num_threads=2)
running = threading.Event()

def loop():
    while True:
        for _ in other:
            running.set()

threading.Thread(target=loop, daemon=True).start()
assert running.wait(60)
print("EXITING", flush=True)
"""


def test_exit_with_loader_threads_alive(folder):
    rc, out, err = run_python(EXIT_WITH_THREADS, folder.root)
    assert rc == 0 and "EXITING" in out, f"exit {rc}\n{err[-3000:]}"
    assert "Exception ignored" not in err and "Fatal" not in err, err[-3000:]


# Both scripts put Python's SIGINT handler back first: a shell without job control starts its
# background commands with SIGINT ignored, and a Python started so keeps ignoring it.
INTERRUPTS = r"""
import _thread, json, signal, sys, threading
import numpy as np
import dpu_pipe

signal.signal(signal.SIGINT, signal.default_int_handler)

path, epochs = sys.argv[1], 2
kw = dict(size=32, dtype="uint8", seed=3, num_threads=2)
ref = {}
with dpu_pipe.Loader(path, 4, **kw) as fresh:
    for e in range(epochs):
        for s, (x, y) in enumerate(fresh):
            ref[e, s] = (x.copy(), y.copy())
    want = {i: fresh.describe(0, i) for i in range(8)}
ld = dpu_pipe.Loader(path, 4, **kw)
go, stop = threading.Event(), threading.Event()

def interrupter():
    while not stop.is_set():
        if go.wait(0.2):
            go.clear()
            _thread.interrupt_main()

threading.Thread(target=interrupter, daemon=True).start()
thread = threading.Thread(target=interrupter, daemon=True)
thread.start()
got, interrupts, n = {}, 0, 0
while True:
    try:
        if ld.epoch >= epochs:
            break
        it = iter(ld)
        for x, y in it:
            if it.epoch >= epochs:            # an epoch's end met in iter()
                break
            # An interrupt here loses the batch in this loop, not in the loader.
            got[it.epoch, it.next_step - 1] = (x.copy(), y.copy())
            n += 1
            go.set()                          # an interrupt lands somewhere soon
            assert ld.describe(0, n % 8) == want[n % 8]
    except KeyboardInterrupt:
        interrupts += 1
while True:
    try:
        stop.set()
        thread.join(10)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        break
    except KeyboardInterrupt:
        interrupts += 1
bad = [list(k) for k in got if not (np.array_equal(got[k][0], ref[k][0])
                                    and np.array_equal(got[k][1], ref[k][1]))]
print(json.dumps({"interrupts": interrupts, "bad": bad, "got": len(got), "ref": len(ref)}))
"""


def test_keyboard_interrupts_anywhere_leave_the_stream_unchanged(folder):
    # KeyboardInterrupt lands in kernel calls (describe, the batch wait) and between them;
    # iterating again continues the same stream.
    rc, out, err = run_python(INTERRUPTS, folder.root, timeout=120)
    assert rc == 0, f"exit {rc}\n{err[-3000:]}"
    res = json.loads(out.strip().splitlines()[-1])
    # Each interrupt loses at most the batch the loop body was holding.
    assert res["bad"] == [] and res["interrupts"] >= 1, res
    assert res["got"] >= res["ref"] - res["interrupts"], res


SIGINT_LOOP = r"""
import signal, sys, dpu_pipe
signal.signal(signal.SIGINT, signal.default_int_handler)
ld = dpu_pipe.Loader(sys.argv[1], 4, size=32, num_threads=2)
n = 0
while True:
    for x, y in ld:
        n += 1
        if n == 2:
            print("READY", flush=True)
"""


def test_ctrl_c_ends_a_local_loop(folder):
    full = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", SIGINT_LOOP, str(folder.root)], cwd=ROOT,
                            env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, (proc.returncode, err[-2000:])
    assert "Fatal" not in err and "Exception ignored" not in err, err[-2000:]


# --- fork -------------------------------------------------------------------------------------

FORK = r"""
import json, multiprocessing as mp, os, sys, time
import dpu_pipe

path, how = sys.argv[1], sys.argv[2]
kw = dict(size=32, dtype="uint8", seed=3, num_threads=2)

def labels(loader, epochs=2):
    return [[y.tolist() for _, y in loader] for _ in range(epochs)]

ref = labels(dpu_pipe.Loader(path, 4, **kw))
parent = dpu_pipe.Loader(path, 4, prefetch=3, **kw)
it = iter(parent); next(it)                   # threads and OpenMP running at the fork

def child(conn):
    own = labels(dpu_pipe.Loader(path, 4, **kw))
    try:
        next(it)
        stale = "yielded"
    except dpu_pipe.ConfigError as exc:
        stale = str(exc)
    # The inherited loader continues from where the parent stood (epoch 0, step 1).
    rest = [y.tolist() for _, y in parent]
    conn({"own": own == ref, "inherited": rest == ref[0][1:], "stale": stale,
          "describe": parent.describe(0, 1) == dpu_pipe.Loader(path, 4, **kw).describe(0, 1)})

deadline = time.monotonic() + 60
if how == "os.fork":
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        def send(d):
            os.write(w, json.dumps(d).encode())
        try:
            child(send)
        finally:
            os._exit(0)
    os.close(w)
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        print(json.dumps({"hang": True}))
        sys.exit(0)
    print(os.read(r, 1 << 16).decode() or json.dumps({"status": status}))
else:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q.put,))
    p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
        print(json.dumps({"hang": True}))
        sys.exit(0)
    print(json.dumps(q.get(timeout=10)))
# The parent's own iteration is untouched by the fork.
rest = [y.tolist() for _, y in it]
assert [ref[0][0]] + rest == ref[0], "the parent's stream changed"
"""


@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
def test_forked_child_runs_loaders(folder, how):
    rc, out, err = run_python(FORK, folder.root, how, timeout=150)
    assert rc == 0, f"exit {rc}\n{err[-3000:]}"
    res = json.loads(out.strip().splitlines()[-1])
    assert not res.get("hang"), "the forked child hung"
    assert res["own"] and res["inherited"] and res["describe"], res
    assert "the process forked" in res["stale"], res


@pytest.mark.slow      # importing torch alone takes ~20 s here
def test_torch_dataloader_workers_are_refused(folder):
    torch = pytest.importorskip("torch")
    ld = Loader(folder, 4, output="torch", **KW)
    it = iter(ld)
    next(it)                                    # threads alive when the workers fork
    dl = torch.utils.data.DataLoader(ld.iterable_dataset(), batch_size=None, num_workers=2,
                                     multiprocessing_context="fork", timeout=DEADLINE)
    with pytest.raises(ConfigError, match=r"num_workers=2"):
        for _ in dl:
            pass
    ld.close()


# --- sources and packed readers ---------------------------------------------------------------

@pytest.fixture(scope="module")
def packed(folder, tmp_path_factory):
    from dpu_pipe import pack

    # Small shards and index blocks: the threads open, evict and check many of them.
    out = tmp_path_factory.mktemp("threads") / "ds.dpk"
    pack(folder, str(out), shard_size=4000, transcode=False, block_records=2, progress=False)
    return str(out)


def test_sources_read_from_many_threads(folder, packed):
    from dpu_pipe.sources import PackedSource

    sources = {"folder": folder, "filelist": FileList([(folder.describe(i), i) for i in range(N)]),
               "packed": PackedSource(packed, max_open_shards=2, verify_reads=True)}
    want = {i: folder.read(i) for i in range(N)}
    errors = []

    def hammer(src, k):
        try:
            for n in range(200):
                i = (n * 7 + k) % N
                assert bytes(src.read(i)) == want[i], i
                if hasattr(src, "buffers") and n % 10 == 0:
                    idx = np.array([(i + j) % N for j in range(4)], np.int64)
                    bufs, errs = src.buffers(idx)
                    assert not errs and len(bufs) == 4
                src.describe(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((src, exc))

    threads = [threading.Thread(target=hammer, args=(src, k)) for src in sources.values()
               for k in range(3)]
    for t in threads:
        t.start()
    join_all(threads)
    assert not errors, errors


def test_packed_close_from_another_thread(folder, packed):
    from dpu_pipe.sources import PackedSource

    src = PackedSource(packed, max_open_shards=2)
    want = {i: folder.read(i) for i in range(N)}
    started, closed = threading.Event(), threading.Event()
    seen, errors = {"ok": 0, "closed": 0}, []

    def reader(k):
        try:
            n = 0
            while True:
                i = (n * 5 + k) % N
                try:
                    data = bytes(src.read(i))
                except ConfigError as exc:
                    assert "is closed" in str(exc), exc
                    seen["closed"] += 1
                    return
                assert data == want[i], i
                seen["ok"] += 1
                n += 1
                started.set()
                assert n < 10**6 and (n < 1000 or closed.wait(DEADLINE)), "never closed"
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    assert started.wait(DEADLINE)
    closer = threading.Thread(target=lambda: (src.close(), closed.set()), name="closer")
    closer.start()
    join_all(threads + [closer])
    assert not errors, errors
    assert seen["ok"] > 0 and seen["closed"] == 3, seen
    # A loader over the closed source says so; it is not a bad sample to skip.
    with pytest.raises(DpuPipeError, match="is closed"):
        next(iter(Loader(src, 4, on_error="skip", **KW)))
