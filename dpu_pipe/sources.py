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
    Labels, from the in-memory index (no I/O). ``labels`` is read-only.
``src.classes -> list[str] | None``
    Class names (label ``k`` is ``classes[k]``) when the source has them.
``src.relpath(i) -> str``
    Sample ``i``'s path relative to the dataset root (what a packed dataset stores).
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
           "as_source", "JPEG_EXTENSIONS", "LIST_EXTENSIONS"]

JPEG_EXTENSIONS = (".jpg", ".jpeg")
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
        """Label of sample ``i`` as a Python int."""
        self._check_index(i)
        return int(self._labels[i])

    def read(self, i):  # pragma: no cover - every subclass overrides it
        """Encoded bytes of sample ``i``; :class:`DecodeError` if they cannot be read."""
        raise NotImplementedError

    def relpath(self, i):  # pragma: no cover - every subclass overrides it
        """Sample ``i``'s path relative to the dataset root."""
        raise NotImplementedError

    def describe(self, i):
        """Where sample ``i`` lives, for error messages."""
        return self.relpath(i)

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
    """JPEG files in class sub-folders: ``root/<class>/**/<file>.jpg``.

    Classes are the sub-directories of ``root`` in sorted (code point) order and get labels
    ``0 .. C-1``, as torchvision's ``ImageFolder`` numbers them; a class folder without images
    keeps its label so numbering does not depend on which folders happen to be empty. Files
    with a ``.jpg``/``.jpeg`` extension in any letter case are taken from each class folder and
    its sub-folders (symlinks followed); other files, files directly in ``root`` and hidden
    entries (names starting with ``.``, e.g. ``.ipynb_checkpoints``) are ignored. Samples are
    ordered by class, then by directory, then by file name, so every node that lists the same
    tree gets the same indices.

    Raises :class:`ConfigError` when ``root`` is not a directory or holds no JPEG file.
    """

    kind = "image_folder"

    def __init__(self, root):
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

        relpaths, labels = [], []
        for label, cls in enumerate(classes):
            found = []
            for dirpath, dirnames, filenames in os.walk(os.path.join(root, cls),
                                                        onerror=walk_error, followlinks=True):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
                for name in filenames:
                    if not name.startswith(".") and name.lower().endswith(JPEG_EXTENSIONS):
                        found.append((rel, name))
            found.sort()  # os.walk's order depends on the file system; this does not
            relpaths.extend(f"{d}/{n}" for d, n in found)
            labels.extend([label] * len(found))
        if not relpaths:
            what = (f"class folders {classes[:5]}{'...' if len(classes) > 5 else ''}"
                    if classes else "no class sub-folders")
            raise ConfigError(f"no .jpg/.jpeg files found under ImageFolder root {root} "
                              f"({what}); expected root/<class>/<image>.jpg")
        self._root = root
        self._relpaths = relpaths
        self._labels = _frozen(labels)
        self.classes = classes

    @property
    def root(self):
        return self._root

    def _spec(self):
        return {"root": self._root}


def _check_label_range(value, where):
    if not -2**63 <= value < 2**63:
        raise ConfigError(f"{where}: label {value} does not fit in int64")
    return value


def _parse_label(text, where):
    try:
        value = int(text.strip(), 10)
    except ValueError:
        raise ConfigError(f"{where}: label {text.strip()!r} is not an integer") from None
    return _check_label_range(value, where)


def _as_label(value, where):
    """An int label from an int, a numpy integer or a decimal string."""
    if isinstance(value, str):
        return _parse_label(value, where)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return _check_label_range(int(value), where)
    raise ConfigError(f"{where}: label {value!r} is not an integer")


def _parse_line(line, where):
    """``path,label`` (CSV quoting allowed) or ``path label`` (the path may contain
    spaces: the label is the last field)."""
    if "," in line:
        fields = next(csv.reader([line]))
        if len(fields) != 2:
            raise ConfigError(f"{where}: expected 'path,label', got {len(fields)} "
                              f"comma-separated fields: {line!r}")
        path, label = fields
    else:
        fields = line.rsplit(None, 1)
        if len(fields) != 2:
            raise ConfigError(f"{where}: expected 'path label' or 'path,label', got {line!r}")
        path, label = fields
    path = path.strip()
    if not path:
        raise ConfigError(f"{where}: empty path")
    return path, _parse_label(label, where)


