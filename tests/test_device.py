"""Host → device copies (``dpu_pipe.device``) on a fake device runtime whose copies land late,
when their event completes: staging buffers reused only after their copy, batches in a pinned
region copied in place and fenced before their memory is reused, registration and its refusal,
deadlines. The same on the real CUDA runtime when there is one. The offloaded path through
the RMA window runs under mpiexec in ``tests/mpi/test_device_offload.py``."""
import logging
import time
import types

import numpy as np
import pytest

from dpu_pipe import Loader, PipeTimeout
from dpu_pipe.device import CudaBackend, DeviceStage, PinnedRegion

torch = pytest.importorskip("torch")
from fake_device import FakeDevice  # noqa: E402  (needs torch)

pytestmark = pytest.mark.timeout(60)

KW = dict(size=24, seed=3, shuffle=False, drop_last=False)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(photo_folder):
    return photo_folder(10)


@pytest.fixture(scope="module")
def reference(folder):
    with Loader(folder, 4, **KW) as loader:
        return [(x.copy(), y.copy()) for x, y in loader]


def window_with(mem, images, labels, at):
    """Put ``images`` and ``labels`` into ``mem`` from byte ``at``; their views there as
    tensors."""
    x = mem[at:at + images.nbytes].view(images.dtype).reshape(images.shape)
    at += images.nbytes
    y = mem[at:at + labels.nbytes].view(labels.dtype).reshape(labels.shape)
    x[...] = images
    y[...] = labels
    return torch.from_numpy(x), torch.from_numpy(y)


def test_staging_buffers_are_reused_only_after_their_copy(reference):
    dev = FakeDevice(delay=0.01)
    stage = DeviceStage(torch, CPU, backend=dev)
    outs = []
    for x, y in reference:
        bx = torch.from_numpy(x.copy()).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        outs.append(stage.send(bx, torch.from_numpy(y), torch.bfloat16))
    dev.synchronize()
    # Copies land 10 ms after they start, reading the staging buffer as it is then; the
    # batches were sent faster than that, so a buffer refilled early would show.
    assert not any(c.event.overwritten for c in dev.copies)
    assert all(dev.in_staging(c) for c in dev.copies)
    assert len(dev.pinned) == 2 * DeviceStage.SLOTS   # images + labels per slot, once
    assert stage.staged == len(reference) and stage.direct == 0
    for (ox, oy), (rx, ry) in zip(outs, reference):
        assert ox.dtype == torch.bfloat16 and ox.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(ox, torch.from_numpy(rx).to(torch.bfloat16))
        assert np.array_equal(oy.numpy(), ry)
    assert reference[-1][0].shape[0] < reference[0][0].shape[0]   # a short last batch too


def test_a_batch_in_the_pinned_region_is_copied_in_place_and_fenced(reference):
    dev = FakeDevice(delay=0.05)
    mem = np.zeros(1 << 16, np.uint8)
    region = PinnedRegion(dev)
    assert region.attach(mem)
    stage = DeviceStage(torch, CPU, backend=dev)
    stage.window = region
    (x0, y0), (x1, y1) = reference[:2]
    x, y = window_with(mem, x0, y0, 128)
    ox, oy = stage.send(x, y, x.dtype)
    assert stage.direct == 1 and stage.staged == 0 and not dev.pinned
    assert [c.inside(mem.ctypes.data, mem.nbytes) for c in dev.copies] == [True, True]
    t0 = time.monotonic()
    stage.fence()
    assert time.monotonic() - t0 > 0.03 and dev.copies[-1].event.early_queries > 0
    window_with(mem, x1, y1, 128)       # the slot made again, once the fence returned
    dev.synchronize()
    assert not any(c.event.overwritten for c in dev.copies)
    assert np.array_equal(ox.numpy(), x0) and np.array_equal(oy.numpy(), y0)
    stage.fence()                       # nothing in flight: returns at once


def test_a_batch_outside_the_region_is_staged(reference):
    dev = FakeDevice()
    mem = np.zeros(1 << 16, np.uint8)
    region = PinnedRegion(dev)
    region.attach(mem)
    stage = DeviceStage(torch, CPU, backend=dev)
    stage.window = region
    x0, y0 = reference[0]
    x, y = window_with(mem, x0, y0, 0)
    stage.send(x, torch.from_numpy(y0.copy()), x.dtype)         # labels elsewhere
    stage.send(torch.from_numpy(x0.copy()), y, x.dtype)         # images elsewhere
    stage.send(x, y, torch.float16)                             # a conversion
    assert stage.staged == 3 and stage.direct == 0
    assert all(dev.in_staging(c) for c in dev.copies)


