"""Soak: a train and a val DPULoader (1 host, 2 producers) alternating every epoch over a
dataset with 2 % bad files, local Loaders with 1 and 2 threads beside them, a set_epoch jump
and a resume half-way. Resources of every rank must not grow and the last epoch's stream must
equal a fresh Loader's.

CI runs 5 epochs in offload mode. The long version (outside CI)::

    DPU_PIPE_SOAK_EPOCHS=50 DPU_PIPE_SOAK_MODES=offload,hybrid python -m pytest -s tests/mpi/test_soak.py

prints the table of RSS, fds, threads per rank and files under $TMPDIR every 10 epochs.
"""
import json
import os
import sys

import pytest

from mpi_launch import run_mpi

EPOCHS = int(os.environ.get("DPU_PIPE_SOAK_EPOCHS", "5"))
MODES = os.environ.get("DPU_PIPE_SOAK_MODES", "offload,hybrid").split(",")
N = 100                 # samples; 2 of them bad (2 %)
BAD = {13: "corrupt", 71: "not-jpeg"}
RSS_GROWTH = 0.05       # RSS after the last epoch within 5 % of after the first

# Epochs under mpiexec with resource sampling: the slow tier.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(max(300, 30 * EPOCHS))]


@pytest.fixture(scope="module")
def data(mpi_dataset):
    return mpi_dataset(N, BAD)


def table(res):
    rows = [r for r in res["rows"] if r["epoch"] == 1 or r["epoch"] % 10 == 0
            or r["epoch"] == len(res["rows"])]
    names = list(rows[0]["ranks"])
    head = "| epoch | s | tmp files | " + " | ".join(f"{n} RSS MiB / fds / threads"
                                                    for n in names) + " |"
    lines = [head, "|" + "---|" * (3 + len(names))]
    for r in rows:
        cells = []
        for n in names:
            s = r["ranks"][n]
            cells.append("gone" if s is None else
                         f"{s['rss'] / 2**20:.1f} / {s['fds']} / {s['threads']}")
        lines.append(f"| {r['epoch']} | {r['seconds']} | {r['tmp_files']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


@pytest.fixture(scope="module", params=MODES)
def soak(data, tmp_path_factory, request):
    """One soak run per mode: (mode, results, the job's $TMPDIR)."""
    mode = request.param
    base = tmp_path_factory.mktemp(f"soak-{mode}")
    out, tmpdir = str(base / "out"), base / "tmpdir"
    os.makedirs(out)
    os.makedirs(tmpdir)
    job = run_mpi(1, "reliability_host.py", "soak", "--data", data, "--out", out,
                  "--epochs", str(EPOCHS), "--mode", mode, "--timeout", "20",
                  ":", "-n", "2", sys.executable,
                  "-m", "mpi4py", "-m", "dpu_pipe.worker", env={"TMPDIR": str(tmpdir)},
                  limit=max(240, 25 * EPOCHS))
    assert job.returncode == 0, job.explain()
    with open(os.path.join(out, "soak.json")) as f:
        res = json.load(f)
    print(f"\nsoak, mode {mode}, {EPOCHS} epochs\n" + table(res))
    return mode, res, tmpdir


def test_soak_resources_stay_flat_and_the_stream_stays_right(soak):
    mode, res, tmpdir = soak
    assert res["last_epoch_equals_fresh_loader"]
    # Every bad file is reported by the loaders that met it (the train loader before and
    # after the resume, the val loader).
    seen = set(res["bad"]) | set(res["bad_before_resume"])
    assert seen == {str(i) for i in BAD} and set(res["val_bad"]) == seen, res
    rows = res["rows"]
    assert len(rows) == EPOCHS and len(rows[0]["ranks"]) == 3, rows[0]
    # The baseline is the first epoch: a producer starts its maker thread, touches its batch
    # buffers and imports OpenCV when a pipeline opens, so nothing grows when its first batch
    # (or its first non-JPEG sample) comes later, as it may in hybrid mode.
    first, last = rows[0], rows[-1]
    for name, s0 in first["ranks"].items():
        s1 = last["ranks"][name]
        assert s0 is not None and s1 is not None, (name, first, last)
        assert s1["fds"] <= s0["fds"], (name, s0, s1)
        assert s1["threads"] <= s0["threads"], (name, s0, s1)
        assert s1["rss"] <= s0["rss"] * (1 + RSS_GROWTH), (name, s0, s1)
    assert last["tmp_files"] <= first["tmp_files"], (first["tmp_files"], last["tmp_files"])
    # Nothing MPICH leaves in $TMPDIR (hydra_hwloc_xmlfile_*) outlives the job.
    assert not os.listdir(tmpdir), os.listdir(tmpdir)
