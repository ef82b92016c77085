"""DPULoader: batches produced by DPU (producer) ranks and delivered into this host's memory
over MPI one-sided RMA (:mod:`dpu_pipe.transport`).

Launch (one machine)::

    mpiexec -n 1 python -m mpi4py train.py : -n 2 python -m mpi4py -m dpu_pipe.worker

and on a cluster, hosts and DPUs as separate machines (MPMD)::

    mpiexec -hosts node1,node2 -n 2 python -m mpi4py train.py \\
          : -hosts node1-dpu,node2-dpu -n 16 python -m mpi4py -m dpu_pipe.worker

Every host rank builds its DPULoader(s) with the same sequence of calls; producer ranks need
no arguments: each one is assigned to a host (same hostname first, then the host whose name
its own extends, e.g. ``node1-dpu`` → ``node1``), and receives the pipeline spec (source
description, transform, batch size, seed, shard) from its host each time an iteration starts.
A host group with no producer falls back to producing locally.

The stream is the local :class:`~dpu_pipe.Loader`'s, bit for bit: producers run the same
:class:`~dpu_pipe.steps.StepProducer`, and the host consumes steps strictly in order.
"""

import atexit
import json
import logging
import os
import time

import numpy as np

from .errors import ConfigError, DpuPipeError
from .loader import Loader, _Run
from .mpi import load_mpi
from .transport import Consumer, discover_roles, host_comm

__all__ = ["DPULoader", "SPEC_TAG", "PAYLOAD_HEADER"]

log = logging.getLogger("dpu_pipe")

#: MPI tag of the pipeline spec a host sends its producers (None: shut down).
SPEC_TAG = 0x4450
SPEC_VERSION = 2

#: int64 words at the start of every payload, then labels int64[batch_size], then the images
#: (n samples), then ``bad_bytes`` of JSON {index: message} of newly skipped samples.
PAYLOAD_HEADER = ("n", "bad_bytes", "read_ns", "process_ns", "publish_ns", "reserved")
BAD_REPORT_BYTES = 16384

MODES = ("offload", "local")


def _mpi_running():
    """True when this process already initialized MPI (it was launched in an MPI job)."""
    import sys

    mod = sys.modules.get("mpi4py.MPI")
    return mod is not None and mod.Is_initialized() and not mod.Is_finalized()


class _HostSession:
    """This process's place in the MPI job as a host: its group (rank 0 = this host, then its
    producers), its index among the hosts. One per communicator; shuts producers down at
    exit."""

    _sessions = {}

    @classmethod
    def get(cls, comm):
        key = comm.py2f()
        if key not in cls._sessions:
            cls._sessions[key] = cls(comm)
        return cls._sessions[key]

    def __init__(self, comm):
        roles = discover_roles(comm, "host")
        self.group = host_comm(comm, roles)
        self.host_index = roles.hosts.index(roles.rank)
        self.num_hosts = len(roles.hosts)
        self.producers = self.group.Get_size() - 1
        me = roles.hostnames[roles.rank]
        #: True when a producer of this host runs on another machine (a DPU), or MPICH is
        #: told to act as if (MPIR_CVAR_NOLOCAL): its RMA then needs the host to make MPI
        #: progress.
        self.remote_producers = os.environ.get("MPIR_CVAR_NOLOCAL", "0") not in ("", "0") \
            or any(roles.hostnames[p] != me for p in roles.producers_of(roles.rank))
        self.active = None        # the _RemoteRun whose stream the producers serve
        self.open = True
        atexit.register(self.shutdown)

    def send_spec(self, spec):
        for p in range(1, self.group.Get_size()):
            self.group.send(spec, dest=p, tag=SPEC_TAG)

    def activate(self, run):
        """Make `run` the stream the producers serve; the one they served is suspended (its
        prefetched batches are dropped and re-made when it continues)."""
        if self.active is not None and self.active is not run:
            self.active.suspend()
        self.active = run

    def shutdown(self):
        """Release the producers: they leave their serving loop and exit."""
        if self.open:
            self.open = False
            if self.active is not None:
                self.active.suspend()
            self.send_spec(None)


