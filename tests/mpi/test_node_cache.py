"""The producers' node cache (``cache_bytes`` in the offloaded modes): one cache per node in MPI
shared memory, shared by the node's producers. The stream is the uncached Loader's whatever the
cache holds (cache_host.py compares every batch), across a mid-epoch resume, with a cache
smaller than the data, with corrupt files, with 1-3 producers and off-node (NOLOCAL); a sample
one producer decoded is a hit for another; a writer stalled mid-fill (then SIGKILLed) never
leaves an entry read as whole; RemoteValidation evaluates from the cache."""
import importlib.util
import json
import os
import sys

import pytest

import helpers
from mpi_launch import ENVS, run_mpi

pytestmark = pytest.mark.timeout(300)

N = 48
BAD = {5: "corrupt", 17: "not-jpeg"}
#: The table of a 48-sample cache (128-byte header + 24 bytes per sample, rounded to 64).
TABLE = 1280
HAVE_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture(scope="module")
def data(mpi_dataset):
    return mpi_dataset(N)


def launch(out, scenario, producers, *args, env="shm", extra_env=None, limit=150, data):
    os.makedirs(out, exist_ok=True)
    full_env = dict(ENVS[env], **(extra_env or {}))
    return run_mpi(1, "cache_host.py", scenario, "--out", out, "--data", data, *args,
                   ":", "-n", str(producers), sys.executable, "-m", "mpi4py",
                   "-m", "dpu_pipe.worker", env=full_env, limit=limit)


def result(out):
    with open(os.path.join(out, "host0.json")) as f:
        return json.load(f)


def producers_of(made):
    """{sample: {epoch: producer rank}} from the batches received."""
    who = {}
    for e, batches in enumerate(made):
        for p, indices in batches:
            for i in indices:
                who.setdefault(i, {})[e] = p
    return who


def check_full_offload(run, producers, epochs=3, batch=4):
    """A cache that holds every sample: epoch 0 stores each sample once (N entries); a
    lookup misses only while the sample's first fill is still in flight (a batch of the next
    epoch made ahead, at most a batch per producer), and every lookup after is a hit,
    whichever producer makes the batch."""
    first, last = run["cache"][0], run["cache"][-1]
    assert first["entries"] == N and first["did_not_fit"] == 0, run
    extra = first["misses"] - N
    assert 0 <= extra <= producers * batch, run
    assert last["misses"] == first["misses"] and last["entries"] == N, run
    assert last["hits"] >= (epochs - 1) * N, run
    assert last["bytes"] <= N * 40 * 40 * 3, run
    if producers > 1:
        who = producers_of(run["made"])
        # Made in epoch 1 by another producer than in epoch 0, and no miss after the few
        # above: hits on what another producer decoded.
        crossed = [i for i, d in who.items() if 0 in d and 1 in d and d[0] != d[1]]
        assert len(crossed) > extra, who


@pytest.mark.parametrize("producers", [2, pytest.param(1, marks=pytest.mark.slow),
                                       pytest.param(3, marks=pytest.mark.slow)])
def test_cached_offload_and_hybrid_equal_the_uncached_loader(data, tmp_path, producers):
    out = str(tmp_path)
    job = launch(out, "stream", producers, data=data)
    assert job.returncode == 0, job.explain()
    res = result(out)
    check_full_offload(res["offload"], producers)
    hybrid = res["hybrid"]["cache"][-1]
    # Host threads do not cache: what they made is decoded by a producer later, if at all.
    assert 0 < hybrid["entries"] <= N and hybrid["hits"] > 0, res["hybrid"]


@pytest.mark.slow
def test_off_node_each_producer_caches_for_itself(data, tmp_path):
    """NOLOCAL: MPICH puts every rank on a node of its own, so each producer has a cache
    of its own; the stream is the same and the host sums the nodes' counters."""
    out = str(tmp_path)
    job = launch(out, "stream", 2, env="nolocal", data=data)
    assert job.returncode == 0, job.explain()
    run = result(out)["offload"]
    first, last = run["cache"][0], run["cache"][-1]
    assert N <= first["entries"] <= first["misses"], run
    assert N < last["entries"] <= 2 * N and last["hits"] > 0, run


