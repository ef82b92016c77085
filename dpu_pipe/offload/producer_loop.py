"""The producer rank's loop (``python -m dpu_pipe.worker``): serve this rank's host until it
stops.

Each turn of the loop (one thread, never blocking for long) starts the handlers of the host's
requests (pickled ``(id, kind, payload)``), runs one piece of each generator handler, publishes
the made batches whose buffers were granted, makes the next assigned batch while it holds fewer
than ``DEPTH`` (docs/design/transport.md) and heartbeats; it sleeps, backing off to
``poll_interval``, when nothing happened.

Request handlers (:func:`handler`) are the extension point for work other than the training
stream (docs/guides/offload.md): a handler gets the :class:`Context` and the host's payload and
returns a value, or is a generator run one piece per turn. Built-in kinds: ``"stream"`` (see
:func:`dpu_pipe.engines.offload.stream_request`) and ``"ping"`` (echo).
"""

import argparse
import importlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import _validate as _v
from ..kernel import load_other_formats
from ..deadline import deadline_in
from ..errors import ConfigError, error_record
from ..mpi import load_mpi
from ..spec import StreamSpec
from ..batch import BatchMaker
from . import rendezvous, wire
from .channel import Channel
from .node_cache import NodeCaches, cache_key
from .roles import discover_roles, host_comm
from .transport import CANCELLED, ProducerTransport
from .validation import ValidationService

__all__ = ["serve", "main", "handler", "Context", "HANDLERS", "HANDLER_MODULES", "DEPTH"]

#: Batches a producer makes ahead into its own memory (its memory bound: DEPTH batches
#: of the largest stream, plus the decoder's scratch).
DEPTH = 2
#: {kind: handler}; see the module docstring. "resize" is reserved (the window itself).
HANDLERS = {}
#: Modules imported by :func:`serve` before it starts, for their handlers.
HANDLER_MODULES = []


def handler(kind):
    """Register the decorated function as the handler of requests of ``kind``."""
    def register(fn):
        HANDLERS[kind] = fn
        return fn
    return register


