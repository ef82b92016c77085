"""One way to wait for something that completes elsewhere (an MPI request, a device copy):
test it, sleep a little longer each time, and raise :class:`PipeTimeout` at a deadline.

Blocking waits are avoided on purpose: MPI libraries spin a core in them, and a device
synchronize has no deadline.
"""
import time

from .errors import PipeTimeout

__all__ = ["poll_until"]


def poll_until(done, deadline, message, longest):
    """Call ``done()`` until it returns true, sleeping between calls (from 20 µs, doubling,
    up to ``longest`` seconds); raise :class:`PipeTimeout` with ``message`` once
    ``deadline`` (``time.monotonic()`` seconds) has passed."""
    delay = 0.0
    while not done():
        if time.monotonic() > deadline:
            raise PipeTimeout(message)
        if delay:
            time.sleep(delay)
        delay = min(longest, max(2e-5, delay * 2))
