"""A list of ``(path, label)`` samples: :class:`FileList`, from a list file or from rows."""

import csv
import os

import numpy as np

from .. import _validate as _v
from ..errors import ConfigError
from .folder import FileSource

__all__ = ["FileList", "LIST_EXTENSIONS"]

#: File names a path given to a loader may end with to be read as a :class:`FileList`.
LIST_EXTENSIONS = (".txt", ".csv", ".lst", ".tsv")


def _check_label_range(value, where):
    if not -2**63 <= value < 2**63:
        raise ConfigError(f"{where}: label {value} does not fit in int64")
    return value


def _parse_label(text, where):
    """An int, or a finite float, from one label field."""
    text = text.strip()
    try:
        value = int(text, 10)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"{where}: label {text!r} is not an integer (or a number)") from None
        if not np.isfinite(value):
            raise ConfigError(f"{where}: label {text!r} is not finite")
        return value
    return _check_label_range(value, where)


def _as_label(value, where):
    """The tuple of numbers of a row's label: a number, a decimal string, or a sequence."""
    items = [value]
    if not isinstance(value, (str, int, float, np.integer, np.floating)) \
            or isinstance(value, (bool, np.bool_)):
        try:
            items = list(value)
        except TypeError:
            raise ConfigError(f"{where}: label {value!r} is not a number") from None
        if not items:
            raise ConfigError(f"{where}: empty label list")
    out = []
    for v in items:
        if isinstance(v, str):
            out.append(_parse_label(v, where))
        elif isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
            out.append(_check_label_range(int(v), where))
        elif isinstance(v, (float, np.floating)) and np.isfinite(v):
            out.append(float(v))
        else:
            raise ConfigError(f"{where}: label {v!r} is not a finite number")
    return tuple(out)


def _label_array(rows, wheres):
    """Read-only labels: int64 if all are integers, else float32; (N,) or (N, K)."""
    for lab, where in zip(rows, wheres):
        if len(lab) != len(rows[0]):
            raise ConfigError(f"{where}: {len(lab)} labels where the first sample has "
                              f"{len(rows[0])}; every sample needs the same number")
    ints = all(isinstance(v, int) for lab in rows for v in lab)
    arr = np.array(rows, dtype=np.int64 if ints else np.float32)
    if arr.shape[1] == 1:
        arr = arr[:, 0]
    arr.flags.writeable = False
    return arr


def _parse_line(text, where, columns=None):
    """A sample of a list file's line (CSV given a header's ``columns``)."""
    csv_line = columns is not None or "," in text
    fields = next(csv.reader([text])) if csv_line else text.rsplit(None, 1)
    if columns is None:
        if len(fields) < 2:
            raise ConfigError(f"{where}: expected 'path label' or 'path,label', got {text!r}")
        labels, meta = range(1, len(fields)), ()
    else:
        count, labels, meta = columns
        if len(fields) != count:
            raise ConfigError(f"{where}: {len(fields)} fields where the header has {count}")
    path = fields[0].strip()
    if not path:
        raise ConfigError(f"{where}: empty path")
    return (path, tuple(_parse_label(fields[k], where) for k in labels), where,
            tuple(fields[k].strip() for k in meta))