class OpenStream:
    """A stream opened from a host's stream request: a BatchMaker and ``DEPTH`` buffers."""

    def __init__(self, request, cache=None):
        if request.get("version") != wire.STREAM_REQUEST_VERSION:
            raise ConfigError(f"stream request version {request.get('version')} is not "
                              f"{wire.STREAM_REQUEST_VERSION}: host and producers run "
                              "different dpu_pipe versions")
        stream = StreamSpec.from_wire(request)
        self.cache = cache          # the node cache (a SharedCache) or None
        self.maker = BatchMaker(stream, request["num_threads"], cache)
        self.layout = wire.PayloadLayout.from_request(
            request, wire.image_shapes(stream.transform), stream.transform.np_dtype)
        mine = (self.maker.label_dtype, self.maker.label_shape)
        if mine != (self.layout.label_dtype, self.layout.label_shape):
            raise ConfigError(f"the batches here have labels {mine[0]}{mine[1]}, "
                              f"the host's {self.layout.label_dtype}{self.layout.label_shape}")
        # A buffer is a payload as the host receives it, so a batch is made in place and Put
        # as is. Touched (zeros) and OpenCV imported now: a producer's memory is what it holds
        # after start-up, not something that grows with the first batch or PNG of an epoch.
        self.free = [np.zeros(self.layout.end(self.layout.batch_size), np.uint8)
                     for _ in range(DEPTH)]
        load_other_formats()
        # {stream: sample indices reported}: each stream sharing it lists every bad sample.
        self.reported = {}

    def _bad_report(self, stream):
        """The bad samples ``stream`` has not heard of that fit the report area (JSON-able)."""
        entries, size = {}, 0
        reported = self.reported.setdefault(stream, set())
        for index, message in sorted(self.maker.bad_samples.items()):
            if index in reported:
                continue
            item = len(json.dumps({str(index): message}))
            if size + item > wire.BAD_REPORT_BYTES:
                if entries:
                    break
                message = message[:wire.BAD_REPORT_BYTES // 2]  # longer than the area alone
            entries[str(index)] = message
            reported.add(index)
            size += item
        return entries

    def make(self, work, publish_ns=0):
        """Fill a free buffer with ``work``'s batch: sets ``work.parts`` (the payload up to its
        report, then the report); the buffer comes back with :meth:`give_back`."""
        buf = self.free.pop()
        st = self.maker.stats
        read0, proc0 = st.read_s, st.process_s
        try:
            images, labels, indices = self.layout.views(buf, self.layout.batch_size)
            n = self.maker.make(work.epoch, work.step, images, labels, indices)
        except BaseException:
            self.free.append(buf)
            raise
        entries = self._bad_report(work.stream)
        report = json.dumps(entries).encode() if entries else b""
        shape = self.maker.sample_shape_at(work.epoch)
        cache = {}
        if self.cache is not None:
            c = self.cache.stats()
            cache = {f"cache_{k}": c[k] for k in wire.CACHE_FIELDS}
            cache["cache_node"] = self.cache.node
        self.layout.write_header(buf, n=n, bad_bytes=len(report),
                                 read_ns=round((st.read_s - read0) * 1e9),
                                 process_ns=round((st.process_s - proc0) * 1e9),
                                 publish_ns=publish_ns, sample_shape=shape, **cache)
        work.parts = [buf[:self.layout.end(n, shape)], np.frombuffer(report, np.uint8)]
        work.buffers = (buf, [int(i) for i in entries])

    def give_back(self, work, delivered=True):
        """Take back ``work``'s buffer; when it was not delivered, the bad samples it
        reported go with a later batch."""
        if work.buffers is not None:
            buf, reported = work.buffers
            self.free.append(buf)
            if not delivered:
                self.reported[work.stream].difference_update(reported)
            work.buffers = None


class Context:
    """What a request handler may use: ``comm`` (host group), ``rank`` (group rank),
    ``transport`` (:class:`~transport.ProducerTransport`), ``streams`` ({id: OpenStream}) and
    ``caches`` (the node's :class:`~.node_cache.NodeCaches`, or None without them)."""

    def __init__(self, transport, caches=None):
        self.transport = transport
        self.comm = transport.comm
        self.rank = transport.rank
        self.streams = {}
        self.caches = caches


@handler("ping")
def _ping(ctx, payload):
    return payload


@handler("stream")
def _open_stream(ctx, payload):
    """Open a stream; with ``cache_bytes``, its node cache first (a generator: the set-up
    waits for the node's other producers in pieces between batches)."""
    stream, request = payload
    key = json.dumps(request, sort_keys=True)
    for maker in ctx.streams.values():   # the same stream again: reuse the open source
        if getattr(maker, "key", None) == key:
            ctx.streams[stream] = maker
            return stream
    cache = None
    if request.get("cache_bytes"):
        if ctx.caches is None:
            raise ConfigError("this producer runs without node caches: cache_bytes cannot "
                              "be served")
        cache = yield from ctx.caches.open(
            cache_key(request["source"], request["transform"], request["cache_bytes"]),
            request["cache_bytes"], request["cache_samples"])
    maker = OpenStream(request, cache)
    maker.key = key
    ctx.streams[stream] = maker
    return stream


class ProducerLoop:
    """The producer rank's loop over its transport (see the module docstring)."""

    def __init__(self, transport, caches=None):
        self.t = transport
        self.ctx = Context(transport, caches)
        self.made = []              # Work made, waiting for a grant, in seq order
        self.running = []           # (id, generator) of handlers running in pieces
        self.backoff_max = transport.poll_interval
        self.publish_ns = 0
        self.current = None         # the Work the maker thread is making, and its future
        self.future = None
        # Batches are made on a thread (the kernel releases the GIL) so that this loop keeps
        # publishing granted batches, beating and answering requests meanwhile.
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="dpu_pipe-maker")
        self.pool.submit(int).result()   # started now: threads stay flat after start-up

    def _start(self, rid, kind, payload):
        if kind == "resize":  # the window itself: every made batch of the old one is void
            self._collect(wait=True)
            for work in self.made:
                self._give_back(work, False)
            self.made = []
            self.t.resize()
            return
        fn = HANDLERS.get(kind)
        try:
            if fn is None:
                raise ConfigError(f"no handler for request kind {kind!r} on this producer "
                                  f"(known: {sorted(HANDLERS)})")
            out = fn(self.ctx, payload)
        except Exception as exc:  # noqa: BLE001 - goes back to the host with its traceback
            self.t.reply(rid, False, error_record(exc))
            return
        if hasattr(out, "__next__") and hasattr(out, "send"):
            self.running.append((rid, out))
        else:
            self.t.reply(rid, True, out)

    def _step_handlers(self):
        busy = bool(self.running)
        for rid, gen in list(self.running):
            try:
                next(gen)
                continue
            except StopIteration as stop:
                ok, value = True, stop.value
            except Exception as exc:  # noqa: BLE001 - goes back to the host
                ok, value = False, error_record(exc)
            self.running.remove((rid, gen))
            self.t.reply(rid, ok, value)
        return busy

    def _done_seq(self):
        """Every assignment below this one is finished: the oldest one held, else the next."""
        held = [w.seq for w in self.made] + ([self.current.seq] if self.current else [])
        return min(held) if held else self.t.next_seq

    def _publish_granted(self):
        busy = False
        for work in list(self.made):
            g = self.t.granted(work)
            if g is None:
                continue
            busy = True
            self.made.remove(work)
            if g != CANCELLED:
                # Reported with the next batch: this one's header is already out.
                self.publish_ns = self.t.publish(work, *g)
            self._give_back(work, g != CANCELLED)
        return busy

    def _give_back(self, work, delivered):
        maker = self.ctx.streams.get(work.stream)
        if maker is not None:
            maker.give_back(work, delivered)

    def _collect(self, wait=False):
        """Move the batch the maker thread finished to ``made``; True when one was."""
        if self.future is None or not (wait or self.future.done()):
            return False
        exc = self.future.result()
        work, self.future, self.current = self.current, None, None
        return self._made(work, exc)

    def _made(self, work, exc):
        if exc is not None:
            self.t.fail(work, exc)
        self.t.working = -1
        self.made.append(work)
        return True

    def _make_next(self):
        busy = self._collect()
        # At most DEPTH batches held: the one being made and those waiting for a grant.
        if self.future is not None or len(self.made) >= DEPTH:
            return busy
        work = self.t.next_work()
        if work is None:
            return busy
        self.current = work
        maker = self._maker(work.stream)
        self.t.working = work.ticket
        self.t.beat(force=True, done=self._done_seq())
        if maker is None:
            self.current = None
            return self._made(work, ConfigError(f"no stream request for stream {work.stream} "
                                                "arrived"))
        self.future = self.pool.submit(self._make, maker, work, self.publish_ns)
        return True

    @staticmethod
    def _make(maker, work, publish_ns):
        """Maker thread: returns the exception making ``work`` raised, or None."""
        try:
            maker.make(work, publish_ns)
        except Exception as exc:  # noqa: BLE001 - delivered to the host for that step
            return exc
        return None

    def _maker(self, stream):
        """The stream's pipeline; its request may arrive a moment after the assignment."""
        deadline = deadline_in(self.t.setup_timeout)
        while stream not in self.ctx.streams:
            for rid, kind, payload in self.t.requests():
                self._start(rid, kind, payload)
            self._step_handlers()           # opening a stream with a node cache
            if stream in self.ctx.streams or time.monotonic() > deadline:
                break
            if self.t.stop_requested():
                return None
            self.t.beat(done=self._done_seq())
            time.sleep(0.001)
        return self.ctx.streams.get(stream)

    def run(self):
        idle = 0.0
        while True:
            busy = False
            for rid, kind, payload in self.t.requests():
                self._start(rid, kind, payload)
                busy = True
            if self.t.stop_requested():
                return
            busy |= self._step_handlers()
            busy |= self._publish_granted()
            busy |= self._make_next()
            busy |= self._publish_granted()
            self.t.beat(done=self._done_seq())
            if busy:
                idle = 0.0
            else:
                idle = min(self.backoff_max, max(2e-5, idle * 2))
                time.sleep(idle)


