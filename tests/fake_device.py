"""A device runtime for tests on machines without a GPU, with the interface of
:class:`dpu_pipe.device.CudaBackend`: device memory is CPU memory, and a copy lands when its
event completes — ``delay`` seconds after it started, or when the consumer synchronizes —
reading the source *as it is then*, as DMA does. So a source overwritten before its copy
completed shows up in the copied tensor, and each copy also says whether its source bytes
changed in flight (``overwritten``). Copies run in order on one stream: an event completes
the copies before it too."""
import time

import torch


class FakeEvent:
    def __init__(self, src, dst, ready_at, before):
        self.src, self.dst, self.ready_at = src, dst, ready_at
        self.before = before        # the event of the copy before it on the stream
        self.snapshot = src.clone()
        self.done = False
        self.overwritten = None     # source bytes changed between start and completion
        self.early_queries = 0      # queries answered "not yet"

    def _complete(self):
        if self.before is not None and not self.before.done:
            self.before._complete()
        self.before = None
        self.overwritten = not torch.equal(self.src, self.snapshot)
        self.dst.copy_(self.src)
        self.done = True

    def query(self):
        if not self.done:
            if time.monotonic() < self.ready_at:
                self.early_queries += 1
                return False
            self._complete()
        return True

    def synchronize(self):
        if not self.done:
            time.sleep(max(0.0, self.ready_at - time.monotonic()))
            self._complete()


class Copy:
    """One host → device copy: where it read from, how many bytes, its event."""

    def __init__(self, src, event):
        self.ptr = src.data_ptr()
        self.nbytes = src.numel() * src.element_size()
        self.event = event

    def inside(self, base, nbytes):
        return base <= self.ptr and self.ptr + self.nbytes <= base + nbytes


class FakeDevice:
    """``register`` records the memory (or raises ``RuntimeError(refuse)``); ``unregister``
    calls ``on_unregister(ptr)`` first, for checks of the caller's state at that moment.
    ``log`` lists ("register", ptr, nbytes) and ("unregister", ptr) in order; ``copies``
    every :class:`Copy`; ``pinned`` every staging buffer allocated."""

    def __init__(self, delay=0.0, refuse=None, on_unregister=None):
        self.delay, self.refuse, self.on_unregister = delay, refuse, on_unregister
        self.log, self.copies, self.pinned = [], [], []
        self.registered = {}

    def empty_pinned(self, like, dtype):
        t = torch.empty_like(like, dtype=dtype, device="cpu")
        self.pinned.append(t)
        return t

    def register(self, ptr, nbytes):
        self.log.append(("register", ptr, nbytes))
        if self.refuse is not None:
            raise RuntimeError(self.refuse)
        if any(p < ptr + nbytes and ptr < p + n for p, n in self.registered.items()):
            raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")
        self.registered[ptr] = nbytes

    def unregister(self, ptr):
        if self.on_unregister is not None:
            self.on_unregister(ptr)
        self.log.append(("unregister", ptr))
        if self.registered.pop(ptr, None) is None:
            raise RuntimeError("cudaErrorHostMemoryNotRegistered")

    def copy_to_device(self, pinned):
        out = torch.empty_like(pinned)      # strides (channels_last) kept, as .to() does
        ev = FakeEvent(pinned, out, time.monotonic() + self.delay,
                       self.copies[-1].event if self.copies else None)
        self.copies.append(Copy(pinned, ev))
        return out, ev

    def synchronize(self):
        """The consumer's stream waits for every copy (what reading a device tensor does)."""
        for c in self.copies:
            c.event.synchronize()

    def in_staging(self, copy):
        return any(copy.inside(t.data_ptr(), t.numel() * t.element_size())
                   for t in self.pinned)
