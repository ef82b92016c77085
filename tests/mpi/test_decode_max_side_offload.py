"""decode_max_side and stick_to_shard in the offloaded modes: both are part of the stream spec
and travel to the producers (the transform's dict, the spec's fields on the wire), so the
offloaded stream is the local Loader's, bit for bit (offload_host.py's ``stream`` scenario
compares every batch with it and checks exactly-once delivery over the hosts)."""
import json
import os
import re
import sys

import pytest

from mpi_launch import ENVS, run_mpi

pytestmark = pytest.mark.timeout(300)

N = 48


@pytest.fixture(scope="module")
def data(mpi_dataset):
    return mpi_dataset(N)


def test_offloaded_decode_max_side_and_stick_to_shard_equal_the_loader(data, tmp_path):
    out = str(tmp_path)
    # Samples are 64..199 pixels a side: 40 reduces nearly all of them.
    recipe = json.dumps({"decode_max_side": 40, "stick_to_shard": True})
    job = run_mpi(2, "offload_host.py", "stream", "--out", out, "--data", data, "--slots", "3",
                  "--epochs", "2", "--recipe", recipe,
                  ":", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "dpu_pipe.worker",
                  env=ENVS["shm"], limit=150)
    assert job.returncode == 0, job.explain()
    assert sorted(re.findall(r"OK host=(\d+)", job.stdout)) == ["0", "1"], job.explain()
    for h in range(2):
        with open(os.path.join(out, f"host{h}.json")) as f:
            res = json.load(f)
        assert res["mode"] == "offload" and not res["warnings"], res
        run = res["runs"][0]
        assert run["batches"] == 2 * N // 4 // 2 and sum(run["steps_per_producer"].values()) \
            == run["batches"], run
