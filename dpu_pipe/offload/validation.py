"""Offloaded validation: producer ranks evaluate a snapshot of the model while the host trains
(the user's side: docs/guides/validation.md).

The channel (:class:`~dpu_pipe.offload.channel.Channel`) is a duplicate of the host group's
communicator with a dynamic RMA window on it. :meth:`RemoteValidation.submit` packs the
``state_dict`` into one flat buffer (:mod:`dpu_pipe.weights`), attaches it to the window, sends
each producer a request ``{"job", "spec", "address", "nbytes", "part", "parts"}`` and returns.
Each producer's :class:`ValidationService` thread (nice 19: batch making takes the core
whenever it has work) reads the weights with an ``Rget``, evaluates steps ``part, part +
parts, ...`` of the host's shard (:class:`~dpu_pipe.evaluate.ShardEvaluator`) and sends back
the sums of :class:`~dpu_pipe.evaluate.Metrics`, or the error with its traceback. Hosts send
their sums to each other, so every host's future gives the whole validation set's metrics.

Memory: the host keeps each snapshot's buffer until every producer has answered (a silent
producer may still read it); each producer holds one weights buffer, its model and one batch.
"""

import contextlib
import json
import os
import threading
import time

import numpy as np

from .. import _validate as _v
from ..deadline import deadline_in, poll_until
from ..errors import ConfigError, ProducerError, error_record
from ..cache import check_cache_bytes
from ..evaluate import Metrics, ShardEvaluator, check_topk, require_torch
from ..mpi import load_mpi
from ..transforms import TransformConfig
from ..weights import pack_state
from .channel import MERGE_TAG, REQUEST_TAG, RESULT_TAG
from .group import host_group
from .node_cache import cache_key, run_to_end

__all__ = ["RemoteValidation", "ValidationFuture", "ValidationService"]


_POLL = 0.002

#: Held by whatever reads or changes the host's validation channel (pending sends, futures,
#: attached buffers), from any thread; never while waiting: result() takes it once per poll.
_CHANNEL_LOCK = threading.RLock()


class ValidationService(threading.Thread):
    """A producer's validation thread (nice 19): serves requests until :meth:`stop`;
    ``rma_timeout`` bounds each read of the weights from the host."""

    def __init__(self, channel, *, rma_timeout=120.0, caches=None):
        super().__init__(name="dpu_pipe-validation", daemon=True)
        self.channel = channel
        self.rma_timeout = float(rma_timeout)
        self._halt = threading.Event()
        self.caches = caches
        self.evaluator = ShardEvaluator(cache_for=self._node_cache if caches else None)

    def stop(self, timeout=10.0):
        self._halt.set()
        self.join(timeout)

    def run(self):
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while not self._halt.is_set():
            req = self.channel.comm.irecv(source=0, tag=REQUEST_TAG)
            while not self._halt.is_set():
                done, job = req.test()
                if done:
                    break
                self._halt.wait(_POLL)
            else:
                req.Cancel()
                return
            if job is None:
                return
            self._serve(job)

    def _serve(self, job):
        ch = self.channel
        t0, c0 = time.perf_counter(), time.thread_time()
        record = {"job": job["job"], "producer": ch.rank, "pid": os.getpid()}
        try:
            torch = require_torch()
            torch.set_num_threads(1)
            weights = self._read_weights(job)
            metrics, make_s, model_s = self.evaluator.run(job["spec"], weights, job["part"],
                                                          job["parts"])
            record.update(ok=True, metrics=metrics.to_dict(), make_s=make_s, model_s=model_s)
            cache = self.evaluator.cache_stats(job["spec"])
            if cache is not None:
                record["cache"] = cache
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the host
            record.update(error_record(exc), ok=False)
        record["seconds"] = time.perf_counter() - t0
        # CPU seconds of this thread: the wall seconds above include the gaps in which the
        # producer's batch making (at a higher priority) had the core.
        record["cpu_s"] = time.thread_time() - c0
        ch.comm.send(record, dest=0, tag=RESULT_TAG)

    def _node_cache(self, spec, num_samples):
        """The node cache of a spec with ``cache_bytes``, made collectively on its first job."""
        key = cache_key(spec["source"], spec["transform"], spec["cache_bytes"])
        return run_to_end(self.caches.open(key, spec["cache_bytes"], num_samples,
                                           user="validation"), _POLL)

    def _read_weights(self, job):
        ch = self.channel
        buf = np.empty(int(job["nbytes"]), np.uint8)
        req = ch.win.Rget(buf, 0, target=(int(job["address"]), buf.size, ch.MPI.BYTE))
        poll_until(req.Test, deadline_in(self.rma_timeout),
                   f"reading the weights of validation job {job['job']} from the host did "
                   f"not complete within {self.rma_timeout:g} s", _POLL / 4)
        return buf


