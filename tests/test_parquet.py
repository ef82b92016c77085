"""Parquet and Arrow IPC files, and Hugging Face datasets: the same stream as the ImageFolder
they were written from; bad files and columns."""

import os
import pickle

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from dpu_pipe import Loader  # noqa: E402
from dpu_pipe.errors import ConfigError, DecodeError  # noqa: E402
from dpu_pipe.sources import ImageFolder, ParquetSource, as_source, open_source  # noqa: E402

import dataset_formats as dfm  # noqa: E402


batches, same_stream = dfm.batches, dfm.same_stream


@pytest.fixture(scope="module")
def folder(format_folder):
    return ImageFolder(format_folder)


LAYOUTS = {
    "parquet-struct": lambda src, d: dfm.write_parquet(src, os.path.join(d, "x.parquet")),
    "parquet-binary": lambda src, d: dfm.write_parquet(src, os.path.join(d, "x.parquet"),
                                                       struct=False, row_group_size=4),
    "arrow-file": lambda src, d: dfm.write_arrow(src, os.path.join(d, "x.arrow")),
    "arrow-stream": lambda src, d: dfm.write_arrow(src, os.path.join(d, "x.arrow"),
                                                   stream=True, struct=False),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("train", [False, True], ids=["val", "train"])
def test_stream_equals_image_folder(folder, tmp_path, layout, train):
    path = LAYOUTS[layout](folder, str(tmp_path))
    src = as_source(path)
    assert isinstance(src, ParquetSource) and len(src) == len(folder)
    assert np.array_equal(src.labels, folder.labels)
    for i in range(len(folder)):
        assert src.read(i) == folder.read(i)
    same_stream(batches(Loader(path, 4, train=train, size=32, seed=3)),
                batches(Loader(folder, 4, train=train, size=32, seed=3)))


def test_one_row_group_batch_is_zero_copy_and_spec_round_trips(folder, tmp_path):
    path = dfm.write_parquet(folder, str(tmp_path / "x.parquet"), row_group_size=100)
    src = ParquetSource(path, max_cached_groups=1)
    bufs, errors = src.buffers(np.array([5, 1, 9], np.int64))
    assert len(bufs) == 3 and not errors
    assert src._cache[0].data.base is not None     # a view of Arrow's buffer, not a copy
    again = open_source(src.spec())
    assert again.fingerprint() == src.fingerprint()
    assert pickle.loads(pickle.dumps(src)).read(2) == folder.read(2)
    assert src.metadata(3) == {"file": path, "row": 3}


def test_several_files_and_lru_bound(folder, tmp_path):
    a = dfm.write_parquet(folder, str(tmp_path / "a.parquet"), row_group_size=3)
    b = dfm.write_arrow(folder, str(tmp_path / "b.arrow"), batch_rows=5)
    src = ParquetSource([a, b], max_cached_groups=2)
    n = len(folder)
    assert len(src) == 2 * n
    for i in range(0, 2 * n, 3):
        assert src.read(i) == folder.read(i % n)
        assert sum(1 for g in src._cache if src._groups[g][0] == 0) <= 2
    assert src.relpath(n + 2) == "b.arrow/2"
    bufs, errors = src.buffers(np.arange(2 * n, dtype=np.int64))
    assert len(bufs) == 2 * n and not errors


def test_null_bytes_read_from_path_and_null_image(folder, tmp_path):
    table = dfm.hf_table(folder)
    datas = [None if i == 2 else folder.read(i) for i in range(len(folder))]
    paths = [os.path.join(folder.root, folder.relpath(i)) if i != 4 else None
             for i in range(len(folder))]
    datas[4] = None
    image = pa.StructArray.from_arrays([pa.array(datas, pa.binary()), pa.array(paths)],
                                       names=["bytes", "path"])
    table = table.set_column(0, "image", image)
    path = str(tmp_path / "n.parquet")
    pq.write_table(table, path)
    src = ParquetSource(path)
    assert src.read(2) == folder.read(2)           # from its path
    with pytest.raises(DecodeError, match="the image is null"):
        src.read(4)
    got = batches(Loader(src, 7, train=False, size=16, on_error="skip"))
    assert sum(len(y) for _, y in got) == len(folder)


def test_bad_files_and_columns(folder, tmp_path):
    path = dfm.write_parquet(folder, str(tmp_path / "x.parquet"))
    with pytest.raises(ConfigError, match="no column 'img'"):
        ParquetSource(path, image_column="img")
    table = pa.table({"image": pa.array([1, 2]), "label": pa.array(["a", "b"])})
    pq.write_table(table, str(tmp_path / "w.parquet"))
    with pytest.raises(ConfigError, match="image column 'image' holds int64"):
        ParquetSource(str(tmp_path / "w.parquet"))
    table = pa.table({"image": pa.array([b"x", b"y"]), "label": pa.array(["a", "b"])})
    pq.write_table(table, str(tmp_path / "l.parquet"))
    with pytest.raises(ConfigError, match="label column 'label' holds string"):
        ParquetSource(str(tmp_path / "l.parquet"))
    junk = tmp_path / "j.parquet"
    junk.write_bytes(b"PAR1" + b"\0" * 50)
    with pytest.raises(ConfigError, match="neither a readable Parquet file"):
        ParquetSource(str(junk))
    with pytest.raises(ConfigError, match="does not exist"):
        ParquetSource(str(tmp_path / "missing.parquet"))
    with pytest.raises(ConfigError, match="pyarrow|Parquet"):
        ParquetSource([])


def test_hugging_face_dataset(folder, tmp_path):
    datasets = pytest.importorskip("datasets")
    names = list(folder.classes)
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": folder.read(i), "path": None} for i in range(len(folder))],
         "label": [int(v) for v in folder.labels]},
        features=datasets.Features({"image": datasets.Image(),
                                    "label": datasets.ClassLabel(names=names)}))
    ds.save_to_disk(str(tmp_path / "hf"))
    ds = datasets.load_from_disk(str(tmp_path / "hf"))
    src = open_source(ds)
    assert src.classes == names and len(src) == len(folder)
    same_stream(batches(Loader(ds, 5, train=True, size=24, seed=1)),
                batches(Loader(folder, 5, train=True, size=24, seed=1)))
    # The classes come from the schema metadata too, without the Dataset object.
    assert ParquetSource(src.paths).classes == names
    with pytest.raises(ConfigError, match="flatten_indices"):
        open_source(ds.shuffle(seed=0))
    mem = datasets.Dataset.from_dict({"image": [b"x"], "label": [0]})
    with pytest.raises(ConfigError, match="save_to_disk"):
        open_source(mem)
