"""examples/train_imagenet.py, the reference DDP script, under mpiexec: 2 host ranks + 2
producer ranks, a tiny model on a tiny generated dataset, CPU and gloo.

A run stopped after some steps (``--stop-after-steps``, or SIGTERM as a preempted job gets)
and resumed must end with the same weights, bit for bit, and the same per-epoch metrics as an
uninterrupted run; local, offload and hybrid modes train on the same stream, so they give the
same metrics too."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from helpers import repo_env
from mpi_launch import ROOT

torch = pytest.importorskip("torch")
pytest.importorskip("mpi4py")

from dpu_pipe.mpi import mpiexec_path  # noqa: E402

SCRIPT = ROOT / "examples" / "train_imagenet.py"
KEYS = {"epoch", "train_loss", "val_top1", "val_top5", "val_loss", "val_count", "img_per_s",
        "data_wait_share", "world_size", "producers"}
TIMED = {"img_per_s", "data_wait_share"}
STEPS_PER_EPOCH = 3         # 48 images, 2 hosts, batch 8


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("tiny")
    rng = np.random.default_rng(0)
    for split, n in (("train", 48), ("val", 21)):
        for i in range(n):
            c = i % 3
            d = root / split / f"c{c}"
            d.mkdir(parents=True, exist_ok=True)
            a = rng.integers(0, 255, (40 + i % 7, 48, 3), dtype=np.uint8)
            a[..., c] = 255 - a[..., c] // 4          # a learnable class signal
            Image.fromarray(a).save(d / f"{i:04d}.jpg", quality=85)
    return root


def argv(data, run_dir, mode="offload", producers=2, extra=(), hosts=2):
    host = [sys.executable, "-m", "mpi4py", str(SCRIPT), "--train", str(data / "train"),
            "--val", str(data / "val"), "--epochs", "2", "--batch-size", "8", "--size", "32",
            "--arch", "resnet_tiny", "--width", "4", "--lr", "0.05", "--seed", "3",
            "--mode", mode, "--checkpoint", str(run_dir), "--json", str(run_dir / "log.json"),
            "--log-every", "1", "--timeout", "120", *extra]
    line = [mpiexec_path(), "-n", str(hosts), *host]
    if producers:
        line += [":", "-n", str(producers), sys.executable, "-m", "mpi4py", "-m",
                 "dpu_pipe.worker"]
    return ["timeout", "-k", "5", "240", *line]


def env():
    return repo_env(OMP_NUM_THREADS="1")


def run(data, run_dir, **kw):
    proc = subprocess.run(argv(data, run_dir, **kw), cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc


def records(run_dir):
    return json.loads((run_dir / "log.json").read_text())


def weights(run_dir):
    return torch.load(run_dir / "final_weights.pt")


def assert_same_run(a, b):
    ra, rb = records(a), records(b)
    assert [r["epoch"] for r in ra] == [r["epoch"] for r in rb] == [0, 1]
    for x, y in zip(ra, rb):
        assert set(x) == KEYS == set(y)
        assert {k: v for k, v in x.items() if k not in TIMED} == \
            {k: v for k, v in y.items() if k not in TIMED}
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def host_pids(run_dir):
    """Processes running the script for ``run_dir`` (its path is on their command line)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if cmd[0] == os.fsencode(sys.executable) and os.fsencode(SCRIPT) in cmd \
                and os.fsencode(run_dir) in cmd:
            pids.append(int(entry))
    return pids


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    run(data, d)
    return d


@pytest.mark.slow
def test_json_is_complete(uninterrupted):
    recs = records(uninterrupted)
    assert [r["epoch"] for r in recs] == [0, 1]
    for r in recs:
        assert set(r) == KEYS
        assert (r["world_size"], r["producers"], r["val_count"]) == (2, 2, 21)
        assert 0 <= r["val_top1"] <= r["val_top5"] <= 1 and r["img_per_s"] > 0
        assert 0 <= r["data_wait_share"] <= 1 and np.isfinite(r["train_loss"])


@pytest.mark.slow
def test_stop_after_steps_and_resume_is_bit_identical(data, tmp_path, uninterrupted):
    proc = run(data, tmp_path, extra=("--stop-after-steps", "5"))
    # 5 steps: all of epoch 0 (3) and 2 of epoch 1.
    assert "stopped after epoch 1 step 2" in proc.stdout, proc.stdout
    assert not (tmp_path / "final_weights.pt").exists()
    run(data, tmp_path, extra=("--resume",))
    assert_same_run(uninterrupted, tmp_path)


