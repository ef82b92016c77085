"""Writing packed datasets: ``pack(source, out)`` and ``dpu-pipe pack SRC OUT``. The writer
reads any source, so it sits above :mod:`dpu_pipe.sources` (see :mod:`dpu_pipe.packed`)."""

import concurrent.futures
import contextlib
import io
import json
import math
import os
import shutil
import uuid
import zlib

import numpy as np

from .. import _validate, jpeg
from .._version import __version__
from ..errors import ConfigError, DecodeError, DpuPipeError
from ..sources import PackedSource, open_path
from . import format as fmt
from .reader import PackedShard, is_packed

__all__ = ["pack", "DEFAULT_SHARD_SIZE", "parse_size"]

DEFAULT_SHARD_SIZE = 2**30

_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 10**3, "KIB": 2**10, "M": 2**20, "MB": 10**6,
          "MIB": 2**20, "G": 2**30, "GB": 10**9, "GIB": 2**30, "T": 2**40, "TB": 10**12,
          "TIB": 2**40}


def parse_size(text):
    """Bytes in a size such as ``1GiB``, ``500MB``, ``64M`` or ``4096`` (KiB/MiB/GiB/TiB and
    K/M/G/T are powers of 1024, kB/MB/GB/TB powers of 1000)."""
    s = str(text).strip()
    num = s.rstrip("KMGTIBkmgtib ")
    unit = s[len(num):].strip().upper()
    with contextlib.suppress(ValueError, KeyError):
        value = float(num)
        if value > 0 and math.isfinite(value):
            return int(value * _UNITS[unit])
    raise ConfigError(f"not a size: {text!r} (expected e.g. 1GiB, 500MB, 4096)")


def _positive_int(value, name, what="integer"):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive {what}, got {value!r}")
    return int(value)


def _transcoder(restart_interval):
    """``pack(transcode=True)``'s per-record transform: JPEG bytes -> bytes, None (kept as
    they are) or DecodeError (libjpeg cannot read them)."""
    if restart_interval != "row":
        if isinstance(restart_interval, bool) or not isinstance(
                restart_interval, (int, np.integer)) or not 1 <= restart_interval <= 65535:
            raise ConfigError(f"restart_interval must be a number of MCUs (1 to 65535) or "
                              f"'row', got {restart_interval!r}")
        restart_interval = int(restart_interval)

    def apply(data):
        try:
            return jpeg.transcode(data, restart_interval=restart_interval, optimize=True)
        except jpeg.TranscodeUnsupported:  # readable, but rewriting would change the pixels
            return None
    apply.restart_interval = restart_interval
    return apply


#: JPEG quality of the records ``max_side`` re-encodes (FFCV's default for its JPEGs too).
RESIZE_QUALITY = 90


def _downscaler(max_side):
    """``pack(max_side=N)``'s per-record transform: (JPEG bytes, width, height) -> JPEG bytes
    with a longer side of N, or None when it fits. Done by Pillow: packing is not a hot path."""
    max_side = _validate.integer(max_side, "max_side", low=1, high=65500)
    try:
        from PIL import Image, JpegImagePlugin
    except ImportError:
        raise ConfigError("max_side needs Pillow to resize and re-encode JPEGs: pip install "
                          "pillow (or dpu_pipe[tools])") from None

    def apply(data, width, height):
        if max(width, height) <= max_side:
            return None
        scale = max_side / max(width, height)
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        with Image.open(io.BytesIO(data)) as im:
            sampling = JpegImagePlugin.get_sampling(im)
            icc = im.info.get("icc_profile")
            im = im.convert("L" if im.mode in ("L", "1") else "RGB")
        small = im.resize(size, Image.Resampling.LANCZOS)
        out = io.BytesIO()
        small.save(out, "JPEG", quality=RESIZE_QUALITY,
                   subsampling=sampling if sampling >= 0 else 2, icc_profile=icc)
        return out.getvalue()
    apply.max_side = max_side
    return apply


def _prepare(data, transform, downscale=None):
    """``(bytes to store, flags, format code)`` of one source record."""
    code = fmt.detect_format(data)
    flags = 0
    if code == 1:
        try:
            hdr = jpeg.read_header(data)
        except DecodeError:
            return data, fmt.UNREADABLE, code
        if downscale is not None:
            try:
                small = downscale(data, hdr.width, hdr.height)
            except (OSError, ValueError):  # Pillow cannot read what libjpeg's header did
                return data, fmt.UNREADABLE, code
            if small is not None:
                data, flags = small, fmt.RESIZED
        if transform is not None:
            try:
                out = transform(data)
            except DecodeError:  # the header reads, the coefficients do not
                return data, fmt.UNREADABLE, code
            if out is not None:
                data, flags = out, flags | fmt.TRANSCODED
    elif code == 0:
        flags = fmt.UNREADABLE
    return data, flags, code


