"""PyTorch is optional: the one place that imports it on demand."""

from .errors import ConfigError

__all__ = ["torch_module"]


def torch_module(why):
    """``torch``, or :class:`ConfigError` saying what needs it (``why``) and how to install
    it."""
    try:
        import torch
    except ImportError:
        raise ConfigError(f"{why} needs PyTorch: pip install dpu_pipe[torch] "
                          f"(or pip install torch)") from None
    return torch
