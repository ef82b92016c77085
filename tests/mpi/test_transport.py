"""The RMA transport under mpiexec: ordering, exactly-once, byte-exact payloads, errors and
dead producers, each scenario with shared memory and with MPICH's shared memory disabled."""
import re

import pytest

from mpi_launch import ENVS, run_mpi

pytestmark = pytest.mark.timeout(300)

# (ranks, script arguments): hosts + producers, slot counts, delays on either side.
STREAMS = {
    "1host-1producer-K3": (2, ["--slots", "3"]),
    "1host-2producers-K1": (3, ["--slots", "1"]),
    "1host-3producers-K8-random-delays-slow-consumer":
        (4, ["--slots", "8", "--producer-delay", "0.02", "--consumer-delay", "0.005"]),
    "1host-3producers-K1-random-delays-serve":
        (4, ["--slots", "1", "--producer-delay", "0.01", "--serve"]),
    "2hosts-2producers-K2-random-delays":
        (4, ["--hosts", "2", "--slots", "2", "--producer-delay", "0.01", "--consumer-delay", "0.002"]),
    "1host-2producers-K4-1MB-payload": (3, ["--slots", "4", "--image-bytes", "1000000", "--steps", "8"]),
}


@pytest.mark.parametrize("env", ENVS, ids=list(ENVS))
@pytest.mark.parametrize("scenario", STREAMS, ids=list(STREAMS))
def test_stream(scenario, env):
    nprocs, args = STREAMS[scenario]
    job = run_mpi(nprocs, "stream.py", *args, env=ENVS[env], limit=120)
    assert job.returncode == 0, job.explain()
    hosts = 2 if "--hosts" in args else 1
    oks = job.ok_lines()
    assert len(oks) == hosts, job.explain()
    for line in oks:
        assert "steps=40" in line or "steps=16" in line, line
        # Every producer of the group took part (dynamic claiming, nobody starved forever).
        group = int(re.search(r"group=(\d+)", line).group(1))
        by = re.search(r"by_producer=\{(.*?)\}", line).group(1)
        assert len(by.split(",")) == group - 1, line


@pytest.mark.parametrize("env", ENVS, ids=list(ENVS))
def test_progress_thread_fills_slots_while_host_sleeps(env):
    """The host requests K steps and sleeps in Python (no MPI calls); every slot must be
    filled during the sleep, also when remote atomics need the host's progress."""
    job = run_mpi(3, "stream.py", "--slots", "4", "--sleep-fill", "2", "--progress", "thread",
                  env=ENVS[env])
    assert job.returncode == 0, job.explain()
    assert "filled_during_sleep=4/4" in job.stdout, job.explain()


def test_nolocal_without_progress_stalls_until_host_calls_mpi():
    """Control for the test above: with shared memory off and no progress mechanism, nothing
    lands while the host sleeps (so NOLOCAL really emulates an off-node DPU here)."""
    job = run_mpi(3, "stream.py", "--slots", "4", "--sleep-fill", "2", "--progress", "none",
                  env=ENVS["nolocal"])
    assert job.returncode == 0, job.explain()
    assert "filled_during_sleep=0/4" in job.stdout, job.explain()


@pytest.mark.parametrize("env", ENVS, ids=list(ENVS))
@pytest.mark.parametrize("kind", ["decode", "runtime"])
@pytest.mark.parametrize("loop", ["claim-publish", "serve"])
def test_producer_error_reaches_host(loop, kind, env):
    """A producer publishes an error for step 5: the host raises it naming the producer
    (DecodeError keeps index and path), and the stream goes on with the other steps."""
    extra = ["--serve"] if loop == "serve" else []
    job = run_mpi(3, "stream.py", "--fail-at", "5", "--fail-kind", kind, *extra, env=ENVS[env])
    assert job.returncode == 0, job.explain()
    (line,) = job.ok_lines()
    if kind == "decode":
        assert "DecodeError index=1005 path=/data/train/5.jpg by producer rank" in line, line
    else:
        assert "ProducerError by producer rank" in line, line


