"""The packed dataset format: all JPEG records of a dataset in one memory-mappable file.

Reading a million small files over a shared file system costs one open/stat round trip per
sample; a packed file costs one ``mmap`` per process, and a batch decoder can take a pointer
per record out of one buffer without creating a Python object per sample.

On-disk format, version 1
-------------------------
Every integer is little-endian with a fixed width, so a file written on x86-64 reads the same
on aarch64 (and anywhere else). One file, four parts::

    offset          size            part
    0               128             header
    data_offset     data_size       records: the JPEG bytes, each starting at a multiple of
                                    ``alignment`` (zero padding between records)
    index_offset    index_size      index (starts at a multiple of 8)
    index_offset + index_size       end of file: nothing may follow

Header (128 bytes)::

    0    8   magic          b"DPUPACK\\0"
    8    u4  version        1
    12   u4  header_size    128
    16   u8  count          number of records
    24   u8  data_offset    first byte of the record area
    32   u8  data_size      bytes of the record area, padding included
    40   u8  index_offset
    48   u8  index_size
    56   u8  paths_size     bytes of the path blob inside the index
    64   u8  meta_size      bytes of the JSON metadata inside the index
    72   u4  alignment      record alignment in bytes (a power of two, 1..4096)
    76   u4  index_crc32    zlib.crc32 of the whole index part
    80   44  reserved       zero
    124  u4  header_crc32   zlib.crc32 of header bytes 0..123

Index, contiguous arrays of ``count`` entries each, in this order::

    offsets   <u8   absolute file offset of record i
    lengths   <u8   byte length of record i
    labels    <i8   integer label of record i
    path_end  <u8   end of record i's path in the path blob (record i's path is
                    blob[path_end[i-1]:path_end[i]], with path_end[-1] taken as 0)
    crc32     <u4   zlib.crc32 of record i's bytes
    (zero padding to a multiple of 8)
    paths     paths_size bytes: UTF-8 relative paths, concatenated
    meta      meta_size bytes: UTF-8 JSON object: {"classes": [str, ...] or null,
              "created_by": "dpu_pipe X.Y.Z", "source": the spec of the packed source}

A reader checks the magic, the version, the header CRC, that the file has exactly the
size the header describes (a truncated copy is caught before any record is read), the index
CRC and that every record lies inside the record area. Record CRCs are checked by
:meth:`PackedFile.verify`, by :func:`pack` after writing, and optionally on every read.
"""

import json
import os
import sys
import tempfile
import time
import zlib

import numpy as np

from .errors import ConfigError, DecodeError, DpuPipeError

__all__ = ["MAGIC", "VERSION", "HEADER_SIZE", "PackedFile", "pack", "is_packed_file"]

MAGIC = b"DPUPACK\0"
VERSION = 1
HEADER_SIZE = 128
DEFAULT_ALIGNMENT = 64

_HEADER_DTYPE = np.dtype([
    ("magic", "S8"),
    ("version", "<u4"),
    ("header_size", "<u4"),
    ("count", "<u8"),
    ("data_offset", "<u8"),
    ("data_size", "<u8"),
    ("index_offset", "<u8"),
    ("index_size", "<u8"),
    ("paths_size", "<u8"),
    ("meta_size", "<u8"),
    ("alignment", "<u4"),
    ("index_crc32", "<u4"),
    ("reserved", "V44"),
    ("header_crc32", "<u4"),
])
assert _HEADER_DTYPE.itemsize == HEADER_SIZE

# Bytes per record in the fixed-width part of the index: offsets, lengths, labels,
# path_end (8 bytes each) and crc32 (4 bytes).
_INDEX_BYTES_PER_RECORD = 8 * 4 + 4


def _pad(n, align):
    """Bytes of padding that bring ``n`` up to a multiple of ``align``."""
    return -n % align


def _encode_header(*, count, data_offset, data_size, index_offset, index_size, paths_size,
                   meta_size, alignment, index_crc32):
    h = np.zeros((), dtype=_HEADER_DTYPE)
    h["magic"] = MAGIC
    h["version"] = VERSION
    h["header_size"] = HEADER_SIZE
    h["count"] = count
    h["data_offset"] = data_offset
    h["data_size"] = data_size
    h["index_offset"] = index_offset
    h["index_size"] = index_size
    h["paths_size"] = paths_size
    h["meta_size"] = meta_size
    h["alignment"] = alignment
    h["index_crc32"] = index_crc32
    raw = bytearray(h.tobytes())
    raw[HEADER_SIZE - 4:] = zlib.crc32(raw[:HEADER_SIZE - 4]).to_bytes(4, "little")
    return bytes(raw)


