"""dpu-pipe plan: the capacity arithmetic against a case computed by hand, the presets, the
measurement on a dataset, and the command line's errors."""

import io
import json
import os

import numpy as np
import pytest
from PIL import Image

from dpu_pipe.tools import cli
from dpu_pipe.tools.plan import GiB, PRESETS, cache_plan, plan


def test_hand_computed_case():
    # 1000 img/s; 100 img/s per x86 core x 0.5 = 50 img/s per Arm core; 10 % headroom
    # -> 1100 / 50 = 22 cores; 8x8 px uint8 = 192 B per sample, batch 10.
    p = plan(train_rate=1000, producer_rate=100, arm_factor=0.5, headroom=0.1, batch=10,
             size=8, dtype="uint8", preset="bluefield2", jpeg_bytes=50_000,
             process_bytes=1000, kernel_memory_bytes=500)
    assert p["sample_bytes"] == 192
    assert p["producer_core_rate"] == 50
    assert p["producer_cores"] == 22
    assert p["producer_capacity"] == 1100
    assert p["batch_seconds_per_core"] == 0.2                # 10 images at 50 img/s
    assert p["slots"] == 24                                   # 22 producers + 2
    # header 128 B, then indices and labels (10 x 8 B each) padded to 64 B, images, report
    assert p["slot_bytes"] == 320 + 10 * 192 + 16384 == 18624
    assert p["window_bytes"] == 24 * 18624
    assert p["producer_rank_bytes"] == 1000 + (320 + 1920) + 500 == 3740
    assert p["producer_memory_bytes"] == 22 * 3740
    assert p["to_host_bytes_per_s"] == 1000 * (192 + 16)
    assert p["dataset_read_bytes_per_s"] == 1000 * 50_000
    d = p["dpu"]
    assert d["dpus_per_host"] == 3                            # ceil(22 / 8)
    assert d["rate_per_dpu"] == 8 * 50
    assert d["ranks_per_dpu"] == 8
    assert d["memory_per_dpu_bytes"] == 8 * 3740
    assert d["memory_share"] == 8 * 3740 / (16 * GiB)


def test_presets_and_exact_fit():
    assert (PRESETS["bluefield2"]["cores"], PRESETS["bluefield2"]["memory_bytes"]) == (8, 16 * GiB)
    assert (PRESETS["bluefield3"]["cores"], PRESETS["bluefield3"]["memory_bytes"]) == (16, 32 * GiB)
    # 1600 img/s with 100 img/s cores, no headroom: exactly 16 cores, one BlueField-3
    p = plan(train_rate=1600, producer_rate=100, headroom=0, preset="bluefield3", size=224)
    assert p["producer_cores"] == 16 and p["dpu"]["dpus_per_host"] == 1
    assert p["sample_bytes"] == 3 * 224 * 224 * 4
    assert p["dpu"]["ranks_per_dpu"] == 16
    p = plan(train_rate=1601, producer_rate=100, headroom=0, preset="bluefield3", slots=5)
    assert p["producer_cores"] == 17 and p["dpu"]["dpus_per_host"] == 2 and p["slots"] == 5


def _json_run(capsys, *argv):
    assert cli.main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_matches_the_function(capsys):
    p = _json_run(capsys, "--train-rate", "2500", "--producer-rate", "180", "--batch", "128",
                  "--size", "160", "--dtype", "float16", "--preset", "bluefield2",
                  "--arm-factor", "0.4", "--jpeg-bytes", "90000")
    want = plan(train_rate=2500, producer_rate=180, batch=128, size=160, dtype="float16",
                preset="bluefield2", arm_factor=0.4, jpeg_bytes=90000,
                process_bytes=p["producer_rank_parts"]["process"])
    assert p == json.loads(json.dumps(want))
    assert p["producer_cores"] == 39                        # ceil(2750 / 72)
    assert p["producer_rank_parts"]["process"] > 10 * 2**20  # an interpreter with dpu_pipe


