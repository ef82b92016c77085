"""``python -m dpu_pipe.worker``: a producer rank (on a DPU core) serving its host.

It takes no arguments. It finds its host in the MPI job, then loops: receive a pipeline spec
from the host (one per iteration of a DPULoader), reopen the source it names (shared file
system or packed file), and produce the steps the host grants until the host stops the
stream; a ``None`` spec (the host's exit) ends the process. Launch it under
``python -m mpi4py`` so that an error in any rank aborts the job instead of hanging it.
"""

import argparse
import json
import time

import numpy as np

from .mpi import load_mpi
from .offload import BAD_REPORT_BYTES, PAYLOAD_HEADER, SPEC_TAG, SPEC_VERSION
from .errors import ConfigError, PipeTimeout
from .sources import open_source
from .steps import StepProducer
from .transforms import TransformConfig
from .transport import Producer, discover_roles, host_comm

__all__ = ["serve", "main"]


class _Maker:
    """A StepProducer for one spec, with its own batch buffers; reused while the host keeps
    sending the same spec (the source is not reopened each epoch)."""

    def __init__(self, spec):
        if spec.get("version") != SPEC_VERSION:
            raise ConfigError(f"pipeline spec version {spec.get('version')} is not "
                              f"{SPEC_VERSION}: host and workers run different dpu_pipe versions")
        transform = TransformConfig.from_dict(spec["transform"])
        self.steps = StepProducer(open_source(spec["source"]), spec["batch_size"], transform,
                                  seed=spec["seed"], shuffle=spec["shuffle"],
                                  rank=spec["rank"], world_size=spec["world_size"],
                                  shard_tail=spec["shard_tail"], drop_last=spec["drop_last"],
                                  num_threads=spec["num_threads"],
                                  on_error=spec["on_error"])
        self.images = np.empty(self.steps.batch_shape, dtype=transform.np_dtype)
        self.labels = np.empty(self.steps.batch_size, dtype=np.int64)
        self.header = np.zeros(len(PAYLOAD_HEADER), dtype=np.int64)
        self.reported = set()
        self.producer = None      # the transport endpoint serving the current stream

    def _bad_report(self):
        """JSON of the bad samples the host has not heard of yet, as many as fit a slot's
        report area; the rest go with the next batches."""
        entries, size = {}, 0
        for index, message in sorted(self.steps.bad_samples.items()):
            if index in self.reported:
                continue
            # A dict's JSON is as long as its one-item dicts' JSON together.
            item = len(json.dumps({str(index): message}))
            if size + item > BAD_REPORT_BYTES:
                if not entries:  # one message longer than the area: send it shortened
                    entries[str(index)] = message[:BAD_REPORT_BYTES // 2]
                    self.reported.add(index)
                break
            entries[str(index)] = message
            self.reported.add(index)
            size += item
        return json.dumps(entries).encode() if entries else b""

    def __call__(self, work):
        tm = self.steps.timings
        read0, proc0 = tm["read_s"], tm["process_s"]
        n = self.steps.produce(work.epoch, work.step, self.images, self.labels)
        report = self._bad_report()
        self.header[:5] = (n, len(report), round((tm["read_s"] - read0) * 1e9),
                           round((tm["process_s"] - proc0) * 1e9),
                           self.producer.last_publish_ns if self.producer else 0)
        return self.header, self.labels, self.images[:n], report


def _receive_spec(group, idle_timeout):
    req = group.irecv(source=0, tag=SPEC_TAG)
    deadline = time.monotonic() + idle_timeout
    while True:
        done, spec = req.test()
        if done:
            return spec
        if time.monotonic() > deadline:
            req.Cancel()
            raise PipeTimeout(f"no pipeline spec from the host within {idle_timeout:.0f} s")
        time.sleep(0.005)


def serve(comm=None, *, idle_timeout=86400.0):
    """Serve this rank's host until it shuts down. Returns the number of steps produced."""
    MPI = load_mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    roles = discover_roles(comm, "producer")
    group = host_comm(comm, roles)
    makers = {}
    total = 0
    try:
        while True:
            spec = _receive_spec(group, idle_timeout)
            if spec is None:
                return total
            key = json.dumps(spec, sort_keys=True)
            maker = makers.get(key)
            if maker is None:
                maker = makers[key] = _Maker(spec)
            with Producer(group) as producer:
                maker.producer = producer
                total += producer.serve(maker)
    finally:
        group.Free()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dpu_pipe.worker", description=__doc__)
    p.add_argument("--idle-timeout", type=float, default=86400.0,
                   help="seconds to wait for the host's next pipeline spec before giving up")
    args = p.parse_args(argv)
    serve(idle_timeout=args.idle_timeout)


if __name__ == "__main__":
    main()
