"""The source protocol: what a loader needs from a dataset, and the base class of the built-in
sources (a guide with an example: docs/guides/datasets.md, "Your own source").

A source is an indexed collection of encoded images (JPEG; PNG, WebP and the other formats
OpenCV reads) with labels:

``len(src)``
    Number of samples ``N``; indices are ``0 .. N-1``, anything else raises ``IndexError``.
``src.read(i) -> bytes``
    The encoded bytes of sample ``i``, read on demand; :class:`dpu_pipe.DecodeError`
    ``("cannot read: ...", index=i, path=...)`` when they cannot be read, so a loader's
    ``on_error`` policy treats an unreadable sample like an undecodable one.
``src.buffers(indices) -> (BufferList, {batch position: DecodeError})`` (optional)
    A whole batch (``indices`` int64 of shape ``(n,)``) without a Python object per record.
``src.labels``, ``src.label(i)``, ``src.classes``
    Read-only labels of shape ``(N,)`` (int64; a :class:`~dpu_pipe.sources.FileList` may
    hold float32, or shape ``(N, K)``), from memory; class names (label ``k`` is
    ``classes[k]``) or None.
``src.describe(i)``, ``src.metadata(i)``, ``src.relpath(i)`` (optional)
    Where sample ``i`` lives, for messages; its metadata dict (the same keys for every
    sample); a name unique within the dataset (what a packed dataset stores).
``src.fingerprint()``
    A digest of the names and labels, in order: equal on two nodes only for the same data.
``src.spec()``
    ``{"factory": "module:callable", "args": {...}, "count": N, "fingerprint": ...}``, from
    which :func:`~dpu_pipe.sources.open_source` rebuilds the source in a producer process
    (absolute paths: the data is mounted at the same path) and refuses it if its count or
    fingerprint differs, which would silently break determinism and exactly-once delivery.

A user's source subclasses :class:`Source`. Sources are picklable and safe to read from
several threads at once.
"""

import hashlib

import numpy as np

from .. import _jpeg
from ..errors import DecodeError

__all__ = ["Source", "buffers_by_record", "fingerprint_of", "frozen_labels"]


def buffers_by_record(indices, view):
    """The general path of a source's ``buffers``: a BufferList of ``view(i)`` for each index,
    and ``{position: DecodeError}`` for the records that could not be read (their buffer is
    empty), so that one bad record does not fail the batch."""
    views, errors = [], {}
    for p, i in enumerate(np.asarray(indices).tolist()):
        try:
            views.append(view(i))
        except DecodeError as exc:
            errors[p] = exc
            views.append(b"")
    return _jpeg.BufferList.from_buffers(views), errors


def fingerprint_of(names, labels):
    """Short hex digest of an index: ``names`` (str per sample) and ``labels``, in order."""
    h = hashlib.sha256()
    for p, lab in zip(names, np.asarray(labels).tolist()):
        h.update(f"{p}\0{lab}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:16]


def frozen_labels(labels):
    """Labels as a read-only int64 array."""
    arr = np.asarray(labels, dtype=np.int64)
    arr.flags.writeable = False
    return arr


class Source:
    """Base class of sources: index checks, ``label``, ``describe``, ``metadata``,
    ``fingerprint`` and ``spec``. Subclasses set ``_labels`` (an array of shape ``(N,)``),
    optionally ``classes``, and implement ``read(i)`` and ``_spec()`` (the keyword arguments
    that rebuild them, JSON-serialisable); ``relpath(i)`` names samples (default: the index)."""

    #: A short name of the kind of source, for summaries (None for a user's source).
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
        """Labels of all samples: read-only array of shape ``(len(self),)``."""
        return self._labels

    def label(self, i):
        """Label of sample ``i``: a Python int (a float, or a list for several labels)."""
        self._check_index(i)
        return self._labels[i].tolist()

    def read(self, i):  # pragma: no cover - every subclass overrides it
        """Encoded bytes of sample ``i``; :class:`DecodeError` if they cannot be read."""
        raise NotImplementedError

    def relpath(self, i):
        """A name of sample ``i`` unique in the dataset (default: its index)."""
        self._check_index(i)
        return str(i)

    def describe(self, i):
        """Where sample ``i`` lives, for error messages."""
        return self.relpath(i)

    def metadata(self, i):
        """Sample ``i``'s metadata: ``{"path": relpath(i)}``."""
        return {"path": self.relpath(i)}

    def _all_relpaths(self):
        return (self.relpath(i) for i in range(len(self)))

    def fingerprint(self):
        """Hex digest of this source's sample names and labels, in order."""
        if getattr(self, "_fp", None) is None:
            self._fp = fingerprint_of(self._all_relpaths(), self._labels)
        return self._fp

    def _spec(self):  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def spec(self):
        """``{"factory": "module:Class", "args": ..., "count": N, "fingerprint": ...}``."""
        cls = type(self)
        return {"factory": f"{cls.__module__}:{cls.__qualname__}", "args": self._spec(),
                "count": len(self), "fingerprint": self.fingerprint()}

    def __repr__(self):
        return f"{type(self).__name__}({self._spec()!r}, count={len(self)})"


class _PartedSource(Source):
    """A source whose samples are concatenated parts (shards, row groups): part ``k`` holds
    samples ``_starts[k]`` to ``_starts[k + 1] - 1``. Pickled as its spec."""

    def _locate(self, i):
        """``(part, position in the part)`` of sample ``i``."""
        self._check_index(i)
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        return k, i - int(self._starts[k])

    def _one_part(self, indices):
        """``indices`` as int64, and the part holding all of them (None: several, or none)."""
        indices = np.asarray(indices, dtype=np.int64)
        if not len(indices):
            return indices, None
        if indices.min() < 0 or indices.max() >= len(self):
            self._check_index(int(indices[(indices < 0) | (indices >= len(self))][0]))
        parts = np.searchsorted(self._starts, indices, side="right") - 1
        return indices, int(parts[0]) if (parts == parts[0]).all() else None

    def __getstate__(self):
        return self._spec()

    def __setstate__(self, state):
        self.__init__(**state)
