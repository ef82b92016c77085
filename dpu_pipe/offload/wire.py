"""Every byte layout the host and its producers exchange, defined once.

Each record is a numpy structured dtype of little-endian fields, a multiple of 8 bytes in
size, read and written through :func:`pack` / :func:`unpack`, never positional slicing. MPI
gives a ``Put`` no atomicity, so a record one side writes while the other may read it ends in
a ``check`` word (:func:`seal` / :func:`intact`): a reader that finds it wrong saw the record
half written and reads again later. That replaces remote atomics, which off-node need the
target to make MPI progress.

Windows (displacement unit 1 byte, everything 64-byte aligned): the host's is
``[STATUS x producers][BUFFER_HEADER + payload] x buffers`` (:class:`HostLayout`; a producer
writes its own ``STATUS`` and the buffers granted to it), a producer's is
``[CONTROL][ASSIGN x QUEUE]`` (:class:`ProducerLayout`, written only by the host). Ranks whose
:data:`WIRE_VERSION` differ refuse to start, naming both versions.
"""
import functools
import json
import struct

import numpy as np

from ..errors import ConfigError

__all__ = [
    "WIRE_VERSION", "ALIGN", "QUEUE", "STATUS", "BUFFER_HEADER", "CONTROL", "ASSIGN",
    "PAYLOAD_HEADER", "CACHE_FIELDS", "BAD_REPORT_BYTES", "LABEL_DTYPES", "PayloadLayout",
    "image_shapes", "STREAM_REQUEST_VERSION", "WAITING", "CANCELLED", "OK", "FAILED",
    "HostLayout", "ProducerLayout", "pack", "unpack", "seal", "intact", "align", "check_version",
]

#: Version of every layout in this module (and of a stream request's meaning); CHANGELOG.md
#: says what each version changed.
WIRE_VERSION = 8
ALIGN = 64
#: Assignment entries per producer: work it may hold (producing, produced, queued).
QUEUE = 3

#: One per producer in the host window, written by that producer only.
STATUS = np.dtype([
    ("beat", "<i8"),          # bumped every few ms while the producer lives
    ("done", "<i8"),          # every assignment with a smaller seq is finished or dropped
    ("working", "<i8"),       # ticket it is making (-1: none)
    ("stopped", "<i8"),       # 1 once it left its loop after the host's stop
    ("made", "<i8"),          # batches it delivered
    ("pid", "<i8"),
    ("reserved", "<i8"),
    ("check", "<u8"),
])

#: Header of a batch buffer in the host window; the producer writes it after the payload
#: (and a Flush), so a header that is intact and names the buffer's current grant means the
#: payload is complete.
BUFFER_HEADER = np.dtype([
    ("grant", "<i8"),         # grant id the host issued for this buffer (unique per grant)
    ("ticket", "<i8"),
    ("epoch", "<i8"),
    ("step", "<i8"),
    ("payload_bytes", "<i8"),
    ("producer", "<i4"),      # group rank of the producer
    ("status", "<i4"),        # OK, or FAILED: the payload is a pickled error record
    ("stream", "<i8"),
    ("check", "<u8"),
])

#: Start of a producer's window, written by the host.
CONTROL = np.dtype([
    ("stop", "<i8"),          # 1: leave the serving loop
    ("host_beat", "<i8"),     # bumped by the host whenever it polls
    ("reserved", "<i8", (5,)),
    ("check", "<u8"),
])

#: One unit of work for a producer, in entry ``seq % QUEUE`` of its window. The host writes it
#: once to assign the ticket (``buffer`` -1), again to grant a batch buffer, or to cancel it.
ASSIGN = np.dtype([
    ("seq", "<i8"),           # 0, 1, 2, ... per producer
    ("ticket", "<i8"),
    ("stream", "<i8"),
    ("epoch", "<i8"),
    ("step", "<i8"),
    ("buffer", "<i8"),        # granted buffer, -1 not yet, CANCELLED: drop the work
    ("grant", "<i8"),         # grant id to echo in the buffer header
    ("check", "<u8"),
])

WAITING, CANCELLED = -1, -2
OK, FAILED = 0, 1

