"""Host side of the elastic-resume scenarios, run under mpiexec (MPMD) by
``test_elastic_offload.py``::

    mpiexec -n H python -m mpi4py tests/mpi/elastic_host.py SCENARIO --data D --out O ... \\
          : -n P python -m mpi4py -m dpu_pipe.worker

``save``
    A DPULoader (offload) takes ``--take`` batches of epoch 0 on every host; host 0 writes
    ``O/states.json`` (every host's ``state_dict()``, in host order) and ``O/part1.json``
    (the labels the hosts took).
``resume``
    Every host loads ``--states`` with ``elastic=True`` into a DPULoader — offload, then
    hybrid, in the same job — and consumes the rest of epoch 0 and epoch 1, each batch
    compared bit for bit with a local Loader that loaded the same states; host 0 writes
    ``O/result.json``: per mode and epoch, every host's labels and valid labels (host
    order) and batch counts.

Datasets have one class folder per sample (``offload_host.make_dataset``): label == index.
"""
import argparse
import json
import os
import sys

from offload_host import Hosts, check_same, write_json

KW = dict(size=32, dtype="uint8", seed=11, shard_tail="mask")


def run_save(args, src):
    from dpu_pipe import DPULoader

    dl = DPULoader(src, args.batch, mode="offload", **KW)
    hosts = Hosts(dl)
    it = iter(dl)
    labels = [v for _ in range(args.take) for v in next(it)[1].tolist()]
    states = hosts.comm.allgather(dl.state_dict())
    part1 = hosts.all_labels(labels)
    if hosts.index == 0:
        write_json(os.path.join(args.out, "states.json"), states)
        write_json(os.path.join(args.out, "part1.json"), part1)
    dl.close()


def run_resume(args, src):
    from dpu_pipe import DPULoader, Loader

    with open(args.states) as f:
        states = json.load(f)
    result = {}
    for mode in ("offload", "hybrid"):
        dl = DPULoader(src, args.batch, mode=mode, **KW)
        hosts = Hosts(dl)
        dl.load_state_dict(states, elastic=True)
        spec = dl.stream_spec
        with Loader(src, args.batch, rank=spec.rank, world_size=spec.world_size, **KW) as ref:
            ref.load_state_dict(states, elastic=True)
            assert dl.state_dict() == ref.state_dict()
            epochs = []
            for epoch in range(2):
                assert len(dl) == len(ref), (len(dl), len(ref))
                labels, valid, batches = [], [], 0
                mine = iter(ref)
                for got in dl:
                    check_same(got, next(mine), f"{mode} epoch {epoch} batch {batches}")
                    assert dl.valid_rows == ref.valid_rows
                    y = got[1].tolist()
                    labels += y
                    valid += y[:dl.valid_rows]
                    batches += 1
                assert next(mine, None) is None      # the same number of batches
                assert dl.epoch == ref.epoch == epoch + 1
                epochs.append({"labels": hosts.all_labels(labels),
                               "valid": hosts.all_labels(valid),
                               "batches": hosts.comm.allgather(batches)})
        if mode == "offload":
            assert dl.stats()["producer_samples"] > 0, "no batch came from a producer"
        result[mode] = epochs
        dl.close()
    if hosts.index == 0:
        write_json(os.path.join(args.out, "result.json"), result)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=("save", "resume"))
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--take", type=int, default=1)
    ap.add_argument("--states", default=None)
    args = ap.parse_args()

    from mpi4py import MPI
    from dpu_pipe.sources import open_path

    src = open_path(args.data)
    {"save": run_save, "resume": run_resume}[args.scenario](args, src)
    print(f"OK host={MPI.COMM_WORLD.Get_rank()} {args.scenario}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