class DPULoader(Loader):
    """:class:`~dpu_pipe.Loader` whose batches are made by DPU producer ranks.

    Same arguments and behaviour as :class:`~dpu_pipe.Loader` (``len``, ``set_epoch``,
    ``state_dict``/``load_state_dict``, ``on_error``, torch output), plus:

    Parameters
    ----------
    comm : mpi4py communicator, optional
        The job's communicator holding hosts and producers (default ``COMM_WORLD``).
        Construction is collective over the hosts of ``comm``.
    mode : "offload" or "local"
        ``"offload"``: producers make the batches (falls back to local when this host has no
        producer). ``"local"``: this host's threads do, as :class:`~dpu_pipe.Loader`.
    rank, world_size : int, optional
        Shard of this host; default: its index among the host ranks and their count.
    slots : int, optional
        Batch slots in the host's RMA window (default ``prefetch + 1``): host memory is
        about ``slots × batch bytes``.
    producer_threads : int
        Threads of each producer's batch kernel (one per DPU core is usual when several
        producer ranks share a DPU: keep 1).
    liveness_timeout : float
        Seconds without a heartbeat after which a producer counts as dead (PipeTimeout).
    progress : "auto", "thread" or "none"
        MPI progress while the host trains (see :mod:`dpu_pipe.transport`): "auto" runs the
        progress thread only when a producer is on another machine (a DPU); same-node
        producers move data through shared memory without it.
    progress_interval : float
        Seconds between the progress thread's MPI polls: CPU cost on the host against
        delivery latency.

    Several DPULoaders (train and val, say) share the producers: iterating one while
    another is mid-epoch suspends the other, whose prefetched batches are dropped and made
    again when it continues — and the batch it last yielded becomes invalid.
    """

    def __init__(self, source, batch_size, *, comm=None, mode="offload", rank=None,
                 world_size=None, slots=None, producer_threads=1, liveness_timeout=60.0,
                 progress="auto", progress_interval=5e-4, **kwargs):
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        if progress not in ("auto", "thread", "none"):
            raise ConfigError(f"progress must be 'auto', 'thread' or 'none', got {progress!r}")
        self._session = None
        if mode == "offload" or comm is not None or _mpi_running():
            # In an MPI job the hosts take part in role discovery whatever the mode, so the
            # shard defaults agree across modes and the producers are released at exit.
            MPI = load_mpi()
            self._session = _HostSession.get(MPI.COMM_WORLD if comm is None else comm)
            rank = self._session.host_index if rank is None else rank
            world_size = self._session.num_hosts if world_size is None else world_size
            if mode == "offload" and self._session.producers == 0:
                log.warning("DPULoader: no producer rank serves this host; producing locally")
                mode = "local"
        super().__init__(source, batch_size, rank=0 if rank is None else rank,
                         world_size=1 if world_size is None else world_size, **kwargs)
        self.mode = mode
        self.slots = self.prefetch + 1 if slots is None else int(slots)
        if self.slots < 1:
            raise ConfigError(f"slots must be >= 1, got {slots!r}")
        self.producer_threads = int(producer_threads)
        self.liveness_timeout = float(liveness_timeout)
        if progress == "auto":
            progress = "thread" if self._session and self._session.remote_producers else "none"
        self.progress = progress
        self.progress_interval = float(progress_interval)
        self._remote = {"bytes": 0, "batches": 0, "read_s": 0.0, "process_s": 0.0,
                        "publish_s": 0.0, "per_producer": {}}
        self._remote_bad = {}

    def spec(self):
        """What producers need to make this loader's stream (JSON-serialisable)."""
        p = self.producer
        return {"version": SPEC_VERSION, "source": self.source.spec(),
                "batch_size": self.batch_size, "transform": self.transform.to_dict(),
                "seed": p.seed, "shuffle": p.sampler.shuffle, "rank": p.sampler.rank,
                "world_size": p.sampler.world_size, "shard_tail": p.sampler.shard_tail,
                "drop_last": p.drop_last,
                "on_error": p.on_error, "num_threads": self.producer_threads}

    @property
    def payload_bytes(self):
        """Bytes of one slot's payload: header, labels, images, bad-sample report."""
        return (8 * len(PAYLOAD_HEADER) + 8 * self.batch_size
                + self.batch_size * self.transform.sample_bytes + BAD_REPORT_BYTES)

    def _make_run(self, epoch, start):
        if self.mode == "local":
            return super()._make_run(epoch, start)
        return _RemoteRun(self, epoch, start)

    @property
    def bad_samples(self):
        bad = dict(self.producer.bad_samples)
        bad.update(self._remote_bad)
        return bad

    def stats(self):
        """Loader counters plus, in offload mode, bytes received and the producers' own
        read/decode+augment/publish seconds, and steps per producer rank."""
        d = super().stats()
        if self.mode == "offload":
            r = self._remote
            d.update(bytes_received=r["bytes"], batches=r["batches"],
                     producer_read_s=r["read_s"], producer_process_s=r["process_s"],
                     producer_publish_s=r["publish_s"],
                     steps_per_producer=dict(r["per_producer"]))
        return d


