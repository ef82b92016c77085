"""Host side of the progressive-resolution scenario, run under mpiexec (MPMD) by
``test_progressive_offload.py``::

    mpiexec -n 1 python -m mpi4py tests/mpi/progressive_host.py --data D --out O \\
          : -n P python -m mpi4py -m dpu_pipe.worker

For modes {offload, hybrid} x threads {1, 2} (the producers' kernel threads, the host's
``num_threads`` and hybrid's ``host_threads``): a DPULoader with a progressive size takes
epochs 0 and 1 (16 px), breaks off epoch 2 (24 px) after 2 batches with its state saved,
jumps to epoch 3 (32 px), then loads the state saved at the end of epoch 1 (the next batch is
epoch 2's, at the next size) and the mid-epoch one, each continued to the end of epoch 3.
Every batch equals the local Loader's (``num_threads=1``) bit for bit. Then, per mode, an
elastic resume: the states of a job of 2 ranks stopped one batch into epoch 2 (local Loaders
of ranks 0 and 1 of 2) continue on this one host, the rest of epoch 2 at 24 px and epoch 3 at
32 px equal to a local Loader that loaded the same states. ``O/host0.json`` holds per run the
mode, threads, the shapes seen per epoch and the samples made by each side, and per mode the
shapes of the elastic resume.
"""
import argparse
import os
import sys

from offload_host import check_same, write_json

SCHEDULE = dict(min_size=16, max_size=32, start_epoch=1, end_epoch=3, multiple=8)
KW = dict(dtype="uint8", seed=5)
BATCH = 4


def copies(loader, limit=None):
    out = []
    for x, y in loader:
        out.append((x.copy(), y.copy()))
        if limit is not None and len(out) == limit:
            break
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from mpi4py import MPI
    from dpu_pipe import DPULoader, Loader, progressive_size
    from dpu_pipe.sources import open_path

    src = open_path(args.data)
    size = progressive_size(**SCHEDULE)
    with Loader(src, BATCH, size=size, rank=0, world_size=1, **KW) as ref:
        want = [copies(ref) for _ in range(4)]
    runs = []
    for mode in ("offload", "hybrid"):
        for threads in (1, 2):
            where = f"{mode} threads={threads}"
            dl = DPULoader(src, BATCH, size=size, mode=mode, slots=3, num_threads=threads,
                           producer_threads=threads, host_threads=threads, **KW)
            got = {e: copies(dl) for e in (0, 1)}
            boundary = dl.state_dict()
            assert (boundary["epoch"], boundary["step"]) == (2, 0), boundary
            got[2] = copies(dl, limit=2)
            mid = dl.state_dict()
            dl.set_epoch(3)
            got[3] = copies(dl)
            dl.load_state_dict(boundary)
            got["from-boundary"] = copies(dl) + copies(dl)
            dl.load_state_dict(mid)
            got["from-mid"] = copies(dl) + copies(dl)
            for key, ref_batches in ((0, want[0]), (1, want[1]), (2, want[2][:2]),
                                     (3, want[3]), ("from-boundary", want[2] + want[3]),
                                     ("from-mid", want[2][2:] + want[3])):
                assert len(got[key]) == len(ref_batches), (where, key, len(got[key]))
                for j, (b, w) in enumerate(zip(got[key], ref_batches)):
                    check_same(b, w, f"{where} {key} batch {j}")
            s = dl.stats()
            if mode == "offload":
                assert s["host_samples"] == 0 and s["producer_samples"] > 0, (where, s)
            runs.append({"mode": mode, "threads": threads,
                         "shapes": {str(k): sorted({str(list(x.shape[1:]))
                                                    for x, _ in v}) for k, v in got.items()},
                         "producer_samples": s["producer_samples"],
                         "host_samples": s["host_samples"]})
            dl.close()
    states = []
    for r in range(2):
        with Loader(src, BATCH, size=size, rank=r, world_size=2, **KW) as old:
            old.set_epoch(2)
            next(iter(old))
            states.append(old.state_dict())
    elastic = {}
    with Loader(src, BATCH, size=size, rank=0, world_size=1, **KW) as ref:
        ref.load_state_dict(states, elastic=True)
        want = copies(ref) + copies(ref)
    for mode in ("offload", "hybrid"):
        dl = DPULoader(src, BATCH, size=size, mode=mode, slots=3, **KW)
        dl.load_state_dict(states, elastic=True)
        got = copies(dl) + copies(dl)
        assert len(got) == len(want), (mode, len(got), len(want))
        for j, (b, w) in enumerate(zip(got, want)):
            check_same(b, w, f"{mode} elastic batch {j}")
        elastic[mode] = [list(x.shape[1:]) for x, _ in got]
        dl.close()
    write_json(os.path.join(args.out, "host0.json"), {"runs": runs, "elastic": elastic})
    print(f"OK host={MPI.COMM_WORLD.Get_rank()}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
