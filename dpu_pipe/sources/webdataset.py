"""WebDataset tar shards with random access: :class:`WebDataset`.

Consecutive members of an uncompressed tar file with the same key (the member path up to the
first ``.`` of its file name) form a sample, as the webdataset library groups them. A
per-shard member index, built by one scan of the tar headers and cached as a small ``.npz``
file (docs/guides/datasets.md: "The member index and its cache"), gives random access into a
read-only memory map of the shard.
"""

import collections
import hashlib
import itertools
import json
import mmap
import os
import re
import threading
import uuid
import zipfile

import numpy as np

from .. import _jpeg
from .. import _validate as _v
from ..errors import ConfigError, DecodeError
from .base import _PartedSource, buffers_by_record, frozen_labels

__all__ = ["WebDataset", "expand_shards", "INDEX_VERSION", "SAMPLE"]

#: Version of the cached index layout; a cache of another version is rebuilt.
INDEX_VERSION = 1

#: One sample of a shard index: where its image member's data lies in the tar file, its label,
#: its key (a slice of the shard's key blob), which of ``image_keys`` it is, and its flags.
SAMPLE = np.dtype([("offset", "<i8"), ("size", "<i8"), ("label", "<i8"), ("key_off", "<i8"),
                   ("key_len", "<i4"), ("ext", "<i2"), ("flags", "<u2")])
TRUNCATED = 1     # the image member's data runs past the end of the file
NO_LABEL = 2      # no label member, or it holds no integer (the reason is in ``problems``)
NO_IMAGE = 4      # the sample has no member with one of ``image_keys``
_FLAG_TEXT = {TRUNCATED: "truncated tar member: its data runs past the end of the shard",
              NO_IMAGE: "sample has no image member"}

BLOCK = 512   # tar's block size

_BRACE = re.compile(r"\{([^{}]*)\}")


def expand_shards(pattern):
    """Shard paths of a brace pattern, in order: ``train-{0000..0003}.tar`` gives
    ``train-0000.tar`` ... ``train-0003.tar`` (the width of the first bound is kept),
    ``{a,b}`` alternatives; several braces expand left to right (the last varies fastest)."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    body = m.group(1)
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        lo, hi = rng.group(1), rng.group(2)
        if int(hi) < int(lo):
            raise ConfigError(f"shard pattern {pattern!r}: range {{{body}}} runs backwards")
        if int(hi) - int(lo) >= 10**8:
            raise ConfigError(f"shard pattern {pattern!r}: range {{{body}}} is too large")
        width = len(lo) if lo.startswith("0") else 0
        items = [str(k).zfill(width) for k in range(int(lo), int(hi) + 1)]
    elif "," in body:
        items = body.split(",")
    else:
        raise ConfigError(f"shard pattern {pattern!r}: {{{body}}} is neither a range "
                          f"{{lo..hi}} nor alternatives {{a,b}}")
    head, tail = pattern[:m.start()], pattern[m.end():]
    return [p for item in items for p in expand_shards(head + item + tail)]


def _split_key(name):
    """``(key, extension)`` of a member name: the extension starts at the first dot of the
    file name (``a/b.seg.png`` → ``("a/b", "seg.png")``)."""
    folder, slash, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return folder + slash + stem, ext


def _index_paths(shard):
    """Where the index of ``shard`` is cached: beside it, then in the user's cache."""
    folder, name = os.path.split(shard)
    digest = hashlib.sha256(shard.encode("utf-8", "surrogateescape")).hexdigest()[:24]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [os.path.join(folder, f".{name}.dpu-index.npz"),
            os.path.join(cache, "dpu_pipe", "wds-index", f"{digest}-{name}.npz")]


def _writable(directory):
    return os.access(directory, os.W_OK)


class _ShardIndex(collections.namedtuple("_ShardIndex", "samples keys problems")):
    """One shard's SAMPLE records, key blob (uint8) and ``{position: why}`` of NO_LABEL ones."""

    def key(self, j):
        r = self.samples[j]
        o = int(r["key_off"])
        return self.keys[o:o + int(r["key_len"])].tobytes().decode("utf-8", "surrogateescape")


