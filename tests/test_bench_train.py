"""``dpu-pipe bench-train``: the JSON and PNG outputs are written with their keys and names (one
local configuration, quick tier), and with ``--quick`` every configuration runs, the MPI ones
under mpiexec (slow tier). Values are measurements, not checked here."""
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



def _bench_train(tmp_path, *extra, timeout):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "")
                                                       .split(os.pathsep) if p])
    out, plots = tmp_path / "r.json", tmp_path / "plots"
    proc = subprocess.run([sys.executable, "-m", "dpu_pipe", "bench-train", "--quick",
                           "--json", str(out), "--plots", str(plots),
                           "--cache", str(tmp_path / "data"), *extra],
                          cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc, json.loads(out.read_text()), plots


def _check_pngs(plots, names):
    from PIL import Image
    assert sorted(p.name for p in plots.iterdir()) == names
    for name in names:
        with Image.open(plots / name) as im:
            im.verify()
            assert im.format == "PNG" and im.size[0] > 100


#: Keys every configuration's record has in the JSON (the offloaded ones have more).
CONFIG_KEYS = {"config", "name", "epoch_s", "images_per_s", "wait_s", "wait_share",
               "val_host_s", "producer_busy_s", "epochs", "final_top1", "timeline", "train_s",
               "compute_s", "other_s", "wall_s", "epochs_run", "time_to_accuracy_s",
               "producers"}


def test_bench_train_one_local_configuration_writes_json_and_plots(tmp_path):
    proc, results, plots = _bench_train(tmp_path, "--points", "aug-bound", "--configs", "3",
                                        "--epochs", "1", timeout=300)
    assert "| 3 | Loader on the host |" in proc.stdout
    assert set(results) == {"args", "machine", "recipe", "data", "calibration", "points",
                            "seconds"}
    assert results["args"]["configs"] == [3] and results["args"]["points"] == ["aug-bound"]
    (point,) = results["points"].values()
    assert set(point) == {"configs", "summary", "val_count"}
    (record,) = point["configs"]
    assert CONFIG_KEYS <= set(record), sorted(CONFIG_KEYS - set(record))
    assert record["config"] == 3 and len(record["epochs"]) == 1
    _check_pngs(plots, ["breakdown.png"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_train_quick_writes_json_and_plots(tmp_path):
    proc, results, plots = _bench_train(tmp_path, timeout=540)
    assert "| 5 | DPULoader offload + RemoteValidation |" in proc.stdout
    assert set(results["points"]) == {"aug-bound", "research"}
    for point in results["points"].values():
        configs = {r["config"]: r for r in point["configs"]}
        assert sorted(configs) == [1, 2, 3, 4, 5, 6]
        for c in (1, 2, 3, 4, 5, 6):
            assert "skipped" not in configs[c], configs[c]
            assert len(configs[c]["epochs"]) == results["args"]["epochs"]
            assert CONFIG_KEYS <= set(configs[c]), (c, sorted(CONFIG_KEYS - set(configs[c])))
    _check_pngs(plots, ["breakdown.png", "timeline_aug-bound_config2.png",
                        "timeline_aug-bound_config5.png", "timeline_research_config2.png",
                        "timeline_research_config5.png"])
