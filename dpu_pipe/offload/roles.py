"""Who is who in an MPI job: which ranks are hosts, which producers, and which host each
producer serves (the rule: :func:`assign_producers`; the user's side: docs/guides/cluster.md).
"""
import logging
import os
import socket
from dataclasses import dataclass

from ..errors import ConfigError
from ..deadline import deadline_in
from ..mpi import wait_request

__all__ = ["Roles", "assign_producers", "parse_hostmap", "discover_roles", "host_comm",
           "HOSTMAP_ENV"]

log = logging.getLogger("dpu_pipe")

HOSTMAP_ENV = "DPU_PIPE_HOSTMAP"


@dataclass(frozen=True)
class Roles:
    """``hosts`` and ``producers`` are rank tuples (ascending), ``host_of`` maps each producer
    rank to its host rank, ``hostnames`` lists every rank's hostname; ``rank`` and ``role``
    are the calling rank's."""

    hosts: tuple
    producers: tuple
    host_of: dict
    hostnames: tuple
    rank: int
    role: str


def _short(name):
    return name.split(".", 1)[0]


def _same_node(producer, host):
    """Whether short hostname ``producer`` is ``host`` or holds it as a ``-``/``_`` part."""
    p, h = _short(producer), _short(host)
    if p == h:
        return True
    parts = p.replace("_", "-").split("-")
    hp = h.replace("_", "-").split("-")
    return any(parts[i:i + len(hp)] == hp for i in range(len(parts) - len(hp) + 1))


def parse_hostmap(text):
    """``"hostA:dpuA,hostB:dpuB"`` → ``{producer hostname: host hostname}``; None for an
    empty or missing map. Raises ConfigError for malformed text or a producer hostname
    mapped twice."""
    if not text:
        return None
    mapping = {}
    for item in str(text).replace(";", ",").split(","):
        item = item.strip()
        if not item:
            continue
        host, sep, producer = (part.strip() for part in item.partition(":"))
        if not sep or not host or not producer:
            raise ConfigError(f"host map entry {item!r} is not 'host:producer' "
                              f"(e.g. {HOSTMAP_ENV}='nodeA:bf-nodeA,nodeB:bf-nodeB')")
        if mapping.setdefault(producer, host) != host:
            raise ConfigError(f"host map sends producer host {producer!r} to both "
                              f"{mapping[producer]!r} and {host!r}")
    return mapping or None


def assign_producers(roles, hostnames, hostmap=None):
    """Map producers to hosts: returns ``({producer rank: host rank}, warnings)``, the
    warnings as ``(host rank concerned, text)`` pairs.

    ``roles[r]`` is "host" or "producer", ``hostnames[r]`` rank r's hostname. An explicit
    ``hostmap`` (``{producer hostname: host hostname}``, see :func:`parse_hostmap`) decides
    alone. Else by name: the same hostname, then one holding the host's as a
    ``-``/``_``-separated part (``node1-dpu``, ``bf-node1``, ``node1_bf2``), the longest
    host name first, then anywhere (with a warning). Among a producer's candidate hosts the
    one with the fewest producers so far wins, then the lowest rank. Raises ConfigError
    when no rank is a host or the map misses a producer's host or names no host's."""
    hosts = [r for r, role in enumerate(roles) if role == "host"]
    if not hosts:
        raise ConfigError("no rank declared the role 'host'")
    load = {h: 0 for h in hosts}
    host_of, unmatched, warnings = {}, [], []

    def place(p, candidates):
        h = min(candidates, key=lambda h: (load[h], h))
        load[h] += 1
        host_of[p] = h
        return h

    producers = [p for p, role in enumerate(roles) if role == "producer"]
    if hostmap:
        known = {hostnames[h] for h in hosts}
        for host in sorted(set(hostmap.values()) - known):
            raise ConfigError(f"host map names host {host!r}, but no host rank runs there "
                              f"(host ranks run on {sorted(known)})")
        for p in producers:
            want = hostmap.get(hostnames[p], hostmap.get(_short(hostnames[p])))
            if want is None:
                raise ConfigError(f"host map has no entry for producer host "
                                  f"{hostnames[p]!r} (rank {p})")
            place(p, [h for h in hosts if hostnames[h] == want])
        return host_of, ()
    for p in producers:
        same = [h for h in hosts if hostnames[h] == hostnames[p]]
        if not same:
            near = [h for h in hosts if _same_node(hostnames[p], hostnames[h])]
            if near:  # the most specific host name wins (node10 over node1 for node10-dpu)
                longest = max(len(_short(hostnames[h])) for h in near)
                same = [h for h in near if len(_short(hostnames[h])) == longest]
        if same:
            place(p, same)
        else:
            unmatched.append(p)
    for p in unmatched:
        h = place(p, hosts)
        warnings.append((h, f"producer rank {p} on {hostnames[p]!r} matches no host's node; "
                         f"paired with host rank {h} on {hostnames[h]!r} (its traffic "
                         f"crosses the network; set {HOSTMAP_ENV} to choose)"))
    if producers:
        for h in hosts:
            if load[h] == 0:
                warnings.append((h, f"host rank {h} on {hostnames[h]!r} has no producer while "
                                f"{len(producers)} serve other hosts; it will produce "
                                f"locally (set {HOSTMAP_ENV} to choose)"))
    return host_of, tuple(warnings)


def discover_roles(comm, role, *, hostname=None, hostmap=None, timeout=86400.0):
    """Collective (start-up only): every rank of ``comm`` declares ``role`` ("host" or
    "producer"); returns the same :class:`Roles` on every rank. ``hostmap`` (text, hosts
    only) overrides ``DPU_PIPE_HOSTMAP``; the first host's map is everyone's. Raises
    ConfigError on every rank when a role is invalid or no host exists, PipeTimeout when not
    every rank arrives within ``timeout`` seconds (producers wait, sleeping, for their hosts'
    first DPULoader)."""
    wait_request(comm.Ibarrier(), deadline_in(timeout),
                 f"start-up: rank {comm.Get_rank()} waited for every rank of the job to "
                 f"declare its role")
    hostname = socket.gethostname() if hostname is None else str(hostname)
    if hostmap is None:
        hostmap = os.environ.get(HOSTMAP_ENV) or None
    table = comm.allgather((role, hostname, hostmap))
    roles = [r for r, _, _ in table]
    bad = sorted({repr(r) for r in roles if r not in ("host", "producer")})
    if bad:
        raise ConfigError(f"roles must be 'host' or 'producer', got {', '.join(bad)}")
    hostnames = tuple(h for _, h, _ in table)
    # A host's map (argument or environment) wins; producers may carry it alone.
    maps = [m for r, _, m in table if r == "host" and m] + [m for _, _, m in table if m]
    host_of, warnings = assign_producers(roles, hostnames,
                                         parse_hostmap(maps[0] if maps else None))
    me = comm.Get_rank()
    for h, text in warnings:
        if h == me:
            log.warning("%s", text)
    return Roles(hosts=tuple(r for r, x in enumerate(roles) if x == "host"),
                 producers=tuple(r for r, x in enumerate(roles) if x == "producer"),
                 host_of=host_of, hostnames=hostnames, rank=me, role=role)


def host_comm(comm, roles):
    """Collective (start-up only): split ``comm`` into one communicator per host, the host as
    rank 0 and its producers after it in rank order."""
    me = comm.Get_rank()
    host = me if roles.role == "host" else roles.host_of[me]
    return comm.Split(color=roles.hosts.index(host), key=0 if me == host else me + 1)
