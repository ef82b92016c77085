"""Writing packed datasets: ``pack(source, out)`` and ``dpu-pipe pack SRC OUT``.

The writer sits above :mod:`dpu_pipe.sources` (it reads any source and returns a
:class:`~dpu_pipe.sources.PackedSource`); the format and the reader sit below it, so
``sources`` imports ``packed.reader`` and nothing imports back.
"""

import concurrent.futures
import io
import json
import os
import shutil
import uuid
import zlib

import numpy as np

from .. import _validate, jpeg
from ..errors import ConfigError, DecodeError, DpuPipeError
from ..sources import PackedSource, open_path
from . import format as fmt
from .reader import PackedShard, manifest_path

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
    try:
        value = float(num)
    except ValueError:
        value = None
    if value is None or unit not in _UNITS or not value > 0 or value != value:
        raise ConfigError(f"not a size: {text!r} (expected e.g. 1GiB, 500MB, 4096)")
    return int(value * _UNITS[unit])


def _transcoder(restart_interval):
    """The per-record JPEG transform of ``pack(transcode=True)``: bytes -> bytes, or None
    when the file stays as it is; DecodeError when libjpeg cannot read it."""
    transcode = getattr(jpeg, "transcode", None)
    if transcode is None:
        raise ConfigError("this dpu_pipe has no JPEG transcoder (dpu_pipe.jpeg.transcode); "
                          "pack with transcode=False (--no-transcode)")
    if restart_interval != "row":
        if isinstance(restart_interval, bool) or not isinstance(
                restart_interval, (int, np.integer)) or not 1 <= restart_interval <= 65535:
            raise ConfigError(f"restart_interval must be a number of MCUs (1 to 65535) or "
                              f"'row', got {restart_interval!r}")
        restart_interval = int(restart_interval)
    unsupported = jpeg.TranscodeUnsupported

    def apply(data):
        try:
            return transcode(data, restart_interval=restart_interval, optimize=True)
        except unsupported:  # readable, but rewriting it would change what decoders see
            return None
    return apply


#: JPEG quality of the records ``max_side`` re-encodes (FFCV's default for its JPEGs too).
RESIZE_QUALITY = 90


def _downscaler(max_side):
    """The per-record transform of ``pack(max_side=N)``: (JPEG bytes, width, height) -> JPEG
    bytes whose longer side is N, or None when the image already fits. Pillow does it: an
    antialiased Lanczos resize (its filter support widens with the reduction, as the
    project's own resize kernel's does) and a JPEG encoder, which the decoding kernels do not
    have and do not need; packing is not a hot path."""
    if max_side is None:
        return None
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
        if pad:
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
        ends = recs["path_end"].astype(np.int64)
        lo = 0
        for k in range(len(blocks)):
            block = recs[k * b:(k + 1) * b]
            hi = int(ends[min((k + 1) * b, self.count) - 1])
            blocks[k] = fmt.block_crc(block.tobytes(), bytes(self.paths[lo:hi]))
            lo = hi
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

    def abort(self):
        if not self.f.closed:
            self.f.close()


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
    try:  # not every file system allows fsync on a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _progress_bar(progress, total, desc):
    if progress is False:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        if progress:
            raise ConfigError("progress bars need tqdm: pip install tqdm "
                              "(or dpu_pipe[tools]), or pass progress=False") from None
        return None
    return tqdm(total=total, desc=desc, unit="img", unit_scale=True, dynamic_ncols=True,
                disable=None if progress is None else False)


