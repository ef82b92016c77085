"""The Loader: one front end over engines that make batches.

The :class:`Loader` owns what every engine shares — the position in the stream (epoch, step),
the batch the caller holds, the output conversion, the state and the stats — and asks its
engine for one thing, the next batch (the :class:`~dpu_pipe.engines.base.Engine` contract).
Engines, chosen by ``mode``:

- ``"local"``: :class:`~dpu_pipe.engines.local.LocalEngine`, a maker thread on this host
  filling a ring of buffers (also the fallback of the offloaded modes, and the reference
  stream they reproduce); this mode never calls MPI;
- ``"offload"`` and ``"hybrid"``: :class:`~dpu_pipe.engines.offload.OffloadEngine`, batches
  of the producer ranks (and of host threads in hybrid mode) from the host's window.

Every engine makes the stream of the loader's :class:`~dpu_pipe.spec.StreamSpec` with
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
from .device import BatchOutput, torch_module
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
    torch = sys.modules.get("torch")   # a job using torch.distributed has imported torch
    dist = getattr(torch, "distributed", None) if torch is not None else None
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
    torch = sys.modules.get("torch")
    profiler = getattr(torch, "profiler", None) if torch is not None else None
    if profiler is None:
        return contextlib.nullcontext()
    return profiler.record_function("dpu_pipe.wait")


class _EpochIter:
    """One pass over the rest of an epoch: what ``iter(loader)`` returns.

    A yielded batch stays valid until the next one is requested: its buffer is given back
    at the start of the next ``next()`` — not at the ``StopIteration`` that ends the epoch,
    so the last batch can still be read after the loop.

    Only the loader's current iteration may yield: one superseded by a new ``iter()``,
    ``set_epoch``, ``load_state_dict`` or ``close`` — in this thread or another, also while
    it waits for a batch — raises :class:`ConfigError` instead of handing out buffers that
    the new one is overwriting. An exception that is not an ``Exception`` (a
    ``KeyboardInterrupt``) ends the iteration too: a new ``iter()`` continues from the
    loader's position, the batch it interrupted included.
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
            # Waiting for the loader, as well as for a batch, ends when a call from another
            # thread ends this iteration: that call may hold the loader while the engine
            # finishes the batch under way.
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


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked_child)