@pytest.mark.parametrize("env", ENVS, ids=list(ENVS))
def test_frozen_producer_is_named_within_liveness_timeout(env, tmp_path):
    """A producer that stops answering (SIGSTOP) while holding step 7: the host raises
    PipeTimeout naming it after ~liveness_timeout, and the job ends."""
    report = tmp_path / "report"
    job = run_mpi(3, "stream.py", "--freeze-at", "7", "--liveness", "2",
                  "--report", report, env=ENVS[env], limit=60)
    assert job.returncode != 0 and not job.ok_lines(), job.explain()
    text = (tmp_path / "report.0").read_text()
    victim = (tmp_path / "report.victim").read_text()
    assert text.startswith("PipeTimeout"), text
    assert victim in text and "stopped answering" in text and "step 7 of epoch 0" in text, text
    seconds = float(re.search(r"after ([\d.]+)s", text).group(1))
    assert 2.0 <= seconds < 2.0 + 10.0, text
    assert job.seconds < 40, job.explain()


@pytest.mark.parametrize("env", ENVS, ids=list(ENVS))
@pytest.mark.parametrize("launcher", ["default", "disable-auto-cleanup"])
def test_killed_producer_ends_the_job(launcher, env, tmp_path):
    """SIGKILL of a producer mid-stream. Hydra's default kills the whole job at once. With
    -disable-auto-cleanup the survivors keep running: then either MPICH ends the host when it
    learns of the failure, or the host's heartbeat check raises PipeTimeout naming the dead
    rank first. In no case may the job hang or report success."""
    report = tmp_path / "report"
    extra = () if launcher == "default" else ("-disable-auto-cleanup",)
    job = run_mpi(3, "stream.py", "--kill-at", "7", "--liveness", "2", "--report", report,
                  env=ENVS[env], limit=60, launcher_args=extra)
    assert job.returncode != 0 and not job.ok_lines(), job.explain()
    assert job.seconds < 30, job.explain()
    host_report = tmp_path / "report.0"
    if host_report.exists():
        text = host_report.read_text()
        victim = (tmp_path / "report.victim").read_text()
        assert text.startswith("PipeTimeout") and victim in text, text


@pytest.mark.parametrize("env", ENVS, ids=list(ENVS))
@pytest.mark.parametrize("progress", ["thread", "none"])
def test_host_training_longer_than_liveness_is_no_false_alarm(progress, env):
    """The host spends 1.5 s per batch without MPI calls while liveness_timeout is 1 s:
    producers are idle, not dead, also when their heartbeats could not land meanwhile."""
    job = run_mpi(3, "stream.py", "--consumer-delay", "1.5", "--steps", "3", "--epochs", "1",
                  "--liveness", "1", "--slots", "1", "--progress", progress, env=ENVS[env])
    assert job.returncode == 0, job.explain()
    assert "steps=3 " in job.stdout, job.explain()


@pytest.mark.parametrize("env", ENVS, ids=list(ENVS))
def test_frozen_host_is_named_by_producers(env, tmp_path):
    """The host stops answering (SIGSTOP) after step 3: producers waiting for credits raise
    PipeTimeout naming it after host_timeout, and the job ends."""
    report = tmp_path / "report"
    job = run_mpi(3, "stream.py", "--freeze-host-at", "3", "--host-timeout", "2",
                  "--slots", "2", "--report", report, env=ENVS[env], limit=60)
    assert job.returncode != 0 and not job.ok_lines(), job.explain()
    texts = [p.read_text() for p in tmp_path.glob("report.[12]")]
    assert texts, job.explain()
    for text in texts:
        assert text.startswith("PipeTimeout: host rank 0") and "stopped answering" in text, text
    assert job.seconds < 40, job.explain()
