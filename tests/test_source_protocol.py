"""The source protocol: a user's source, its spec round trip (check_rebuild), and packing any
source (tar shards, Parquet, a user's factory) with ``pack`` and ``dpu-pipe pack``."""

import json
import subprocess
import sys

import numpy as np
import pytest

from dpu_pipe import Loader, pack
from dpu_pipe.errors import ConfigError
from dpu_pipe.sources import ImageFolder, PackedSource, check_rebuild, open_source

import dataset_formats as dfm
import user_source as us
from helpers import TESTS, repo_env


batches, same_stream = dfm.batches, dfm.same_stream


@pytest.fixture(scope="module")
def root(format_folder):
    return format_folder


def test_user_source_spec_round_trips(root):
    src = us.EveryKth(root, 3, 1)
    spec = check_rebuild(src)
    assert spec["factory"] == "user_source:EveryKth"
    again = open_source(json.loads(json.dumps(spec)))
    assert len(again) == len(src) == 7
    assert [again.read(i) for i in range(len(again))] == [src.read(i) for i in range(len(src))]
    folder = ImageFolder(root)
    assert src.read(2) == folder.read(7)
    fn = open_source({"factory": "user_source:every_kth", "args": {"root": root, "k": 3,
                                                                  "start": 1}})
    assert fn.fingerprint() == src.fingerprint()


def test_spec_that_does_not_round_trip_is_a_config_error(root):
    with pytest.raises(ConfigError, match="differs from the one the spec describes|rebuilds"):
        check_rebuild(us.ForgetsStart(root, 3, 1))
    with pytest.raises(ConfigError, match="changes in JSON"):
        check_rebuild(us.NotJson(root, 3, 1))

    class Local(us.EveryKth):   # not importable by name from another process
        pass
    with pytest.raises(ConfigError, match="has no"):
        check_rebuild(Local(root, 3, 1))

    class NoSpec:
        labels = np.zeros(2, np.int64)

        def __len__(self):
            return 2
    with pytest.raises(ConfigError, match="has no spec"):
        check_rebuild(NoSpec())


def test_user_source_in_a_loader(root):
    src = us.EveryKth(root, 2)
    folder = ImageFolder(root)
    got = batches(Loader(src, 3, train=False, size=24))
    flat = np.concatenate([y for _, y in got])
    assert np.array_equal(flat, folder.labels[::2])


def _run_cli(*args):
    return subprocess.run([sys.executable, "-m", "dpu_pipe", *map(str, args)],
                          capture_output=True, text=True, env=repo_env(TESTS), timeout=300)


def test_pack_from_tar_parquet_and_factory(root, tmp_path):
    folder = ImageFolder(root)
    want = batches(Loader(folder, 4, train=False, size=24))
    dfm.write_tars(folder, str(tmp_path / "s-%02d.tar"), 10)
    pq = dfm.write_parquet(folder, str(tmp_path / "x.parquet"))

    r = _run_cli("pack", tmp_path / "s-{00..02}.tar", tmp_path / "from_tar", "-q",
                 "--no-transcode", "--threads", "2")
    assert r.returncode == 0, r.stderr
    from_tar = PackedSource(str(tmp_path / "from_tar"))
    assert from_tar.relpath(0) == "s-00.tar/" + folder.relpath(0)
    same_stream(batches(Loader(from_tar, 4, train=False, size=24)), want)

    from_pq = pack(pq, str(tmp_path / "from_pq"), transcode=False, progress=False)
    same_stream(batches(Loader(from_pq, 4, train=False, size=24)), want)

    r = _run_cli("pack", tmp_path / "from_fn", "--factory", "user_source:every_kth",
                 "--args", json.dumps({"root": root, "k": 2}), "-q", "--no-transcode")
    assert r.returncode == 0, r.stderr
    from_fn = PackedSource(str(tmp_path / "from_fn"))
    assert np.array_equal(from_fn.labels, folder.labels[::2])
    assert from_fn.read(3) == folder.read(6)
    assert from_fn.dataset.meta["source"]["factory"] == "user_source:EveryKth"

    r = _run_cli("pack", tmp_path / "x", "--factory", "user_source:every_kth", "--args", "[1]")
    assert r.returncode != 0 and "JSON object" in r.stderr
    r = _run_cli("pack", tmp_path / "only_out")
    assert r.returncode != 0 and "SRC OUT" in r.stderr


def test_pack_refuses_labels_it_cannot_hold(tmp_path):
    from dpu_pipe.sources import FileList
    img = tmp_path / "a.jpg"
    img.write_bytes(dfm.image_bytes(1))
    src = FileList([(str(img), 0.5)])
    with pytest.raises(ConfigError, match="one integer label per sample"):
        pack(src, str(tmp_path / "out"), progress=False)


def test_dpu_loader_refuses_a_spec_that_does_not_round_trip_on_the_host(root):
    """Before any MPI: the producers would rebuild another dataset, so the host refuses."""
    from dpu_pipe import DPULoader
    with pytest.raises(ConfigError, match="differs from the one the spec describes"):
        DPULoader(us.ForgetsStart(root, 3, 1), 4, mode="offload")
    with pytest.raises(ConfigError, match="changes in JSON"):
        DPULoader(us.NotJson(root, 3, 1), 4, mode="hybrid")
