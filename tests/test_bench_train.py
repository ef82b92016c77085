"""``dpu-pipe bench-train --quick``: every configuration runs (the MPI ones under mpiexec) and
the JSON and PNG outputs are written. Values are measurements, not checked here."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("mpi4py")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_bench_train_quick_writes_json_and_plots(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "")
                                                       .split(os.pathsep) if p])
    out, plots = tmp_path / "r.json", tmp_path / "plots"
    proc = subprocess.run([sys.executable, "-m", "dpu_pipe", "bench-train", "--quick",
                           "--json", str(out), "--plots", str(plots),
                           "--cache", str(tmp_path / "data")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "| 5 | DPULoader offload + RemoteValidation |" in proc.stdout
    results = json.loads(out.read_text())
    assert set(results["points"]) == {"aug-bound", "research"}
    for point in results["points"].values():
        configs = {r["config"]: r for r in point["configs"]}
        assert sorted(configs) == [1, 2, 3, 4, 5, 6]
        for c in (1, 2, 3, 4, 5, 6):
            assert "skipped" not in configs[c], configs[c]
            assert len(configs[c]["epochs"]) == results["args"]["epochs"]
    from PIL import Image
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["breakdown.png", "timeline_aug-bound_config2.png",
                     "timeline_aug-bound_config5.png", "timeline_research_config2.png",
                     "timeline_research_config5.png"]
    for name in names:
        with Image.open(plots / name) as im:
            im.verify()
            assert im.format == "PNG" and im.size[0] > 100
