"""The packed dataset format, version 4: every on-disk structure, and the checks that parse it.

A packed dataset is a directory::

    OUT/manifest.dpk         the manifest: counts, the shard table, every label, class names
    OUT/shard-000000.dpks    shard 0: records 0 .. n0-1
    OUT/shard-000001.dpks    shard 1: records n0 .. n0+n1-1
    ...

Every structure is a numpy structured dtype with explicit little-endian widths, shared by the
writer and the reader, so x86-64 and aarch64 read the same files. CRCs are ``zlib.crc32``; each
structure's CRC is held by the one above it (manifest header → shard table → shard header →
block CRC table → index block and its paths → record bytes), so a reader validates exactly the
part it is about to use, and a shard alone (without its manifest) is still fully verifiable.

Manifest (``manifest.dpk``)::

    offset           size               part
    0                128                MANIFEST_HEADER
    shards_offset    64 × num_shards    SHARD_ENTRY table
    labels_offset    8 × count          labels, <i8, record order (8-aligned)
    meta_offset      meta_size          UTF-8 JSON object (see below)
    file_size                           end of file: nothing may follow

Shard (``shard-NNNNNN.dpks``)::

    0                128                SHARD_HEADER
    data_offset      data_size          record bytes, each at a multiple of ``alignment``
    index_offset     48 × count         RECORD entries, one per record, in record order
    blocks_offset    4 × nblocks        CRC of each index block (see below)
    paths_offset     paths_size         UTF-8 relative paths, concatenated
    file_size                           end of file

An index block is ``block_records`` consecutive RECORD entries (the last block may be
shorter); its CRC covers the entries' bytes followed by the bytes of their paths (record j's
path is ``paths[path_end[j-1]:path_end[j]]``, ``path_end[-1]`` taken as 0). A reader loads
and checks one block when it first needs a record of it, so opening a dataset of a billion
records reads its manifest header and shard table only.

Records are the samples' encoded bytes, as the source held them unless a flag (see
:data:`TRANSCODED`) says otherwise; ``format`` names what their first bytes say.

The manifest's JSON object: ``classes`` (list of str or null), ``formats`` ({name: record
count}), ``unreadable`` (record count), ``data_bytes`` and ``orig_bytes`` (sums of the record
sizes as stored and as read from the source), ``label_range`` ([min, max]) and ``num_labels``
(distinct labels), all required; ``created_by``, ``source`` (the spec of the packed source),
``shard_size`` (the target in bytes), ``transcode`` (null, or ``{"restart_interval",
"optimize"}``), ``unreadable_examples`` (up to 20 paths) and ``max_side`` (null, or
``{"max_side", "resized", "quality", "resampler"}``).

Versions (history: docs/design/packed-format.md): this module writes 4 and reads 2, 3 and 4.
Version 2 is version 4 without ``RESIZED`` records. Version 3 shards end with a restart-interval
index after the paths (at ``intervals_offset``, 8-aligned, ``intervals_size`` bytes: a ``<u8``
end of each record's entry × count, then each record's restart-interval offsets as LEB128
varints); their block CRCs cover, after the paths, the block's interval ends and its entries'
bytes. The index is bounds- and CRC-checked and otherwise ignored. In versions 2 and 4
``intervals_offset`` and ``intervals_size`` are zero and the paths end the file.

The functions here are pure (bytes or arrays in, values or :class:`ConfigError` out) so that a
fuzz harness can drive them: :func:`parse_manifest` and :func:`parse_shard` validate a whole
file's bytes, all but the record CRCs.
"""

import json
import zlib

import numpy as np

from ..errors import ConfigError

__all__ = [
    "VERSION", "MAGIC", "SHARD_MAGIC", "HEADER_SIZE", "MANIFEST_NAME", "DEFAULT_ALIGNMENT",
    "DEFAULT_BLOCK_RECORDS", "MANIFEST_HEADER", "SHARD_HEADER", "SHARD_ENTRY", "RECORD",
    "TRANSCODED", "UNREADABLE", "RESIZED", "FORMATS", "shard_name", "detect_format",
    "encode_header", "parse_manifest_header", "parse_shard_header", "check_shard_table",
    "shard_parts", "check_block", "block_crc", "parse_meta", "parse_manifest", "parse_shard",
]

VERSION = 4
READ_VERSIONS = (2, 3, 4)
#: The version whose shards end with a restart-interval index.
_INTERVALS_VERSION = 3
MAGIC = b"DPUPACK\0"
SHARD_MAGIC = b"DPUSHRD\0"
HEADER_SIZE = 128
MANIFEST_NAME = "manifest.dpk"
DEFAULT_ALIGNMENT = 64
DEFAULT_BLOCK_RECORDS = 256