class ValidationFuture:
    """The result of one :meth:`RemoteValidation.submit`. ``result(timeout)`` waits for it."""

    def __init__(self, owner, job, tag, producers, hosts):
        self._owner, self.job, self.tag = owner, job, tag
        self._waiting = set(producers)          # producer ranks of this host still to answer
        self._hosts = set(hosts)                # other hosts whose sums are still to come
        self._parts = []                        # per-producer records of this host
        self._remote = {}                       # host index -> its sums and parts
        self._error = self._value = None
        self._sent = False                      # this host's sums went to the others

    def done(self):
        """True once the result (or an error) is in; polls without blocking."""
        with _CHANNEL_LOCK:
            if self._value is None and self._error is None:
                self._owner._poll()
                self._finish()
            return self._value is not None or self._error is not None

    def result(self, timeout=None):
        """The metrics ``{"tag", "count", "loss", "top1", "top5", ..., "seconds", "by_rank"}``
        of the whole validation set: ``seconds`` is the slowest producer's wall time, each
        ``by_rank`` entry has its producer's wall ``seconds`` and its validation thread's CPU
        ``cpu_s``. Waits at most ``timeout`` seconds (default: the RemoteValidation's); raises
        :class:`PipeTimeout` naming who has not answered, or :class:`ProducerError` with the
        traceback of a producer's factory, weights or forward pass."""
        timeout = self._owner.timeout if timeout is None else float(timeout)

        def silent():
            who = [self._owner._describe(r) for r in sorted(self._waiting)]
            who += [f"host {h}" for h in sorted(self._hosts)]
            return (f"validation job {self.job} (tag {self.tag!r}): no answer within "
                    f"{timeout:g} s from {', '.join(who)}")

        poll_until(self.done, deadline_in(timeout), silent, _POLL)
        if self._error is not None:
            raise self._error
        return self._value

    def _finish(self):
        if self._waiting:
            return
        owner = self._owner
        p = next((p for p in self._parts if not p["ok"]), None)
        if p is not None:
            self._error = ProducerError(
                f"validation job {self.job} (tag {self.tag!r}) failed: {p['type']}: "
                f"{p['message']}", producer=owner._describe(p["producer"]),
                remote_traceback=p["traceback"])
            owner._send_sums(self, None)
            return
        # Our sums go to the other hosts once, as soon as they are complete, whether or not
        # theirs already arrived.
        owner._send_sums(self, self._own_sums())
        if self._hosts:
            owner._poll()
            if self._hosts:
                return
        total = self._own_sums()
        by_rank = [dict(p, host=owner.host_index) for p in self._parts]
        for h, rec in sorted(self._remote.items()):
            if rec is None:
                self._error = ProducerError(f"validation job {self.job} failed on host {h}")
                return
            total.merge(Metrics.from_dict(rec["sums"]))
            by_rank += [dict(p, host=h) for p in rec["parts"]]
        self._value = {"tag": self.tag, **total.result(),
                       "seconds": max((p["seconds"] for p in by_rank), default=0.0),
                       "by_rank": by_rank}
        owner.channel.futures.pop(self.job, None)

    def _own_sums(self):
        total = Metrics(self._owner.topk)
        for p in self._parts:
            total.merge(Metrics.from_dict(p["metrics"]))
        return total


