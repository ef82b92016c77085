"""The batch kernel: N encoded images → one (N, C, H, W) (or (N, H, W, C)) batch.

A sample's random parameters come from the counter-based RNG (:mod:`dpu_pipe.rng`) keyed by
(seed, epoch, sample index), so its output depends only on its bytes, its index, the epoch,
the seed and the :class:`~dpu_pipe.transforms.TransformConfig`: not on its batch, its position
or the number of threads. A multi-view recipe (:mod:`dpu_pipe.views`) decodes each sample once
and makes one batch per view.
"""

import functools
import threading
import warnings

import numpy as np

from . import _augment, _jpeg, _pipeline
from . import _validate as _v
from .augment import kernel_params
from .errors import ConfigError, DecodeError
from .transforms import TransformConfig

__all__ = ["BatchProcessor", "SampleInfo"]

STATUS_NAMES = {0: "ok", 1: "ok, decoded by OpenCV", -1: "decode error",
                -2: "budget exceeded", -3: "bad region", -4: "out of memory",
                -10: "resampling error", -11: "not a JPEG"}
#: ``info`` status of a sample that is not a JPEG and was decoded by OpenCV instead.
ST_OTHER_FORMAT = 1
_ST_NOT_JPEG = -11

#: Columns of the ``info`` array returned by :meth:`BatchProcessor.run`.
SampleInfo = ("status", "top", "left", "height", "width", "flip", "scale")


