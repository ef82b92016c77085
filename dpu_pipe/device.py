"""What a loader hands out: the batch its producer wrote, as numpy arrays or as torch tensors
— converted (bfloat16), laid out (channels_last), pinned, or already on an accelerator.

The producer writes each batch into one buffer of a fixed ring (``prefetch + 1`` buffers).
Labels are always copied (a few bytes). Images are where the memory goes:

=============================  ==================================================================
output                         what the yielded images are
=============================  ==================================================================
numpy / torch on the CPU       **a view of a ring buffer**: valid until the next batch is asked
                               for (``copy=True`` yields a private copy); bfloat16 too (the
                               kernel writes it)
``pin_memory=True``            a new pinned CPU tensor (torch's caching host allocator)
``device="cuda"``              a new device tensor; the host side goes through a ring of two
                               pinned staging buffers, copied with ``non_blocking=True`` on a
                               side stream that the consumer's stream waits on
=============================  ==================================================================

So batches kept across iterations (``held = [(x, y) for x, y in loader]``) are safe on a
device, pinned, and with ``copy=True``; not otherwise.
"""

import warnings

from . import _validate as _v
from .errors import ConfigError

__all__ = ["OutputSpec", "torch_module"]


def torch_module(why):
    """``torch``, or a ConfigError saying which option needs it."""
    try:
        import torch
    except ImportError:
        raise ConfigError(f"{why} needs PyTorch: pip install torch") from None
    return torch


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


class OutputSpec:
    """The output options of a loader, checked once.

    Parameters
    ----------
    dtype : str, numpy dtype or torch dtype
        ``float32``, ``float16``, ``bfloat16`` (torch output only: numpy has no bfloat16) or
        ``uint8``.
    layout : "CHW" or "HWC"
    output : "numpy", "torch" or None
        None: torch when a torch-only option (device, pin_memory, a torch dtype, bfloat16,
        memory_format) is given, else numpy.
    device : str or torch.device, optional
    pin_memory : bool
    memory_format : torch.channels_last, torch.contiguous_format, their names, or None
        ``channels_last`` makes the kernel write NHWC and yields (B, 3, H, W) tensors whose
        memory is channels-last (``x.is_contiguous(memory_format=torch.channels_last)``).
    copy : bool
    """

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
        torch = None
        if self.output == "torch":
            torch = torch_module("output='torch'")
        elif wants_torch:
            raise ConfigError("device, pin_memory, memory_format and bfloat16 give torch "
                              "tensors: use output='torch' (or leave output unset)")
        self.channels_last = _memory_format(memory_format, torch)
        layout = _v.choice(layout, "layout", ("CHW", "HWC"))
        if self.channels_last and layout != "CHW":
            raise ConfigError("memory_format=channels_last already chooses the layout: leave "
                              "layout='CHW' (the tensors are (B, 3, H, W), NHWC in memory)")
        #: Layout the kernel writes.
        self.kernel_layout = "HWC" if self.channels_last else layout
        #: dtype the kernel writes.
        self.kernel_dtype = self.dtype
        self.device = None
        if device is not None:
            try:
                self.device = torch.device(device)
            except (RuntimeError, TypeError) as exc:
                raise ConfigError(f"device: {exc}") from None
            if self.device.type == "cpu":
                self.device = None
        if self.pin_memory and not _accelerator(torch):
            # As torch's DataLoader does: a pinned buffer without an accelerator is only slower.
            warnings.warn("pin_memory=True but torch sees no accelerator: batches are not "
                          "pinned", RuntimeWarning, stacklevel=4)
            self.pin_memory = False
        self._torch = torch
        self._stage = None

    def emit(self, images, labels):
        """``(images, labels)`` to yield, from the ring buffer's ``images`` and ``labels``."""
        labels = labels.copy()
        if self.output == "numpy":
            return (images.copy() if self.copy else images), labels
        torch = self._torch
        x = torch.from_numpy(images)
        if self.dtype == "bfloat16":
            x = x.view(torch.bfloat16)      # the kernel wrote bfloat16 bits into uint16
        if self.channels_last:
            x = x.permute(0, 3, 1, 2)       # (B, 3, H, W) view of NHWC memory
        y = torch.from_numpy(labels)
        if self.device is not None:
            if self._stage is None:
                self._stage = DeviceStage(torch, self.device)
            return self._stage.send(x, y, x.dtype)
        if self.pin_memory:
            return x.pin_memory(), y.pin_memory()   # new pinned copies
        if self.copy:
            x = x.clone()                   # strides (channels_last) kept
        return x, y


def _accelerator(torch):
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return bool(torch.cuda.is_available())


class CudaBackend:
    """What :class:`DeviceStage` asks of the device runtime; ``torch.cuda`` by default."""

    def __init__(self, torch, device):
        self.torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def empty_pinned(self, like, dtype):
        return self.torch.empty_like(like, dtype=dtype, device="cpu", pin_memory=True)

    def event(self):
        return self.torch.cuda.Event()

    def copy_to_device(self, pinned):
        """Start copying ``pinned`` to the device on the side stream; return the new tensor
        and an event recorded after the copy."""
        torch = self.torch
        with torch.cuda.stream(self.stream):
            out = pinned.to(self.device, non_blocking=True)
            done = self.event()
            done.record(self.stream)
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_stream(self.stream)
        # The tensor is born on the side stream and used on the consumer's: tell the caching
        # allocator, or it may hand the memory out again while the consumer still reads it.
        out.record_stream(consumer)
        return out, done


class DeviceStage:
    """Host → device copies through a ring of two pinned staging buffers.

    ``send`` copies the batch (converting its dtype) into the staging buffer whose previous
    copy has completed, starts an asynchronous ``non_blocking`` copy to the device and returns
    at once: the copy overlaps with the consumer's work on the previous batch and with the
    producer making the next one. A staging buffer is reused only after the event recorded
    behind its last copy has completed.
    """

    SLOTS = 2

    def __init__(self, torch, device, backend=None):
        self.torch = torch
        self.backend = backend if backend is not None else CudaBackend(torch, device)
        self._pinned = [None] * self.SLOTS      # (images, labels) staging per slot
        self._done = [None] * self.SLOTS        # event behind the slot's last copy
        self._next = 0

    def send(self, images, labels, dtype):
        """Device tensors ``(images as dtype, labels)``, copies of the CPU tensors given."""
        k = self._next
        self._next = (k + 1) % self.SLOTS
        if self._done[k] is not None:
            self._done[k].synchronize()
        staged = self._pinned[k]
        if staged is None or staged[0].shape[1:] != images.shape[1:] \
                or staged[0].shape[0] < images.shape[0] or staged[0].dtype != dtype:
            staged = (self.backend.empty_pinned(images, dtype),
                      self.backend.empty_pinned(labels, labels.dtype))
            self._pinned[k] = staged
        n = images.shape[0]
        x, y = staged[0][:n], staged[1][:n]
        x.copy_(images)
        y.copy_(labels)
        out_x, done_x = self.backend.copy_to_device(x)
        out_y, done_y = self.backend.copy_to_device(y)
        self._done[k] = done_y                  # recorded after the image copy, same stream
        return out_x, out_y