class FileList(_FileSource):
    """Samples listed as ``(path, label)`` pairs, from a list file or from rows.

    ``path_or_rows`` is either the path of a UTF-8 text file, one sample per line as
    ``path,label`` (a line with a comma is read as CSV, so quote a path that contains one) or
    ``path label`` (whitespace; the label is the last field, so paths may contain spaces), or
    an iterable of ``(path, label)`` pairs. Blank lines and
    lines starting with ``#`` are skipped, as is a first line ``path,label`` style header
    whose label field is not a number but a word like ``label``. Relative paths are resolved
    against ``root``, by default the list file's directory (or the working directory, for
    rows). Order and labels are kept as listed. Files are not checked at construction; a
    missing one raises :class:`DecodeError` when read.

    Raises :class:`ConfigError` naming the line for a malformed line or a non-integer label,
    and when the list is empty.
    """

    kind = "file_list"

    def __init__(self, path_or_rows, root=None):
        if isinstance(path_or_rows, (str, bytes, os.PathLike)):
            list_path = os.path.abspath(os.fsdecode(path_or_rows))
            rows = self._read_list(list_path)
            base = os.path.dirname(list_path)
            self._list_path = list_path
        else:
            rows = []
            for n, row in enumerate(path_or_rows):
                try:
                    path, label = row
                    path = os.fsdecode(path)
                except (TypeError, ValueError):
                    raise ConfigError(f"FileList row {n}: expected a (path, label) pair, "
                                      f"got {row!r}") from None
                rows.append((path, _as_label(label, f"FileList row {n}")))
            base = os.getcwd()
            self._list_path = None
        if not rows:
            where = self._list_path or "the given rows"
            raise ConfigError(f"FileList is empty: no samples in {where}")
        # Listed absolute paths stay absolute: os.path.join(root, abs) == abs.
        self._root = os.path.abspath(os.fspath(root)) if root is not None else base
        self._relpaths = [p for p, _ in rows]
        self._labels = _frozen([lab for _, lab in rows])

    @staticmethod
    def _read_list(list_path):
        try:
            with open(list_path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise ConfigError(f"cannot read file list: {e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"file list {list_path} is not UTF-8 text: {e}") from e
        rows = []
        for lineno, line in enumerate(lines, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            where = f"{list_path}, line {lineno}"
            if not rows and _is_header(text):
                continue
            rows.append(_parse_line(text, where))
        return rows

    @property
    def root(self):
        return self._root

    def _spec(self):
        if self._list_path is not None:
            return {"path": self._list_path, "root": self._root}
        return {"rows": [[p, int(lab)] for p, lab in zip(self._relpaths, self._labels.tolist())],
                "root": self._root}


def _is_header(text):
    """A first line like ``path,label`` or ``filename label``: its label field is a word."""
    fields = next(csv.reader([text])) if "," in text else text.rsplit(None, 1)
    if len(fields) != 2:
        return False
    label = fields[1].strip().lower()
    return label in ("label", "labels", "class", "class_id", "target", "y")


class PackedSource(Source):
    """Samples from a packed dataset (see :mod:`dpu_pipe.packed`): its directory or manifest.

    Opening reads the manifest's header, shard table and metadata and maps its labels; a
    shard is mapped, and an index block of it checked, when one of its records is first read,
    so memory grows with what a rank reads, not with the dataset (at most
    ``max_open_shards`` shards mapped at once). ``read(i)`` copies record ``i`` into
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

    def __init__(self, path, *, verify_reads=False, max_open_shards=64):
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
                      max_open_shards=state.get("max_open_shards", 64))


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
            src = ImageFolder(spec["root"])
        elif kind == "file_list":
            rows = spec.get("rows")
            src = FileList(spec["path"] if rows is None else rows, root=spec.get("root"))
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
    if is_packed(path):
        if root is not None:
            raise ConfigError("root= applies to file lists, not to a packed dataset")
        return PackedSource(path)
    if os.path.isdir(path):
        if root is not None:
            raise ConfigError("root= applies to file lists, not to an ImageFolder directory")
        return ImageFolder(path)
    if not os.path.exists(path):
        raise ConfigError(f"dataset path does not exist: {path}")
    return FileList(path, root=root)


def as_source(obj):
    """A source from what a loader was given: a source object is returned as it is; a path
    is opened as a dataset — a directory as an :class:`ImageFolder`, a packed file (found by
    its header, whatever its name) as a :class:`PackedSource`, a ``.txt``/``.csv``/``.lst``/
    ``.tsv`` file as a :class:`FileList`. Anything else raises :class:`ConfigError`."""
    if isinstance(obj, (str, bytes, os.PathLike)):
        path = os.fsdecode(obj)
        if os.path.isdir(path):
            return ImageFolder(path)
        if not os.path.exists(path):
            raise ConfigError(f"dataset path does not exist: {path}")
        if is_packed_file(path):
            return PackedSource(path)
        if path.lower().endswith(LIST_EXTENSIONS):
            return FileList(path)
        raise ConfigError(f"{path} is not a dataset: expected a directory (ImageFolder), a "
                          f"packed file, or a file list ({', '.join(LIST_EXTENSIONS)})")
    if all(hasattr(obj, a) for a in ("read", "labels", "describe", "__len__")):
        return obj
    raise ConfigError(f"source must be a dpu_pipe source (ImageFolder, FileList, PackedSource) "
                      f"or a dataset path, got {type(obj).__name__}")
