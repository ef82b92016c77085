"""torchrun starts processes that are no MPI job: DPULoader(mode="offload") refuses to run
there (naming the MPMD launch line) within its set-up time; hybrid mode produces locally."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import free_port, repo_env
from mpi_launch import HERE, ROOT

pytest.importorskip("torch")
pytest.importorskip("mpi4py")


@pytest.mark.slow
def test_offload_under_torchrun_without_producers_is_a_config_error(tmp_path):
    from PIL import Image
    import numpy as np

    for i in range(10):
        d = tmp_path / f"c{i % 2}"
        d.mkdir(exist_ok=True)
        Image.fromarray(np.full((24, 30, 3), 20 * i, np.uint8)).save(d / f"{i}.jpg")
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(["timeout", "-k", "5", "120", str(torchrun), "--nproc_per_node", "2",
                           "--master_port", str(free_port()), str(HERE / "torchrun_host.py"), str(tmp_path)],
                          cwd=ROOT, env=repo_env(OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    ok = sorted(re.findall(r"OK rank=(\d) world=2 offload=ConfigError hybrid=(\d+)",
                           proc.stdout))
    assert ok == [("0", "5"), ("1", "5")], proc.stdout
    assert "no producer rank serves this host" in proc.stderr
