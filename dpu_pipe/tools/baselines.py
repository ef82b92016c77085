"""The baselines the benchmarks compare dpu_pipe with, in one place: torchvision's PIL path
written by hand with Pillow and numpy (full decode, RandomResizedCrop box resized bilinearly,
flip, ToTensor + Normalize), for a thread pool and for a process pool writing into
shared-memory batches as DataLoader workers do.
"""

import io

import numpy as np

from ..errors import ConfigError

__all__ = ["pil", "pillow_sample", "pillow_batch", "pillow_batch_returning",
           "pillow_worker_init", "pillow_worker_batch"]


def pil():
    """Pillow's Image module, or a ConfigError saying to install it."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise ConfigError("the decode benchmark compares against Pillow: pip install pillow") \
            from exc
    return Image


_worker = {}


def pillow_sample(Image, path, box, flip, size, mean, std, out):
    """torchvision's PIL path by hand: ImageFolder's loader (full decode to RGB), the
    RandomResizedCrop box resized bilinearly, flip, ToTensor + Normalize into ``out`` (CHW)."""
    with open(path, "rb") as f:
        im = Image.open(io.BytesIO(f.read()))
        im = im.convert("RGB")
    top, left, h, w = (int(v) for v in box)
    im = im.resize((size[1], size[0]), Image.BILINEAR, box=(left, top, left + w, top + h))
    if flip:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    a = np.asarray(im, dtype=np.float32)
    a *= np.float32(1 / 255)
    a -= mean
    a /= std
    out[...] = a.transpose(2, 0, 1)


def pillow_batch(Image, paths, indices, boxes, flips, size, mean, std, out):
    for j, i in enumerate(indices.tolist()):
        pillow_sample(Image, paths[i], boxes[i], flips[i], size, mean, std, out[j])


def pillow_worker_init(paths, size, mean, std, shm_name, slot_shape, nslots):
    from multiprocessing import shared_memory

    Image = pil()
    shm = shared_memory.SharedMemory(name=shm_name)
    slots = np.ndarray((nslots,) + tuple(slot_shape), dtype=np.float32, buffer=shm.buf)
    _worker.update(Image=Image, paths=paths, size=size, mean=mean, std=std, shm=shm,
                   slots=slots)


def pillow_worker_batch(slot, indices, boxes, flips):
    """One batch in a worker process, written into shared-memory slot ``slot``.
    ``boxes``/``flips`` are the batch's own rows (position j is sample indices[j])."""
    w = _worker
    out = w["slots"][slot]
    for j, i in enumerate(indices.tolist()):
        pillow_sample(w["Image"], w["paths"][i], boxes[j], flips[j], w["size"], w["mean"],
                       w["std"], out[j])
    return indices



def pillow_batch_returning(Image, paths, indices, boxes, flips, size, mean, std, out):
    pillow_batch(Image, paths, indices, boxes, flips, size, mean, std, out)
    return indices

