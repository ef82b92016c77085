"""The one place that checks user arguments. Each check returns the normalised value or
raises :class:`~dpu_pipe.errors.ConfigError` naming the argument and what it accepts.

Truthiness is never accepted as a bool (``train="no"`` is a mistake, not ``True``), numbers
must be finite (a NaN mean would reach the kernel), and bools are never integers.
"""

import math
import numbers

import numpy as np

from .constants import INTERPOLATIONS, OUTPUT_DTYPES
from .errors import ConfigError

__all__ = ["boolean", "integer", "positive_int", "number", "pair", "triple", "choice",
           "seconds", "names", "dtype", "bad_budget", "hook_path", "color_jitter",
           "erase_value", "progressive", "image_size", "crop_range", "view", "OUTPUT_DTYPES"]

#: Largest side of an image, in pixels: JPEG's own limit.
MAX_SIDE = 65500


def boolean(value, name):
    """``value`` as a bool; only ``True``/``False`` (or numpy bools) are accepted."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ConfigError(f"{name} must be True or False, got {value!r}")


def integer(value, name, low=None, high=None):
    """``value`` as an int in ``[low, high]`` (inclusive; ``None`` = unbounded)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        if high is None:
            raise ConfigError(f"{name} must be an integer >= {low}, got {value}")
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value}")
    return value


def positive_int(value, name):
    """An integer >= 1."""
    return integer(value, name, low=1)


def number(value, name, low=None, high=None, *, low_open=False):
    """``value`` as a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, got {value}")
    below = low is not None and (value <= low if low_open else value < low)
    if below or (high is not None and value > high):
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"<= {high}"
        raise ConfigError(f"{name} must be {' and '.join(x for x in (lo, hi) if x)}, "
                          f"got {value}")
    return value


def bad_budget(value, count, name="max_bad"):
    """The number of bad samples tolerated among ``count``: ``None`` (no limit) stays None,
    an integer >= 0 is a count, a float in [0, 1] a fraction of ``count`` (rounded down)."""
    if value is None:
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return integer(value, name, low=0)
    if isinstance(value, (float, np.floating)):
        return int(number(value, name, 0.0, 1.0) * count)
    raise ConfigError(f"{name} must be None, an integer >= 0 or a fraction in [0, 1], "
                      f"got {value!r}")


def _items(value, name, count, what):
    """The ``count`` items of ``value``; ConfigError "``name`` must be ``what``" otherwise."""
    try:
        items = tuple(value)
    except TypeError:
        raise ConfigError(f"{name} must be {what}, got {value!r}") from None
    if len(items) != count:
        raise ConfigError(f"{name} must be {what}, got {value!r}")
    return items


def _numbers(value, name, count, what):
    return tuple(number(v, name) for v in _items(value, name, count, what))


def pair(value, name):
    """A ``(min, max)`` pair of finite floats with ``min <= max``."""
    lo, hi = _numbers(value, name, 2, "a (min, max) pair of numbers")
    if lo > hi:
        raise ConfigError(f"{name} must have min <= max, got {value!r}")
    return lo, hi


def triple(value, name):
    """Three finite floats (one per R, G, B channel)."""
    return _numbers(value, name, 3, "3 numbers (R, G, B)")


#: Elements an erase_value="random" box may have: 16 Philox streams of 2**16 blocks of 4 words
#: (dpu_pipe/rng.py, STREAM_ERASE_NOISE).
ERASE_NOISE_MAX = 16 * 2**16 * 4


def erase_value(value, dtype, size):
    """RandomErasing's value: ``"random"`` (standard normal values in the normalized float
    domain; refused for uint8 outputs, which have no such domain, and for outputs whose 3 x H
    x W elements exceed the noise streams) or three finite floats (one number: all three)."""
    if isinstance(value, str):
        if value != "random":
            raise ConfigError(f"erase_value must be 'random' or 3 numbers (R, G, B), got {value!r}")
        if dtype == "uint8":
            raise ConfigError("erase_value='random' draws standard normal values in the "
                              "normalized float domain; a uint8 output is not normalized: use "
                              "a float dtype, or a constant erase_value")
        if 3 * size[0] * size[1] > ERASE_NOISE_MAX:
            raise ConfigError(f"erase_value='random' supports outputs of up to "
                              f"{ERASE_NOISE_MAX // 3} pixels, got {size[0]}x{size[1]}")
        return value
    return triple((value,) * 3 if isinstance(value, (int, float)) else value, "erase_value")


def color_jitter(value, name="color_jitter"):
    """ColorJitter's ``(brightness, contrast, saturation, hue)`` as four floats (one number:
    the first three, hue 0; three numbers: hue 0), or None when every factor is 0."""
    if value is None:
        return None
    cj = (value, value, value, 0.0) if isinstance(value, (int, float)) else value
    try:
        cj = tuple(float(v) for v in cj)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be None, a number or (brightness, contrast, "
                          f"saturation, hue), got {value!r}") from None
    if len(cj) == 3:
        cj = cj + (0.0,)
    if len(cj) != 4 or not all(0.0 <= v < 1e6 for v in cj) or cj[3] > 0.5:
        raise ConfigError(f"{name} must be (brightness, contrast, saturation, hue) with each "
                          f">= 0 and hue <= 0.5, got {value!r}")
    return cj if any(cj) else None


#: Epochs are 32-bit (the RNG keys them so).
_EPOCH_LIMIT = 2**32 - 1


def progressive(min_size, max_size, start_epoch, end_epoch, multiple):
    """The fields of a progressive size (:func:`dpu_pipe.progressive_size`) as ints:
    ``1 <= min_size <= max_size`` (pixels, at most 65500), ``0 <= start_epoch <= end_epoch
    < 2**32`` and ``multiple >= 1``."""
    min_size = integer(min_size, "min_size", 1, MAX_SIDE)
    max_size = integer(max_size, "max_size", 1, MAX_SIDE)
    if min_size > max_size:
        raise ConfigError(f"progressive_size needs min_size <= max_size, got {min_size} "
                          f"and {max_size}")
    start_epoch = integer(start_epoch, "start_epoch", 0, _EPOCH_LIMIT)
    end_epoch = integer(end_epoch, "end_epoch", 0, _EPOCH_LIMIT)
    if start_epoch > end_epoch:
        raise ConfigError(f"progressive_size needs start_epoch <= end_epoch, got "
                          f"{start_epoch} and {end_epoch}")
    multiple = integer(multiple, "multiple", 1, MAX_SIDE)
    return min_size, max_size, start_epoch, end_epoch, multiple


def image_size(value, name="size"):
    """An image size in pixels as ``(height, width)`` positive ints (one int: square)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        value = (value, value)
    return tuple(positive_int(v, name)
                 for v in _items(value, name, 2, "an int or (height, width)"))


