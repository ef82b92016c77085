"""Reading packed datasets: the manifest, and shards mapped and checked only where they are read.

Opening a :class:`PackedDataset` reads the manifest's header, shard table and metadata (64
bytes per shard plus the JSON object) and maps its label array, whose pages the OS loads when
they are touched. A shard is opened, mapped and its header checked against the manifest the
first time one of its records is needed; an index block (256 records by default) is checked
(CRC, bounds, labels equal to the manifest's) the first time one of its records is needed.
So a rank's memory grows with the blocks it reads, never with the dataset: see
:attr:`PackedDataset.max_open_shards` for the bound on mappings.
"""

import collections
import os
import threading
import zlib

import numpy as np

from .. import _jpeg
from ..errors import ConfigError, DecodeError
from . import format as fmt

__all__ = ["PackedShard", "PackedDataset", "is_packed", "manifest_path",
           "default_max_open_shards"]


class ClosedError(ConfigError):
    """A read of a :class:`PackedDataset` after its :meth:`~PackedDataset.close` (not a
    damaged shard: never turned into a sample's :class:`DecodeError`)."""


def manifest_path(path):
    """The manifest of the packed dataset at ``path`` (its directory, its manifest — or one
    of its shards, which opening then refuses by name), or None when ``path`` is none of
    these."""
    path = os.fspath(path)
    if os.path.isdir(path):
        candidate = os.path.join(path, fmt.MANIFEST_NAME)
        return candidate if os.path.isfile(candidate) else None
    try:
        with open(path, "rb") as f:
            head = f.read(len(fmt.MAGIC))
    except OSError:
        return None
    return path if head in (fmt.MAGIC, fmt.SHARD_MAGIC) else None


def is_packed(path):
    """True when ``path`` is a packed dataset's directory, manifest (of any version) or
    shard."""
    return manifest_path(path) is not None


