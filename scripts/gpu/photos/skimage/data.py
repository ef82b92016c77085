"""``skimage.data``'s sample photographs, read from the folder named by
``DPU_PIPE_GPU_PHOTOS`` (the wheelhouse's ``photos/``: the files of scikit-image's wheel and
their ``SHA256SUMS``). Each function returns the same uint8 (H, W, 3) array as
scikit-image's; a file whose checksum differs raises OSError."""
import hashlib
import io
import os

import numpy as np

__all__ = ["astronaut", "coffee", "chelsea", "rocket"]


def _load(name):
    folder = os.environ.get("DPU_PIPE_GPU_PHOTOS")
    if not folder:
        raise OSError("DPU_PIPE_GPU_PHOTOS is not set: the folder of the sample photographs")
    with open(os.path.join(folder, "SHA256SUMS")) as f:
        sums = dict(reversed(line.split()) for line in f if line.strip())
    with open(os.path.join(folder, name), "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != sums.get(name):
        raise OSError(f"{folder}/{name}: checksum differs from SHA256SUMS")
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)))


def astronaut():
    """Eileen Collins (512, 512, 3)."""
    return _load("astronaut.png")


def coffee():
    """A cup of coffee (400, 600, 3)."""
    return _load("coffee.png")


def chelsea():
    """Chelsea the cat (300, 451, 3)."""
    return _load("chelsea.png")


def rocket():
    """A rocket launch (427, 640, 3)."""
    return _load("rocket.jpg")
