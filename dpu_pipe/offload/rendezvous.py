"""Producers as an MPI job of their own (``python -m dpu_pipe.worker --serve FILE``), joined
by hosts that are no MPI job with them (``torchrun``'s singletons, ``serve_file=FILE`` or
``DPU_PIPE_SERVE``). The user's side, deadlines and faults: docs/guides/cluster.md.

1. Producer rank 0 opens a port, writes it into ``FILE`` (JSON, renamed into place) and
   touches the file every :data:`REFRESH` seconds while it accepts hosts: a still time stamp
   means a job that is gone (connecting to a dead job's port crashes ``MPI_Comm_connect``),
   without any clock agreement.
2. Each host connects and sends its hello (torch's ``RANK``/``WORLD_SIZE``, hostname, host
   map, wire version, deadline); the producers accept ``--hosts`` hosts one at a time, then
   close the port and remove the file.
3. The producers match themselves to the hosts as in an MPMD job
   (:func:`~.roles.assign_producers`, hosts by ``RANK``), send each host the verdict, merge
   each intercommunicator and split it into that host's group (the host as rank 0), then
   disconnect the merged and intercommunicators so the jobs end independently. :func:`leave`
   disconnects the group at the end.
"""

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time

from ..deadline import deadline_in, poll_until
from ..errors import ConfigError, PipeTimeout
from ..mpi import load_mpi, wait_request
from . import wire
from .roles import Roles, assign_producers, parse_hostmap, HOSTMAP_ENV

__all__ = ["SERVE_ENV", "REFRESH", "accept_hosts", "join", "leave", "serve_file"]

log = logging.getLogger("dpu_pipe")

#: Environment variable naming the serve file on hosts (``DPULoader(serve_file=...)`` wins).
SERVE_ENV = "DPU_PIPE_SERVE"
#: Seconds between the producer job's rewrites of the serve file's time stamp.
REFRESH = 0.5
_HELLO_TAG, _VERDICT_TAG = 0x4d01, 0x4d02


def serve_file(path=None):
    """The serve file a host should join: ``path``, else ``DPU_PIPE_SERVE``, else None;
    ``{rank}`` and ``{local_rank}`` in it become torch's ``RANK`` and ``LOCAL_RANK`` (one
    producer job per host: ``serve-{rank}.json``)."""
    path = path if path is not None else os.environ.get(SERVE_ENV) or None
    if path is None:
        return None
    path = os.fspath(path).format(rank=int(os.environ.get("RANK", 0)),
                                  local_rank=int(os.environ.get("LOCAL_RANK", 0)))
    return os.path.abspath(path)


def _wait(req, deadline, what):
    """A request's value once it completes (``req.test()`` polled, sleeping), or PipeTimeout."""
    box = []

    def done():
        ok, value = req.test()
        if ok:
            box.append(value)
        return ok
    poll_until(done, deadline, f"{what}: no answer before the deadline", 0.005)
    return box[0]


# -- producer side ------------------------------------------------------------------------------
class _Publisher(threading.Thread):
    """Producer rank 0 while it accepts hosts: keeps the serve file fresh and ends the job at
    the deadline (the accept it watches cannot be interrupted otherwise)."""

    def __init__(self, path, deadline, comm, expected):
        super().__init__(name="dpu_pipe-serve", daemon=True)
        self.path, self.deadline, self.comm = path, deadline, comm
        self.joined, self.expected = 0, expected
        self.finished = threading.Event()

    def run(self):
        while not self.finished.wait(REFRESH):
            with contextlib.suppress(OSError):
                os.utime(self.path)
            if time.monotonic() > self.deadline:
                print(f"dpu_pipe.worker --serve {self.path}: waited for {self.expected} "
                      f"host(s) ({self.joined} joined) past the deadline; ending the producer "
                      f"job", file=sys.stderr, flush=True)
                _remove(self.path)
                # The launcher forwards this rank's stderr through its proxy, which the abort
                # tears down: without a pause the line above was lost once.
                time.sleep(1.0)
                self.comm.Abort(1)


def _remove(path):
    with contextlib.suppress(OSError):
        os.remove(path)


