"""Sample indices and per-sample metadata (``return_meta=True``) from the local Loader and
DPULoader's local mode: each row's metadata names the sample whose image and label the row
holds — also where ``on_error="skip"`` replaced a bad file — across resume, set_epoch, torch
output and the IterableDataset view; and labels beyond one int class through DPULoader."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dpu_pipe import ConfigError, DPULoader, Loader
from dpu_pipe.sampler import EpochSampler
from dpu_pipe.sources import FileList

from test_loader import KW, SEED, kernel_reference, make_dataset

pytestmark = pytest.mark.timeout(120)

N = 20
BAD = {4: "corrupt", 11: "missing"}


@pytest.fixture(scope="module")
def listed(tmp_path_factory):
    """N samples (two of them bad) with float labels unique to each sample (not its index)
    and a caption column."""
    files = make_dataset(str(tmp_path_factory.mktemp("meta")), N, bad=BAD)
    return FileList([(files.describe(i), 100 + 0.5 * i, f"sample {i}") for i in range(N)],
                    meta_columns=["caption"])


def check_rows(src, images, labels, meta, epoch):
    """Each row is the sample its metadata names: its label, its caption, its path, and its
    image as the kernel makes that sample alone."""
    index = np.asarray(meta["index"])
    assert index.dtype == np.int64 and index.shape == (len(labels),)
    assert not set(index.tolist()) & set(BAD)
    assert np.array_equal(np.asarray(labels), src.labels[index])
    assert meta["path"] == [src.relpath(i) for i in index.tolist()]
    assert meta["caption"] == [f"sample {i}" for i in index.tolist()]
    assert sorted(meta) == ["caption", "index", "path", "valid"]
    valid = np.asarray(meta["valid"])
    assert valid.dtype == bool and valid.shape == (len(labels),) and valid.all()
    assert np.array_equal(np.asarray(images), kernel_reference(src, index, epoch))


@pytest.mark.parametrize("loader_type", [Loader, DPULoader], ids=["Loader", "DPULoader-local"])
def test_meta_names_the_sample_of_every_row_with_bad_files_skipped(listed, loader_type):
    kw = dict(KW, on_error="skip", return_meta=True, num_threads=2)
    if loader_type is DPULoader:
        kw["mode"] = "local"
    replaced = 0
    with loader_type(listed, 4, **kw) as loader:
        for epoch in range(2):
            order = EpochSampler(N, seed=SEED).permutation(epoch).tolist()
            for step, (x, y, meta) in enumerate(loader):
                check_rows(listed, x, y, meta, epoch)
                planned = order[4 * step:4 * step + 4]
                replaced += sum(a != b for a, b in zip(meta["index"].tolist(), planned))
        assert set(loader.bad_samples) == set(BAD)
    assert replaced == 2 * len(BAD)      # each bad file replaced once per epoch


def test_meta_follows_resume_and_set_epoch(listed):
    kw = dict(KW, on_error="skip", return_meta=True)

    def indices(batches):
        return [b[2]["index"].tolist() for b in batches]

    with Loader(listed, 4, **kw) as whole:
        whole.set_epoch(3)
        want = indices(list(whole))
    with Loader(listed, 4, **kw) as first:
        first.set_epoch(3)
        it = iter(first)
        head = [next(it)[2]["index"].tolist() for _ in range(2)]
        state = first.state_dict()
    with Loader(listed, 4, **kw) as again:
        again.load_state_dict(state)
        rest = [(x.copy(), y, m) for x, y, m in again]
    assert head + indices(rest) == want
    for x, y, meta in rest:
        check_rows(listed, x, y, meta, 3)


def test_meta_without_source_metadata_is_the_indices(listed):
    class Bare:
        """A user's source: read, labels, describe and len only."""

        def __init__(self, src):
            self.src, self.labels = src, src.labels

        def __len__(self):
            return len(self.src)

        def read(self, i):
            return self.src.read(i)

        def describe(self, i):
            return self.src.describe(i)

    with Loader(Bare(listed), 4, **KW, on_error="skip", return_meta=True) as loader:
        for x, y, meta in loader:
            assert list(meta) == ["index", "valid"]
            assert np.array_equal(listed.labels[meta["index"]], y)


def test_return_meta_is_checked():
    with pytest.raises(ConfigError, match="return_meta must be True or False"):
        Loader(FileList([("a.jpg", 1)]), 1, return_meta="yes")


