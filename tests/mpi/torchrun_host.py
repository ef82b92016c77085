"""Run by ``torchrun --nproc_per_node 2``: DPULoader without any producer rank.

Prints ``OK rank=R offload=ConfigError hybrid=B`` when offload mode is refused with the
MPMD launch line and hybrid mode makes the whole shard of this rank (B samples) locally."""
import logging
import os
import sys
import time

from dpu_pipe import DPULoader
from dpu_pipe.distributed import init_process_group
from dpu_pipe.errors import ConfigError

logging.basicConfig(level=logging.WARNING)
info = init_process_group()
rank = info.rank
start = time.monotonic()
try:
    DPULoader(sys.argv[1], 4, size=32, mode="offload")
    print(f"FAIL rank={rank}: offload mode accepted without producers", flush=True)
    sys.exit(1)
except ConfigError as exc:
    assert "mpiexec" in str(exc) and "dpu_pipe.worker" in str(exc), exc
    # Within the host group's set-up timeout (60 s): nothing waits for absent producers.
    refused_s = time.monotonic() - start
    assert refused_s < 60, refused_s
with DPULoader(sys.argv[1], 4, size=32, mode="hybrid") as dl:
    assert dl.mode == "local" and dl.state_dict()["world_size"] == 2, dl.state_dict()
    n = sum(len(y) for _, y in dl)
print(f"OK rank={rank} world={os.environ['WORLD_SIZE']} offload=ConfigError hybrid={n}",
      flush=True)
