"""DPULoader over WebDataset tar shards, Parquet files and a user's factory source: producer
ranks rebuild each source from its spec, and every batch of the offload and hybrid modes
(slots 1 and 3, set_epoch jumps, a mid-epoch resume: offload_host.py's matrix) equals the
local Loader's, each epoch's samples exactly once — with shared memory and with NOLOCAL."""
import json
import os
import sys

import pytest

from dpu_pipe.sources import ImageFolder

import dataset_formats as dfm
from helpers import ROOT, TESTS
from mpi_launch import ENVS, run_mpi

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

N = 24


@pytest.fixture(scope="module")
def folder(mpi_dataset):
    return ImageFolder(mpi_dataset(N))


def _data(kind, folder, tmp):
    if kind == "tar":
        dfm.write_tars(folder, os.path.join(tmp, "s-%d.tar"), 10)
        return os.path.join(tmp, "s-{0..2}.tar")
    if kind == "parquet":
        return dfm.write_parquet(folder, os.path.join(tmp, "x.parquet"), row_group_size=7)
    return json.dumps({"factory": "user_source:every_kth",
                       "args": {"root": folder.root, "k": 1}})


@pytest.mark.parametrize("env", list(ENVS))
@pytest.mark.parametrize("kind", ["tar", "parquet", "factory"])
def test_offloaded_stream_over_other_sources(folder, tmp_path, kind, env):
    if kind == "parquet":
        pytest.importorskip("pyarrow")
    data = _data(kind, folder, str(tmp_path))
    out = tmp_path / "out"
    out.mkdir()
    # Producers import the user's module by name: it must be on their path.
    environ = dict(ENVS[env], PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    job = run_mpi(1, "offload_host.py", "matrix", "--out", out, "--data", data,
                  ":", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "dpu_pipe.worker",
                  env=environ, limit=200)
    assert job.returncode == 0, job.explain()
    runs = json.loads((out / "host0.json").read_text())["runs"]
    assert [(r["mode"], r["slots"]) for r in runs] == \
        [("offload", 1), ("offload", 3), ("hybrid", 1), ("hybrid", 3)]
    assert all(r["host_samples"] == 0 for r in runs if r["mode"] == "offload"), runs
