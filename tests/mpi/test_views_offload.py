"""Multi-view recipes in the offloaded modes: the views travel in the stream spec, the one
wire format carries a batch of every view, and offload and hybrid give the local Loader's
stream bit for bit (views_host.py compares every view of every batch, kernel threads 1 and
2, and checks exactly-once delivery)."""
import json
import os
import sys

import pytest

from mpi_launch import ENVS, run_mpi

pytestmark = pytest.mark.timeout(300)

N = 20


def test_offloaded_views_equal_the_loader(mpi_dataset, tmp_path):
    out = str(tmp_path)
    job = run_mpi(1, "views_host.py", "--out", out, "--data", mpi_dataset(N),
                  ":", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "dpu_pipe.worker",
                  env=ENVS["shm"], limit=200)
    assert job.returncode == 0, job.explain()
    assert "OK host=0" in job.stdout, job.explain()
    with open(os.path.join(out, "host0.json")) as f:
        runs = json.load(f)["runs"]
    assert [(r["mode"], r["threads"]) for r in runs] == \
        [("offload", 1), ("hybrid", 1), ("offload", 2), ("hybrid", 2)]
    # Offload: every sample made by the producers.
    assert all(r["producer_samples"] == 2 * N and not r["host_samples"]
               for r in runs if r["mode"] == "offload"), runs
