"""DPULoader with a device under mpiexec (1 host, 2 producer ranks), on the fake device
runtime of ``tests/fake_device.py`` (no GPU needed): batches copied to the device straight
from the RMA window registered as pinned memory, each window slot given back to the producers
only once its copy completed, registration undone before the window is freed or made anew,
and the staging path when registration is refused — the stream equal to the local Loader's
in every case. The scenario itself is ``device_host.py``."""
import json
import os
import sys

import pytest

from mpi_launch import run_mpi

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(180)

REFUSAL = "cudaErrorNotSupported: operation not supported (refused by the test runtime)"


@pytest.fixture(scope="module")
def data(mpi_dataset):
    return mpi_dataset(48)


def launch(data, out, *args):
    os.makedirs(out, exist_ok=True)
    job = run_mpi(1, "device_host.py", "--data", data, "--out", out, *args,
                  ":", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "dpu_pipe.worker",
                  limit=120)
    assert job.returncode == 0, job.explain()
    assert "OK host=0" in job.stdout, job.explain()
    with open(os.path.join(out, "host0.json")) as f:
        return json.load(f)


@pytest.mark.slow
def test_batches_go_to_the_device_straight_from_the_registered_window(data, tmp_path):
    res = launch(data, str(tmp_path), "--copy-delay", "0.03")
    # 2 epochs of 12 batches, 8 of batch 6 after the resize, 12 more: all from the window.
    assert res["stats"] == {"device_path": "window", "device_path_reason": None,
                            "device_batches_from_window": 36, "device_batches_staged": 0}
    assert res["big_stats"]["device_batches_from_window"] == 8
    assert res["said"] == []
    # The copies took 30 ms: next() found them in flight and waited before the slot went back
    # (the host script checked that no copy's source changed before it completed).
    assert res["fence_waited"] > 12
    # One window, then the one made for the larger loader: each registered once and
    # unregistered once, before it was freed (the window still there at that moment).
    (a, na), (b, nb) = res["windows"]
    assert res["log"] == [["register", a, na], ["unregister", a],
                          ["register", b, nb], ["unregister", b]]
    assert res["alive"] == [True, True] and res["registered"] == 0


@pytest.mark.slow
def test_refused_registration_stages_every_batch(data, tmp_path):
    res = launch(data, str(tmp_path), "--refuse", REFUSAL, "--copy-delay", "0.005")
    s = res["stats"]
    assert (s["device_path"], s["device_batches_from_window"], s["device_batches_staged"]) \
        == ("staging", 0, 24)
    assert REFUSAL in s["device_path_reason"]
    assert len(res["said"]) == 1 and REFUSAL in res["said"][0]
    assert res["staging_buffers"] == 4          # 2 staging slots x (images, labels)
    assert [e[0] for e in res["log"]] == ["register"] and res["alive"] == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_device_from_the_window(data, tmp_path):
    res = launch(data, str(tmp_path), "--real")
    s = res["stats"]
    assert s["device_batches_from_window"] + s["device_batches_staged"] == 24, s
    # The MPI's window memory may be refused by the driver: then staging, with the reason.
    if s["device_path"] == "window":
        assert s["device_batches_from_window"] == 24, s
    else:
        assert s["device_path_reason"], s
