"""Model weights as one flat byte buffer: a small header described by numpy structured dtypes,
then the tensors' raw bytes. Nothing is pickled, so a receiver only ever interprets numbers it
checks against the model it built itself.

Layout (every field little-endian, every offset from the buffer's start)::

    [WEIGHTS_HEADER 64 B][TENSOR_ENTRY x count][names, UTF-8, back to back][pad to 64]
    [tensor 0 bytes][pad to 64][tensor 1 bytes]...

A tensor entry locates its name and its data and gives its shape and torch dtype name
(``float32``, ``bfloat16``, ...).
"""

import sys

import numpy as np

from ._torch import require_torch
from .errors import ConfigError

__all__ = ["WEIGHTS_HEADER", "TENSOR_ENTRY", "FORMAT_VERSION", "MAX_NDIM", "pack_state",
           "read_entries", "load_state"]

FORMAT_VERSION = 1
MAGIC = b"DPUW"
MAX_NDIM = 8
_ALIGN = 64

WEIGHTS_HEADER = np.dtype([
    ("magic", "S4"),
    ("version", "<u4"),
    ("count", "<u8"),          # tensors
    ("names_bytes", "<u8"),    # length of the names area
    ("data_offset", "<u8"),    # where the first tensor's bytes start
    ("total_bytes", "<u8"),    # length of the whole buffer
    ("reserved", "<u8", (3,)),
])

TENSOR_ENTRY = np.dtype([
    ("name_offset", "<u8"),    # into the names area
    ("name_bytes", "<u4"),
    ("ndim", "<u4"),
    ("dtype", "S16"),          # torch dtype name, e.g. b"float32"
    ("shape", "<u8", (MAX_NDIM,)),
    ("data_offset", "<u8"),    # from the buffer's start, a multiple of 64
    ("nbytes", "<u8"),
])

assert WEIGHTS_HEADER.itemsize == 64

#: torch dtypes a weights buffer may carry, by name.
DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
          "uint8", "bool", "complex64", "complex128")


def _align(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _torch():
    return require_torch("model weights (torch tensors)")


def _dtype_name(torch, dtype):
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES or getattr(torch, name) != dtype:
        raise ConfigError(f"tensors of dtype {dtype} cannot be shipped as weights "
                          f"(supported: {', '.join(DTYPES)})")
    return name


def pack_state(state_dict, out=None):
    """Pack the tensors of ``state_dict`` ({name: torch.Tensor}, on any device) into one
    C-contiguous ``uint8`` array: a view of the first bytes of ``out`` when that is a
    C-contiguous ``uint8`` array large enough, else a new one. :class:`ConfigError` for an
    entry that is not a tensor, has over :data:`MAX_NDIM` dimensions or another dtype than
    :data:`DTYPES`."""
    if sys.byteorder != "little":
        raise ConfigError("weights buffers are little-endian; this machine is not")
    torch = _torch()
    items = []
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"state_dict entry {name!r} is a {type(t).__name__}, not a tensor")
        if t.dim() > MAX_NDIM:
            raise ConfigError(f"tensor {name!r} has {t.dim()} dimensions; at most {MAX_NDIM}")
        items.append((str(name).encode("utf-8"), t.detach().to("cpu").contiguous()))
    names = b"".join(n for n, _ in items)
    entries = np.zeros(len(items), TENSOR_ENTRY)
    data_offset = at = _align(WEIGHTS_HEADER.itemsize + entries.nbytes + len(names))
    name_at = 0
    for e, (name, t) in zip(entries, items):
        e["name_offset"], e["name_bytes"] = name_at, len(name)
        name_at += len(name)
        e["dtype"] = _dtype_name(torch, t.dtype).encode()
        e["ndim"] = t.dim()
        e["shape"][:t.dim()] = tuple(t.shape)
        e["data_offset"] = at
        e["nbytes"] = t.numel() * t.element_size()
        at = _align(at + int(e["nbytes"]))
    if out is not None and out.dtype == np.uint8 and out.flags.c_contiguous and out.size >= at:
        buf = out[:at]
    else:
        buf = np.empty(at, np.uint8)
    header = np.array((MAGIC, FORMAT_VERSION, len(items), len(names), data_offset, at, 0),
                      WEIGHTS_HEADER)
    table = b"".join((header.tobytes(), entries.tobytes(), names))
    buf[:len(table)] = np.frombuffer(table, np.uint8)
    buf[len(table):data_offset] = 0
    dst = torch.from_numpy(buf)
    for e, (_, t) in zip(entries, items):
        start, n = int(e["data_offset"]), int(e["nbytes"])
        if n:
            dst[start:start + n].copy_(t.reshape(-1).view(torch.uint8))
    return buf