# Offsets and sizes, annotated: bytes from the start of the file.
MANIFEST_HEADER = np.dtype([
    ("magic", "S8"),
    ("version", "<u4"),
    ("header_size", "<u4"),
    ("count", "<u8"),            # records in the dataset
    ("num_shards", "<u8"),
    ("shards_offset", "<u8"),
    ("labels_offset", "<u8"),
    ("meta_offset", "<u8"),
    ("meta_size", "<u8"),
    ("file_size", "<u8"),
    ("shards_crc32", "<u4"),     # of the SHARD_ENTRY table
    ("meta_crc32", "<u4"),       # of the JSON object
    ("reserved", "V44"),
    ("header_crc32", "<u4"),     # of bytes 0..123
])

SHARD_ENTRY = np.dtype([
    ("first", "<u8"),            # dataset index of the shard's first record
    ("count", "<u8"),
    ("file_size", "<u8"),
    ("data_bytes", "<u8"),       # sum of the record lengths as stored
    ("orig_bytes", "<u8"),       # sum of the record lengths as read from the source
    ("transcoded", "<u8"),       # records with the TRANSCODED flag
    ("header_crc32", "<u4"),     # the shard header's own CRC: binds the file to the manifest
    ("reserved", "V12"),
])

SHARD_HEADER = np.dtype([
    ("magic", "S8"),
    ("version", "<u4"),
    ("header_size", "<u4"),
    ("shard", "<u8"),            # this shard's number
    ("first", "<u8"),            # dataset index of record 0 of this shard
    ("count", "<u8"),
    ("data_offset", "<u8"),
    ("data_size", "<u8"),
    ("index_offset", "<u8"),
    ("blocks_offset", "<u8"),
    ("paths_offset", "<u8"),
    ("paths_size", "<u8"),
    ("file_size", "<u8"),
    ("block_records", "<u4"),
    ("alignment", "<u4"),
    ("blocks_crc32", "<u4"),     # of the block CRC table
    ("intervals_offset", "<u8"), # version 3 (0 in versions 2 and 4)
    ("intervals_size", "<u8"),
    ("header_crc32", "<u4"),     # of bytes 0..123
])

RECORD = np.dtype([
    ("offset", "<u8"),           # from the start of the shard file
    ("length", "<u8"),
    ("label", "<i8"),
    ("orig_length", "<u8"),      # bytes the source held (== length unless flags say otherwise)
    ("path_end", "<u8"),         # end of this record's path in the shard's path blob
    ("crc32", "<u4"),            # of the record bytes as stored
    ("flags", "u1"),
    ("format", "u1"),
    ("reserved", "V2"),
])

for _dt, _size in ((MANIFEST_HEADER, HEADER_SIZE), (SHARD_HEADER, HEADER_SIZE),
                   (SHARD_ENTRY, 64), (RECORD, 48)):
    assert _dt.itemsize == _size, (_dt, _size)

#: RECORD flags.
TRANSCODED = 1       # a JPEG rewritten losslessly to baseline with restart markers
UNREADABLE = 2       # its decoder could not read its header when packed (its bytes are kept)
RESIZED = 4          # versions 3 and 4: a JPEG that ``max_side`` downscaled and re-encoded
_KNOWN_FLAGS = TRANSCODED | UNREADABLE | RESIZED

#: RECORD format codes, by what a record's first bytes say.
FORMATS = ("unknown", "jpeg", "png", "gif", "webp", "bmp", "tiff")
_SIGNATURES = ((b"\xff\xd8\xff", 1), (b"\x89PNG\r\n\x1a\n", 2), (b"GIF87a", 3), (b"GIF89a", 3),
               (b"BM", 5), (b"II*\0", 6), (b"MM\0*", 6))


def shard_name(k):
    """File name of shard ``k`` inside a packed dataset's directory."""
    return f"shard-{k:06d}.dpks"


def detect_format(data):
    """Format code (index into :data:`FORMATS`) of encoded image bytes, from their signature."""
    head = bytes(data[:16])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return 4
    for sig, code in _SIGNATURES:
        if head.startswith(sig):
            return code
    return 0


def _pad(n, align):
    return -n % align


def encode_header(dtype, **fields):
    """128 header bytes of ``dtype`` with ``fields`` set, magic/version/size filled in and
    the trailing CRC computed."""
    h = np.zeros((), dtype=dtype)
    h["magic"] = SHARD_MAGIC if dtype is SHARD_HEADER else MAGIC
    h["version"] = VERSION
    h["header_size"] = HEADER_SIZE
    for k, v in fields.items():
        h[k] = v
    raw = bytearray(h.tobytes())
    raw[HEADER_SIZE - 4:] = zlib.crc32(raw[:HEADER_SIZE - 4]).to_bytes(4, "little")
    return bytes(raw)