class Loader:
    """Iterable of ``(images, labels)`` batches (``(images, labels, meta)`` with
    ``return_meta``), decoded and augmented on this host or, with ``mode="offload"`` or
    ``"hybrid"``, by producer ranks (DPU cores) that put them into this host's memory over MPI
    one-sided RMA (see :mod:`dpu_pipe.engines.offload` for the launch line). The stream is
    the same in every mode, bit for bit.

    Labels are the source's: int64 (B,) classes, or a :class:`~dpu_pipe.FileList`'s float32
    targets (B,) or several labels per sample (B, K), int64 or float32.

    Parameters
    ----------
    source : ImageFolder, FileList, PackedSource, or a dataset path
        A path is opened by :func:`dpu_pipe.sources.as_source`: a directory as an
        ImageFolder, a packed file as a PackedSource, a ``.txt``/``.csv`` list as a FileList.
    batch_size : int
    train : bool
        RandomResizedCrop + flip (True) or resize + center crop (False).
    size : int, (height, width) or dpu_pipe.progressive_size(...)
        Output size in pixels. A :func:`~dpu_pipe.progressive_size` (train only) changes it
        with the epoch by FFCV's rule: epoch ``e`` yields ``(B, 3, s, s)`` with ``s =
        size.size_at(e)``; buffers (and window slots) are sized for ``size.largest``.
    seed : int
        Keys the epoch permutation and every sample's augmentation.
    shuffle : bool, optional
        Shuffle every epoch (default: ``train``; evaluation reads in index order).
    shard_tail : "pad", "drop", "uneven" or "mask", optional
        The samples left over when ``world_size`` does not divide the dataset (see
        :class:`dpu_pipe.sampler.EpochSampler`, with a worked table): ``"pad"`` repeats a
        few (``DistributedSampler``'s default), ``"drop"`` leaves a few out, ``"uneven"``
        gives the first ranks one sample more so every sample is read exactly once across
        ranks (but ranks may differ by one batch), ``"mask"`` pads as ``"pad"`` and marks
        the padded rows not valid (:attr:`valid_rows`, ``meta["valid"]``). Default:
        ``"pad"`` when ``train``, ``"mask"`` otherwise — every rank runs the same number of
        batches (per-batch collectives of a DDP validation loop never hang) and counting
        the valid rows counts every sample once.
    drop_last : bool
        Drop this rank's last partial batch, as ``DataLoader``'s ``drop_last`` (default
        False: the last batch is kept, shorter). ``len()`` counts batches accordingly.
    rank, world_size : int, optional
        This process's shard. Unset, they are this host's index among the hosts of its host
        group and their count (offloaded modes, or a process that has started a host group),
        else they come from ``torch.distributed`` when its process group is initialized,
        else they are 0 and 1 (with a warning when the launcher's environment, e.g.
        ``WORLD_SIZE``, says the job has several processes).
    mode : "local", "offload" or "hybrid"
        The engine. ``"local"`` (default): this host's threads make the batches; MPI is not
        touched. ``"offload"``: producer ranks make the batches (this host's threads when
        no producer serves it, with a warning). ``"hybrid"``: producers and ``host_threads``
        host threads take work from the same ticket pool; the host threads take work only
        when the producers fall behind (fewer than ``slots // 2 + 1`` batches ready), and
        take over the work of a producer that falls silent. The arguments below apply to
        the offloaded modes. ``decode_max_side``, ``stick_to_shard`` and ``cache_bytes``
        work in every mode (the producers receive them with the stream spec).
    comm : mpi4py communicator, optional
        The job's communicator holding hosts and producers (default ``COMM_WORLD``). The
        first offloaded loader of a process starts the host group: collective over ``comm``.
    host_threads : int
        Threads making batches on the host in hybrid mode (default 1). Each holds its own
        batch buffer: host memory grows by ``(host_threads + 2) × batch bytes``.
    slots : int, optional
        Batch buffers in the host's window (default ``prefetch + 1``): host memory for
        offloaded batches is ``slots × batch bytes``. The window is sized by the first
        offloaded loader of the process (the largest of its slots and batch bytes seen so
        far when a later loader needs more: then it is made again, a collective with the
        producers).
    producer_threads : int
        Threads of each producer's batch kernel (keep 1 when producer ranks share a DPU).
    liveness_timeout : float
        Seconds without a producer's heartbeat after which it counts as silent: offload mode
        raises :class:`PipeTimeout` naming it; hybrid mode takes over its work.
    hostmap : str, optional
        ``"host:producer,..."`` hostname pairs, overriding ``DPU_PIPE_HOSTMAP`` and matching
        by name (see :mod:`dpu_pipe.offload.roles`). Used when the host group starts.
    serve_file : str or path, optional
        Join the producers of a job of their own (``python -m dpu_pipe.worker --serve
        FILE``) through the port they published in this file, instead of producer ranks of
        this MPI job — for hosts started by ``torchrun`` (default: ``DPU_PIPE_SERVE``; see
        :mod:`dpu_pipe.offload.rendezvous`). Each host is torch's ``RANK`` of ``WORLD_SIZE``.
    dtype : "float32", "float16", "bfloat16" or "uint8", or a numpy or torch dtype
        Float outputs are normalized by mean/std. bfloat16 (written by the kernel: the
        float32 value rounded to nearest even) needs torch output.
    layout : "CHW" or "HWC"
        Batches are (B, 3, H, W) or (B, H, W, 3).
    memory_format : torch.channels_last, optional
        The kernel writes NHWC and the loader yields (B, 3, H, W) tensors that are
        channels-last in memory, with no copy.
    output : "numpy", "torch", or None
        None means torch when a torch-only option (``device``, ``pin_memory``,
        ``memory_format``, a torch dtype, bfloat16) is given, numpy otherwise.
    device : str or torch.device, optional
        Yield tensors on this device. An accelerator device gets each batch through pinned
        staging buffers and a ``non_blocking`` copy on a side stream, overlapped with the
        making of the next batch (see :mod:`dpu_pipe.device`).
    pin_memory : bool
        Yield CPU tensors in pinned memory (ignored, with a warning, without an accelerator).
    num_threads : int
        Threads decoding each batch.
    prefetch : int
        Batches produced ahead. Memory is bounded by ``(prefetch + 1) × batch bytes``: one
        buffer per batch in flight plus the one the caller holds.
    on_error : "raise" or "skip"
        See :class:`dpu_pipe.batch.BatchMaker`.
    max_bad : int, float or None
        With ``on_error="skip"``, the failure budget: at most this many bad samples (an
        int), or this fraction of the rank's shard (a float in [0, 1], rounded down), are
        skipped; with one more, iterating raises a :class:`DecodeError` that names the first
        failures (files and messages) instead of skipping on. Counted over every bad sample
        the loader has met (host threads and producers alike), checked as each batch is
        delivered. None: no limit.
    copy : bool
        Yield images the caller owns.
    return_meta : bool
        Yield ``(images, labels, meta)``: ``meta`` is a dict of columns, one entry per row,
        as ``DataLoader``'s default collate builds from per-sample dicts — ``meta["index"]``
        the dataset index of each row (int64 array, or CPU tensor with torch output), and a
        list per key of the source's ``metadata(i)`` (``"path"``: the path relative to the
        dataset root; a :class:`~dpu_pipe.FileList`'s ``meta_columns``). With
        ``on_error="skip"`` a replaced row names its replacement, the sample whose image and
        label it holds. ``meta["valid"]``: bool per row (array, or tensor with torch
        output), False for the padding of ``shard_tail="mask"``. Looked up on the
        consumer's thread from the in-memory index.

    Exact distributed evaluation
    ----------------------------
    With ``shard_tail="mask"`` (the default of ``train=False``) every rank has
    ``ceil(n / world_size)`` samples; the last row of some ranks is padding (a sample read
    again). After each batch, :attr:`valid_rows` is the number of rows that count — always
    the *first* rows, so ``images[:loader.valid_rows]`` are the real samples — and
    ``meta["valid"]`` flags them. Summing metrics over valid rows and all-reducing counts
    every sample exactly once.

    Buffers and aliasing
    --------------------
    **Without** ``copy``, a device or pin_memory, **the images of a yielded batch
    are a view of a reused ring buffer: they stay valid only until the next batch is
    requested.** Keeping batches across iterations (``held = list(loader)``) then keeps
    buffers that later batches overwrite. With ``output="torch"`` the tensor shares that
    memory (``torch.from_numpy``): ``images.clone()``, a ``.to(device)``, or ``copy=True``
    detaches it. Labels are always a fresh array (or tensor) per batch.
    timeout : float
        Seconds the consumer waits for one batch before raising :class:`PipeTimeout`.
    lookahead : int
        Batches the caller's framework fetches ahead of the one its training step works on:
        1 under Accelerate (``DataLoaderShard`` fetches the next batch before handing out the
        current one, to know the end); 0 (default) for a plain ``for`` loop and for Lightning
        (its fit loop fetches ahead only from iterables without a length; this loader and its
        :meth:`iterable_dataset` view have one). With ``lookahead=k`` the yielded batches are copies (they stay valid while the
        framework holds ``k + 1`` of them; ``k + 1`` batches of memory more) and
        :meth:`state_dict` is the position after the batch the training step consumed — the
        ``k``-th last one yielded, or the last one once the end of the epoch was fetched —
        so a checkpoint taken in the training step resumes at the batch fetched ahead, not
        after it.
    decode_max_side : int, optional
        Decode every sample whole and reduce it to this longest side (pixels), then cut its
        crop from the reduced image (see :class:`~dpu_pipe.transforms.DecodeOptions`): part
        of the stream, which then depends on it. What ``cache_bytes`` caches.
    cache_bytes : int
        Keep the reduced images of ``decode_max_side`` in a cache of this many bytes (0: no
        cache), so later epochs cut their crops without decoding. The batches are the same
        whatever the cache holds. The bytes include a table of 24 bytes per sample of the
        source; when the cache is full, the samples that did not fit are decoded every
        epoch. Resident memory grows by at most ``cache_bytes`` as it fills.
        ``stats()["cache"]`` counts hits, misses, bytes, entries and did_not_fit. In
        ``"local"`` mode the cache is this loader's, shared by its threads; in the offloaded
        modes it is the producers' — one per node, in MPI shared memory, shared by the
        node's producers of this host (``stats()["cache"]``: their totals, as of the last
        batch received) — and this host's own threads (hybrid) do not cache. See
        docs/guides/caching.md.
    stick_to_shard : bool
        Every rank reads the same subset of the dataset every epoch (reshuffled within it),
        so that a per-rank cache is hit: see :class:`dpu_pipe.sampler.EpochSampler`. Part of
        the stream and of its saved state.
    **transform_options
        More :class:`~dpu_pipe.transforms.TransformConfig` fields: ``scale``, ``ratio``,
        ``flip_p``, ``resize``, ``mean``, ``std``, ``fast``, ``max_pixels``, the recipes
        (``interpolation``, ``auto_augment``, ``color_jitter``, ``random_erase``, ...) and
        the batch ops (``mixup_alpha``, ``cutmix_alpha``, ``mix_switch_p``, ``mix_p``,
        ``label_smoothing``, ``num_classes``: labels then float32 (B, num_classes);
        ``batch_hook``), see :mod:`dpu_pipe.mix`; ``views``: a multi-view recipe, a list of
        :class:`dpu_pipe.views.View` (presets ``views.dino()``, ``views.simclr()``,
        ``views.byol()``), each sample decoded once and ``images`` a list, one batch per
        view (see :mod:`dpu_pipe.views`).

    Offloaded memory
    ----------------
    A producer holds ``dpu_pipe.offload.producer_loop.DEPTH`` (2) batches plus its
    decoder's scratch. With an accelerator ``device``, the window is registered as pinned
    memory (``cudaHostRegister``) and a batch made by a producer is copied to the device
    straight from its window slot; the slot is given back once that copy has completed.
    Without registration (refused, or a torch without ``torch.cuda.cudart``) batches go
    through pinned staging buffers, as in local mode; ``stats()["device_path"]`` says which
    (see :mod:`dpu_pipe.device`).
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
        if isinstance(host_threads, bool) or not isinstance(host_threads, int) \
                or host_threads < (1 if mode == "hybrid" else 0):
            raise ConfigError(f"host_threads must be an integer >= 1 in hybrid mode, got "
                              f"{host_threads!r}")
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
                                         dtype=self.out.kernel_dtype,
                                         layout=self.out.kernel_layout, **transform_options)
        # Evaluation reads in order, nothing dropped; the padding that gives every rank as
        # many batches is flagged (valid_rows), so every sample counts once.
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
        self.timeout = _v.deadline(timeout, "timeout", DEFAULT_TIMEOUT)
        self.out.timeout = self.timeout
        #: The :class:`~dpu_pipe.batch.BatchMaker` of this host (the local engine's; thread
        #: 0's in hybrid mode); it also gives the stream's geometry.
        if cache_bytes and self.transform.decode.decode_max_side is None:
            raise ConfigError("cache_bytes needs decode_max_side: the cache holds the whole "
                              "images decode_max_side reduces (e.g. decode_max_side=256)")
        if cache_bytes:
            check_cache_bytes(cache_bytes, len(self.source))
        #: This process's decoded-sample cache (:class:`~dpu_pipe.cache.DecodedCache`), or
        #: None: where the stream runs, not what it is — every maker of this loader shares
        #: it. Local mode only: the offloaded modes cache on the producers, and the host's
        #: memory is the training's.
        self.cache = DecodedCache(cache_bytes, len(self.source)) \
            if cache_bytes and mode == "local" else None
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
        #: Rows of the batch last yielded that count: its first ``valid_rows`` rows (all of
        #: them, except the padding of ``shard_tail="mask"``); 0 before the first batch.
        self.valid_rows = 0
        self._created = time.perf_counter()
        self._mark = None         # (perf_counter, counters) of the last stats(interval=True)
        self.slots = self.prefetch + 1 if slots is None else slots
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ConfigError(f"slots must be an integer >= 1, got {slots!r}")
        self.producer_threads = _v.positive_int(producer_threads, "producer_threads")
        self.liveness_timeout = _v.seconds(liveness_timeout, "liveness_timeout")
        self.host_threads = int(host_threads)
        #: The engine's mode: the one asked for, or ``"local"`` when no producer serves this
        #: host.
        self.mode = mode if mode == "local" else _offload.prepare(self, mode)
        if self.mode == "local" and cache_bytes and self.cache is None:
            # No producer serves this host: it caches as a local loader does.
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
        """Hold ``_lock`` for ``what``; the thread holding it lets go within one batch
        (``timeout``) or, waiting for a batch, as soon as it is told (:meth:`_supersede`).
        With ``cancel`` (an Event), waiting for the lock raises :class:`Cancelled` once it
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

    def _supersede(self, why):
        """Tell the current iteration — which another thread may be waiting in — that
        ``why`` ends it, so that the wait lets go of the loader at once."""
        it = getattr(self, "_iter", None)
        if it is not None and it.why is None:
            it.why = f"{why} (in thread {threading.current_thread().name!r})"
            it.cancel.set()

    def _forked(self):
        """In the child of a fork (``os.fork``, a DataLoader worker), at once: the parent's
        threads did not come along, and the locks, queues and kernels they were using may
        have been caught in use. New locks; the engine and the iteration are dropped (its
        iterator raises), the maker is remade at the next use (:meth:`_after_fork`)."""
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
        """First use of the loader in a forked child: a new maker (same stream, position
        kept); an offloaded mode refuses."""
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
        """Batches of the loader's current epoch on this rank: the same every epoch, except
        the epoch continued by an elastic resume (see :meth:`load_state_dict`), which has
        what is left of it."""
        return self.maker.batches_in(self._epoch)

    @property
    def epoch(self):
        return self._epoch

    def __iter__(self):
        self._supersede("a new iter()")
        with self._locked("iter()"):
            self._end_iteration()
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
        is the loader's current epoch: then its position is kept.

        Iterating continues where the loader stands: after a complete epoch it moves to the
        next epoch by itself; a partly consumed epoch (a ``break``, or a restored state)
        continues with its next batch. So the torch habit
        ``loader.load_state_dict(ckpt); for ep in range(start, E): loader.set_epoch(ep); ...``
        resumes the restored epoch where it stopped, not at step 0 (which would train twice
        on the samples before the checkpoint). To restart the current epoch from its first
        batch, ``load_state_dict`` a state with ``step`` 0.
        """
        epoch = check_epoch(epoch)
        if epoch == self._epoch:
            return
        self._supersede(f"set_epoch({epoch})")
        with self._locked("set_epoch()"):
            if epoch == self._epoch:
                return
            self._end_iteration()
            with self._state_lock:
                self._epoch = epoch
                self._step = 0

    def state_dict(self):
        """Position in the stream: restoring it (in this or a new process, with the same
        dataset and arguments) makes the remaining stream bit-identical to an uninterrupted
        run. With ``lookahead`` it is the position of the training step, behind what was
        fetched ahead of it. JSON-serialisable; ``"resume"`` is the resume point of an
        elastic resume when the position is in the epoch it applies to (else None)."""
        with self._state_lock:
            epoch, step = self._epoch, self._step
            if self._fetched[-1] == (epoch, step):    # else set_epoch/load_state_dict moved it
                epoch, step = self._fetched[0]
            spec = self.stream_spec
        return _resume.state_of(spec, epoch, step)

    def load_state_dict(self, state, elastic=False):
        """Continue from ``state`` (from :meth:`state_dict`) on the next iteration.

        The state must come from a loader of the same dataset and arguments. With
        ``elastic=True`` it may come from a job of another size — other ``world_size``,
        ``rank`` or ``batch_size`` — whose ranks all stood at the same step, as DDP's do:
        the rest of the saved epoch (the positions of its order no rank had read) is
        sharded over this job's ranks, so every sample of that epoch is delivered once
        across the two jobs (with ``shard_tail="pad"`` the few padded rows of the rest
        repeat samples of the epoch's start; ``"mask"`` marks them not valid); the epochs
        after it are this job's whole epochs. That epoch then has fewer batches (``len()``
        tells) and its steps count from 0 again; a state saved in it carries the resume
        point. Every rank of the new job loads the same state: one rank's (its step stands
        for every rank's) or the list of every saved rank's states, which is checked: ranks
        at different steps, a missing rank or different epochs raise :class:`ConfigError`.
        With the same geometry (world size, batch size) an elastic load is a plain resume.
        With ``stick_to_shard`` the rest of the saved epoch keeps the order the saved job
        began it in (the resume point records that job's world size); from the next epoch
        on, the samples are split among this job's ranks (each rank's subset changes once).
        """
        elastic = _v.boolean(elastic, "elastic")
        # Checked before the current iteration is told to end: a bad state changes nothing.
        _resume.resume_position(self.stream_spec, state, elastic)
        self._supersede("load_state_dict()")
        with self._locked("load_state_dict()"):
            resume, epoch, step = _resume.resume_position(self.stream_spec, state, elastic)
            self._end_iteration()
            spec = dataclasses.replace(self.stream_spec, resume=resume)
            if spec != self.stream_spec:
                self._set_stream(spec)
            with self._state_lock:
                self._epoch = epoch
                self._step = step

    def _set_stream(self, spec):
        """Make ``spec`` this loader's stream: a new maker (keeping the counters and bad
        samples met so far) and, on the next iteration, a new engine."""
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
        """This loader as a ``torch.utils.data.IterableDataset`` of whole batches (see
        :mod:`dpu_pipe.torch_dataset`): wrap it in ``DataLoader(ds, batch_size=None)``."""
        from .torch_dataset import LoaderDataset
        return LoaderDataset(self)

    # --- what was made ------------------------------------------------------------------

    def _makers(self, engine=None):
        engine = self._engine if engine is None else engine
        return engine.makers if engine is not None else (self.maker,)

    def describe(self, epoch, index):
        """The exact augmentation parameters sample ``index`` (of the dataset) gets in
        ``epoch``: see :meth:`dpu_pipe.kernel.BatchProcessor.describe` for the keys. The same
        for every mode, thread count and producer count (they all run this kernel).

        A train loader that mixes (``mixup_alpha``, ``cutmix_alpha``) or smooths labels adds
        ``"mix"``: the sample's step and row in this rank's epoch, its partner, the mode
        (``"mixup"``, ``"cutmix"`` or None), λ (its own label's weight) and the CutMix box
        (see :meth:`dpu_pipe.batch.BatchMaker.describe_mix`).

        With ``views`` (:mod:`dpu_pipe.views`), a list of such dicts, one per view in view
        order, each with ``"blur"`` and ``"solarize"`` (see :mod:`dpu_pipe.views`)."""
        index = _v.integer(index, "index", 0, len(self.source) - 1)
        epoch = check_epoch(epoch)
        maker = self.maker
        data = self.source.read(index)
        # A kernel of its own: the makers' kernels (and their scratch memory) are in use by
        # the threads making batches. One thread is enough: the answer is the same.
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
        """A :class:`DecodeError` summarizing the first failures once more samples are bad
        than ``max_bad`` allows."""
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
        (``process_s``), batches and samples made (summed over every maker of this host,
        samples also counting the producers'), and seconds waiting for batches in the
        consumer (``wait_s``); with a device, how batches reach it (see
        :mod:`dpu_pipe.device`); with an offloaded mode, bytes received, the producers'
        read/decode+augment/publish seconds, batches per producer rank (0: host threads),
        samples made by each side (``producer_samples``, ``host_samples``), and the window
        polls made while waiting for batches (``host_polls``; each costs the host ~30-60 us
        of CPU, and a host waiting for a producer sleeps through most of its batch time
        instead of polling).

        ``interval=True`` returns rates since the previous ``stats(interval=True)`` (or since
        the loader was made) instead, what a training log prints every N steps:
        ``seconds`` (wall time of the interval), ``samples`` (yielded to the caller),
        ``img_per_s``, ``data_wait_share`` (share of the interval the caller spent waiting
        for batches), ``producer_busy_share`` (seconds the batch makers — this host's threads,
        or the producer ranks — spent reading and decoding, over the interval times their
        number) and ``bad_samples`` (samples skipped as undecodable in the interval). This
        host's makers count the batch in progress as it runs, so their share is at most 1;
        producer ranks report a batch's seconds when it arrives, so over an interval shorter
        than a few batches their share can read above 1."""
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
            busy, makers = self._busy(d, engine, now)
            counts = (self._yielded, self._wait_s, busy, bad)
            then, last = self._mark if self._mark is not None else (self._created,
                                                                    (0, 0.0, 0.0, 0))
            self._mark = (now, counts)
        dt = max(now - then, 1e-9)
        return {"seconds": dt, "samples": counts[0] - last[0],
                "img_per_s": (counts[0] - last[0]) / dt,
                "data_wait_share": (counts[1] - last[1]) / dt,
                "producer_busy_share": (counts[2] - last[2]) / (dt * max(1, makers)),
                "bad_samples": counts[3] - last[3]}

    def _busy(self, stats, engine, at):
        """(seconds the batch makers spent reading and decoding up to ``at``, a
        ``time.perf_counter()`` reading; how many makers)."""
        busy = engine.busy(stats) if engine is not None else None
        if busy is not None:
            return busy
        return sum(m.busy_s(at) for m in self._makers(engine)), self.num_threads

    def _meta(self, indices, valid_rows):
        """The ``meta`` of a batch whose rows are the samples ``indices``, the first
        ``valid_rows`` of them valid: a dict of columns, ``"index"`` (int64, a fresh array
        or CPU tensor), ``"valid"`` (bool, likewise) and one list per key of the source's
        ``metadata(i)``."""
        index = np.array(indices, dtype=np.int64)    # a copy: ``indices`` is a ring buffer
        valid = np.arange(len(index)) < valid_rows
        lookup = getattr(self.source, "metadata", None)
        rows = [lookup(i) for i in index.tolist()] if lookup is not None else []
        meta = {"index": index, "valid": valid}
        for key in (rows[0] if rows else ()):
            if key not in meta:
                meta[key] = [r[key] for r in rows]
        if self.output == "torch":
            torch = torch_module("output='torch'")
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
        """Stop background work and release buffers. Idempotent. From another thread, an
        iteration in progress ends: its next ``next()`` — or the one waiting — raises
        :class:`ConfigError`. The loader can be iterated again afterwards."""
        if getattr(self, "_lock", None) is None or self._pid != os.getpid():
            # __init__ failed before there was anything to close, or a forked child's copy
            # (the parent's threads and window are not this process's to stop).
            return
        self._supersede("close()")
        with self._locked("close()"):
            self._end_iteration()
            if getattr(self, "_engine", None) is not None:
                self._engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class DPULoader(Loader):
    """:class:`Loader` with ``mode="offload"`` by default: batches made by producer ranks
    (DPU cores). Same arguments and behaviour otherwise; ``DPULoader(..., mode="hybrid")``
    is ``Loader(..., mode="hybrid")``."""

    def __init__(self, source, batch_size, *, mode="offload", **kwargs):
        super().__init__(source, batch_size, mode=mode, **kwargs)