def crop_range(scale, ratio, prefix=""):
    """RandomResizedCrop's ``scale`` (fraction of the area, ``0 < min <= max <= 1``) and
    ``ratio`` (width / height, ``0 < min <= max``) as pairs of floats; ``prefix`` starts the
    names in messages."""
    scale_pair = pair(scale, prefix + "scale")
    if not 0 < scale_pair[0] <= scale_pair[1] <= 1.0:
        raise ConfigError(f"{prefix}scale must satisfy 0 < min <= max <= 1, got {scale!r}")
    ratio_pair = pair(ratio, prefix + "ratio")
    if not 0 < ratio_pair[0]:
        raise ConfigError(f"{prefix}ratio must satisfy 0 < min <= max, got {ratio!r}")
    return scale_pair, ratio_pair


def view(value, fields):
    """A multi-view recipe's view (a :class:`dpu_pipe.views.View`, or the dict of one, as
    ``to_dict`` gives it) checked field by field: ``fields`` maps each field to its default.
    Returns the checked fields as a dict."""
    if hasattr(value, "__dataclass_fields__"):
        value = {k: getattr(value, k) for k in fields}
    if not isinstance(value, dict):
        raise ConfigError(f"a view must be a dpu_pipe.views.View, got {value!r}")
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ConfigError(f"unknown view settings: {unknown}")
    d = dict(fields, **value)
    size = image_size(d["size"], "view size")
    scale, ratio = crop_range(d["scale"], d["ratio"], "view ")
    out = {"size": size, "scale": scale, "ratio": ratio,
           "interpolation": choice(d["interpolation"], "view interpolation", INTERPOLATIONS),
           "color_jitter": color_jitter(d["color_jitter"], "view color_jitter")}
    for key in ("flip_p", "jitter_p", "grayscale_p", "blur_p", "solarize_p"):
        out[key] = number(d[key], f"view {key}", 0.0, 1.0)
    sigma = pair(d["blur_sigma"], "view blur_sigma")
    if not 0 < sigma[0]:
        raise ConfigError(f"view blur_sigma must be positive, got {d['blur_sigma']!r}")
    out["blur_sigma"] = sigma
    kernel = d["blur_kernel"]
    if kernel is None:      # SimCLR's rule: 10 % of the side, made odd
        kernel = int(0.1 * min(size))
        kernel += 1 - kernel % 2
    kernel = integer(kernel, "view blur_kernel", 1, 2 * min(size) - 1)
    if kernel % 2 == 0:
        raise ConfigError(f"view blur_kernel must be odd, got {kernel}")
    out["blur_kernel"] = kernel
    out["solarize_threshold"] = number(d["solarize_threshold"], "view solarize_threshold",
                                       0.0, 255.0)
    return out