def pack(source, out, *, shard_size=DEFAULT_SHARD_SIZE, transcode=True, restart_interval=1,
         threads=None, progress=None, verify=True, alignment=fmt.DEFAULT_ALIGNMENT,
         block_records=fmt.DEFAULT_BLOCK_RECORDS, max_side=None):
    """Write every record of ``source`` into the packed dataset directory ``out``.

    ``source`` is any source (built in or following the protocol of
    :mod:`dpu_pipe.sources.base`: ``len``, ``read``, integer ``labels``; ``relpath``,
    ``classes`` and ``spec`` when it has them) or a path that
    :func:`dpu_pipe.sources.open_path` accepts (ImageFolder, file list, tar shards, Parquet or
    Arrow files). Records keep the source's order, labels, relative paths (the index for a
    source without them) and class names. Shards hold
    consecutive records and grow to about ``shard_size`` bytes (an int, or a string such as
    ``"1GiB"``; a record larger than that gets a shard of its own).

    Each record's header is read: a JPEG whose header libjpeg cannot read, or bytes of no known
    image format, are stored as they are and flagged unreadable (a loader reports them as it
    would the original file); other formats (PNG, GIF, WebP, BMP, TIFF) are stored as they are
    with their format recorded. With ``transcode`` each readable JPEG is rewritten losslessly by
    :func:`dpu_pipe.jpeg.transcode` (``restart_interval`` MCUs, optimized Huffman tables) —
    same decoded pixels, restart markers a region decode can enter at; a file it does not take
    stays as it is.

    ``max_side`` (pixels, default None: off) downscales, before transcoding, every readable
    JPEG whose longer side exceeds it so that its longer side is ``max_side`` (aspect ratio
    kept to within rounding): a lossy pack-time resize, as FFCV's ``max_resolution``, with
    Pillow (antialiased Lanczos, re-encoded at quality :data:`RESIZE_QUALITY` with the
    source's chroma subsampling; needs Pillow). Such records are flagged ``RESIZED`` and the
    manifest records the setting; other formats, and JPEGs that fit, are not touched.
    ``threads`` (default: the CPUs this process may run on) read and
    transcode records in parallel; the output does not depend on their number.

    The dataset is written into a temporary directory next to ``out`` (files and directory
    created with the process's umask), each shard re-read and its CRCs checked when
    ``verify``, and the directory renamed to ``out`` when complete; an existing packed dataset
    at ``out`` is replaced, anything else there is refused. An unreadable source file raises
    the source's :class:`DecodeError` naming it and leaves ``out`` untouched. ``progress``:
    True, False, or None for a tqdm bar only on a terminal. ``alignment`` (bytes, a power of
    two up to 4096) is where each record starts.

    Memory: one shard's index (48 bytes per record plus paths),
    ``threads × 64`` records in
    flight, and the source's label array. Returns the dataset as a
    :class:`~dpu_pipe.sources.PackedSource`.
    """
    from .._version import __version__

    if isinstance(source, (str, os.PathLike)):
        source = open_path(source)
    if not all(hasattr(source, a) for a in ("read", "labels", "__len__")):
        raise ConfigError(f"pack() needs a dpu_pipe source or a dataset path, "
                          f"got {type(source).__name__}")
    labels = np.asarray(source.labels)
    if labels.ndim != 1 or labels.dtype.kind not in "iub":
        raise ConfigError(f"a packed dataset holds one integer label per sample; this source's "
                          f"labels are {labels.dtype} of shape {labels.shape}")
    # A source without names of its own (the protocol makes relpath optional) gets its index.
    relpath = getattr(source, "relpath", str)
    classes = getattr(source, "classes", None)
    shard_size = parse_size(shard_size) if isinstance(shard_size, str) else shard_size
    if isinstance(shard_size, bool) or not isinstance(shard_size, (int, np.integer)) \
            or shard_size < 1:
        raise ConfigError(f"shard_size must be a positive number of bytes, got {shard_size!r}")
    alignment = int(alignment)
    if alignment < 1 or alignment > 4096 or alignment & (alignment - 1):
        raise ConfigError(f"alignment must be a power of two between 1 and 4096 bytes, "
                          f"got {alignment}")
    if not 1 <= int(block_records) <= 2**20:
        raise ConfigError(f"block_records must be in [1, 2**20], got {block_records!r}")
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise ConfigError(f"threads must be a positive integer, got {threads!r}")
    if not isinstance(transcode, bool):
        raise ConfigError(f"transcode must be True or False, got {transcode!r}")
    transform = _transcoder(restart_interval) if transcode else None
    downscale = _downscaler(max_side)
    count = len(source)
    if count == 0:
        raise ConfigError(f"nothing to pack: the source has no records ({source!r})")
    out = os.path.abspath(os.fspath(out))
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise ConfigError(f"output directory does not exist: {parent}")
    if os.path.lexists(out) and manifest_path(out) is None:
        raise ConfigError(f"refusing to replace {out}: it exists and is not a packed dataset")
    labels = np.ascontiguousarray(source.labels, dtype="<i8")

    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{uuid.uuid4().hex[:12]}")
    os.mkdir(tmp)  # mode 0o777 minus the umask, as any directory the user creates
    bar = _progress_bar(progress, count, f"packing {os.path.basename(out)}")
    pool = concurrent.futures.ThreadPoolExecutor(int(threads)) if threads > 1 else None
    writer = None
    try:
        table, formats = [], np.zeros(len(fmt.FORMATS), dtype=np.int64)
        resized = 0
        unreadable = []

        def prepared(i):
            data = source.read(i)
            return (len(data),) + _prepare(data, transform, downscale)

        def chunks():
            step = 64 * int(threads)
            for lo in range(0, count, step):
                idx = range(lo, min(lo + step, count))
                yield idx, (pool.map(prepared, idx) if pool else map(prepared, idx))

        def close_shard():
            entry, recs = writer.finish()
            if verify:
                _verify_shard(writer.path, len(table), recs, labels[writer.first:
                                                                     writer.first + writer.count])
            table.append(entry)

        for idx, results in chunks():
            for i, (orig_length, data, flags, code) in zip(idx, results):
                rel = relpath(i).encode("utf-8", "surrogateescape")
                if writer is not None and writer.count and \
                        writer.size_with(len(data), len(rel)) > shard_size:
                    close_shard()
                    writer = None
                if writer is None:
                    writer = _ShardWriter(os.path.join(tmp, fmt.shard_name(len(table))),
                                          len(table), i, alignment, int(block_records))
                writer.add(data, labels[i], orig_length, flags, code, rel)
                formats[code] += 1
                resized += bool(flags & fmt.RESIZED)
                if flags & fmt.UNREADABLE:
                    unreadable.append(relpath(i))
                if bar is not None:
                    bar.update(1)
        close_shard()
        writer = None
        if bar is not None:
            bar.close()
            bar = None

        table = np.array(table, dtype=fmt.SHARD_ENTRY)
        spec = source.spec() if hasattr(source, "spec") else {"type": type(source).__name__}
        if not isinstance(spec.get("args", {}).get("path_or_rows", ""), str):
            del spec["args"]["path_or_rows"]   # a row-based file list's: every path again
        meta = {
            "classes": classes,
            "created_by": f"dpu_pipe {__version__}",
            "source": spec,
            "shard_size": int(shard_size),
            "transcode": ({"restart_interval": restart_interval if restart_interval == "row"
                           else int(restart_interval), "optimize": True}
                          if transcode else None),
            "formats": {name: int(n) for name, n in zip(fmt.FORMATS, formats) if n},
            "unreadable": len(unreadable),
            "unreadable_examples": unreadable[:20],
            "label_range": [int(labels.min()), int(labels.max())],
            "num_labels": int(len(np.unique(labels))),
            "data_bytes": int(table["data_bytes"].sum()),
            "orig_bytes": int(table["orig_bytes"].sum()),
            "max_side": ({"max_side": downscale.max_side, "resized": resized,
                          "quality": RESIZE_QUALITY, "resampler": "Pillow LANCZOS"}
                         if downscale is not None else None),
        }
        _write_manifest(os.path.join(tmp, fmt.MANIFEST_NAME), labels, table,
                        json.dumps(meta, sort_keys=True).encode("utf-8"))
        _fsync_dir(tmp)
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
    except BaseException:
        if writer is not None:
            writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        if bar is not None:
            bar.close()
    return PackedSource(out)


def _verify_shard(path, number, recs, labels):
    """Re-read a written shard: structure, every record against the CRC of the bytes that
    were written, labels against the source's."""
    try:
        sh = PackedShard(path)
        try:
            bad = sh.find_corrupt()
            same = (np.array_equal(sh.records["crc32"], recs["crc32"])
                    and np.array_equal(sh.records["label"], labels))
        finally:
            sh.close()
    except ConfigError as e:
        raise DpuPipeError(f"verification of written shard {number} failed: {e}") from e
    if len(bad) or not same:
        what = (f"{len(bad)} records differ from what was written (first: record "
                f"{int(bad[0])} of the shard)" if len(bad)
                else "its index differs from what was written")
        raise DpuPipeError(f"verification of written shard {number} ({path}) failed: {what}")
