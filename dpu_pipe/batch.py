"""Making step ``s`` of epoch ``e``: which samples, their bytes, the batch kernel, and what
happens to samples that cannot be decoded. Local loader threads, hybrid host threads and DPU
producer ranks run the same code, built from the same :class:`~dpu_pipe.spec.StreamSpec`, so
the stream is the same whoever makes it.
"""

import logging
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from . import _jpeg
from . import _validate as _v
from .kernel import ST_OTHER_FORMAT, BatchProcessor
from .errors import ConfigError, DecodeError
from .mix import BatchOps
from .sampler import EpochSampler
from .spec import ON_ERROR, StreamSpec

__all__ = ["BatchMaker", "MakerStats", "ON_ERROR"]

log = logging.getLogger("dpu_pipe")


@dataclass
class MakerStats:
    """What one :class:`BatchMaker` did: seconds reading bytes and in the batch kernel,
    batches and samples made, and samples that were not JPEGs (decoded by OpenCV)."""

    read_s: float = 0.0
    process_s: float = 0.0
    batches: int = 0
    samples: int = 0
    other_formats: int = 0

    def __iadd__(self, other):
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)
        return self

    def as_dict(self):
        return asdict(self)


class BatchMaker:
    """Makes the batches of one rank's shard, as its :class:`~dpu_pipe.spec.StreamSpec` says.

    Parameters
    ----------
    spec : StreamSpec
        Source, batch size, transform, seed, shard, ``drop_last`` and ``on_error``.
    num_threads : int
        Threads of the batch kernel (not in the spec: they change where it runs, not what).
    cache : dpu_pipe.cache.DecodedCache, optional
        The decoded-sample cache of ``decode_max_side`` (likewise not in the spec). Samples
        found in it are not read from the source.

    With ``spec.on_error="skip"`` (docs/guides/loading.md) an undecodable sample is replaced by
    the next one of the shard's order that decodes, and recorded in :attr:`bad_samples`.
    """

    def __init__(self, spec, num_threads=1, cache=None):
        if not isinstance(spec, StreamSpec):
            raise TypeError(f"spec must be a StreamSpec, got {spec!r}")
        self.spec = spec
        source = self.source = spec.source
        self.batch_size = spec.batch_size
        self.on_error = spec.on_error
        self.sampler = EpochSampler(len(source), seed=spec.seed, shuffle=spec.shuffle,
                                    rank=spec.rank, world_size=spec.world_size,
                                    shard_tail=spec.shard_tail, resume=spec.resume,
                                    stick_to_shard=spec.stick_to_shard)
        #: Batches of a whole epoch (:meth:`batches_in`: of a given epoch).
        self.num_batches = self.sampler.num_batches(self.batch_size, spec.drop_last)
        self.drop_last = spec.drop_last
        self.seed = spec.seed
        # With uneven shards a rank may legitimately have nothing to read (n < world_size);
        # otherwise every rank has the same count, and none means a useless configuration.
        if self.num_batches == 0 and self.sampler.shard_tail != "uneven":
            raise ConfigError(
                f"no batches: {len(self.sampler)} samples per rank and batch_size="
                f"{self.batch_size} with drop_last=True; lower batch_size or set "
                f"drop_last=False")
        if cache is not None and cache.num_samples != len(source):
            raise ConfigError(f"the cache was made for {cache.num_samples} samples, the source "
                              f"has {len(source)}")
        self.num_threads = _v.positive_int(num_threads, "num_threads")
        self.cache = cache
        #: The stream's transform (with a progressive size, each epoch's: :meth:`kernel_at`).
        self.transform = spec.transform
        # The kernels and batch ops by output size: a progressive size changes a few times
        # per run, so two of each are kept (the epoch being made, and one a resume may reach).
        self._kernels, self._ops = {}, {}
        self._stages_lock = threading.Lock()
        self.kernel_at(0)       # a transform the kernel refuses fails here, not in a thread
        labels = np.asarray(source.labels)
        #: Labels of every sample: int64, or float32 (FileList float labels); (N,) or (N, K).
        self.labels = labels.astype(np.int64 if labels.dtype.kind in "iub" else np.float32,
                                    copy=False)
        # A packed source gathers a batch's records itself, without a copy per record.
        self._gather = getattr(source, "buffers", None)
        #: The batch ops (mixing, label smoothing, batch_hook) of the first epoch (another
        #: epoch's: :meth:`ops_at`; only the CutMix box depends on the epoch's size).
        self.batch_ops = self.ops_at(0)
        if self.batch_ops.soft:
            if self.labels.dtype != np.int64 or self.labels.ndim != 1:
                raise ConfigError(f"mixup_alpha, cutmix_alpha and label_smoothing need one "
                                  f"integer class per sample; this source's labels are "
                                  f"{self.labels.dtype} of shape {self.labels.shape[1:]}")
            self._classes = np.empty(self.batch_size, np.int64)
        #: {sample index: error message} of the samples found undecodable (skip mode).
        self.bad_samples = {}
        #: What this maker did (:class:`MakerStats`); the loader adds up its makers'.
        self.stats = MakerStats()
        # Start (perf_counter) of the batch being made, so busy_s() can count it as it runs:
        # interval rates would otherwise book a whole batch in the interval it ends in.
        self._started = None
        self._busy_lock = threading.Lock()

    def busy_s(self, at=None):
        """Seconds this maker has spent reading and processing batches, the one in progress
        included up to ``at`` (a ``time.perf_counter()`` reading; default: now); it grows by
        at most one second per second of wall time."""
        with self._busy_lock:
            if at is None:
                at = time.perf_counter()
            running = max(0.0, at - self._started) if self._started is not None else 0.0
            return self.stats.read_s + self.stats.process_s + running

    @property
    def batch_shape(self):
        """(batch_size, *sample_shape): a buffer that holds a batch of any epoch (with a
        progressive size, of the largest)."""
        return (self.batch_size,) + self.transform.sample_shape

    def _cached(self, cache, epoch, make):
        """``cache``'s entry for ``epoch``'s transform, made by ``make(transform)`` when
        missing (dropping the older of two)."""
        config = self.transform.at_epoch(epoch)
        key = config.recipe.size
        with self._stages_lock:
            got = cache.get(key)
            if got is None:
                got = make(config)
                if len(cache) >= 2:
                    del cache[next(iter(cache))]
                cache[key] = got
            return got

    def kernel_at(self, epoch):
        """The :class:`~dpu_pipe.kernel.BatchProcessor` that makes ``epoch``'s samples."""
        return self._cached(self._kernels, epoch, lambda config: BatchProcessor(
            config, self.num_threads, self.cache))

    def ops_at(self, epoch):
        """The :class:`~dpu_pipe.mix.BatchOps` of ``epoch``'s batches."""
        return self._cached(self._ops, epoch,
                            lambda config: BatchOps(config, self.seed, self.spec.rank))

    def sample_shape_at(self, epoch):
        """Shape of one sample of ``epoch`` (with a progressive size, that epoch's)."""
        return self.transform.sample_shape_at(epoch)

    def rows(self, images, epoch, n):
        """The (n, *sample_shape_at(epoch)) view of the first bytes of ``images``, a
        C-contiguous buffer of at least ``n`` such samples (``images[:n]`` when the shapes
        agree): a smaller epoch's batch fills the start of a larger buffer, as in a window
        slot. With views, ``images`` is a list (one buffer per view) and so is the result."""
        if isinstance(images, list):
            return [v[:n] for v in images]
        shape = (int(n),) + self.sample_shape_at(epoch)
        if images.shape[1:] == shape[1:]:
            return images[:n]
        count = int(np.prod(shape))
        if not images.flags.c_contiguous or images.size < count:
            raise ConfigError(f"a batch of shape {shape} does not fit a C-contiguous "
                              f"buffer of shape {images.shape}")
        return images.reshape(-1)[:count].reshape(shape)

    def empty_images(self):
        """Uninitialised images of a full batch, for :meth:`make` (with views, a list: one
        per view)."""
        out = [np.empty((self.batch_size,) + s, self.transform.np_dtype)
               for s in self.transform.view_shapes]
        return out if self.transform.views is not None else out[0]

    def batches_in(self, epoch):
        """Number of batches of ``epoch`` (fewer than :attr:`num_batches` in the epoch of
        ``spec.resume``)."""
        return self.sampler.num_batches(self.batch_size, self.drop_last, epoch)

    @property
    def label_dtype(self):
        """dtype of the batches' labels: float32 when mixing or smoothing, else that of
        :attr:`labels`."""
        return np.dtype(np.float32) if self.batch_ops.soft else self.labels.dtype

    @property
    def label_shape(self):
        """One row's labels: (num_classes,) when mixing or smoothing, else the source's."""
        if self.batch_ops.soft:
            return (self.transform.batch_ops.num_classes,)
        return self.labels.shape[1:]

    def describe_mix(self, epoch, index):
        """Where sample ``index`` sits in ``epoch`` and how its batch is mixed: ``{"step",
        "row", "partner" (the sample whose image and label are mixed into it), "mode"
        ("mixup", "cutmix" or None), "lam" (the weight of its own label), "box" (CutMix:
        [top, left, height, width] in output pixels of the pasted partner; else None)}``, or
        None when this rank's shard does not deliver it in ``epoch`` (another rank's sample,
        or dropped by ``drop_last``). Rows replaced by ``on_error="skip"`` are not followed."""
        where = np.flatnonzero(self.sampler.indices(epoch) == index)
        if not where.size:
            return None
        step, row = divmod(int(where[0]), self.batch_size)
        if step >= self.batches_in(epoch):
            return None
        batch = self.step_indices(epoch, step)
        p = self.ops_at(epoch).params(epoch, step)
        box = p["box"]
        return {"step": step, "row": row, "partner": int(batch[(row - 1) % len(batch)]),
                "mode": p["mode"], "lam": p["lam"],
                "box": None if box is None else [box[1], box[0], box[3] - box[1],
                                                 box[2] - box[0]]}

    def step_indices(self, epoch, step):
        """Sample indices of batch ``step`` of ``epoch``: int64 (n,), n <= batch_size."""
        return self.sampler.batch(epoch, step, self.batch_size, self.drop_last)

    def valid_rows(self, epoch, step):
        """How many first rows of batch ``step`` of ``epoch`` count: all but the padding of
        ``shard_tail="mask"`` (:meth:`~dpu_pipe.sampler.EpochSampler.num_valid`)."""
        start = step * self.batch_size
        stop = min(start + self.batch_size, self.sampler.count(epoch))
        return self.sampler.num_valid(epoch, start, stop)

    def _buffers(self, indices):
        """BufferList of the samples, and {batch position: DecodeError} for unreadable ones.
        Samples held by the cache are not read: the kernel does not look at their buffers."""
        if self._gather is not None:
            return self._gather(indices)
        cached = (self.cache.ready(indices).tolist() if self.cache is not None
                  else [False] * len(indices))
        datas, errors = [b""] * len(indices), {}
        for j, i in enumerate(indices.tolist()):
            if not cached[j]:
                try:
                    datas[j] = self.source.read(i)
                except DecodeError as exc:
                    errors[j] = exc
        return _jpeg.BufferList.from_buffers(datas), errors

    def make(self, epoch, step, images, labels, out_indices=None):
        """Fill ``images[:n]`` and ``labels[:n]`` with batch ``step`` of ``epoch``, and
        ``out_indices[:n]`` (when given) with the dataset index of each row; return n.

        ``images``: a buffer as :meth:`rows` takes; ``labels``: :attr:`label_dtype`, shape
        (>= n, *:attr:`label_shape`); ``out_indices``: int64 (>= n,). Row j is sample
        ``step_indices(epoch, step)[j]``, or the replacement ``on_error="skip"`` chose. The
        batch ops (:mod:`dpu_pipe.mix`) run last.
        """
        indices = self.step_indices(epoch, step)
        n = len(indices)
        t0 = self._started = time.perf_counter()
        try:
            images = self.rows(images, epoch, n)
            kernel, ops = self.kernel_at(epoch), self.ops_at(epoch)
            bufs, read_errors = self._buffers(indices)
            t1 = time.perf_counter()
            _, info, errors = kernel.run(bufs, indices, epoch=epoch, seed=self.seed, out=images)
            other = int(np.count_nonzero(info[:, 0] == ST_OTHER_FORMAT))
            errors.update(read_errors)
            classes = self._classes if ops.soft else labels
            classes[:n] = self.labels[indices]
            if errors:
                indices = indices.copy()   # rows replaced below name their replacement
                self._handle_errors(epoch, step, indices, errors, images, classes)
            if out_indices is not None:
                out_indices[:n] = indices
            if ops.active:
                ops.apply(epoch, step, images, classes[:n], labels[:n], indices)
            t2 = time.perf_counter()
            st = self.stats
            with self._busy_lock:
                st.read_s += t1 - t0
                st.process_s += t2 - t1
                self._started = None
            st.batches += 1
            st.samples += n
            st.other_formats += other
            return n
        finally:
            if self._started is not None:       # it raised: the time was still spent
                with self._busy_lock:
                    self.stats.process_s += time.perf_counter() - t0
                    self._started = None

    def _named(self, exc, index):
        msg = exc.message if isinstance(exc, DecodeError) else str(exc)
        return DecodeError(msg, index=int(index), path=self.source.describe(int(index)))

    def _record_bad(self, index, err):
        if index not in self.bad_samples:
            self.bad_samples[index] = str(err)
            log.warning("skipping undecodable sample: %s", err)

    def _handle_errors(self, epoch, step, indices, errors, images, labels):
        if self.on_error == "raise":
            j = min(errors)
            raise self._named(errors[j], indices[j])
        shard_len = self.sampler.count(epoch)
        for j in sorted(errors):
            self._record_bad(int(indices[j]), self._named(errors[j], indices[j]))
            pos = step * self.batch_size + j
            for k in range(1, shard_len):
                at = (pos + k) % shard_len
                cand = int(self.sampler.indices(epoch, at, at + 1)[0])
                if cand in self.bad_samples:
                    continue
                row = ([v[j:j + 1] for v in images] if isinstance(images, list)
                       else images[j:j + 1])
                err = self._single(epoch, cand, row)
                if err is None:
                    labels[j] = self.labels[cand]
                    indices[j] = cand
                    break
                self._record_bad(cand, err)
            else:
                raise self._named(f"no decodable sample left in the shard to replace sample "
                                  f"{int(indices[j])}", indices[j])

    def _single(self, epoch, index, out):
        idx = np.array([index], dtype=np.int64)
        bufs, errors = self._buffers(idx)
        if errors:
            return self._named(errors[0], index)
        _, _, errors = self.kernel_at(epoch).run(bufs, idx, epoch=epoch, seed=self.seed,
                                                 out=out)
        return self._named(errors[0], index) if errors else None
