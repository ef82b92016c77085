"""torch is optional for dpu_pipe: the one place that imports it on demand."""

from .errors import ConfigError

__all__ = ["require_torch"]


def require_torch(why):
    """``torch``, or :class:`ConfigError` saying that ``why`` (what needs it, e.g.
    ``"output='torch'"``) needs PyTorch and how to install it."""
    try:
        import torch
    except ImportError:
        raise ConfigError(f"{why} needs PyTorch: pip install dpu_pipe[torch] "
                          f"(or pip install torch)") from None
    return torch
