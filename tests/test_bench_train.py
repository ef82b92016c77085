"""``dpu-pipe bench-train``: the JSON and PNG outputs are written with their keys and names (one
local configuration), and with ``--quick`` every configuration runs, the MPI ones under
mpiexec; the recipes' options and baselines are checked without a run
(quick tier). Values are measurements, not checked here."""
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


@pytest.mark.slow
def test_bench_train_one_local_configuration_writes_json_and_plots(tmp_path):
    proc, results, plots = _bench_train(tmp_path, "--points", "aug-bound", "--configs", "3",
                                        "--epochs", "1", timeout=300)
    assert "| 3 | Loader on the host |" in proc.stdout
    assert set(results) == {"args", "machine", "recipe", "recipe_name", "data", "calibration",
                            "points", "seconds"}
    assert results["recipe_name"] == "classic"
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


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("recipe", ["tv-new", "vit"])
def test_bench_train_heavy_recipe_trains_with_soft_labels(tmp_path, recipe):
    """torchvision v2's recipe (serial, with MixUp/CutMix in the loop) and the Loader's
    (the same options as dpu_pipe transform keywords) both train with the recipe."""
    proc, results, _ = _bench_train(tmp_path, "--points", "aug-bound", "--configs", "1,3",
                                    "--epochs", "1", "--recipe", recipe, timeout=840)
    assert results["recipe_name"] == recipe and f"{recipe} recipe" in results["recipe"]
    assert f"Training recipe: {recipe}" in proc.stdout
    (point,) = results["points"].values()
    assert sorted(r["config"] for r in point["configs"]) == [1, 3]
    for r in point["configs"]:
        assert CONFIG_KEYS <= set(r) and len(r["epochs"]) == 1


def test_recipes_are_valid_transform_options_and_torchvision_baselines():
    """Every bench-train recipe is a TransformConfig dpu_pipe accepts, and its torchvision
    baseline makes normalized (3, S, S) samples and, with mixing, float32 (B, K) labels: rows
    that sum to 1 with all their weight on the batch's own classes."""
    import io

    import numpy as np
    from PIL import Image

    torch = pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    from dpu_pipe.tools.baselines import Recipe
    from dpu_pipe.tools.harness import RECIPES, recipe_options
    from dpu_pipe.transforms import TransformConfig

    y, x = np.mgrid[0:96, 0:128]
    img = np.stack([x * 2, y * 2, (x + y) % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    labels = torch.tensor([1, 4, 4, 7])
    for name in RECIPES:
        opts = recipe_options(name, 10)
        assert TransformConfig(train=True, size=(32, 32), **opts).train
        rec = Recipe(32, True, name, 10)
        xs = torch.stack([rec(data, k) for k in range(4)])
        assert xs.shape == (4, 3, 32, 32) and xs.dtype == torch.float32
        images, soft = rec.batch(xs, labels, 5)
        assert images.shape == xs.shape
        if not opts.get("mixup_alpha"):
            assert soft is labels
            continue
        assert soft.shape == (4, 10) and soft.dtype == torch.float32
        assert torch.allclose(soft.sum(1), torch.ones(4))
        assert float(soft[:, [1, 4, 7]].sum()) == pytest.approx(4.0)
