"""The engines behind :class:`~dpu_pipe.Loader`, one per ``mode``: the contract
(:mod:`~dpu_pipe.engines.base`), ``mode="local"`` (:mod:`~dpu_pipe.engines.local`) and
``mode="offload"`` / ``"hybrid"`` (:mod:`~dpu_pipe.engines.offload`)."""
