"""What a loader hands out: the batch its producer wrote, as numpy arrays or torch tensors —
converted (bfloat16), laid out (channels_last), pinned, or on an accelerator.

Labels are always copied. Images on the CPU are **a view of a ring buffer**, valid until the
next batch (``copy=True``: a private copy; ``pin_memory=True``: a new pinned tensor). With
``device="cuda"`` a batch goes through one of two pinned staging buffers, copied
``non_blocking`` on a side stream the consumer's stream waits on; in the offloaded modes it is
copied straight from its slot of the RMA window, registered as pinned memory
(``cudaHostRegister``), and the slot goes back to the producers once the copy has completed.
``stats()`` reports the path (``device_path``: docs/guides/offload.md).
"""

import contextlib
import ctypes
import logging
import os
import warnings

from . import _validate as _v
from ._torch import require_torch
from .deadline import deadline_in, poll_until
from .errors import ConfigError

__all__ = ["BatchOutput", "CudaBackend", "DeviceStage", "PinnedRegion", "wait_event"]

log = logging.getLogger("dpu_pipe")

#: ``cudaHostRegisterPortable``: pinned for every CUDA context of the process.
HOST_REGISTER_PORTABLE = 1


def _memory_format(value, torch):
    if value is None:
        return False
    if isinstance(value, str):
        return _v.choice(value, "memory_format", ("channels_last", "contiguous_format")) \
            == "channels_last"
    if torch is not None and value in (torch.channels_last, torch.contiguous_format):
        return value is torch.channels_last
    raise ConfigError(f"memory_format must be torch.channels_last, torch.contiguous_format "
                      f"or None, got {value!r}")


class BatchOutput:
    """A loader's output options (:class:`~dpu_pipe.Loader`'s), checked once; ``memory_format``
    may also be given by name."""

    def __init__(self, *, dtype="float32", layout="CHW", output=None, device=None,
                 pin_memory=False, memory_format=None, copy=False):
        torch_dtype = type(dtype).__module__ == "torch"
        self.dtype = _v.dtype(dtype)
        self.pin_memory = _v.boolean(pin_memory, "pin_memory")
        self.copy = _v.boolean(copy, "copy")
        wants_torch = (torch_dtype or self.dtype == "bfloat16" or device is not None
                       or self.pin_memory or memory_format is not None)
        if output is None:
            output = "torch" if wants_torch else "numpy"
        self.output = _v.choice(output, "output", ("numpy", "torch"))
        torch = require_torch("output='torch'") if self.output == "torch" else None
        if torch is None and wants_torch:
            raise ConfigError("device, pin_memory, memory_format and bfloat16 give torch "
                              "tensors: use output='torch' (or leave output unset)")
        self.channels_last = _memory_format(memory_format, torch)
        layout = _v.choice(layout, "layout", ("CHW", "HWC"))
        if self.channels_last and layout != "CHW":
            raise ConfigError("memory_format=channels_last already chooses the layout: leave "
                              "layout='CHW' (the tensors are (B, 3, H, W), NHWC in memory)")
        #: Layout the kernel writes.
        self.kernel_layout = "HWC" if self.channels_last else layout
        self.device = None
        if device is not None:
            try:
                self.device = torch.device(device)
            except (RuntimeError, TypeError) as exc:
                raise ConfigError(f"device: {exc}") from None
            if self.device.type == "cpu":
                self.device = None
        if self.pin_memory and not _accelerator(torch):
            # As DataLoader does: a pinned buffer without an accelerator is only slower.
            warnings.warn("pin_memory=True but torch sees no accelerator: batches are not "
                          "pinned", RuntimeWarning, stacklevel=4)
            self.pin_memory = False
        self._torch = torch
        self._stages = {}       # view -> DeviceStage (its pinned buffers fit that view)
        #: The device runtime (:class:`CudaBackend` unless set before the first batch).
        self.backend = None
        #: A :class:`PinnedRegion` whose batches are copied in place (DPULoader's window).
        self.window = None
        #: Deadline of every wait for a device copy, seconds (the loader's ``timeout``).
        self.timeout = 300.0

    def emit(self, images, labels):
        """``(images, labels)`` to yield from the ring buffer's (``images``: one per view)."""
        if isinstance(images, list):
            out = [self._emit(x, labels, v) for v, x in enumerate(images)]
            return [x for x, _ in out], out[0][1]
        return self._emit(images, labels, 0)

    def _emit(self, images, labels, view):
        if self.output == "numpy":
            return (images.copy() if self.copy else images), labels.copy()
        torch = self._torch
        x = torch.from_numpy(images)
        if self.dtype == "bfloat16":
            x = x.view(torch.bfloat16)      # the kernel wrote bfloat16 bits into uint16
        if self.channels_last:
            x = x.permute(0, 3, 1, 2)       # (B, 3, H, W) view of NHWC memory
        if self.device is not None:
            # Labels in place too: staged (copied at once) or copied from the pinned window.
            return self._device_stage(view).send(x, torch.from_numpy(labels), x.dtype)
        y = torch.from_numpy(labels.copy())
        if self.pin_memory:
            return x.pin_memory(), y.pin_memory()   # new pinned copies
        if self.copy:
            x = x.clone()                   # strides (channels_last) kept
        return x, y

    def device_backend(self):
        """:attr:`backend`, made on first use."""
        if self.backend is None:
            self.backend = CudaBackend(self._torch, self.device)
        return self.backend

    def _device_stage(self, view=0):
        if view not in self._stages:
            self._stages[view] = DeviceStage(self._torch, self.device,
                                             backend=self.device_backend(), timeout=self.timeout)
        stage = self._stages[view]
        stage.window = self.window
        return stage

    def fence(self):
        """Wait (deadline :attr:`timeout`) until no device copy reads an emitted batch."""
        for stage in self._stages.values():
            stage.fence()

    def stats(self):
        """Which way batches reach the device (empty without a device)."""
        if self.device is None:
            return {}
        stage, window = self._stages.get(0), self.window    # view 0's: one per batch
        return {"device_path": "window" if window is not None and window.nbytes else "staging",
                "device_path_reason": None if window is None else window.reason,
                "device_batches_from_window": stage.direct if stage is not None else 0,
                "device_batches_staged": stage.staged if stage is not None else 0}


