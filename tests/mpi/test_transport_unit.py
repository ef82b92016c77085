"""Parts of the offload transport that need no MPI job: wire records, producer placement,
errors carried across the wire."""
import json
import pickle
import struct

import numpy as np
import pytest

from dpu_pipe.errors import ConfigError, DecodeError, ProducerError
from dpu_pipe.offload import wire
from dpu_pipe.offload.roles import assign_producers, parse_hostmap
from dpu_pipe.offload.transport import pack_error, raise_remote

SEALED = (wire.STATUS, wire.BUFFER_HEADER, wire.CONTROL, wire.ASSIGN)


@pytest.mark.parametrize("dtype", SEALED + (wire.PAYLOAD_HEADER,),
                         ids=["status", "buffer_header", "control", "assign", "payload"])
def test_records_are_explicit_little_endian_and_aligned(dtype):
    assert dtype.itemsize % 64 == 0
    for name in dtype.names:
        assert dtype.fields[name][0].base.str[0] in "<|", name


def test_buffer_header_byte_layout():
    # Field offsets are the wire format between x86 hosts and aarch64 DPUs.
    offsets = {n: wire.BUFFER_HEADER.fields[n][1] for n in wire.BUFFER_HEADER.names}
    assert offsets == {"grant": 0, "ticket": 8, "epoch": 16, "step": 24, "payload_bytes": 32,
                       "producer": 40, "status": 44, "stream": 48, "check": 56}
    rec = wire.pack(wire.BUFFER_HEADER, grant=5, step=0x0102030405060708)
    raw = rec.tobytes()
    assert raw[0:8] == (5).to_bytes(8, "little")
    assert raw[24:32] == bytes([8, 7, 6, 5, 4, 3, 2, 1])


@pytest.mark.parametrize("dtype", SEALED, ids=["status", "buffer_header", "control", "assign"])
def test_seal_detects_every_torn_or_foreign_record(dtype):
    rng = np.random.default_rng(0)
    fields = {n: int(rng.integers(0, 1 << 30)) for n in dtype.names if n != "check"
              and dtype.fields[n][0].shape == ()}
    rec = wire.pack(dtype, **fields)
    raw = rec.view(np.uint8).reshape(-1)
    got = wire.intact(raw, dtype)
    assert {k: v for k, v in got.items() if k in fields} == fields
    assert got == {n: rec[n][0].tolist() for n in dtype.names if n not in ("reserved",)} | \
        {k: v for k, v in got.items() if k == "reserved"}
    assert wire.intact(np.zeros(dtype.itemsize, np.uint8), dtype) is None   # never written
    old = wire.pack(dtype, **{k: v + 1 for k, v in fields.items()}).view(np.uint8).reshape(-1)
    for cut in range(8, dtype.itemsize, 8):   # half new, half old: a torn Put
        torn = np.concatenate([raw[:cut], old[cut:]])
        assert wire.intact(torn, dtype) is None, cut


def test_layout_offsets_aligned_and_disjoint():
    L = wire.HostLayout(3, 1000, 5)
    assert L.status(1) == 0 and L.status(5) == 4 * 64
    assert L.buffers_offset >= 5 * 64 and L.buffers_offset % 64 == 0
    for b in range(3):
        assert L.header(b) % 64 == 0 and L.payload(b) == L.header(b) + 64
        assert L.payload(b) + 1000 <= (L.header(b + 1) if b < 2 else L.total_bytes)
    assert wire.ProducerLayout.entry(0) == 64
    assert wire.ProducerLayout.entry(wire.QUEUE) == 64


def test_version_mismatch_names_both_versions():
    with pytest.raises(ConfigError, match=f"format 1, this rank speaks {wire.WIRE_VERSION}"):
        wire.check_version(1, "world rank 3")


# --- roles -----------------------------------------------------------------------------------