class _RemoteRun(_Run):
    """One pass over the rest of an epoch, delivered by the host group's producers.

    The transport stream (spec sent, Consumer open) exists while the run is the session's
    active one; a suspended run reopens it at its next step.
    """

    def __init__(self, loader, epoch, start):  # not _Run.__init__: that starts a thread
        self.loader = loader
        self.epoch = epoch
        self.next_step = start
        self.end = len(loader)
        self.held = None
        self.consumer = None
        self.requested = start
        self.failed = None

    def _open(self):
        loader = self.loader
        session = loader._session
        session.activate(self)
        session.send_spec(loader.spec())
        self.consumer = Consumer(session.group, slots=loader.slots,
                                 slot_bytes=loader.payload_bytes, timeout=loader.timeout,
                                 liveness_timeout=loader.liveness_timeout,
                                 progress=loader.progress,
                                 progress_interval=loader.progress_interval)
        self.requested = self.next_step

    def __next__(self):
        loader = self.loader
        if self.failed is not None:
            raise DpuPipeError(f"this iteration ended with an error at epoch {self.epoch} "
                               f"step {self.next_step}: {self.failed}; start a new one")
        self._begin_next()
        if self.consumer is None:
            self._open()
        while self.requested < self.end and self.requested - self.next_step < loader.slots:
            self.consumer.request(self.epoch, self.requested)
            self.requested += 1
        t0 = time.perf_counter()
        try:
            batch = self.consumer.get()
        except BaseException as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            self.close()
            raise
        loader._wait_s += time.perf_counter() - t0
        if (batch.epoch, batch.step) != (self.epoch, self.next_step):
            self.failed = "out-of-order delivery"
            self.close()
            raise DpuPipeError(f"transport delivered epoch {batch.epoch} step {batch.step}, "
                               f"expected epoch {self.epoch} step {self.next_step}")
        images, labels = self._unpack(batch)
        self.held = batch
        self.next_step += 1
        loader._advance()
        return loader._emit(images, labels)

    def _release_held(self):
        if self.held is not None:
            self.held.release()
            self.held = None

    def _unpack(self, batch):
        loader = self.loader
        payload = batch.payload
        nh = len(PAYLOAD_HEADER)
        head = payload[:8 * nh].view(np.int64)
        n, bad_bytes, read_ns, process_ns, publish_ns = (int(v) for v in head[:5])
        at = 8 * nh
        labels = payload[at:at + 8 * loader.batch_size].view(np.int64)[:n]
        at += 8 * loader.batch_size
        size = n * loader.transform.sample_bytes
        images = payload[at:at + size].view(loader.transform.np_dtype).reshape(
            (n,) + loader.transform.sample_shape)
        if bad_bytes:
            report = json.loads(bytes(payload[at + size:at + size + bad_bytes]))
            for index, message in report.items():
                if int(index) not in loader._remote_bad:
                    loader._remote_bad[int(index)] = message
                    log.warning("producer %d skipped undecodable sample: %s", batch.producer,
                                message)
        r = loader._remote
        r["bytes"] += payload.nbytes
        r["batches"] += 1
        r["read_s"] += read_ns * 1e-9
        r["process_s"] += process_ns * 1e-9
        r["publish_s"] += publish_ns * 1e-9
        r["per_producer"][batch.producer] = r["per_producer"].get(batch.producer, 0) + 1
        loader.producer.timings["samples"] += n
        return images, labels

    def suspend(self):
        """Stop the transport stream but keep the position: the next step is requested again
        when the run continues."""
        self._release_held()
        if self.consumer is not None:
            consumer, self.consumer = self.consumer, None
            try:
                consumer.close()
            finally:
                session = self.loader._session
                if session.active is self:
                    session.active = None

    close = suspend
