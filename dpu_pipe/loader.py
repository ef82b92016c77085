"""The local Loader: batches produced ahead by a background thread on this host.

It is also the fallback of the offloaded modes, and the reference stream they reproduce.
"""

import os
import queue
import sys
import threading
import time
import warnings

import numpy as np

from . import _validate as _v
from .deadline import deadline_in
from .device import OutputSpec, torch_module
from .rng import check_epoch
from .errors import (ConfigError, DecodeError, DpuPipeError, PipeTimeout, ProducerError,
                     format_traceback)
from .sources import as_source
from .steps import StepProducer
from .transforms import TransformConfig

__all__ = ["Loader"]

# 2: the epoch order became a keyed Feistel permutation and shard_tail joined drop_last;
# a state of version 1 would resume into a different stream.
STATE_VERSION = 2


#: Environment variables launchers set to the number of processes in the job.
_WORLD_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE",
                    "SLURM_NTASKS")


def default_shard(rank, world_size):
    """``(rank, world_size)`` with what was left unset taken from ``torch.distributed`` when
    it is initialized, else ``(0, 1)`` — with a warning when the launcher says this process is
    one of several (every rank would then read the whole dataset)."""
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


class _BaseLoader:
    """What every loader shares: arguments, position in the stream, state_dict, output."""

    def __init__(self, source, batch_size, *, train=True, size=224, seed=0, shuffle=None,
                 drop_last=False, shard_tail=None, dtype="float32", layout="CHW",
                 num_threads=1, prefetch=2, on_error="raise", rank=None, world_size=None,
                 output=None, copy=False, device=None, pin_memory=False, memory_format=None,
                 timeout=300.0, return_meta=False, **transform_options):
        self.out = OutputSpec(dtype=dtype, layout=layout, output=output, device=device,
                              pin_memory=pin_memory, memory_format=memory_format, copy=copy)
        self.transform = TransformConfig(train=_v.boolean(train, "train"), size=size,
                                         dtype=self.out.kernel_dtype,
                                         layout=self.out.kernel_layout, **transform_options)
        # Evaluation reads every sample once, in order: no shuffle, no padding, no drop.
        shuffle = self.transform.train if shuffle is None else _v.boolean(shuffle, "shuffle")
        drop_last = _v.boolean(drop_last, "drop_last")
        if shard_tail is None:
            shard_tail = "pad" if self.transform.train else "uneven"
        prefetch = _v.positive_int(prefetch, "prefetch")
        num_threads = _v.positive_int(num_threads, "num_threads")
        source = as_source(source)
        rank, world_size = default_shard(rank, world_size)
        self.source = source
        self.output = self.out.output
        self.copy = self.out.copy
        self.return_meta = _v.boolean(return_meta, "return_meta")
        self.prefetch = prefetch
        self.timeout = _v.seconds(timeout, "timeout")
        self.out.timeout = self.timeout
        self.producer = StepProducer(source, batch_size, self.transform, seed=seed,
                                     shuffle=shuffle, rank=rank, world_size=world_size,
                                     shard_tail=shard_tail, drop_last=drop_last,
                                     num_threads=num_threads, on_error=on_error)
        self.batch_size = self.producer.batch_size
        self.num_threads = num_threads
        self._epoch = 0
        self._step = 0            # batches of self._epoch already yielded
        self._wait_s = 0.0

    # --- position in the stream ---------------------------------------------------------

    def __len__(self):
        """Batches per epoch on this rank."""
        return self.producer.num_batches

    @property
    def epoch(self):
        return self._epoch

    def set_epoch(self, epoch):
        """Start epoch ``epoch`` at its first batch on the next iteration.

        Iterating continues where the loader stands: after a complete epoch it moves to the
        next epoch by itself; a partly consumed epoch (a ``break``, or a restored state)
        continues with its next batch. ``set_epoch`` is needed only to jump elsewhere.
        """
        epoch = check_epoch(epoch)
        self._close_run()
        self._epoch = epoch
        self._step = 0

    def state_dict(self):
        """Position in the stream: restoring it (in this or a new process, with the same
        dataset and arguments) makes the remaining stream bit-identical to an uninterrupted
        run."""
        p = self.producer
        return {"version": STATE_VERSION, "epoch": self._epoch, "step": self._step,
                "seed": p.seed, "num_samples": len(p.source), "batch_size": self.batch_size,
                "rank": p.sampler.rank, "world_size": p.sampler.world_size,
                "drop_last": p.drop_last, "shard_tail": p.sampler.shard_tail,
                "shuffle": p.sampler.shuffle,
                "transform": self.transform.to_dict()}

    def load_state_dict(self, state):
        """Continue from ``state`` (from :meth:`state_dict`) on the next iteration."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ConfigError(f"not a dpu_pipe loader state (version {STATE_VERSION}): {state!r}")
        mine = self.state_dict()
        for key in ("seed", "num_samples", "batch_size", "rank", "world_size", "drop_last",
                    "shard_tail", "shuffle", "transform"):
            if state.get(key) != mine[key]:
                raise ConfigError(
                    f"state was saved with {key}={state.get(key)!r} but this loader has "
                    f"{key}={mine[key]!r}; build the loader with the same dataset and "
                    f"arguments to resume")
        epoch = check_epoch(state.get("epoch"))
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) \
                or not 0 <= step <= len(self):
            raise ConfigError(f"state step {step!r} outside 0..{len(self)}")
        self._close_run()
        self._epoch = epoch
        step = int(step)
        self._step = step

    def iterable_dataset(self):
        """This loader as a ``torch.utils.data.IterableDataset`` of whole batches (see
        :mod:`dpu_pipe.torch_dataset`): wrap it in ``DataLoader(ds, batch_size=None)``."""
        from .torch_dataset import LoaderDataset
        return LoaderDataset(self)

    @property
    def bad_samples(self):
        """{sample index: message} of the samples skipped as undecodable (on_error='skip')."""
        return dict(self.producer.bad_samples)

    def stats(self):
        """Per-stage counters: seconds reading bytes, in decode+augment, and waiting for
        batches in the consumer; batches and samples produced; with a device, how batches
        reach it (see :mod:`dpu_pipe.device`)."""
        d = self._step_stats().as_dict()
        d["wait_s"] = self._wait_s
        d.update(self.out.stats())
        return d

    def _step_stats(self):
        """The :class:`~dpu_pipe.steps.StepStats` of every producer of this loader, added."""
        return self.producer.stats

    def _emit(self, images, labels):
        return self.out.emit(images, labels)

    def _meta(self, indices):
        """The ``meta`` of a batch whose rows are the samples ``indices``: a dict of columns,
        ``"index"`` (int64, a fresh array or CPU tensor) and one list per key of the
        source's ``metadata(i)``."""
        index = np.array(indices, dtype=np.int64)    # a copy: ``indices`` is a ring buffer
        lookup = getattr(self.source, "metadata", None)
        rows = [lookup(i) for i in index.tolist()] if lookup is not None else []
        meta = {"index": index}
        for key in (rows[0] if rows else ()):
            if key != "index":
                meta[key] = [r[key] for r in rows]
        if self.output == "torch":
            meta["index"] = torch_module("output='torch'").from_numpy(index)
        return meta

    def _advance(self):
        self._step += 1

    def _epoch_done(self):
        self._epoch += 1
        self._step = 0

    # --- lifecycle ----------------------------------------------------------------------

    def _close_run(self):
        pass

    def close(self):
        """Stop background work and release buffers. Idempotent."""
        self._close_run()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Loader(_BaseLoader):
    """Iterable of ``(images, labels)`` batches decoded and augmented on this host
    (``(images, labels, meta)`` with ``return_meta``).

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
    size : int or (height, width)
        Output size in pixels.
    seed : int
        Keys the epoch permutation and every sample's augmentation.
    shuffle : bool, optional
        Shuffle every epoch (default: ``train``; evaluation reads in index order).
    shard_tail : "pad", "drop" or "uneven", optional
        The samples left over when ``world_size`` does not divide the dataset (see
        :class:`dpu_pipe.sampler.EpochSampler`, with a worked table): ``"pad"`` repeats a
        few (``DistributedSampler``'s default), ``"drop"`` leaves a few out, ``"uneven"``
        gives the first ranks one sample more so every sample is read exactly once across
        ranks. Default: ``"pad"`` when ``train``, ``"uneven"`` otherwise — distributed
        evaluation counts every sample once, with nothing padded or duplicated.
    drop_last : bool
        Drop this rank's last partial batch, as ``DataLoader``'s ``drop_last`` (default
        False: the last batch is kept, shorter). ``len()`` counts batches accordingly.
    rank, world_size : int, optional
        This process's shard. Unset, they come from ``torch.distributed`` when its process
        group is initialized, else they are 0 and 1 (with a warning when the launcher's
        environment, e.g. ``WORLD_SIZE``, says the job has several processes).
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
        See :class:`dpu_pipe.steps.StepProducer`.
    copy : bool
        Yield images the caller owns.
    return_meta : bool
        Yield ``(images, labels, meta)``: ``meta`` is a dict of columns, one entry per row,
        as ``DataLoader``'s default collate builds from per-sample dicts — ``meta["index"]``
        the dataset index of each row (int64 array, or CPU tensor with torch output), and a
        list per key of the source's ``metadata(i)`` (``"path"``: the path relative to the
        dataset root; a :class:`~dpu_pipe.FileList`'s ``meta_columns``). With
        ``on_error="skip"`` a replaced row names its replacement, the sample whose image and
        label it holds. Looked up on the consumer's thread from the in-memory index.

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
    **transform_options
        More :class:`~dpu_pipe.transforms.TransformConfig` fields: ``scale``, ``ratio``,
        ``flip_p``, ``resize``, ``mean``, ``std``, ``fast``, ``max_pixels``.
    """

    def __init__(self, source, batch_size, **kwargs):
        super().__init__(source, batch_size, **kwargs)
        shape = self.producer.batch_shape
        nslots = self.prefetch + 1
        self._images = [np.empty(shape, dtype=self.transform.np_dtype) for _ in range(nslots)]
        labels = self.producer.labels
        self._labels = [np.empty((self.batch_size,) + labels.shape[1:], dtype=labels.dtype)
                        for _ in range(nslots)]
        self._indices = [np.empty(self.batch_size, np.int64) for _ in range(nslots)]
        self._run = None

    def __iter__(self):
        self._close_run()
        if self._step >= len(self) > 0:
            self._epoch_done()
        self._run = self._make_run(self._epoch, self._step)
        return self._run

    def _make_run(self, epoch, start):
        return _LocalRun(self, epoch, start)

    def _close_run(self):
        run = getattr(self, "_run", None)
        if run is not None:
            run.close()
            self._run = None