def choice(value, name, options):
    """``value`` if it is one of ``options``."""
    if isinstance(value, str) and value in options:
        return value
    raise ConfigError(f"{name} must be one of {', '.join(map(repr, options))}, got {value!r}")


def hook_path(value, name):
    """A ``"module:function"`` string (dotted module, function name), as importable code is
    named in specs (``RemoteValidation``'s model, ``batch_hook``)."""
    if isinstance(value, str):
        module, sep, func = value.partition(":")
        if sep and all(p.isidentifier() for p in module.split(".")) and func.isidentifier():
            return value
    raise ConfigError(f"{name} must be 'module:function' (an importable module and a "
                      f"function in it), got {value!r}")


def seconds(value, name):
    """A finite, positive duration in seconds."""
    return number(value, name, 0.0, low_open=True)


def names(value, name, reserved=()):
    """A tuple of distinct, non-empty strings (None: empty), none of them in ``reserved``."""
    if value is None:
        return ()
    if isinstance(value, str):
        raise ConfigError(f"{name} must be a list of names, got the string {value!r}")
    try:
        items = tuple(value)
    except TypeError:
        raise ConfigError(f"{name} must be a list of names, got {value!r}") from None
    for v in items:
        if not isinstance(v, str) or not v.strip() or v != v.strip():
            raise ConfigError(f"{name} must hold non-empty names without surrounding "
                              f"spaces, got {v!r}")
        if v in reserved:
            raise ConfigError(f"{name}: {v!r} is reserved (the loader's metadata has it)")
    if len(set(items)) != len(items):
        raise ConfigError(f"{name} must not repeat a name, got {list(items)}")
    return items


def dtype(value, name="dtype"):
    """Canonical name (one of :data:`OUTPUT_DTYPES`) of a dtype given as a string, a numpy
    dtype or type (``np.float32``) or a torch dtype (``torch.bfloat16``)."""
    if isinstance(value, str):
        text = value
    elif type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        text = str(value).split(".", 1)[1]          # torch.bfloat16 -> "bfloat16"
    else:
        try:
            text = np.dtype(value).name
        except TypeError:
            text = None
    if text not in OUTPUT_DTYPES:
        raise ConfigError(f"{name} must be one of {', '.join(OUTPUT_DTYPES)} (a string, numpy "
                          f"or torch dtype), got {value!r}")
    return text


_NO_EQUIVALENT = "there is no equivalent: "
#: torch.utils.data.DataLoader arguments that users pass out of habit, and what to do instead.
TORCH_LOADER_ARGS = {
    "num_workers": "use num_threads (threads decoding each batch; DPULoader: producer ranks)",
    "persistent_workers": _NO_EQUIVALENT + "the loader's threads or producer ranks live as "
                                           "long as the loader",
    "prefetch_factor": "use prefetch (batches made ahead)",
    "pin_memory_device": "use device (batches are copied to it through pinned buffers)",
    "worker_init_fn": _NO_EQUIVALENT + "there are no worker processes to initialize; "
                                       "producers rebuild the pipeline from the loader's spec",
    "collate_fn": "use batch_hook='module:function' (a function applied to every batch)",
    "sampler": "use shuffle, seed, rank and world_size (the sampler is built in)",
    "batch_sampler": _NO_EQUIVALENT + "batches are fixed by batch_size, drop_last and the "
                                      "built-in sampler",
    "generator": "use seed",
    "multiprocessing_context": _NO_EQUIVALENT + "there are no worker processes",
}


def torch_loader_args(options, where):
    """ConfigError when ``options`` (unknown keywords of ``where``) hold a torch DataLoader
    argument, naming dpu_pipe's equivalent or saying there is none."""
    for key in options:
        if key in TORCH_LOADER_ARGS:
            raise ConfigError(f"{where}: {key}= is a torch DataLoader argument; "
                              f"{TORCH_LOADER_ARGS[key]}")


def deadline(value, name, default):
    """A wait's deadline in seconds. 0 (torch's "no timeout") means ``default``: every wait in
    dpu_pipe has a deadline."""
    if not isinstance(value, bool) and isinstance(value, (int, float)) and value == 0:
        return float(default)
    return seconds(value, name)