#: Start of a DPULoader batch payload; :class:`PayloadLayout` places the rest.
PAYLOAD_HEADER = np.dtype([
    ("n", "<i8"),             # rows in this batch (<= batch_size: a short last batch)
    ("bad_bytes", "<i8"),
    ("read_ns", "<i8"),
    ("process_ns", "<i8"),
    ("publish_ns", "<i8"),
    ("version", "<i8"),
    ("sample_shape", "<i4", (3,)),   # one image of this batch, e.g. (3, H, W)
    ("reserved", "<i4"),
    # The producer's node cache (decoded samples) as of this batch: the host-group rank that
    # names the node (0, the host's rank: no cache) and the node's counters, every producer
    # of it counted.
    ("cache_node", "<i8"),
    ("cache_hits", "<i8"),
    ("cache_misses", "<i8"),
    ("cache_bytes", "<i8"),
    ("cache_entries", "<i8"),
    ("cache_did_not_fit", "<i8"),
    ("reserved2", "<i8", (2,)),
])
#: The cache counters of a payload header, in the order of ``stats()["cache"]``.
CACHE_FIELDS = ("hits", "misses", "bytes", "entries", "did_not_fit")
BAD_REPORT_BYTES = 16384
#: Version of a stream request (what producers need to make a stream: see
#: :func:`dpu_pipe.engines.offload.stream_request`).
STREAM_REQUEST_VERSION = WIRE_VERSION
#: Label dtypes a payload carries: integer classes, or float targets (regression, soft or
#: multi-label), one or several per sample.
LABEL_DTYPES = {"int64": np.dtype("<i8"), "float32": np.dtype("<f4")}


