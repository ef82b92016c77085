"""Evaluating a model on validation batches: exact, mergeable metrics.

A :class:`Metrics` holds sums, never averages, so partial results from several producers or
hosts add up exactly. :func:`evaluate_steps` runs one shard's batches (made as by
``Loader(train=False)``) through a model, as a producer rank does for
:class:`~dpu_pipe.RemoteValidation`. Without torch, what needs it raises :class:`ConfigError`
naming the extra to install.
"""

import importlib
import json
import math
import threading
import time

import numpy as np

from . import _torch
from .errors import ConfigError
from .sources import open_source
from .spec import StreamSpec
from .batch import BatchMaker
from .cache import DecodedCache
from .transforms import TransformConfig
from .weights import load_state

__all__ = ["Metrics", "require_torch", "load_factory", "build_model", "evaluate_batch",
           "evaluate_steps", "evaluate_loader", "check_topk", "ShardEvaluator"]


def require_torch():
    """``torch``, or :class:`ConfigError` saying how to install it."""
    return _torch.require_torch("evaluating a model")


def check_topk(topk):
    """``topk`` as a sorted tuple of distinct positive ints (ConfigError otherwise)."""
    if isinstance(topk, (int, np.integer)) and not isinstance(topk, bool):
        topk = (topk,)
    try:
        ks = tuple(sorted({int(k) for k in topk}))
    except (TypeError, ValueError):
        raise ConfigError(f"topk must be positive integers, got {topk!r}") from None
    if not ks or ks[0] < 1 or any(isinstance(k, bool) for k in topk):
        raise ConfigError(f"topk must be positive integers, got {topk!r}")
    return ks


