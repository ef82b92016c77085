"""Elastic resume of DPULoader under mpiexec: a job of H1 hosts stops mid-epoch and saves
every host's state; a job of H2 hosts (other producers) loads them with ``elastic=True`` and,
offloaded and hybrid, makes the Loader's stream bit for bit (``elastic_host.py`` compares
each batch in the host). Checked here: the two parts of the interrupted epoch hold every
sample once (valid rows of ``shard_tail="mask"``), every host of a job runs the same number
of batches, and the next epoch is the new world size's."""
import json
import os
import sys

import numpy as np
import pytest

from mpi_launch import run_mpi

pytestmark = pytest.mark.timeout(400)

N = 26
BS = 4
SEED = 11


@pytest.fixture(scope="module")
def data(mpi_dataset):
    return mpi_dataset(N)


def job(hosts, producers, *args):
    tail = [":", "-n", str(producers), sys.executable, "-m", "mpi4py", "-m", "dpu_pipe.worker"]
    j = run_mpi(hosts, "elastic_host.py", *args, *tail, limit=150)
    assert j.returncode == 0, j.explain()
    # Counted, not split into lines: the ranks' prints may interleave on one line.
    assert j.stdout.count("OK host=") == hosts, j.explain()
    return j


@pytest.mark.parametrize("before,after", [
    pytest.param((2, 1), (3, 3), id="2to3"),
    pytest.param((3, 1), (2, 2), id="3to2", marks=pytest.mark.slow)])
def test_dpuloader_resumes_elastically(data, tmp_path, before, after):
    from dpu_pipe.sampler import EpochSampler

    saved, resumed = str(tmp_path / "saved"), str(tmp_path / "resumed")
    os.makedirs(saved)
    os.makedirs(resumed)
    job(*before, "save", "--data", data, "--out", saved, "--take", "1")
    job(*after, "resume", "--data", data, "--out", resumed, "--states",
        os.path.join(saved, "states.json"))
    with open(os.path.join(saved, "part1.json")) as f:
        part1 = json.load(f)
    with open(os.path.join(resumed, "result.json")) as f:
        result = json.load(f)
    w_old, w_new = before[0], after[0]
    read = BS * w_old
    perm = EpochSampler(N, seed=SEED).permutation(0)
    assert sorted(part1) == sorted(perm[:read].tolist())
    rest = N - read
    fresh = [EpochSampler(N, seed=SEED, rank=r, world_size=w_new, shard_tail="mask")
             for r in range(w_new)]
    for mode in ("offload", "hybrid"):
        first, second = result[mode]
        # The rest of epoch 0: every sample the saved job had not read, once.
        assert sorted(part1 + first["valid"]) == list(range(N)), mode
        per_rank = -(-rest // w_new)
        assert len(first["labels"]) == per_rank * w_new
        assert first["batches"] == [-(-per_rank // BS)] * w_new
        # Epoch 1: the new world size's whole epoch.
        assert second["labels"] == np.concatenate([s.indices(1) for s in fresh]).tolist()
        assert sorted(second["valid"]) == list(range(N))
        assert len(set(second["batches"])) == 1
