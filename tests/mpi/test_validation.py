"""RemoteValidation under mpiexec: hosts run ``validation_host.py``, producer ranks
``python -m dpu_pipe.worker`` (MPMD). Metrics must equal the host's own evaluation of the
same snapshot; submit must not wait for the evaluation; errors and silent producers surface
through the future.
"""
import json
import os
import sys

import pytest

from helpers import sample_jpeg
from mpi_launch import HERE, ROOT, run_mpi

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(300)

CLASSES = 5
ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}


def make_data(root, n):
    """An ImageFolder of ``n`` photos in 5 classes."""
    for i in range(n):
        d = root / f"class{i % CLASSES}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:03d}.jpg").write_bytes(sample_jpeg(i))
    return str(root)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("validation") / "val", 24)


@pytest.fixture(scope="module")
def seven(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("validation") / "seven", 7)


def launch(hosts, producers, scenario, data, out, *args, limit=150):
    os.makedirs(out, exist_ok=True)
    worker = [":", "-n", str(producers), sys.executable, "-m", "mpi4py", "-m", "dpu_pipe.worker"]
    return run_mpi(hosts, "validation_host.py", scenario, "--data", data, "--out", out, *args,
                   *worker, env=ENV, limit=limit)


def results(out, hosts):
    got = []
    for h in range(hosts):
        path = os.path.join(out, f"host{h}.json")
        assert os.path.exists(path), f"host {h} wrote no result"
        with open(path) as f:
            got.append(json.load(f))
    return got


@pytest.mark.parametrize("hosts,producers,batch,n", [(1, 1, 5, 24), (1, 3, 4, 24),
                                                     (2, 2, 3, 7), (2, 4, 5, 24)],
                         ids=["1host-1prod", "1host-3prod", "2hosts-1prod-each-7samples-batch3",
                              "2hosts-2prod-each"])
@pytest.mark.slow
def test_metrics_equal_host_evaluation(data, seven, tmp_path, hosts, producers, batch, n):
    job = launch(hosts, producers, "equal", data if n == 24 else seven, str(tmp_path),
                 "--batch-size", str(batch))
    assert job.returncode == 0, job.explain()
    for h, res in enumerate(results(str(tmp_path), hosts)):
        for name in ("a", "b"):
            remote, host = res[name]["remote"], res[name]["host"]
            assert remote["tag"] == name
            assert remote["count"] == host["count"] == n, (h, name, remote, host)
            assert remote["top1"] == host["top1"] and remote["top5"] == host["top5"], \
                (h, name, remote, host)
            assert remote["loss"] == pytest.approx(host["loss"], rel=1e-6)
            assert remote["seconds"] > 0
            # CPU seconds of a producer's validation thread: some, never more than its wall
            # time (thread CPU time on one thread; 10 ms for clock granularity).
            for wall, cpu in res[name]["times"]:
                assert 0 < cpu <= wall + 0.01, (h, name, wall, cpu)
            # Every producer of every host took part, and the parts add up.
            parts = res[name]["parts"]
            assert len(parts) == producers
            assert sum(c for _, _, c in parts) == n
            if n == 7:   # uneven shards: host 0 evaluates 4 samples, host 1 three
                assert sorted((h, c) for h, _, c in parts) == [(0, 4), (1, 3)]
        # The two snapshots differ, so the queued second one was evaluated with its own
        # weights, not the first's.
        assert res["a"]["remote"]["loss"] != res["b"]["remote"]["loss"]


@pytest.mark.slow
def test_submit_returns_while_training_goes_on(data, tmp_path):
    job = launch(1, 1, "overlap", data, str(tmp_path), "--batch-size", "4")
    assert job.returncode == 0, job.explain()
    (res,) = results(str(tmp_path), 1)
    events = res["events"]
    kinds = [e[0] for e in events]
    sub = kinds.index("submitted")
    assert events[sub][1] is False, "submit waited for the evaluation"
    assert kinds[:sub] == ["batch", "batch"]
    # Training batches kept coming after submit returned and before the result was ready: the
    # evaluation cannot finish before the host opens its gate after two such batches.
    during = [e for e in events[sub + 1:] if e[0] == "batch" and e[3] is False]
    assert len(during) >= 2, events
    assert kinds[-1] == "result" and events[-1][1] == 24


@pytest.mark.slow
def test_errors_and_silence_come_back_through_the_future(data, tmp_path):
    job = launch(1, 2, "failures", data, str(tmp_path))
    assert job.returncode == 0, job.explain()
    (res,) = results(str(tmp_path), 1)
    errors, silent = res["errors"], res["silent"]
    f = errors["factory"]
    assert f["raised"] == "ProducerError"
    assert "the factory broke on purpose" in f["message"]
    assert "broken_factory" in f["traceback"] and "valmodels.py" in f["traceback"]
    assert "producer rank" in f["producer"]
    g = errors["forward"]
    assert g["raised"] == "ProducerError" and "forward refused a batch" in g["message"]
    assert "in forward" in g["traceback"]
    w = errors["weights"]
    assert w["raised"] == "ProducerError" and "do not match the model" in w["message"]
    assert errors["after"] == 24
    # A stopped producer: PipeTimeout naming it, not before the timeout asked for (the
    # error's own words say which deadline it was); the same future completes once it runs
    # again.
    assert silent["raised"] and "no answer within 3 s" in silent["raised"]
    assert f"producer rank {silent['stopped']} of host 0" in silent["raised"]
    assert silent["waited"] >= 3
    assert silent["after_resume"] == 24