def _accelerator(torch):
    if hasattr(getattr(torch, "accelerator", None), "is_available"):
        return bool(torch.accelerator.is_available())
    return bool(torch.cuda.is_available())


def wait_event(event, deadline, what):
    """Poll the device ``event`` (every 1 ms at most) until it has completed; past
    ``deadline`` (``time.monotonic()``), :class:`PipeTimeout` saying ``what``."""
    poll_until(event.query, deadline,
               f"{what}: the device copy did not complete before the deadline", 1e-3)


def _cudart(torch):
    """``torch.cuda.cudart()``, or a RuntimeError saying why this torch cannot pin memory."""
    if not hasattr(torch.cuda, "cudart"):
        raise RuntimeError(f"torch {torch.__version__} has no torch.cuda.cudart()")
    try:
        cudart = torch.cuda.cudart()
    except (AssertionError, RuntimeError, OSError) as exc:  # a build without CUDA asserts
        raise RuntimeError(f"torch.cuda.cudart() is unavailable: {exc}") from None
    if not hasattr(cudart, "cudaHostRegister"):
        raise RuntimeError(f"torch {torch.__version__} does not bind cudaHostRegister")
    return cudart


def _clear_cuda_error(torch):
    """Reset the runtime's last error after a refused registration, which torch would report
    against an unrelated kernel. Best effort, through the libcudart torch has loaded."""
    major = (getattr(torch.version, "cuda", None) or "").split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        with contextlib.suppress(OSError):
            ctypes.CDLL(name, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL).cudaGetLastError()
            return


class CudaBackend:
    """What :class:`DeviceStage` and :class:`PinnedRegion` ask of the runtime: ``torch.cuda``."""

    def __init__(self, torch, device):
        self.torch = torch
        self.device = device
        self._stream = None

    @property
    def stream(self):
        """The side stream of the copies (made on first use)."""
        if self._stream is None:
            self._stream = self.torch.cuda.Stream(device=self.device)
        return self._stream

    def empty_pinned(self, like, dtype):
        return self.torch.empty_like(like, dtype=dtype, device="cpu", pin_memory=True)

    def event(self):
        return self.torch.cuda.Event()

    def _runtime(self, call, what, *args):
        """``cudart.<call>(*args)``; RuntimeError saying that ``what`` failed on refusal."""
        cudart = _cudart(self.torch)
        err = getattr(cudart, call)(*args)
        if int(err) != 0:
            _clear_cuda_error(self.torch)
            raise RuntimeError(f"{what} failed: {cudart.cudaGetErrorString(err)} "
                               f"(cudaError {int(err)})")

    def register(self, ptr, nbytes):
        """Page-lock ``nbytes`` bytes at address ``ptr`` in place (``cudaHostRegister``)."""
        self._runtime("cudaHostRegister", f"cudaHostRegister of {nbytes} bytes", ptr, nbytes,
                      HOST_REGISTER_PORTABLE)

    def unregister(self, ptr):
        """Undo :meth:`register` of the memory at ``ptr``."""
        self._runtime("cudaHostUnregister", "cudaHostUnregister", ptr)

    def copy_to_device(self, pinned):
        """Start copying the pinned tensor ``pinned`` to the device on the side stream;
        return the new tensor and an event recorded after the copy."""
        torch = self.torch
        with torch.cuda.stream(self.stream):
            out = pinned.to(self.device, non_blocking=True)
            done = self.event()
            done.record(self.stream)
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_stream(self.stream)
        # Else the caching allocator may reuse it while the consumer's stream still reads it.
        out.record_stream(consumer)
        return out, done