def _produce(producer, images, labels, indices, epoch, start, end, free, ready, stop):
    """Producer thread body. It holds no reference to the Loader or its iterator, so a loader
    dropped without close() is collected, and its __del__ stops this thread."""
    step = start
    try:
        for step in range(start, end):
            while True:
                if stop.is_set():
                    return
                try:
                    slot = free.get(timeout=0.1)
                    break
                except queue.Empty:
                    continue
            n = producer.produce(epoch, step, images[slot], labels[slot], indices[slot])
            ready.put((step, slot, n, None))
    except BaseException as exc:  # noqa: B902 - carried to the consumer, never lost
        ready.put((step, None, 0, exc))


class _Run:
    """One pass over the rest of an epoch: the iterator contract every engine shares.

    It owns the position (epoch, next step, end), the check that it is still the loader's
    current iteration, the wait accounting and the output conversion; an engine provides
    ``_next_data()`` (the next batch as ``(images, labels, indices)`` arrays, ``indices``
    the dataset index of each row; raising on failure),
    ``_release_held()`` (give back the buffer of the batch the caller held) and ``close()``.
    Engines: :class:`_LocalRun` (a host thread), ``dpu_pipe.offload.host._RemoteRun``
    (producer ranks, and host threads in hybrid mode).

    A yielded batch stays valid until the next one is requested: its buffer is given back
    at the start of the next ``next()`` — not at the ``StopIteration`` that ends the epoch,
    so the last batch can still be read after the loop.

    Only the loader's current run may yield: a run superseded by a new ``iter()``,
    ``set_epoch`` or ``load_state_dict`` raises instead of handing out buffers that the new
    run is overwriting.
    """

    def __init__(self, loader, epoch, start):
        self.loader = loader
        self.epoch = epoch
        self.next_step = start
        self.end = len(loader)

    def __iter__(self):
        return self

    def _check_current(self):
        if self.loader._run is not self:
            raise DpuPipeError("this iterator is no longer current: the loader started another "
                               "iteration, or moved with set_epoch/load_state_dict/close")

    def __next__(self):
        loader = self.loader
        self._check_current()
        if self.next_step >= self.end:
            self.close()
            loader._run = None
            loader._epoch_done()
            raise StopIteration
        self._release_held()
        t0 = time.perf_counter()
        images, labels, indices = self._next_data()
        loader._wait_s += time.perf_counter() - t0
        self.next_step += 1
        loader._advance()
        if loader.return_meta:
            x, y = loader._emit(images, labels)
            return x, y, loader._meta(indices)
        return loader._emit(images, labels)

    def _next_data(self):
        raise NotImplementedError

    def _release_held(self):
        raise NotImplementedError

    def close(self):
        raise NotImplementedError


