"""The one error model of dpu_pipe.

Every error raised on purpose by dpu_pipe is a :class:`DpuPipeError`; each subclass also
derives from the builtin exception users would reach for (``ValueError``, ``TimeoutError``,
``RuntimeError``), so ``except ValueError`` keeps working around bad data.
"""

import traceback

__all__ = ["DpuPipeError", "DecodeError", "ConfigError", "ProducerError", "PipeTimeout",
           "TranscodeUnsupported", "error_record", "format_traceback"]


class DpuPipeError(Exception):
    """Base class of every error dpu_pipe raises on purpose."""


class DecodeError(DpuPipeError, ValueError):
    """A sample could not be decoded.

    ``message`` is the decoder's own words (libjpeg's message for JPEG data), ``index`` the
    sample index in its source (or position in a batch) and ``path`` its file, when known.
    """

    def __init__(self, message, *, index=None, path=None):
        self.message = message
        self.index = index
        self.path = path
        super().__init__(message)

    def __str__(self):
        where = []
        if self.index is not None:
            where.append(f"sample {self.index}")
        if self.path is not None:
            where.append(str(self.path))
        return f"{self.message} ({', '.join(where)})" if where else self.message


class ConfigError(DpuPipeError, ValueError):
    """An argument or configuration value is invalid; the message says what is accepted."""


class ProducerError(DpuPipeError, RuntimeError):
    """A producer (thread or DPU rank) failed; ``producer`` names it, ``remote_traceback``
    carries its traceback text."""

    def __init__(self, message, *, producer=None, remote_traceback=None):
        self.producer = producer
        self.remote_traceback = remote_traceback
        text = message if producer is None else f"{message} [in {producer}]"
        if remote_traceback:
            text += "\n\n--- traceback of the producer ---\n" + remote_traceback
        super().__init__(text)


def format_traceback(exc):
    """The traceback text of ``exc``, as ``traceback.format_exception`` prints it."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def error_record(exc, where=None):
    """What a failure in a producer (a DPU rank, a host thread, a validation thread) sends to
    the host that raises it: ``{"type": qualified class name, "message": str(exc),
    "traceback": text}``, plus ``"where"`` (who failed, e.g. the producer's rank) when
    given. The host raises it as a :class:`ProducerError`."""
    record = {"type": f"{type(exc).__module__}.{type(exc).__qualname__}",
              "message": str(exc), "traceback": format_traceback(exc)}
    if where is not None:
        record["where"] = where
    return record


class PipeTimeout(DpuPipeError, TimeoutError):
    """A bounded wait ran out: a producer or the consumer stopped answering."""


class TranscodeUnsupported(DecodeError):
    """A JPEG that :func:`dpu_pipe.jpeg.transcode` leaves as it is: libjpeg reads it only with a
    corrupt-data warning (truncated, extraneous bytes, an inconsistent progression — rewriting
    it would change what the decoder does with it), or this build cannot read its coefficients
    (arithmetic coding without arithmetic decoding). Keep the original bytes."""
