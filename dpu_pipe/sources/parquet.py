"""Images in a column of Parquet or Arrow IPC files: :class:`ParquetSource`, and Hugging Face
``datasets.Dataset`` objects through their Arrow files (:func:`from_hf_dataset`).

Needs pyarrow (``pip install dpu_pipe[parquet]``), imported when such a source is opened.
"""

import hashlib
import json
import os
import threading
from collections import OrderedDict

import numpy as np

from .. import _jpeg
from .. import _validate as _v
from ..errors import ConfigError, DecodeError
from .base import _PartedSource, buffers_by_record, frozen_labels

__all__ = ["ParquetSource", "from_hf_dataset", "PARQUET_EXTENSIONS", "ARROW_EXTENSIONS"]

PARQUET_EXTENSIONS = (".parquet", ".pq")
ARROW_EXTENSIONS = (".arrow", ".feather", ".ipc")


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401 - the submodules this module uses
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ConfigError("Parquet and Arrow sources need pyarrow: pip install pyarrow "
                          "(or dpu_pipe[parquet])") from None
    return pyarrow


class _File:
    """One data file's groups of rows (Parquet row groups, Arrow record batches, the latter
    memory-mapped) and its checked schema."""

    def __init__(self, path, image_column, label_column):
        pa = _pyarrow()
        self.path = path
        with open(path, "rb") as f:
            self.parquet = f.read(4) == b"PAR1"
        if self.parquet:
            self._pf = pa.parquet.ParquetFile(path, memory_map=True)
            schema = self._pf.schema_arrow
            md = self._pf.metadata
            self.group_rows = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
        else:
            source = pa.memory_map(path, "r")
            try:
                reader = pa.ipc.open_file(source)
                self._batches = [reader.get_batch(g) for g in range(reader.num_record_batches)]
                schema = reader.schema
            except pa.ArrowInvalid:
                source.seek(0)
                stream = pa.ipc.open_stream(source)  # a Hugging Face cache file
                schema = stream.schema
                self._batches = list(stream)
            self.group_rows = [b.num_rows for b in self._batches]
        self.schema = schema
        for col in (image_column, label_column):
            if col is not None and schema.get_field_index(col) < 0:
                raise ConfigError(f"{path} has no column {col!r}; its columns: {schema.names}")
        kind = schema.field(image_column).type
        if pa.types.is_struct(kind):
            if kind.get_field_index("bytes") < 0:
                raise ConfigError(f"{path}: image column {image_column!r} is a struct "
                                  f"without a 'bytes' field ({kind})")
            kind = kind.field("bytes").type
        if not (pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
            raise ConfigError(f"{path}: image column {image_column!r} holds {kind}; expected "
                              f"binary or a struct {{bytes, path}}")

    def labels(self, column):
        """The label column as int64 (N,)."""
        pa = _pyarrow()
        if self.parquet:
            col = self._pf.read(columns=[column]).column(0)
        else:
            col = pa.chunked_array([b.column(column) for b in self._batches],
                                   type=self.schema.field(column).type)
        if not (pa.types.is_integer(col.type) or pa.types.is_boolean(col.type)):
            raise ConfigError(f"{self.path}: label column {column!r} holds {col.type}; "
                              f"expected integers")
        if col.null_count:
            raise ConfigError(f"{self.path}: label column {column!r} has {col.null_count} "
                              f"missing labels")
        return col.to_numpy().astype(np.int64)

    def group(self, g, column):
        """Column ``column`` of group ``g`` as an Arrow array."""
        if self.parquet:
            col = self._pf.read_row_group(g, columns=[column]).column(0)
            return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        return self._batches[g].column(column)


def _validity(arr):
    """Bool per row of an Arrow array, or None when no row is null."""
    if not arr.null_count:
        return None
    return np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), bool)


class _Group:
    """One group's images: ``data`` (uint8), ``offsets`` int64 (n + 1), ``valid`` (bool (n,)
    or None) and, for a struct column, its ``path`` field (for rows without bytes)."""

    __slots__ = ("data", "offsets", "valid", "paths")

    def __init__(self, arr):
        pa = _pyarrow()
        self.paths = parent = None
        if pa.types.is_struct(arr.type):
            if arr.type.get_field_index("path") >= 0:
                self.paths = arr.field("path")
            parent = _validity(arr)
            arr = arr.field("bytes")
        valid = _validity(arr)
        self.valid = parent if valid is None else valid if parent is None else valid & parent
        bufs = arr.buffers()
        wide = pa.types.is_large_binary(arr.type)
        self.offsets = np.frombuffer(bufs[1], dtype="<i8" if wide else "<i4",
                                     count=arr.offset + len(arr) + 1)[arr.offset:].astype(np.int64)
        self.data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None and \
            bufs[2].size else np.zeros(0, np.uint8)


