"""The thread-safety contract (docs/guides/threads.md) in the offloaded modes, under mpiexec:
every public method of a DPULoader from several threads while producers deliver batches —
no crash, no hang, the stream a fresh local Loader's — two DPULoaders iterated in two
threads, RemoteValidation submitted and polled from several threads while batches flow, and
Ctrl-C ending every process of an offloaded job.

The host runs ``threads_host.py``; producers ``python -m dpu_pipe.worker``. The stress part
runs ``DPU_PIPE_STRESS_SECONDS`` seconds (default 6: about 17 s a mode here, MPI start-up and
the references included).
"""
import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from mpi_launch import HERE, ROOT, run_mpi

from dpu_pipe.mpi import mpiexec_argv

pytestmark = pytest.mark.timeout(240)

N = 24                       # test_threads.py's dataset size (its reference and checks)
SECONDS = float(os.environ.get("DPU_PIPE_STRESS_SECONDS", "6"))


@pytest.fixture(scope="module")
def data(mpi_dataset):
    return mpi_dataset(N)


def producers(n):
    return [":", "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "dpu_pipe.worker"]


@pytest.mark.parametrize("mode", ["offload", "hybrid"])
def test_stress_every_method_from_every_thread(data, tmp_path, mode):
    out = str(tmp_path)
    job = run_mpi(1, "threads_host.py", "stress", "--data", data, "--out", out, "--mode", mode,
                  "--seconds", SECONDS, *producers(2), limit=int(SECONDS) + 150)
    assert job.returncode == 0 and "OK host=0" in job.stdout, job.explain()
    with open(os.path.join(out, "host0.json")) as f:
        res = json.load(f)
    assert res["two_loaders"] == [12, 12], res
    assert res["producer_samples"] > 0, res
    if mode == "offload":
        assert res["host_samples"] == 0, res


@pytest.mark.parametrize("mode", ["offload", "hybrid"])
def test_exit_with_dpuloader_threads_alive(data, tmp_path, mode):
    # A daemon thread iterating at interpreter exit gets ConfigError from its next(); it is
    # never inside the window while the host group frees it.
    job = run_mpi(1, "threads_host.py", "exit", "--data", data, "--out", str(tmp_path),
                  "--mode", mode, *producers(2), limit=60)
    assert job.returncode == 0 and "OK host=0" in job.stdout, job.explain()
    errors = re.findall(r"^(\w[\w.]*(?:Error|Exception)): (.*)$", job.stderr, re.M)
    assert all(e == "dpu_pipe.errors.ConfigError" and "interpreter is exiting" in m
               for e, m in errors), job.explain()
    assert "Fatal" not in job.stderr and "Segmentation" not in job.stderr, job.explain()


@pytest.mark.slow            # torch on the host and the producers: ~30 s here
def test_remote_validation_from_threads_while_batches_flow(photo_folder, tmp_path):
    pytest.importorskip("torch")
    out = str(tmp_path)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
    data = str(photo_folder(24, classes=5))     # the validation model's 5 classes
    job = run_mpi(1, "threads_host.py", "validation", "--data", data, "--out", out,
                  *producers(2), env=env, limit=200)
    assert job.returncode == 0 and "OK host=0" in job.stdout, job.explain()
    with open(os.path.join(out, "host0.json")) as f:
        res = json.load(f)
    assert res["futures"] == 4 and res["batches"] > 0, res


def _procs():
    """{pid: (parent pid, state)} of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(entry)] = (int(fields[1]), fields[0])
    return out


def job_pids(root):
    """pids of ``root`` and its descendants (launcher, proxies, ranks)."""
    procs = _procs()
    found, todo = set(), [root]
    while todo:
        p = todo.pop()
        found.add(p)
        todo += [c for c, (parent, _) in procs.items() if parent == p and c not in found]
    return sorted(found)


def alive(pids):
    """The ``pids`` that still run (zombies are done)."""
    procs = _procs()
    return [p for p in pids if p in procs and procs[p][1] != "Z"]


@pytest.mark.parametrize("mode", ["offload", "hybrid"])
@pytest.mark.parametrize("target", ["mpiexec", "host"])
def test_ctrl_c_ends_every_process_of_an_offloaded_job(data, tmp_path, mode, target):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    argv = mpiexec_argv(1, HERE / "threads_host.py", "loop", "--data", data, "--out",
                        str(tmp_path), "--mode", mode) + producers(2)
    # A process group of its own, killed whatever happens.
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        match, lines, end = None, [], time.monotonic() + 120
        while match is None and time.monotonic() < end:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                break
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            match = re.search(r"READY pid=(\d+)", line)
        assert match, f"no READY line: {lines!r}"
        pids = job_pids(proc.pid)
        assert len(pids) >= 4, pids          # mpiexec, its proxy, the host, 2 producers
        os.kill(proc.pid if target == "mpiexec" else int(match.group(1)), signal.SIGINT)
        deadline = time.monotonic() + 30
        while alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = alive(pids)
        assert not left, f"processes of the job still running 30 s after SIGINT: {left}"
        proc.wait(10)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
