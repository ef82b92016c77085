"""The README's two quickstarts run as written: the `Loader` block as a script, and the
`mode="offload"` block as `train.py` under the README's own `mpiexec` line."""
import re
import shlex
import sys

import pytest

from helpers import ROOT, repo_env, run

README = (ROOT / "README.md").read_text()


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README, re.S)


def _run(argv, cwd, limit):
    return run(argv, cwd=cwd, env=repo_env(), timeout=limit).stdout


def test_readme_has_the_two_quickstarts():
    blocks = _python_blocks()
    assert len(blocks) == 2, "the README's front page has exactly two Python quickstarts"
    assert "dpu_pipe.Loader(" in blocks[0] and 'mode="offload"' in blocks[1]


@pytest.mark.slow
def test_loader_quickstart_runs(tmp_path):
    (tmp_path / "quickstart.py").write_text(_python_blocks()[0])
    out = _run([sys.executable, "quickstart.py"], tmp_path, 240)
    # The block prints loader.stats(): 2 epochs of 64 samples.
    assert "'samples': 128" in out, out


@pytest.mark.slow
def test_dpuloader_quickstart_runs_under_its_launch_line(tmp_path):
    pytest.importorskip("mpi4py", reason="the offloaded quickstart needs mpi4py")
    from dpu_pipe.mpi import mpiexec_path

    make_data = [line for line in _python_blocks()[0].splitlines()
                 if line.startswith(("from dpu_pipe.tools.sample_data", "make_imagenet_like("))]
    assert len(make_data) == 2, "the first quickstart makes the dataset the second reads"
    _run([sys.executable, "-c", "\n".join(make_data)], tmp_path, 240)
    (tmp_path / "train.py").write_text(_python_blocks()[1])
    launch = [line for line in README.splitlines()
              if line.startswith("mpiexec -n 1 python -m mpi4py train.py")]
    assert len(launch) == 1, "the README shows one launch line for train.py"
    argv = [mpiexec_path() if a == "mpiexec" else sys.executable if a == "python" else a
            for a in shlex.split(launch[0])]
    out = _run(["timeout", "-k", "5", "180", *argv], tmp_path, 200)
    # The block prints stats()["producer_samples"]: every sample of both epochs came from
    # the producer ranks.
    assert out.strip().splitlines()[-1] == "128", out
