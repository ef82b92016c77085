"""Progressive resolution: an output size that ramps up with the epoch, by FFCV's rule
(``get_resolution`` in libffcv/ffcv-imagenet's ``train_imagenet.py``). The rule, its rounding
and how the schedule travels in the stream spec: docs/guides/recipes.md."""

from dataclasses import asdict, astuple, dataclass, fields

from . import _validate as _v
from .errors import ConfigError

__all__ = ["ProgressiveSize", "progressive_size", "KIND"]

#: The ``"kind"`` of a progressive size's dict in a transform's ``to_dict()``.
KIND = "progressive"


@dataclass(frozen=True)
class ProgressiveSize:
    """A square output size per epoch, in pixels, by FFCV's rule: build it with
    :func:`progressive_size`. Plain frozen data, so batch ``s`` of epoch ``e`` stays a pure
    function of the stream spec that carries it (:meth:`to_dict`)."""

    min_size: int
    max_size: int
    start_epoch: int
    end_epoch: int
    multiple: int = 32

    def __post_init__(self):
        checked = _v.progressive(*astuple(self))
        for f, value in zip(fields(self), checked):
            object.__setattr__(self, f.name, value)
        low = self.size_at(self.start_epoch + 1) if self._ramps() else self.min_size
        if low < 1:
            raise ConfigError(
                f"progressive_size({self.min_size}, {self.max_size}, {self.start_epoch}, "
                f"{self.end_epoch}, multiple={self.multiple}) gives size {low} in epoch "
                f"{self.start_epoch + 1} (the interpolation rounds to a multiple of "
                f"{self.multiple}): use a smaller multiple or a larger min_size")

    def _ramps(self):
        """Whether some epoch lies strictly between start_epoch and end_epoch."""
        return self.end_epoch - self.start_epoch >= 2

    def size_at(self, epoch):
        """The side in pixels of epoch ``epoch`` (>= 0): ``min_size`` up to ``start_epoch``,
        ``max_size`` from ``end_epoch``, else the interpolation rounded (half to even) to a
        multiple of ``multiple``."""
        epoch = int(epoch)
        # As FFCV: the start_epoch test first, np.interp's formula, np.round's rounding.
        if epoch <= self.start_epoch:
            return self.min_size
        if epoch >= self.end_epoch:
            return self.max_size
        slope = (self.max_size - self.min_size) / (self.end_epoch - self.start_epoch)
        interp = slope * (epoch - self.start_epoch) + self.min_size
        return int(round(interp / self.multiple)) * self.multiple

    @property
    def largest(self):
        """The largest side of any epoch, in pixels: what buffers are sized for. The rounded
        interpolation never decreases with the epoch, so it is ``max_size`` or the last
        ramp epoch's size (larger when ``max_size`` is not a multiple of ``multiple``)."""
        if not self._ramps():
            return self.max_size
        return max(self.max_size, self.size_at(self.end_epoch - 1))

    def sizes(self, epochs):
        """The side in pixels of each of the first ``epochs`` epochs."""
        return [self.size_at(e) for e in range(int(epochs))]

    def to_dict(self):
        """The schedule as the JSON-serialisable dict (``"kind": "progressive"``) of a
        transform's ``to_dict()`` and a saved state."""
        return {"kind": KIND, **asdict(self)}

    @classmethod
    def from_dict(cls, d):
        """The schedule of :meth:`to_dict`'s dict ``d``; ConfigError for another dict."""
        names = [f.name for f in fields(cls)]
        if not isinstance(d, dict) or d.get("kind") != KIND or set(d) != {"kind", *names}:
            raise ConfigError(f"size must be an int, (height, width) or "
                              f"dpu_pipe.progressive_size(...), got {d!r}")
        return cls(**{name: d[name] for name in names})


def progressive_size(min_size, max_size, start_epoch, end_epoch, multiple=32):
    """A train loader's output size that ramps up with the epoch, by FFCV's rule: pass it as
    ``size=`` to :class:`~dpu_pipe.Loader` (every mode).

    Parameters
    ----------
    min_size, max_size : int
        Side (pixels) up to ``start_epoch`` and from ``end_epoch`` on (FFCV's ``min_res`` and
        ``max_res``), ``min_size <= max_size``.
    start_epoch, end_epoch : int
        Last epoch at ``min_size`` and first at ``max_size`` (FFCV's ``start_ramp`` and
        ``end_ramp``), ``0 <= start_epoch <= end_epoch``. With equal epochs, that epoch is at
        ``min_size`` (FFCV tests ``start_epoch`` first) and the next at ``max_size``.
    multiple : int
        The epochs in between get the linear interpolation rounded (half to even) to a
        multiple of this (FFCV: 32).

    Returns
    -------
    ProgressiveSize
        Images are square, ``(B, 3, s, s)`` in epoch e with ``s = size_at(e)``.
    """
    return ProgressiveSize(min_size, max_size, start_epoch, end_epoch, multiple)
