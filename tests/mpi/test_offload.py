"""DPULoader under mpiexec: host ranks run ``offload_host.py``, producer ranks
``python -m dpu_pipe.worker`` (MPMD). The offloaded stream must be the local Loader's, bit for
bit, over epochs, slot counts, worker counts, hosts, resumption and bad samples; failures
(bad files, dead or hung workers, misuse) must end the job with an error, never a hang.

Datasets have one class folder per sample, so a label *is* the sample index: exactly-once
delivery over the hosts is checked on the labels the hosts gather among themselves.
"""
import importlib.util
import json
import os
import re
import sys
import time

import numpy as np
import pytest

from helpers import make_dataset
from mpi_launch import ENVS, ENVS_NOLOCAL_SLOW, HERE, run_mpi

pytestmark = pytest.mark.timeout(300)

N = 48                     # samples of the main dataset (divisible by batch 4 x 2 hosts)
BAD = {5: "corrupt", 17: "not-jpeg"}
KW = dict(size=32, dtype="uint8", seed=11)   # offload_host.py's defaults
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def workers(n, *wrapper_args):
    """The MPMD tail of the command line: ``n`` producer ranks, the real worker module, or
    offload_host.py's delaying wrapper around it when ``wrapper_args`` are given."""
    target = (["-m", "dpu_pipe.worker"] if not wrapper_args
              else [str(HERE / "offload_host.py"), "worker", *wrapper_args])
    return [":", "-n", str(n), sys.executable, "-m", "mpi4py", *target]


def launch(hosts, nworkers, scenario, out, *args, worker_args=(), env="shm", limit=90,
           launcher_args=()):
    os.makedirs(out, exist_ok=True)
    return run_mpi(hosts, "offload_host.py", scenario, "--out", out, *args,
                   *workers(nworkers, *worker_args), env=ENVS[env], limit=limit,
                   launcher_args=launcher_args)


