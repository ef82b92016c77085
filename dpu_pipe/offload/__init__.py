"""Offload to producer ranks (DPU cores) over MPI one-sided RMA.

``wire`` (byte layouts) → ``roles`` (who serves whom) → ``transport`` (window, tickets,
request channel) → ``host`` (:class:`DPULoader`) and ``worker`` (the producer loop).
"""
from .host import DPULoader

__all__ = ["DPULoader"]
