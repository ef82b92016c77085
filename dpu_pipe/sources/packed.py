"""Samples of a packed dataset (:mod:`dpu_pipe.packed`): :class:`PackedSource`."""

from ..errors import DecodeError
from ..packed.reader import PackedDataset
from .base import Source

__all__ = ["PackedSource"]


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