def _check_version(version, where):
    if version in READ_VERSIONS:
        return
    versions = f"{', '.join(map(str, READ_VERSIONS[:-1]))} and {READ_VERSIONS[-1]}"
    if version == 1:
        raise ConfigError(f"{where}: packed format version 1 (a single-file packed dataset of "
                          f"dpu_pipe 0.1) is not supported; this dpu_pipe reads versions "
                          f"{versions}: pack the original images again with `dpu-pipe pack`")
    newer = " (written by a newer dpu_pipe; upgrade to read it)" if version > VERSION else ""
    raise ConfigError(f"{where}: packed format version {version} is not supported, this "
                      f"dpu_pipe reads versions {versions}{newer}")


def _parse_header(raw, dtype, magic, file_size, where):
    raw = bytes(raw[:HEADER_SIZE])
    if raw[:8] not in (MAGIC, SHARD_MAGIC):
        raise ConfigError(f"{where} is not a dpu_pipe packed dataset (it does not start with "
                          f"{MAGIC!r} or {SHARD_MAGIC!r}); make one with `dpu-pipe pack SRC OUT`")
    if len(raw) < 16:
        raise ConfigError(f"{where} is truncated: {len(raw)} bytes")
    if raw[:8] != magic:
        if raw[:8] == SHARD_MAGIC:
            raise ConfigError(f"{where} is a shard of a packed dataset, not a manifest; open "
                              f"the dataset's directory")
        raise ConfigError(f"{where} is a manifest of a packed dataset, not a shard")
    _check_version(int.from_bytes(raw[8:12], "little"), where)
    if len(raw) < HEADER_SIZE:
        raise ConfigError(f"{where} is truncated: {len(raw)} bytes, shorter than its "
                          f"{HEADER_SIZE}-byte header")
    h = np.frombuffer(raw, dtype=dtype, count=1)[0]
    if zlib.crc32(raw[:HEADER_SIZE - 4]) != int(h["header_crc32"]):
        raise ConfigError(f"{where}: header corrupted (CRC mismatch)")
    fields = {n: int(h[n]) for n in dtype.names if n not in ("magic", "reserved")}
    if fields["header_size"] != HEADER_SIZE:
        raise ConfigError(f"{where}: header size {fields['header_size']} != {HEADER_SIZE}")
    if file_size != fields["file_size"]:
        how = "truncated" if file_size < fields["file_size"] else "followed by unexpected bytes"
        raise ConfigError(f"{where} is {how}: its header describes {fields['file_size']} "
                          f"bytes, the file has {file_size}")
    return fields


def _inside(lo, size, hi):
    """lo .. lo+size lies within [HEADER_SIZE, hi] (Python ints: no overflow)."""
    return HEADER_SIZE <= lo and lo + size <= hi


def parse_manifest_header(raw, file_size, where):
    """Validate a manifest's header bytes against the manifest's size; a dict of ints."""
    h = _parse_header(raw, MANIFEST_HEADER, MAGIC, file_size, where)
    n, s = h["count"], h["num_shards"]
    if (n > 2**48 or s > 2**32 or s > max(n, 1)
            or h["shards_offset"] % 8 or h["labels_offset"] % 8
            or not _inside(h["shards_offset"], SHARD_ENTRY.itemsize * s, h["labels_offset"])
            or not _inside(h["labels_offset"], 8 * n, h["meta_offset"])
            or not _inside(h["meta_offset"], h["meta_size"], file_size)
            or h["meta_offset"] + h["meta_size"] != file_size):
        raise ConfigError(f"{where}: inconsistent part sizes in the manifest header")
    if n and not s:
        raise ConfigError(f"{where}: {n} records but no shards")
    return h


def check_shard_table(table, count, where):
    """Shard entries tile ``[0, count)`` in order, each non-empty, with sane sizes."""
    if len(table) == 0:
        return
    first = table["first"].astype(np.uint64)
    n = table["count"].astype(np.uint64)
    if first[0] != 0 or np.any(n == 0) or np.any(n > 2**48):
        raise ConfigError(f"{where}: invalid shard table (a shard is empty or the first "
                          f"does not start at record 0)")
    ends = first + n
    gaps = np.flatnonzero(first[1:] != ends[:-1])
    if len(gaps):
        raise ConfigError(f"{where}: shard table has a gap or overlap at shard {gaps[0] + 1}")
    if int(ends[-1]) != count:
        raise ConfigError(f"{where}: the shards hold {int(ends[-1])} records, the manifest "
                          f"describes {count}")
    if np.any(table["file_size"].astype(np.uint64) < HEADER_SIZE):
        raise ConfigError(f"{where}: a shard's file size in the shard table is too small")


