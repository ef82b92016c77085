"""The stream spec: what a batch stream is made from, frozen, defined apart from where it runs.

A :class:`StreamSpec` says which samples batch ``s`` of epoch ``e`` holds and how they are
augmented. The local engine, a hybrid host thread and a producer rank each build a
:class:`~dpu_pipe.batch.BatchMaker` from the same spec, so they make the same batches. It is
what a loader's state is checked against and (as :meth:`StreamSpec.to_wire`, a JSON dict)
what travels to the producers.
"""

from dataclasses import dataclass

from . import _validate as _v
from .constants import ON_ERROR
from .rng import check_seed
from .sampler import SHARD_TAILS, check_resume
from .sources import open_source
from .transforms import TransformConfig

__all__ = ["StreamSpec", "ON_ERROR"]

#: Fields a saved loader state records and a resume must match, beside ``num_samples``.
_STATE_FIELDS = ("seed", "batch_size", "rank", "world_size", "drop_last", "shard_tail",
                 "shuffle", "stick_to_shard")
#: What a state field added later means when a state (or a producer's spec) lacks it.
STATE_DEFAULTS = {"stick_to_shard": False}


@dataclass(frozen=True)
class StreamSpec:
    """One rank's batch stream.

    Parameters
    ----------
    source : a dpu_pipe source (``ImageFolder``, ``FileList``, ``PackedSource``, ...)
        The object itself; its ``spec()`` is what goes on the wire.
    batch_size : int
    transform : TransformConfig
    seed, shuffle, rank, world_size, shard_tail, stick_to_shard : as
        :class:`~dpu_pipe.sampler.EpochSampler`
    drop_last : bool
        Drop the rank's last partial batch.
    on_error : "raise" or "skip"
        See :class:`~dpu_pipe.batch.BatchMaker`.
    resume : (epoch, start) or (epoch, start, order_world_size), optional
        The resume point of an elastic resume, as :class:`~dpu_pipe.sampler.EpochSampler`'s
        ``resume``; None: every epoch whole.

    Every field is checked and normalized here (``seed`` to its int, booleans to bool), so
    two specs of one stream compare equal.
    """

    source: object
    batch_size: int
    transform: TransformConfig
    seed: int = 0
    shuffle: bool = True
    rank: int = 0
    world_size: int = 1
    shard_tail: str = "pad"
    drop_last: bool = False
    on_error: str = "raise"
    resume: tuple = None
    stick_to_shard: bool = False

    def __post_init__(self):
        put = object.__setattr__
        if not isinstance(self.transform, TransformConfig):
            raise TypeError(f"transform must be a TransformConfig, got {self.transform!r}")
        put(self, "batch_size", _v.positive_int(self.batch_size, "batch_size"))
        put(self, "seed", check_seed(self.seed))
        put(self, "shuffle", _v.boolean(self.shuffle, "shuffle"))
        put(self, "world_size", _v.positive_int(self.world_size, "world_size"))
        put(self, "rank", _v.integer(self.rank, "rank", 0, self.world_size - 1))
        put(self, "shard_tail", _v.choice(self.shard_tail, "shard_tail", SHARD_TAILS))
        put(self, "drop_last", _v.boolean(self.drop_last, "drop_last"))
        put(self, "on_error", _v.choice(self.on_error, "on_error", ON_ERROR))
        put(self, "stick_to_shard", _v.boolean(self.stick_to_shard, "stick_to_shard"))
        put(self, "resume", check_resume(self.resume, len(self.source), self.stick_to_shard))

    def state(self):
        """The fields a loader state saves and a resume must match (JSON-serialisable)."""
        d = {k: getattr(self, k) for k in _STATE_FIELDS}
        d["num_samples"] = len(self.source)
        d["transform"] = self.transform.to_dict()
        return d

    def to_wire(self):
        """The spec as a JSON-serialisable dict, the source as its ``spec()``."""
        d = {k: getattr(self, k) for k in _STATE_FIELDS if k not in STATE_DEFAULTS}
        d.update(source=self.source.spec(), transform=self.transform.to_dict(),
                 on_error=self.on_error)
        # Later fields only when set: the specs (and the producers' stream keys) of the
        # streams without them stay what they were.
        d.update((k, getattr(self, k)) for k, default in STATE_DEFAULTS.items()
                 if getattr(self, k) != default)
        if self.resume is not None:
            d["resume"] = list(self.resume)
        return d

    @classmethod
    def from_wire(cls, d):
        """The spec of :meth:`to_wire`'s dict ``d`` (extra keys ignored), its source opened
        by :func:`dpu_pipe.sources.open_source`."""
        optional = {"on_error": "raise", "resume": None, **STATE_DEFAULTS}
        return cls(source=open_source(d["source"]),
                   transform=TransformConfig.from_dict(d["transform"]),
                   **{k: d[k] for k in _STATE_FIELDS if k not in optional},
                   **{k: d.get(k, default) for k, default in optional.items()})