class _ShardWriter:
    """One shard being written: records appended, then index, block CRCs, paths, header."""

    def __init__(self, path, number, first, alignment, block_records):
        self.path, self.number, self.first = path, number, first
        self.alignment, self.block_records = alignment, block_records
        self.f = open(path, "xb")  # created with the process's umask
        self.data_offset = fmt.HEADER_SIZE + fmt._pad(fmt.HEADER_SIZE, alignment)
        self.f.write(b"\0" * self.data_offset)  # header written last, once sizes are known
        self.pos = self.data_offset
        self.records = np.zeros(1024, dtype=fmt.RECORD)
        self.count = 0
        self.paths = bytearray()

    def size_with(self, nbytes, path_len):
        """Approximate file size after adding a record of ``nbytes`` (index included)."""
        n = self.count + 1
        return (self.pos + fmt._pad(self.pos, self.alignment) + nbytes + 8
                + fmt.RECORD.itemsize * n + 4 * (n // self.block_records + 1)
                + len(self.paths) + path_len)

    def add(self, data, label, orig_length, flags, code, relpath):
        pad = fmt._pad(self.pos, self.alignment)
        self.f.write(b"\0" * pad)
        self.pos += pad
        self.f.write(data)
        if self.count == len(self.records):
            self.records = np.concatenate([self.records, np.zeros_like(self.records)])
        self.paths += relpath
        self.records[self.count] = (self.pos, len(data), label, orig_length, len(self.paths),
                                    zlib.crc32(data), flags, code, b"\0\0")
        self.pos += len(data)
        self.count += 1

    def finish(self):
        """Write index, block CRCs, paths and header; fsync; return the SHARD_ENTRY."""
        recs = self.records[:self.count]
        data_size = self.pos - self.data_offset
        index_offset = self.pos + fmt._pad(self.pos, 8)
        self.f.write(b"\0" * (index_offset - self.pos))
        self.f.write(recs.tobytes())
        b = self.block_records
        blocks = np.empty(-(-self.count // b), dtype="<u4")
        for k in range(len(blocks)):
            block = recs[k * b:(k + 1) * b]
            lo = int(recs["path_end"][k * b - 1]) if k else 0
            paths = bytes(self.paths[lo:int(block["path_end"][-1])])
            blocks[k] = fmt.block_crc(block.tobytes(), paths)
        blocks_offset = index_offset + recs.nbytes
        self.f.write(blocks.tobytes())
        paths_offset = blocks_offset + blocks.nbytes
        self.f.write(self.paths)
        file_size = paths_offset + len(self.paths)
        header = fmt.encode_header(
            fmt.SHARD_HEADER, shard=self.number, first=self.first, count=self.count,
            data_offset=self.data_offset, data_size=data_size, index_offset=index_offset,
            blocks_offset=blocks_offset, paths_offset=paths_offset, paths_size=len(self.paths),
            file_size=file_size, block_records=b, alignment=self.alignment,
            blocks_crc32=zlib.crc32(blocks))
        self.f.seek(0)
        self.f.write(header)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        entry = np.zeros((), dtype=fmt.SHARD_ENTRY)
        entry["first"], entry["count"], entry["file_size"] = self.first, self.count, file_size
        entry["data_bytes"] = int(recs["length"].sum())
        entry["orig_bytes"] = int(recs["orig_length"].sum())
        entry["transcoded"] = int(np.count_nonzero(recs["flags"] & fmt.TRANSCODED))
        entry["header_crc32"] = int.from_bytes(header[-4:], "little")
        return entry, recs


def _write_manifest(path, labels, table, meta):
    shards_offset = fmt.HEADER_SIZE
    labels_offset = shards_offset + table.nbytes
    labels_offset += fmt._pad(labels_offset, 8)
    meta_offset = labels_offset + labels.nbytes
    header = fmt.encode_header(
        fmt.MANIFEST_HEADER, count=len(labels), num_shards=len(table),
        shards_offset=shards_offset, labels_offset=labels_offset, meta_offset=meta_offset,
        meta_size=len(meta), file_size=meta_offset + len(meta),
        shards_crc32=zlib.crc32(table), meta_crc32=zlib.crc32(meta))
    with open(path, "xb") as f:
        f.write(header)
        f.write(table.tobytes())
        f.write(b"\0" * (labels_offset - shards_offset - table.nbytes))
        f.write(labels.tobytes())
        f.write(meta)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path):
    with contextlib.suppress(OSError):  # not every file system allows fsync on a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _NoBar:
    """A tqdm bar's calls, doing nothing."""

    def update(self, n):
        pass


def _progress_bar(progress, total, desc):
    """A tqdm bar (used as a context manager), or a silent stand-in with the same calls."""
    if progress is False:
        return contextlib.nullcontext(_NoBar())
    try:
        from tqdm import tqdm
    except ImportError:
        if progress:
            raise ConfigError("progress bars need tqdm: pip install tqdm "
                              "(or dpu_pipe[tools]), or pass progress=False") from None
        return contextlib.nullcontext(_NoBar())
    return tqdm(total=total, desc=desc, unit="img", unit_scale=True, dynamic_ncols=True,
                disable=None if progress is None else False)


def pack(source, out, *, shard_size=DEFAULT_SHARD_SIZE, transcode=True, restart_interval=1,
         threads=None, progress=None, verify=True, alignment=fmt.DEFAULT_ALIGNMENT,
         block_records=fmt.DEFAULT_BLOCK_RECORDS, max_side=None):
    """Write every record of ``source`` into the packed dataset directory ``out``, in order,
    with its label, relative path and class names (docs/guides/packing.md).

    Parameters
    ----------
    source : source or path
        Any source with integer labels, or a path :func:`dpu_pipe.sources.open_path` opens.
    out : str
        The directory, written beside it and renamed when complete; an existing packed
        dataset there is replaced, anything else refused.
    shard_size : int or str
        Bytes a shard grows to (``"1GiB"`` allowed); a larger record gets a shard of its own.
    transcode : bool
        Rewrite readable JPEGs losslessly with a restart marker every ``restart_interval``
        MCUs (or ``"row"``) and optimized Huffman tables (:func:`dpu_pipe.jpeg.transcode`).
    threads : int, optional
        Threads reading and transcoding (default: one per usable CPU); no effect on output.
    progress : bool or None
        A tqdm bar; None: only on a terminal.
    verify : bool
        Re-read each written shard and check its CRCs.
    alignment : int
        Bytes, a power of two up to 4096: records start at multiples of it.
    block_records : int
        Records per CRC-checked index block.
    max_side : int, optional
        Pixels: readable JPEGs with a longer side are downscaled to it (lossy, Pillow's
        Lanczos, quality :data:`RESIZE_QUALITY`) and flagged ``RESIZED``.

    Returns
    -------
    PackedSource
        The dataset written. An unreadable source file raises its :class:`DecodeError` and
        leaves ``out`` untouched.
    """
    source, labels = _packable(source)
    shard_size = _positive_int(parse_size(shard_size) if isinstance(shard_size, str)
                               else shard_size, "shard_size", "number of bytes")
    alignment = int(alignment)
    if alignment < 1 or alignment > 4096 or alignment & (alignment - 1):
        raise ConfigError(f"alignment must be a power of two between 1 and 4096 bytes, "
                          f"got {alignment}")
    block_records = _validate.integer(block_records, "block_records", 1, 2**20)
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
    threads = _positive_int(threads, "threads")
    transcode = _validate.boolean(transcode, "transcode")
    transform = _transcoder(restart_interval) if transcode else None
    downscale = _downscaler(max_side) if max_side is not None else None
    out = os.path.abspath(os.fspath(out))
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise ConfigError(f"output directory does not exist: {parent}")
    if os.path.lexists(out) and not is_packed(out):
        raise ConfigError(f"refusing to replace {out}: it exists and is not a packed dataset")

    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{uuid.uuid4().hex[:12]}")
    os.mkdir(tmp)  # mode 0o777 minus the umask, as any directory the user creates
    shards = _Shards(tmp, labels, shard_size, alignment, block_records, verify)
    relpath = getattr(source, "relpath", str)   # a source without names: its index
    try:
        with _progress_bar(progress, len(source), f"packing {os.path.basename(out)}") as bar:
            for i, *record in _records(source, transform, downscale, threads):
                shards.add(i, relpath(i), *record)
                bar.update(1)
        shards.close()
        table = shards.table()
        spec = source.spec() if hasattr(source, "spec") else {"type": type(source).__name__}
        if not isinstance(spec.get("args", {}).get("path_or_rows", ""), str):
            del spec["args"]["path_or_rows"]   # a row-based file list's: every path again
        meta = {
            "classes": getattr(source, "classes", None),
            "created_by": f"dpu_pipe {__version__}",
            "source": spec,
            "shard_size": shard_size,
            "transcode": None if transform is None else {
                "restart_interval": transform.restart_interval, "optimize": True},
            "max_side": None if downscale is None else {
                "max_side": downscale.max_side, "resized": shards.resized,
                "quality": RESIZE_QUALITY, "resampler": "Pillow LANCZOS"},
            "formats": {name: int(n) for name, n in zip(fmt.FORMATS, shards.formats) if n},
            "unreadable": len(shards.unreadable),
            "unreadable_examples": shards.unreadable[:20],
            "label_range": [int(labels.min()), int(labels.max())],
            "num_labels": int(len(np.unique(labels))),
            "data_bytes": int(table["data_bytes"].sum()),
            "orig_bytes": int(table["orig_bytes"].sum()),
        }
        _write_manifest(os.path.join(tmp, fmt.MANIFEST_NAME), labels, table,
                        json.dumps(meta, sort_keys=True).encode("utf-8"))
        _fsync_dir(tmp)
        _install(tmp, out, parent)
    except BaseException:
        shards.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PackedSource(out)


def _packable(source):
    """(source, int64 labels) of what :func:`pack` was given: a source or a dataset path."""
    if isinstance(source, (str, os.PathLike)):
        source = open_path(source)
    if not all(hasattr(source, a) for a in ("read", "labels", "__len__")):
        raise ConfigError(f"pack() needs a dpu_pipe source or a dataset path, "
                          f"got {type(source).__name__}")
    labels = np.asarray(source.labels)
    if labels.ndim != 1 or labels.dtype.kind not in "iub":
        raise ConfigError(f"a packed dataset holds one integer label per sample; this source's "
                          f"labels are {labels.dtype} of shape {labels.shape}")
    if len(source) == 0:
        raise ConfigError(f"nothing to pack: the source has no records ({source!r})")
    return source, np.ascontiguousarray(labels, dtype="<i8")


def _records(source, transform, downscale, threads):
    """``(i, orig_length, data, flags, code)`` of each record in order, ``threads × 64`` at most
    in flight."""
    def one(i):
        data = source.read(i)
        return (i, len(data)) + _prepare(data, transform, downscale)

    pool = concurrent.futures.ThreadPoolExecutor(threads) if threads > 1 else None
    try:
        step = 64 * threads
        for lo in range(0, len(source), step):
            idx = range(lo, min(lo + step, len(source)))
            yield from (pool.map(one, idx) if pool else map(one, idx))
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


class _Shards:
    """The shards of a pack being written into ``tmp``: a new one when the current one would
    outgrow ``shard_size``, each verified when closed (with ``verify``), and their counts."""

    def __init__(self, tmp, labels, shard_size, alignment, block_records, verify):
        self.tmp, self.labels, self.shard_size = tmp, labels, shard_size
        self.alignment, self.block_records, self.verify = alignment, block_records, verify
        self.entries, self.writer = [], None
        self.formats = np.zeros(len(fmt.FORMATS), dtype=np.int64)
        self.unreadable = []
        self.resized = 0

    def add(self, i, relpath, orig_length, data, flags, code):
        rel = relpath.encode("utf-8", "surrogateescape")
        if self.writer is not None and self.writer.size_with(len(data), len(rel)) > self.shard_size:
            self.close()
        if self.writer is None:
            self.writer = _ShardWriter(os.path.join(self.tmp, fmt.shard_name(len(self.entries))),
                                       len(self.entries), i, self.alignment, self.block_records)
        self.writer.add(data, self.labels[i], orig_length, flags, code, rel)
        self.formats[code] += 1
        self.resized += bool(flags & fmt.RESIZED)
        if flags & fmt.UNREADABLE:
            self.unreadable.append(relpath)

    def close(self):
        w, self.writer = self.writer, None
        entry, recs = w.finish()
        if self.verify:
            _verify_shard(w.path, len(self.entries), recs,
                          self.labels[w.first:w.first + w.count])
        self.entries.append(entry)

    def abort(self):
        if self.writer is not None:
            self.writer.f.close()
            self.writer = None

    def table(self):
        return np.array(self.entries, dtype=fmt.SHARD_ENTRY)


def _install(tmp, out, parent):
    """Put the complete dataset ``tmp`` at ``out``, replacing a packed dataset there."""
    if os.path.lexists(out):
        # A directory cannot be renamed over a non-empty one: move the old dataset aside,
        # put the new one in place (or the old one back), then delete the old one.
        old = os.path.join(parent, f".{os.path.basename(out)}.old-{uuid.uuid4().hex[:12]}")
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        (shutil.rmtree if os.path.isdir(old) else os.unlink)(old)
    else:
        os.rename(tmp, out)
    _fsync_dir(parent)


def _verify_shard(path, number, recs, labels):
    """Re-read a written shard: its structure, labels and every record's CRC."""
    try:
        sh = PackedShard(path, labels=labels)
        try:
            bad = sh.find_corrupt()
            same = np.array_equal(sh.records["crc32"], recs["crc32"])
        finally:
            sh.close()
    except ConfigError as e:
        raise DpuPipeError(f"verification of written shard {number} failed: {e}") from e
    if len(bad) or not same:
        what = (f"{len(bad)} records differ from what was written (first: record "
                f"{int(bad[0])} of the shard)" if len(bad)
                else "its index differs from what was written")
        raise DpuPipeError(f"verification of written shard {number} ({path}) failed: {what}")