def parse_shard_header(raw, file_size, where):
    """Validate a shard's header bytes against the shard's size; a dict of ints."""
    h = _parse_header(raw, SHARD_HEADER, SHARD_MAGIC, file_size, where)
    n, b, a = h["count"], h["block_records"], h["alignment"]
    if a < 1 or a > 4096 or a & (a - 1):
        raise ConfigError(f"{where}: invalid record alignment {a} in the shard header")
    if n == 0 or n > 2**48 or b < 1:
        raise ConfigError(f"{where}: invalid record count {n} or block size {b}")
    nblocks = -(-n // b)
    io, isz = h["intervals_offset"], h["intervals_size"]
    if h["version"] == _INTERVALS_VERSION:
        paths_end = io - _pad(h["paths_offset"] + h["paths_size"], 8)
        intervals_ok = io % 8 == 0 and isz >= 8 * n and io + isz == file_size
    else:
        paths_end, intervals_ok = file_size, io == 0 and isz == 0
    if (h["index_offset"] % 8
            or not _inside(h["data_offset"], h["data_size"], h["index_offset"])
            or not _inside(h["index_offset"], RECORD.itemsize * n, h["blocks_offset"])
            or not _inside(h["blocks_offset"], 4 * nblocks, h["paths_offset"])
            or h["blocks_offset"] + 4 * nblocks != h["paths_offset"]
            or h["paths_offset"] + h["paths_size"] != paths_end
            or not intervals_ok):
        raise ConfigError(f"{where}: inconsistent part sizes in the shard header")
    h["nblocks"] = nblocks
    return h


def block_crc(entries_bytes, paths_bytes, intervals=()):
    """CRC of an index block's RECORD entries, paths and (version 3 only) ``intervals``: the
    bytes of the block's interval index ends and of their entries."""
    crc = zlib.crc32(paths_bytes, zlib.crc32(entries_bytes))
    for part in intervals:
        crc = zlib.crc32(part, crc)
    return crc


def shard_parts(buf, h, where):
    """``(records RECORD[count], block CRCs <u4[nblocks], paths, intervals)`` of the shard
    file in ``buf`` with parsed header ``h``, the block CRC table checked. ``intervals`` is
    ``(ends <u8[count], entries)`` of a version-3 shard's interval index, else None."""
    blocks = np.frombuffer(buf, "<u4", count=h["nblocks"], offset=h["blocks_offset"])
    if zlib.crc32(blocks) != h["blocks_crc32"]:
        raise ConfigError(f"{where}: block CRC table corrupted (CRC mismatch)")
    records = np.frombuffer(buf, RECORD, count=h["count"], offset=h["index_offset"])
    paths = memoryview(buf)[h["paths_offset"]:h["paths_offset"] + h["paths_size"]]
    intervals = None
    if h["version"] == _INTERVALS_VERSION:
        n, io = h["count"], h["intervals_offset"]
        intervals = (np.frombuffer(buf, "<u8", count=n, offset=io),
                     memoryview(buf)[io + 8 * n:io + h["intervals_size"]])
    return records, blocks, paths, intervals


def check_block(h, parts, k, where):
    """Check index block ``k`` of a shard (header ``h``, :func:`shard_parts` ``parts``): its
    records lie in the record area with known flags and format and path ends that grow within
    the path blob (a version-3 interval index's ends likewise), and its CRC matches. Returns
    the block's RECORD entries; ConfigError names the first record that fails."""
    records, blocks, paths, intervals = parts
    first = k * h["block_records"]
    block = records[first:first + h["block_records"]]
    path_lo = int(records["path_end"][first - 1]) if k else 0
    data_lo, data_hi = h["data_offset"], h["data_offset"] + h["data_size"]
    off = block["offset"].astype(np.uint64)
    ln = block["length"].astype(np.uint64)
    pe = block["path_end"].astype(np.uint64)
    prev = np.concatenate(([np.uint64(path_lo)], pe[:-1]))
    lo, span = np.uint64(data_lo), np.uint64(h["data_size"])
    # offset + length <= hi written without a sum that could wrap: where a term below
    # wraps, an earlier term of the same row is already true.
    bad = np.flatnonzero((off < lo) | (ln > span) | (off - lo > span - ln)
                         | (pe < prev) | (pe > np.uint64(h["paths_size"]))
                         | ((block["flags"] & ~np.uint8(_KNOWN_FLAGS)) != 0)
                         | (block["format"] >= len(FORMATS)))
    if len(bad):
        j = int(bad[0])
        raise ConfigError(
            f"{where}: index entry of record {first + j} is invalid (offset {int(off[j])}, "
            f"length {int(ln[j])}, path end {int(pe[j])}, flags {int(block['flags'][j])}, "
            f"format {int(block['format'][j])}; record area {data_lo}..{data_hi}, "
            f"{h['paths_size']} path bytes)")
    crc_parts = ()
    if intervals is not None:
        ends, entries = intervals
        ilo = int(ends[first - 1]) if first else 0
        iends = ends[first:first + len(block)].astype(np.uint64)
        iprev = np.concatenate(([np.uint64(ilo)], iends[:-1]))
        bad = np.flatnonzero((iends < iprev) | (iends > np.uint64(len(entries))))
        if len(bad):
            j = int(bad[0])
            raise ConfigError(f"{where}: interval index entry of record {first + j} is invalid "
                              f"(end {int(iends[j])}, previous end {int(iprev[j])}, "
                              f"{len(entries)} entry bytes)")
        crc_parts = (iends.tobytes(), entries[ilo:int(iends[-1])])
    if block_crc(block, paths[path_lo:int(pe[-1])], crc_parts) != int(blocks[k]):
        raise ConfigError(f"{where}: index block {k} (records {first}.."
                          f"{first + len(block) - 1}) corrupted (CRC mismatch)")
    return block


def parse_meta(raw, crc, where):
    """The manifest's JSON object, CRC-checked."""
    if zlib.crc32(raw) != crc:
        raise ConfigError(f"{where}: metadata corrupted (CRC mismatch)")
    try:
        meta = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(f"{where}: unreadable metadata: {e}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{where}: metadata is not a JSON object")
    classes = meta.get("classes")
    if classes is not None and not (isinstance(classes, list)
                                    and all(isinstance(c, str) for c in classes)):
        raise ConfigError(f"{where}: metadata 'classes' is not a list of names")
    for key, ok in _META_REQUIRED.items():
        if key not in meta or not ok(meta[key]):
            raise ConfigError(f"{where}: metadata lacks a valid {key!r}")
    return meta


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


_META_REQUIRED = {
    "data_bytes": _is_int,
    "orig_bytes": _is_int,
    "unreadable": _is_int,
    "num_labels": _is_int,
    "label_range": lambda v: isinstance(v, list) and len(v) == 2 and all(map(_is_int, v)),
    "formats": lambda v: isinstance(v, dict) and all(_is_int(n) for n in v.values()),
}


def parse_manifest(buf, where="manifest"):
    """Parse and validate a whole manifest held in ``buf`` (bytes-like).

    Returns ``(header dict, shard table SHARD_ENTRY[num_shards], labels <i8[count], meta
    dict)``; arrays are views of ``buf``. Raises :class:`ConfigError` naming what is wrong.
    """
    buf = memoryview(buf).cast("B")
    h = parse_manifest_header(buf[:HEADER_SIZE], len(buf), where)
    table = np.frombuffer(buf, SHARD_ENTRY, count=h["num_shards"], offset=h["shards_offset"])
    if zlib.crc32(table) != h["shards_crc32"]:
        raise ConfigError(f"{where}: shard table corrupted (CRC mismatch)")
    check_shard_table(table, h["count"], where)
    labels = np.frombuffer(buf, "<i8", count=h["count"], offset=h["labels_offset"])
    meta = parse_meta(buf[h["meta_offset"]:h["meta_offset"] + h["meta_size"]],
                      h["meta_crc32"], where)
    return h, table, labels, meta


def parse_shard(buf, where="shard"):
    """Parse and validate a whole shard held in ``buf`` (bytes-like): header, block CRC
    table, every index block and its paths, not the record bytes' CRCs.

    Returns ``(header dict, records RECORD[count], paths bytes)``, ``records`` a view of
    ``buf``. Raises :class:`ConfigError` naming the block or record that is wrong.
    """
    buf = memoryview(buf).cast("B")
    h = parse_shard_header(buf[:HEADER_SIZE], len(buf), where)
    parts = shard_parts(buf, h, where)
    for k in range(h["nblocks"]):
        check_block(h, parts, k, where)
    records, _, paths, _ = parts
    used = int(records["path_end"][-1])
    if used != h["paths_size"]:
        raise ConfigError(f"{where}: the path blob has {h['paths_size']} bytes, the index "
                          f"uses {used}")
    return h, records, bytes(paths)
