"""Producing step ``s`` of epoch ``e``: which samples, their bytes, the batch kernel, and what
happens to samples that cannot be decoded. Local loader threads and DPU producer ranks run
the same code, so the stream is the same whoever makes it.
"""

import dataclasses
import logging
import time

import numpy as np

from . import _jpeg
from . import _validate as _v
from .batch import ST_OTHER_FORMAT, BatchProcessor
from .errors import ConfigError, DecodeError
from .sampler import EpochSampler

__all__ = ["StepProducer", "StepStats", "ON_ERROR"]

log = logging.getLogger("dpu_pipe")

ON_ERROR = ("raise", "skip")


@dataclasses.dataclass
class StepStats:
    """What one :class:`StepProducer` has made: seconds reading bytes (``read_s``) and in
    the batch kernel (``process_s``), batches and samples made, and samples that were not
    JPEGs (decoded by OpenCV, ``other_formats``).

    Each producer thread owns one (updated without a lock); whoever reports a total adds
    them with ``+``, so no producer's work is left out of it.
    """

    read_s: float = 0.0
    process_s: float = 0.0
    batches: int = 0
    samples: int = 0
    other_formats: int = 0

    def __add__(self, other):
        return StepStats(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                            for f in dataclasses.fields(self)})

    def as_dict(self):
        return dataclasses.asdict(self)


class StepProducer:
    """Makes the batches of one rank's shard.

    Parameters
    ----------
    source : a dpu_pipe source (``ImageFolder``, ``FileList``, ``PackedSource``)
    batch_size : int
    transform : TransformConfig
    seed, shuffle, rank, world_size, shard_tail : as :class:`~dpu_pipe.sampler.EpochSampler`
        (``shard_tail="uneven"``: every sample once across ranks, for exact evaluation).
    drop_last : bool
        Drop this rank's last partial batch (as ``DataLoader``); False keeps it, shorter.
    num_threads : int
        Threads of the batch kernel.
    on_error : "raise" or "skip"
        ``"raise"``: the first undecodable sample of a batch raises :class:`DecodeError` naming
        its index and file. ``"skip"``: it is replaced by the next sample of the shard's
        reading order that decodes (wrapping around; the replacement keeps its own index,
        crop and label), so the batch keeps its size and the choice is the same on every run;
        the bad sample is recorded in :attr:`bad_samples` and logged once.
    """

    def __init__(self, source, batch_size, transform, *, seed=0, shuffle=True, rank=0,
                 world_size=1, shard_tail="pad", drop_last=False, num_threads=1,
                 on_error="raise"):
        on_error = _v.choice(on_error, "on_error", ON_ERROR)
        self.source = source
        self.batch_size = _v.positive_int(batch_size, "batch_size")
        self.on_error = on_error
        self.sampler = EpochSampler(len(source), seed=seed, shuffle=shuffle, rank=rank,
                                    world_size=world_size, shard_tail=shard_tail)
        self.num_batches = self.sampler.num_batches(self.batch_size, drop_last)
        self.drop_last = bool(drop_last)
        self.seed = self.sampler.seed
        # With uneven shards a rank may legitimately have nothing to read (n < world_size);
        # otherwise every rank has the same count, and none means a useless configuration.
        if self.num_batches == 0 and self.sampler.shard_tail != "uneven":
            raise ConfigError(
                f"no batches: {len(self.sampler)} samples per rank and batch_size="
                f"{self.batch_size} with drop_last=True; lower batch_size or set "
                f"drop_last=False")
        self.kernel = BatchProcessor(transform, num_threads)
        self.transform = self.kernel.config
        labels = np.asarray(source.labels)
        #: Labels of every sample: int64, or float32 (FileList float labels); (N,) or (N, K).
        self.labels = labels.astype(np.int64 if labels.dtype.kind in "iub" else np.float32,
                                    copy=False)
        # A packed source gathers a batch's records itself, without a copy per record.
        self._gather = getattr(source, "buffers", None)
        #: {sample index: error message} of the samples found undecodable (skip mode).
        self.bad_samples = {}
        #: What this producer has made (:class:`StepStats`).
        self.stats = StepStats()

    @property
    def batch_shape(self):
        return (self.batch_size,) + self.transform.sample_shape

    def step_indices(self, epoch, step):
        """Sample indices of batch ``step`` of ``epoch``: int64 (n,), n <= batch_size."""
        return self.sampler.batch(epoch, step, self.batch_size, self.drop_last)

    def _buffers(self, indices):
        """BufferList of the samples, and {batch position: DecodeError} for unreadable ones."""
        if self._gather is not None:
            return self._gather(indices)
        datas, errors = [], {}
        for j, i in enumerate(indices.tolist()):
            try:
                datas.append(self.source.read(i))
            except DecodeError as exc:
                errors[j] = exc
                datas.append(b"")
        return _jpeg.BufferList.from_buffers(datas), errors

    def produce(self, epoch, step, images, labels, out_indices=None):
        """Fill ``images[:n]`` and ``labels[:n]`` with batch ``step`` of ``epoch``, and
        ``out_indices[:n]`` (when given) with the dataset index of each row.

        ``images`` is a C-contiguous array of shape (>= n, *sample_shape) and the transform's
        dtype, ``labels`` of :attr:`labels`' dtype and shape (>= n, ...), ``out_indices``
        int64 (>= n,). Row j is sample ``step_indices(epoch, step)[j]``, except where
        ``on_error="skip"`` replaced an undecodable sample: ``out_indices[j]`` then names the
        replacement, the sample whose image and label the row holds. Returns n, the batch's
        sample count.
        """
        indices = self.step_indices(epoch, step)
        n = len(indices)
        t0 = time.perf_counter()
        bufs, read_errors = self._buffers(indices)
        t1 = time.perf_counter()
        _, info, errors = self.kernel.run(bufs, indices, epoch=epoch, seed=self.seed,
                                          out=images[:n])
        other = int(np.count_nonzero(info[:, 0] == ST_OTHER_FORMAT))
        t2 = time.perf_counter()
        errors.update(read_errors)
        labels[:n] = self.labels[indices]
        if errors:
            indices = indices.copy()   # rows replaced below name their replacement
            self._handle_errors(epoch, step, indices, errors, images, labels)
        if out_indices is not None:
            out_indices[:n] = indices
        t3 = time.perf_counter()
        st = self.stats
        st.read_s += t1 - t0
        st.process_s += (t2 - t1) + (t3 - t2)
        st.batches += 1
        st.samples += n
        st.other_formats += other
        return n

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
        shard_len = len(self.sampler)
        for j in sorted(errors):
            self._record_bad(int(indices[j]), self._named(errors[j], indices[j]))
            pos = step * self.batch_size + j
            for k in range(1, shard_len):
                at = (pos + k) % shard_len
                cand = int(self.sampler.indices(epoch, at, at + 1)[0])
                if cand in self.bad_samples:
                    continue
                err = self._single(epoch, cand, images[j:j + 1])
                if err is None:
                    labels[j] = self.labels[cand]
                    indices[j] = cand
                    break
                self._record_bad(cand, err)
            else:
                raise DecodeError(f"no decodable sample left in the shard to replace sample "
                                  f"{int(indices[j])}", index=int(indices[j]),
                                  path=self.source.describe(int(indices[j])))

    def _single(self, epoch, index, out):
        idx = np.array([index], dtype=np.int64)
        bufs, errors = self._buffers(idx)
        if errors:
            return self._named(errors[0], index)
        _, _, errors = self.kernel.run(bufs, idx, epoch=epoch, seed=self.seed, out=out)
        return self._named(errors[0], index) if errors else None