class BatchProcessor:
    """Decode and augment batches with one transform on ``num_threads`` threads.

    Parameters
    ----------
    config : TransformConfig or dict, optional
        The transform of one output size; default ``TransformConfig()``.
    num_threads : int
        OpenMP threads sharing each batch (the GIL is released for the whole batch).
    cache : dpu_pipe.cache.DecodedCache, optional
        Keeps and serves the reduced images of ``decode_max_side`` (which the config must
        set); the output is the same without it.

    Calls from several threads take turns, one batch at a time: the decoders and scratch
    buffers belong to the processor. For batches in parallel, give each thread its own
    processor (they may share one cache).
    """

    def __init__(self, config=None, num_threads=1, cache=None):
        if config is None:
            config = TransformConfig()
        elif isinstance(config, dict):
            config = TransformConfig.from_dict(config)
        elif not isinstance(config, TransformConfig):
            raise ConfigError(f"config must be a TransformConfig, got {type(config).__name__}")
        if config.progressive:
            raise ConfigError("a batch kernel makes one output size: give it one epoch's "
                              "transform, config.at_epoch(epoch), of a progressive size")
        self.num_threads = _v.positive_int(num_threads, "num_threads")
        if self.num_threads > 1 and not _jpeg.build_flags()["openmp"]:
            warnings.warn("dpu_pipe was built without OpenMP: batches run on one thread "
                          "whatever num_threads says (rebuild with a compiler that has "
                          "OpenMP, and without DPU_PIPE_OPENMP=0)", RuntimeWarning,
                          stacklevel=2)
        self.config = config
        if cache is not None and config.decode.decode_max_side is None:
            raise ConfigError("cache_bytes needs decode_max_side: the cache holds the reduced "
                              "images that decode_max_side makes")
        #: The :class:`~dpu_pipe.cache.DecodedCache` this kernel uses, or None.
        self.cache = cache
        self._kernel = _pipeline.Pipeline(config.to_dict(), self.num_threads,
                                          None if cache is None else cache.kernel)
        self._lock = threading.Lock()
        #: Views of the recipe (1 without ``views``).
        self.num_views = len(config.view_shapes)
        self._augmenters = [
            _augment.Augmenter(kernel_params(vtc, view, v))
            if vtc.augmented or view is not None else None
            for v, (vtc, view) in enumerate(config.per_view())]

    @property
    def sample_shape(self):
        return self.config.sample_shape

    def empty(self, n):
        """An uninitialised output batch of n samples (with views, a list: one per view)."""
        out = [np.empty((n,) + shape, dtype=self.config.np_dtype)
               for shape in self.config.view_shapes]
        return out if self.config.views is not None else out[0]

    def run(self, buffers, indices, *, epoch=0, seed=0, out=None):
        """Process ``buffers[i]`` as sample ``indices[i]`` of ``epoch``.

        Parameters
        ----------
        buffers : sequence of bytes-like, or ``_jpeg.BufferList``
        indices : int array (N,)
            Sample indices in the dataset, >= 0: they key the random parameters.
        epoch, seed : int
            Unsigned, of 32 and 64 bits.
        out : array (N, *sample_shape) of the configured dtype, optional
            With views, a list of them (shapes ``config.view_shapes``).

        Returns
        -------
        (out, info, errors)
            ``info``: int32 (N, 7 * views), the columns of :data:`SampleInfo` for each view in
            turn (column 0, the status, is the sample's): the crop box in full-resolution
            pixels and the DCT scale in eighths (with ``decode_max_side``: of the reduced
            image and of its decode). ``errors``: {batch position: :class:`DecodeError`}
            (``index``: the sample index); a failed sample's slot in ``out`` is garbage.

        Samples that are not JPEG streams are decoded by OpenCV (status
        :data:`ST_OTHER_FORMAT`). A sample found in the cache is cut from its cached image,
        its buffer (possibly empty) not read.
        """
        bufs = buffers if isinstance(buffers, _jpeg.BufferList) else \
            _jpeg.BufferList.from_buffers(buffers)
        n = len(bufs)
        idx = np.ascontiguousarray(indices, dtype=np.int64)
        if idx.shape != (n,):
            raise ConfigError(f"indices must have shape ({n},), got {idx.shape}")
        if n and idx.min() < 0:
            raise ConfigError("sample indices must be non-negative")
        if not 0 <= int(epoch) < 2**32 or not 0 <= int(seed) < 2**64:
            raise ConfigError("epoch must fit in 32 bits and seed in 64 bits, unsigned")
        if out is None:
            out = self.empty(n)
        outs = out if self.config.views is not None else [out]
        if not (isinstance(outs, (list, tuple)) and len(outs) == self.num_views and all(
                isinstance(o, np.ndarray) and o.dtype == self.config.np_dtype
                and o.shape == (n,) + shape and o.flags.c_contiguous and o.flags.writeable
                for o, shape in zip(outs, self.config.view_shapes))):
            raise ConfigError(f"out must be {'a list of ' if self.config.views else ''}"
                              f"writable C-contiguous {self.config.recipe.dtype} array(s) of "
                              f"shape {[(n,) + s for s in self.config.view_shapes]}")
        info = np.zeros((n, len(SampleInfo) * self.num_views), dtype=np.int32)
        with self._lock:
            messages = self._kernel.run(bufs, idx, int(seed), int(epoch), out, info)
            for i in [i for i in messages if info[i, 0] == _ST_NOT_JPEG]:
                messages[i] = self._other_format(bufs, i, int(idx[i]), int(seed), int(epoch),
                                                 out, info)
        errors = {i: DecodeError(f"{msg} [{STATUS_NAMES.get(int(info[i, 0]), 'error')}]",
                                 index=int(idx[i]))
                  for i, msg in messages.items() if msg is not None}
        return out, info, errors

    def describe(self, data, index, *, epoch=0, seed=0):
        """The parameters sample ``index`` of ``epoch`` gets from ``data``, in the order they
        apply (docs/guides/recipes.md): ``"crop"`` [top, left, height, width] in source pixels
        (validation: the centre box, floored; with ``decode_max_side``, of the reduced image),
        ``"flip"``, ``"ops"``, ``"jitter"``, ``"grayscale"``, ``"erase"``, ``"blur"``
        ({"sigma", "kernel"} or None), ``"solarize"`` (the threshold or None). With views, a
        list of such dicts, each with ``"scale"`` (the DCT scale of the one decode, eighths).
        Raises the sample's DecodeError when the bytes do not decode."""
        _, info, errors = self.run([data], [index], epoch=epoch, seed=seed)
        if errors:
            raise errors[0]
        found = []
        for v, aug in enumerate(self._augmenters):
            row = info[0, v * len(SampleInfo):(v + 1) * len(SampleInfo)]
            out = {"crop": [int(c) for c in row[1:5]],
                   "flip": bool(row[5]), "ops": [], "jitter": {}, "grayscale": False,
                   "erase": None, "blur": None, "solarize": None}
            if aug is not None and self.config.train:
                out.update(aug.params(int(seed), int(epoch), int(index)))
            if self.config.views is not None:
                out["scale"] = int(row[6])
            found.append(out)
        return found if self.config.views is not None else found[0]

    def _other_format(self, bufs, i, index, seed, epoch, out, info):
        """Decode ``bufs[i]`` with OpenCV and run the fused pass on it; None or a message."""
        cv2 = _cv2()
        if cv2 is None:
            return "not a JPEG stream, and other formats need OpenCV: pip install " \
                   "opencv-python-headless"
        data = np.frombuffer(_pipeline.buffer_bytes(bufs, i), np.uint8)
        img = cv2.imdecode(data, cv2.IMREAD_COLOR) if data.size else None
        if img is None:
            return "neither a JPEG stream nor an image format OpenCV decodes"
        if img.shape[0] * img.shape[1] > self.config.decode.max_pixels:
            return (f"image of {img.shape[1]}x{img.shape[0]} pixels exceeds max_pixels="
                    f"{self.config.decode.max_pixels}")
        rgb = np.ascontiguousarray(cv2.cvtColor(img, cv2.COLOR_BGR2RGB))
        msg = self._kernel.run_decoded(rgb, index, seed, epoch, out, i, info)
        if msg is None:
            info[i, 0] = ST_OTHER_FORMAT
        return msg


@functools.cache
def _cv2():
    """OpenCV (None when not installed), imported on the first non-JPEG sample so that only
    datasets of other formats pay its 16 MiB and thread. A long-lived producer calls
    :func:`load_other_formats` at start-up instead, to keep its memory and threads flat."""
    try:
        import cv2
    except ImportError:
        return None
    cv2.setNumThreads(1)   # the caller's threads are the parallelism
    return cv2


def load_other_formats():
    """Import OpenCV now rather than at the first non-JPEG sample; True when it is there."""
    return _cv2() is not None