class PinnedRegion:
    """Host memory (DPULoader's RMA window) registered in place with the device runtime, so
    batches in it are copied from where they are. When registration is refused, the region
    stays empty, :attr:`reason` says why (logged) and batches are staged."""

    def __init__(self, backend, timeout=300.0):
        self.backend = backend
        self.timeout = float(timeout)
        self.base = 0           # address and size of the registered memory; 0 when none
        self.nbytes = 0
        self.reason = None      # why the memory is not registered
        self._reading = []      # events of copies from it not yet seen complete

    def attach(self, mem):
        """Register ``mem`` (a 1-D uint8 numpy array over the memory); True when it is."""
        if self.nbytes:
            raise ConfigError("the pinned region already holds registered memory")
        ptr, nbytes = mem.ctypes.data, mem.nbytes
        try:
            self.backend.register(ptr, nbytes)
        except Exception as exc:  # noqa: BLE001 - any refusal means: stage instead
            self.reason = f"the RMA window cannot be pinned in place: {exc}"
            log.warning("dpu_pipe: %s; batches go to the device through pinned staging "
                        "buffers", self.reason)
            return False
        self.base, self.nbytes, self.reason = ptr, nbytes, None
        return True

    def detach(self):
        """Wait for the copies reading the memory, then unregister it. Idempotent."""
        if not self.nbytes:
            return
        deadline = deadline_in(self.timeout)
        for event in self._reading:
            wait_event(event, deadline, "unpinning the RMA window")
        self._reading = []
        base, self.base, self.nbytes = self.base, 0, 0
        self.reason = "the RMA window was freed"
        try:
            self.backend.unregister(base)
        except Exception as exc:  # noqa: BLE001 - the window is freed all the same
            log.warning("dpu_pipe: unpinning the RMA window: %s", exc)

    def holds(self, tensor):
        """True when the memory of the dense CPU tensor ``tensor`` lies in the region."""
        p = tensor.data_ptr()
        return (self.nbytes > 0 and self.base <= p
                and p + tensor.numel() * tensor.element_size() <= self.base + self.nbytes)

    def reading(self, event):
        """Note a copy from the region in flight until ``event`` completes."""
        self._reading = [e for e in self._reading if not e.query()]
        self._reading.append(event)


def _fits(buffer, tensor, dtype):
    """True when ``buffer`` can stage ``tensor`` as ``dtype`` (rows ``[:len(tensor)]``)."""
    return (buffer.shape[1:] == tensor.shape[1:] and buffer.shape[0] >= tensor.shape[0]
            and buffer.dtype == dtype)


class DeviceStage:
    """Asynchronous host → device copies, overlapped with the consumer's work and the making
    of the next batch. A batch in :attr:`window` (a registered :class:`PinnedRegion`) is
    copied from there and must stay untouched until :meth:`fence` returns; any other is
    copied (as the dtype asked) into one of two pinned staging buffers once that buffer's
    previous copy has completed (deadline ``timeout`` seconds).
    """

    SLOTS = 2

    def __init__(self, torch, device, backend=None, timeout=300.0):
        self.torch = torch
        self.backend = backend if backend is not None else CudaBackend(torch, device)
        self.timeout = float(timeout)
        self.window = None
        self._pinned = [None] * self.SLOTS      # (images, labels) staging per slot
        self._done = [None] * self.SLOTS        # event behind the slot's last copy
        self._next = 0
        self._direct = []                       # events of copies from the window in flight
        self.direct = 0                         # batches copied from the window
        self.staged = 0                         # batches copied through staging

    def send(self, images, labels, dtype):
        """Device tensors ``(images as dtype, labels)``, copies of the CPU tensors given."""
        w = self.window
        direct = (w is not None and dtype == images.dtype and w.holds(images)
                  and w.holds(labels))
        if direct:
            x, y = images, labels
        else:
            k = self._next
            self._next = (k + 1) % self.SLOTS
            if self._done[k] is not None:
                wait_event(self._done[k], deadline_in(self.timeout),
                           "reusing a pinned staging buffer")
            staged = self._pinned[k]
            if staged is None or not (_fits(staged[0], images, dtype)
                                      and _fits(staged[1], labels, labels.dtype)):
                staged = self._pinned[k] = (self.backend.empty_pinned(images, dtype),
                                            self.backend.empty_pinned(labels, labels.dtype))
            n = images.shape[0]
            x, y = staged[0][:n], staged[1][:n]
            x.copy_(images)
            y.copy_(labels)
        out_x, _ = self.backend.copy_to_device(x)
        out_y, done = self.backend.copy_to_device(y)   # after the image copy, same stream
        if direct:
            w.reading(done)
            self._direct.append(done)
            self.direct += 1
        else:
            self._done[k] = done
            self.staged += 1
        return out_x, out_y

    def fence(self):
        """Wait until every copy from the window started by :meth:`send` has completed."""
        deadline = deadline_in(self.timeout)
        while self._direct:
            wait_event(self._direct[0], deadline,
                       "giving a batch's window slot back to the producers")
            self._direct.pop(0)
