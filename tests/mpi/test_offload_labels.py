"""Labels beyond one int class, sample indices and per-sample metadata through DPULoader
under mpiexec (1 host, 2 producers): float, multi-label and multi-float labels with a
metadata column and bad files skipped, in offload and hybrid modes, equal to the local
Loader batch by batch, images, labels and metadata."""
import pytest

from mpi_launch import ENVS
from test_offload import BAD, launch, read

pytestmark = pytest.mark.timeout(300)

N = 32


@pytest.fixture(scope="module")
def data(mpi_dataset):
    return mpi_dataset(N, BAD)


@pytest.mark.parametrize("env", list(ENVS))
@pytest.mark.slow
def test_labels_indices_and_metadata_equal_the_loader(data, tmp_path, env):
    out = str(tmp_path / "out")
    # Producers take 30 ms per batch, so hybrid host threads make batches too.
    job = launch(1, 2, "labels", out, "--data", data, "--bad", ",".join(map(str, BAD)),
                 worker_args=("--fixed-delay", "0.03"), env=env, limit=120)
    assert job.returncode == 0, job.explain()
    runs = read(out, "host0.json")["runs"]
    assert [(r["kind"], r["mode"]) for r in runs] == [
        (k, m) for k in ("float", "multi", "multi-float") for m in ("offload", "hybrid")]
    for r in runs:
        assert r["batches"] == 2 * N // 4, r
        assert r["skipped"] == sorted(BAD), r
        assert r["producer_samples"] + r["host_samples"] == 4 * r["batches"], r
        # stats()["samples"] counts what every maker made (cancelled work too): at least
        # what was delivered, the work of the second host thread included.
        assert r["samples"] >= r["producer_samples"] + r["host_samples"], r
        if r["mode"] == "offload":
            assert r["host_samples"] == 0, r
    # How many batches hybrid host threads make depends on the machine's load, so it is not
    # asserted here; that they make them, with labels equal to the Loader's, is forced in
    # tests/mpi/test_offload.py::test_hybrid_takes_over_a_stopped_producer (a stopped producer).