class Metrics:
    """Sums over evaluated samples: ``count``, ``loss_sum`` (float64) and ``correct[k]``.

    Top-k with k larger than the number of classes counts every sample as correct (its label
    is always among all the classes), as ``torch.topk`` with k clamped to the class count.
    """

    __slots__ = ("topk", "count", "loss_sum", "correct")

    def __init__(self, topk=(1, 5), count=0, loss_sum=0.0, correct=None):
        self.topk = check_topk(topk)
        self.count = int(count)
        self.loss_sum = float(loss_sum)
        self.correct = {k: 0 for k in self.topk}
        self.correct.update((int(k), int(v)) for k, v in (correct or {}).items())

    def merge(self, other):
        """Add ``other``'s sums to these (same ``topk``); returns self."""
        if other.topk != self.topk:
            raise ConfigError(f"cannot merge metrics of topk {other.topk} into {self.topk}")
        self.count += other.count
        self.loss_sum += other.loss_sum
        for k in self.topk:
            self.correct[k] += other.correct[k]
        return self

    def to_dict(self):
        """Plain, JSON-serialisable sums (what producers send back)."""
        return {"topk": list(self.topk), "count": self.count, "loss_sum": self.loss_sum,
                "correct": {str(k): v for k, v in self.correct.items()}}

    @classmethod
    def from_dict(cls, d):
        try:
            return cls(d["topk"], d["count"], d["loss_sum"],
                       {int(k): v for k, v in d["correct"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"not a metrics record: {d!r} ({exc})") from None

    def result(self):
        """{"count", "loss", "top1", "top5", ...}: loss is the summed cross-entropy divided by
        the count, ``topK`` the share of samples whose label is among the K highest logits
        (NaN for both when nothing was evaluated)."""
        n = self.count
        out = {"count": n, "loss": self.loss_sum / n if n else math.nan}
        return out | {f"top{k}": self.correct[k] / n if n else math.nan for k in self.topk}

    def __eq__(self, other):
        return isinstance(other, Metrics) and self.to_dict() == other.to_dict()

    def __repr__(self):
        return (f"Metrics(count={self.count}, loss_sum={self.loss_sum!r}, "
                f"correct={self.correct})")


def load_factory(spec):
    """The callable named by ``"package.module:function"`` (attributes may be dotted:
    ``"pkg.mod:Class.build"``)."""
    module_name, _, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not module_name or not attr or ":" in attr:
        raise ConfigError(f"model must be 'module:factory', got {spec!r}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for model {spec!r}: {exc}") from exc
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ConfigError(f"{module_name!r} has no attribute {attr!r} (model {spec!r})") from None
    if not callable(obj):
        raise ConfigError(f"model factory {spec!r} is not callable")
    return obj


def build_model(spec, kwargs=None):
    """Call the factory ``spec`` with ``kwargs``, check it made a ``torch.nn.Module`` and put
    it in eval mode; errors inside the factory propagate unchanged."""
    torch = require_torch()
    model = load_factory(spec)(**(kwargs or {}))
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model factory {spec!r} returned a {type(model).__name__}, "
                          "not a torch.nn.Module")
    return model.eval()


def evaluate_batch(model, images, labels, metrics, valid=None):
    """Add one batch to ``metrics`` (returned): ``images`` a float tensor or array
    (B, 3, H, W) or whatever the model takes, ``labels`` int64 (B,); the model, already in eval
    mode, runs under ``torch.no_grad`` on the whole batch, so every rank's forward has the same
    shape. ``valid`` says which rows count: None (all), an int k (the first k rows: a loader's
    ``valid_rows``) or a bool array or tensor (B,) (``meta["valid"]``)."""
    torch = require_torch()
    images = torch.as_tensor(images)
    labels = torch.as_tensor(labels, dtype=torch.int64)
    n = int(labels.shape[0])
    keep = _rows(valid, n, labels.device)
    if n == 0:
        return metrics
    with torch.no_grad():
        logits = model(images)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ConfigError(f"the model returned logits of shape {tuple(logits.shape)} "
                              f"for a batch of {n}; expected ({n}, classes)")
        if keep is not None:
            logits, labels = logits[keep], labels[keep]
            n = int(labels.shape[0])
        # Per-sample losses summed in float64: partial sums over different batchings (hosts,
        # producers) then agree to float64 rounding, not float32's.
        losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        metrics.loss_sum += float(losses.double().sum())
        kmax = min(metrics.topk[-1], logits.shape[1])
        top = torch.topk(logits, kmax, dim=1).indices
        hit = top == labels[:, None]
        for k in metrics.topk:
            metrics.correct[k] += int(hit[:, :min(k, kmax)].any(dim=1).sum())
    metrics.count += n
    return metrics


def _rows(valid, n, device):
    """``valid`` of :func:`evaluate_batch` as None (every row) or a bool tensor (n,)."""
    torch = require_torch()
    if valid is None:
        return None
    if isinstance(valid, (int, np.integer)) and not isinstance(valid, bool):
        if not 0 <= valid <= n:
            raise ConfigError(f"valid={valid} rows of a batch of {n}")
        return None if valid == n else torch.arange(n, device=device) < int(valid)
    keep = torch.as_tensor(valid, device=device)
    if keep.dtype != torch.bool or tuple(keep.shape) != (n,):
        raise ConfigError(f"valid must be None, a row count or a bool mask of shape ({n},), "
                          f"got {keep.dtype} {tuple(keep.shape)}")
    return keep


def evaluate_loader(model, loader, *, topk=(1, 5), device=None):
    """:class:`Metrics` of ``model`` (in eval mode) over the rest of ``loader``'s epoch on this
    rank, valid rows only (the ranks' sums count each sample once). ``device``: where images
    and labels go before the forward (default: where the loader yields them)."""
    metrics = Metrics(topk)
    for batch in loader:
        images, labels = batch[0], batch[1]
        if device is not None:
            images, labels = images.to(device), labels.to(device)
        evaluate_batch(model, images, labels, metrics, valid=loader.valid_rows)
    return metrics


def evaluate_steps(model, maker, steps, *, topk=(1, 5), epoch=0, images=None, labels=None):
    """Evaluate the batches ``steps`` (step numbers) of ``maker`` (a
    :class:`~dpu_pipe.batch.BatchMaker` with the validation transform) with ``model``, valid
    rows only; returns (:class:`Metrics`, seconds making batches, seconds in the model).
    ``images``/``labels``: optional batch buffers to reuse (``maker.batch_shape`` of the
    transform's dtype, and int64 (batch_size,))."""
    torch = require_torch()
    if images is None:
        images = np.empty(maker.batch_shape, maker.transform.np_dtype)
    if labels is None:
        labels = np.empty(maker.batch_size, np.int64)
    metrics = Metrics(topk)
    make_s = model_s = 0.0
    for step in steps:
        t0 = time.perf_counter()
        n = maker.make(epoch, step, images, labels)
        t1 = time.perf_counter()
        evaluate_batch(model, torch.from_numpy(images[:n]), torch.from_numpy(labels[:n]),
                       metrics, valid=maker.valid_rows(epoch, step))
        model_s += time.perf_counter() - t1
        make_s += t1 - t0
    return metrics, make_s, model_s


class ShardEvaluator:
    """What a producer keeps between validation requests: the model built once per factory
    and arguments, and one :class:`~dpu_pipe.batch.BatchMaker` per validation spec.

    A *validation spec* is a JSON-serialisable dict: ``source`` (a source spec, see
    :func:`dpu_pipe.sources.open_source`), ``transform`` (``TransformConfig.to_dict()``),
    ``batch_size``, ``rank``/``world_size`` (the host's shard), ``shard_tail`` (``"mask"``,
    the default, or ``"uneven"``), ``model`` (``"module:factory"``), ``model_kwargs``,
    ``topk``, ``num_threads`` and ``cache_bytes`` (0 or absent: no cache).

    Parameters
    ----------
    cache_for : callable, optional
        ``cache_for(spec, num_samples)``: the cache of a spec with ``cache_bytes`` (a
        producer's node cache); default: a :class:`~dpu_pipe.cache.DecodedCache` of this process.
    """

    def __init__(self, cache_for=None):
        self._models = {}
        self._makers = {}
        self._cache_for = cache_for or (lambda spec, n: DecodedCache(spec["cache_bytes"], n))
        # The cached model and each maker's kernel and buffers are not for two threads.
        self._lock = threading.Lock()

    def model(self, spec, kwargs):
        key = (spec, json.dumps(kwargs or {}, sort_keys=True))
        model = self._models.get(key)
        if model is None:
            model = self._models[key] = build_model(spec, kwargs)
        return model

    def maker(self, spec):
        """The :class:`~dpu_pipe.batch.BatchMaker` of validation spec ``spec``."""
        tail = spec.get("shard_tail", "mask")
        if tail not in ("mask", "uneven"):
            raise ConfigError(f"validation shard_tail must be 'mask' or 'uneven' (every sample "
                              f"once), got {tail!r}")
        key = self._key(spec)
        maker = self._makers.get(key)
        if maker is None:
            transform = TransformConfig.from_dict(spec["transform"])
            # Loader(train=False)'s sharding: every sample counts once over the hosts.
            stream = StreamSpec(open_source(spec["source"]), spec["batch_size"], transform,
                                shuffle=False, shard_tail=tail, drop_last=False,
                                rank=spec["rank"], world_size=spec["world_size"])
            cache = self._cache_for(spec, len(stream.source)) if spec.get("cache_bytes") else None
            maker = BatchMaker(stream, spec.get("num_threads", 1), cache)
            maker.buffers = (np.empty(maker.batch_shape, transform.np_dtype),
                             np.empty(maker.batch_size, np.int64))
            self._makers[key] = maker
        return maker

    @staticmethod
    def _key(spec):
        return json.dumps({k: spec[k] for k in ("source", "transform", "batch_size", "rank",
                                                "world_size", "num_threads")}
                          | {"shard_tail": spec.get("shard_tail", "mask"),
                             "cache_bytes": spec.get("cache_bytes", 0)}, sort_keys=True)

    def cache_stats(self, spec):
        """The counters of the cache spec ``spec``'s batches use (``{"hits", "misses",
        "bytes", "entries", "did_not_fit"}``), or None without one."""
        maker = self._makers.get(self._key(spec))
        return None if maker is None or maker.cache is None else maker.cache.stats()

    def run(self, spec, weights, part=0, parts=1):
        """Evaluate the steps ``part, part + parts, ...`` of the shard ``spec`` describes with
        the weights buffer ``weights`` (:mod:`dpu_pipe.weights`) loaded into the model, one
        call at a time; returns what :func:`evaluate_steps` does."""
        with self._lock:
            model = self.model(spec["model"], spec.get("model_kwargs"))
            load_state(model, weights)
            model.eval()
            maker = self.maker(spec)
            images, labels = maker.buffers
            return evaluate_steps(model, maker, range(part, maker.num_batches, parts),
                                  topk=spec["topk"], images=images, labels=labels)
