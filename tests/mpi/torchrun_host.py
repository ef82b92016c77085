"""Run by ``torchrun --nproc_per_node 2``: DPULoader without any producer rank.

Prints ``OK rank=R offload=ConfigError hybrid=B`` when offload mode is refused with the
MPMD launch line and hybrid mode makes the whole shard of this rank (B samples) locally."""
import logging
import os
import sys

from dpu_pipe import DPULoader
from dpu_pipe.distributed import init_process_group
from dpu_pipe.errors import ConfigError

logging.basicConfig(level=logging.WARNING)
info = init_process_group()
rank = info.rank
try:
    DPULoader(sys.argv[1], 4, size=32, mode="offload")
    print(f"FAIL rank={rank}: offload mode accepted without producers", flush=True)
    sys.exit(1)
except ConfigError as exc:
    # A refusal naming the MPMD launch line, not a PipeTimeout at the host group's set-up
    # deadline: nothing waits for absent producers.
    assert "mpiexec" in str(exc) and "dpu_pipe.worker" in str(exc), exc
with DPULoader(sys.argv[1], 4, size=32, mode="hybrid") as dl:
    assert dl.mode == "local" and dl.state_dict()["world_size"] == 2, dl.state_dict()
    n = sum(len(y) for _, y in dl)
# One write for the line and its newline: the two ranks share this stdout.
sys.stdout.write(f"OK rank={rank} world={os.environ['WORLD_SIZE']} offload=ConfigError "
                 f"hybrid={n}\n")
sys.stdout.flush()