def test_waiting_for_a_copy_has_a_deadline(reference):
    dev = FakeDevice(delay=1e9)         # a copy that never completes: a hung device
    mem = np.zeros(1 << 16, np.uint8)
    region = PinnedRegion(dev, timeout=0.2)
    region.attach(mem)
    stage = DeviceStage(torch, CPU, backend=dev, timeout=0.2)
    stage.window = region
    stage.send(*window_with(mem, *reference[0], 0), torch.float32)
    with pytest.raises(PipeTimeout, match="giving a batch's window slot back.*did not complete"):
        stage.fence()
    with pytest.raises(PipeTimeout, match="unpinning the RMA window.*did not complete"):
        region.detach()
    # Each wait polled the copy's event until its deadline rather than blocking on it.
    assert dev.copies[-1].event.early_queries >= 2
    assert ("unregister", mem.ctypes.data) not in dev.log     # not while a copy reads it


def test_region_unregisters_once_after_its_copies_completed(reference):
    seen = []
    dev = FakeDevice(delay=0.05, on_unregister=lambda ptr: seen.append(
        all(c.event.done for c in dev.copies)))
    a, b = np.zeros(1 << 16, np.uint8), np.zeros(1 << 15, np.uint8)
    region = PinnedRegion(dev)
    region.attach(a)
    stage = DeviceStage(torch, CPU, backend=dev)
    stage.window = region
    stage.send(*window_with(a, *reference[0], 0), torch.float32)
    region.detach()
    region.detach()
    assert not region.holds(torch.from_numpy(a))
    region.attach(b)                    # the window made anew
    assert region.holds(torch.from_numpy(b[8:16]))
    region.detach()
    assert dev.log == [("register", a.ctypes.data, a.nbytes), ("unregister", a.ctypes.data),
                       ("register", b.ctypes.data, b.nbytes), ("unregister", b.ctypes.data)]
    assert seen == [True, True] and not dev.registered


def test_refused_registration_stages_with_one_logged_reason(reference, caplog):
    dev = FakeDevice(refuse="cudaErrorNotSupported: operation not supported")
    mem = np.zeros(1 << 16, np.uint8)
    region = PinnedRegion(dev)
    with caplog.at_level(logging.WARNING, logger="dpu_pipe"):
        assert not region.attach(mem)
    said = [r.getMessage() for r in caplog.records if "pinned in place" in r.getMessage()]
    assert len(said) == 1 and "operation not supported" in said[0]
    assert "operation not supported" in region.reason
    stage = DeviceStage(torch, CPU, backend=dev)
    stage.window = region
    x, y = window_with(mem, *reference[0], 0)
    ox, _ = stage.send(x, y, x.dtype)
    dev.synchronize()
    assert stage.staged == 1 and dev.in_staging(dev.copies[0])
    assert np.array_equal(ox.numpy(), reference[0][0])
    region.detach()                     # nothing registered: nothing to undo
    assert dev.log == [("register", mem.ctypes.data, mem.nbytes)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA")
def test_torch_without_cuda_refuses_registration_without_crashing():
    region = PinnedRegion(CudaBackend(torch, torch.device("cuda")))
    assert not region.attach(np.zeros(4096, np.uint8))
    assert "cudart" in region.reason


def test_an_older_torch_without_cudart_refuses_registration_without_crashing():
    old = types.SimpleNamespace(__version__="1.9.0", cuda=types.SimpleNamespace(),
                                version=types.SimpleNamespace(cuda="11.1"))
    region = PinnedRegion(CudaBackend(old, "cuda"))
    assert not region.attach(np.zeros(4096, np.uint8))
    assert "torch 1.9.0 has no torch.cuda.cudart()" in region.reason


def test_loader_on_a_device_stages_and_says_so(folder, reference):
    dev = FakeDevice(delay=0.005)
    with Loader(folder, 4, device="cuda", **KW) as loader:
        loader.out.backend = dev
        got = [(x, y) for x, y in loader]
        stats = loader.stats()
    dev.synchronize()
    assert len(got) == len(reference)
    for (x, y), (rx, ry) in zip(got, reference):
        assert np.array_equal(x.numpy(), rx) and np.array_equal(y.numpy(), ry)
    assert (stats["device_path"], stats["device_path_reason"]) == ("staging", None)
    assert (stats["device_batches_staged"], stats["device_batches_from_window"]) == (3, 0)
    assert not any(c.event.overwritten for c in dev.copies)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_copies_from_registered_memory(reference):
    backend = CudaBackend(torch, torch.device("cuda"))
    mem = np.zeros(1 << 20, np.uint8)
    region = PinnedRegion(backend)
    assert region.attach(mem), region.reason
    try:
        assert torch.from_numpy(mem).is_pinned()
        stage = DeviceStage(torch, torch.device("cuda"), backend=backend)
        stage.window = region
        outs = []
        for k, (x0, y0) in enumerate(reference):
            stage.fence()               # the slot is reused: its last copy must be done
            x, y = window_with(mem, x0, y0, 4096 * (k % 2))
            outs.append(stage.send(x, y, x.dtype))
        stage.fence()
        assert stage.direct == len(reference) and stage.staged == 0
        for (ox, oy), (rx, ry) in zip(outs, reference):
            assert ox.device.type == "cuda"
            assert np.array_equal(ox.cpu().numpy(), rx) and np.array_equal(oy.cpu().numpy(), ry)
    finally:
        region.detach()
    assert not torch.from_numpy(mem).is_pinned()
