"""The Loader: one front end over the engines that make batches (:mod:`dpu_pipe.engines`).

The :class:`Loader` owns what every engine shares — the position (epoch, step), the batch the
caller holds, the output conversion, the state and the stats — and asks its engine, chosen by
``mode``, for the next batch. Every engine makes batches with
:class:`~dpu_pipe.batch.BatchMaker`, so they are the same whoever makes them. States and
resuming: :mod:`dpu_pipe.resume`.
"""

import collections
import contextlib
import dataclasses
import os
import sys
import threading
import time
import warnings
import weakref

import numpy as np

from . import _validate as _v
from . import resume as _resume
from .batch import BatchMaker, MakerStats
from ._torch import require_torch
from .device import BatchOutput
from .engines import offload as _offload
from .engines.base import Cancelled
from .engines.local import LocalEngine
from .errors import ConfigError, DecodeError, PipeTimeout
from .kernel import BatchProcessor
from .offload.group import host_group, started_group
from .rng import check_epoch
from .sources import as_source
from .spec import StreamSpec
from .cache import DecodedCache, check_cache_bytes
from .offload.wire import CACHE_FIELDS
from .transforms import TransformConfig

__all__ = ["Loader", "DPULoader", "MODES", "default_shard"]

#: The engines a loader's ``mode`` picks.
MODES = ("offload", "hybrid", "local")

#: Seconds the consumer waits for one batch (also what ``timeout=0`` means).
DEFAULT_TIMEOUT = 300.0

#: Environment variables launchers set to the number of processes in the job.
_WORLD_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE",
                    "SLURM_NTASKS")


def default_shard(rank, world_size, group=None):
    """``(rank, world_size)``, what is unset taken from ``group`` (a
    :class:`~dpu_pipe.offload.group.HostGroup`: this host's index, the number of hosts) when
    it has producers or several hosts, else from an initialized ``torch.distributed``, else
    ``(0, 1)`` — with a warning when the launcher says this process is one of several."""
    if group is not None and (group.roles.producers or group.num_hosts > 1):
        rank = group.host_index if rank is None else rank
        world_size = group.num_hosts if world_size is None else world_size
    if rank is not None and world_size is not None:
        return rank, world_size
    # A job using torch.distributed has imported torch.
    dist = getattr(sys.modules.get("torch"), "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return (dist.get_rank() if rank is None else rank,
                dist.get_world_size() if world_size is None else world_size)
    for var in _WORLD_SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1 and world_size is None:
            warnings.warn(f"this process is one of {value} ({var}={value}) but rank and "
                          f"world_size were not given and torch.distributed is not "
                          f"initialized: this loader reads the whole dataset, as every other "
                          f"rank does. Pass rank= and world_size=, or initialize the process "
                          f"group first.", RuntimeWarning, stacklevel=4)
            break
    return (0 if rank is None else rank, 1 if world_size is None else world_size)


def _wait_range():
    """A ``dpu_pipe.wait`` profiler range when torch is imported (as DataLoader's wait)."""
    profiler = getattr(sys.modules.get("torch"), "profiler", None)
    return contextlib.nullcontext() if profiler is None else \
        profiler.record_function("dpu_pipe.wait")


