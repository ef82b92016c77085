"""Cells of the fault matrix (``tests/mpi/fault_matrix.py``, which runs all of them) that no
other test covers, asserted: each fault injected into a real job of 1 host and 2 producer
ranks ends the way it must, by itself (a job stopped at its limit is the outcome "HUNG"),
with no rank of the job left alive (checked by pid). SIGKILL and SIGSTOP of producers, and
takeover, are asserted in test_offload.py."""
import pytest

from mpi_launch import HERE  # noqa: F401  (skips the module without mpi4py)
from fault_matrix import run_cell

#: (mode, fault) -> (outcome, what the message names); None: any message.
CELLS = {
    ("offload", "raise"): ("ProducerError", "producer rank"),
    ("offload", "host_raise"): ("RuntimeError", "injected host failure"),
    ("offload", "host_killed"): ("job ended", None),
    ("offload", "window_alloc"): ("ConfigError", "cannot allocate the"),
    ("offload", "unreachable"): ("DecodeError", "sample 45"),
    ("hybrid", "stop_mid"): ("completed, exactly once", None),
    ("hybrid", "slow"): ("completed, exactly once", None),
}


@pytest.fixture(scope="module")
def data(mpi_dataset):
    return mpi_dataset(48)


@pytest.mark.parametrize("mode, fault", list(CELLS), ids=[f"{m}-{f}" for m, f in CELLS])
@pytest.mark.slow
def test_fault_cell(data, mode, fault):
    outcome, names = CELLS[mode, fault]
    r = run_cell(fault, mode, data, limit=60)
    assert r["outcome"] == outcome, r
    if names is not None:
        assert names in r["message"], r
    assert not r["left_behind"], r
