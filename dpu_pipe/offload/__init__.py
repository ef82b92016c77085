"""Offload to producer ranks (DPU cores) over MPI one-sided RMA.

``wire`` (byte layouts) → ``roles`` (who serves whom) → ``transport`` (window, tickets,
request channel) and ``channel`` (the validation channel) → ``group`` (a host's place in the
job) → ``validation``; ``producer_loop`` (the producer rank's loop). The host's engine of the
offloaded modes is :mod:`dpu_pipe.engines.offload`.
"""