def _decode_header(raw, path):
    """Validate a header's bytes and return it as a dict of Python ints."""
    if len(raw) < len(MAGIC) or raw[:len(MAGIC)] != MAGIC:
        raise ConfigError(f"{path} is not a dpu_pipe packed file (it does not start with "
                          f"{MAGIC!r}); make one with `dpu-pipe pack SRC OUT`")
    if len(raw) < HEADER_SIZE:
        raise ConfigError(f"{path} is truncated: {len(raw)} bytes, shorter than the "
                          f"{HEADER_SIZE}-byte header of a dpu_pipe packed file")
    h = np.frombuffer(raw, dtype=_HEADER_DTYPE, count=1)[0]
    version = int(h["version"])
    if version != VERSION:
        newer = " (written by a newer dpu_pipe; upgrade to read it)" if version > VERSION else ""
        raise ConfigError(f"{path}: packed format version {version} is not supported, this "
                          f"dpu_pipe reads version {VERSION}{newer}")
    if zlib.crc32(raw[:HEADER_SIZE - 4]) != int(h["header_crc32"]):
        raise ConfigError(f"{path}: the header of the packed file is corrupted (CRC mismatch)")
    fields = {name: int(h[name]) for name in _HEADER_DTYPE.names
              if name not in ("magic", "reserved")}
    if fields["header_size"] != HEADER_SIZE:
        raise ConfigError(f"{path}: header size {fields['header_size']} != {HEADER_SIZE}")
    return fields


