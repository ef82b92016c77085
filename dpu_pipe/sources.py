"""Data sources: where the encoded samples of a dataset come from.

The source interface
--------------------
A source is an indexed collection of encoded JPEG samples with integer labels. Every source
provides:

``len(src)``
    Number of samples ``N``. Sample indices are ``0 .. N-1``; anything else raises
    ``IndexError``.
``src.read(i) -> bytes``
    The encoded bytes of sample ``i``, read on demand (a file is opened and read, a packed
    file's mapping is sliced); nothing is loaded up front. If the bytes cannot be read
    (missing file, permission, I/O error) it raises :class:`dpu_pipe.DecodeError`
    ``("cannot read: ...", index=i, path=...)``, so a loader's ``on_error`` policy treats an
    unreadable sample exactly like an undecodable one.
``src.label(i) -> int`` and ``src.labels -> np.ndarray[int64]`` of shape ``(N,)``
    Labels, from the in-memory index (no I/O). ``labels`` is read-only. A :class:`FileList`
    may also hold float labels (float32) or several per sample (shape ``(N, K)``).
``src.classes -> list[str] | None``
    Class names (label ``k`` is ``classes[k]``) when the source has them.
``src.relpath(i) -> str``
    Sample ``i``'s path relative to the dataset root (what a packed dataset stores).
``src.metadata(i) -> dict`` (optional)
    Per-sample metadata from the in-memory index, the same keys for every sample: here
    ``{"path": relpath(i)}``, plus a :class:`FileList`'s ``meta_columns``. A loader built
    with ``return_meta=True`` yields them, looked up by the dataset index of each row; a
    source without the method gives only the indices.
``src.describe(i) -> str``
    Where sample ``i`` lives, for error messages: a file path, or
    ``"packed dataset X, shard k, record i (relpath)"``.
``src.spec() -> dict``
    A JSON-serialisable description from which :func:`open_source` reopens an equivalent
    source in another process, e.g. a DPU rank reading the same dataset from a shared file
    system. Paths in it are absolute, so the dataset must be mounted at the same path. The
    spec carries the sample count and a fingerprint of the index (paths and labels), and
    :func:`open_source` refuses a dataset that differs, because a different listing on one
    node would silently break determinism and exactly-once delivery.

Sources are picklable (a packed source reopens its mapping on unpickling) and safe to read
from several threads at once.
"""

import csv
import hashlib
import os
import stat

import numpy as np

from .errors import ConfigError, DecodeError
from .packed.reader import PackedDataset, is_packed

__all__ = ["Source", "ImageFolder", "FileList", "PackedSource", "open_source", "open_path",
           "as_source", "JPEG_EXTENSIONS", "IMG_EXTENSIONS", "LIST_EXTENSIONS"]

JPEG_EXTENSIONS = (".jpg", ".jpeg")
#: The file extensions ImageFolder takes: torchvision's ``IMG_EXTENSIONS``. JPEGs take the fast
#: path; other formats (and non-JPEG data behind any name) are decoded by OpenCV.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
#: File names a path given to a loader may end with to be read as a :class:`FileList`.
LIST_EXTENSIONS = (".txt", ".csv", ".lst", ".tsv")