def _parse_label(text, where):
    try:
        value = int(text.strip(), 10)
    except ValueError:
        return None, f"label {text.strip()[:40]!r} in {where} is not an integer"
    if not -2**63 <= value < 2**63:
        return None, f"label {value} in {where} does not fit in int64"
    return value, None


def _label_of(members, label_key, read, key):
    """``(label, None)`` or ``(None, why not)`` of a sample's members ``{ext: (offset, size)}``."""
    if label_key is None:
        return 0, None
    ext, _, field = label_key.partition(":")
    if ext not in members:
        return None, f"missing label: no member {key}.{ext}"
    data = read(*members[ext])
    if data is None:
        return None, f"label member {key}.{ext} is truncated"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, f"label member {key}.{ext} is not UTF-8 text"
    if not field:
        return _parse_label(text, f"{key}.{ext}")
    try:
        obj = json.loads(text)
    except ValueError as e:
        return None, f"label member {key}.{ext} is not JSON: {e}"
    value = obj.get(field) if isinstance(obj, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None, f"label member {key}.{ext} has no integer {field!r}"
    return _parse_label(str(value), f"{key}.{ext}[{field!r}]")


def _octal(field):
    """The number in a tar header's numeric field: octal text, or base-256 (high bit set)
    as GNU tar writes large sizes; None when it is neither."""
    if field[:1] and field[0] & 0x80:
        if field[0] == 0xFF:     # a negative base-256 number
            return None
        return int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        return None


def _pax(data, where):
    """``{key: value}`` of a pax extended header's ``"<len> <key>=<value>\n"`` records."""
    out, i = {}, 0
    while i < len(data):
        sp = data.find(b" ", i, i + 24)
        try:
            length = int(data[i:sp]) if sp > i else 0
        except ValueError:
            length = 0
        rec = data[i:i + length]
        if length <= sp - i or len(rec) != length or not rec.endswith(b"\n") \
                or b"=" not in rec[sp - i:]:
            if not data[i:].strip(b"\0"):
                break     # padding after the last record
            raise ConfigError(f"{where}: malformed pax record at byte {i} of the header")
        key, _, value = rec[sp - i + 1:-1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value
        i += length
    return out


def _tar_members(buf, size, path):
    """``(name, data offset, data size)`` of every regular member of the tar bytes ``buf``
    (``size`` bytes), in order. GNU long names and pax ``path``/``size`` records apply to
    the next member; a member whose data runs past the end ends the listing. A header that
    is not a tar header raises :class:`ConfigError`: the next member cannot be found."""
    pos, longname, pax = 0, None, {}
    while pos + BLOCK <= size:
        h = buf[pos:pos + BLOCK]
        if not h.strip(b"\0"):
            return    # the end-of-archive marker: zero blocks
        where = f"WebDataset shard {path}: bad tar header at byte {pos}"
        want = _octal(h[148:156])
        rest = h[:148] + h[156:]
        unsigned = sum(rest) + 256         # the checksum field counts as eight spaces
        # Some old tars sum signed bytes.
        if want != unsigned and want != unsigned - 256 * sum(b > 127 for b in rest):
            raise ConfigError(f"{where} (checksum); members from there on cannot be located")
        n = _octal(h[124:136])
        if n is None:
            raise ConfigError(f"{where} (size field {h[124:136]!r})")
        typ = h[156:157]
        name = h[0:100].split(b"\0", 1)[0]
        if h[257:263] == b"ustar\0":
            prefix = h[345:500].split(b"\0", 1)[0]
            if prefix:
                name = prefix + b"/" + name
        data = pos + BLOCK
        if typ in (b"L", b"x", b"g"):
            if data + n > size:
                raise ConfigError(f"{where}: its extended header runs past the end of the file")
            ext = buf[data:data + n]
            if typ == b"L":
                longname = ext.split(b"\0", 1)[0]
            elif typ == b"x":
                pax = _pax(ext, where)
        else:
            if "size" in pax:
                try:
                    n = int(pax["size"])
                except ValueError:
                    n = -1
                if n < 0:
                    raise ConfigError(f"{where}: pax size {pax['size'][:30]!r}")
            if "path" in pax:
                name = pax["path"]
            elif longname is not None:
                name = longname
            if typ in (b"0", b"\0", b"7"):
                yield name.decode("utf-8", "surrogateescape"), data, n
                if data + n > size:
                    return
            longname, pax = None, {}
        pos = data + (n + BLOCK - 1) // BLOCK * BLOCK
    if pos < size and buf[pos:size].strip(b"\0"):
        raise ConfigError(f"WebDataset shard {path}: bad tar header at byte {pos} (a partial "
                          f"block at the end of the file)")


def scan_shard(path, image_keys, label_key):
    """The index of one shard, from its tar headers (and label members) in order.
    :class:`ConfigError` names the shard (and byte offset) when the tar itself is unreadable."""
    rows, keys, problems = [], bytearray(), {}
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read WebDataset shard {path}: {e}") from None
    if size < BLOCK or not buf[:BLOCK].strip(b"\0"):
        raise ConfigError(f"WebDataset shard {path} is not an uncompressed tar file "
                          f"({size} bytes{', no first header' if size >= BLOCK else ''})")
    if buf[:2] == b"\x1f\x8b" or buf[:3] == b"BZh" or buf[:6] == b"\xfd7zXZ\0":
        raise ConfigError(f"WebDataset shard {path} is not an uncompressed tar file: it is "
                          f"compressed; decompress it (random access needs a plain tar)")

    def read(offset, length):
        return None if offset + length > size else buf[offset:offset + length]

    named = ((*_split_key(name), offset, length)
             for name, offset, length in _tar_members(buf, size, path))
    try:
        for key, group in itertools.groupby(named, key=lambda member: member[0]):
            members = {}
            for _, suffix, offset, length in group:
                members.setdefault(suffix.lower(), (offset, length))
            kb = key.encode("utf-8", "surrogateescape")
            ext = next((k for k, name in enumerate(image_keys) if name in members), -1)
            offset, length = members[image_keys[ext]] if ext >= 0 else (0, 0)
            flags = NO_IMAGE if ext < 0 else TRUNCATED if offset + length > size else 0
            label, why = _label_of(members, label_key, read, key)
            if why is not None:
                flags |= NO_LABEL
                problems[len(rows)] = why
                label = -1
            rows.append((offset, length, label, len(keys), len(kb), ext, flags))
            keys.extend(kb)
    finally:
        if size:
            buf.close()
    samples = np.array(rows, dtype=SAMPLE) if rows else np.zeros(0, SAMPLE)
    return _ShardIndex(samples, np.frombuffer(bytes(keys), np.uint8), problems)


def _load_index(path, want, size):
    """The cached index at ``path`` if it matches ``want`` and, checked like any other data,
    fits a shard of ``size`` bytes; else None."""
    try:
        with np.load(path, allow_pickle=False) as z:
            info = json.loads(z["info"].tobytes().decode("utf-8"))
            if info.get("want") != want:
                return None
            samples, keys = z["samples"], z["keys"]
            problems = {int(k): str(v) for k, v in info.get("problems", {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, EOFError, MemoryError,
            SyntaxError, zipfile.BadZipFile):
        return None
    ok = (samples.dtype == SAMPLE and samples.ndim == 1 and keys.dtype == np.uint8
          and keys.ndim == 1)
    if ok and len(samples):
        s = samples
        image = s["flags"] & NO_IMAGE == 0
        ok = bool((s["offset"] >= 0).all() and (s["size"] >= 0).all()
                  and (s["key_off"] >= 0).all() and (s["key_len"] >= 0).all()
                  and (s["key_off"] + s["key_len"] <= len(keys)).all()
                  and (s["ext"][image] < len(want["image_keys"])).all()
                  and ((s["offset"] + s["size"] <= size) | (s["flags"] & TRUNCATED != 0)).all()
                  and all(0 <= k < len(s) for k in problems))
    return _ShardIndex(samples, keys, problems) if ok else None


def _save_index(path, index, want):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    info = json.dumps({"want": want, "problems": {str(k): v for k, v in index.problems.items()}})
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, samples=index.samples, keys=index.keys,
                     info=np.frombuffer(info.encode("utf-8"), np.uint8))
        os.replace(tmp, path)   # readers see the old index or the new one, never half
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def open_index(shard, image_keys, label_key):
    """The index of ``shard``: from its cache when fresh, else scanned (and cached where a
    cache can be written; an unwritable location is not an error)."""
    try:
        st = os.stat(shard)
    except OSError as e:
        raise ConfigError(f"cannot open WebDataset shard: {e}") from None
    want = {"version": INDEX_VERSION, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "image_keys": list(image_keys), "label_key": label_key}
    candidates = _index_paths(shard)
    for p in candidates:
        got = _load_index(p, want, st.st_size)
        if got is not None:
            return got
    index = scan_shard(shard, image_keys, label_key)
    for p in candidates:
        d = os.path.dirname(p)
        if os.path.isdir(d) and not _writable(d):
            continue
        try:
            _save_index(p, index, want)
            break
        except OSError:
            continue
    return index


class WebDataset(_PartedSource):
    """Samples of WebDataset tar shards, in shard order then member order.

    Parameters
    ----------
    shards : str or list of str
        Shard paths; each may be a brace pattern (``train-{000000..000146}.tar``, ``{a,b}``),
        expanded in order.
    image_keys : sequence of str
        Extensions (case-insensitive) of the member holding a sample's image, in order of
        preference: the first one a sample has is its image.
    label_key : str or None
        ``"cls"``: the member ``<key>.cls`` holds the label as decimal text; ``"json:label"``:
        the integer field ``label`` of the member ``<key>.json``; None: every label is 0.

    A shard that is missing, compressed or whose tar headers are damaged raises
    :class:`ConfigError` naming it (and the byte offset of the bad header). A sample whose
    image member is truncated or missing, or whose label is missing or not an integer, keeps
    its place (label -1) and raises :class:`DecodeError` naming the shard and member when it
    is read.
    """

    kind = "webdataset"

    def __init__(self, shards, *, image_keys=("jpg", "jpeg", "png", "webp"), label_key="cls"):
        if isinstance(shards, (str, bytes, os.PathLike)):
            shards = [shards]
        try:
            patterns = [os.fsdecode(s) for s in shards]
        except TypeError:
            raise ConfigError(f"shards must be a path, a brace pattern or a list of them, "
                              f"got {shards!r}") from None
        paths = [os.path.abspath(p) for pat in patterns for p in expand_shards(pat)]
        if not paths:
            raise ConfigError("WebDataset needs at least one shard")
        if isinstance(image_keys, str):
            image_keys = (image_keys,)
        image_keys = _v.names(list(image_keys), "image_keys")
        if not image_keys:
            raise ConfigError("image_keys must name at least one extension")
        self._image_keys = tuple(k.lower() for k in image_keys)
        if label_key is not None and (not isinstance(label_key, str) or not label_key
                                      or label_key.startswith(":")):
            raise ConfigError(f"label_key must be an extension such as 'cls', "
                              f"'json:<field>', or None, got {label_key!r}")
        self._label_key = label_key.lower() if label_key and ":" not in label_key else label_key
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise ConfigError(f"{len(missing)} of {len(paths)} WebDataset shards do not exist "
                              f"or are not files; first: {missing[0]}")
        self._paths = paths
        self._index = [open_index(p, self._image_keys, self._label_key) for p in paths]
        counts = np.array([len(ix.samples) for ix in self._index], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        if self._starts[-1] == 0:
            raise ConfigError(f"no samples in the {len(paths)} WebDataset shards "
                              f"(first: {paths[0]})")
        self._labels = frozen_labels(np.concatenate([ix.samples["label"]
                                                     for ix in self._index]))
        self._maps = {}
        self._lock = threading.Lock()

    @property
    def shards(self):
        """Absolute paths of the shards, in order."""
        return list(self._paths)

    def _map(self, k):
        """Shard ``k``'s bytes as a read-only uint8 array over a memory map, mapped once."""
        arr = self._maps.get(k)
        if arr is not None:
            return arr
        with self._lock:
            if k in self._maps:
                return self._maps[k]
            path = self._paths[k]
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
            except (OSError, ValueError) as e:
                raise DecodeError(f"cannot map WebDataset shard: {e}", path=path) from None
            s = self._index[k].samples
            ends = (s["offset"] + s["size"])[s["flags"] & (TRUNCATED | NO_IMAGE) == 0]
            if len(ends) and int(ends.max()) > size:
                raise DecodeError(f"WebDataset shard shrank to {size} bytes since it was "
                                  f"indexed", path=path)
            self._maps[k] = np.frombuffer(mm, dtype=np.uint8)
            return self._maps[k]

    def _member(self, k, j):
        ext = int(self._index[k].samples[j]["ext"])
        key = self._index[k].key(j)
        return f"{key}.{self._image_keys[ext]}" if ext >= 0 else key

    def describe(self, i):
        k, j = self._locate(i)
        return f"WebDataset shard {self._paths[k]}, member {self._member(k, j)}"

    def relpath(self, i):
        k, j = self._locate(i)
        return f"{os.path.basename(self._paths[k])}/{self._member(k, j)}"

    def metadata(self, i):
        """``{"__key__": the sample's key, "shard": its shard's path}``."""
        k, j = self._locate(i)
        return {"__key__": self._index[k].key(j), "shard": self._paths[k]}

    def view(self, i):
        """Sample ``i``'s image member as a read-only uint8 array into the shard's map."""
        k, j = self._locate(i)
        r = self._index[k].samples[j]
        flags = int(r["flags"])
        if flags & (NO_IMAGE | TRUNCATED | NO_LABEL):
            msg = next((_FLAG_TEXT[bit] for bit in (NO_IMAGE, TRUNCATED) if flags & bit),
                       None) or self._index[k].problems.get(j, "no label")
            raise DecodeError(f"cannot read: {msg}", index=i, path=self.describe(i))
        o = int(r["offset"])
        try:
            return self._map(k)[o:o + int(r["size"])]
        except DecodeError as e:
            raise DecodeError(e.message, index=i, path=self.describe(i)) from None

    def read(self, i):
        return self.view(i).tobytes()

    def buffers(self, indices):
        """``(BufferList, {batch position: DecodeError})`` of samples ``indices`` (int64
        (n,)); a batch within one shard is its map and offset arrays, no object per record."""
        indices, k = self._one_part(indices)
        if k is not None:
            rec = self._index[k].samples[indices - self._starts[k]]
            if not rec["flags"].any():
                try:
                    return _jpeg.BufferList.from_packed(
                        self._map(k), np.ascontiguousarray(rec["offset"]),
                        np.ascontiguousarray(rec["size"])), {}
                except DecodeError:
                    pass    # the general path names each sample
        return buffers_by_record(indices, self.view)

    def fingerprint(self):
        """Digest of the shard names, member keys, image sizes and labels (hashing the index
        arrays whole, with no per-sample Python work)."""
        if getattr(self, "_fp", None) is None:
            h = hashlib.sha256()
            for p, ix in zip(self._paths, self._index):
                h.update(os.path.basename(p).encode("utf-8", "surrogateescape") + b"\0")
                h.update(ix.keys.tobytes())
                for field in ("key_len", "size", "label", "flags"):
                    h.update(np.ascontiguousarray(ix.samples[field]).tobytes())
            self._fp = h.hexdigest()[:16]
        return self._fp

    def _spec(self):
        return {"shards": list(self._paths), "image_keys": list(self._image_keys),
                "label_key": self._label_key}