def is_packed_file(path):
    """True when ``path`` is a regular file that starts with the packed-format magic."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


class PackedFile:
    """Read-only, memory-mapped view of one packed file.

    Opening reads and validates the header and the index (see the module docstring); the
    records themselves are only touched when read, so opening a packed ImageNet costs about
    the size of its index (~40 bytes per record plus its paths), not its data.

    Thread-safe for reading: records are slices of one read-only mapping.
    """

    def __init__(self, path, *, verify_reads=False):
        self.path = os.fspath(path)
        self.verify_reads = bool(verify_reads)
        try:
            with open(self.path, "rb") as f:
                raw = f.read(HEADER_SIZE)
                file_size = os.fstat(f.fileno()).st_size
        except OSError as e:
            raise ConfigError(f"cannot open packed file: {e}") from e
        h = _decode_header(raw, self.path)
        self.header = h
        count, align = h["count"], h["alignment"]
        if align < 1 or align > 4096 or align & (align - 1):
            raise ConfigError(f"{self.path}: invalid record alignment {align} in header")
        expected = h["index_offset"] + h["index_size"]
        if file_size != expected:
            how = "truncated" if file_size < expected else "followed by unexpected bytes"
            raise ConfigError(f"{self.path}: packed file is {how}: the header describes "
                              f"{expected} bytes, the file has {file_size}")
        fixed = count * _INDEX_BYTES_PER_RECORD
        fixed += _pad(fixed, 8)
        if (h["data_offset"] < HEADER_SIZE
                or h["data_offset"] + h["data_size"] > h["index_offset"]
                or h["index_offset"] % 8
                or fixed + h["paths_size"] + h["meta_size"] != h["index_size"]):
            raise ConfigError(f"{self.path}: inconsistent part sizes in the packed header")

        # np.memmap of the whole file: one mapping whose address a batch decoder can use.
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        index = self._mm[h["index_offset"]:expected]
        if zlib.crc32(index) != h["index_crc32"]:
            raise ConfigError(f"{self.path}: the index of the packed file is corrupted "
                              f"(CRC mismatch)")

        def array(dtype, start):
            return np.frombuffer(index, dtype=dtype, count=count, offset=start)

        # '<u8' etc. equal the native dtypes on little-endian machines (no copy); astype
        # makes native copies on a big-endian one so users always see plain int64/uint64.
        self.offsets = array("<u8", 0).astype(np.uint64, copy=False)
        self.lengths = array("<u8", 8 * count).astype(np.uint64, copy=False)
        self.labels = array("<i8", 16 * count).astype(np.int64, copy=False)
        self._path_end = array("<u8", 24 * count).astype(np.uint64, copy=False)
        self.crc32 = array("<u4", 32 * count).astype(np.uint32, copy=False)
        self._paths = index[fixed:fixed + h["paths_size"]]
        meta_raw = index[fixed + h["paths_size"]:]
        try:
            self.meta = json.loads(bytes(meta_raw).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise ConfigError(f"{self.path}: unreadable metadata in the packed file: {e}") from e

        data_lo, data_hi = h["data_offset"], h["data_offset"] + h["data_size"]
        if count and (self.offsets.min() < data_lo
                      or (self.offsets + self.lengths).max() > data_hi
                      or (self.offsets + self.lengths < self.offsets).any()):
            raise ConfigError(f"{self.path}: a record of the packed file lies outside "
                              f"its record area")
        if count and (np.any(np.diff(self._path_end.astype(np.int64)) < 0)
                      or int(self._path_end[-1]) != h["paths_size"]):
            raise ConfigError(f"{self.path}: inconsistent path table in the packed file")

    # -- contents ---------------------------------------------------------------------

    def __len__(self):
        return self.header["count"]

    @property
    def classes(self):
        """Class names (label i is ``classes[i]``), or None when the source had none."""
        return self.meta.get("classes")

    @property
    def total_bytes(self):
        """Sum of the record lengths in bytes (padding excluded)."""
        return int(self.lengths.sum())

    def _check_index(self, i):
        n = self.header["count"]
        if not 0 <= i < n:
            raise IndexError(f"record {i} out of range for packed file {self.path} "
                             f"with {n} records")

    def record(self, i):
        """Record ``i``'s bytes as a read-only, zero-copy ``memoryview`` of the mapping.

        With ``verify_reads`` the record's CRC is checked first and a mismatch raises
        :class:`DecodeError`.
        """
        self._check_index(i)
        start = int(self.offsets[i])
        view = memoryview(self._mm)[start:start + int(self.lengths[i])]
        if self.verify_reads and zlib.crc32(view) != int(self.crc32[i]):
            raise DecodeError("packed record fails its CRC check (corrupted file)",
                              index=i, path=self.describe(i))
        return view

    def relpath(self, i):
        """The path record ``i`` had in its source, relative to the source's root."""
        self._check_index(i)
        lo = int(self._path_end[i - 1]) if i else 0
        return bytes(self._paths[lo:int(self._path_end[i])]).decode("utf-8", "surrogateescape")

    def describe(self, i):
        return f"packed file {self.path}, record {i} ({self.relpath(i)})"

    def raw(self):
        """``(buffer, offsets, lengths)`` for batch decoders.

        ``buffer`` is the whole file as a read-only ``uint8`` array (a memory map);
        record i is ``buffer[offsets[i]:offsets[i] + lengths[i]]``. ``offsets`` and
        ``lengths`` are ``uint64`` arrays of shape ``(len(self),)``. All three stay valid
        while this object (or any of them) is alive.
        """
        return self._mm, self.offsets, self.lengths

    def find_corrupt(self, indices=None, *, progress=None):
        """Indices (``int64`` array) of records whose bytes do not match their stored CRC.

        ``indices`` limits the check to those records; ``progress(done, nbytes)`` is called
        after each record checked.
        """
        idx = range(len(self)) if indices is None else indices
        mv = memoryview(self._mm)
        bad, nbytes = [], 0
        for done, i in enumerate(idx, 1):
            start, n = int(self.offsets[i]), int(self.lengths[i])
            if zlib.crc32(mv[start:start + n]) != int(self.crc32[i]):
                bad.append(i)
            nbytes += n
            if progress is not None:
                progress(done, nbytes)
        return np.asarray(bad, dtype=np.int64)

    def verify(self):
        """Check every record against its CRC; raise :class:`DecodeError` naming the first
        bad record (and how many are bad) if any fails."""
        bad = self.find_corrupt()
        if len(bad):
            i = int(bad[0])
            raise DecodeError(f"{len(bad)} of {len(self)} packed records fail their CRC check "
                              f"(corrupted file); first bad", index=i, path=self.describe(i))

    def close(self):
        """Drop this object's reference to the mapping (it is unmapped once no array or
        memoryview taken from it remains)."""
        self._mm = None
        self.offsets = self.lengths = self.labels = self.crc32 = None
        self._path_end = self._paths = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Progress:
    """A one-line text progress bar on stderr (redrawn in place on a terminal, one line
    every few seconds otherwise so logs stay short)."""

    def __init__(self, total, label, enabled, stream=None):
        self.total, self.label, self.enabled = total, label, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = self.last = time.monotonic()
        self.period = 0.1 if self.tty else 5.0

    def update(self, done, nbytes, force=False):
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self.last < self.period:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        frac = done / self.total if self.total else 1.0
        bar = "#" * int(frac * 30)
        text = (f"{self.label}: [{bar:<30}] {done}/{self.total} ({100 * frac:.1f} %) "
                f"{nbytes / 2**20:.1f} MiB {rate:.0f} rec/s")
        if self.tty:
            self.stream.write("\r" + text + ("\n" if force else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def pack(source, out_path, *, progress=True, verify=True, alignment=DEFAULT_ALIGNMENT):
    """Write every record of ``source`` into the packed file ``out_path``.

    ``source`` is a dpu_pipe source (see :mod:`dpu_pipe.sources`) or a path that
    :func:`dpu_pipe.sources.open_path` accepts. Records keep the source's order, labels,
    relative paths and class names.

    The file is written to a temporary file in the destination directory, synced, and
    renamed over ``out_path`` only when complete, so readers never see a half-written
    file. With ``verify`` the written file is reopened and every record's CRC checked
    against the CRC of the bytes read from the source; a mismatch raises
    :class:`DpuPipeError` and leaves ``out_path`` untouched. An unreadable source file
    raises the source's :class:`DecodeError` naming it. ``progress`` draws a text progress
    bar on stderr. ``alignment`` (bytes, a power of two up to 4096) is where each record
    starts; 64 keeps each record on its own cache lines.

    Returns the written file, opened as a :class:`dpu_pipe.sources.PackedSource`.
    """
    from . import __version__
    from .sources import PackedSource, open_path

    if isinstance(source, (str, os.PathLike)):
        source = open_path(source)
    if not all(hasattr(source, a) for a in ("read", "labels", "relpath", "spec")):
        raise ConfigError(f"pack() needs a dpu_pipe source or a dataset path, "
                          f"got {type(source).__name__}")
    alignment = int(alignment)
    if alignment < 1 or alignment > 4096 or alignment & (alignment - 1):
        raise ConfigError(f"alignment must be a power of two between 1 and 4096 bytes, "
                          f"got {alignment}")
    count = len(source)
    if count == 0:
        raise ConfigError(f"nothing to pack: the source has no records ({source.spec()})")
    out_path = os.path.abspath(os.fspath(out_path))
    out_dir = os.path.dirname(out_path)
    if not os.path.isdir(out_dir):
        raise ConfigError(f"output directory does not exist: {out_dir}")

    labels = np.asarray(source.labels, dtype=np.int64)
    offsets = np.empty(count, dtype="<u8")
    lengths = np.empty(count, dtype="<u8")
    crcs = np.empty(count, dtype="<u4")
    path_end = np.empty(count, dtype="<u8")
    paths = bytearray()
    bar = _Progress(count, f"packing {os.path.basename(out_path)}", progress)

    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(out_path) + ".",
                               suffix=".tmp", dir=out_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * HEADER_SIZE)  # real header written last, once sizes are known
            data_offset = HEADER_SIZE + _pad(HEADER_SIZE, alignment)
            f.write(b"\0" * (data_offset - HEADER_SIZE))
            pos = data_offset
            for i in range(count):
                data = source.read(i)
                pad = _pad(pos, alignment)
                if pad:
                    f.write(b"\0" * pad)
                    pos += pad
                f.write(data)
                offsets[i], lengths[i], crcs[i] = pos, len(data), zlib.crc32(data)
                pos += len(data)
                paths += source.relpath(i).encode("utf-8", "surrogateescape")
                path_end[i] = len(paths)
                bar.update(i + 1, pos - data_offset)
            data_size = pos - data_offset
            index_offset = pos + _pad(pos, 8)
            f.write(b"\0" * (index_offset - pos))

            spec = source.spec()
            # A row-based file list's spec holds every path again; the index has them.
            spec.pop("rows", None)
            meta = json.dumps({
                "classes": source.classes,
                "created_by": f"dpu_pipe {__version__}",
                "source": spec,
            }, sort_keys=True).encode("utf-8")
            fixed = offsets.tobytes() + lengths.tobytes() + labels.astype("<i8").tobytes() \
                + path_end.tobytes() + crcs.tobytes()
            fixed += b"\0" * _pad(len(fixed), 8)
            index = fixed + bytes(paths) + meta
            f.write(index)
            f.seek(0)
            f.write(_encode_header(count=count, data_offset=data_offset, data_size=data_size,
                                   index_offset=index_offset, index_size=len(index),
                                   paths_size=len(paths), meta_size=len(meta),
                                   alignment=alignment, index_crc32=zlib.crc32(index)))
            f.flush()
            os.fsync(f.fileno())
        bar.update(count, data_size, force=True)

        if verify:
            try:
                check = _Progress(count, f"verifying {os.path.basename(out_path)}", progress)
                with PackedFile(tmp) as written:
                    bad = written.find_corrupt(progress=check.update)
                    labels_ok = np.array_equal(written.labels, labels)
                check.update(count, data_size, force=True)
            except ConfigError as e:
                raise DpuPipeError(f"verification of the written packed file failed: {e}; "
                                   f"{out_path} was left untouched") from e
            if len(bad) or not labels_ok:
                what = (f"{len(bad)} records differ from the source (first: record {bad[0]})"
                        if len(bad) else "the labels differ from the source")
                raise DpuPipeError(f"verification of the written packed file failed: {what}; "
                                   f"{out_path} was left untouched")
        os.replace(tmp, out_path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable; not every file system allows fsync on a dir
        dfd = os.open(out_dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    return PackedSource(out_path)