def serve(comm=None, *, hostmap=None, serve_file=None, hosts=1, accept_timeout=86400.0):
    """Serve this rank's host until it stops; returns the number of batches it delivered.
    Start-up is collective with the hosts of ``comm`` (default ``COMM_WORLD``), or, with
    ``serve_file``, ``hosts`` hosts outside it join through the port published in that file
    within ``accept_timeout`` seconds (:mod:`dpu_pipe.offload.rendezvous`)."""
    comm = load_mpi().COMM_WORLD if comm is None else comm
    for name in HANDLER_MODULES:
        importlib.import_module(name)
    if serve_file is not None:
        _, group = rendezvous.accept_hosts(comm, serve_file, hosts=hosts, hostmap=hostmap,
                                           accept_timeout=accept_timeout)
    else:
        roles = discover_roles(comm, "producer", hostmap=hostmap)
        group = host_comm(comm, roles)
    channel = Channel(group, "producer")
    caches = NodeCaches(group)
    validation = ValidationService(channel, caches=caches)
    validation.start()
    transport = ProducerTransport(group)
    # On an exception no clean shutdown is attempted: python -m mpi4py aborts the job.
    loop = ProducerLoop(transport, caches)
    loop.run()
    loop.pool.shutdown(wait=True)
    validation.stop()
    transport.close()
    if not validation.is_alive():
        # A validation thread still evaluating keeps the window (and MPI_Finalize may wait),
        # and may still read a cache.
        validation.channel.close(transport.setup_timeout)
        caches.close()
    if serve_file is not None:
        rendezvous.leave(group, transport.setup_timeout)
    else:
        group.Free()
    return transport.made


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dpu_pipe.worker",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--hostmap", default=None,
                   help="host:producer hostname pairs, as DPU_PIPE_HOSTMAP")
    p.add_argument("--serve", metavar="FILE", default=None,
                   help="serve hosts that are no ranks of this job (torchrun): publish a port "
                        "in FILE for them to join")
    p.add_argument("--hosts", type=int, default=1, metavar="N",
                   help="with --serve: the number of hosts that join (default 1; MPICH "
                        "connects one singleton host per producer job)")
    p.add_argument("--accept-timeout", type=float, default=86400.0, metavar="SECONDS",
                   help="with --serve: end the job when no host joined within SECONDS")
    args = p.parse_args(argv)
    serve(hostmap=args.hostmap, serve_file=args.serve,
          hosts=_v.positive_int(args.hosts, "--hosts"),
          accept_timeout=_v.seconds(args.accept_timeout, "--accept-timeout"))


if __name__ == "__main__":
    main()
