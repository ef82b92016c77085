"""Reading packed datasets lazily: a shard is mapped, and an index block of it checked, when
one of its records is first needed, so memory follows what a rank reads, not the dataset
(docs/design/packed-format.md)."""

import collections
import os
import threading
import zlib

import numpy as np

from .. import _jpeg
from .. import _validate as _v
from ..errors import ConfigError, DecodeError
from ..sources.base import buffers_by_record
from . import format as fmt

__all__ = ["PackedShard", "PackedDataset", "is_packed"]


class ClosedError(ConfigError):
    """A read of a :class:`PackedDataset` after its :meth:`~PackedDataset.close` (not a
    damaged shard: never turned into a sample's :class:`DecodeError`)."""


def is_packed(path):
    """True when ``path`` is a packed dataset's directory, manifest (of any version) or
    shard (which opening then refuses by name)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, fmt.MANIFEST_NAME))
    try:
        with open(path, "rb") as f:
            return f.read(len(fmt.MAGIC)) in (fmt.MAGIC, fmt.SHARD_MAGIC)
    except OSError:
        return False


def _default_max_open_shards():
    """A quarter of the soft file-descriptor limit, between 16 and 1024."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            soft = 4096
    except (ImportError, OSError, ValueError):  # no resource module (not POSIX)
        soft = 1024
    return max(16, min(1024, soft // 4))


def _read_head(path, where):
    try:
        with open(path, "rb") as f:
            return f.read(fmt.HEADER_SIZE), os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise ConfigError(f"{where} is missing") from None
    except OSError as e:
        raise ConfigError(f"{where} cannot be read: {e}") from None


class PackedShard:
    """One shard file, memory-mapped read-only.

    ``expect`` is ``(shard number, SHARD_ENTRY)`` from a manifest, which the shard must match
    (``checked``, the :attr:`checked` array of an earlier opening of it, is only trusted
    then); without it the shard is opened on its own (its CRCs still cover every part).
    ``labels`` (``<i8``, the manifest's slice) is compared with each index block as it is
    checked. Errors are :class:`ConfigError` naming the shard and, for an index entry, the
    record.
    """

    def __init__(self, path, *, expect=None, labels=None, checked=None):
        self.path = os.fspath(path)
        self.where = (f"shard {expect[0]} ({self.path})" if expect is not None
                      else f"shard {self.path}")
        raw, size = _read_head(self.path, self.where)
        h = fmt.parse_shard_header(raw, size, self.where)
        if expect is not None:
            k, entry = expect
            want = [k] + [int(entry[n]) for n in ("first", "count", "file_size", "header_crc32")]
            if [h[n] for n in ("shard", "first", "count", "file_size", "header_crc32")] != want:
                raise ConfigError(f"{self.where} does not belong to this dataset: it holds "
                                  f"records {h['first']}..{h['first'] + h['count'] - 1} of shard "
                                  f"{h['shard']} ({h['file_size']} bytes), the manifest expects "
                                  f"records {want[1]}..{want[1] + want[2] - 1} of shard {k} "
                                  f"({want[3]} bytes) with header CRC {want[4]:08x}")
        self.header = h
        #: The whole shard file as a read-only ``uint8`` array (a memory map).
        self.buffer = np.memmap(self.path, dtype=np.uint8, mode="r")
        if len(self.buffer) != h["file_size"]:  # changed between the header read and the map
            raise ConfigError(f"{self.where} changed size while it was opened")
        #: The same bytes as a read-only ``memoryview``.
        self.view = memoryview(self.buffer)
        self._parts = fmt.shard_parts(self.buffer, h, self.where)
        self.records = self._parts[0]
        self._labels = labels
        #: ``bool`` per index block: checked already.
        self.checked = (checked if checked is not None and len(checked) == h["nblocks"]
                        else np.zeros(h["nblocks"], dtype=bool))
        self.first, self.block_records = h["first"], h["block_records"]

    def __len__(self):
        return self.header["count"]

    def check_block(self, k):
        """Check index block ``k`` (CRC, record bounds, paths, labels) once; ConfigError
        naming the record otherwise."""
        if self.checked[k]:
            return
        block = fmt.check_block(self.header, self._parts, k, self.where)
        if self._labels is not None:
            b = self.block_records
            diff = np.flatnonzero(block["label"] != self._labels[k * b:(k + 1) * b])
            if len(diff):
                j = int(diff[0])
                raise ConfigError(f"{self.where}: record {k * b + j} has label "
                                  f"{int(block['label'][j])} in the shard and "
                                  f"{int(self._labels[k * b + j])} in the manifest")
        self.checked[k] = True

    def record(self, j):
        """Record ``j``'s bytes as a read-only memoryview of the mapping (index checked)."""
        self.check_block(j // self.block_records)
        start = int(self.records["offset"][j])
        return self.view[start:start + int(self.records["length"][j])]

    def relpath(self, j):
        """Record ``j``'s relative path (index checked)."""
        self.check_block(j // self.block_records)
        ends = self.records["path_end"]
        lo = int(ends[j - 1]) if j else 0
        return bytes(self._parts[2][lo:int(ends[j])]).decode("utf-8", "surrogateescape")

    def find_corrupt(self):
        """Shard-local numbers (``int64`` array) of the records whose bytes fail their CRC,
        after checking every index block."""
        bad = []
        b = self.block_records
        # Read with pread, not through the mapping: checking a 1 GiB shard then leaves the
        # process's resident memory alone (one record at a time), the page cache aside.
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for k in range(self.header["nblocks"]):
                self.check_block(k)
                block = self.records[k * b:(k + 1) * b]
                for j, (off, n, crc) in enumerate(block[["offset", "length", "crc32"]].tolist()):
                    if zlib.crc32(os.pread(fd, n, off)) != crc:
                        bad.append(k * b + j)
        finally:
            os.close(fd)
        return np.asarray(bad, dtype=np.int64)

    def verify(self):
        """Check every index block and every record's CRC; ConfigError naming the shard and
        its first bad record."""
        bad = self.find_corrupt()
        if len(bad):
            raise ConfigError(f"{self.where}: {len(bad)} of {len(self)} records fail their CRC "
                              f"check (corrupted data); first bad: record {int(bad[0])}")

    def close(self):
        """Let go of the mapping."""
        self.buffer = self.view = self.records = self._parts = None


class PackedDataset:
    """A packed dataset (directory or manifest ``path``), read lazily.

    ``labels`` is the manifest's label array, memory-mapped (``int64``, read-only, shape
    ``(count,)``). At most ``max_open_shards`` shards are mapped at once (least recently used
    first out; a batch holding records of an evicted shard keeps its mapping alive), each
    holding a file descriptor: by default a quarter of the descriptor limit, at most 1024.
    With ``verify_reads`` every record read is checked against its CRC. A missing, corrupt or
    foreign shard raises, when one of its records is read, :class:`DecodeError` naming the
    record and the shard (so a loader's ``on_error`` policy applies), and is not retried; the
    manifest's own damage raises :class:`ConfigError` at opening.
    """

    def __init__(self, path, *, verify_reads=False, max_open_shards=None):
        path = os.path.abspath(os.fspath(path))
        manifest = path
        if os.path.isdir(path):
            manifest = os.path.join(path, fmt.MANIFEST_NAME)
            if not os.path.isfile(manifest):
                raise ConfigError(f"{path} is not a packed dataset: it has no "
                                  f"{fmt.MANIFEST_NAME}; make one with `dpu-pipe pack SRC OUT`")
        where = f"packed dataset manifest {manifest}"
        # The header alone first: a foreign or empty file is named before it is mapped.
        fmt.parse_manifest_header(*_read_head(manifest, where), where)
        self.max_open_shards = (_default_max_open_shards() if max_open_shards is None
                                else _v.positive_int(max_open_shards, "max_open_shards"))
        self._mm = np.memmap(manifest, dtype=np.uint8, mode="r")
        self.header, self.shards, self.labels, self.meta = fmt.parse_manifest(self._mm, where)
        self.path = os.path.dirname(manifest)
        self.manifest = manifest
        self.verify_reads = bool(verify_reads)
        self._firsts = self.shards["first"].astype(np.int64)
        self._open = collections.OrderedDict()   # shard number -> PackedShard, LRU order
        self._checked = {}                       # shard number -> its PackedShard.checked
        self._failed = {}                        # shard number -> its ConfigError
        self._lock = threading.Lock()
        self._closed = False

    def __len__(self):
        return self.header["count"]

    @property
    def classes(self):
        return self.meta.get("classes")

    @property
    def num_shards(self):
        return self.header["num_shards"]

    @property
    def fingerprint(self):
        """The manifest header's CRC as hex. It covers the shard table, which holds each
        shard's header CRC, which covers that shard's index CRCs (paths and labels)."""
        return f"crc32:{self.header['header_crc32']:08x}"

    def shard_path(self, k):
        return os.path.join(self.path, fmt.shard_name(k))

    def shard_of(self, indices):
        """Shard number of each dataset index (``int64`` array, same shape)."""
        return np.searchsorted(self._firsts, indices, side="right") - 1

    def _open_shard(self, k, shards, labels, checked=None):
        e = shards[k]
        first = int(e["first"])
        return PackedShard(self.shard_path(k), expect=(k, e), checked=checked,
                           labels=labels[first:first + int(e["count"])])

    def shard(self, k):
        """Shard ``k``, opened (and checked against the manifest) on first use; raises the
        ConfigError that names it when it is missing or not the shard the manifest lists."""
        with self._lock:
            self._check_open()
            sh = self._open.get(k)
            if sh is not None:
                self._open.move_to_end(k)
                return sh
            if k in self._failed:
                raise self._failed[k]
            # Taken under the lock: close() may drop them at any moment.
            shards, labels, checked = self.shards, self.labels, self._checked.get(k)
        try:  # outside the lock: other threads read open shards meanwhile
            sh = self._open_shard(k, shards, labels, checked)
        except ConfigError as exc:
            with self._lock:
                self._failed[k] = exc
            raise
        with self._lock:
            self._check_open()
            sh = self._open.setdefault(k, sh)
            self._checked[k] = sh.checked
            self._open.move_to_end(k)
            while len(self._open) > self.max_open_shards:
                self._open.popitem(last=False)
        return sh

    def _check_open(self):
        if self._closed:
            raise ClosedError(f"packed dataset {self.path} is closed")

    def _check_index(self, i):
        self._check_open()
        n = len(self)
        if not 0 <= i < n:
            raise IndexError(f"record {i} out of range for packed dataset {self.path} "
                             f"with {n} records")

    def _locate(self, i):
        """(shard, shard-local number) of record ``i``, its index block checked, or DecodeError."""
        self._check_index(i)
        k = int(self.shard_of(i))
        try:
            sh = self.shard(k)
            j = i - int(self._firsts[k])
            sh.check_block(j // sh.block_records)
        except ClosedError:
            raise
        except ConfigError as exc:
            raise DecodeError(str(exc), index=i, path=self.shard_path(k)) from None
        return sh, j

    def record(self, i):
        """Record ``i``'s bytes as a read-only memoryview of its shard's mapping."""
        sh, j = self._locate(i)
        view = sh.record(j)
        if self.verify_reads and zlib.crc32(view) != int(sh.records["crc32"][j]):
            raise DecodeError("packed record fails its CRC check (corrupted shard)",
                              index=i, path=self.describe(i))
        return view

    def entry(self, i):
        """Record ``i``'s RECORD entry (a numpy void scalar)."""
        sh, j = self._locate(i)
        return sh.records[j]

    def relpath(self, i):
        sh, j = self._locate(i)
        return sh.relpath(j)

    def describe(self, i):
        self._check_index(i)
        try:
            rel = f" ({self.relpath(i)})"
        except DecodeError:
            rel = ""
        return f"packed dataset {self.path}, shard {int(self.shard_of(i))}, record {i}{rel}"

    def buffers(self, indices):
        """``(BufferList, {batch position: DecodeError})`` of the records ``indices``
        (int64 array). Records of a missing or corrupt shard or index block, and with
        ``verify_reads`` records failing their CRC, get an empty buffer and an error."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            self._check_index(int(indices[(indices < 0) | (indices >= len(self))][0]))
        ks = self.shard_of(indices)
        if len(indices) and (ks == ks[0]).all():
            got = self._one_shard(int(ks[0]), indices)
            if got is not None:
                return got
        return buffers_by_record(indices, self.record)

    def _one_shard(self, k, indices):
        """``buffers`` of records all in shard ``k``, without a Python object per record; None
        when a record needs an error (the general path names it)."""
        try:
            sh = self.shard(k)
            local = indices - sh.first
            for b in np.unique(local // sh.block_records).tolist():
                sh.check_block(b)
        except ClosedError:
            raise
        except ConfigError:
            return None
        rec = sh.records[local]
        offsets = rec["offset"].astype(np.int64)
        lengths = rec["length"].astype(np.int64)
        if self.verify_reads:
            for o, ln, crc in zip(offsets.tolist(), lengths.tolist(), rec["crc32"].tolist()):
                if zlib.crc32(sh.view[o:o + ln]) != crc:
                    return None
        return _jpeg.BufferList.from_packed(sh.buffer, offsets, lengths), {}

    def check(self, *, progress=None):
        """Verify every shard on its own: header against the manifest, every index block,
        every record's CRC. Returns ``{shard number: message}`` for the shards that fail;
        ``progress(nbytes)`` is called after each shard with its size."""
        self._check_open()
        failures = {}
        for k in range(self.num_shards):
            try:
                sh = self._open_shard(k, self.shards, self.labels)
                try:
                    sh.verify()
                finally:
                    sh.close()
            except ConfigError as exc:
                failures[k] = str(exc)
            if progress is not None:
                progress(int(self.shards[k]["file_size"]))
        return failures

    def close(self):
        """Let go of the mappings (a batch holding records keeps theirs alive). Any thread may
        close; a read started after it raises :class:`ConfigError`, one in progress completes."""
        with self._lock:
            self._closed = True
            self._open.clear()
            self._mm = self.shards = self.labels = None
