"""The offloaded job under Slurm: a private cluster on this machine — munged, slurmctld and two
slurmd (a "host" node and a "DPU" node, both this machine with its real CPUs and memory),
generated config, own state and spool directories, free ports — started and stopped here by
PID. Each launch recipe runs ``offload_host.py stream`` (2 host ranks, 2 producer ranks, one
offload epoch checked batch for batch against the local Loader, exactly once over the hosts)
or must fail with a clear error, never hang. ``./run.sh slurm`` installs Debian's slurm-wlm
and munge and runs this file; CI installs them before the suite (``./run.sh slurm-deps``),
and with ``CI=true`` a machine without them fails here instead of skipping.

Why two slurmd: Slurm schedules heterogeneous jobs (``srun A : B``) only with backfill, and
in 22.05 a second component never fits on the node the first one is planned on (it stays
pending, reason None, even with CPUs free) — on a real cluster hosts and DPUs are different
nodes anyway.
"""
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers import make_dataset, repo_env
from mpi_launch import HERE, ROOT

BINARIES = ("munged", "mungekey", "munge", "slurmctld", "slurmd", "srun", "sbatch", "scancel",
            "squeue", "sinfo")
_missing = [b for b in BINARIES if shutil.which(b) is None]
if _missing and os.environ.get("CI") == "true":
    # CI installs Slurm before the suite (.ci/run: ./run.sh slurm-deps): a skip there would
    # hide that these launch recipes went unchecked.
    pytest.fail(f"CI=true but Slurm is not installed (missing {', '.join(_missing)}): "
                f"./run.sh slurm-deps", pytrace=False)
pytestmark = [
    pytest.mark.slow, pytest.mark.timeout(900),
    pytest.mark.skipif(bool(_missing), reason=f"Slurm is not installed (missing "
                       f"{', '.join(_missing)}): apt-get install slurm-wlm munge, or "
                       f"./run.sh slurm"),
]

SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
PYTHON = sys.executable
HOSTS, PRODUCERS = 2, 2
N = 16                       # samples: 2 hosts x batch 4 x 2 batches
JOB_LIMIT = 180              # seconds for one job, queueing included
USER = pwd.getpwuid(os.getuid()).pw_name   # runs the daemons and owns the jobs


def free_ports(n):
    """``n`` TCP ports free right now (bound together, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def hardware():
    """(CPUs, RealMemory in MiB) of this machine as slurmd sees it (``slurmd -C``)."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
    cpus = int(re.search(r"\bCPUs=(\d+)", out).group(1))
    mem = int(re.search(r"\bRealMemory=(\d+)", out).group(1))
    return cpus, mem