class PayloadLayout:
    """Byte layout of one DPULoader batch payload, computed alike by the producer that writes
    it and the host that reads it (or the host's own threads in hybrid mode)::

        0                 PAYLOAD_HEADER (128 bytes)
        indices_offset    int64[batch_size]: the dataset index of each row
        labels_offset     label dtype [batch_size, *label_shape]
        images_offset     images, n rows of the header's ``sample_shape`` (64-byte aligned)
        end(n, shape)     ``bad_bytes`` of UTF-8 JSON {index: message}: samples newly skipped

    A short batch (``n < batch_size``) leaves the tail of the indices and labels unused; its
    images, possibly smaller than ``sample_shape`` (a progressive size), fill the start of the
    images area. With views (``sample_shape`` a list) the images are one block of
    ``batch_size`` rows per view, view v at ``images_offset + view_offsets[v]`` (64-byte
    aligned), a short batch filling the first ``n`` rows of each. :attr:`nbytes`, the largest
    payload, is a host window slot's size.

    Parameters
    ----------
    batch_size : int
    sample_shape : tuple of int, or list of them
        The largest image, e.g. (3, H, W); a list: one shape per view of a multi-view
        recipe. ``image_dtype`` is their numpy dtype.
    label_dtype : "int64" or "float32" (or the numpy dtype)
    label_shape : tuple of int
        One sample's labels: () for one label, (K,) for K.
    """

    def __init__(self, batch_size, sample_shape, image_dtype, label_dtype="int64",
                 label_shape=()):
        self.batch_size = int(batch_size)
        #: Whether images come as a list, one batch per view.
        self.multi_view = isinstance(sample_shape, list)
        shapes = sample_shape if self.multi_view else [sample_shape]
        if not shapes:
            raise ConfigError("a multi-view payload needs at least one view")
        self.view_shapes = [tuple(int(v) for v in s) for s in shapes]
        self.sample_shape = self.view_shapes[0]
        self.image_dtype = np.dtype(image_dtype)
        name = np.dtype(label_dtype).name
        if name not in LABEL_DTYPES:
            raise ConfigError(f"labels of dtype {name} do not travel to a DPULoader: "
                              f"use one of {', '.join(LABEL_DTYPES)}")
        self.label_dtype = LABEL_DTYPES[name]
        self.label_shape = tuple(int(v) for v in label_shape)
        if any(v < 1 for v in self.label_shape):
            raise ConfigError(f"label shape {self.label_shape} has an empty axis")
        self.view_bytes = [self._image_bytes(s) for s in self.view_shapes]
        #: Image bytes of one sample, every view's together.
        self.sample_bytes = sum(self.view_bytes)
        self.view_offsets = [0]
        for b in self.view_bytes[:-1]:
            self.view_offsets.append(self.view_offsets[-1] + align(b * self.batch_size))
        self._label_bytes = int(np.prod(self.label_shape)) * self.label_dtype.itemsize
        self.indices_offset = PAYLOAD_HEADER.itemsize
        self.labels_offset = self.indices_offset + 8 * self.batch_size
        self.images_offset = align(self.labels_offset + self._label_bytes * self.batch_size)
        self.nbytes = self.end(self.batch_size) + BAD_REPORT_BYTES

    def _image_bytes(self, shape):
        return int(np.prod(shape)) * self.image_dtype.itemsize

    @classmethod
    def from_request(cls, request, sample_shape, image_dtype):
        """The layout of a stream request's payloads (``request["labels"]`` from
        :meth:`labels`)."""
        labels = request["labels"]
        return cls(request["batch_size"], sample_shape, image_dtype, labels["dtype"],
                   labels["shape"])

    def labels(self):
        """The labels' part of a stream request: ``{"dtype": name, "shape": [...]}``."""
        return {"dtype": self.label_dtype.name, "shape": list(self.label_shape)}

    def end(self, n, sample_shape=None):
        """Offset of the bad-sample report of a batch of ``n`` rows of ``sample_shape``
        (default :attr:`sample_shape`; with views, always the views' own): the end of its
        images."""
        if self.multi_view or sample_shape is None:
            return self.images_offset + self.view_offsets[-1] + int(n) * self.view_bytes[-1]
        return self.images_offset + int(n) * self._image_bytes(sample_shape)

    def shape_of(self, head):
        """The sample shape a payload's header (a dict of :data:`PAYLOAD_HEADER`) names;
        ConfigError when it does not fit this layout's slots."""
        shape = tuple(int(v) for v in head["sample_shape"])
        if len(shape) != len(self.sample_shape) or min(shape) < 1 or \
                self._image_bytes(shape) > self.sample_bytes or \
                (self.multi_view and shape != self.sample_shape):
            raise ConfigError(f"a payload names samples of shape {shape}, which do not fit "
                              f"this stream's slots of {self.sample_shape}")
        return shape

    def views(self, payload, n, sample_shape=None):
        """``(images (n, *sample_shape), labels (n, *label_shape), indices (n,))``: views into
        ``payload``, a 1-D uint8 array holding (at least) the first ``end(n, sample_shape)``
        bytes (``sample_shape`` default :attr:`sample_shape`). With views, ``images`` is a
        list: view v's ``(n, *view_shapes[v])``."""
        b = self.batch_size
        indices = payload[self.indices_offset:self.labels_offset].view("<i8")[:n]
        labels = payload[self.labels_offset:self.labels_offset + b * self._label_bytes]
        labels = labels.view(self.label_dtype).reshape((b,) + self.label_shape)[:n]
        shapes = self.view_shapes
        if sample_shape is not None and not self.multi_view:
            shapes = [tuple(sample_shape)]
        images = []
        for off, shape in zip(self.view_offsets, shapes):
            at = self.images_offset + off
            nbytes = int(n) * self._image_bytes(shape)
            images.append(payload[at:at + nbytes].view(self.image_dtype).reshape((n,) + shape))
        return (images if self.multi_view else images[0]), labels, indices

    def write_header(self, payload, **fields):
        """Write the :data:`PAYLOAD_HEADER` (``fields``, and this format's version) at the
        start of ``payload``; ``sample_shape`` defaults to :attr:`sample_shape`."""
        fields.setdefault("sample_shape", self.sample_shape)
        payload[:PAYLOAD_HEADER.itemsize] = pack(PAYLOAD_HEADER, version=WIRE_VERSION,
                                                 **fields).view(np.uint8)

    def report(self, payload, n, bad_bytes, sample_shape=None):
        """The bad-sample report of a payload of ``n`` rows of ``sample_shape`` (default
        :attr:`sample_shape`): {sample index: message}."""
        if not bad_bytes:
            return {}
        at = self.end(n, sample_shape)
        return {int(k): v for k, v in json.loads(bytes(payload[at:at + bad_bytes])).items()}


def image_shapes(transform):
    """The ``sample_shape`` argument of :class:`PayloadLayout` for a
    :class:`~dpu_pipe.transforms.TransformConfig`: its sample shape, or with views the list
    of its views' sample shapes."""
    return transform.sample_shape if transform.views is None else list(transform.view_shapes)


for _dt in (STATUS, BUFFER_HEADER, CONTROL, ASSIGN, PAYLOAD_HEADER):
    assert _dt.itemsize % 64 == 0, _dt
for _dt in (STATUS, BUFFER_HEADER, CONTROL, ASSIGN):   # sealed: 64 bytes, check word last
    assert _dt.itemsize == 64 and _dt.names[-1] == "check" and _dt.fields["check"][1] == 56