def default_max_open_shards():
    """Shards a reader keeps open by default: a quarter of the soft file-descriptor limit,
    between 16 and 1024."""
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

    ``expect`` is ``(shard number, SHARD_ENTRY)`` from a manifest; the shard must match it
    (``checked``, the :attr:`checked` array of an earlier opening of it, is only trusted then).
    Without it the shard is opened on its own (its own CRCs still cover every part).
    ``labels`` (``<i8`` array of the shard's records, e.g. the manifest's slice) is compared
    with each index block as it is checked. Errors are :class:`ConfigError` naming the shard
    and, for an index entry, the record.
    """

    def __init__(self, path, *, expect=None, labels=None, checked=None):
        self.path = os.fspath(path)
        self.where = (f"shard {expect[0]} ({self.path})" if expect is not None
                      else f"shard {self.path}")
        raw, size = _read_head(self.path, self.where)
        h = fmt.parse_shard_header(raw, size, self.where)
        if expect is not None:
            k, entry = expect
            got = (h["shard"], h["first"], h["count"], h["file_size"], int.from_bytes(raw[-4:], "little"))
            want = (k, int(entry["first"]), int(entry["count"]), int(entry["file_size"]),
                    int(entry["header_crc32"]))
            if got != want:
                raise ConfigError(f"{self.where} does not belong to this dataset: it holds "
                                  f"records {h['first']}..{h['first'] + h['count'] - 1} of shard "
                                  f"{h['shard']} ({h['file_size']} bytes), the manifest expects "
                                  f"records {want[1]}..{want[1] + want[2] - 1} of shard {k} "
                                  f"({want[3]} bytes) with header CRC {want[4]:08x}")
        self.header = h
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        if len(self._mm) != h["file_size"]:  # changed between the header read and the map
            raise ConfigError(f"{self.where} changed size while it was opened")
        self._blocks = np.frombuffer(self._mm, "<u4", count=h["nblocks"],
                                     offset=h["blocks_offset"])
        if zlib.crc32(self._blocks) != h["blocks_crc32"]:
            raise ConfigError(f"{self.where}: block CRC table corrupted (CRC mismatch)")
        self.records = np.frombuffer(self._mm, fmt.RECORD, count=h["count"],
                                     offset=h["index_offset"])
        self._paths = memoryview(self._mm)[h["paths_offset"]:h["paths_offset"] + h["paths_size"]]
        # A version-3 shard's restart-interval index: read only for its blocks' CRCs.
        self._interval_ends, self._interval_entries = fmt.interval_parts(self._mm, h)
        self._labels = labels
        # Which index blocks passed check_block; a reader that reopens the same shard (same
        # header CRC, so the same CRC-covered index) passes the array back in.
        self._checked = (checked if checked is not None and len(checked) == h["nblocks"]
                         else np.zeros(h["nblocks"], dtype=bool))
        self.first, self.block_records = h["first"], h["block_records"]
        self._view = None

    def __len__(self):
        return self.header["count"]

    @property
    def checked(self):
        """``bool`` array, one per index block: checked already."""
        return self._checked

    @property
    def buffer(self):
        """The whole shard file as a read-only ``uint8`` array (a memory map)."""
        return self._mm

    @property
    def view(self):
        """The whole shard file as a read-only ``memoryview`` (of :attr:`buffer`)."""
        if self._view is None:
            self._view = memoryview(self._mm)
        return self._view

    def _path_lo(self, k):
        if k == 0:
            return 0
        return int(self.records["path_end"][k * self.header["block_records"] - 1])

    def check_block(self, k):
        """Check index block ``k`` (CRC, record bounds, path table, labels); ConfigError
        naming the record otherwise. Each block is checked once."""
        if self._checked[k]:
            return
        h, b = self.header, self.header["block_records"]
        block = self.records[k * b:(k + 1) * b]
        path_lo = self._path_lo(k)
        where = self.where
        fmt.check_records(block, data_lo=h["data_offset"],
                          data_hi=h["data_offset"] + h["data_size"], path_lo=path_lo,
                          paths_size=h["paths_size"], first=k * b, where=where)
        path_hi = int(block["path_end"][-1])
        parts = ()
        if self._interval_ends is not None:
            parts = fmt.block_interval_parts(self._interval_ends, self._interval_entries,
                                             k * b, len(block), where)
        if path_lo > path_hi or fmt.block_crc(block, self._paths[path_lo:path_hi], parts) \
                != int(self._blocks[k]):
            raise ConfigError(f"{where}: index block {k} (records {k * b}.."
                              f"{k * b + len(block) - 1}) corrupted (CRC mismatch)")
        if self._labels is not None:
            want = self._labels[k * b:(k + 1) * b]
            diff = np.flatnonzero(block["label"] != want)
            if len(diff):
                j = k * b + int(diff[0])
                raise ConfigError(f"{where}: record {j} has label {int(block['label'][diff[0]])} "
                                  f"in the shard and {int(want[diff[0]])} in the manifest")
        self._checked[k] = True

    def record(self, j):
        """Record ``j``'s bytes as a read-only memoryview of the mapping (index checked)."""
        self.check_block(j // self.header["block_records"])
        r = self.records[j]
        start = int(r["offset"])
        return memoryview(self._mm)[start:start + int(r["length"])]

    def relpath(self, j):
        self.check_block(j // self.header["block_records"])
        lo = int(self.records["path_end"][j - 1]) if j else 0
        return bytes(self._paths[lo:int(self.records["path_end"][j])]).decode(
            "utf-8", "surrogateescape")

    def find_corrupt(self, progress=None):
        """Shard-local numbers (``int64`` array) of the records whose bytes do not match
        their CRC, after checking every index block. ``progress(nbytes)`` is called per
        block with the bytes checked."""
        bad = []
        b = self.header["block_records"]
        # Read with pread, not through the mapping: checking a 1 GiB shard then leaves the
        # process's resident memory alone (one record at a time), the page cache aside.
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for k in range(self.header["nblocks"]):
                self.check_block(k)
                block = self.records[k * b:(k + 1) * b]
                nbytes = 0
                for j, (off, n, crc) in enumerate(zip(block["offset"].tolist(),
                                                      block["length"].tolist(),
                                                      block["crc32"].tolist())):
                    if zlib.crc32(os.pread(fd, n, off)) != crc:
                        bad.append(k * b + j)
                    nbytes += n
                if progress is not None:
                    progress(nbytes)
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
        self._mm = self.records = self._blocks = self._paths = self._view = None
        self._interval_ends = self._interval_entries = None


class PackedDataset:
    """A packed dataset (directory or manifest ``path``), read lazily.

    ``labels`` is the manifest's label array, memory-mapped (``int64``, read-only, shape
    ``(count,)``). ``max_open_shards`` bounds the shards mapped at once (least recently used
    first out; a batch still holding records of an evicted shard keeps its mapping alive).
    With ``verify_reads`` every record read is checked against its CRC.

    Each open shard holds one file descriptor and one memory mapping; by default at most a
    quarter of the process's file-descriptor limit, capped at 1024. Index blocks checked stay
    checked across a shard's closing and reopening (1 byte per 256 records).

    A shard that is missing, corrupt or foreign raises, when one of its records is read,
    :class:`DecodeError` naming the record and the shard (so a loader's ``on_error`` policy
    applies); this object does not retry it (open the dataset again to). The manifest's own
    damage raises :class:`ConfigError` at opening.
    """

    def __init__(self, path, *, verify_reads=False, max_open_shards=None):
        path = os.path.abspath(os.fspath(path))
        if os.path.isdir(path):
            manifest = os.path.join(path, fmt.MANIFEST_NAME)
            if not os.path.isfile(manifest):
                raise ConfigError(f"{path} is not a packed dataset: it has no "
                                  f"{fmt.MANIFEST_NAME}; make one with `dpu-pipe pack SRC OUT`")
        else:
            manifest = path
        raw, size = _read_head(manifest, f"packed dataset manifest {manifest}")
        where = f"packed dataset manifest {manifest}"
        h = fmt.parse_manifest_header(raw, size, where)
        self.path = os.path.dirname(manifest)
        self.manifest = manifest
        self.header = h
        self.verify_reads = bool(verify_reads)
        if max_open_shards is None:
            max_open_shards = default_max_open_shards()
        if isinstance(max_open_shards, bool) or not isinstance(max_open_shards,
                                                                (int, np.integer)) \
                or max_open_shards < 1:
            raise ConfigError(f"max_open_shards must be a positive integer, got "
                              f"{max_open_shards!r}")
        self.max_open_shards = int(max_open_shards)
        self._mm = np.memmap(manifest, dtype=np.uint8, mode="r")
        if len(self._mm) != h["file_size"]:
            raise ConfigError(f"{where} changed size while it was opened")
        self.shards = np.frombuffer(self._mm, fmt.SHARD_ENTRY, count=h["num_shards"],
                                    offset=h["shards_offset"])
        if zlib.crc32(self.shards) != h["shards_crc32"]:
            raise ConfigError(f"{where}: shard table corrupted (CRC mismatch)")
        fmt.check_shard_table(self.shards, h["count"], where)
        self._firsts = self.shards["first"].astype(np.int64)
        self.labels = np.frombuffer(self._mm, "<i8", count=h["count"], offset=h["labels_offset"])
        m0 = h["meta_offset"]
        self.meta = fmt.parse_meta(memoryview(self._mm)[m0:m0 + h["meta_size"]],
                                   h["meta_crc32"], where)
        self._open = collections.OrderedDict()   # shard number -> PackedShard, LRU order
        self._checked = {}                       # shard number -> its PackedShard.checked
        self._failed = {}                        # shard number -> its ConfigError
        self._lock = threading.Lock()
        self._fingerprint = f"crc32:{int.from_bytes(self._mm[124:128].tobytes(), 'little'):08x}"
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
        return self._fingerprint

    def shard_path(self, k):
        return os.path.join(self.path, fmt.shard_name(k))

    def shard_of(self, indices):
        """Shard number of each dataset index (``int64`` array, same shape)."""
        return np.searchsorted(self._firsts, indices, side="right") - 1

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
            e = self.shards[k]
            first, n = int(e["first"]), int(e["count"])
            labels = self.labels[first:first + n]
        try:
            sh = PackedShard(self.shard_path(k), expect=(k, e), labels=labels,
                             checked=self._checked.get(k))
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
        """(shard, shard-local number) of record ``i``, index block checked; DecodeError
        naming the record and shard when either fails."""
        self._check_index(i)
        k = int(self.shard_of(i))
        try:
            sh = self.shard(k)
            j = i - int(self._firsts[k])
            sh.check_block(j // sh.header["block_records"])
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
        k = int(self.shard_of(i))
        try:
            rel = f" ({self.relpath(i)})"
        except DecodeError:
            rel = ""
        return f"packed dataset {self.path}, shard {k}, record {i}{rel}"

    def buffers(self, indices):
        """``(BufferList, {batch position: DecodeError})`` of the records ``indices``
        (int64 array). Records of a missing or corrupt shard or index block, and with
        ``verify_reads`` records failing their CRC, get an empty buffer and an error."""
        indices = np.asarray(indices, dtype=np.int64)
        n = len(indices)
        if n and (indices.min() < 0 or indices.max() >= len(self)):
            self._check_index(int(indices[(indices < 0) | (indices >= len(self))][0]))
        ks = self.shard_of(indices)
        if n and ks[0] == ks[-1] and (ks == ks[0]).all():
            got = self._one_shard(int(ks[0]), indices)
            if got is not None:
                return got
        # A shuffled batch touches about as many shards as it has records: one pass over the
        # records, each costing a few dictionary and array look-ups.
        errors, views, opened = {}, [], {}
        empty = b""
        for p, (k, i) in enumerate(zip(ks.tolist(), indices.tolist())):
            sh = opened.get(k)
            if sh is None:
                try:
                    sh = self.shard(k)
                except ClosedError:
                    raise
                except ConfigError as exc:
                    sh = exc
                opened[k] = sh
            if isinstance(sh, ConfigError):
                errors[p] = DecodeError(str(sh), index=i, path=self.shard_path(k))
                views.append(empty)
                continue
            j = i - sh.first
            b = j // sh.block_records
            if not sh._checked[b]:
                try:
                    sh.check_block(b)
                except ConfigError as exc:
                    errors[p] = DecodeError(str(exc), index=i, path=self.shard_path(k))
                    views.append(empty)
                    continue
            r = sh.records[j]
            o, ln = int(r["offset"]), int(r["length"])
            view = sh.view[o:o + ln]
            if self.verify_reads and zlib.crc32(view) != int(r["crc32"]):
                errors[p] = DecodeError("packed record fails its CRC check (corrupted shard)",
                                        index=i, path=self.describe(i))
                view = empty
            views.append(view)
        return _jpeg.BufferList.from_buffers(views), errors

    def _one_shard(self, k, indices):
        """``buffers`` of records that all lie in shard ``k``: its mapping and the offsets,
        no Python object per record; None when a record needs an error (the general path
        names it)."""
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
            mv = sh.view
            for o, ln, crc in zip(offsets.tolist(), lengths.tolist(), rec["crc32"].tolist()):
                if zlib.crc32(mv[o:o + ln]) != crc:
                    return None
        return _jpeg.BufferList.from_packed(sh.buffer, offsets, lengths), {}

    def check(self, shards=None, *, progress=None):
        """Verify shards (all, or the numbers in ``shards``) on their own: header against the
        manifest, every index block, every record's CRC. Returns ``{shard number: message}``
        for the shards that fail; ``progress(nbytes)`` is called as bytes are checked."""
        self._check_open()
        failures = {}
        for k in (range(self.num_shards) if shards is None else shards):
            k = int(k)
            e = self.shards[k]
            first, n = int(e["first"]), int(e["count"])
            try:
                sh = PackedShard(self.shard_path(k), expect=(k, e),
                                 labels=self.labels[first:first + n])
                try:
                    sh.verify()
                finally:
                    sh.close()
            except ConfigError as exc:
                failures[k] = str(exc)
            if progress is not None:
                progress(int(e["file_size"]))
        return failures

    def close(self):
        """Let go of the mappings (a batch still holding records keeps theirs alive). Any
        thread may close; a read started after it raises :class:`ConfigError`, one in
        progress completes."""
        with self._lock:
            self._closed = True
            self._open.clear()
            self._mm = self.shards = self.labels = None