def read_entries(buf):
    """[(name, dtype name, shape tuple, data_offset, nbytes)] of weights buffer ``buf``
    (``uint8`` array), bounds-checked against it; :class:`ConfigError` when it is not a
    weights buffer this version reads."""
    buf = np.asarray(buf)
    if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size < WEIGHTS_HEADER.itemsize:
        raise ConfigError("not a weights buffer: need a 1-D uint8 array of at least "
                          f"{WEIGHTS_HEADER.itemsize} bytes")
    header = buf[:WEIGHTS_HEADER.itemsize].view(WEIGHTS_HEADER)[0]
    if bytes(header["magic"]) != MAGIC:
        raise ConfigError("not a weights buffer (bad magic)")
    if int(header["version"]) != FORMAT_VERSION:
        raise ConfigError(f"weights buffer format version {int(header['version'])} is not "
                          f"{FORMAT_VERSION}: host and producers run different dpu_pipe versions")
    total = int(header["total_bytes"])
    if total > buf.size:
        raise ConfigError(f"weights buffer truncated: {buf.size} bytes of {total}")
    count, names_bytes = int(header["count"]), int(header["names_bytes"])
    at = WEIGHTS_HEADER.itemsize
    end = at + count * TENSOR_ENTRY.itemsize
    if end + names_bytes > buf.size:
        raise ConfigError("weights buffer truncated inside its table of tensors")
    entries = buf[at:end].view(TENSOR_ENTRY)
    names = bytes(buf[end:end + names_bytes])
    out = []
    for e in entries:
        no, nb = int(e["name_offset"]), int(e["name_bytes"])
        ndim = int(e["ndim"])
        start, n = int(e["data_offset"]), int(e["nbytes"])
        if no + nb > names_bytes or ndim > MAX_NDIM or start + n > total:
            raise ConfigError("weights buffer has an entry pointing outside it")
        dtype = bytes(e["dtype"]).rstrip(b"\0").decode("ascii", "replace")
        if dtype not in DTYPES:
            raise ConfigError(f"weights buffer has a tensor of unknown dtype {dtype!r}")
        out.append((names[no:no + nb].decode("utf-8", "replace"), dtype,
                    tuple(int(v) for v in e["shape"][:ndim]), start, n))
    return out


def load_state(model, buf):
    """Copy the tensors of weights buffer ``buf`` into ``model`` (a ``torch.nn.Module``) and
    return it. The buffer must hold exactly the model's ``state_dict`` names, each with the
    model's shape and dtype; otherwise :class:`ConfigError` lists the differences."""
    torch = _torch()
    entries = read_entries(buf)
    own = model.state_dict()
    got = {name for name, *_ in entries}
    problems = []
    for what, names in (("missing", [n for n in own if n not in got]),
                        ("unexpected", [n for n in got if n not in own])):
        if names:
            problems.append(f"{what} {names[:5]}{' ...' if len(names) > 5 else ''}")
    for name, dtype, shape, start, n in entries:
        t = own.get(name)
        if t is None:
            continue
        mine = (str(t.dtype).removeprefix("torch."), tuple(t.shape))
        if (dtype, shape) != mine:
            problems.append(f"{name}: weights have {dtype}{list(shape)}, the model "
                            f"{mine[0]}{list(mine[1])}")
        elif n != t.numel() * t.element_size():
            problems.append(f"{name}: {n} bytes for {t.numel()} elements of {dtype}")
    if problems:
        raise ConfigError("the weights do not match the model built from the factory: "
                          + "; ".join(problems))
    src = torch.from_numpy(np.asarray(buf))
    with torch.no_grad():
        for name, dtype, shape, start, n in entries:
            t = own[name]
            if n:
                t.copy_(src[start:start + n].view(getattr(torch, dtype)).view(shape))
    return model
