"""DPULoader over a sharded packed dataset whose JPEGs were transcoded at pack time: producer
ranks reopen it from its spec and map only the shards their steps read. The stream must be the
local Loader's over the same dataset, bit for bit, and exactly once over the epoch; the local
Loader's stream over a transcoded packed dataset equals the original files' (test_packed.py),
so the offloaded one does too."""
import json
import re
import sys

import pytest

from dpu_pipe import pack
from dpu_pipe.sources import ImageFolder

from mpi_launch import ENVS, run_mpi

pytestmark = pytest.mark.timeout(300)

N = 24


def test_offloaded_stream_over_a_transcoded_sharded_dataset(mpi_dataset, tmp_path):
    root = mpi_dataset(N)
    packed = pack(ImageFolder(root), tmp_path / "packed", shard_size=40_000, transcode=True,
                  progress=False)
    assert packed.dataset.num_shards >= 3
    assert int(packed.dataset.shards["transcoded"].sum()) == N
    out = tmp_path / "out"
    out.mkdir()
    job = run_mpi(1, "offload_host.py", "stream", "--out", out, "--data", packed.path,
                  "--slots", "3", "--epochs", "2",
                  ":", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "dpu_pipe.worker",
                  env=ENVS["shm"], limit=90)
    assert job.returncode == 0, job.explain()
    assert re.findall(r"OK host=(\d+)", job.stdout) == ["0"], job.explain()
    res = json.loads((out / "host0.json").read_text())
    assert res["mode"] == "offload" and not res["warnings"], res
    run = res["runs"][0]
    assert run["batches"] == 2 * (N // 4), run
    assert set(run["steps_per_producer"]) == {"1", "2"}, run
