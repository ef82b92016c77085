"""The local engine (``mode="local"``, and the offloaded modes' fallback): a maker thread
filling a ring of buffers in order; the reference stream the offloaded modes reproduce."""

import contextlib
import queue
import sys
import threading
import time

import numpy as np

from ..deadline import deadline_in
from ..errors import DecodeError, PipeTimeout, ProducerError, format_traceback
from .base import Cancelled, Engine

__all__ = ["LocalEngine"]


def _make_loop(maker, images, labels, indices, epoch, start, end, free, ready, stop):
    """Maker thread body: no reference to the loader, whose __del__ then stops it."""
    try:
        for step in range(start, end):
            slot = None
            while slot is None:
                if stop.is_set():
                    return
                with contextlib.suppress(queue.Empty):
                    slot = free.get(timeout=0.1)
            n = maker.make(epoch, step, images[slot], labels[slot], indices[slot])
            ready.put((slot, n, None))
    except BaseException as exc:  # noqa: B902 - carried to the consumer, never lost
        ready.put((None, 0, exc))


class LocalEngine(Engine):
    """A maker thread filling a ring of ``prefetch + 1`` buffers of the largest batch, in
    order (one per batch in flight plus the one the caller holds)."""

    def __init__(self, maker, prefetch, timeout):
        self.maker = maker
        self.makers = (maker,)
        self.timeout = timeout
        nslots = prefetch + 1
        self.images = [maker.empty_images() for _ in range(nslots)]
        self.labels = [np.empty((maker.batch_size,) + maker.label_shape,
                                dtype=maker.label_dtype) for _ in range(nslots)]
        self.indices = [np.empty(maker.batch_size, np.int64) for _ in range(nslots)]
        self.held = None
        self.thread = None
        self.free = self.ready = self.stop_flag = None

    def start(self, epoch, step, end):
        self.pause()
        if self.thread is not None and self.thread.is_alive():
            # A second thread would run the maker's kernel (and its scratch memory) at once.
            raise PipeTimeout(f"the loader's maker thread did not stop within "
                              f"{self.timeout:.0f} s (a batch still being made); try again")
        self.free = queue.Queue()
        self.ready = queue.Queue()
        self.stop_flag = threading.Event()
        for k in range(len(self.images)):
            if k != self.held:
                self.free.put(k)
        self.thread = threading.Thread(
            target=_make_loop, name="dpu_pipe-maker", daemon=True,
            args=(self.maker, self.images, self.labels, self.indices, epoch, step, end,
                  self.free, self.ready, self.stop_flag))
        self.thread.start()

    def release_held(self):
        # Cleared first: an interrupt loses a slot until the next start(), never gives it twice.
        slot, self.held = self.held, None
        if slot is not None and self.free is not None:
            self.free.put(slot)

    def _next_data(self, epoch, step):
        deadline = deadline_in(self.timeout)
        while True:
            try:
                slot, n, exc = self.ready.get(timeout=0.2)
                break
            except queue.Empty:
                if self.cancel is not None and self.cancel.is_set():
                    raise Cancelled() from None
                if not self.thread.is_alive() and self.ready.empty():
                    raise ProducerError("the loader's maker thread ended without a batch",
                                        producer="loader thread") from None
                if time.monotonic() > deadline:
                    raise PipeTimeout(f"no batch within {self.timeout:.0f} s (epoch "
                                      f"{epoch}, step {step})") from None
        if exc is not None:
            self.pause()
            if isinstance(exc, DecodeError):
                raise exc  # keeps the maker thread's traceback
            raise ProducerError(f"{type(exc).__name__}: {exc}", producer="loader thread",
                                remote_traceback=format_traceback(exc)) from exc
        self.held = slot
        return (self.maker.rows(self.images[slot], epoch, n), self.labels[slot][:n],
                self.indices[slot][:n])

    def pause(self):
        thread = self.thread
        if thread is None:
            return
        self.stop_flag.set()
        # The maker stops after its batch; at interpreter exit it may be frozen for good.
        if thread.is_alive() and thread is not threading.current_thread() \
                and not sys.is_finalizing():
            thread.join(timeout=self.timeout)

    def close(self):
        self.pause()
        self.release_held()
