"""examples/train_ssl.py, the DINO-style pretraining example, under mpiexec: 2 host ranks + 2
producer ranks making the views (2 global + 2 local per image), a tiny model on a tiny dataset,
CPU and gloo.

A run stopped after some steps and resumed ends with the same teacher, bit for bit, and the
same per-epoch losses as an uninterrupted run; local and offload modes train on the same views,
so they end with the same teacher too."""
import json
import subprocess
import sys

import numpy as np
import pytest

from helpers import repo_env
from mpi_launch import ROOT
from test_train_example import data  # noqa: F401  (the tiny dataset, a module fixture)

torch = pytest.importorskip("torch")
pytest.importorskip("mpi4py")

from dpu_pipe.mpi import mpiexec_path  # noqa: E402

SCRIPT = ROOT / "examples" / "train_ssl.py"
TIMED = {"img_per_s", "views_per_s", "data_wait_share"}


def run(data, run_dir, mode="offload", extra=()):   # noqa: F811
    host = [sys.executable, "-m", "mpi4py", str(SCRIPT), "--train", str(data / "train"),
            "--epochs", "2", "--batch-size", "8", "--global-size", "32", "--local-size", "16",
            "--local-crops", "2", "--arch", "resnet_tiny", "--width", "4", "--out-dim", "32",
            "--lr", "0.001", "--seed", "5", "--mode", mode, "--checkpoint", str(run_dir),
            "--json", str(run_dir / "log.json"), "--timeout", "120", *extra]
    line = [mpiexec_path(), "-n", "2", *host]
    if mode != "local":
        line += [":", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "dpu_pipe.worker"]
    proc = subprocess.run(["timeout", "-k", "5", "240", *line], cwd=ROOT,
                          env=repo_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc


def assert_same_run(a, b):
    ra, rb = (json.loads((d / "log.json").read_text()) for d in (a, b))
    assert [r["epoch"] for r in ra] == [r["epoch"] for r in rb] == [0, 1]
    for x, y in zip(ra, rb):
        assert {k: v for k, v in x.items() if k not in TIMED} == \
            {k: v for k, v in y.items() if k not in TIMED}
        assert np.isfinite(x["train_loss"]) and x["world_size"] == 2
    wa, wb = (torch.load(d / "final_teacher.pt") for d in (a, b))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):   # noqa: F811
    d = tmp_path_factory.mktemp("ssl")
    run(data, d)
    return d


@pytest.mark.slow
def test_stop_and_resume_is_bit_identical(data, tmp_path, uninterrupted):   # noqa: F811
    proc = run(data, tmp_path, extra=("--stop-after-steps", "4"))
    assert "stopped" in proc.stdout and not (tmp_path / "final_teacher.pt").exists()
    run(data, tmp_path, extra=("--resume",))
    assert_same_run(uninterrupted, tmp_path)


@pytest.mark.slow
def test_local_mode_trains_on_the_same_views(data, tmp_path, uninterrupted):   # noqa: F811
    run(data, tmp_path, mode="local")
    assert_same_run(uninterrupted, tmp_path)
