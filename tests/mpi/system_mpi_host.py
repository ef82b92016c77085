"""Host rank for the system-MPI check: DPULoader over the producers equals Loader for 2
epochs in offload mode and 2 in hybrid mode; then, in hybrid mode, one producer is stopped
(SIGSTOP) mid-epoch, the host takes over its work (the epoch still equals Loader's), and
after SIGCONT one more epoch is checked. Prints one OK line per check; any mismatch raises
(and python -m mpi4py aborts the job)."""
import os
import signal
import sys

import numpy as np

from dpu_pipe import DPULoader, ImageFolder, Loader


def workers():
    """pids of this job's ``dpu_pipe.worker`` ranks on this node (siblings of this rank)."""
    me, out = os.getppid(), []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me and b"dpu_pipe.worker" in cmd:
            out.append(int(entry))
    return sorted(out)


def check(loader, ref, what, stop_after=None):
    got, want, stopped = [], [(x.copy(), y.copy()) for x, y in ref], None
    for x, y in loader:
        got.append((x.copy(), y.copy()))
        if stop_after is not None and len(got) == stop_after:
            stopped = workers()[-1]
            os.kill(stopped, signal.SIGSTOP)
    assert len(got) == len(want) == len(ref), (len(got), len(want))
    for (a, b), (c, d) in zip(got, want):
        assert np.array_equal(a, c) and np.array_equal(b, d), what
    print(f"OK {what}: {len(got)} batches identical to Loader; steps per producer "
          f"{loader.stats()['steps_per_producer']}", flush=True)
    return stopped


src = ImageFolder(sys.argv[1])
kw = dict(size=48, seed=3, timeout=120)
local = Loader(src, 8, **kw)
remote = DPULoader(src, 8, **kw)
for epoch in range(2):
    check(remote, local, f"offload epoch {epoch}")
remote.close()
hybrid = DPULoader(src, 8, mode="hybrid", liveness_timeout=2.0, **kw)
hybrid.set_epoch(2)         # where `local` stands
for epoch in range(2, 4):
    check(hybrid, local, f"hybrid epoch {epoch}")
hybrid.set_epoch(4)
local.set_epoch(4)
stopped = check(hybrid, local, "hybrid epoch 4 with a producer stopped mid-epoch", stop_after=1)
os.kill(stopped, signal.SIGCONT)
check(hybrid, local, "hybrid epoch 5 after it woke up")
hybrid.close()
local.close()
