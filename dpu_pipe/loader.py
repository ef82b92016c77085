"""The Loader: one front end over engines that make batches.

The :class:`Loader` owns what every engine shares — the position in the stream (epoch, step),
the batch the caller holds, the output conversion, the state and the stats — and asks its
engine (:mod:`dpu_pipe.engines`, chosen by ``mode``) for one thing, the next batch. Every
engine makes the stream of the loader's :class:`~dpu_pipe.spec.StreamSpec` with
:class:`~dpu_pipe.batch.BatchMaker` objects, so the batches are the same whoever makes them.
States and resuming are :mod:`dpu_pipe.resume`'s.
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
    """``(rank, world_size)`` with what was left unset taken from ``group`` (a
    :class:`~dpu_pipe.offload.group.HostGroup`: this host's index among the hosts and their
    count) when it has producers or more than one host, else from ``torch.distributed`` when
    it is initialized, else ``(0, 1)`` — with a warning when the launcher says this process
    is one of several (every rank would then read the whole dataset)."""
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
    """``torch.profiler.record_function("dpu_pipe.wait")`` when torch is imported (the wait
    for a batch shows in profiler traces, as torch DataLoader's does), else nothing."""
    profiler = getattr(sys.modules.get("torch"), "profiler", None)
    return contextlib.nullcontext() if profiler is None else \
        profiler.record_function("dpu_pipe.wait")


class _EpochIter:
    """One pass over the rest of an epoch: what ``iter(loader)`` returns.

    A yielded batch's buffer is given back at the start of the next ``next()``, so the last
    batch can still be read after the loop. An iteration superseded by a new ``iter()``,
    ``set_epoch``, ``load_state_dict`` or ``close`` (from any thread, also while it waits)
    raises :class:`ConfigError`; one interrupted by a ``KeyboardInterrupt`` ends, and a new
    ``iter()`` continues with the batch it interrupted (docs/guides/threads.md).
    """

    def __init__(self, loader, engine, epoch, start):
        self.loader = loader
        self.engine = engine
        self.epoch = epoch
        self.next_step = start
        self.end = len(loader)
        #: Why this iteration stopped being current (set by the call that ended it).
        self.why = None
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
            # Waiting for the loader, not only for a batch, ends when another thread ends
            # this iteration: it may hold the loader while the engine finishes a batch.
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
                # Interrupted anywhere (KeyboardInterrupt, SystemExit): the batch was not
                # handed out, and the engine and the position may disagree on which comes
                # next. Back to the position before this call, iteration ended.
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
                # The wrapper that fetched ahead learns here that the epoch ended; the batch
                # it trains on now is the last one (see Loader's ``lookahead``).
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
    ``pin_memory``, the images are a view of a reused ring buffer: valid only until the next
    batch is requested.

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
        Shuffle every epoch (default: ``train``; evaluation reads in index order).
    shard_tail : "pad", "drop", "uneven" or "mask", optional
        The samples left over when ``world_size`` does not divide the dataset
        (:class:`dpu_pipe.sampler.EpochSampler`); ``"mask"`` pads as ``"pad"`` and marks the
        padded rows not valid (:attr:`valid_rows`, ``meta["valid"]``). Default: ``"pad"``
        when ``train``, ``"mask"`` otherwise.
    drop_last : bool
        Drop this rank's last partial batch, as ``DataLoader``'s ``drop_last``.
    rank, world_size : int, optional
        This process's shard; unset, see :func:`default_shard`.
    mode : "local", "offload" or "hybrid"
        Who makes the batches: this host's threads (``"local"``, no MPI), producer ranks
        (``"offload"``), or both from one ticket pool (``"hybrid"``: host threads work when
        fewer than ``slots // 2 + 1`` batches are ready, and take over the work of a silent
        producer). The arguments down to ``serve_file`` apply to the offloaded modes.
    comm : mpi4py communicator, optional
        The job's communicator (default ``COMM_WORLD``): the first offloaded loader of a
        process starts the host group, collectively over it.
    host_threads : int
        Threads making batches on the host in hybrid mode (default 1); host memory grows by
        ``(host_threads + 2) × batch bytes``.
    slots : int, optional
        Batch buffers in the host's window (default ``prefetch + 1``), shared by the
        process's offloaded loaders (sized for the largest).
    producer_threads : int
        Threads of each producer's batch kernel (keep 1 when producer ranks share a DPU).
    liveness_timeout : float
        Seconds without a producer's heartbeat after which it counts as silent: offload mode
        raises :class:`PipeTimeout` naming it; hybrid mode takes over its work.
    hostmap : str, optional
        ``"host:producer,..."`` hostname pairs (:mod:`dpu_pipe.offload.roles`).
    serve_file : str or path, optional
        Join the producers of a job of their own (``dpu_pipe.worker --serve FILE``), for
        hosts started by ``torchrun`` (default: ``DPU_PIPE_SERVE``;
        :mod:`dpu_pipe.offload.rendezvous`).
    dtype : "float32", "float16", "bfloat16" or "uint8", or a numpy or torch dtype
        Float outputs are normalized by mean/std. bfloat16 needs torch output.
    layout : "CHW" or "HWC"
        Batches are (B, 3, H, W) or (B, H, W, 3).
    memory_format : torch.channels_last, optional
        The kernel writes NHWC and the loader yields (B, 3, H, W) channels-last tensors.
    output : "numpy", "torch", or None
        None means torch when a torch-only option (``device``, ``pin_memory``,
        ``memory_format``, a torch dtype, bfloat16) is given, numpy otherwise.
    device : str or torch.device, optional
        Yield tensors on this device, copied asynchronously (see :mod:`dpu_pipe.device`).
    pin_memory : bool
        Yield CPU tensors in pinned memory (ignored, with a warning, without an accelerator).
    num_threads : int
        Threads decoding each batch.
    prefetch : int
        Batches produced ahead: memory is ``(prefetch + 1) × batch bytes``.
    on_error : "raise" or "skip"
        See :class:`dpu_pipe.batch.BatchMaker`.
    max_bad : int, float or None
        With ``on_error="skip"``, at most this many bad samples (an int), or this fraction
        of the rank's shard (a float in [0, 1]), are skipped; one more raises a
        :class:`DecodeError` naming the first failures. None: no limit.
    copy : bool
        Yield images the caller owns.
    return_meta : bool
        Yield ``(images, labels, meta)``: a dict of columns, one entry per row —
        ``"index"`` (int64 dataset index; a CPU tensor with torch output), ``"valid"`` (bool)
        and a list per key of the source's ``metadata(i)`` (e.g. ``"path"``).
    timeout : float
        Seconds the consumer waits for one batch before raising :class:`PipeTimeout`.
    lookahead : int
        Batches the caller's framework fetches ahead of its training step (1 under
        Accelerate, 0 for a plain loop and Lightning). Then the yielded batches are copies
        and :meth:`state_dict` is the position of the training step, not of the batch
        fetched ahead.
    decode_max_side : int, optional
        Decode every sample whole, reduced to this longest side (pixels), and cut its crop
        from that (see :class:`~dpu_pipe.transforms.DecodeOptions`): part of the stream.
    cache_bytes : int
        Keep the reduced images of ``decode_max_side`` in a cache of this many bytes (0: no
        cache), so later epochs need no decode; the producers' node cache in the offloaded
        modes. See docs/guides/caching.md.
    stick_to_shard : bool
        Every rank reads the same subset every epoch (reshuffled within it), so that a
        per-rank cache is hit: see :class:`dpu_pipe.sampler.EpochSampler`.
    **transform_options
        More :class:`~dpu_pipe.transforms.TransformConfig` fields: ``scale``, ``ratio``,
        ``mean``, ``std``, the recipes (``auto_augment``, ``color_jitter``, ...), the batch
        ops (``mixup_alpha``, ``cutmix_alpha``, ``label_smoothing``, ``batch_hook``:
        :mod:`dpu_pipe.mix`) and ``views`` (``images`` then a list, one batch per view).
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
        _LIVE.add(self)
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        #: Bytes of the decoded-sample cache (0: none): this loader's in local mode, the
        #: producers' node cache in the offloaded modes.
        self.cache_bytes = cache_bytes = _v.integer(cache_bytes, "cache_bytes", 0)
        self.host_threads = _v.integer(host_threads, "host_threads",
                                       1 if mode == "hybrid" else 0)
        #: The host group of an offloaded mode (:class:`~dpu_pipe.offload.group.HostGroup`);
        #: None in local mode.
        self._group = None
        if mode != "local":
            self._group = host_group(comm, hostmap=hostmap, serve_file=serve_file)
        _v.torch_loader_args(transform_options, type(self).__name__)
        self.lookahead = _v.integer(lookahead, "lookahead", 0)
        # A framework fetching ahead holds lookahead + 1 batches: ring buffers would be
        # overwritten under the one it trains on.
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
        #: This process's decoded-sample cache (:class:`~dpu_pipe.cache.DecodedCache`), shared
        #: by the loader's makers, or None. Local mode only: the offloaded modes cache on the
        #: producers, and the host's memory is the training's.
        self.cache = DecodedCache(cache_bytes, len(self.source)) \
            if cache_bytes and mode == "local" else None
        #: The :class:`~dpu_pipe.batch.BatchMaker` of this host (the local engine's; thread
        #: 0's in hybrid mode); it also gives the stream's geometry.
        self.maker = BatchMaker(self.stream_spec, self.num_threads, self.cache)
        self.batch_size = self.maker.batch_size
        self.max_bad = max_bad
        self._bad_limit = _v.bad_budget(max_bad, len(self.maker.sampler))
        if self._bad_limit is not None and self.maker.on_error != "skip":
            raise ConfigError("max_bad applies with on_error='skip' (with on_error='raise' "
                              "the first bad sample raises)")
        self._engine = None       # made on first iteration, chosen by mode
        self._iter = None         # the current _EpochIter
        self._epoch = 0
        self._step = 0            # batches of self._epoch already yielded
        # Positions after each of the last lookahead + 1 batches handed out (and the epoch
        # end, once fetched): the oldest is the consumer's (see lookahead).
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
        #: The engine's mode: the one asked for, or ``"local"`` when no producer serves this
        #: host (which then caches as a local loader does).
        self.mode = mode if mode == "local" else _offload.prepare(self, mode)
        if self.mode == "local" and cache_bytes and self.cache is None:
            self.cache = DecodedCache(cache_bytes, len(self.source))
            self.maker = BatchMaker(self.stream_spec, self.num_threads, self.cache)

    def _new_engine(self):
        """The engine of :attr:`mode`."""
        if self.mode == "local":
            return LocalEngine(self.maker, self.prefetch, self.timeout)
        return _offload.OffloadEngine(self)

    # --- threads ------------------------------------------------------------------------
    # ``_lock`` (re-entrant) is held by whatever moves the loader or drives its engine:
    # next(), iter(), set_epoch, load_state_dict, close — one thread at a time, so the
    # engine (its queues, its maker's kernel, the host window) is never driven from two
    # threads. ``_state_lock`` guards the position and counters for the readers (state_dict,
    # stats), who never wait for a batch. See docs/guides/threads.md.

    def _init_locks(self):
        self._lock = threading.RLock()
        self._state_lock = threading.Lock()
        self._describe_lock = threading.Lock()
        self._describe_kernel = None     # describe()'s own batch kernel, made on first use
        self._pid = os.getpid()

    @contextlib.contextmanager
    def _locked(self, what, cancel=None):
        """Hold ``_lock`` for ``what`` (its holder lets go within one batch, or at once when
        superseded); with ``cancel`` (an Event), the wait raises :class:`Cancelled` once it
        is set."""
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
        """Hold the loader to move it (``why``), the current iteration ended — also when
        another thread waits in it."""
        self._supersede(why)
        with self._locked(why):
            self._end_iteration()
            yield

    def _supersede(self, why):
        """Tell the current iteration (another thread may wait in it) that ``why`` ends it."""
        it = getattr(self, "_iter", None)
        if it is not None and it.why is None:
            it.why = f"{why} (in thread {threading.current_thread().name!r})"
            it.cancel.set()

    def _forked(self):
        """In the child of a fork, at once: the parent's threads did not come along, and the
        locks, queues and kernels they used may have been caught in use. New locks; the
        engine and the iteration are dropped, the maker is remade at the next use."""
        pid = self._pid
        self._init_locks()
        self._pid = pid
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

    # --- position in the stream ---------------------------------------------------------

    def __len__(self):
        """Batches of the loader's current epoch on this rank (fewer in the epoch continued
        by an elastic resume)."""
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
            if self._engine is None:
                self._engine = self._new_engine()
            self._iter = _EpochIter(self, self._engine, self._epoch, self._step)
            return self._iter

    def set_epoch(self, epoch):
        """Start epoch ``epoch`` at its first batch on the next iteration — unless ``epoch``
        is the loader's current epoch: then its position is kept, so the torch habit of
        ``load_state_dict(ckpt)`` then ``set_epoch(ep)`` resumes the restored epoch where it
        stopped. To restart the current epoch, ``load_state_dict`` a state with ``step`` 0.
        """
        epoch = check_epoch(epoch)
        if epoch == self._epoch:
            return
        with self._moving(f"set_epoch({epoch})"), self._state_lock:
            if epoch != self._epoch:        # (another thread may have moved it meanwhile)
                self._epoch, self._step = epoch, 0

    def state_dict(self):
        """Position in the stream (JSON-serialisable): restoring it, in this or a new
        process, makes the remaining stream bit-identical to an uninterrupted run. With
        ``lookahead``, the position of the training step, not of the batches fetched
        ahead."""
        with self._state_lock:
            epoch, step = self._epoch, self._step
            if self._fetched[-1] == (epoch, step):    # else set_epoch/load_state_dict moved it
                epoch, step = self._fetched[0]
            spec = self.stream_spec
        return _resume.state_of(spec, epoch, step)

    def load_state_dict(self, state, elastic=False):
        """Continue from ``state`` (from :meth:`state_dict` of a loader of the same dataset
        and arguments) on the next iteration.

        With ``elastic=True`` the state may come from a job of another ``world_size``,
        ``rank`` or ``batch_size`` whose ranks all stood at the same step (as DDP's do): the
        rest of the saved epoch is sharded over this job's ranks, so every sample of that
        epoch is delivered once across the two jobs; that epoch has fewer batches (``len()``)
        and its steps count from 0. ``state`` is then one rank's state or the list of every
        saved rank's, which is checked (:class:`ConfigError`). See "Elastic resume" in
        docs/guides/loading.md.
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
                self._epoch = epoch
                self._step = step

    def _set_stream(self, spec):
        """A new maker for ``spec`` (keeping the counters and bad samples met so far) and,
        on the next iteration, a new engine."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        old = self.maker
        maker = BatchMaker(spec, self.num_threads, self.cache)
        maker.stats, maker.bad_samples = old.stats, old.bad_samples
        with self._state_lock:
            self.stream_spec = spec
            self.maker = maker

    def iterable_dataset(self):
        """This loader as a ``torch.utils.data.IterableDataset`` of whole batches
        (:mod:`dpu_pipe.torch_dataset`)."""
        from .torch_dataset import LoaderDataset
        return LoaderDataset(self)

    # --- what was made ------------------------------------------------------------------

    def _makers(self, engine=None):
        engine = self._engine if engine is None else engine
        return engine.makers if engine is not None else (self.maker,)

    def describe(self, epoch, index):
        """The exact augmentation parameters sample ``index`` (of the dataset) gets in
        ``epoch``, the same in every mode: a dict (keys: see
        :meth:`dpu_pipe.kernel.BatchProcessor.describe`), with ``"mix"`` when the loader
        mixes or smooths labels (:meth:`dpu_pipe.batch.BatchMaker.describe_mix`); with
        ``views``, a list of such dicts, one per view."""
        index = _v.integer(index, "index", 0, len(self.source) - 1)
        epoch = check_epoch(epoch)
        maker = self.maker
        data = self.source.read(index)
        # A kernel of its own: the makers' kernels (and their scratch memory) are in use by
        # the threads making batches.
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
        """Per-stage counters: seconds reading bytes (``read_s``), in decode+augment
        (``process_s``), batches and samples made, and seconds the consumer waited
        (``wait_s``); with a device, how batches reach it (:mod:`dpu_pipe.device`); with an
        offloaded mode, what arrived from the producers
        (:meth:`~dpu_pipe.engines.offload.OffloadEngine.stats`); with a cache, ``"cache"``.

        ``interval=True`` returns rates since the previous ``stats(interval=True)`` (or since
        the loader was made) instead: ``seconds``, ``samples`` (yielded), ``img_per_s``,
        ``data_wait_share`` (of the interval spent waiting for batches),
        ``producer_busy_share`` (seconds the batch makers spent reading and decoding, over
        the interval times their number; producer ranks report a batch's seconds when it
        arrives, so over a short interval their share can read above 1) and
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
            # One clock reading for the interval and for the batches in progress, so the
            # busy seconds of an interval never outgrow it (perf_counter: the makers' clock).
            now = time.perf_counter()
            busy = engine.busy(d) if engine is not None else None
            busy, makers = busy or (sum(m.busy_s(now) for m in self._makers(engine)),
                                    self.num_threads)
            counts = (self._yielded, self._wait_s, busy, bad)
            then, last = self._mark or (self._created, (0, 0.0, 0.0, 0))
            self._mark = (now, counts)
        dt = max(now - then, 1e-9)
        return {"seconds": dt, "samples": counts[0] - last[0],
                "img_per_s": (counts[0] - last[0]) / dt,
                "data_wait_share": (counts[1] - last[1]) / dt,
                "producer_busy_share": (counts[2] - last[2]) / (dt * max(1, makers)),
                "bad_samples": counts[3] - last[3]}

    def _meta(self, indices, valid_rows):
        """The ``meta`` of a batch of the samples ``indices``, its first ``valid_rows``
        valid (see ``return_meta``)."""
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

    # --- lifecycle ----------------------------------------------------------------------

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
            # __init__ failed before there was anything to close, or a forked child's copy
            # (the parent's threads and window are not this process's to stop).
            return
        with self._moving("close()"):
            if getattr(self, "_engine", None) is not None:
                self._engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # The collector runs finalizers in whatever thread allocates: a hybrid host thread of
        # another loader, say, whose batch the main thread waits for while it holds the
        # transport lock that close() takes. Closing here would wait for that thread, which
        # waits for this finalizer. So the close runs in a thread of its own, unless the
        # interpreter is exiting (no new threads then). A loader that never iterated (one whose
        # __init__ refused its arguments, say) has nothing to close.
        if getattr(self, "_engine", None) is None and getattr(self, "_iter", None) is None:
            return
        if sys.is_finalizing():
            with contextlib.suppress(Exception):
                self.close()
            return
        with contextlib.suppress(Exception):
            threading.Thread(target=self.close, name="dpu_pipe-finalize", daemon=True).start()


class DPULoader(Loader):
    """:class:`Loader` with ``mode="offload"`` by default: batches made by producer ranks
    (DPU cores). Same arguments and behaviour otherwise; ``DPULoader(..., mode="hybrid")``
    is ``Loader(..., mode="hybrid")``."""

    def __init__(self, source, batch_size, *, mode="offload", **kwargs):
        super().__init__(source, batch_size, mode=mode, **kwargs)
