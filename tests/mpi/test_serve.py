"""Producers as an MPI job of their own (``python -m dpu_pipe.worker --serve FILE``), hosts
started by ``torchrun --nproc_per_node 2`` (no MPI job: each a singleton MPI process of the
mpich wheel) joining it through the port in FILE: the same stream as Loader, what a
producer SIGKILLed mid-epoch does, and deadlines on every wait of the start-up."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import free_port, repo_env
from mpi_launch import HERE, ROOT

pytest.importorskip("torch")
pytest.importorskip("mpi4py")

from dpu_pipe.mpi import mpiexec_path  # noqa: E402
from dpu_pipe.errors import PipeTimeout  # noqa: E402

TORCHRUN = Path(sys.executable).with_name("torchrun")


def _env():
    return repo_env(OMP_NUM_THREADS="1")


def _data(tmp_path):
    from PIL import Image
    import numpy as np

    for i in range(24):
        d = tmp_path / "data" / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((30, 36, 3), 9 * i, np.uint8)).save(d / f"{i}.jpg")
    return tmp_path / "data"


def _finish(proc, timeout):
    """``proc.communicate()`` within ``timeout`` seconds; past it the process group the test
    started (``timeout``, the launcher and every rank under it) is SIGKILLed, so no child
    left holding the pipes can keep the test waiting."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:      # the whole group ended meanwhile
            pass
        return proc.communicate(timeout=30)


def _run(tmp_path, mode, limit=150, grace=None):
    """Two producer jobs of one rank each (``--serve serve-0.json``, ``serve-1.json``: the
    mpich wheel connects one singleton host per job) and torchrun (2 hosts joining
    ``serve-{rank}.json``), each under its own deadline and in its own process group;
    returns ``([(returncode, stdout, stderr)] of the producer jobs, the torchrun
    CompletedProcess)``, the latter with its ``seconds``. ``grace``: seconds the producer
    jobs get after torchrun ended, then their groups are killed."""
    data = _data(tmp_path)
    popen = dict(cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 text=True, start_new_session=True)
    jobs = [subprocess.Popen(
        ["timeout", "-k", "5", str(limit), mpiexec_path(), "-n", "1", sys.executable, "-m",
         "mpi4py", "-m", "dpu_pipe.worker", "--serve", str(tmp_path / f"serve-{r}.json"),
         "--accept-timeout", "100"], **popen)
        for r in range(2)]
    try:
        start = time.monotonic()
        argv = ["timeout", "-k", "5", str(limit), str(TORCHRUN), "--nproc_per_node", "2",
                "--master_port", str(free_port()), str(HERE / "serve_host.py"), str(data), str(tmp_path / "serve-{rank}.json"),
                mode]
        torchrun = subprocess.Popen(argv, **popen)
        out, err = _finish(torchrun, limit + 20)
        hosts = subprocess.CompletedProcess(argv, torchrun.returncode, out, err)
        hosts.seconds = time.monotonic() - start
        producers = []
        for job in jobs:
            out, err = _finish(job, limit + 20 if grace is None else grace)
            producers.append((job.returncode, out, err))
    finally:
        for job in jobs:
            if job.poll() is None:
                _finish(job, 0)
    return producers, hosts


@pytest.mark.slow
def test_torchrun_hosts_join_serving_producer_jobs(tmp_path):
    """Two epochs per host equal Loader's shard of 2, every batch made by the host's own
    producer; every job ends with every process gone, and the serve files are removed."""
    start = time.monotonic()
    producers, hosts = _run(tmp_path, "offload")
    seconds = time.monotonic() - start
    assert hosts.returncode == 0, hosts.stdout + hosts.stderr[-4000:]
    for rc, out, err in producers:
        assert rc == 0, out + err[-4000:]
    ok = sorted(line for line in hosts.stdout.splitlines() if line.startswith("OK "))
    assert [line.split(":")[0] for line in ok] == [
        "OK rank=0 offload epoch 0", "OK rank=0 offload epoch 1",
        "OK rank=1 offload epoch 0", "OK rank=1 offload epoch 1"], hosts.stdout
    assert not list(tmp_path.glob("serve-*.json"))
    print(f"torchrun + --serve: {seconds:.1f} s", *ok, sep="\n")


@pytest.mark.slow
def test_producer_sigkilled_mid_epoch_takeover_or_clear_end(tmp_path):
    """Rank 0 SIGKILLs its producer after the first batch: either its thread takes over
    (both epochs identical to Loader, exit 0) or the host ends naming the dead process — and
    the hosts do not hang (torchrun ends by itself, before its deadline). With the mpich
    wheel (UCX over shared memory) it is the second: the host's next RMA write into the dead
    process aborts it inside MPI (``process_vm_writev(pid=...): No such process``) before its
    liveness deadline could retire the producer; the other host's epochs are identical to Loader
    until torchrun stops it."""
    producers, hosts = _run(tmp_path, "kill", limit=120, grace=10)
    seconds = hosts.seconds
    # timeout(1) exits 124 (137 after its -k) when it stopped torchrun at the deadline.
    assert hosts.returncode not in (124, 137), hosts.stdout + hosts.stderr[-4000:]
    # The other producer job is not checked (killed after 10 s): when torchrun stops its
    # host in the middle of the shutdown handshake, it waits out its own shutdown deadline.
    killed = re.search(r"KILL rank=0 pid (\d+)", hosts.stdout)
    assert killed, hosts.stdout + hosts.stderr[-4000:]
    ok = [line for line in hosts.stdout.splitlines() if line.startswith("OK ")]
    if hosts.returncode == 0:
        assert len(ok) == 4, hosts.stdout
        outcome = "taken over"
    else:
        assert f"pid={killed.group(1)}" in hosts.stderr, hosts.stdout + hosts.stderr[-4000:]
        outcome = "host ended naming the dead producer"
    print(f"SIGKILL mid-epoch: {outcome} after {seconds:.1f} s", *ok, sep="\n")


def test_stale_serve_file_is_a_timeout_naming_it(tmp_path):
    """A serve file left by a producer job that is gone (its time stamp stands still) is a
    PipeTimeout naming the file within the deadline — not a connect to a dead port."""
    from dpu_pipe.offload import rendezvous

    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"port": "tag#0$nothing$", "producers": 1}))
    with pytest.raises(PipeTimeout, match=f"serve file {re.escape(str(path))}: no producer job "
                       "refreshes it"):
        rendezvous.join(path, timeout=1.0)


@pytest.mark.slow
def test_producer_job_without_hosts_ends_at_its_deadline(tmp_path):
    """No host ever comes: the producer job ends at --accept-timeout with a message naming
    the file, and removes it."""
    path = tmp_path / "serve.json"
    proc = subprocess.run(
        ["timeout", "-k", "5", "90", mpiexec_path(), "-n", "2", sys.executable, "-m",
         "mpi4py", "-m", "dpu_pipe.worker", "--serve", str(path), "--accept-timeout", "3"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=110)
    assert proc.returncode not in (0, 124), proc.stdout + proc.stderr[-3000:]
    assert f"--serve {path}: waited for 1 host(s) (0 joined) past the deadline" in proc.stderr
    assert not path.exists()
