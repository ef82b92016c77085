"""The engines behind :class:`~dpu_pipe.Loader`, one per ``mode``: what makes a loader's
batches.

- :mod:`~dpu_pipe.engines.base`: the :class:`~dpu_pipe.engines.base.Engine` contract;
- :mod:`~dpu_pipe.engines.local`: ``mode="local"``, a maker thread on this host (also the
  fallback of the offloaded modes, and the reference stream they reproduce);
- :mod:`~dpu_pipe.engines.offload`: ``mode="offload"`` and ``"hybrid"``, batches of the
  producer ranks (and of host threads in hybrid mode) from the host's window.
"""
