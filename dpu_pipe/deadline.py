"""One way to wait for something that completes elsewhere (an MPI request, a device copy, a
reply, a batch): test it, sleep a little longer each time, and raise :class:`PipeTimeout` at a
deadline (``time.monotonic()`` seconds). Blocking waits are avoided on purpose: MPI libraries
spin a core in them, and a device synchronize has no deadline.
"""
import time

from .errors import PipeTimeout

__all__ = ["Backoff", "deadline_in", "poll_until"]


def deadline_in(seconds):
    """The ``time.monotonic()`` deadline ``seconds`` from now."""
    return time.monotonic() + seconds


class Backoff:
    """Poll pacing: tight at first, then sleeps doubling from 20 µs up to ``longest`` seconds
    — and, with ``stretch``, in a long wait up to 5 % of the time waited so far (at most
    5 ms), so a host waiting for slow producers spends little CPU polling."""

    def __init__(self, longest, stretch=True):
        self.longest = longest
        self.stretch = stretch
        self.delay = 0.0
        self.start = time.monotonic()

    def __call__(self, nap=0.0):
        """Sleep the next delay, or ``nap`` seconds when that is longer (then ``longest``
        again: what is waited for is due)."""
        if nap > self.delay:
            time.sleep(nap)
            self.delay = self.longest / 2
            return
        if self.delay:
            time.sleep(self.delay)
        cap = self.longest
        if self.stretch:
            cap = max(cap, min(0.005, 0.05 * (time.monotonic() - self.start)))
        self.delay = min(cap, max(2e-5, self.delay * 2))


def poll_until(done, deadline, message, longest, *, stretch=False):
    """Call ``done()`` until it returns true, pacing the calls with :class:`Backoff`
    (``longest`` seconds at most between them, more in a long wait with ``stretch``); raise
    :class:`PipeTimeout` with ``message`` (a string, or a function returning one, called
    then) once ``deadline`` (``time.monotonic()`` seconds) has passed."""
    backoff = Backoff(longest, stretch)
    while not done():
        if time.monotonic() > deadline:
            raise PipeTimeout(message() if callable(message) else message)
        backoff()
