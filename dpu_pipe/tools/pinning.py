"""CPU pinning for the benchmarks and the demo, written once.

A benchmark that compares methods pins itself to one core, so that every method runs on the
same core and the scheduler does not move it mid-round; it restores the affinity it found when
it is done. Where the OS has no affinity call (not Linux), every function here does nothing.
"""

import contextlib
import os

from ..errors import ConfigError

__all__ = ["available", "allowed_cores", "pin", "pinned", "restore"]


def available():
    """True when this OS lets a process choose its cores."""
    return hasattr(os, "sched_setaffinity")


def allowed_cores():
    """Sorted list of the cores this process may run on (all of them without affinity)."""
    if not available():
        return list(range(os.cpu_count() or 1))
    return sorted(os.sched_getaffinity(0))


def pin(cores, *, strict=True):
    """Restrict this process (its calling thread and what it starts later) to ``cores``.

    ``cores``: ``True`` = the last core this process may use; an int = that core; a set of
    ints; ``None`` = every core of the machine; ``False`` = leave the affinity alone. Returns
    the previous affinity (a set) for :func:`restore`, or None when nothing changed. With
    ``strict``, a core this process may not use is a ConfigError; without, the request is
    ignored (a 1-core machine shares its core).
    """
    if cores is False or not available():
        return None
    previous = set(os.sched_getaffinity(0))
    if cores is True:
        wanted = {max(previous)}
    elif cores is None:
        wanted = set(range(os.cpu_count() or 1))
    elif isinstance(cores, int):
        wanted = {cores}
    else:
        wanted = {int(c) for c in cores}
    try:
        os.sched_setaffinity(0, wanted)
    except (OSError, ValueError):
        if strict and cores is not None:
            raise ConfigError(f"cannot run on cores {sorted(wanted)}: this process may only "
                              f"run on {sorted(previous)}") from None
        return None
    return previous


def restore(previous):
    """Undo :func:`pin` (``previous`` is what it returned; None does nothing)."""
    if previous is not None and available():
        os.sched_setaffinity(0, previous)


@contextlib.contextmanager
def pinned(cores=True, *, strict=True):
    """``with pinned(core):`` — :func:`pin` for the block, restored afterwards. Yields the
    cores now allowed."""
    previous = pin(cores, strict=strict)
    try:
        yield allowed_cores()
    finally:
        restore(previous)