def read(out, name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def gone(pid, wait=5.0):
    """True once process ``pid`` no longer exists (or is a zombie) — no rank left behind."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def data(mpi_dataset):
    return mpi_dataset(N)


@pytest.fixture(scope="module")
def bad_data(mpi_dataset):
    return mpi_dataset(32, BAD)


# --- the stream: bit-identical to the Loader, exactly once over the hosts -----------------------

# name: (hosts, workers, extra host arguments). Every launch checks K=1 and K=6 slots with a
# consumer that sleeps per batch, 3 epochs (one of them consumed in two loops), and an epoch
# of batch 5 with a short last batch in float32 HWC.
STREAMS = {
    "1host-1worker": (1, 1, []),
    "1host-2workers": (1, 2, ["--local"] + (["--torch"] if HAVE_TORCH else [])),
    "1host-3workers": (1, 3, []),
    "2hosts-2workers": (2, 2, ["--local"]),
    "2hosts-1worker-fallback": (2, 1, []),
}


@pytest.fixture(scope="module")
def stream_runs(data, tmp_path_factory):
    """Launches of the stream scenario, made once per (scenario, env) and shared by the
    tests that read different parts of their results."""
    cache = {}

    def get(name, env):
        if (name, env) not in cache:
            hosts, nworkers, extra = STREAMS[name]
            out = str(tmp_path_factory.mktemp(f"{name}-{env}"))
            job = launch(hosts, nworkers, "stream", out, "--data", data, "--slots", "1,6",
                         "--sleep", "0.005", "--epochs", "3", *extra, env=env)
            cache[name, env] = (job, [read(out, f"host{h}.json") for h in range(hosts)])
        return cache[name, env]

    return get


@pytest.mark.parametrize("env", ENVS, ids=list(ENVS))
@pytest.mark.parametrize("name", STREAMS, ids=list(STREAMS))
@pytest.mark.slow
def test_stream_equals_loader_exactly_once(stream_runs, name, env):
    hosts, nworkers, extra = STREAMS[name]
    job, results = stream_runs(name, env)
    assert job.returncode == 0, job.explain()
    # Ranks' lines may be merged on the launcher's stdout: count the markers.
    assert sorted(re.findall(r"OK host=(\d+)", job.stdout)) == [str(h) for h in range(hosts)], \
        job.explain()
    batches = N // 4 // hosts
    for h, res in enumerate(results):
        assert res is not None, job.explain()
        assert (res["host"], res["hosts"]) == (h, hosts), res
        assert [r["slots"] for r in res["runs"]] == [1, 6]
        assert res["partial_batch"] == [5] * (N // hosts // 5) + [N // hosts % 5]
        producers = set()
        for run in res["runs"]:
            if res["mode"] == "local":
                continue
            assert run["batches"] == 3 * batches, run
            spp = run["steps_per_producer"]
            assert sum(spp.values()) == 3 * batches, run
            producers |= set(spp)
        if name == "2hosts-1worker-fallback":
            # One producer: it serves host 0; host 1 produces locally and says so.
            expect = "offload" if h == 0 else "local"
            assert res["mode"] == expect, res
            said = [w for w in res["warnings"] if "no producer rank serves this host" in w]
            assert bool(said) == (h == 1), res["warnings"]
            assert producers == ({"1"} if h == 0 else set()), res
        else:
            assert res["mode"] == "offload" and not res["warnings"], res
            # Each host's producers: every one took part (with >= 2, the work is spread).
            assert producers == {str(p) for p in range(1, nworkers // hosts + 1)}, res
        if "--local" in extra:
            assert res["local_checked"], res
        if "--torch" in extra:
            assert res["torch_checked"], res


def test_local_mode_defaults_to_the_hosts_shard(stream_runs):
    job, results = stream_runs("2hosts-2workers", "shm")
    assert job.returncode == 0, job.explain()
    assert [r["local_default_shard"] for r in results] == [[0, 2], [1, 2]]


@pytest.mark.parametrize("env", list(ENVS))
@pytest.mark.slow
def test_slow_random_producers_and_slow_consumer(data, tmp_path, env):
    """Workers sleep a random 0..30 ms before each batch (a wrapper around the worker), the
    host 10 ms per batch, K=1 and K=8: same stream, no deadlock (the job ends by itself
    within its limit)."""
    out = str(tmp_path)
    job = launch(1, 3, "stream", out, "--data", data, "--slots", "1,8", "--sleep", "0.01",
                 "--epochs", "2", worker_args=("--delay", "0.03"), env=env, limit=90)
    assert job.returncode == 0, job.explain()
    res = read(out, "host0.json")
    for run in res["runs"]:
        assert run["batches"] == 2 * N // 4, run
        assert len(run["steps_per_producer"]) > 1, run


# --- resume in a new job -------------------------------------------------------------------------

@pytest.mark.slow
def test_resume_in_a_new_job_continues_the_stream(data, tmp_path):
    """Job 1 (2 workers) consumes 17 batches (into epoch 1) and saves state_dict(); job 2
    (a new mpiexec, 1 worker, shared memory off) loads it and consumes to the end of epoch 2.
    Together they are the uninterrupted Loader stream; the state also resumes a Loader."""
    from dpu_pipe import ImageFolder, Loader

    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    job1 = launch(1, 2, "resume", one, "--data", data, "--take", "17", "--slots", "3")
    assert job1.returncode == 0, job1.explain()
    state = read(one, "state0.json")
    assert (state["epoch"], state["step"]) == (1, 5), state
    job2 = launch(1, 1, "resume", two, "--data", data, "--load", os.path.join(one, "state0.json"),
                  "--epochs", "3", "--slots", "2", "--close", env="nolocal")
    assert job2.returncode == 0, job2.explain()
    assert read(two, "host0.json")["start"]["step"] == 5
    a, b = np.load(os.path.join(one, "batches0.npz")), np.load(os.path.join(two, "batches0.npz"))
    images = np.concatenate([a["images"], b["images"]])
    labels = np.concatenate([a["labels"], b["labels"]])
    where = np.concatenate([a["where"], b["where"]]).tolist()
    assert where == [[e, s] for e in range(3) for s in range(12)]
    src = ImageFolder(data)
    with Loader(src, 4, **KW) as ref:
        expected = [(x.copy(), y.copy()) for _ in range(3) for x, y in ref]
    assert len(images) == len(expected) == 36
    for j, (x, y) in enumerate(expected):
        assert np.array_equal(labels[j], y), j
        assert np.array_equal(images[j], x), j
    # The DPULoader's state is a Loader state: a local Loader resumes the same stream.
    with Loader(src, 4, **KW) as local:
        local.load_state_dict(state)
        rest = [y.copy() for _ in range(2) for _, y in local]
    assert np.array_equal(np.stack(rest), b["labels"])


# --- bad samples -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bad_runs(bad_data, tmp_path_factory):
    """The bad-samples scenario, launched once per env: 2 epochs of on_error="skip", then
    on_error="raise" until the DecodeError, which the host records and re-raises."""
    cache = {}

    def get(env):
        if env not in cache:
            out = str(tmp_path_factory.mktemp(f"bad-{env}"))
            job = launch(1, 2, "bad", out, "--data", bad_data, "--bad", ",".join(map(str, BAD)),
                         "--slots", "3", env=env, limit=60)
            cache[env] = (job, read(out, "host0.json"), read(out, "error0.json"))
        return cache[env]

    return get


@pytest.mark.parametrize("env", ENVS_NOLOCAL_SLOW)
def test_bad_samples_skip_then_raise(bad_runs, bad_data, env):
    """on_error="skip": full batches, the Loader's stream, bad_samples == the bad files.
    on_error="raise": DecodeError naming the file and the producer rank, at the step where
    the Loader raises; the host re-raises it and the job ends non-zero, promptly."""
    job, res, err = bad_runs(env)
    assert job.returncode != 0 and "OK host=" not in job.stdout, job.explain()
    assert not job.timed_out, job.explain()
    assert res is not None, job.explain()
    paths = {i: os.path.join(bad_data, f"c{i:03d}", "img.jpg") for i in BAD}
    skipped = {int(i): m for i, m in res["skip_bad_samples"].items()}
    assert set(skipped) == set(BAD), skipped
    for i, message in skipped.items():
        assert paths[i] in message, message
    assert {int(i) for i in res["loader_bad_samples"]} == set(BAD)
    for i in BAD:
        assert any(paths[i] in w and "producer" in w for w in res["skip_warnings"]), res
    assert err is not None, job.explain()
    expected = res["expected"]
    assert err["type"] == "DecodeError", err
    assert (err["step"], err["index"], err["path"]) == \
        (expected["step"], expected["index"], expected["path"]), (err, expected)
    assert err["path"] in err["message"], err
    assert any("producer rank" in note for note in err["notes"]), err
    assert err["cause_type"] == "ProducerError" and "producer rank" in err["cause_producer"]
    assert expected["path"] in job.stderr, job.explain()


def test_next_after_decode_error_is_a_dpu_pipe_error(bad_runs):
    job, _, err = bad_runs("shm")
    assert err is not None and err["type"] == "DecodeError", job.explain()
    assert err["again_is_dpu_pipe_error"], err["again_type"]


@pytest.mark.slow
def test_many_bad_samples_in_one_batch_all_reach_the_host(tmp_path_factory):
    """150 of 160 files bad, batch 128, long paths: one batch finds ~130 bad files. The
    host's bad_samples must end up as the Loader's (over 3 epochs, however it is split)."""
    root = tmp_path_factory.mktemp("many_bad_files_" + "with_a_long_directory_name_" * 4)
    bad = [i for i in range(160) if i % 16]
    data = make_dataset(str(root / "data"), 160, bad={i: "not-jpeg" for i in bad})
    out = str(tmp_path_factory.mktemp("many-bad-out"))
    job = launch(1, 1, "bad", out, "--data", data, "--bad", ",".join(map(str, bad)),
                 "--batch", "128", "--epochs", "3", limit=60)
    res = read(out, "host0.json")
    assert res is not None, job.explain()           # the skip part ran to its end
    assert len(res["loader_bad_samples"]) > 100, res["loader_bad_samples"]
    assert set(res["skip_bad_samples"]) == set(res["loader_bad_samples"]), \
        f"host got {len(res['skip_bad_samples'])} of {len(res['loader_bad_samples'])}"


# --- dead and hung workers -----------------------------------------------------------------------

LIVENESS = 3.0


@pytest.mark.parametrize("signal,env,launcher,when", [
    ("KILL", "shm", "default", "mid-epoch"),
    ("KILL", "nolocal", "disable-auto-cleanup", "mid-epoch"),
    ("STOP", "shm", "default", "mid-epoch"),
    ("STOP", "nolocal", "default", "mid-epoch"),
    ("STOP", "nolocal", "default", "between-epochs"),
], ids=["kill-shm", "kill-nolocal-no-auto-cleanup", "stop-shm", "stop-nolocal",
        "stop-between-epochs-nolocal"])
@pytest.mark.slow
def test_dead_or_hung_worker_ends_the_job(data, tmp_path, signal, env, launcher, when):
    """After 3 batches (or between epochs 0 and 1) the host SIGKILLs (or SIGSTOPs) one of its
    2 workers and keeps consuming. The job must end non-zero by itself, not at the launcher's
    deadline: MPI ends it when a rank dies, or the host raises naming the worker once the
    liveness timeout has passed (always so for a hung worker, which MPI cannot see). No rank
    may outlive the job."""
    out = str(tmp_path)
    extra = () if launcher == "default" else ("-disable-auto-cleanup",)
    when_args = ("--between",) if when == "between-epochs" else ("--kill-after", "3")
    job = launch(1, 2, "kill", out, "--data", data, "--slots", "2", "--liveness", str(LIVENESS),
                 "--sleep", "0.05", "--epochs", "3", "--signal", signal, *when_args,
                 env=env, limit=60, launcher_args=extra)
    assert job.returncode != 0 and "OK host=" not in job.stdout, job.explain()
    assert not job.timed_out, job.explain()
    killed = read(out, "killed.json")
    assert killed is not None and len(killed["workers"]) == 2, job.explain()
    err = read(out, "error0.json")
    if signal == "STOP":
        assert err is not None, job.explain()
    if err is not None:
        assert err["type"] in ("PipeTimeout", "ProducerError"), err
        assert f"pid {killed['pid']}" in err["message"], err
        # Not before the liveness timeout (a monotonic clock cannot run short); the upper
        # bound is the job's end by itself, checked above.
        assert err["seconds_after_kill"] >= LIVENESS - 0.5, err
        if err["type"] == "PipeTimeout":
            assert "stopped answering" in err["message"], err
            assert f"liveness_timeout {LIVENESS:g} s" in err["message"], err
    for pid in killed["workers"]:
        assert gone(pid), f"worker pid {pid} outlived the job"


# --- misuse that must not hang -------------------------------------------------------------------

def test_two_loaders_take_turns_on_the_producers(data, tmp_path):
    """Training with one DPULoader, validating with another after 3 batches and after every
    epoch: both streams equal Loader's, within bounded time (the loader that starts cancels
    the other's work in flight, so neither waits for buffers the other holds)."""
    out = str(tmp_path)
    job = launch(1, 1, "interleave", out, "--data", data, "--timeout", "20", "--liveness", "10",
                 "--slots", "2", limit=60)
    assert job.returncode == 0, f"{read(out, 'error0.json')}\n{job.explain()}"
    res = read(out, "host0.json")
    assert res["val_steps"] == N // 4 and res["validations"] == 3


# --- every producer busy, request channel, GIL, takeover, early close ---------------------------

@pytest.mark.parametrize("producers,slots", [(8, 3), (16, 2)], ids=["8x3slots", "16x2slots"])
@pytest.mark.slow
def test_every_producer_busy_whatever_the_slots(data, tmp_path, producers, slots):
    """Producers that take 0.2 s per batch (test-only wrapper) with fewer host slots than
    producers: every producer makes batches, and at some moment all of them are making one at
    once — they make ahead of their grants instead of waiting for a free slot (a producer
    that waited for its grant would keep the overlap at the slot count). Overlap, not the
    rate: the rate depends on the machine's load (``bench/bench_offload.py --scaling``
    measures it)."""
    out = str(tmp_path)
    job = launch(1, producers, "concurrency", out, "--data", data, "--slots", str(slots),
                 "--epochs", "4", "--size", "16",
                 worker_args=("--fixed-delay", "0.2", "--intervals", out), limit=120)
    assert job.returncode == 0, job.explain()
    res = read(out, "host0.json")
    assert len(res["steps_per_producer"]) == producers, res
    intervals = [read(out, f"made{rank}.json") for rank in range(1, producers + 1)]
    assert all(intervals), [len(i) for i in intervals]
    events = sorted([(s, 1) for i in intervals for s, _ in i]
                    + [(e, -1) for i in intervals for _, e in i])
    making = most = 0
    for _, delta in events:     # at equal times an end (-1) sorts before a start
        making += delta
        most = max(most, making)
    assert most == producers, (most, producers, slots)


@pytest.mark.parametrize("env", ["shm", "nolocal"])
@pytest.mark.slow
def test_a_host_waiting_for_a_slow_producer_sleeps_instead_of_polling(data, tmp_path, env):
    """One producer at 0.3 s per batch (test-only wrapper): the host, always waiting, naps
    through most of each batch. Polling alone would take ~70 polls per batch (pacing up to
    5 % of the time waited); the naps must not cost throughput."""
    out = str(tmp_path)
    job = launch(1, 1, "concurrency", out, "--data", data, "--slots", "2", "--epochs", "2",
                 "--size", "16", worker_args=("--fixed-delay", "0.3"), env=env, limit=120)
    assert job.returncode == 0, job.explain()
    res = read(out, "host0.json")
    assert res["rate"] >= 0.85 / 0.3, res
    assert res["polls"] <= 30 * res["all_batches"], res


@pytest.fixture(scope="module")
def misc_run(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("misc"))
    job = launch(1, 2, "misc", out, "--data", data, "--slots", "3", "--bulk", env="nolocal",
                 worker_args=("--fixed-delay", "0"), limit=60)
    return job, read(out, "host0.json")


def test_request_channel_answers_and_carries_errors(misc_run):
    job, res = misc_run
    assert job.returncode == 0, job.explain()
    assert res["ping"] == [{"x": [1, 2, 3]}] * 2
    unknown = res["unknown"]
    assert unknown is not None and "no handler for request kind 'no-such-kind'" in \
        unknown["message"] and "producer rank 1" in unknown["producer"], unknown
    assert "Traceback" in unknown["traceback"]
    # A handler run in pieces, fed by a 24 MB non-blocking transfer, answered by each.
    assert res["bulk"] == [res["bulk_expected"]] * 2 and res["batches_meanwhile"] == 5, res


def test_last_batch_stays_valid_after_the_loop(misc_run):
    job, res = misc_run
    assert job.returncode == 0 and res["last_batch_checked"], job.explain()


def test_producers_fill_the_window_while_the_host_holds_the_gil(misc_run):
    """NOLOCAL (off-node RMA): the host sits 2 s in one C call holding the GIL; every
    granted buffer is filled meanwhile (no host progress needed)."""
    job, res = misc_run
    assert job.returncode == 0, job.explain()
    assert res["granted"] == 2 and res["ready_after_hold"] == res["granted"], res


@pytest.mark.parametrize("where", ["mid-epoch",
                                   pytest.param("between-epochs", marks=pytest.mark.slow)])
def test_hybrid_takes_over_a_stopped_producer(data, tmp_path, where):
    """Hybrid mode: a producer SIGSTOPped (mid-epoch, or between epochs) loses its work to
    the host's thread; every epoch equals the Loader's, every sample once; after SIGCONT the
    woken producer corrupts nothing (two more epochs checked), and the job ends cleanly."""
    out = str(tmp_path)
    extra = ["--between"] if where == "between-epochs" else ["--kill-after", "3"]
    job = launch(1, 2, "takeover", out, "--data", data, "--slots", "3", "--liveness", "2",
                 "--epochs", "5", "--sleep", "0.02", *extra,
                 worker_args=("--fixed-delay", "0.02"), env="nolocal", limit=90)
    assert job.returncode == 0, job.explain()
    res = read(out, "host0.json")
    assert res["host_samples"] > 0 and res["producer_samples"] > 0, res
    assert len(res["takeover_warnings"]) == 1 and f"pid {res['stopped']}" in \
        res["takeover_warnings"][0], res
    assert gone(res["stopped"]), "the stopped producer outlived the job"


@pytest.mark.slow
def test_hybrid_takes_over_a_producer_ten_times_slower(data, tmp_path):
    """Hybrid mode: one producer's batch takes 3 s where the others take 0.05 s (its
    heartbeat goes on): the host takes its work over, the streams stay the Loader's."""
    out = str(tmp_path)
    job = launch(1, 3, "takeover", out, "--data", data, "--slots", "3", "--liveness", "60",
                 "--epochs", "3", "--no-signal",
                 worker_args=("--fixed-delay", "0.05", "--slow-rank", "3", "--slow-delay", "3"),
                 limit=90)
    assert job.returncode == 0, job.explain()
    res = read(out, "host0.json")
    assert len(res["takeover_warnings"]) == 1 and "usual" in res["takeover_warnings"][0], res
    assert f"pid {res['stopped']}" in res["takeover_warnings"][0], res


@pytest.mark.slow
def test_hybrid_stats_count_every_host_thread(data, tmp_path):
    """Hybrid mode, three host threads, producers at 0.3 s per batch: every host thread makes
    batches, and stats()["samples"] is the producers' samples plus every host thread's (not
    only the first thread's)."""
    out = str(tmp_path)
    job = launch(1, 2, "hybrid-stats", out, "--data", data, "--slots", "3",
                 worker_args=("--fixed-delay", "0.3"), limit=90)
    assert job.returncode == 0, job.explain()
    res = read(out, "host0.json")
    assert res["threads_that_made"] == 3, res
    assert res["samples"] == res["producer_samples"] + res["made_here"], res
    assert res["host_samples"] <= res["made_here"] and res["read_s"] > 0, res


def test_host_that_closes_early_ends_the_job(data, tmp_path):
    out = str(tmp_path)
    job = launch(1, 3, "close-early", out, "--data", data, "--slots", "2", limit=60)
    assert job.returncode == 0, job.explain()
    for pid in read(out, "host0.json")["workers"]:
        assert gone(pid), f"worker pid {pid} outlived the job"


@pytest.mark.parametrize("env", ENVS, ids=list(ENVS))
@pytest.mark.parametrize("producers", [1, 3, 8])
@pytest.mark.slow
def test_stream_matrix_equals_loader(data, tmp_path, producers, env):
    """Producers {1, 3, 8} x NOLOCAL {0, 1}, each launch running slots {1, 3} x modes
    {offload, hybrid} with set_epoch jumps and a mid-epoch resume: the Loader's stream."""
    out = str(tmp_path)
    job = launch(1, producers, "matrix", out, "--data", data, env=env, limit=150)
    assert job.returncode == 0, job.explain()
    runs = read(out, "host0.json")["runs"]
    assert [(r["mode"], r["slots"]) for r in runs] == \
        [("offload", 1), ("offload", 3), ("hybrid", 1), ("hybrid", 3)]
    for r in runs:
        if r["mode"] == "offload":
            assert r["host_samples"] == 0, r


RECIPE = {"auto_augment": "ta_wide", "random_erase": 0.5, "interpolation": "bicubic",
          "color_jitter": [0.4, 0.4, 0.4, 0.1], "grayscale_p": 0.2}


@pytest.mark.parametrize("producers", [1, 3])
@pytest.mark.slow
def test_recipe_stream_equals_loader(data, tmp_path, producers):
    """The matrix scenario (offload and hybrid, slots 1 and 3, set_epoch jumps, a resume) with
    an augmented recipe: the producers' ops give the local Loader's stream bit for bit."""
    out = str(tmp_path)
    job = launch(1, producers, "matrix", out, "--data", data, "--recipe", json.dumps(RECIPE),
                 limit=150)
    assert job.returncode == 0, job.explain()
    assert len(read(out, "host0.json")["runs"]) == 4


MIX_RECIPE = {"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "label_smoothing": 0.1,
              "batch_hook": "tests.batch_hooks:noise", "auto_augment": "ta_wide"}


@pytest.mark.parametrize("producers", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_mixed_stream_equals_loader(data, tmp_path, producers):
    """MixUp/CutMix with label smoothing and a batch_hook, offload and hybrid: the producers'
    batches (float32 (B, num_classes) labels through the payload layout) equal the Loader's;
    a hook that raises ends the iteration with an error naming the hook and the batch."""
    out = str(tmp_path)
    job = launch(1, producers, "mix", out, "--data", data, "--recipe", json.dumps(MIX_RECIPE),
                 "--dtype", "float32", limit=150)
    assert job.returncode == 0, job.explain()
    res = read(out, "host0.json")
    assert [r["mode"] for r in res["runs"]] == ["offload", "hybrid"]
    assert res["runs"][0]["host_samples"] == 0 and res["runs"][0]["producer_samples"] > 0
    for mode, err in res["errors"].items():
        assert err is not None, mode
        assert "batch_hook 'tests.batch_hooks:always_fails' raised on batch" in \
            err["message"] and "broken hook" in err["message"], (mode, err)


def test_host_map_naming_no_host_ends_the_job_with_the_reason(data, tmp_path):
    """DPU_PIPE_HOSTMAP wins over hostnames; one that names a host no rank runs on is a
    ConfigError on every rank, and the job ends by itself (not at its deadline)."""
    from mpi_launch import run_mpi

    job = run_mpi(1, "offload_host.py", "close-early", "--data", data, "--out", str(tmp_path),
                  *workers(2), env={"DPU_PIPE_HOSTMAP": "no-such-node:whatever"}, limit=60)
    assert job.returncode != 0 and not job.timed_out, job.explain()
    assert "host map names host 'no-such-node'" in job.stderr, job.explain()
