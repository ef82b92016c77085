"""Batch ops: MixUp / CutMix with soft, smoothed labels, then the user's ``batch_hook``, run on
a finished batch by whichever side made it (loader thread, hybrid host thread, producer rank).
Semantics (torchvision v2's ``MixUp`` / ``CutMix``, timm's switch, probability and
``mixup_target``) and the hook's contract: docs/guides/recipes.md.

Randomness is keyed by the batch (stream ``STREAM_MIX`` of :mod:`dpu_pipe.rng`, index words
``step | rank << 32``: each rank its own λ, as in timm's DDP runs), so batch ``s`` of epoch
``e`` mixes the same whoever makes it. Validation loaders never mix.
"""

import importlib
import math

import numpy as np

from . import _mix
from . import _validate as _v
from . import rng
from .errors import ConfigError, DpuPipeError

__all__ = ["mix_params", "cutmix_box", "BatchOps", "load_hook", "hook_rng"]


def mix_params(config, seed, epoch, step, rank=0):
    """The mix of batch ``step`` of ``epoch`` for ``config`` (a train TransformConfig) as a
    dict: ``mode`` ("mixup", "cutmix" or None), ``lam`` (each row's own label weight, after
    the CutMix correction), ``box`` (CutMix: ``(x1, y1, x2, y2)`` in output pixels,
    torchvision's order, end exclusive; else None)."""
    h, w = config.recipe.size
    ops = config.batch_ops
    index = int(step) | int(rank) << 32
    # The kernel twins of rng.uniforms and rng.beta_variate (tests hold them equal): a few
    # microseconds per batch instead of numpy's per-call overheads.
    u_mix, u_switch = _mix.uniforms(seed, epoch, index, rng.STREAM_MIX, 0)
    a_mix, a_cut = ops.mixup_alpha, ops.cutmix_alpha
    if not (a_mix > 0 or a_cut > 0) or not u_mix < ops.mix_p:
        return dict(mode=None, lam=1.0, box=None)
    cut = a_cut > 0 and (a_mix == 0 or u_switch < ops.mix_switch_p)
    alpha = a_cut if cut else a_mix
    lam = _mix.beta_variate(seed, epoch, index, rng.STREAM_MIX, alpha, alpha, first_block=2)
    if not cut:
        return dict(mode="mixup", lam=lam, box=None)
    ux, uy = _mix.uniforms(seed, epoch, index, rng.STREAM_MIX, 1)
    box, lam = cutmix_box(lam, int(math.floor(ux * w)), int(math.floor(uy * h)), h, w)
    return dict(mode="cutmix", lam=lam, box=box)


def cutmix_box(lam, r_x, r_y, height, width):
    """``((x1, y1, x2, y2), corrected λ)`` of CutMix for λ and the box centre
    ``(r_x, r_y)`` (pixels) in a ``height`` x ``width`` image, as ``v2.CutMix.make_params``."""
    r = 0.5 * math.sqrt(1.0 - lam)
    r_w, r_h = int(r * width), int(r * height)
    x1, y1 = max(r_x - r_w, 0), max(r_y - r_h, 0)
    x2, y2 = min(r_x + r_w, width), min(r_y + r_h, height)
    return (x1, y1, x2, y2), float(1.0 - (x2 - x1) * (y2 - y1) / (width * height))


def load_hook(path):
    """The function ``path`` ("module:function") names; ConfigError naming it otherwise."""
    path = _v.hook_path(path, "batch_hook")
    module, _, name = path.partition(":")
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's setting
        raise ConfigError(f"batch_hook {path!r}: cannot import {module!r} "
                          f"({type(exc).__name__}: {exc})") from exc
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ConfigError(f"batch_hook {path!r}: module {module!r} has no function {name!r}")
    return fn


def hook_rng(seed, epoch, step, rank=0):
    """The ``numpy.random.Generator`` batch ``step`` of ``epoch`` gives ``batch_hook``."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(
        [int(seed), int(epoch), int(rank), int(step), rng.STREAM_HOOK])))


class BatchOps:
    """The batch ops of one stream: mixing (train only) and the hook. ``seed`` and ``rank``,
    the stream's, key the mix and the hook's Generator."""

    def __init__(self, config, seed, rank):
        self.config = config
        self.seed, self.rank = int(seed), int(rank)
        self.soft = config.soft_labels
        self.hook_path = config.batch_ops.batch_hook
        self.hook = load_hook(self.hook_path) if self.hook_path else None

    @property
    def active(self):
        return self.soft or self.hook is not None

    def params(self, epoch, step):
        return mix_params(self.config, self.seed, epoch, step, self.rank)

    def apply(self, epoch, step, images, classes, labels, indices):
        """Mix ``images`` (n rows) and write the soft labels of ``classes`` (int64 (n,))
        into ``labels`` (float32 (n, num_classes)) when mixing or smoothing; then run the
        hook on ``(images, labels)``. ``indices`` (the rows' samples) name a failing batch."""
        recipe, cfg = self.config.recipe, self.config.batch_ops
        if self.soft:
            p = self.params(epoch, step)
            if p["mode"] == "mixup":
                _mix.mixup(images, p["lam"], recipe.dtype)
            elif p["mode"] == "cutmix":
                _mix.cutmix(images, p["box"], recipe.layout)
            bad = np.flatnonzero((classes < 0) | (classes >= cfg.num_classes))
            if bad.size:
                j = int(bad[0])
                raise ConfigError(f"sample {int(indices[j])} has label {int(classes[j])}, "
                                  f"outside 0..{cfg.num_classes - 1} (num_classes="
                                  f"{cfg.num_classes})")
            _mix.soft_labels(classes, cfg.num_classes, p["lam"], cfg.label_smoothing,
                             out=labels)
        if self.hook is not None:
            self._run_hook(epoch, step, images, labels, indices)

    def _run_hook(self, epoch, step, images, labels, indices):
        try:
            result = self.hook(images, labels, hook_rng(self.seed, epoch, step, self.rank))
        except Exception as exc:  # noqa: BLE001 - named with its batch, cause kept
            raise DpuPipeError(
                f"batch_hook {self.hook_path!r} raised on batch {step} of epoch {epoch} "
                f"(rank {self.rank}, samples {_few(indices)}): {type(exc).__name__}: "
                f"{exc}") from exc
        if result is None:
            return
        try:
            new_images, new_labels = result
        except (TypeError, ValueError):
            new_images = new_labels = None
        for name, new, old in (("images", new_images, images), ("labels", new_labels, labels)):
            if not (isinstance(new, np.ndarray) and new.shape == old.shape
                    and new.dtype == old.dtype):
                raise DpuPipeError(
                    f"batch_hook {self.hook_path!r} on batch {step} of epoch {epoch}: must "
                    f"return None or (images, labels) arrays; its {name} are not "
                    f"{old.dtype}{old.shape}")
            if new is not old:
                np.copyto(old, new)


def _few(indices, count=4):
    idx = [int(i) for i in indices[:count]]
    return ", ".join(map(str, idx)) + (", ..." if len(indices) > count else "")