def test_producers_follow_hostnames_then_spread():
    roles = ["host", "host"] + ["producer"] * 6
    names = ["node1", "node10", "node10-dpu", "node1-dpu.cluster", "node1", "other",
             "node10_bf2", "bf-node1"]
    got, warnings = assign_producers(roles, names)
    # same hostname, then names containing the host's as a part ("node10-dpu" must not
    # match "node1"; "bf-node1" does), then the rest evenly, with a warning.
    assert got == {2: 1, 3: 0, 4: 0, 5: 1, 6: 1, 7: 0}
    assert len(warnings) == 1 and "producer rank 5 on 'other'" in warnings[0][1]


def test_prefix_dpu_names_pair_with_their_own_node():
    got, warnings = assign_producers(["host", "host", "producer", "producer"],
                                     ["nodeA", "nodeB", "bf-nodeB", "bf-nodeA"])
    assert got == {2: 1, 3: 0} and not warnings


def test_host_left_without_producers_is_warned():
    got, warnings = assign_producers(["host", "host", "producer", "producer"],
                                     ["gpu01", "gpu02", "gpu01-dpu", "gpu01-dpu"])
    assert got == {2: 0, 3: 0}
    assert [h for h, _ in warnings] == [1] and "no producer" in warnings[0][1]


def test_explicit_host_map_wins_over_names():
    hostmap = parse_hostmap("gpu01:x, gpu02:gpu01-dpu")
    got, warnings = assign_producers(["host", "host", "producer", "producer"],
                                     ["gpu01", "gpu02", "gpu01-dpu", "x"], hostmap)
    assert got == {2: 1, 3: 0} and not warnings


@pytest.mark.parametrize("text,match", [
    ("nodeA", "not 'host:producer'"), ("a:b,c:b", "both"), ("zz:n", "no host rank runs")])
def test_bad_host_maps_are_errors(text, match):
    with pytest.raises(ConfigError, match=match):
        assign_producers(["host", "producer"], ["a", "n"], parse_hostmap(text))


def test_no_host_is_an_error():
    with pytest.raises(ValueError, match="no rank declared the role 'host'"):
        assign_producers(["producer"], ["n"])


# --- errors across the wire ----------------------------------------------------------------

def _raised(blob):
    with pytest.raises(Exception) as info:
        raise_remote(blob, "producer rank 3 (world rank 4 on dpu, pid 9)", 1, 17)
    return info.value


def _traceback_of(exc):
    try:
        raise exc
    except Exception as e:
        import traceback
        return "".join(traceback.format_exception(type(e), e, e.__traceback__))


def test_decode_error_crosses_with_index_path_and_producer():
    exc = DecodeError("Corrupt JPEG data", index=42, path="/d/x.jpg")
    err = _raised(pack_error(exc, _traceback_of(exc), 1 << 16, "p"))
    assert type(err) is DecodeError and err.index == 42 and err.path == "/d/x.jpg"
    assert isinstance(err.__cause__, ProducerError)
    assert err.__cause__.producer.startswith("producer rank 3")
    assert "raise exc" in err.__cause__.remote_traceback
    assert "step 17 of epoch 1" in str(err.__cause__)


@pytest.mark.parametrize("capacity", [0, 30, 120, 400, 5000])
def test_error_record_truncated_to_slot(capacity):
    exc = DecodeError("x" * 3000, index=1, path="/p")
    tb = "".join(f"  frame {i} \u00e9\n" for i in range(500)) + "LAST FRAME\n"
    blob = pack_error(exc, tb, capacity, "p")
    assert len(blob) <= capacity
    err = _raised(blob)
    assert isinstance(err, (DecodeError, ProducerError))
    kept = pickle.loads(blob)["traceback"] if blob else ""
    if kept:
        assert kept.startswith("...(truncated)\n") and tb.endswith(kept[len("...(truncated)\n"):])


def test_unreadable_record():
    err = _raised(b"\x80\x04garbage")
    assert type(err) is ProducerError and "unreadable" in str(err)


# --- batch payloads: one layout at both ends ------------------------------------------------

