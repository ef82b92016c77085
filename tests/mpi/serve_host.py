"""Run by ``torchrun --nproc_per_node 2 serve_host.py DATA FILE MODE``: a host that is no MPI
job with its producers joins the ``python -m dpu_pipe.worker --serve FILE`` job.

``offload``: two epochs equal Loader's (this rank's shard of 2), every batch from a producer.
``kill``: hybrid mode; rank 0 SIGKILLs its producer (by the pid its host group knows) after
the first batch; if the host survives, the epoch still equals Loader's (its thread took
over), and so does the next one. Prints one ``OK rank=R ...`` line per check; any mismatch raises."""
import logging
import os
import signal
import sys

import numpy as np

from dpu_pipe import DPULoader, ImageFolder, Loader

logging.basicConfig(level=logging.WARNING)
data, path, mode = sys.argv[1:4]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
src = ImageFolder(data)
kw = dict(size=40, seed=5, timeout=120, rank=rank, world_size=world)
local = Loader(src, 4, **kw)


def say(line):
    """One write per line: the two torchrun ranks share this stdout, and print's separate
    write of the newline let one rank's line run into the other's."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def check(loader, what, kill_after=None):
    want = [(x.copy(), y.copy()) for x, y in local]
    got, killed = [], None
    for x, y in loader:
        got.append((x.copy(), y.copy()))
        if kill_after is not None and len(got) == kill_after:
            t = loader._group.transport
            killed = t._idents[1][1]        # (hostname, pid, world rank) of group rank 1
            say(f"KILL rank={rank} pid {killed}")
            os.kill(killed, signal.SIGKILL)
    assert len(got) == len(want) > 0, (len(got), len(want))
    for (a, b), (c, d) in zip(got, want):
        assert np.array_equal(a, c) and np.array_equal(b, d), what
    per = loader.stats()["steps_per_producer"]
    say(f"OK rank={rank} {what}: {len(got)} batches identical to Loader; steps per "
        f"producer {per}" + (f"; killed pid {killed}" if killed else ""))
    return per


if mode == "offload":
    with DPULoader(src, 4, serve_file=path, **kw) as dl:
        assert dl.state_dict()["world_size"] == world
        for epoch in range(2):
            per = check(dl, f"offload epoch {epoch}")
            assert set(per) == {"1"}, per     # group rank 1: this host's one producer
elif mode == "kill":
    with DPULoader(src, 4, mode="hybrid", liveness_timeout=2.0, serve_file=path, **kw) as dl:
        check(dl, "hybrid epoch 0 with its producer killed mid-epoch",
              kill_after=1 if rank == 0 else None)
        check(dl, "hybrid epoch 1 after the kill")
else:
    raise SystemExit(f"unknown mode {mode!r}")