def test_partial_fill_keeps_the_stream(data, tmp_path):
    """A cache that holds about a third of the samples: the rest are refused once
    (did_not_fit) and decoded every epoch; the stream is the same."""
    out = str(tmp_path)
    job = launch(out, "stream", 2, "--cache-bytes", str(TABLE + 60000), "--modes", "offload",
                 data=data)
    assert job.returncode == 0, job.explain()
    run = result(out)["offload"]
    first, last = run["cache"][0], run["cache"][-1]
    assert 0 < first["entries"] < N and first["entries"] + first["did_not_fit"] == N, run
    assert last["entries"] == first["entries"], run
    assert last["did_not_fit"] == first["did_not_fit"], run
    assert first["bytes"] <= 60000, run
    assert last["hits"] >= 2 * first["entries"], run


@pytest.fixture(scope="module")
def bad_data(mpi_dataset):
    return mpi_dataset(N, bad=BAD)


def test_corrupt_files_are_never_cached(bad_data, tmp_path):
    """on_error="skip": the Loader's stream and bad samples; every good sample is stored,
    no bad one."""
    out = str(tmp_path)
    job = launch(out, "stream", 2, "--on-error", "skip", "--modes", "offload", data=bad_data)
    assert job.returncode == 0, job.explain()
    run = result(out)["offload"]
    assert run["bad"] == sorted(BAD), run
    assert run["cache"][-1]["entries"] == N - len(BAD), run


def test_a_writer_stalled_mid_fill_is_never_read_and_killing_it_ends_the_job(data, tmp_path):
    """Hybrid, 2 producers: the producer that fills sample 7 stops with half its pixels
    copied (DPU_PIPE_TEST_FILL_STALL) and is taken over; the others find the entry FILLING,
    decode the sample themselves, and every epoch equals the uncached Loader's. The host
    then SIGKILLs that producer, still mid-fill: MPI ends the job, by itself."""
    out = str(tmp_path)
    job = launch(out, "fault", 2, "--kill", extra_env={"DPU_PIPE_TEST_FILL_STALL": "7:600000"},
                 limit=120, data=data)
    assert not job.timed_out, job.explain()
    assert "OK host=0" in job.stdout, job.explain()
    res = result(out)
    assert len(res["takeover_warnings"]) == 1 and res["stalled"] in res["workers"], res
    assert res["cache"]["entries"] < N, res
    assert job.returncode != 0, job.explain()        # the kill ended the job


@pytest.mark.skipif(not HAVE_TORCH, reason="RemoteValidation needs torch")
@pytest.mark.slow
def test_validation_from_the_node_cache_equals_uncached(data, tmp_path):
    out = str(tmp_path)
    job = launch(out, "validation", 2, data=data)
    assert job.returncode == 0, job.explain()
    res = result(out)
    local = res["local"]
    for name in ("uncached", "cached"):
        for run in res[name]:
            assert run["count"] == local["count"] == N, res
            assert run["top1"] == local["top1"] and run["top5"] == local["top5"], res
            assert run["loss"] == pytest.approx(local["loss"], rel=1e-6), res
    assert all(c is None for run in res["uncached"] for c in run["cache"]), res
    first, second = res["cached"]
    # One node: both producers report the same arena. The first snapshot fills it, the
    # second is evaluated from it (no new miss).
    c1 = max(first["cache"], key=lambda c: c["hits"] + c["misses"])
    c2 = max(second["cache"], key=lambda c: c["hits"] + c["misses"])
    assert c1["entries"] == N and c1["misses"] == N, res
    assert c2["misses"] == N and c2["hits"] >= N, res


#: What a producer's resident memory may grow by beyond what the cache stores: the table's
#: pages, the last pixel page, a second stream's kernel and the allocator's noise.
RSS_SLACK = 8 << 20


def test_producer_memory_grows_by_at_most_what_the_cache_holds(tmp_path):
    """40 photographs of 480x360 and more, reduced to 320 x ~240 (~9 MB in all), in a 64 MiB
    node cache: each producer's resident memory grows by what the cache stores (the pages it
    touched, at most the whole arena), not by cache_bytes."""
    data = helpers.photo_folder(tmp_path / "ds", 40, shape=(360, 2, 480, 2), quality=85)
    out = str(tmp_path / "out")
    cache_bytes = 64 << 20
    job = launch(out, "memory", 2, "--max-side", "320", "--size", "64", "--cache-bytes",
                 str(cache_bytes), data=str(data))
    assert job.returncode == 0, job.explain()
    res = result(out)
    c = res["cache"]
    assert c["entries"] == 40 and c["bytes"] > 8 << 20, res
    for g in res["growth"]:
        assert g <= min(cache_bytes, c["bytes"] + TABLE) + RSS_SLACK, res
    # Some producer touched the pages it stored or read (the measurement sees the cache).
    assert max(res["growth"]) >= c["bytes"] // 4, res