LABELS = {"int": ("int64", ()), "float": ("float32", ()), "multi": ("int64", (3,)),
          "multi-float": ("float32", (2,))}
IMAGES = {"u8-chw": ((3, 7, 5), "uint8"), "f32-hwc": ((9, 11, 3), "float32"),
          "f16": ((3, 4, 4), "float16")}


@pytest.mark.parametrize("image", IMAGES, ids=list(IMAGES))
@pytest.mark.parametrize("batch, n", [(1, 1), (5, 5), (5, 3)], ids=["1of1", "5of5", "3of5"])
@pytest.mark.parametrize("label", LABELS, ids=list(LABELS))
def test_payload_round_trip(label, batch, n, image):
    """A producer's buffer, sent as the transport Puts its parts (payload up to the report,
    then the report), reads back through the layout the host makes from the stream request."""
    dtype, shape = LABELS[label]
    sample_shape, image_dtype = IMAGES[image]
    writer = wire.PayloadLayout(batch, sample_shape, image_dtype, dtype, shape)
    rng = np.random.default_rng(batch * 10 + n)
    buf = np.zeros(writer.end(batch), np.uint8)
    images, labels, indices = writer.views(buf, batch)
    images[:] = rng.integers(0, 255, images.shape)
    labels[:] = rng.integers(-1000, 1000, labels.shape) / (4 if dtype == "float32" else 1)
    indices[:] = rng.integers(0, 2**40, batch)
    sent_images, sent_labels, sent_indices = images.copy(), labels.copy(), indices.copy()
    report = json.dumps({"7": "bad file"}).encode()
    writer.write_header(buf, n=n, bad_bytes=len(report), read_ns=5)
    sent = bytes(buf[:writer.end(n)]) + report

    request = json.loads(json.dumps({"batch_size": batch, "labels": writer.labels()}))
    reader = wire.PayloadLayout.from_request(request, sample_shape, image_dtype)
    assert len(sent) <= reader.nbytes
    slot = np.zeros(reader.nbytes, np.uint8)
    slot[:len(sent)] = np.frombuffer(sent, np.uint8)
    head = wire.unpack(slot, wire.PAYLOAD_HEADER)
    assert (head["n"], head["read_ns"], head["version"]) == (n, 5, wire.WIRE_VERSION)
    got_images, got_labels, got_indices = reader.views(slot, n)
    assert got_labels.dtype == np.dtype(dtype) and got_labels.shape == (n,) + shape
    assert got_images.dtype == np.dtype(image_dtype)
    assert np.array_equal(got_images, sent_images[:n])
    assert np.array_equal(got_labels, sent_labels[:n])
    assert np.array_equal(got_indices, sent_indices[:n])
    assert reader.report(slot, n, head["bad_bytes"]) == {7: "bad file"}


def test_payload_byte_layout():
    # Offsets are the wire format between x86 hosts and aarch64 DPUs: little-endian fields,
    # labels 8-aligned after the indices, images 64-aligned.
    L = wire.PayloadLayout(3, (3, 2, 2), "uint8", "float32", (2,))
    assert wire.PAYLOAD_HEADER.itemsize == 128
    assert (L.indices_offset, L.labels_offset, L.images_offset) == (128, 128 + 24, 192)
    assert L.end(3) == 192 + 36 and L.nbytes == 192 + 36 + wire.BAD_REPORT_BYTES
    buf = np.zeros(L.end(3), np.uint8)
    images, labels, indices = L.views(buf, 3)
    indices[:] = [1, 2**40, 3]
    labels[:] = [[0.5, -1.0], [2.0, 3.0], [4.0, 5.0]]
    images[2] = 9
    L.write_header(buf, n=3, cache_node=2, cache_hits=2**33, cache_did_not_fit=5)
    raw = buf.tobytes()
    assert raw[136:144] == (2**40).to_bytes(8, "little")
    assert raw[152:160] == struct.pack("<ff", 0.5, -1.0)
    assert raw[192 + 24:192 + 36] == bytes([9] * 12) and raw[192:192 + 24] == bytes(24)
    # The node cache's counters: node, then hits, misses, bytes, entries, did_not_fit.
    assert raw[64:80] == (2).to_bytes(8, "little") + (2**33).to_bytes(8, "little")
    assert raw[104:112] == (5).to_bytes(8, "little")
    head = wire.unpack(buf, wire.PAYLOAD_HEADER)
    assert (head["version"], head["cache_node"], head["cache_hits"]) == (wire.WIRE_VERSION, 2,
                                                                        2**33)
    assert wire.PayloadLayout(4, (1,), "uint8").labels() == {"dtype": "int64", "shape": []}