class _EpochIter:
    """One pass over the rest of an epoch: what ``iter(loader)`` returns.

    A yielded batch's buffer is given back at the next ``next()``, so the last batch can be
    read after the loop. Superseded by a new ``iter()``, ``set_epoch``, ``load_state_dict``
    or ``close`` (from any thread, also while it waits), it raises :class:`ConfigError`;
    interrupted by a ``KeyboardInterrupt``, it ends and a new ``iter()`` continues with the
    batch it interrupted (docs/guides/threads.md).
    """

    def __init__(self, loader, engine, epoch, start):
        self.loader = loader
        self.engine = engine
        self.epoch = epoch
        self.next_step = start
        self.end = len(loader)
        self.why = None         # why this iteration stopped being current
        self.cancel = threading.Event()
        engine.cancel = self.cancel
        engine.start(epoch, start, self.end)

    def __iter__(self):
        return self

    def _stale(self):
        why = self.why or ("the loader started another iteration, or moved with "
                           "set_epoch/load_state_dict/close")
        return ConfigError(f"this iterator is no longer current: {why}")

    def __next__(self):
        loader = self.loader
        try:
            # Another thread that ends this iteration may hold the loader meanwhile.
            with loader._locked("next()", self.cancel):
                return self._next_locked(loader)
        except Cancelled:
            # The call that cancelled it ends it (and waits for the engine to stop).
            raise self._stale() from None

    def _next_locked(self, loader):
        if loader._iter is not self or self.why is not None:
            raise self._stale()
        with loader._state_lock:
            mark = (loader._epoch, loader._step, loader._yielded)
        try:
            return self._next(loader)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                # Interrupted (KeyboardInterrupt): engine and position start over from here.
                with loader._state_lock:
                    loader._epoch, loader._step, loader._yielded = mark
                loader._end_iteration()
            raise

    def _next(self, loader):
        if self.next_step >= self.end:
            loader._end_iteration()
            with loader._state_lock:
                loader._epoch += 1
                loader._step = 0
                # A wrapper fetching ahead trains on the epoch's last batch now (lookahead).
                loader._fetched.append((loader._epoch, 0))
            raise StopIteration
        self.engine.release_held()
        t0 = time.monotonic()
        with _wait_range():
            images, labels, indices = self.engine._next_data(self.epoch, self.next_step)
        with loader._state_lock:
            loader._wait_s += time.monotonic() - t0
        loader._check_bad()
        valid_rows = loader.maker.valid_rows(self.epoch, self.next_step)
        with loader._state_lock:
            loader._yielded += len(labels)
            loader.valid_rows = valid_rows
            self.next_step += 1
            loader._step += 1
            loader._fetched.append((loader._epoch, loader._step))
        x, y = loader.out.emit(images, labels)
        if loader.return_meta:
            return x, y, loader._meta(indices, valid_rows)
        return x, y


#: Every loader alive in this process (the fork handler gives each new locks).
_LIVE = weakref.WeakSet()


def _forked_child():
    for loader in list(_LIVE):
        loader._forked()


os.register_at_fork(after_in_child=_forked_child)