def _fingerprint(relpaths, labels):
    """Short hex digest of an index (paths and labels, in order)."""
    h = hashlib.sha256()
    for p, lab in zip(relpaths, labels.tolist()):
        h.update(f"{p}\0{lab}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:16]


def _frozen(labels):
    arr = np.asarray(labels, dtype=np.int64)
    arr.flags.writeable = False
    return arr


class Source:
    """Base class of the sources in this module: index checks, ``label``, ``describe``
    and the spec round trip. Subclasses set ``_labels`` (int64 array), ``classes`` and
    implement ``read``, ``relpath`` and ``_spec``."""

    kind = None
    classes = None

    def __len__(self):
        return len(self._labels)

    def _check_index(self, i):
        n = len(self._labels)
        if not 0 <= i < n:
            raise IndexError(f"sample index {i} out of range for a source of {n} samples")

    @property
    def labels(self):
        """Labels of all samples: read-only ``int64`` array of shape ``(len(self),)``."""
        return self._labels

    def label(self, i):
        """Label of sample ``i``: a Python int (a float, or a list for several labels)."""
        self._check_index(i)
        return self._labels[i].tolist()

    def read(self, i):  # pragma: no cover - every subclass overrides it
        """Encoded bytes of sample ``i``; :class:`DecodeError` if they cannot be read."""
        raise NotImplementedError

    def relpath(self, i):  # pragma: no cover - every subclass overrides it
        """Sample ``i``'s path relative to the dataset root."""
        raise NotImplementedError

    def describe(self, i):
        """Where sample ``i`` lives, for error messages."""
        return self.relpath(i)

    def metadata(self, i):
        """Sample ``i``'s metadata: ``{"path": relative path}`` (no I/O for file sources; a
        packed source reads the path from its shard's index, mapped once per shard)."""
        return {"path": self.relpath(i)}

    def _all_relpaths(self):
        return (self.relpath(i) for i in range(len(self)))

    def fingerprint(self):
        """Hex digest of this source's relative paths and labels, in order."""
        if getattr(self, "_fp", None) is None:
            self._fp = _fingerprint(self._all_relpaths(), self._labels)
        return self._fp

    def spec(self):
        """JSON-serialisable description that :func:`open_source` reopens."""
        return {"kind": self.kind, **self._spec(), "count": len(self),
                "fingerprint": self.fingerprint()}

    def __repr__(self):
        return f"{type(self).__name__}({self._spec()!r}, count={len(self)})"


class _FileSource(Source):
    """A source whose samples are individual files: ``_root`` plus relative paths."""

    def _path(self, i):
        self._check_index(i)
        return os.path.join(self._root, self._relpaths[i])

    def relpath(self, i):
        self._check_index(i)
        return self._relpaths[i]

    def _all_relpaths(self):
        return self._relpaths

    def describe(self, i):
        return self._path(i)

    def read(self, i):
        path = self._path(i)
        if "\0" in path:  # the OS cannot name it: open() would raise ValueError
            raise DecodeError("cannot read: the path contains a NUL byte", index=i, path=path)
        try:
            # Non-blocking open: a FIFO listed as a sample would otherwise block until a
            # writer appears. Only regular files are samples: a device such as /dev/zero
            # never ends, and a FIFO's contents are whatever some writer sends.
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            try:
                regular = stat.S_ISREG(os.fstat(fd).st_mode)
                f = open(fd, "rb") if regular else None
            finally:
                if not regular:
                    os.close(fd)
            if f is None:
                raise DecodeError("cannot read: not a regular file", index=i, path=path)
            with f:
                return f.read()
        except OSError as e:
            raise DecodeError(f"cannot read: {e}", index=i, path=path) from e


class ImageFolder(_FileSource):
    """Image files in class sub-folders: ``root/<class>/**/<file>.jpg`` (or .png, ...).

    Classes are the sub-directories of ``root`` in sorted (code point) order and get labels
    ``0 .. C-1``, as torchvision's ``ImageFolder`` numbers them. Files with an extension of
    :data:`IMG_EXTENSIONS` (torchvision's) in any letter case are taken from each class folder
    and its sub-folders (symlinks followed); other files, files directly in ``root`` and hidden
    entries (names starting with ``.``, e.g. ``.ipynb_checkpoints``) are ignored. Samples are
    ordered by class, then by directory, then by file name, so every node that lists the same
    tree gets the same indices.

    Like torchvision, a class folder without a usable file raises :class:`ConfigError` naming
    it; with ``allow_empty=True`` it keeps its label (numbering does not depend on which
    folders happen to be empty). Also raises :class:`ConfigError` when ``root`` is not a
    directory or holds no image at all.
    """

    kind = "image_folder"

    def __init__(self, root, *, allow_empty=False):
        from ._validate import boolean
        self._allow_empty = boolean(allow_empty, "allow_empty")
        root = os.path.abspath(os.fspath(root))
        if not os.path.isdir(root):
            raise ConfigError(f"ImageFolder root is not a directory: {root}")
        try:
            classes = sorted(e.name for e in os.scandir(root)
                             if e.is_dir() and not e.name.startswith("."))
        except OSError as e:
            raise ConfigError(f"cannot list ImageFolder root: {e}") from e
        def walk_error(err):
            # A sub-folder skipped on one node but not on another would give the nodes
            # different listings, so an unreadable one stops the scan.
            raise ConfigError(f"cannot list ImageFolder sub-folder: {err}") from err

        relpaths, labels, empty = [], [], []
        for label, cls in enumerate(classes):
            found = []
            for dirpath, dirnames, filenames in os.walk(os.path.join(root, cls),
                                                        onerror=walk_error, followlinks=True):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
                for name in filenames:
                    if not name.startswith(".") and name.lower().endswith(IMG_EXTENSIONS):
                        found.append((rel, name))
            found.sort()  # os.walk's order depends on the file system; this does not
            relpaths.extend(f"{d}/{n}" for d, n in found)
            labels.extend([label] * len(found))
            if not found:
                empty.append(cls)
        if not relpaths:
            what = (f"class folders {classes[:5]}{'...' if len(classes) > 5 else ''}"
                    if classes else "no class sub-folders")
            raise ConfigError(f"no image files found under ImageFolder root {root} ({what}); "
                              f"expected root/<class>/<image>.jpg, with extensions "
                              f"{', '.join(IMG_EXTENSIONS)}")
        if empty and not self._allow_empty:
            raise ConfigError(f"Found no valid file for the classes {', '.join(empty)} under "
                              f"{root}. Supported extensions are: {', '.join(IMG_EXTENSIONS)} "
                              f"(allow_empty=True keeps empty classes)")
        self._root = root
        self._relpaths = relpaths
        self._labels = _frozen(labels)
        self.classes = classes

    @property
    def root(self):
        return self._root

    def _spec(self):
        return {"root": self._root, "allow_empty": self._allow_empty}


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
        pass
    else:
        return _check_label_range(value, where)
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{where}: label {text!r} is not an integer (or a number)") from None
    if not np.isfinite(value):
        raise ConfigError(f"{where}: label {text!r} is not finite")
    return value


def _as_label(value, where):
    """A label from an int, a float, a numpy number, a decimal string, or a sequence of those
    (several labels per sample); returned as a tuple of numbers."""
    if isinstance(value, (str, int, float, np.integer, np.floating)) \
            and not isinstance(value, (bool, np.bool_)):
        items = [value]
    else:
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
    """The labels array of a list: int64 when every label is an integer, else float32;
    shape (N,) with one label per sample, (N, K) with K. ``wheres[i]`` names row i."""
    for lab, where in zip(rows, wheres):
        if len(lab) != len(rows[0]):
            raise ConfigError(f"{where}: {len(lab)} labels where the first sample has "
                              f"{len(rows[0])}; every sample needs the same number")
    if all(isinstance(v, int) for lab in rows for v in lab):
        arr = np.array(rows, dtype=np.int64)
    else:
        arr = np.array(rows, dtype=np.float32)
    if arr.shape[1] == 1:
        arr = arr[:, 0]
    arr.flags.writeable = False
    return arr


def _parse_line(line, where):
    """``path,label[,label...]`` (CSV quoting allowed) or ``path label`` (the path may
    contain spaces: the label is the last field)."""
    if "," in line:
        fields = next(csv.reader([line]))
        if len(fields) < 2:
            raise ConfigError(f"{where}: expected 'path,label', got {line!r}")
        path, labels = fields[0], fields[1:]
    else:
        fields = line.rsplit(None, 1)
        if len(fields) != 2:
            raise ConfigError(f"{where}: expected 'path label' or 'path,label', got {line!r}")
        path, labels = fields[0], fields[1:]
    path = path.strip()
    if not path:
        raise ConfigError(f"{where}: empty path")
    return path, tuple(_parse_label(v, where) for v in labels)


class FileList(_FileSource):
    """Samples listed as ``(path, label)`` pairs, from a list file or from rows.

    ``path_or_rows`` is either the path of a UTF-8 text file, one sample per line as
    ``path,label`` (a line with a comma is read as CSV, so quote a path that contains one) or
    ``path label`` (whitespace; the label is the last field, so paths may contain spaces), or
    an iterable of ``(path, label)`` pairs. Blank lines and
    lines starting with ``#`` are skipped, as is a first line ``path,label`` style header
    whose label field is not a number but a word like ``label``.

    Labels: one integer per sample gives ``labels`` int64 of shape (N,), as for the other
    sources. A label that is a float (``path,0.75``) makes the array float32; several label
    columns (``path,1,0,1`` — CSV only — or rows with a sequence of numbers) give shape
    (N, K), for multi-label or regression targets; every sample must have the same K. Both
    loaders yield labels of the same dtype and shape (packed files hold one integer per
    sample).

    Metadata: ``meta_columns=["caption", ...]`` names CSV columns that are per-sample
    metadata rather than labels. The list must then start with a header naming every column
    (``path,label,caption``; the first column is the path, whatever its name, and every
    column not in ``meta_columns`` is a label); each line has as many fields as the header.
    Their text (stripped) is in :meth:`metadata` beside the ``"path"``. Rows take them after
    the label: ``(path, label, caption, ...)``. Relative paths are resolved
    against ``root``, by default the list file's directory (or the working directory, for
    rows). Order and labels are kept as listed. Files are not checked at construction; a
    missing one raises :class:`DecodeError` when read.

    Raises :class:`ConfigError` naming the line for a malformed line or a label that is not a
    finite number, and when the list is empty.
    """

    kind = "file_list"

    def __init__(self, path_or_rows, root=None, *, meta_columns=None):
        from ._validate import names
        meta_columns = names(meta_columns, "meta_columns", reserved=("path", "index"))
        self.meta_columns = meta_columns
        if isinstance(path_or_rows, (str, bytes, os.PathLike)):
            list_path = os.path.abspath(os.fsdecode(path_or_rows))
            rows = self._read_list(list_path, meta_columns)
            base = os.path.dirname(list_path)
            self._list_path = list_path
        else:
            rows = []
            shape = "a (path, label) pair" if not meta_columns else \
                "(path, label" + "".join(f", {c}" for c in meta_columns) + ")"
            for n, row in enumerate(path_or_rows):
                try:
                    path, label, *meta = row
                    path = os.fsdecode(path)
                    if len(meta) != len(meta_columns):
                        raise ValueError
                except (TypeError, ValueError):
                    raise ConfigError(f"FileList row {n}: expected {shape}, got {row!r}") \
                        from None
                for v in meta:
                    if not isinstance(v, str):
                        raise ConfigError(f"FileList row {n}: metadata {v!r} is not a string")
                rows.append((path, _as_label(label, f"FileList row {n}"), f"FileList row {n}",
                             tuple(meta)))
            base = os.getcwd()
            self._list_path = None
        if not rows:
            where = self._list_path or "the given rows"
            raise ConfigError(f"FileList is empty: no samples in {where}")
        # Listed absolute paths stay absolute: os.path.join(root, abs) == abs.
        self._root = os.path.abspath(os.fspath(root)) if root is not None else base
        self._relpaths = [r[0] for r in rows]
        self._labels = _label_array([r[1] for r in rows], [r[2] for r in rows])
        self._meta = [r[3] for r in rows]

    def metadata(self, i):
        """``{"path": relative path as listed, <each meta column>: its text}``."""
        meta = {"path": self.relpath(i)}
        meta.update(zip(self.meta_columns, self._meta[i]))
        return meta

    @staticmethod
    def _read_list(list_path, meta_columns=()):
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
            if meta_columns:
                if columns is None:
                    columns = _header_columns(text, meta_columns, where)
                    continue
                rows.append(_parse_row(text, columns, where))
                continue
            if not rows and _is_header(text):
                continue
            rows.append(_parse_line(text, where) + (where, ()))
        return rows

    @property
    def root(self):
        return self._root

    def _spec(self):
        extra = {"meta_columns": list(self.meta_columns)} if self.meta_columns else {}
        if self._list_path is not None:
            return {"path": self._list_path, "root": self._root, **extra}
        return {"rows": [[p, lab, *m] for p, lab, m in zip(self._relpaths,
                                                           self._labels.tolist(), self._meta)],
                "root": self._root, **extra}


def _header_columns(text, meta_columns, where):
    """Positions ``(labels, meta)`` of the columns of a ``path,...`` header line: those named
    in ``meta_columns`` are metadata (in that order), every other one after the path a label."""
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


def _parse_row(text, columns, where):
    """One CSV line of a list with a header: ``(path, labels, where, meta texts)``."""
    count, labels, meta = columns
    fields = next(csv.reader([text]))
    if len(fields) != count:
        raise ConfigError(f"{where}: {len(fields)} fields where the header has {count}")
    path = fields[0].strip()
    if not path:
        raise ConfigError(f"{where}: empty path")
    return (path, tuple(_parse_label(fields[k], where) for k in labels), where,
            tuple(fields[k].strip() for k in meta))


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


class PackedSource(Source):
    """Samples from a packed dataset (see :mod:`dpu_pipe.packed`): its directory or manifest.

    Opening reads the manifest's header, shard table and metadata and maps its labels; a
    shard is mapped, and an index block of it checked, when one of its records is first read,
    so memory grows with what a rank reads, not with the dataset (at most
    ``max_open_shards`` shards mapped at once, by default a quarter of the file-descriptor
    limit up to 1024). ``read(i)`` copies record ``i`` into
    ``bytes``, ``view(i)`` returns it as a zero-copy ``memoryview``, and ``buffers(indices)``
    gives a batch decoder every record of a batch without a Python object per record when
    they share a shard. With ``verify_reads`` each read checks the record's CRC (about a 5 %
    cost on decode time for 100 KB records), worth it on a file system that may return bad
    data.

    Opening raises :class:`ConfigError` for a path that is missing or foreign, a damaged
    manifest, or an unsupported format version (named). A missing, corrupt or foreign shard
    raises :class:`DecodeError` naming the shard and the record when a record of it is read.
    """

    kind = "packed"

    def __init__(self, path, *, verify_reads=False, max_open_shards=None):
        self._ds = PackedDataset(path, verify_reads=verify_reads,
                                 max_open_shards=max_open_shards)
        self._labels = self._ds.labels  # memory-mapped: pages load as they are used
        self.classes = self._ds.classes

    @property
    def path(self):
        """The dataset's directory."""
        return self._ds.path

    @property
    def dataset(self):
        """The underlying :class:`dpu_pipe.packed.PackedDataset`."""
        return self._ds

    def label(self, i):
        self._check_index(i)
        self._ds.entry(i)  # checks the index block, which holds the label too
        return int(self._labels[i])

    def read(self, i):
        self._check_index(i)
        return bytes(self._ds.record(i))

    def view(self, i):
        """Record ``i`` as a read-only ``memoryview`` into its shard's mapping (no copy)."""
        self._check_index(i)
        return self._ds.record(i)

    def buffers(self, indices):
        """``(BufferList, {batch position: DecodeError})`` of the records ``indices``
        (int64 array of shape (n,)); a record of a missing or corrupt shard gets an empty
        buffer and an error naming it."""
        return self._ds.buffers(indices)

    def relpath(self, i):
        self._check_index(i)
        return self._ds.relpath(i)

    def describe(self, i):
        return self._ds.describe(i)

    def verify(self, *, progress=None):
        """Check every shard on its own (header, index, every record's CRC);
        :class:`DecodeError` names the first bad shard and how many are bad."""
        failures = self._ds.check(progress=progress)
        if failures:
            k = min(failures)
            raise DecodeError(f"{len(failures)} of {self._ds.num_shards} shards fail their "
                              f"check; first: {failures[k]}", path=self._ds.shard_path(k))

    def fingerprint(self):
        return self._ds.fingerprint  # a CRC chain over the whole index: no need to hash it

    def close(self):
        self._ds.close()

    def _spec(self):
        return {"path": self._ds.path, "verify_reads": self._ds.verify_reads}

    def __getstate__(self):
        return {"path": self._ds.path, "verify_reads": self._ds.verify_reads,
                "max_open_shards": self._ds.max_open_shards}

    def __setstate__(self, state):
        self.__init__(state["path"], verify_reads=state["verify_reads"],
                      max_open_shards=state.get("max_open_shards"))


_KINDS = {"image_folder", "file_list", "packed"}


def open_source(spec):
    """Reopen the source that ``spec`` (from :meth:`Source.spec`) describes.

    Raises :class:`ConfigError` for an unknown kind, missing fields, or when the dataset
    found differs from the one described (sample count or index fingerprint).
    """
    if not isinstance(spec, dict) or spec.get("kind") not in _KINDS:
        kind = spec.get("kind") if isinstance(spec, dict) else type(spec).__name__
        raise ConfigError(f"not a source spec (kind {kind!r}); expected a dict with kind in "
                          f"{sorted(_KINDS)}")
    kind = spec["kind"]
    try:
        if kind == "image_folder":
            src = ImageFolder(spec["root"], allow_empty=spec.get("allow_empty", False))
        elif kind == "file_list":
            rows = spec.get("rows")
            src = FileList(spec["path"] if rows is None else rows, root=spec.get("root"),
                           meta_columns=spec.get("meta_columns"))
        else:
            src = PackedSource(spec["path"], verify_reads=spec.get("verify_reads", False))
    except KeyError as e:
        raise ConfigError(f"source spec of kind {kind!r} lacks field {e}") from None
    if "count" in spec and spec["count"] != len(src):
        raise ConfigError(f"the {kind} dataset found here has {len(src)} samples, the spec "
                          f"describes {spec['count']}: {spec}")
    if "fingerprint" in spec and spec["fingerprint"] != src.fingerprint():
        raise ConfigError(f"the {kind} dataset found here differs from the one the spec "
                          f"describes (same count, different paths or labels): {spec}")
    return src


def open_path(path, *, root=None):
    """Open a dataset path as a source: a packed dataset (its directory or manifest) is a
    :class:`PackedSource`, any other directory an :class:`ImageFolder`, any other file a
    :class:`FileList` (``root`` applies to file lists only)."""
    path = os.fspath(path)
    if is_packed(path) or os.path.isdir(path):
        if root is not None:
            raise ConfigError(f"root= applies to file lists, not to the dataset directory {path}")
        return PackedSource(path) if is_packed(path) else ImageFolder(path)
    if not os.path.exists(path):
        raise ConfigError(f"dataset path does not exist: {path}")
    return FileList(path, root=root)


def as_source(obj):
    """A source from what a loader was given: a source object is returned as it is; a path
    is opened as a dataset — a packed dataset (its directory or manifest, found by the
    manifest's header whatever the name) as a
    :class:`PackedSource`, any other directory as an :class:`ImageFolder`, a ``.txt``/
    ``.csv``/``.lst``/``.tsv`` file as a :class:`FileList`. Anything else raises
    :class:`ConfigError`."""
    if isinstance(obj, (str, bytes, os.PathLike)):
        path = os.fsdecode(obj)
        if (os.path.isfile(path) and not is_packed(path)
                and not path.lower().endswith(LIST_EXTENSIONS)):
            raise ConfigError(f"{path} is not a dataset: expected a directory (ImageFolder), "
                              f"a packed dataset, or a file list ({', '.join(LIST_EXTENSIONS)})")
        return open_path(path)
    if all(hasattr(obj, a) for a in ("read", "labels", "describe", "__len__")):
        return obj
    raise ConfigError(f"source must be a dpu_pipe source (ImageFolder, FileList, PackedSource) "
                      f"or a dataset path, got {type(obj).__name__}")