def test_torch_output_and_iterable_dataset_carry_meta(listed):
    torch = pytest.importorskip("torch")
    kw = dict(KW, on_error="skip", return_meta=True, output="torch", shuffle=False)
    with Loader(listed, 4, **kw) as loader:
        direct = [(x.clone(), y, m) for x, y, m in loader]
        loader.set_epoch(0)
        dl = torch.utils.data.DataLoader(loader.iterable_dataset(), batch_size=None)
        viewed = [(x.clone(), y, m) for x, y, m in dl]
    assert len(direct) == len(viewed) == 5
    for (x, y, m), (u, v, w) in zip(direct, viewed):
        assert isinstance(m["index"], torch.Tensor) and m["index"].dtype == torch.int64
        assert torch.equal(x, u) and torch.equal(y, v)
        assert torch.equal(m["index"], w["index"]) and m["path"] == w["path"]
        check_rows(listed, x.numpy(), y.numpy(), {**m, "index": m["index"].numpy()}, 0)


@pytest.mark.parametrize("labels, dtype, shape", [
    ([0.5 * i for i in range(N)], np.float32, ()),
    ([(i % 2, i % 3, 1) for i in range(N)], np.int64, (3,)),
    ([(0.1 * i, -i) for i in range(N)], np.float32, (2,))], ids=["float", "multi", "multi-float"])
def test_dpu_loader_yields_float_and_multi_labels(listed, labels, dtype, shape):
    """DPULoader takes any label array a source has (the offloaded modes are tested under
    mpiexec); here its local mode against the Loader and the source's own labels."""
    src = FileList([(listed.describe(i), lab) for i, lab in enumerate(labels)])
    kw = dict(KW, on_error="skip", return_meta=True)
    with DPULoader(src, 4, mode="local", **kw) as dl, Loader(src, 4, **kw) as ref:
        got = [(x.copy(), y, m) for x, y, m in dl]
        want = [(x.copy(), y, m) for x, y, m in ref]
    assert len(got) == len(want) == 5
    for (x, y, m), (u, v, w) in zip(got, want):
        assert y.dtype == dtype and y.shape == (len(x),) + shape
        assert np.array_equal(x, u) and np.array_equal(y, v)
        assert np.array_equal(m["index"], w["index"])
        assert np.array_equal(y, np.asarray(labels, dtype)[m["index"]])


@pytest.mark.parametrize("kw, match", [
    ({"liveness_timeout": 0}, "liveness_timeout must be > 0"),
    ({"liveness_timeout": -1.0}, "liveness_timeout must be > 0"),
    ({"liveness_timeout": float("nan")}, "liveness_timeout must be finite"),
    ({"liveness_timeout": "60"}, "liveness_timeout must be a number"),
    ({"liveness_timeout": True}, "liveness_timeout must be a number"),
    ({"producer_threads": 0}, "producer_threads must be an integer >= 1"),
    ({"producer_threads": 1.5}, "producer_threads must be an integer"),
    ({"producer_threads": True}, "producer_threads must be an integer"),
    ({"producer_threads": "2"}, "producer_threads must be an integer"),
])
def test_dpuloader_checks_its_own_arguments(listed, kw, match):
    """liveness_timeout and producer_threads go through dpu_pipe._validate like every other
    argument (a zero liveness timeout used to pass and time out every producer at once)."""
    with pytest.raises(ConfigError, match=match):
        DPULoader(listed, 4, mode="local", **kw)


def test_local_mode_never_touches_mpi(listed):
    """``mode="local"`` — Loader's default, and ``DPULoader(mode="local")`` — starts no host
    group and imports no MPI: a fresh process iterates an epoch of each and mpi4py is still
    not imported."""
    rows = [(listed.describe(i), i) for i in range(N) if i not in BAD]
    code = "\n".join([
        "import json, sys",
        "from dpu_pipe import DPULoader, Loader",
        "from dpu_pipe.sources import FileList",
        "src = FileList([tuple(r) for r in json.loads(sys.argv[1])])",
        "for kind in (Loader, DPULoader):",
        "    with kind(src, 4, mode='local', size=16, dtype='uint8') as dl:",
        "        assert sum(len(y) for _, y in dl) == len(src)",
        "        assert dl.mode == 'local' and dl._group is None",
        "assert 'mpi4py' not in sys.modules, 'mpi4py was imported'",
        "print('OK')"])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(rows)], env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr
