"""scripts/gpu_check.sh and its steps (scripts/gpu/*.py) on a machine without a GPU: the dry
run stops with exit 3 and "no GPU" after its import and MPI checks, a missing import stops it
with exit 1; the steps' logic — finding the CUDA-only tests, reading pytest's JUnit XML, the
overlap arithmetic, the copy paths, the offload check under mpiexec, the training records,
the report — runs against tests/fake_device.py's runtime and made-up records, and each check
is shown to fail when what it checks is wrong."""
import hashlib
import json
import os
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
GPU = ROOT / "scripts" / "gpu"
sys.path.insert(0, str(GPU))

import common  # noqa: E402
import cuda_tests  # noqa: E402
import report  # noqa: E402
import train_check  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def run_check(*args, cwd=ROOT, limit=240, **extra_env):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_WHEELHOUSE")}
    env.update(extra_env)
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=limit)


def test_every_script_compiles(tmp_path):
    files = sorted(GPU.rglob("*.py"))
    assert {f.name for f in files} >= {"common.py", "preflight.py", "cuda_tests.py",
                                       "offload_check.py", "copy_timing.py", "train_check.py",
                                       "report.py", "make_data.py", "data.py"}
    for f in files:
        py_compile.compile(str(f), doraise=True, cfile=str(tmp_path / (f.name + "c")))
    for sh in (SCRIPT, ROOT / "scripts" / "gpu_wheelhouse.sh"):
        proc = subprocess.run(["bash", "-n", str(sh)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


# --- the dry run -------------------------------------------------------------------------------

def test_dry_run_without_a_gpu_exits_3_after_its_checks(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("mpi4py")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check runs for real here")
    proc = run_check("--python", sys.executable, "--work", tmp_path / "work",
                     OUT=str(tmp_path / "out"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "no GPU" in out
    # What a device machine would send back.
    assert (tmp_path / "out" / "gpu_logs" / "preflight.json").exists()
    rec = json.loads((tmp_path / "work" / "results" / "preflight.json").read_text())
    checks = {c["name"]: c["ok"] for c in rec["checks"]}
    # Everything but the device was checked, and passed, before "no GPU".
    assert checks.pop("a CUDA device") is False
    assert all(checks.values()) and {"import dpu_pipe", "dpu_pipe kernels decode a JPEG",
                                     "import torch", "import mpi4py", "mpiexec present",
                                     "mpiexec -n 2 runs mpi4py"} <= set(checks)
    assert rec["summary"] == "no GPU"


def test_a_missing_import_exits_1_without_claiming_no_gpu(tmp_path):
    # The same interpreter without its site-packages: no dpu_pipe, no torch.
    bare = tmp_path / "bare-python"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    proc = run_check("--python", bare, "--work", tmp_path / "work")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "FAIL import dpu_pipe" in out and "FAIL import torch" in out
    assert "no GPU" not in out


def test_without_a_wheelhouse_it_says_how_to_build_one(tmp_path):
    proc = run_check("--wheelhouse", tmp_path / "none", "--work", tmp_path / "work", limit=30)
    assert proc.returncode == 1
    assert "scripts/gpu_wheelhouse.sh" in proc.stdout


def test_an_unknown_step_is_refused(tmp_path):
    proc = run_check("--python", sys.executable, "--only", "offload,warp", limit=30)
    assert proc.returncode == 1 and "no step warp" in proc.stderr


@pytest.mark.slow
def test_dry_run_from_the_wheelhouse_installs_and_exits_3(tmp_path):
    """The install path of the GPU machine, on this one: a venv over this Python's packages,
    dpu_pipe and mpich from the wheelhouse (the wheel runs on 3.11 too)."""
    torch = pytest.importorskip("torch")
    wh = Path(os.environ.get("GPU_CHECK_WHEELHOUSE", ROOT / "build" / "gpu-wheelhouse"))
    if not list(wh.glob("dpu_pipe-*-cp311-abi3-*x86_64.whl")):
        pytest.skip(f"no wheelhouse at {wh} (scripts/gpu_wheelhouse.sh)")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check runs for real here")
    proc = run_check("--wheelhouse", wh, "--base-python", sys.executable,
                     "--work", tmp_path / "work", limit=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    rec = json.loads((tmp_path / "work" / "results" / "preflight.json").read_text())
    # The wheel's dpu_pipe, in the check's venv, not this checkout's.
    assert rec["info"]["dpu_pipe_file"].startswith(str(tmp_path / "work" / "venv")), rec["info"]
    assert rec["info"]["mpiexec"].startswith(str(tmp_path / "work" / "venv")), rec["info"]


@pytest.mark.slow
def test_without_a_gpu_the_steps_can_still_run_and_the_report_names_what_failed(tmp_path):
    """--without-gpu goes on past "no GPU": the steps fail where they need CUDA, and the
    report (with the logs, into $OUT) says which and why."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("mpi4py")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check runs for real here")
    out = tmp_path / "out"
    proc = run_check("--python", sys.executable, "--work", tmp_path / "work", "--without-gpu",
                     "--only", "copy-timing,train", OUT=str(out), limit=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text
    report_md = (out / "gpu_report.md").read_text()
    assert report_md.startswith("# dpu_pipe GPU check: FAIL")
    for step in ("preflight", "copy-timing", "train"):
        assert f"| {step} | FAIL |" in report_md
    assert "| offload |" not in report_md and "| cuda-tests |" not in report_md
    assert "- train: the run exited 0: exit 1" in report_md
    assert {"preflight.json", "copy-timing.json", "train.json", "train-run.log"} <= {
        p.name for p in (out / "gpu_logs").iterdir()}


# --- finding and judging the CUDA-only tests ---------------------------------------------------

def test_discover_finds_the_cuda_only_tests(tmp_path):
    found = cuda_tests.discover(ROOT / "tests")
    assert "tests/test_device.py::test_real_cuda_copies_from_registered_memory" in found
    assert "tests/mpi/test_device_offload.py::test_real_cuda_device_from_the_window" in found
    d = tmp_path / "tests" / "sub"
    d.mkdir(parents=True)
    (d / "test_x.py").write_text(
        "import pytest, torch\n"
        "@pytest.mark.skipif(not torch.cuda.is_available(), reason='x')\n"
        "def test_marked(): pass\n"
        "def test_in_body():\n"
        "    if not torch.cuda.is_available():\n"
        "        pytest.skip('no cuda')\n"
        "@pytest.mark.skipif(torch.cuda.is_available(), reason='has cuda')\n"
        "def test_inverse(): pass\n"
        "def test_plain(): pass\n")
    (d / "helper.py").write_text("@skipif(not torch.cuda.is_available())\ndef test_no(): pass\n")
    assert cuda_tests.discover(tmp_path / "tests") == [
        "tests/sub/test_x.py::test_in_body", "tests/sub/test_x.py::test_marked"]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_device" name="test_real_cuda_copies_from_registered_memory"/>
<testcase classname="tests.test_device" name="test_fake"/>
<testcase classname="tests.mpi.test_device_offload" name="test_real_cuda_device_from_the_window">
{offload}</testcase>
<testcase classname="tests.test_p" name="test_q[a]"/><testcase classname="tests.test_p" name="test_q[b]">
{param}</testcase>
</testsuite></testsuites>"""


@pytest.mark.parametrize("offload,param,bad", [
    ("", "", []),
    ('<skipped message="needs a CUDA device"/>', "",
     ["passed with CUDA: tests/mpi/test_device_offload.py::test_real_cuda_device_from_the_window"]),
    ("", '<failure message="boom"/>', ["no test failed", "passed with CUDA: tests/test_p.py::test_q"]),
    ('<error message="fixture"/>', "", [
        "no test failed",
        "passed with CUDA: tests/mpi/test_device_offload.py::test_real_cuda_device_from_the_window"]),
])
def test_check_junit_wants_each_cuda_test_passed(tmp_path, offload, param, bad):
    xml = tmp_path / "r.xml"
    xml.write_text(JUNIT.format(offload=offload, param=param))
    required = ["tests/test_device.py::test_real_cuda_copies_from_registered_memory",
                "tests/mpi/test_device_offload.py::test_real_cuda_device_from_the_window",
                "tests/test_p.py::test_q"]
    checks, counts = cuda_tests.check_junit(xml, required)
    assert [c["name"] for c in checks.failed()] == bad
    assert checks.ok == (not bad) and sum(counts.values()) == 5
    missing, _ = cuda_tests.check_junit(xml, ["tests/test_device.py::test_absent"])
    assert not missing.ok and missing.failed()[-1]["detail"] == "did not run"


# --- measurements ----------------------------------------------------------------------------

def test_overlap_arithmetic():
    from copy_timing import overlap_share

    assert common.interval_overlap((0, 10), (2, 5)) == 3
    assert common.interval_overlap((0, 10), (8, 15)) == 2
    assert common.interval_overlap((0, 1), (2, 3)) == 0
    assert overlap_share((0, 10), (2, 5)) == 1.0         # copy entirely inside the compute
    assert overlap_share((0, 10), (8, 12)) == 0.5
    assert overlap_share((0, 10), (10, 14)) == 0.0       # serial: the copy after the compute
    assert overlap_share((0, 10), (-3, -1)) == 0.0
    assert overlap_share((0, 10), (4, 4)) == 1.0 and overlap_share((0, 10), (11, 11)) == 0.0
    assert common.summarize_ms([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0,
                                                     "n": 3}
    with pytest.raises(ValueError):
        common.summarize_ms([])


def corrupting_device(**kw):
    """tests/fake_device.py's runtime whose copies land with their first value changed: a
    path that delivers wrong data must be caught."""
    from fake_device import FakeDevice

    class Corrupting(FakeDevice):
        def copy_to_device(self, pinned):
            out, event = super().copy_to_device(pinned)
            complete = event._complete

            def wrong():
                complete()
                first = (0,) * out.dim()
                out[first] = out[first] + 1
            event._complete = wrong
            return out, event

    return Corrupting(**kw)


@pytest.mark.parametrize("corrupt", [False, True])
def test_time_paths_on_the_fake_device(corrupt):
    torch = pytest.importorskip("torch")
    from fake_device import FakeDevice

    from copy_timing import WindowBatch, stage_sender, time_paths
    from dpu_pipe.device import DeviceStage, PinnedRegion

    wb = WindowBatch(torch, 4, 24, seed=1)
    assert wb.x.shape == (4, 3, 24, 24) and wb.x.dtype == torch.bfloat16
    assert wb.x.is_contiguous(memory_format=torch.channels_last)
    assert bool(torch.isfinite(wb.x.float()).all()) and wb.mem.ctypes.data % 4096 == 0
    dev = (corrupting_device if corrupt else FakeDevice)(delay=0.002)
    region = PinnedRegion(dev)
    assert region.attach(wb.mem)
    cpu = torch.device("cpu")
    window = DeviceStage(torch, cpu, backend=dev)
    window.window = region
    staging = DeviceStage(torch, cpu, backend=dev)
    paths = {"window": stage_sender(window, wb), "staging": stage_sender(staging, wb)}
    times, exact = time_paths(torch, paths, wb, 3, dev.synchronize)
    assert exact == {"window": not corrupt, "staging": not corrupt}
    assert (window.direct, window.staged, staging.direct, staging.staged) == (4, 0, 0, 4)
    assert times["window"]["total_ms"]["n"] == 3 and "stream_ms" not in times["window"]
    assert all(c.inside(wb.mem.ctypes.data, wb.mem.nbytes) for c in dev.copies[:2])
    region.detach()
    assert not dev.registered


# --- the offload check, under mpiexec on the fake device ----------------------------------------

def run_offload(tmp_path, *extra):
    pytest.importorskip("torch")
    pytest.importorskip("mpi4py")
    from dpu_pipe.mpi import mpiexec_path

    data = tmp_path / "data"
    subprocess.run([sys.executable, str(GPU / "make_data.py"), str(data)], check=True,
                   capture_output=True, timeout=120)
    result = tmp_path / "offload.json"
    argv = ["timeout", "-k", "5", "200", mpiexec_path(), "-n", "1", sys.executable, "-m",
            "mpi4py", str(GPU / "offload_check.py"), "--data", str(data / "offload"),
            "--result", str(result), *extra,
            ":", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "dpu_pipe.worker"]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=230)
    assert result.exists(), proc.stdout + proc.stderr[-3000:]
    return proc, json.loads(result.read_text())


@pytest.mark.slow
def test_offload_check_passes_on_the_fake_device(tmp_path):
    proc, rec = run_offload(tmp_path, "--fake-device", "0.01")
    assert proc.returncode == 0 and rec["ok"], proc.stdout + proc.stderr[-3000:]
    names = [c["name"] for c in rec["checks"]]
    assert "bfloat16 channels_last: bit for bit the local Loader's stream" in names
    assert "a larger batch made the window again" in names
    # 2 epochs of 8 batches of 8, then 4 of 16 in the new window, a third epoch, hybrid.
    assert rec["stats"]["uint8"]["device_batches_from_window"] == 16
    assert rec["stats"]["bfloat16"]["device_batches_from_window"] == 4
    assert rec["stats"]["uint8_again"]["device_batches_from_window"] == 24


@pytest.mark.slow
def test_offload_check_fails_when_registration_is_refused(tmp_path):
    proc, rec = run_offload(tmp_path, "--fake-device", "0.005", "--fake-refuse",
                            "cudaErrorNotSupported: refused by the test")
    assert proc.returncode != 0 and not rec["ok"]
    failed = {c["name"] for c in rec["checks"] if not c["ok"]}
    assert "uint8, 2 epochs: stats() says the registered window" in failed
    assert "no registration refused" in failed
    # The data still arrive intact, staged: only the path is wrong.
    assert "uint8 epoch 0: bit for bit the local Loader's stream" not in failed


# --- the training run's records and the report -------------------------------------------------

GOOD = {"epoch": 0, "train_loss": 2.31, "val_top1": 0.125, "val_top5": 0.5, "val_loss": 2.3,
        "val_count": 80, "img_per_s": 900.0, "data_wait_share": 0.2, "world_size": 1,
        "producers": 2}


@pytest.mark.parametrize("change,failed", [
    ({}, []),
    ({"train_loss": float("nan")}, ["epoch 0: finite training loss"]),
    ({"val_count": 79}, ["epoch 0: validated every sample"]),
    ({"val_top1": 0.7}, ["epoch 0: validated every sample"]),     # top1 > top5
    ({"producers": 0}, ["epoch 0: world size and producers"]),
])
def test_train_records_are_checked(change, failed):
    checks = common.check_train_records([{**GOOD, **change}], epochs=1, producers=2,
                                        val_count=80)
    assert [c["name"] for c in checks.failed()] == failed
    none = common.check_train_records([], epochs=1, producers=2, val_count=80)
    assert [c["name"] for c in none.failed()] == ["one record per epoch"]


def test_train_check_reads_the_run(tmp_path):
    torch = pytest.importorskip("torch")
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.json").write_text(json.dumps([GOOD]))
    torch.save({"w": torch.ones(3), "n": torch.tensor(4)}, run / "final_weights.pt")
    log = tmp_path / "train.log"
    log.write_text("NCCL version 2.27.3+cuda13.0\nepoch 0 step 5/10: loss 2.3\n")

    def check(status, name, in_process=True):
        # The first run is the script as gpu_check.sh starts it; the others call its main()
        # here, which is what the script's exit status is made of (each process would spend
        # seconds importing torch).
        out = tmp_path / f"{name}.json"
        args = ["--run-dir", str(run), "--log", str(log), "--exit-status", str(status),
                "--result", str(out), "--val-count", "80"]
        if in_process:
            rc = train_check.main(args)
        else:
            rc = subprocess.run([sys.executable, str(GPU / "train_check.py"), *args],
                                capture_output=True, text=True, timeout=120).returncode
        return rc, json.loads(out.read_text())

    rc, rec = check(0, "good", in_process=False)
    assert rc == 0 and rec["ok"], rec
    rc, rec = check(1, "exit")
    assert rc == 1 and [c["name"] for c in rec["checks"] if not c["ok"]] == ["the run exited 0"]
    log.write_text("epoch 0 step 5/10: loss 2.3\n")
    torch.save({"w": torch.tensor([1.0, float("inf")])}, run / "final_weights.pt")
    rc, rec = check(0, "gloo")
    assert rc == 1 and [c["name"] for c in rec["checks"] if not c["ok"]] == [
        "NCCL ran the collectives", "final weights finite"]


def write_record(folder, step, ok, **data):
    checks = common.Checks()
    checks.add(f"{step} works", ok, "" if ok else "it did not")
    common.write_result(str(folder / f"{step}.json"), step, checks, f"{step} summary",
                        order=report.ORDER[step], **data)


def test_report_passes_only_when_every_expected_step_passed(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    write_record(res, "preflight", True, info={"gpu": "NVIDIA H200", "torch": "2.11"})
    write_record(res, "offload", True)
    out = tmp_path / "r.md"
    assert report.main(["--results", str(res), "--out", str(out),
                        "--expect", "preflight,offload"]) == 0
    text = out.read_text()
    assert text.startswith("# dpu_pipe GPU check: PASS") and "NVIDIA H200" in text
    assert report.main(["--results", str(res), "--out", str(out),
                        "--expect", "preflight,offload,train"]) == 1
    assert "| train | FAIL | did not run |" in out.read_text()
    log = tmp_path / "train.log"
    log.write_text("Traceback ...\nRuntimeError: No backend type associated with device type cpu\n")
    assert report.main(["--results", str(res), "--out", str(out), "--expect",
                        "preflight,offload,train", "--fail-step", f"train:1:{log}"]) == 1
    text = out.read_text()
    assert "| train | FAIL | exit 1, no record |" in text and "No backend type" in text
    write_record(res, "train", True)                   # the record replaces the stand-in
    write_record(res, "offload", False)
    assert report.main(["--results", str(res), "--out", str(out),
                        "--expect", "preflight,offload,train"]) == 1
    assert "- offload: offload works: it did not" in out.read_text()


# --- the data ------------------------------------------------------------------------------------

def test_made_datasets_are_deterministic_and_load(tmp_path):
    from dpu_pipe import Loader

    a = common.make_image_folder(str(tmp_path / "a"), 3, 2, seed=5)
    b = common.make_image_folder(str(tmp_path / "b"), 3, 2, seed=5)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.jpg"))
    assert len(files) == 6
    assert all((Path(a) / f).read_bytes() == (Path(b) / f).read_bytes() for f in files)
    with Loader(a, 3, size=32, seed=0, shuffle=False) as loader:
        labels = np.concatenate([y for _, y in loader])
    assert sorted(labels.tolist()) == [0, 0, 1, 1, 2, 2]


def test_photos_stand_in_serves_scikit_images_files(tmp_path):
    skdata = pytest.importorskip("skimage.data")
    src = Path(skdata.__file__).parent
    photos = tmp_path / "photos"
    photos.mkdir()
    with open(photos / "SHA256SUMS", "w") as sums:
        for name in ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg"):
            shutil.copy(src / name, photos / name)
            sums.write(f"{hashlib.sha256((src / name).read_bytes()).hexdigest()}  {name}\n")
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        np.save(tmp_path / f"{name}.npy", getattr(skdata, name)())
    probe = ("import sys, numpy as np, skimage.data as d\n"
             "assert d.__file__.startswith(sys.argv[1]), d.__file__\n"
             "for n in ('astronaut', 'coffee', 'chelsea', 'rocket'):\n"
             "    a, b = getattr(d, n)(), np.load(f'{sys.argv[2]}/{n}.npy')\n"
             "    assert a.dtype == b.dtype and np.array_equal(a, b), n\n")
    env = {**os.environ, "PYTHONPATH": str(GPU / "photos"), "DPU_PIPE_GPU_PHOTOS": str(photos)}
    argv = [sys.executable, "-c", probe, str(GPU / "photos"), str(tmp_path)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = bytearray((photos / "coffee.png").read_bytes())
    data[-20] ^= 0xFF
    (photos / "coffee.png").write_bytes(bytes(data))
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "checksum differs" in proc.stderr