class ParquetSource(_PartedSource):
    """Images stored in a binary column of Parquet or Arrow IPC files, labels in an integer
    column, in file order then row order.

    Parameters
    ----------
    paths : str or list of str
        Parquet files (``PAR1`` magic) and Arrow IPC files (file or stream format, e.g. a
        Hugging Face ``datasets`` cache file), told apart by their contents.
    image_column : str
        A ``binary``/``large_binary`` column, or a struct with a ``bytes`` field (and
        optionally ``path``) as Hugging Face's ``Image()`` feature stores it; a row whose bytes
        are null is read from its ``path`` (absolute, or relative to its data file).
    label_column : str or None
        An integer column (a ``ClassLabel``); None: every label is 0.
    classes : list of str, optional
        Class names; by default those of a Hugging Face ``ClassLabel`` feature recorded in the
        files' schema metadata.
    max_cached_groups : int
        Parquet row groups kept decompressed at once (least recently used go first). Arrow
        IPC files are memory-mapped instead.

    Opening reads every file's footer and the label column; a group of the image column is
    loaded when one of its rows is first read (docs/guides/datasets.md, "Parquet, Arrow,
    Hugging Face datasets"). Raises :class:`ConfigError` for a missing file, a file that is
    neither Parquet nor Arrow, a missing column or one of the wrong type; a damaged row group
    raises :class:`DecodeError` naming the file and row group when one of its rows is read.
    """

    kind = "parquet"

    def __init__(self, paths, *, image_column="image", label_column="label", classes=None,
                 max_cached_groups=8):
        if isinstance(paths, (str, bytes, os.PathLike)):
            paths = [paths]
        try:
            paths = [os.path.abspath(os.fsdecode(p)) for p in paths]
        except TypeError:
            raise ConfigError(f"paths must be a path or a list of paths, got {paths!r}") from None
        if not paths:
            raise ConfigError("ParquetSource needs at least one file")
        if not isinstance(image_column, str) or not image_column:
            raise ConfigError(f"image_column must be a column name, got {image_column!r}")
        if label_column is not None and (not isinstance(label_column, str) or not label_column):
            raise ConfigError(f"label_column must be a column name or None, "
                              f"got {label_column!r}")
        self._max_cached = _v.positive_int(max_cached_groups, "max_cached_groups")
        pa = _pyarrow()
        files = []
        for p in paths:
            if not os.path.isfile(p):
                raise ConfigError(f"Parquet/Arrow file does not exist: {p}")
            try:
                files.append(_File(p, image_column, label_column))
            except (pa.ArrowException, OSError, ValueError) as e:
                raise ConfigError(f"{p} is neither a readable Parquet file nor an Arrow IPC "
                                  f"file: {e}") from None
        self._paths, self._files = paths, files
        self._image_column, self._label_column = image_column, label_column
        # One entry per group of rows: (file, group in file), with the first row of each.
        self._groups = [(f, g) for f, fl in enumerate(files) for g in range(len(fl.group_rows))]
        counts = np.array([files[f].group_rows[g] for f, g in self._groups], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if self._starts[-1] == 0:
            raise ConfigError(f"no rows in {len(paths)} Parquet/Arrow files (first: {paths[0]})")
        if label_column is None:
            labels = np.zeros(int(self._starts[-1]), np.int64)
        else:
            try:
                labels = np.concatenate([f.labels(label_column) for f in files])
            except (pa.ArrowException, OSError, ValueError) as e:
                raise ConfigError(f"cannot read label column {label_column!r}: {e}") from None
        if len(labels) != self._starts[-1]:
            raise ConfigError(f"the label column has {len(labels)} rows, the files' row groups "
                              f"{int(self._starts[-1])}")
        self._labels = frozen_labels(labels)
        self.classes = list(classes) if classes is not None else _hf_classes(
            files[0].schema, label_column)
        self._cache = OrderedDict()
        self._lock = threading.Lock()

    @property
    def paths(self):
        return list(self._paths)

    def _group(self, g):
        with self._lock:
            got = self._cache.get(g)
            if got is not None:
                self._cache.move_to_end(g)
                return got
        f, rg = self._groups[g]
        pa = _pyarrow()
        want = self._files[f].group_rows[rg]
        try:
            arr = self._files[f].group(rg, self._image_column)
            # The file is untrusted: Arrow checks offsets and lengths against the buffers
            # once per group, and the row count must be the one the index was built from.
            arr.validate(full=True)
            if len(arr) != want:
                raise ValueError(f"it holds {len(arr)} rows, the file's metadata says {want}")
            got = _Group(arr)
        except (pa.ArrowException, OSError, ValueError) as e:
            got = DecodeError(f"cannot read row group {rg}: {e}", path=self._paths[f])
        with self._lock:
            self._cache[g] = got
            if self._files[f].parquet:
                while len(self._cache) > self._max_cached:
                    self._cache.popitem(last=False)
        return got

    def _file_row(self, i):
        """(file, row in the file, row group in the file) of row ``i``."""
        g, _ = self._locate(i)
        f, rg = self._groups[g]
        return f, i - int(self._starts[g - rg]), rg

    def describe(self, i):
        f, row, rg = self._file_row(i)
        return f"{self._paths[f]}, row {row} (row group {rg})"

    def relpath(self, i):
        f, row, _ = self._file_row(i)
        return f"{os.path.basename(self._paths[f])}/{row}"

    def metadata(self, i):
        """``{"file": data file path, "row": row in that file}``."""
        f, row, _ = self._file_row(i)
        return {"file": self._paths[f], "row": row}

    def _view(self, i):
        g, j = self._locate(i)
        grp = self._group(g)
        if isinstance(grp, DecodeError):
            raise DecodeError(grp.message, index=i, path=self.describe(i))
        if grp.valid is not None and not grp.valid[j]:
            return self._from_path(i, grp, j)
        lo, hi = int(grp.offsets[j]), int(grp.offsets[j + 1])
        if not 0 <= lo <= hi <= len(grp.data):
            raise DecodeError("cannot read: image offsets lie outside the column's data",
                              index=i, path=self.describe(i))
        return grp.data[lo:hi]

    def _from_path(self, i, grp, j):
        path = grp.paths[j].as_py() if grp.paths is not None else None
        if not path:
            raise DecodeError("cannot read: the image is null (no bytes, no path)", index=i,
                              path=self.describe(i))
        f = self._file_row(i)[0]
        full = os.path.join(os.path.dirname(self._paths[f]), path)
        try:
            with open(full, "rb") as fh:
                return np.frombuffer(fh.read(), np.uint8)
        except OSError as e:
            raise DecodeError(f"cannot read: {e}", index=i, path=full) from None

    def read(self, i):
        return self._view(i).tobytes()

    def buffers(self, indices):
        """``(BufferList, {batch position: DecodeError})`` of rows ``indices`` (int64 (n,));
        rows of one group are passed as that group's buffers and offsets."""
        indices, g = self._one_part(indices)
        if g is not None:
            grp = self._group(g)
            if not isinstance(grp, DecodeError):
                j = indices - self._starts[g]
                if grp.valid is None or grp.valid[j].all():
                    lo = grp.offsets[j]
                    try:
                        return _jpeg.BufferList.from_packed(grp.data, lo,
                                                            grp.offsets[j + 1] - lo), {}
                    except ConfigError:
                        pass    # offsets out of bounds: the general path names the row
        return buffers_by_record(indices, self._view)

    def fingerprint(self):
        """Digest of the file names, their row counts and the labels."""
        if getattr(self, "_fp", None) is None:
            h = hashlib.sha256()
            for p, fl in zip(self._paths, self._files):
                line = f"{os.path.basename(p)}\0{fl.group_rows}\n"
                h.update(line.encode("utf-8", "surrogateescape"))
            h.update(np.ascontiguousarray(self._labels).tobytes())
            self._fp = h.hexdigest()[:16]
        return self._fp

    def _spec(self):
        return {"paths": list(self._paths), "image_column": self._image_column,
                "label_column": self._label_column, "classes": self.classes,
                "max_cached_groups": self._max_cached}


def _hf_classes(schema, label_column):
    """The ``ClassLabel`` names that ``datasets`` records in a file's schema metadata, or None."""
    meta = (schema.metadata or {}).get(b"huggingface")
    if not meta or label_column is None:
        return None
    try:
        feature = json.loads(meta)["info"]["features"][label_column]
        names = feature.get("names") if isinstance(feature, dict) else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return [str(n) for n in names] if isinstance(names, list) else None


def from_hf_dataset(ds, *, image_column="image", label_column="label"):
    """A :class:`ParquetSource` over the Arrow files behind a Hugging Face
    ``datasets.Dataset`` (its ``cache_files``), rows in the dataset's order. A dataset held
    only in memory, or one with an indices mapping (after ``shuffle``, ``select``,
    ``filter``...), raises :class:`ConfigError` saying what to call first."""
    files = [c["filename"] for c in getattr(ds, "cache_files", None) or []]
    if not files:
        raise ConfigError("this datasets.Dataset has no Arrow files (it lives in memory): "
                          "save_to_disk() and load_from_disk() it first")
    if getattr(ds, "_indices", None) is not None:
        raise ConfigError("this datasets.Dataset has an indices mapping (shuffle/select/"
                          "filter): call ds.flatten_indices() first")
    feature = getattr(ds, "features", {}).get(label_column) if label_column else None
    names = getattr(feature, "names", None)
    classes = list(names) if isinstance(names, list) else None
    src = ParquetSource(files, image_column=image_column, label_column=label_column,
                        classes=classes)
    if len(src) != len(ds):
        raise ConfigError(f"the Arrow files of this datasets.Dataset hold {len(src)} rows, "
                          f"the dataset {len(ds)}")
    return src