@pytest.mark.slow
def test_sigterm_mid_epoch_saves_and_resumes(data, tmp_path, uninterrupted):
    job = subprocess.Popen(argv(data, tmp_path), cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in job.stdout:     # rank 0 logs every step
            if line.startswith("epoch 0 step 1/"):
                break
        hosts = host_pids(tmp_path)
        assert len(hosts) == 2, hosts
        for pid in hosts:
            os.kill(pid, signal.SIGTERM)
        out, err = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, out + err[-4000:]
    assert "checkpoint saved" in out and (tmp_path / "last.pt").exists(), out
    assert not (tmp_path / "final_weights.pt").exists()
    run(data, tmp_path, extra=("--resume",))
    assert_same_run(uninterrupted, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["local", "hybrid"])
def test_modes_give_the_same_metrics(data, tmp_path, uninterrupted, mode):
    run(data, tmp_path, mode=mode)
    a, b = records(uninterrupted), records(tmp_path)
    for x, y in zip(a, b):
        for k in ("epoch", "train_loss", "val_top1", "val_top5", "val_count", "world_size"):
            assert x[k] == y[k], (k, x, y)
        # Summed in another order (producers' parts vs host batches): float64 rounding.
        assert y["val_loss"] == pytest.approx(x["val_loss"], rel=1e-9)
    assert_weights = weights(uninterrupted), weights(tmp_path)
    for k in assert_weights[0]:
        assert torch.equal(assert_weights[0][k], assert_weights[1][k]), k


@pytest.mark.slow
def test_a_checkpoint_of_two_ranks_resumes_on_three(data, tmp_path):
    """Stopped after 2 of epoch 0's 3 steps on 2 hosts (32 of 48 samples trained on), resumed
    on 3 hosts: the loaders continue elastically (the rest of epoch 0, 16 samples, over 3
    ranks: one batch each), then epoch 1 of 3 ranks; validation over 3 ranks counts the 21
    samples once."""
    proc = run(data, tmp_path, mode="local", producers=0, extra=("--stop-after-steps", "2"))
    assert "stopped after epoch 0 step 2" in proc.stdout, proc.stdout
    ckpt = torch.load(tmp_path / "last.pt", weights_only=False)
    assert [s["world_size"] for s in ckpt["loader"]] == [2, 2]
    proc = run(data, tmp_path, mode="local", producers=0, hosts=3, extra=("--resume",))
    assert "epoch 0 step 1/1" in proc.stdout, proc.stdout     # the rest: one step
    assert "epoch 1 step 2/2" in proc.stdout, proc.stdout     # 48 over 3 ranks of 8
    recs = records(tmp_path)
    assert [r["epoch"] for r in recs] == [0, 1]
    for r in recs:
        assert set(r) == KEYS and r["world_size"] == 3 and r["val_count"] == 21
        assert np.isfinite(r["train_loss"]) and 0 <= r["val_top1"] <= r["val_top5"] <= 1
    assert (tmp_path / "final_weights.pt").exists()


@pytest.mark.slow
def test_progressive_resolution_resumes_across_the_size_change(data, tmp_path_factory):
    """FFCV's knobs: 32 px in epoch 0, 64 px from epoch 1 (validation at 32 px). Stopped
    after 2 of epoch 0's 3 steps and resumed, the run crosses the size change as the
    uninterrupted one does and ends with the same weights and metrics."""
    knobs = ("--min-res", "32", "--max-res", "64", "--end-ramp", "1", "--val-res", "32")
    full = tmp_path_factory.mktemp("progressive-full")
    proc = run(data, full, mode="local", producers=0, extra=knobs)
    assert "epoch 0: training at 32x32" in proc.stdout, proc.stdout
    assert "epoch 1: training at 64x64" in proc.stdout, proc.stdout
    part = tmp_path_factory.mktemp("progressive-resumed")
    proc = run(data, part, mode="local", producers=0, extra=knobs + ("--stop-after-steps", "2"))
    assert "stopped after epoch 0 step 2" in proc.stdout, proc.stdout
    ckpt = torch.load(part / "last.pt", weights_only=False)
    assert ckpt["loader"][0]["transform"]["size"]["kind"] == "progressive"
    proc = run(data, part, mode="local", producers=0, extra=knobs + ("--resume",))
    assert "epoch 1: training at 64x64" in proc.stdout, proc.stdout
    assert_same_run(full, part)