def test_measure_times_the_kernel_on_the_users_data(tmp_path, capsys):
    sizes = []
    for k in range(6):
        d = tmp_path / "data" / f"c{k % 2}"
        d.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        g = np.random.default_rng(k)
        Image.fromarray(g.integers(0, 255, (40 + k, 50, 3), dtype=np.uint8)).save(
            buf, format="JPEG", quality=90)
        (d / f"{k}.jpg").write_bytes(buf.getvalue())
        sizes.append(len(buf.getvalue()))
    before = sorted(os.listdir(tmp_path / "data"))
    p = _json_run(capsys, "--train-rate", "100", "--measure", "--data", str(tmp_path / "data"),
                  "--size", "32", "-n", "50")
    m = p["measured"]
    assert m["images"] == 6 and m["rate_per_core"] > 0
    assert m["mean_jpeg_bytes"] == pytest.approx(np.mean(sizes))
    assert p["inputs"]["jpeg_bytes"] == m["mean_jpeg_bytes"]
    assert p["inputs"]["producer_rate"] == m["rate_per_core"]
    assert sorted(os.listdir(tmp_path / "data")) == before      # the user's data untouched


def test_cache_model_hand_computed():
    # 1000 samples of 100x75 at max side 100 (22500 B + 7.5 B mean padding each); the table
    # is 128 + 24 x 1000 = 24128 B; 1 MB holds (1e6 - 24128) // 22507.5 = 43 samples.
    c = cache_plan(cache_bytes=1_000_000, max_side=100, shard_samples=1000, miss_rate=100,
                   hit_rate=400, train_rate=1000, headroom=0.0)
    assert c["bytes_per_sample"] == 100 * 75 * 3 and c["table_bytes"] == 24128
    assert c["samples_fit"] == 43 and c["fraction_cached"] == 0.043
    assert c["rate_per_core_later"] == pytest.approx(1 / (0.043 / 400 + 0.957 / 100))
    assert c["producer_cores_later"] == 10          # ceil(1000 / 103.3)
    # Large enough for the whole shard: every later sample a hit.
    c = cache_plan(cache_bytes=c["bytes_for_whole_shard"], max_side=100, shard_samples=1000,
                   miss_rate=100, hit_rate=400, arm_factor=0.5)
    assert c["samples_fit"] == 1000 and c["rate_per_core_later"] == pytest.approx(200)
    assert c["rate_per_core_first_epoch"] == 50


def test_cache_model_measured_on_the_users_data(tmp_path, capsys):
    d = tmp_path / "data" / "c0"
    d.mkdir(parents=True)
    for k in range(4):
        g = np.random.default_rng(k)
        Image.fromarray(g.integers(0, 255, (120, 160, 3), dtype=np.uint8)).save(
            d / f"{k}.jpg", quality=90)
    p = _json_run(capsys, "--train-rate", "100", "--measure", "--data", str(tmp_path / "data"),
                  "--size", "32", "--cache-bytes", "1e6", "--max-side", "80")
    c = p["cache"]
    assert c["bytes_per_sample"] == 80 * 60 * 3 and c["samples_fit"] == c["shard_samples"] == 4
    assert c["hit_rate"] > 0 and c["miss_rate"] > 0 and c["fraction_cached"] == 1
    assert cli.main(["plan", "--train-rate", "1", "--producer-rate", "1", "--cache-bytes",
                     "1e6", "--max-side", "80"]) == 2
    assert "--hit-rate" in capsys.readouterr().err


def test_measure_names_an_undecodable_sample(tmp_path, capsys):
    d = tmp_path / "data" / "c0"
    d.mkdir(parents=True)
    buf = io.BytesIO()
    Image.fromarray(np.zeros((20, 20, 3), np.uint8)).save(buf, format="JPEG")
    (d / "a.jpg").write_bytes(buf.getvalue())
    (d / "b.jpg").write_bytes(buf.getvalue()[:40])
    assert cli.main(["plan", "--train-rate", "10", "--measure", "--data",
                     str(tmp_path / "data")]) == 1
    assert "b.jpg" in capsys.readouterr().err


@pytest.mark.parametrize("argv,match", [
    (["--train-rate", "100", "--producer-rate", "10", "--preset", "bluefield2"], "--arm-factor"),
    (["--train-rate", "100", "--measure"], "--data"),
    (["--train-rate", "-5", "--producer-rate", "10"], "--train-rate"),
    (["--train-rate", "100", "--producer-rate", "0"], "--producer-rate"),
    (["--train-rate", "100", "--producer-rate", "10", "--arm-factor", "nan"], "--arm-factor"),
    (["--train-rate", "100", "--producer-rate", "10", "--slots", "0"], "--slots"),
])
def test_errors_name_the_flag(capsys, argv, match):
    assert cli.main(["plan", *argv]) == 2
    assert match in capsys.readouterr().err