def test_payload_refuses_labels_it_cannot_carry():
    with pytest.raises(ConfigError, match="float64 do not travel"):
        wire.PayloadLayout(2, (3, 4, 4), "uint8", "float64")
    with pytest.raises(ConfigError, match="empty axis"):
        wire.PayloadLayout(2, (3, 4, 4), "uint8", "int64", (0,))


@pytest.fixture(scope="module")
def label_data(mpi_dataset):
    from dpu_pipe.sources import ImageFolder

    return ImageFolder(mpi_dataset(10, {3: "corrupt"}))


@pytest.mark.parametrize("kind", ["int", "float", "multi", "multi-float"])
def test_producer_payload_reads_back_as_the_loaders_batch(label_data, kind):
    """A producer's OpenStream, opened from a loader's stream request, makes payloads that the
    host's layout reads back as the local Loader's batches: images, labels, each row's sample index
    (a skipped bad file replaced), and the bad-sample report."""
    from offload_host import label_lists

    from dpu_pipe import DPULoader, Loader
    from dpu_pipe.engines.offload import payload_layout, stream_request
    from dpu_pipe.offload.transport import Work
    from dpu_pipe.offload.producer_loop import OpenStream

    src = label_data if kind == "int" else label_lists(label_data)[kind]
    kw = dict(size=16, dtype="uint8", seed=3, on_error="skip", return_meta=True)
    host = DPULoader(src, 4, mode="local", **kw)
    layout = payload_layout(host.maker)
    maker = OpenStream(stream_request(host.stream_spec, layout, host.producer_threads))
    reported = {}
    with Loader(src, 4, **kw) as ref:
        for step, (x, y, meta) in enumerate(ref):
            work = Work({"seq": step, "ticket": step, "stream": 1, "epoch": 0, "step": step})
            maker.make(work)
            sent = b"".join(bytes(p) for p in work.parts)
            slot = np.zeros(layout.nbytes, np.uint8)
            slot[:len(sent)] = np.frombuffer(sent, np.uint8)
            head = wire.unpack(slot, wire.PAYLOAD_HEADER)
            images, labels, indices = layout.views(slot, head["n"])
            assert np.array_equal(images, x) and np.array_equal(indices, meta["index"])
            assert labels.dtype == y.dtype and np.array_equal(labels, y)
            assert np.array_equal(src.labels[indices], labels)
            reported.update(layout.report(slot, head["n"], head["bad_bytes"]))
            maker.give_back(work)
    assert list(reported) == [3] and "img.jpg" in reported[3]
    host.close()


def test_producer_refuses_a_spec_whose_labels_differ_from_its_source(label_data):
    from offload_host import label_lists

    from dpu_pipe import DPULoader
    from dpu_pipe.engines.offload import payload_layout, stream_request
    from dpu_pipe.offload.producer_loop import OpenStream

    with DPULoader(label_lists(label_data)["multi"], 4, mode="local", size=16) as host:
        request = stream_request(host.stream_spec, payload_layout(host.maker), 1)
    request["labels"] = {"dtype": "int64", "shape": []}
    with pytest.raises(ConfigError, match=r"labels int64\(3,\).*int64\(\)"):
        OpenStream(request)
