"""Progressive resolution: an output size that changes with the epoch, as FFCV's ImageNet
recipes train (small images first, ramping up to the final size).

The rule is FFCV's (``get_resolution`` in libffcv/ffcv-imagenet's ``train_imagenet.py``):
``min_size`` up to ``start_epoch``, ``max_size`` from ``end_epoch`` on, and in between the
linear interpolation rounded to the nearest multiple of ``multiple``,
``round(interp / multiple) * multiple``. ``interp`` is computed as ``np.interp`` computes it
(``slope * (epoch - start_epoch) + min_size`` in double precision) and the rounding is
numpy's (``np.round``: half to even, 5.5 -> 6, 4.5 -> 4). The arithmetic runs in Python
floats, so every architecture gets the same sizes.

A :class:`ProgressiveSize` is plain frozen data: it travels in the stream spec (its
:meth:`~ProgressiveSize.to_dict` inside ``TransformConfig.to_dict()``), so a saved state or a
producer rank knows the whole schedule, and batch ``s`` of epoch ``e`` stays a pure function of
the spec.
"""

from dataclasses import dataclass

from . import _validate as _v
from .errors import ConfigError

__all__ = ["ProgressiveSize", "progressive_size", "KIND"]

#: The ``"kind"`` of a progressive size's dict in a transform's ``to_dict()``.
KIND = "progressive"


@dataclass(frozen=True)
class ProgressiveSize:
    """A square output size per epoch, in pixels, by FFCV's rule (see the module docstring).

    Build it with :func:`progressive_size`; the fields are checked by
    :func:`dpu_pipe._validate.progressive` either way.
    """

    min_size: int
    max_size: int
    start_epoch: int
    end_epoch: int
    multiple: int = 32

    def __post_init__(self):
        checked = _v.progressive(self.min_size, self.max_size, self.start_epoch,
                                 self.end_epoch, self.multiple)
        for name, value in zip(("min_size", "max_size", "start_epoch", "end_epoch",
                                "multiple"), checked):
            object.__setattr__(self, name, value)
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
        """The side of epoch ``epoch``'s output, in pixels (FFCV's rule).

        Parameters
        ----------
        epoch : int
            An epoch, >= 0.

        Returns
        -------
        int
            ``min_size`` up to ``start_epoch``, ``max_size`` from ``end_epoch``, else the
            interpolation rounded (half to even) to a multiple of ``multiple``.
        """
        epoch = int(epoch)
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
        """``[size_at(e) for e in range(epochs)]``: the side of each of the first ``epochs``
        epochs, in pixels."""
        return [self.size_at(e) for e in range(int(epochs))]

    def to_dict(self):
        """The schedule as a JSON-serialisable dict (``"kind": "progressive"``), as it goes
        in a transform's ``to_dict()`` and a saved state."""
        return {"kind": KIND, "min_size": self.min_size, "max_size": self.max_size,
                "start_epoch": self.start_epoch, "end_epoch": self.end_epoch,
                "multiple": self.multiple}

    @classmethod
    def from_dict(cls, d):
        """The schedule of :meth:`to_dict`'s dict ``d``; ConfigError for another dict."""
        keys = {"kind", "min_size", "max_size", "start_epoch", "end_epoch", "multiple"}
        if not isinstance(d, dict) or d.get("kind") != KIND or set(d) != keys:
            raise ConfigError(f"size must be an int, (height, width) or "
                                 f"dpu_pipe.progressive_size(...), got {d!r}")
        return cls(d["min_size"], d["max_size"], d["start_epoch"], d["end_epoch"],
                   d["multiple"])


def progressive_size(min_size, max_size, start_epoch, end_epoch, multiple=32):
    """A train loader's output size that ramps up with the epoch, by FFCV's rule: pass it
    as ``size=`` to :class:`~dpu_pipe.Loader` (every mode).

    Parameters
    ----------
    min_size : int
        Side (pixels) of the epochs up to ``start_epoch`` (FFCV's ``min_res``).
    max_size : int
        Side (pixels) from ``end_epoch`` on (FFCV's ``max_res``); >= ``min_size``.
    start_epoch : int
        Last epoch at ``min_size`` (FFCV's ``start_ramp``), >= 0.
    end_epoch : int
        First epoch at ``max_size`` (FFCV's ``end_ramp``), >= ``start_epoch``. The test for
        ``start_epoch`` comes first, as in FFCV: with ``end_epoch == start_epoch`` that epoch
        is still at ``min_size`` and the next one at ``max_size``.
    multiple : int
        The epochs in between get the linear interpolation rounded (half to even) to a
        multiple of this (FFCV: 32).

    Returns
    -------
    ProgressiveSize
        Frozen; ``size_at(epoch)`` gives an epoch's side, ``largest`` the side buffers are
        sized for. Images are square, ``(B, 3, s, s)`` in epoch e with ``s = size_at(e)``.

    Examples
    --------
    FFCV's ResNet-50 recipe (88 epochs: 160 px up to epoch 65, 192 px from epoch 76)::

        size = dpu_pipe.progressive_size(160, 192, start_epoch=65, end_epoch=76)
        loader = dpu_pipe.Loader("train/", 256, size=size)
    """
    return ProgressiveSize(min_size, max_size, start_epoch, end_epoch, multiple)
