"""Progressive resolution offloaded: the schedule travels to the producers in the stream
spec, each batch's shape in its payload header, and the window's slots hold the largest
size; offload and hybrid (threads 1 and 2) make the local Loader's stream bit for bit across
the size changes, set_epoch jumps and resumes (``progressive_host.py`` compares every
batch), and so does an elastic resume from a job of two ranks across the size change."""
import json
import os
import sys

import pytest

from mpi_launch import ENVS, run_mpi

pytestmark = pytest.mark.timeout(300)

N = 16


@pytest.fixture(scope="module")
def data(mpi_dataset):
    return mpi_dataset(N)


def test_progressive_stream_offloaded_equals_the_loader(data, tmp_path):
    out = str(tmp_path)
    job = run_mpi(1, "progressive_host.py", "--data", data, "--out", out,
                  ":", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "dpu_pipe.worker",
                  env=ENVS["shm"], limit=200)
    assert job.returncode == 0, job.explain()
    assert job.stdout.count("OK host=") == 1, job.explain()
    with open(os.path.join(out, "host0.json")) as f:
        res = json.load(f)
    runs = res["runs"]
    assert [(r["mode"], r["threads"]) for r in runs] == \
        [("offload", 1), ("offload", 2), ("hybrid", 1), ("hybrid", 2)]
    for r in runs:
        assert r["shapes"]["0"] == r["shapes"]["1"] == ["[3, 16, 16]"], r
        assert r["shapes"]["2"] == ["[3, 24, 24]"] and r["shapes"]["3"] == ["[3, 32, 32]"], r
        assert r["shapes"]["from-boundary"] == ["[3, 24, 24]", "[3, 32, 32]"], r
        assert r["producer_samples"] > 0, r
    # 16 samples, 2 ranks had read 8 of epoch 2: 8 left for one rank (2 batches at 24 px),
    # then epoch 3 whole (4 batches at 32 px).
    for mode in ("offload", "hybrid"):
        assert res["elastic"][mode] == [[3, 24, 24]] * 2 + [[3, 32, 32]] * 4, res["elastic"]
