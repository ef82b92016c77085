"""Host rank of tests/mpi/test_views_offload.py: a multi-view (DINO) stream made by the
producers (``offload``) and by producers and host threads together (``hybrid``), compared
view by view, bit for bit, with the local Loader's, for kernel threads 1 and 2; every sample
delivered exactly once per epoch. Writes ``host0.json`` and prints ``OK host=0``."""
import argparse
import json
import os
import sys

import numpy as np


def stream(loader, epochs):
    """[[(views, labels)] per epoch], copied."""
    out = []
    for e in range(epochs):
        loader.set_epoch(e)
        out.append([([np.array(a) for a in x], np.array(y)) for x, y in loader])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()

    from dpu_pipe import DPULoader, Loader
    from dpu_pipe import views as V
    from dpu_pipe.sources import open_path

    src = open_path(args.data)
    kw = dict(views=V.dino(40, 16, 3), dtype="uint8", seed=11)
    runs = []
    for threads in (1, 2):
        with Loader(src, 4, num_threads=threads, **kw) as ref:
            want = stream(ref, args.epochs)
        for mode in ("offload", "hybrid"):
            extra = {"host_threads": threads} if mode == "hybrid" else {}
            with DPULoader(src, 4, mode=mode, slots=3, producer_threads=threads,
                           **extra, **kw) as dl:
                assert dl.mode == mode, dl.mode
                got = stream(dl, args.epochs)
                s = dl.stats()
            for e, (g, w) in enumerate(zip(got, want)):
                assert len(g) == len(w), (mode, threads, e, len(g), len(w))
                for j, ((x, y), (u, v)) in enumerate(zip(g, w)):
                    where = f"{mode} threads={threads} epoch {e} batch {j}"
                    assert np.array_equal(y, v), where
                    assert len(x) == len(u) == 5, where
                    for k, (a, b) in enumerate(zip(x, u)):
                        assert a.dtype == b.dtype and a.shape == b.shape, (where, k)
                        assert np.array_equal(a, b), f"{where}: view {k} differs"
                labels = sorted(int(t) for _, y in g for t in y)
                assert labels == list(range(len(src))), f"{mode} epoch {e}: not exactly once"
            runs.append({"mode": mode, "threads": threads,
                         "producer_samples": s.get("producer_samples"),
                         "host_samples": s.get("host_samples")})
    with open(os.path.join(args.out, "host0.json"), "w") as f:
        json.dump({"runs": runs}, f)
    print("OK host=0", flush=True)


if __name__ == "__main__":
    sys.exit(main())
