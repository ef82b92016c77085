"""Offload to producer ranks (DPU cores) over MPI one-sided RMA.

``wire`` (byte layouts) → ``roles`` (who serves whom) → ``transport`` (window, tickets,
request channel) and ``channel`` (the validation channel) → ``group`` (a host's place in the
job) → ``validation`` and ``host`` (:class:`DPULoader`); ``worker`` (the producer loop).
"""
from .engine import DPULoader

__all__ = ["DPULoader"]