class Loader:
    """Iterable of ``(images, labels)`` batches (``(images, labels, meta)`` with
    ``return_meta``), decoded and augmented on this host or, with ``mode="offload"`` or
    ``"hybrid"``, by producer ranks (DPU cores) that put them into this host's memory over MPI
    one-sided RMA (launch: :mod:`dpu_pipe.engines.offload`). The stream is the same in every
    mode, bit for bit. Guides: docs/guides/loading.md, offload.md, caching.md, threads.md.

    Labels are the source's (int64 (B,) classes, or a :class:`~dpu_pipe.FileList`'s (B,) or
    (B, K) labels), a fresh array per batch. **Without** ``copy``, a device or
    ``pin_memory``, the images are a view of a reused ring buffer, valid until the next batch.

    Parameters
    ----------
    source : ImageFolder, FileList, PackedSource, or a dataset path
        A path is opened by :func:`dpu_pipe.sources.as_source`.
    batch_size : int
    train : bool
        RandomResizedCrop + flip (True) or resize + center crop (False).
    size : int, (height, width) or dpu_pipe.progressive_size(...)
        Output size in pixels; a :func:`~dpu_pipe.progressive_size` (train only) changes it
        with the epoch (buffers are sized for ``size.largest``).
    seed : int
        Keys the epoch permutation and every sample's augmentation.
    shuffle : bool, optional
        Shuffle every epoch (default: ``train``).
    shard_tail : "pad", "drop", "uneven" or "mask", optional
        The samples left over when ``world_size`` does not divide the dataset
        (:class:`dpu_pipe.sampler.EpochSampler`); ``"mask"`` pads and marks the padded rows
        not valid (:attr:`valid_rows`, ``meta["valid"]``). Default: ``"pad"`` when ``train``,
        else ``"mask"``.
    drop_last : bool
        Drop this rank's last partial batch, as ``DataLoader``'s ``drop_last``.
    rank, world_size : int, optional
        This process's shard; unset, see :func:`default_shard`.
    mode : "local", "offload" or "hybrid"
        Who makes the batches: this host's threads (``"local"``, no MPI), producer ranks
        (``"offload"``), or both from one ticket pool (``"hybrid"``: host threads work when
        fewer than ``slots // 2 + 1`` batches are ready, and take over a silent producer's
        work). The arguments down to ``serve_file`` apply to the offloaded modes.
    comm : mpi4py communicator, optional
        The job's (default ``COMM_WORLD``): the first offloaded loader starts the host group
        over it, collectively.
    host_threads : int
        Hybrid mode's batch-making host threads (default 1); memory: ``host_threads + 2``
        batches.
    slots : int, optional
        Batch buffers in the host's window, shared by the process's offloaded loaders
        (default ``prefetch + 1``).
    producer_threads : int
        Threads of each producer's batch kernel (keep 1 when producer ranks share a DPU).
    liveness_timeout : float
        Seconds without a heartbeat after which a producer is silent: offload mode raises
        :class:`PipeTimeout` naming it; hybrid mode takes over its work.
    hostmap : str, optional
        ``"host:producer,..."`` hostname pairs (:mod:`dpu_pipe.offload.roles`).
    serve_file : str or path, optional
        Join the producers of a job of their own (``dpu_pipe.worker --serve FILE``), for hosts
        started by ``torchrun`` (default: ``DPU_PIPE_SERVE``; :mod:`dpu_pipe.offload.rendezvous`).
    dtype : "float32", "float16", "bfloat16" or "uint8", or a numpy or torch dtype
        Floats are normalized by mean/std; bfloat16 needs torch output.
    layout : "CHW" or "HWC"
        Batches are (B, 3, H, W) or (B, H, W, 3).
    memory_format : torch.channels_last, optional
        Yield (B, 3, H, W) channels-last tensors (the kernel writes NHWC).
    output : "numpy", "torch", or None
        None: torch when a torch-only option (``device``, ``pin_memory``, ``memory_format``,
        a torch dtype, bfloat16) is given, else numpy.
    device : str or torch.device, optional
        Yield tensors on this device, copied asynchronously (:mod:`dpu_pipe.device`).
    pin_memory : bool
        Yield CPU tensors in pinned memory (ignored, with a warning, without an accelerator).
    num_threads, prefetch : int
        Threads decoding each batch; batches made ahead (memory: ``prefetch + 1`` batches).
    on_error : "raise" or "skip"
        See :class:`dpu_pipe.batch.BatchMaker`.
    max_bad : int, float or None
        With ``on_error="skip"``, the bad samples skipped at most (an int, or a fraction of
        the rank's shard); one more raises :class:`DecodeError`. None: no limit.
    copy : bool
        Yield images the caller owns.
    return_meta : bool
        Yield ``(images, labels, meta)``, ``meta`` a dict of columns: ``"index"`` (int64
        dataset index; a CPU tensor with torch output), ``"valid"`` (bool) and a list per key
        of the source's ``metadata(i)`` (e.g. ``"path"``).
    timeout : float
        Seconds the consumer waits for one batch before raising :class:`PipeTimeout`.
    lookahead : int
        Batches the framework fetches ahead of its training step (1 under Accelerate, else
        0): the batches are then copies and :meth:`state_dict` is the training step's.
    decode_max_side : int, optional
        Decode every sample whole, reduced to this longest side (pixels), and crop from that
        (:class:`~dpu_pipe.transforms.DecodeOptions`): part of the stream.
    cache_bytes : int
        Cache the images ``decode_max_side`` reduces in this many bytes (0: none), on the
        producers' nodes in the offloaded modes (docs/guides/caching.md).
    stick_to_shard : bool
        Every rank reads the same subset every epoch, reshuffled, so that a per-rank cache
        is hit (:class:`dpu_pipe.sampler.EpochSampler`).
    **transform_options
        More :class:`~dpu_pipe.transforms.TransformConfig` fields: ``scale``, ``ratio``,
        ``mean``, ``std``, the recipes (``auto_augment``, ``color_jitter``, ...), the batch
        ops (``mixup_alpha``, ``cutmix_alpha``, ``label_smoothing``, ``batch_hook``:
        :mod:`dpu_pipe.mix`) and ``views`` (``images`` is then a list, one per view).
    """

    def __init__(self, source, batch_size, *, train=True, size=224, seed=0, shuffle=None,
                 drop_last=False, shard_tail=None, dtype="float32", layout="CHW",
                 num_threads=1, prefetch=2, on_error="raise", rank=None, world_size=None,
                 output=None, copy=False, device=None, pin_memory=False, memory_format=None,
                 timeout=DEFAULT_TIMEOUT, return_meta=False, max_bad=None, lookahead=0,
                 mode="local", comm=None, host_threads=1, slots=None, producer_threads=1,
                 liveness_timeout=60.0, hostmap=None, serve_file=None, cache_bytes=0,
                 stick_to_shard=False, **transform_options):
        self._init_locks()
        self._pid = os.getpid()
        _LIVE.add(self)
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        #: Bytes of the decoded-sample cache (0: none): this loader's in local mode, the
        #: producers' node cache in the offloaded modes.
        self.cache_bytes = cache_bytes = _v.integer(cache_bytes, "cache_bytes", 0)
        self.host_threads = _v.integer(host_threads, "host_threads",
                                       1 if mode == "hybrid" else 0)
        #: The :class:`~dpu_pipe.offload.group.HostGroup` of an offloaded mode, else None.
        self._group = (host_group(comm, hostmap=hostmap, serve_file=serve_file)
                       if mode != "local" else None)
        _v.torch_loader_args(transform_options, type(self).__name__)
        self.lookahead = _v.integer(lookahead, "lookahead", 0)
        # A framework fetching ahead holds lookahead + 1 batches, more than the ring spares.
        copy = _v.boolean(copy, "copy") or self.lookahead > 0
        self.out = BatchOutput(dtype=dtype, layout=layout, output=output, device=device,
                               pin_memory=pin_memory, memory_format=memory_format, copy=copy)
        self.transform = TransformConfig(train=_v.boolean(train, "train"), size=size,
                                         dtype=self.out.dtype,
                                         layout=self.out.kernel_layout, **transform_options)
        shuffle = self.transform.train if shuffle is None else shuffle
        if shard_tail is None:
            shard_tail = "pad" if self.transform.train else "mask"
        self.prefetch = _v.positive_int(prefetch, "prefetch")
        self.num_threads = _v.positive_int(num_threads, "num_threads")
        self.source = as_source(source)
        # A local loader never starts a host group, but shards as one its process has.
        rank, world_size = default_shard(rank, world_size, self._group or started_group())
        #: What this loader's batches are made from (:class:`~dpu_pipe.spec.StreamSpec`).
        self.stream_spec = StreamSpec(self.source, batch_size, self.transform, seed=seed,
                                      shuffle=shuffle, rank=rank, world_size=world_size,
                                      shard_tail=shard_tail, drop_last=drop_last,
                                      on_error=on_error, stick_to_shard=stick_to_shard)
        self.output = self.out.output
        self.copy = self.out.copy
        self.return_meta = _v.boolean(return_meta, "return_meta")
        self.timeout = self.out.timeout = _v.deadline(timeout, "timeout", DEFAULT_TIMEOUT)
        if cache_bytes and self.transform.decode.decode_max_side is None:
            raise ConfigError("cache_bytes needs decode_max_side: the cache holds the whole "
                              "images decode_max_side reduces (e.g. decode_max_side=256)")
        if cache_bytes:
            check_cache_bytes(cache_bytes, len(self.source))
        #: The makers' :class:`~dpu_pipe.cache.DecodedCache` (local mode only), or None.
        self.cache = DecodedCache(cache_bytes, len(self.source)) \
            if cache_bytes and mode == "local" else None
        #: This host's :class:`~dpu_pipe.batch.BatchMaker` (thread 0's in hybrid mode).
        self.maker = BatchMaker(self.stream_spec, self.num_threads, self.cache)
        self.batch_size = self.maker.batch_size
        self.max_bad = max_bad
        self._bad_limit = _v.bad_budget(max_bad, len(self.maker.sampler))
        if self._bad_limit is not None and self.maker.on_error != "skip":
            raise ConfigError("max_bad applies with on_error='skip' (with on_error='raise' "
                              "the first bad sample raises)")
        self._engine = None       # made on first iteration, chosen by mode
        self._iter = None         # the current _EpochIter
        self._closed = False      # close()d, and not iterated since: nothing for __del__ to stop
        self._epoch = 0
        self._step = 0            # batches of self._epoch already yielded
        # Positions after the last lookahead + 1 batches fetched: the oldest is the consumer's.
        self._fetched = collections.deque([(0, 0)], maxlen=self.lookahead + 1)
        self._wait_s = 0.0
        self._yielded = 0         # samples handed to the caller, all epochs
        #: Rows of the batch last yielded that count (its first rows); 0 before the first.
        self.valid_rows = 0
        self._created = time.perf_counter()
        self._mark = None         # (perf_counter, counters) of the last stats(interval=True)
        self.slots = self.prefetch + 1 if slots is None else _v.positive_int(slots, "slots")
        self.producer_threads = _v.positive_int(producer_threads, "producer_threads")
        self.liveness_timeout = _v.seconds(liveness_timeout, "liveness_timeout")
        #: The mode asked for, or ``"local"`` when no producer serves this host.
        self.mode = mode if mode == "local" else _offload.prepare(self, mode)
        if self.mode == "local" and cache_bytes and self.cache is None:
            self.cache = DecodedCache(cache_bytes, len(self.source))
            self.maker = BatchMaker(self.stream_spec, self.num_threads, self.cache)

    # ``_lock`` (re-entrant) is held by whatever moves the loader or drives its engine
    # (next(), iter(), set_epoch, load_state_dict, close), so the engine is never driven from
    # two threads. ``_state_lock`` guards the position and counters for the readers
    # (state_dict, stats), who never wait for a batch. See docs/guides/threads.md.

    def _init_locks(self):
        self._lock = threading.RLock()
        self._state_lock = threading.Lock()
        self._describe_lock = threading.Lock()
        self._describe_kernel = None     # describe()'s own batch kernel, made on first use

    @contextlib.contextmanager
    def _locked(self, what, cancel=None):
        """Hold ``_lock`` for ``what`` (a holder lets go within one batch, or when superseded);
        with ``cancel`` (an Event), the wait raises :class:`Cancelled` once it is set."""
        limit = getattr(self, "timeout", DEFAULT_TIMEOUT) + 5.0
        deadline = time.monotonic() + limit
        while not self._lock.acquire(timeout=limit if cancel is None else 0.05):
            if cancel is not None and cancel.is_set():
                raise Cancelled()
            if time.monotonic() >= deadline:
                raise PipeTimeout(f"{what}: another thread kept the loader busy for "
                                  f"{limit:.0f} s")
        try:
            if self._pid != os.getpid():
                self._after_fork()
            yield
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def _moving(self, why):
        """Hold the loader to move it (``why``), ending the current iteration in any thread."""
        it = getattr(self, "_iter", None)
        if it is not None and it.why is None:
            it.why = f"{why} (in thread {threading.current_thread().name!r})"
            it.cancel.set()
        with self._locked(why):
            self._end_iteration()
            yield

    def _forked(self):
        """In a forked child, at once: the parent's threads did not come along, and what they
        used may have been caught in use. New locks; the engine and iteration are dropped."""
        self._init_locks()
        it = getattr(self, "_iter", None)     # (a loader still in __init__ has none)
        if it is not None:
            it.why = "the process forked; iterate the loader again"
        self._iter = None
        self._engine = None
        if getattr(self, "maker", None) is not None:
            self.maker._busy_lock = threading.Lock()

    def _after_fork(self):
        """First use in a forked child: a new maker (position kept); offloaded modes refuse."""
        if self.mode != "local":
            raise ConfigError(
                f"{type(self).__name__}(mode={self.mode!r}) used in a process forked from the "
                f"one that made it: the host window and the producers belong to the MPI "
                f"process that joined them. Use it in that process only (a DataLoader over it "
                f"needs num_workers=0), or make a Loader in the child")
        self._pid = os.getpid()
        self._set_stream(self.stream_spec)

    def __len__(self):
        """Batches of the current epoch on this rank (fewer in one continued elastically)."""
        return self.maker.batches_in(self._epoch)

    @property
    def epoch(self):
        return self._epoch

    def __iter__(self):
        with self._moving("a new iter()"):
            with self._state_lock:
                if self._step >= len(self) > 0:
                    self._epoch += 1
                    self._step = 0
                self._fetched.clear()
                self._fetched.append((self._epoch, self._step))
            if self._engine is None and self.mode == "local":
                self._engine = LocalEngine(self.maker, self.prefetch, self.timeout)
            elif self._engine is None:
                self._engine = _offload.OffloadEngine(self)
            self._iter = _EpochIter(self, self._engine, self._epoch, self._step)
            self._closed = False
            return self._iter

    def set_epoch(self, epoch):
        """Start epoch ``epoch`` at its first batch on the next iteration, unless it is the
        current epoch: its position is then kept, so ``load_state_dict(ckpt)`` then
        ``set_epoch(ep)`` resumes where the restored epoch stopped (to restart it,
        ``load_state_dict`` a state with ``step`` 0)."""
        epoch = check_epoch(epoch)
        if epoch == self._epoch:
            return
        with self._moving(f"set_epoch({epoch})"), self._state_lock:
            if epoch != self._epoch:        # (another thread may have moved it meanwhile)
                self._epoch, self._step = epoch, 0

    def state_dict(self):
        """Position in the stream (JSON-serialisable; with ``lookahead``, the training
        step's): restored in any process, the rest of the stream is bit-identical."""
        with self._state_lock:
            epoch, step = self._epoch, self._step
            if self._fetched[-1] == (epoch, step):    # else set_epoch/load_state_dict moved it
                epoch, step = self._fetched[0]
            spec = self.stream_spec
        return _resume.state_of(spec, epoch, step)

    def load_state_dict(self, state, elastic=False):
        """Continue from ``state`` (:meth:`state_dict` of a loader of the same dataset and
        arguments) on the next iteration; :class:`ConfigError` when it does not fit.

        With ``elastic=True`` the state may come from a job of another ``world_size``,
        ``rank`` or ``batch_size`` whose ranks all stood at the same step (as under DDP): the
        rest of the saved epoch, sharded over this job's ranks, has fewer batches (``len()``)
        and its steps count from 0. ``state`` is then one rank's state or the list of every
        saved rank's. See "Elastic resume" in docs/guides/loading.md.
        """
        elastic = _v.boolean(elastic, "elastic")
        # Checked before the current iteration is told to end: a bad state changes nothing.
        _resume.resume_position(self.stream_spec, state, elastic)
        with self._moving("load_state_dict()"):
            resume, epoch, step = _resume.resume_position(self.stream_spec, state, elastic)
            spec = dataclasses.replace(self.stream_spec, resume=resume)
            if spec != self.stream_spec:
                self._set_stream(spec)
            with self._state_lock:
                self._epoch, self._step = epoch, step

    def _set_stream(self, spec):
        """A new maker for ``spec`` (same counters and bad samples); a new engine."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        maker = BatchMaker(spec, self.num_threads, self.cache)
        maker.stats, maker.bad_samples = self.maker.stats, self.maker.bad_samples
        with self._state_lock:
            self.stream_spec = spec
            self.maker = maker

    def iterable_dataset(self):
        """This loader as a ``torch.utils.data.IterableDataset`` (:mod:`dpu_pipe.torch_dataset`)."""
        from .torch_dataset import LoaderDataset
        return LoaderDataset(self)

    def _makers(self, engine):
        return engine.makers if engine is not None else (self.maker,)

    def describe(self, epoch, index):
        """The augmentation parameters dataset sample ``index`` gets in ``epoch``, in every
        mode: a dict (:meth:`dpu_pipe.kernel.BatchProcessor.describe`), with ``"mix"`` when
        the loader mixes or smooths labels (:meth:`dpu_pipe.batch.BatchMaker.describe_mix`);
        with ``views``, a list of dicts, one per view."""
        index = _v.integer(index, "index", 0, len(self.source) - 1)
        epoch = check_epoch(epoch)
        maker = self.maker
        data = self.source.read(index)
        # A kernel of its own: the makers' are in use by the threads making batches.
        transform = self.stream_spec.transform.at_epoch(epoch)
        with self._describe_lock:
            if self._describe_kernel is None or self._describe_kernel.config != transform:
                self._describe_kernel = BatchProcessor(transform, 1)
            out = self._describe_kernel.describe(data, index, epoch=epoch, seed=maker.seed)
        if maker.batch_ops.soft:
            for d in out if isinstance(out, list) else [out]:
                d["mix"] = maker.describe_mix(epoch, index)
        return out

    def _check_bad(self):
        """Raise :class:`DecodeError` once more samples are bad than ``max_bad`` allows."""
        if self._bad_limit is None:
            return
        bad = self.bad_samples
        if len(bad) > self._bad_limit:
            first = "; ".join(list(bad.values())[:5])
            raise DecodeError(f"{len(bad)} bad samples, more than max_bad={self.max_bad} "
                              f"allows ({self._bad_limit} of this rank's "
                              f"{len(self.maker.sampler)}); the first: {first}")

    @property
    def bad_samples(self):
        """{sample index: message} of the samples skipped as undecodable (on_error='skip')."""
        engine = self._engine
        bad = {}
        for m in self._makers(engine):
            bad.update(m.bad_samples)
        if engine is not None:
            bad.update(engine.remote_bad)
        return bad

    def stats(self, interval=False):
        """Per-stage counters: seconds reading bytes (``read_s``) and in decode+augment
        (``process_s``), batches and samples made, seconds the consumer waited (``wait_s``);
        with a device, how batches reach it (:mod:`dpu_pipe.device`); in an offloaded mode,
        what the producers sent (:meth:`~dpu_pipe.engines.offload.OffloadEngine.stats`); with
        a cache, ``"cache"``.

        ``interval=True`` returns rates since the previous ``stats(interval=True)`` (or the
        loader's making) instead: ``seconds``, ``samples`` (yielded), ``img_per_s``,
        ``data_wait_share`` (of the interval spent waiting), ``producer_busy_share`` (the
        makers' read and decode seconds over the interval times their number; producers
        report a batch's seconds on arrival, so a short interval can read above 1) and
        ``bad_samples``."""
        engine = self._engine
        made = MakerStats()
        for m in self._makers(engine):
            made += m.stats
        d = engine.stats(made) if engine is not None else made.as_dict()
        d["wait_s"] = self._wait_s
        d.update(self.out.stats())
        if self.cache is not None:
            d["cache"] = self.cache.stats()
        elif self.cache_bytes:
            d["cache"] = engine.cache_stats() if engine is not None else \
                dict.fromkeys(CACHE_FIELDS, 0)
        if not interval:
            return d
        bad = len(self.bad_samples)
        with self._state_lock:
            # One clock reading for the interval and the busy seconds, so they never outgrow it.
            now = time.perf_counter()
            busy = engine.busy(d) if engine is not None else None
            busy, makers = busy or (sum(m.busy_s(now) for m in self._makers(engine)),
                                    self.num_threads)
            counts = (self._yielded, self._wait_s, busy, bad)
            then, last = self._mark or (self._created, (0, 0.0, 0.0, 0))
            self._mark = (now, counts)
        dt = max(now - then, 1e-9)
        samples, wait_s, busy_s, bad = (new - old for new, old in zip(counts, last))
        return {"seconds": dt, "samples": samples, "img_per_s": samples / dt,
                "data_wait_share": wait_s / dt,
                "producer_busy_share": busy_s / (dt * max(1, makers)), "bad_samples": bad}

    def _meta(self, indices, valid_rows):
        """``meta`` of a batch of samples ``indices``, its first ``valid_rows`` valid."""
        index = np.array(indices, dtype=np.int64)    # a copy: ``indices`` is a ring buffer
        valid = np.arange(len(index)) < valid_rows
        lookup = getattr(self.source, "metadata", None)
        rows = [lookup(i) for i in index.tolist()] if lookup is not None else []
        meta = {"index": index, "valid": valid}
        for key in (rows[0] if rows else ()):
            if key not in meta:
                meta[key] = [r[key] for r in rows]
        if self.output == "torch":
            torch = require_torch("output='torch'")
            meta["index"] = torch.from_numpy(index)
            meta["valid"] = torch.from_numpy(valid)
        return meta

    def _end_iteration(self):
        # Nothing is fetched ahead of a position the iteration does not continue from.
        if getattr(self, "_fetched", None) is not None:
            with self._state_lock:
                self._fetched.clear()
                self._fetched.append((self._epoch, self._step))
        if getattr(self, "_iter", None) is not None:
            self._iter = None
            self._engine.pause()

    def close(self):
        """Stop background work and release buffers (idempotent); an iteration in progress
        ends. The loader can be iterated again afterwards."""
        if getattr(self, "_lock", None) is None or self._pid != os.getpid():
            # __init__ failed early, or a forked child's copy of the parent's threads and window.
            return
        with self._moving("close()"):
            if getattr(self, "_engine", None) is not None:
                self._engine.close()
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # Finalizers run in whatever thread allocates, maybe one that another thread holding
        # close()'s transport lock waits for: so close in a new thread (none at exit). Not for
        # a closed loader: that daemon thread would free its buffers (with a device, torch
        # tensors), and one that the interpreter's exit stops inside C++ code aborts the process.
        if getattr(self, "_closed", False) or (getattr(self, "_engine", None) is None
                                               and getattr(self, "_iter", None) is None):
            return
        if sys.is_finalizing():
            with contextlib.suppress(Exception):
                self.close()
            return
        with contextlib.suppress(Exception):
            threading.Thread(target=self.close, name="dpu_pipe-finalize", daemon=True).start()


class DPULoader(Loader):
    """:class:`Loader` with ``mode="offload"`` by default (batches made by producer ranks,
    DPU cores); ``DPULoader(..., mode="hybrid")`` is ``Loader(..., mode="hybrid")``."""

    def __init__(self, source, batch_size, *, mode="offload", **kwargs):
        super().__init__(source, batch_size, mode=mode, **kwargs)
