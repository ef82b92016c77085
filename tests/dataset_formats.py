"""Datasets in other formats written from an ImageFolder, sample for sample in its order:
WebDataset tar shards (with ``tarfile``), Parquet and Arrow IPC files (with pyarrow)."""

import io
import json
import os
import tarfile

import numpy as np
from PIL import Image


def image_bytes(seed, fmt="JPEG", size=(40, 56)):
    """An image whose bytes differ for every seed: smooth gradients plus noise."""
    rng = np.random.default_rng(seed)
    h, w = size[0] + seed % 7, size[1] + seed % 5
    yy, xx = np.mgrid[0:h, 0:w]
    img = np.stack([(xx * 255 // w), (yy * 255 // h), np.full_like(xx, seed * 37 % 256)], -1)
    img = np.clip(img + rng.integers(-20, 20, img.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def make_folder(root, classes=3, per_class=7, pngs=True):
    """root/<class>/<name>.jpg (and a few .png): an ImageFolder of ``classes × per_class``."""
    for c in range(classes):
        d = os.path.join(root, f"class_{c}")
        os.makedirs(d, exist_ok=True)
        for k in range(per_class):
            seed = c * 100 + k
            png = pngs and k % 4 == 3
            with open(os.path.join(d, f"img_{k:03d}.{'png' if png else 'jpg'}"), "wb") as f:
                f.write(image_bytes(seed, "PNG" if png else "JPEG"))
    return root


def _add(tf, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def write_tars(src, pattern, per_shard, *, label="cls"):
    """Tar shards ``pattern % k`` of ``per_shard`` samples each, in ``src``'s order: members
    ``<key>.<ext>`` and ``<key>.cls`` (or ``<key>.json`` with {"label": ...} for
    ``label="json"``). Returns the shard paths."""
    paths = []
    for k, lo in enumerate(range(0, len(src), per_shard)):
        path = pattern % k
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
            for i in range(lo, min(lo + per_shard, len(src))):
                rel = src.relpath(i)
                key, ext = os.path.splitext(rel)
                _add(tf, key + ext.lower(), src.read(i))
                if label == "cls":
                    _add(tf, key + ".cls", str(src.label(i)).encode())
                else:
                    _add(tf, key + ".json", json.dumps({"label": src.label(i),
                                                        "name": rel}).encode())
        paths.append(path)
    return paths


def hf_table(src, *, struct=True):
    """A pyarrow Table of ``src``: image as Hugging Face's struct {bytes, path} (or plain
    binary), label int64."""
    import pyarrow as pa
    datas = [src.read(i) for i in range(len(src))]
    if struct:
        image = pa.StructArray.from_arrays(
            [pa.array(datas, pa.binary()), pa.array([src.relpath(i) for i in range(len(src))])],
            names=["bytes", "path"])
    else:
        image = pa.array(datas, pa.binary())
    return pa.table({"image": image, "label": pa.array(np.asarray(src.labels), pa.int64())})


def write_parquet(src, path, *, row_group_size=5, struct=True):
    import pyarrow.parquet as pq
    pq.write_table(hf_table(src, struct=struct), path, row_group_size=row_group_size)
    return path


def write_arrow(src, path, *, batch_rows=6, stream=False, struct=True):
    import pyarrow as pa
    table = hf_table(src, struct=struct)
    with pa.OSFile(path, "wb") as sink:
        writer = (pa.ipc.new_stream if stream else pa.ipc.new_file)(sink, table.schema)
        with writer:
            for batch in table.to_batches(max_chunksize=batch_rows):
                writer.write_batch(batch)
    return path


def batches(loader):
    """Every batch of one pass of ``loader`` as (images, labels) copies."""
    return [(x.copy(), y.copy()) for x, y in loader]


def same_stream(a, b):
    """Assert two lists of batches are equal, batch for batch, images and labels; a failure
    says which batch and where."""
    assert len(a) == len(b), f"{len(a)} batches against {len(b)}"
    for k, ((ax, ay), (bx, by)) in enumerate(zip(a, b)):
        assert np.array_equal(ay, by), f"batch {k}: labels {ay.tolist()} against {by.tolist()}"
        assert ax.shape == bx.shape, f"batch {k}: images {ax.shape} against {bx.shape}"
        diff = np.argwhere(ax != bx)
        assert not len(diff), (f"batch {k}: {len(diff)} image values differ, first at "
                               f"{diff[0].tolist()}: {ax[tuple(diff[0])]} against "
                               f"{bx[tuple(diff[0])]}")