def _write(path, record):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def _check_hello(hello, hellos):
    """Why ``hello`` cannot join next to ``hellos`` (None: it can)."""
    if hello.get("wire") != wire.WIRE_VERSION:
        return (f"host {hello.get('hostname')!r} speaks wire version {hello.get('wire')}, the "
                f"producers {wire.WIRE_VERSION}: install the same dpu_pipe on both")
    world, rank = hello["world"], hello["rank"]
    if hellos and world != hellos[0]["world"]:
        return (f"host RANK={rank} says WORLD_SIZE={world}, an earlier host "
                f"WORLD_SIZE={hellos[0]['world']}")
    if not 0 <= rank < world or any(h["rank"] == rank for h in hellos):
        return f"host RANK={rank} is out of range or joined twice (WORLD_SIZE={world})"
    return None


def accept_hosts(comm, path, *, hosts=1, hostmap=None, accept_timeout=86400.0):
    """Producer job side (collective over ``comm``, its producers): publish a port in
    ``path``, accept ``hosts`` hosts, and return this rank's ``(roles, group)``: the
    :class:`~.roles.Roles` of the joined job and its host group (the host as rank 0). Raises
    ConfigError on every producer when a host cannot join (another dpu_pipe version, ranks
    that disagree); ends the job at the deadline: ``accept_timeout`` seconds for the first
    host, that host's own deadline for the others."""
    MPI = load_mpi()
    path = os.path.abspath(os.fspath(path))
    me, nprod = comm.Get_rank(), comm.Get_size()
    port, publisher = None, None
    if me == 0:
        port = MPI.Open_port()
        _write(path, {"port": port, "producers": nprod, "hosts": hosts,
                      "hostname": socket.gethostname(), "pid": os.getpid(),
                      "wire": wire.WIRE_VERSION})
        publisher = _Publisher(path, deadline_in(accept_timeout), comm, hosts)
        publisher.start()
    joined = []         # (hello, intercommunicator), in arrival order
    error = None
    try:
        while error is None and len(joined) < hosts:
            inter = comm.Accept(port, root=0)
            hello = None
            if me == 0:
                # Sent right after connecting: a host that does not is gone.
                hello = _wait(inter.irecv(source=0, tag=_HELLO_TAG), deadline_in(60.0),
                              f"the hello of a host joining {path}")
                error = _check_hello(hello, [h for h, _ in joined])
                if len(joined) == 0:
                    # The others come with the first: they wait as long as it does.
                    publisher.deadline = deadline_in(hello["timeout"])
                publisher.joined = len(joined) + 1
            hello, error = comm.bcast((hello, error), root=0)
            joined.append((hello, inter))
    finally:
        if me == 0:
            publisher.finished.set()
            MPI.Close_port(port)
            _remove(path)
    hostnames = comm.allgather(socket.gethostname())
    if error is None:
        joined.sort(key=lambda j: j[0]["rank"])
        ranks = [h["rank"] for h, _ in joined]
        names = tuple(h["hostname"] for h, _ in joined) + tuple(hostnames)
        # A host's map wins, as in an MPMD job; the producers may carry it alone.
        chosen = next((h["hostmap"] for h, _ in joined if h["hostmap"]),
                      hostmap or os.environ.get(HOSTMAP_ENV))
        try:
            local, warnings = assign_producers(["host"] * hosts + ["producer"] * nprod, names,
                                               parse_hostmap(chosen))
        except ConfigError as exc:
            error = str(exc)
    # The hosts agree on WORLD_SIZE (checked above): one verdict for all.
    verdict = {"error": error} if error is not None else \
        _roles_of(joined[0][0]["world"], ranks, local, names, warnings, nprod)
    group, merged = None, []
    for h, (hello, inter) in enumerate(joined):
        if me == 0:
            wait_request(inter.isend(verdict, dest=0, tag=_VERDICT_TAG),
                         deadline_in(hello["timeout"]), f"answering the host joining {path}")
        if error is not None:
            continue
        merged.append(inter.Merge(high=False))
        mine = local[hosts + me] == h
        g = merged[-1].Split(0 if mine else MPI.UNDEFINED, key=me + 1)
        if mine:
            group = g
    if error is not None:
        raise ConfigError(f"dpu_pipe.worker --serve {path}: {error}")
    # Every host has its group: only now may a host start using it (its producers were
    # busy with the others' start-up until here).
    for (hello, inter), m in zip(joined, merged):
        _disconnect(m, inter, deadline_in(hello["timeout"]), f"producers of {path}")
    return _roles(verdict, verdict["world"] + me, "producer"), group


