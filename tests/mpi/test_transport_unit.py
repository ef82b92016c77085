"""Parts of the transport that need no MPI job: byte layout, producer placement, errors
carried across the wire."""
import pickle

import numpy as np
import pytest

from dpu_pipe.errors import DecodeError, ProducerError
from dpu_pipe.transport import (CONTROL, PRODUCER_ENTRY, SLOT_HEADER, Layout, _pack_error,
                                _raise_remote, _state, assign_producers)


def test_header_layout_is_explicit_little_endian():
    # Field offsets are part of the wire format between x86 hosts and aarch64 DPUs.
    offsets = {name: SLOT_HEADER.fields[name][1] for name in SLOT_HEADER.names}
    assert offsets == {"state": 0, "version": 8, "producer": 12, "epoch": 16, "step": 24,
                       "payload_bytes": 32, "error_bytes": 40, "ticket": 48, "reserved": 56}
    assert SLOT_HEADER.itemsize == 64 and CONTROL.itemsize == 64 and PRODUCER_ENTRY.itemsize == 32
    for dt in (SLOT_HEADER, CONTROL, PRODUCER_ENTRY):
        for name in dt.names:
            base = dt.fields[name][0].base
            assert base.str[0] in "<|", (name, base.str)  # '<' even on a big-endian numpy
    h = np.zeros(1, SLOT_HEADER)
    h["state"], h["version"], h["step"] = _state(5, 2), 1, 0x0102030405060708
    raw = h.tobytes()
    assert raw[0:8] == (22).to_bytes(8, "little") and raw[8:12] == (1).to_bytes(4, "little")
    assert raw[24:32] == bytes([8, 7, 6, 5, 4, 3, 2, 1])


@pytest.mark.parametrize("slots,slot_bytes,producers", [(1, 0, 0), (1, 1, 1), (3, 100, 3), (8, 38535168, 7)])
def test_layout_offsets_aligned_and_disjoint(slots, slot_bytes, producers):
    L = Layout(slots, slot_bytes, producers)
    assert L.entry_offset(1) == 64 if producers else True
    assert L.slots_offset >= 64 + 32 * producers and L.slots_offset % 64 == 0
    for j in range(slots):
        assert L.slot_offset(j) % 64 == 0 and L.payload_offset(j) == L.slot_offset(j) + 64
        assert L.payload_offset(j) + slot_bytes <= (L.slot_offset(j + 1) if j + 1 < slots else L.total_bytes)
    assert L.total_bytes == L.slots_offset + slots * (64 + -(-slot_bytes // 64) * 64)


def test_producers_follow_hostnames_then_spread():
    roles = ["host", "host", "producer", "producer", "producer", "producer", "producer", "producer"]
    names = ["node1", "node10", "node10-dpu", "node1-dpu.cluster", "node1", "other", "node10_bf2", "x"]
    got = assign_producers(roles, names)
    # same hostname first (4 -> 0), then DPU names extending the host's (2, 6 -> 1; 3 -> 0,
    # "node10-dpu" must not match "node1"), then the rest evenly (5 -> 0, 7 -> 1).
    assert got == {2: 1, 3: 0, 4: 0, 5: 0, 6: 1, 7: 1}


def test_producers_spread_evenly_among_same_node_hosts():
    roles = ["host"] * 2 + ["producer"] * 5
    got = assign_producers(roles, ["n"] * 7)
    assert got == {2: 0, 3: 1, 4: 0, 5: 1, 6: 0}


def test_no_host_is_an_error():
    with pytest.raises(ValueError, match="no rank declared the role 'host'"):
        assign_producers(["producer"], ["n"])


def _raised(blob):
    with pytest.raises(Exception) as info:
        _raise_remote(blob, "producer rank 3 (world rank 4 on dpu, pid 9)", 1, 17)
    return info.value


def _traceback_of(exc):
    try:
        raise exc
    except Exception as e:
        import traceback
        return "".join(traceback.format_exception(type(e), e, e.__traceback__))


def test_decode_error_crosses_with_index_path_and_producer():
    exc = DecodeError("Corrupt JPEG data", index=42, path="/d/x.jpg")
    err = _raised(_pack_error(exc, _traceback_of(exc), 1 << 16, "p"))
    assert type(err) is DecodeError and err.index == 42 and err.path == "/d/x.jpg"
    assert isinstance(err.__cause__, ProducerError)
    assert err.__cause__.producer.startswith("producer rank 3")
    assert "raise exc" in err.__cause__.remote_traceback
    assert "step 17 of epoch 1" in str(err.__cause__)


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("no")


def test_other_errors_become_producer_error():
    err = _raised(_pack_error(KeyError("k"), "tb text", 1 << 16, "p"))
    assert type(err) is ProducerError and "KeyError" in str(err) and err.remote_traceback == "tb text"
    assert isinstance(err.__cause__, KeyError)
    err = _raised(_pack_error(_Unpicklable("boom"), "tb", 1 << 16, "p"))
    assert type(err) is ProducerError and "_Unpicklable: boom" in str(err) and err.__cause__ is None


@pytest.mark.parametrize("capacity", [0, 30, 120, 200, 400, 1000, 5000])
def test_error_record_truncated_to_slot(capacity):
    exc = DecodeError("x" * 3000, index=1, path="/p")
    tb = "".join(f"  frame {i} \u00e9\n" for i in range(500)) + "LAST FRAME\n"
    blob = _pack_error(exc, tb, capacity, "p")
    assert len(blob) <= capacity
    err = _raised(blob)
    assert isinstance(err, (DecodeError, ProducerError))
    kept = pickle.loads(blob)["traceback"] if blob else ""
    if kept:  # the tail is kept: the last frames say where it failed
        assert kept.startswith("...(truncated)\n") and tb.endswith(kept[len("...(truncated)\n"):])
        assert len(kept) > 20


def test_unreadable_record():
    err = _raised(b"\x80\x04garbage")
    assert type(err) is ProducerError and "unreadable" in str(err)
