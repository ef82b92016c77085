"""What tests/test_install_matrix.py runs with an installed dpu_pipe (never the checkout's), in
a fresh venv of one CPython version. Needs numpy (and mpi4py for ``offload``) only.

    python install_epoch.py loader DATA OUT.npz     one Loader epoch -> OUT.npz, build_info as
                                                    the last line of stdout (JSON)
    python install_epoch.py failing DATA            a source whose read raises: the error the
                                                    loader raises, as JSON
    mpiexec -n 1 python -m mpi4py install_epoch.py offload DATA OUT.npz
          : -n 1 python -m mpi4py -m dpu_pipe.worker
                                                    one offloaded epoch (DPULoader, 1 producer)
                                                    -> OUT.npz, checked against the Loader's
"""
import json
import sys

import numpy as np

import dpu_pipe
from dpu_pipe.sources import ImageFolder

#: The stream both the venvs and the reference make: small, so an epoch is quick.
KW = dict(size=32, seed=5, dtype="uint8")
BATCH = 4


def epoch(loader):
    images, labels = [], []
    for x, y in loader:
        images.append(np.array(x))
        labels.append(np.array(y))
    return np.concatenate(images), np.concatenate(labels)


def loader_epoch(data, out):
    images, labels = epoch(dpu_pipe.Loader(data, BATCH, **KW))
    np.savez(out, images=images, labels=labels)
    print(json.dumps(dpu_pipe.build_info()))


class FailingFolder(ImageFolder):
    """Sample 2 cannot be read for a reason that is not a DecodeError."""

    def read(self, i):
        if i == 2:
            raise RuntimeError(f"storage went away reading sample {i}")
        return super().read(i)


def failing(data):
    from dpu_pipe.errors import ProducerError

    try:
        epoch(dpu_pipe.Loader(FailingFolder(data), BATCH, shuffle=False, **KW))
    except ProducerError as e:
        print(json.dumps({"type": type(e).__name__, "message": str(e),
                          "traceback": e.remote_traceback}))
    else:
        print(json.dumps({"type": None}))


def offload_epoch(data, out):
    with dpu_pipe.DPULoader(data, BATCH, **KW) as dl:
        mode = dl.mode
        images, labels = epoch(dl)
    ref_images, ref_labels = epoch(dpu_pipe.Loader(data, BATCH, **KW))
    assert mode == "offload", mode
    assert images.tobytes() == ref_images.tobytes() and np.array_equal(labels, ref_labels), \
        "the offloaded epoch differs from the Loader's"
    np.savez(out, images=images, labels=labels)
    print("OK offload", len(labels))


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    {"loader": loader_epoch, "failing": failing, "offload": offload_epoch}[cmd](*args)