class FileList(FileSource):
    """Samples listed as ``(path, label)`` pairs, from a list file or from rows.

    Parameters
    ----------
    path_or_rows : str or iterable
        A UTF-8 list file, one sample per line as ``path,label`` (a line with a comma is CSV:
        quote a path holding one) or ``path label`` (the label is the last field: paths may
        hold spaces); blank lines, ``#`` comments and a ``path,label`` style header are
        skipped. Or an iterable of ``(path, label)`` rows (``(path, label, meta...)`` with
        ``meta_columns``).
    root : str, optional
        What relative paths are resolved against (default: the list file's directory, or
        the working directory for rows).
    meta_columns : list of str, optional
        CSV columns that are per-sample metadata (their stripped text, in :meth:`metadata`)
        rather than labels; the list then starts with a header naming every column (the
        first is the path, every one not in ``meta_columns`` a label).

    One integer label per sample gives ``labels`` int64 of shape (N,); a float label makes
    it float32, several label columns (or rows with a sequence) shape (N, K), the same K for
    every sample. Files are not checked here; a missing one raises :class:`DecodeError` when
    read. Raises :class:`ConfigError` naming the line for a malformed line or a label that is
    not a finite number, and when the list is empty.
    """

    kind = "file_list"

    def __init__(self, path_or_rows, root=None, *, meta_columns=None):
        self.meta_columns = _v.names(meta_columns, "meta_columns", reserved=("path", "index"))
        if isinstance(path_or_rows, (str, bytes, os.PathLike)):
            self._list_path = os.path.abspath(os.fsdecode(path_or_rows))
            rows = _read_list(self._list_path, self.meta_columns)
            base = os.path.dirname(self._list_path)
        else:
            self._list_path = None
            rows = _read_rows(path_or_rows, self.meta_columns)
            base = os.getcwd()
        if not rows:
            where = self._list_path or "the given rows"
            raise ConfigError(f"FileList is empty: no samples in {where}")
        # Listed absolute paths stay absolute: os.path.join(root, abs) == abs.
        self._root = os.path.abspath(os.fspath(root)) if root is not None else base
        relpaths, labels, wheres, meta = zip(*rows)
        self._relpaths = list(relpaths)
        self._labels = _label_array(labels, wheres)
        self._meta = list(meta)

    def metadata(self, i):
        """``{"path": relative path as listed, <each meta column>: its text}``."""
        return {"path": self.relpath(i), **dict(zip(self.meta_columns, self._meta[i]))}

    def _spec(self):
        rows = self._list_path or [[p, lab, *m] for p, lab, m in
                                   zip(self._relpaths, self._labels.tolist(), self._meta)]
        extra = {"meta_columns": list(self.meta_columns)} if self.meta_columns else {}
        return {"path_or_rows": rows, "root": self._root, **extra}


def _read_list(list_path, meta_columns):
    """The samples of a list file: ``(path, labels, where, meta texts)`` each."""
    try:
        with open(list_path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read file list: {e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"file list {list_path} is not UTF-8 text: {e}") from e
    rows, columns = [], None
    for lineno, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{list_path}, line {lineno}"
        if meta_columns and columns is None:
            columns = _header_columns(text, meta_columns, where)
        elif meta_columns or rows or not _is_header(text):
            rows.append(_parse_line(text, where, columns))
    return rows


def _read_rows(rows, meta_columns):
    """The samples of ``FileList(rows)``, as ``_read_list`` gives them."""
    shape = "a (path, label) pair" if not meta_columns else \
        "(path, label" + "".join(f", {c}" for c in meta_columns) + ")"
    out = []
    for n, row in enumerate(rows):
        where = f"FileList row {n}"
        try:
            path, label, *meta = row
            path = os.fsdecode(path)
            if len(meta) != len(meta_columns):
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {shape}, got {row!r}") from None
        for v in meta:
            if not isinstance(v, str):
                raise ConfigError(f"{where}: metadata {v!r} is not a string")
        out.append((path, _as_label(label, where), where, tuple(meta)))
    return out


def _header_columns(text, meta_columns, where):
    """``(column count, label positions, meta positions)`` of a ``path,...`` header line: the
    columns named in ``meta_columns`` are metadata (in that order), every other one after the
    path a label."""
    names = [f.strip() for f in next(csv.reader([text]))]
    missing = [c for c in meta_columns if c not in names[1:]]
    if missing:
        raise ConfigError(f"{where}: meta_columns {missing} are not in the header {names} "
                          f"(a list with meta_columns starts with a 'path,label,...' header)")
    meta = [names.index(c, 1) for c in meta_columns]
    labels = [k for k in range(1, len(names)) if k not in meta]
    if not labels:
        raise ConfigError(f"{where}: no label column left in the header {names}")
    return len(names), labels, meta


def _is_header(text):
    """A first line like ``path,label`` or ``filename label``: its label field is a word."""
    fields = next(csv.reader([text])) if "," in text else text.rsplit(None, 1)
    if len(fields) < 2:
        return False
    if len(fields) > 2:   # several label columns: all named
        return not any(_is_number(f) for f in fields[1:])
    label = fields[1].strip().lower()
    return label in ("label", "labels", "class", "class_id", "target", "y")


def _is_number(text):
    try:
        float(text)
    except ValueError:
        return False
    return True