def _roles_of(world, ranks, local, names, warnings, nprod):
    """The verdict: the joined job with torch's ``RANK`` as host ranks (those of other
    producer jobs named "?"), then the producers."""
    hosts = len(ranks)
    host_of = {world + i: ranks[local[hosts + i]] for i in range(nprod)}
    hostnames = ["?"] * world + list(names[hosts:])
    for i, r in enumerate(ranks):
        hostnames[r] = names[i]
    return {"world": world, "host_of": host_of, "hostnames": hostnames,
            "warnings": [(ranks[h], text) for h, text in warnings]}


def _roles(verdict, rank, role):
    """The :class:`~.roles.Roles` of ``rank`` in the joined job a verdict describes."""
    return Roles(hosts=tuple(range(verdict["world"])), producers=tuple(verdict["host_of"]),
                 host_of=verdict["host_of"], hostnames=tuple(verdict["hostnames"]),
                 rank=rank, role=role)


# -- host side ----------------------------------------------------------------------------------
def _read_fresh(path, deadline):
    """The serve file's record once its time stamp has moved (its producer job is alive)."""
    seen = {}

    def fresh():
        try:
            stamp = os.stat(path).st_mtime_ns
        except OSError:
            return False
        first = seen.setdefault("stamp", stamp)
        return stamp != first
    poll_until(fresh, deadline,
               f"serve file {path}: no producer job refreshes it (none started yet, or it "
               f"ended and left a stale file; start python -m dpu_pipe.worker --serve "
               f"{path})", 0.05)
    with open(path) as f:
        return json.load(f)


def join(path, *, hostmap=None, timeout=600.0):
    """Host side: join the producer job serving ``path`` as torch's ``RANK`` of
    ``WORLD_SIZE`` hosts (0 of 1 without them); returns ``(roles, group)`` as
    :func:`accept_hosts` does. Raises PipeTimeout when a step misses its deadline
    (``timeout`` seconds in all), ConfigError when the producers refuse this host."""
    MPI = load_mpi()
    path = os.path.abspath(os.fspath(path))
    deadline = deadline_in(timeout)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    record = _read_fresh(path, deadline)
    info = MPI.Info.Create()
    # MPICH bounds the attempt by this key; other MPIs ignore it.
    info.Set("timeout", str(max(1, int(deadline - time.monotonic()))))
    try:
        inter = MPI.COMM_SELF.Connect(record["port"], info, root=0)
    except MPI.Exception as exc:
        raise PipeTimeout(f"host RANK={rank}: could not connect to the producer job of "
                          f"{path} ({record.get('hostname')}, pid {record.get('pid')}): "
                          f"{exc.Get_error_string().splitlines()[-1]}") from None
    finally:
        info.Free()
    hello = {"rank": rank, "world": world, "hostname": socket.gethostname(),
             "hostmap": hostmap or os.environ.get(HOSTMAP_ENV) or None,
             "wire": wire.WIRE_VERSION, "timeout": max(1.0, deadline - time.monotonic())}
    wait_request(inter.isend(hello, dest=0, tag=_HELLO_TAG), deadline,
                 f"host RANK={rank}: greeting the producer job of {path}")
    verdict = _wait(inter.irecv(source=0, tag=_VERDICT_TAG), deadline,
                    f"host RANK={rank}: waiting for the producer job of {path} to accept "
                    f"all {record.get('hosts', 1)} of its hosts (--hosts)")
    if "error" in verdict:
        raise ConfigError(f"the producer job of {path} refused the hosts: {verdict['error']}")
    merged = inter.Merge(high=True)
    group = merged.Split(0, key=0)
    _disconnect(merged, inter, deadline, f"host RANK={rank} joining {path}")
    for h, text in verdict["warnings"]:
        if h == rank:
            log.warning("%s", text)
    return _roles(verdict, rank, "host"), group


def _disconnect(merged, inter, deadline, who):
    """Disconnect a host's merged and intercommunicator once every rank is there."""
    wait_request(merged.Ibarrier(), deadline, f"{who}: waiting for the other hosts' start-up")
    merged.Disconnect()
    inter.Disconnect()


def leave(group, timeout):
    """Disconnect a joined host group (either side) once every rank is there, within
    ``timeout`` seconds, so that this process finalizes on its own."""
    wait_request(group.Ibarrier(), deadline_in(timeout),
                 f"rank {group.Get_rank()} of a joined host group leaving it")
    group.Disconnect()