class _LocalRun(_Run):
    """The local engine: a producer thread filling the loader's free buffers in order."""

    def __init__(self, loader, epoch, start):
        super().__init__(loader, epoch, start)
        self.free = queue.Queue()
        self.ready = queue.Queue()
        self.stop = threading.Event()
        self.held = None
        for k in range(len(loader._images)):
            self.free.put(k)
        self.thread = threading.Thread(
            target=_produce, name="dpu_pipe-loader", daemon=True,
            args=(loader.producer, loader._images, loader._labels, loader._indices, epoch,
                  start, self.end,
                  self.free, self.ready, self.stop))
        self.thread.start()

    def _release_held(self):
        if self.held is not None:
            self.free.put(self.held)
            self.held = None

    def _next_data(self):
        loader = self.loader
        deadline = deadline_in(loader.timeout)
        while True:
            try:
                step, slot, n, exc = self.ready.get(timeout=0.2)
                break
            except queue.Empty:
                if not self.thread.is_alive() and self.ready.empty():
                    raise ProducerError("the loader's producer thread ended without a batch",
                                        producer="loader thread") from None
                if time.monotonic() > deadline:
                    raise PipeTimeout(f"no batch within {loader.timeout:.0f} s (epoch "
                                      f"{self.epoch}, step {self.next_step})") from None
        if exc is not None:
            self.close()
            if isinstance(exc, DecodeError):
                raise exc  # keeps the producer thread's traceback
            raise ProducerError(f"{type(exc).__name__}: {exc}", producer="loader thread",
                                remote_traceback=format_traceback(exc)) \
                from exc
        self.held = slot
        return loader._images[slot][:n], loader._labels[slot][:n], loader._indices[slot][:n]

    def close(self):
        self.stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            # The producer notices the stop flag once the batch it is making is done.
            self.thread.join(timeout=self.loader.timeout)