class Cluster:
    """A one-machine Slurm cluster in ``base``: nodes ``<host>`` and ``<host>-dpu``."""

    def __init__(self, base):
        self.base = Path(base)
        self.procs = {}                      # name -> Popen of a daemon in the foreground
        self.host = socket.gethostname().split(".")[0]
        self.nodes = [self.host, f"{self.host}-dpu"]
        self.conf = self.base / "slurm.conf"
        self.env = repo_env()
        # Launcher variables of an enclosing job would leak into ours.
        for key in [k for k in self.env if k.startswith(("SLURM_", "PMI_", "PMIX_"))]:
            if key != "SLURM_CONF":
                del self.env[key]
        self.env["SLURM_CONF"] = str(self.conf)

    def log(self, name):
        path = self.base / "log" / name
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"

    def logs(self):
        return "\n".join(f"--- {p.name}\n{self.log(p.name)}"
                         for p in sorted((self.base / "log").glob("*")))

    def _daemon(self, name, argv):
        out = open(self.base / "log" / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                            env=self.env, start_new_session=True)
        out.close()

    def _wait(self, what, check, limit=60):
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}:\n"
                                   f"{self.logs()}")
            if check():
                return
            time.sleep(0.5)
        raise RuntimeError(f"{what}: not within {limit} s\n{self.logs()}")

    def _quiet(self, argv):
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)

    def start(self):
        b = self.base
        # munged insists that every directory above its socket is searchable by all and
        # that its key is readable by its owner only.
        os.chmod(b, 0o755)
        for d in ("munge", "state", "log", *(f"spool/{n}" for n in self.nodes)):
            (b / d).mkdir(parents=True)
        (b / "munge").chmod(0o755)
        key, sock = b / "munge" / "munge.key", b / "munge" / "munge.socket"
        subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, timeout=30)
        self._daemon("munged", ["munged", "-F", f"--socket={sock}", f"--key-file={key}",
                                f"--pid-file={b}/munge/munged.pid",
                                f"--log-file={b}/log/munged.log",
                                f"--seed-file={b}/munge/munged.seed"])
        self._wait("munged", lambda: self._quiet(
            ["munge", "-n", f"--socket={sock}"]).returncode == 0)
        cpus, mem = hardware()
        ctld_port, *node_ports = free_ports(1 + len(self.nodes))
        lines = [
            "ClusterName=dpupipe", f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}", f"SlurmUser={USER}", f"SlurmdUser={USER}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={sock}",
            f"StateSaveLocation={b}/state", f"SlurmdSpoolDir={b}/spool/%n",
            f"SlurmctldPidFile={b}/slurmctld.pid", f"SlurmdPidFile={b}/slurmd-%n.pid",
            f"SlurmctldLogFile={b}/log/slurmctld.log", f"SlurmdLogFile={b}/log/slurmd-%n.log",
            # No cgroups, no accounting database, no mail: nothing outside this directory.
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "MailProg=/bin/true",
            # Heterogeneous jobs need backfill; a short interval starts them at once.
            "SchedulerType=sched/backfill", "SchedulerParameters=bf_interval=1",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "MpiDefault=none", "ReturnToService=2", "KillWait=5",
            *(f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={p} "
              f"CPUs={cpus} RealMemory={mem} State=UNKNOWN"
              for n, p in zip(self.nodes, node_ports)),
            f"PartitionName=main Nodes={','.join(self.nodes)} Default=YES "
            f"MaxTime=30 State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._wait("slurmctld", lambda: self._quiet(["sinfo", "-h"]).returncode == 0)
        for n in self.nodes:
            self._daemon(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", str(self.conf)])

        def idle():
            out = self._quiet(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split()
            return sorted(out[0::2]) == sorted(self.nodes) and set(out[1::2]) == {"idle"}

        self._wait("both nodes idle", idle)

    def stop(self):
        """Cancel every job, wait until none is left, then stop the daemons by PID."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self._quiet(["scancel", "--full", f"--user={USER}"])
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self._quiet(
                    ["squeue", "-h", "-o", "%A"]).stdout.strip():
                time.sleep(0.5)
        for name in sorted(self.procs, key=lambda n: n == "munged"):   # munged last
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)

    def run(self, argv, limit=JOB_LIMIT, env=None):
        """Run a client command (srun, sbatch --wait) under a deadline."""
        proc = subprocess.run(["timeout", "-k", "5", str(limit), *argv], cwd=ROOT,
                              env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=limit + 20)
        return proc


@pytest.fixture(scope="module")
def cluster():
    base = tempfile.mkdtemp(prefix="dpu_pipe-slurm-")
    c = Cluster(base)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def data(cluster):
    # Inside the cluster's directory: the job's ranks read it from the same paths.
    return make_dataset(str(cluster.base / "data"), N)


def host_argv(data, out):
    return [str(HERE / "offload_host.py"), "stream", "--data", data, "--out", str(out),
            "--epochs", "1", "--slots", "3"]


def check_stream(proc, out, what):
    text = f"{what}: exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n" \
           f"--- stderr\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, text
    for h in range(HOSTS):
        assert (out / f"host{h}.json").exists(), text
        assert not (out / f"error{h}.json").exists(), (out / f"error{h}.json").read_text()


@pytest.mark.parametrize("launch", ["srun", "mpiexec"])
def test_sbatch_template(cluster, data, tmp_path, launch):
    """``sbatch examples/slurm/train.sbatch``: hosts on the first node, producers on the
    second, launched by ``srun --mpi=pmi2 --multi-prog`` or by MPICH's mpiexec (Hydra)
    inside the allocation; the offloaded stream equals the Loader's."""
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "job.log"
    proc = cluster.run(
        ["sbatch", "--wait", "--nodes=2", "--ntasks-per-node=2", "--overcommit",
         "--time=5", f"--output={log}", str(SBATCH), *host_argv(data, out)],
        env={"LAUNCH": launch, "HOSTS": str(HOSTS), "PYTHON": PYTHON})
    proc.stdout += log.read_text() if log.exists() else "(no job output)"
    check_stream(proc, out, f"sbatch LAUNCH={launch}")
    # Not anchored: the launcher may join the ranks' lines.
    assert sorted(re.findall(r"OK host=(\d)", proc.stdout)) == [str(h) for h in range(HOSTS)], \
        proc.stdout


def test_srun_heterogeneous(cluster, data, tmp_path):
    """``srun --mpi=pmi2 HOSTS : PRODUCERS``, a heterogeneous job (one component per node):
    its components form one MPI_COMM_WORLD and the stream equals the Loader's."""
    out = tmp_path / "out"
    out.mkdir()
    proc = cluster.run(
        ["srun", "--mpi=pmi2", "--time=5", "-N1", f"-n{HOSTS}", "-O",
         PYTHON, "-m", "mpi4py", *host_argv(data, out),
         ":", "-N1", f"-n{PRODUCERS}", "-O", PYTHON, "-m", "mpi4py", "-m", "dpu_pipe.worker"])
    check_stream(proc, out, "srun heterogeneous job")


@pytest.mark.parametrize("mpi, expected", [
    # The mpich wheel's library has no PMIx client: MPI_Init aborts every rank.
    ("pmix", "unsupported PMI version PMIx"),
    # No PMI at all: every rank is an MPI job of one, so producers find no host.
    ("none", "no rank declared the role 'host'"),
], ids=["pmix", "none"])
def test_srun_without_pmi2_fails_clearly(cluster, data, tmp_path, mpi, expected):
    """The recipes that cannot work end at once with an error saying why, never a hang."""
    out = tmp_path / "out"
    out.mkdir()
    conf = tmp_path / "multi.conf"
    conf.write_text(f"0-{HOSTS - 1} {PYTHON} -m mpi4py {' '.join(host_argv(data, out))}\n"
                    f"{HOSTS}-{HOSTS + PRODUCERS - 1} {PYTHON} -m mpi4py -m dpu_pipe.worker\n")
    # One node: Slurm's own PMIx plugin cannot serve two slurmd of one machine at once.
    proc = cluster.run(["srun", f"--mpi={mpi}", "--time=5", "-N1", f"-n{HOSTS + PRODUCERS}",
                        "-O", "--kill-on-bad-exit=1", "--multi-prog", str(conf)], limit=120)
    assert proc.returncode != 0, proc.stdout
    assert expected in proc.stderr + proc.stdout, proc.stderr[-3000:]
    # timeout(1) exits 124 when it stopped the command at its deadline.
    assert proc.returncode != 124, "the failing job ended only at its deadline"