class RemoteValidation:
    """Validation of model snapshots on this host's producer ranks (DPU cores).

    Parameters
    ----------
    val_source : ImageFolder, FileList or PackedSource
        The validation set, sharded over the hosts as by ``Loader(train=False)``
        (``shard_tail="mask"``): every sample counted once over all hosts and producers.
    batch_size : int
    model : str
        ``"module:factory"`` importable on the producers; ``factory(**model_kwargs)`` returns
        the ``torch.nn.Module`` whose ``state_dict`` is submitted.
    model_kwargs : dict, optional
        JSON-serialisable arguments of the factory.
    size, and the other validation-transform options of :class:`~dpu_pipe.Loader`
        (``resize``, ``mean``, ``std``, ``dtype``, ``layout``, ``fast``, ``max_pixels``).
    topk : tuple of int
        Which top-k accuracies to report (``top1``, ``top5`` by default).
    comm : mpi4py communicator, optional
        The job's communicator (default ``COMM_WORLD``); construction is collective over its
        hosts, as for :class:`~dpu_pipe.DPULoader`, and every host submits the same snapshots.
    timeout : float
        Default seconds :meth:`ValidationFuture.result` waits.
    producer_threads : int
        Threads of each producer's batch kernel.
    cache_bytes : int
        With ``decode_max_side``: bytes of the producers' node cache of the validation set's
        reduced images, so that snapshots after the first are evaluated without decoding.

    A second :meth:`submit` before the first finished is queued.
    """

    def __init__(self, val_source, batch_size, *, model, model_kwargs=None, size=224,
                 topk=(1, 5), comm=None, timeout=600.0, producer_threads=1, cache_bytes=0,
                 **transform_options):
        require_torch()
        self.topk = check_topk(topk)
        batch_size = _v.positive_int(batch_size, "batch_size")
        producer_threads = _v.positive_int(producer_threads, "producer_threads")
        if not isinstance(model, str) or model.count(":") != 1:
            raise ConfigError(f"model must be 'module:factory', got {model!r}")
        self.timeout = _v.seconds(timeout, "timeout")
        try:
            json.dumps(model_kwargs or {})
        except TypeError as exc:
            raise ConfigError(f"model_kwargs must be JSON-serialisable: {exc}") from None
        transform = TransformConfig(train=False, size=size, **transform_options)
        cache_bytes = _v.integer(cache_bytes, "cache_bytes", 0)
        if cache_bytes:
            if transform.decode.decode_max_side is None:
                raise ConfigError("cache_bytes needs decode_max_side: the cache holds the whole "
                                  "images decode_max_side reduces (e.g. decode_max_side=256)")
            check_cache_bytes(cache_bytes, len(val_source))
        self._world = load_mpi().COMM_WORLD if comm is None else comm
        group = host_group(self._world)
        if group.producers == 0:
            raise ConfigError("RemoteValidation: no producer rank serves this host")
        self.channel = group.validation
        self.host_index = group.host_index
        self.num_hosts = group.num_hosts
        self.spec = {"source": val_source.spec(), "transform": transform.to_dict(),
                     "batch_size": batch_size, "rank": self.host_index,
                     "world_size": self.num_hosts, "shard_tail": "mask", "model": model,
                     "model_kwargs": model_kwargs or {}, "topk": list(self.topk),
                     "num_threads": producer_threads, "cache_bytes": cache_bytes}
        self._hosts_world = list(group.roles.hosts)
        self._attached = {}         # job -> weights buffer attached to the window
        self._closed = False

    def submit(self, state_dict, tag=None):
        """Post a snapshot of ``state_dict`` (e.g. ``model.state_dict()``) for evaluation and
        return its :class:`ValidationFuture` at once; the tensors are copied first, so training
        may change the model right away. Snapshots from several threads are evaluated in the
        order the calls took the channel."""
        buf = pack_state(state_dict)
        with _CHANNEL_LOCK:
            if self._closed:
                raise ConfigError("this RemoteValidation is closed")
            ch = self.channel
            ch.win.Attach(buf)
            job = ch.next_job()
            address = int(ch.MPI.Get_address(buf))
            self._attached[job] = buf
            producers = range(1, ch.size)
            for k, p in enumerate(producers):
                request = {"job": job, "spec": self.spec, "address": address,
                           "nbytes": int(buf.size), "part": k, "parts": len(producers)}
                ch.sends.append(ch.comm.isend(request, dest=p, tag=REQUEST_TAG))
            others = [h for h in range(self.num_hosts) if h != self.host_index]
            fut = ch.futures[job] = ValidationFuture(self, job, tag, producers, others)
            for h, rec in ch.early.pop(job, {}).items():
                fut._remote[h] = rec
                fut._hosts.discard(h)
            return fut

    def _poll(self):
        # Called with _CHANNEL_LOCK held (ValidationFuture.done).
        ch = self.channel
        status = ch.MPI.Status()
        ch.sends = [r for r in ch.sends if not r.Test()]
        while ch.comm.iprobe(source=ch.MPI.ANY_SOURCE, tag=RESULT_TAG, status=status):
            rec = ch.comm.recv(source=status.Get_source(), tag=RESULT_TAG)
            fut = ch.futures.get(rec["job"])
            if fut is None:
                continue
            fut._parts.append(rec)
            fut._waiting.discard(rec["producer"])
            if not fut._waiting:
                buf = fut._owner._attached.pop(rec["job"], None)
                if buf is not None:
                    ch.win.Detach(buf)
        while self._world.iprobe(source=ch.MPI.ANY_SOURCE, tag=MERGE_TAG, status=status):
            rec = self._world.recv(source=status.Get_source(), tag=MERGE_TAG)
            fut = ch.futures.get(rec["job"])
            if fut is None:
                ch.early.setdefault(rec["job"], {})[rec["host"]] = rec["data"]
            else:
                fut._remote[rec["host"]] = rec["data"]
                fut._hosts.discard(rec["host"])

    def _send_sums(self, fut, sums):
        """Send this host's part of job ``fut`` to every other host (once)."""
        if fut._sent or self.num_hosts == 1:
            return
        fut._sent = True
        data = None if sums is None else {"sums": sums.to_dict(), "parts": fut._parts}
        for h, world_rank in enumerate(self._hosts_world):
            if h != self.host_index:
                self.channel.sends.append(self._world.isend(
                    {"job": fut.job, "host": self.host_index, "data": data},
                    dest=world_rank, tag=MERGE_TAG))

    def _describe(self, producer):
        return f"producer rank {producer} of host {self.host_index}"

    def close(self):
        """Stop accepting snapshots (a later :meth:`submit` raises :class:`ConfigError`);
        futures already returned still complete. Buffers of unanswered snapshots stay
        attached (a producer may still read them)."""
        with _CHANNEL_LOCK:
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
