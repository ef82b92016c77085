"""Progress bars of the command-line tools: tqdm's, on stderr, quiet when not on a terminal."""

import contextlib

__all__ = ["bar"]


class _Silent:
    def update(self, n=1):
        pass


@contextlib.contextmanager
def bar(total, desc, *, unit="img", enabled=True):
    """A tqdm bar (``update(k)``) with an ETA, or a silent stand-in when ``enabled`` is false
    or tqdm is not installed (``pip install tqdm``)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        enabled = False
    if not enabled:
        yield _Silent()
        return
    # disable=None: no bar when stderr is not a terminal (logs, CI, pipes).
    with tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=None,
              dynamic_ncols=True) as b:
        yield b