_MIX = 0x9E3779B97F4A7C15
_SEED = 0x6470755F70697065   # "dpu_pipe"
_MASK = (1 << 64) - 1
_WORDS = struct.Struct("<7Q")


def align(n):
    """``n`` rounded up to a multiple of :data:`ALIGN` bytes."""
    return (int(n) + ALIGN - 1) // ALIGN * ALIGN


def _checksum(raw):
    """64-bit mix of the 7 words before the check word of a 64-byte record (bytes-like).
    Plain integers: a record is read on every poll, and numpy scalars cost 10x more."""
    acc = _SEED
    for w in _WORDS.unpack_from(raw):
        acc = ((acc ^ w) * _MIX) & _MASK
        acc ^= acc >> 29
    return acc


def pack(dtype, **fields):
    """A one-record array of ``dtype`` with ``fields`` set (others zero); records ending in a
    ``check`` word come back sealed."""
    rec = np.zeros(1, dtype)
    for name, value in fields.items():
        rec[name] = value
    if "check" in dtype.names:
        seal(rec)
    return rec


def unpack(raw, dtype):
    """The record of ``dtype`` at the start of the bytes ``raw`` as a dict of Python ints
    (copied, so the caller may keep it after the memory changes)."""
    rec = np.frombuffer(raw, dtype, count=1)[0] if not isinstance(raw, np.ndarray) \
        else raw[:dtype.itemsize].view(dtype)[0]
    return {name: rec[name].tolist() for name in dtype.names}


def seal(rec):
    """Set the ``check`` word of the one-record array ``rec`` from its other fields."""
    rec["check"] = _checksum(rec.tobytes())


def intact(raw, dtype):
    """The record of ``dtype`` at the start of ``raw`` (bytes view) as a dict, or None when
    its check word does not match (half written, or never written)."""
    snap = bytes(raw[:dtype.itemsize])   # one snapshot, then verify it
    if int.from_bytes(snap[56:64], "little") != _checksum(snap):
        return None
    layout, names = _plain(dtype)
    return dict(zip(names, layout.unpack(snap)))


_CODES = {"<i8": "q", "<u8": "Q", "<i4": "i", "<u4": "I"}


@functools.cache
def _plain(dtype):
    """``(struct.Struct, field names)`` reading a sealed record's fields, which tile it; of an
    array field (reserved words) the dict keeps the last element."""
    fmt, names = "<", []
    for name in sorted(dtype.names, key=lambda n: dtype.fields[n][1]):
        field = dtype.fields[name][0]
        count = int(np.prod(field.shape))
        fmt += _CODES[field.base.str] * count
        names += [name] * count
    layout = struct.Struct(fmt)
    assert layout.size == dtype.itemsize, dtype
    return layout, names


def check_version(version, who):
    if version != WIRE_VERSION:
        raise ConfigError(f"{who} speaks dpu_pipe wire format {version}, this rank speaks "
                          f"{WIRE_VERSION}: install the same dpu_pipe version on hosts and DPUs")


class HostLayout:
    """Byte offsets of the host window: ``buffers`` batch buffers of ``slot_bytes`` payload
    bytes and ``producers`` status records. Host memory is :attr:`total_bytes`, about
    ``buffers x slot_bytes``."""

    def __init__(self, buffers, slot_bytes, producers):
        self.buffers, self.slot_bytes = int(buffers), int(slot_bytes)
        self.producers = int(producers)
        self.buffers_offset = align(self.producers * STATUS.itemsize)
        self.stride = BUFFER_HEADER.itemsize + align(self.slot_bytes)
        self.total_bytes = self.buffers_offset + self.buffers * self.stride

    def status(self, producer):
        """Offset of the status record of group rank ``producer`` (>= 1)."""
        return (producer - 1) * STATUS.itemsize

    def header(self, buffer):
        return self.buffers_offset + buffer * self.stride

    def payload(self, buffer):
        return self.header(buffer) + BUFFER_HEADER.itemsize


class ProducerLayout:
    """Byte offsets of a producer's window: the control record and :data:`QUEUE` entries."""

    total_bytes = CONTROL.itemsize + QUEUE * ASSIGN.itemsize

    @staticmethod
    def entry(seq):
        return CONTROL.itemsize + (seq % QUEUE) * ASSIGN.itemsize
