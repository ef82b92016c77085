"""The hostile dataset of tests/test_hostile_files.py through DPULoader (1 host, 2 producer
ranks): the skip stream and its bad-sample records equal the local Loader's, and raise ends
with the Loader's DecodeError (same sample, same file) — the producers read the files, so
files that vanish after listing are met by them."""
import json
import os
import sys

import pytest

from mpi_launch import run_mpi

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def hostile_list(tmp_path_factory):
    import test_hostile_files as th

    src, _, expect, _ = th.hostile.__wrapped__(tmp_path_factory)
    path = str(tmp_path_factory.mktemp("list") / "hostile.txt")
    with open(path, "w") as f:
        for i in range(len(src)):
            f.write(f"{src.describe(i)} {i}\n")
    return path, src, expect


@pytest.mark.slow
def test_hostile_files_through_dpuloader(hostile_list, tmp_path):
    path, src, expect = hostile_list
    out = str(tmp_path)
    job = run_mpi(1, "reliability_host.py", "hostile", "--data", path, "--out", out,
                  "--epochs", "2", ":", "-n", "2", sys.executable, "-m", "mpi4py", "-m",
                  "dpu_pipe.worker", limit=200)
    assert job.returncode == 0, job.explain()
    with open(os.path.join(out, "hostile.json")) as f:
        res = json.load(f)
    dpu, ref = res["dpu_bad"], res["loader_bad"]
    assert set(dpu) == set(ref), (sorted(dpu), sorted(ref))
    for i, message in dpu.items():
        assert src.describe(int(i)) in message, message
    for i, e in expect.items():
        if e == "bad":
            assert str(i) in dpu, src.describe(i)
    raised, expected = res["raised"], res["expected"]
    assert raised is not None, "DPULoader(on_error='raise') delivered a bad file"
    assert (raised["index"], raised["path"]) == (expected["index"], expected["path"])
    assert expected["path"] in raised["message"]
