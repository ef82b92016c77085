"""Loader states and resuming: what :meth:`Loader.state_dict <dpu_pipe.Loader.state_dict>`
writes, and where :meth:`Loader.load_state_dict <dpu_pipe.Loader.load_state_dict>` continues
(the same position, or, elastically, the rest of the saved epoch over other ranks). Pure
functions of a loader's :class:`~dpu_pipe.spec.StreamSpec` and the saved states.
"""

import contextlib

import numpy as np

from . import _validate as _v
from .errors import ConfigError
from .rng import check_epoch
from .sampler import EpochSampler
from .spec import STATE_DEFAULTS

__all__ = ["STATE_VERSION", "state_of", "source_identity", "resume_position"]

# Each version adds what an older dpu_pipe would ignore, resuming into another stream (3: the
# elastic resume point; 4: stick_to_shard). Versions 2 and 3 mean what they meant, so they
# are still read; version 1 had another epoch order.
STATE_VERSION = 4
_READABLE_STATES = (2, 3, STATE_VERSION)

#: State fields an elastic resume may change: how the rest of an epoch is sharded.
_ELASTIC_FIELDS = ("world_size", "rank", "batch_size")


def state_of(spec, epoch, step):
    """The state (JSON-serialisable) of the stream ``spec`` at ``(epoch, step)``; its
    ``"resume"`` is the spec's resume point if it applies to ``epoch``, else None."""
    resume = spec.resume
    return {"version": STATE_VERSION, "epoch": epoch, "step": step, **spec.state(),
            "resume": list(resume) if resume is not None and resume[0] == epoch else None,
            "source": source_identity(spec.source)}


def source_identity(source):
    """A state's name of the dataset: kind, location, sample count, index fingerprint."""
    spec = source.spec() if hasattr(source, "spec") else {}
    args = spec.get("args") or {}
    fp = getattr(source, "fingerprint", None)
    return {"kind": type(source).__name__,
            "location": args.get("path", args.get("root")),
            "num_samples": len(source), "fingerprint": fp() if fp else None}


def resume_position(spec, state, elastic):
    """``(resume, epoch, step)``: the resume point and position with which the stream
    ``spec`` continues from ``state`` (:func:`state_of`'s, or with ``elastic`` the list of
    every saved rank's); :class:`ConfigError` when it does not fit
    (:meth:`dpu_pipe.Loader.load_state_dict`)."""
    states = state if isinstance(state, (list, tuple)) else [state]
    if isinstance(state, (list, tuple)) and not (elastic and state):
        raise ConfigError("a list of states is for load_state_dict(states, elastic=True) "
                          "(an elastic resume from every rank's state); pass this rank's "
                          "state to resume on as many ranks as were saved")
    for st in states:
        _check_state(spec, st, elastic)
    first = states[0]
    epoch = check_epoch(first.get("epoch"))
    resume = _state_resume(first, epoch)
    same_geometry = all(first.get(k) == getattr(spec, k) for k in ("world_size", "batch_size"))
    if not elastic or same_geometry:
        if len(states) > 1:
            _elastic_point(spec, states, epoch, resume)    # checks the ranks agree
            first = next(st for st in states if st["rank"] == spec.rank)
        step = _state_step(spec, first, epoch, resume)
        if elastic:
            # Maybe another rank's state: on an uneven shard, one batch less is this end.
            mine = _sampler(spec, spec.world_size, spec.rank, resume)
            step = min(step, mine.num_batches(spec.batch_size, spec.drop_last, epoch))
    else:
        saved_resume = resume
        epoch, start = _elastic_point(spec, states, epoch, resume)
        resume, step = (epoch, start), 0
        if spec.stick_to_shard and start:
            # The rest of the epoch follows the order the saved job began it in.
            resume += (saved_resume[2] if saved_resume is not None
                       and len(saved_resume) == 3 else first["world_size"],)
    return resume, epoch, int(step)


def _check_state(spec, state, elastic):
    """ConfigError unless ``state`` is of this dataset and arguments (but ``elastic``'s)."""
    if not isinstance(state, dict) or state.get("version") not in _READABLE_STATES:
        raise ConfigError(f"not a dpu_pipe loader state (version {STATE_VERSION}): {state!r}")
    theirs, ours = state.get("source"), source_identity(spec.source)
    # A state saved before the dataset was recorded carries no "source": not checked.
    if theirs is not None and theirs.get("fingerprint") != ours["fingerprint"]:
        raise ConfigError(
            f"state was saved for another dataset: {theirs.get('kind')} "
            f"{theirs.get('location')!r} ({theirs.get('num_samples')} samples, index "
            f"fingerprint {theirs.get('fingerprint')}); this loader reads "
            f"{ours['kind']} {ours['location']!r} ({ours['num_samples']} samples, "
            f"fingerprint {ours['fingerprint']}); build the loader with the same dataset "
            f"and arguments to resume")
    for key, mine in spec.state().items():
        if elastic and key in _ELASTIC_FIELDS:
            continue
        if state.get(key, STATE_DEFAULTS.get(key)) != mine:
            hint = ""
            if key in _ELASTIC_FIELDS:
                hint = (" — or, to continue on a different number of ranks, "
                        "load_state_dict(state, elastic=True) (every rank of the saved "
                        "job must have stood at the same step, as under DDP)")
            raise ConfigError(
                f"state was saved with {key}={state.get(key)!r} but this loader has "
                f"{key}={mine!r}; build the loader with the same dataset and "
                f"arguments to resume{hint}")
    if elastic:
        for key, low in (("world_size", 1), ("batch_size", 1), ("rank", 0)):
            _v.integer(state.get(key), f"state {key}", low)
        if state["rank"] >= state["world_size"]:
            raise ConfigError(f"state rank {state['rank']} outside its world_size "
                              f"{state['world_size']}")


def _state_resume(state, epoch):
    """The resume point ``state`` was saved with, (epoch, start) or None."""
    resume = state.get("resume")
    if resume is None:
        return None
    with contextlib.suppress(TypeError, ConfigError):
        resume = tuple(resume)
        if len(resume) in (2, 3) and check_epoch(resume[0]) == epoch:
            return resume
    raise ConfigError(f"state resume point {state.get('resume')!r} is not "
                      f"[epoch {epoch}, start]")


def _sampler(spec, world_size, rank, resume):
    return EpochSampler(len(spec.source), seed=spec.seed, shuffle=spec.shuffle,
                        rank=rank, world_size=world_size, shard_tail=spec.shard_tail,
                        resume=resume, stick_to_shard=spec.stick_to_shard)


def _state_step(spec, state, epoch, resume):
    """The step of ``state``, checked against its own geometry."""
    step = state.get("step")
    saved = _sampler(spec, state.get("world_size", spec.world_size),
                     state.get("rank", spec.rank), resume)
    batches = saved.num_batches(state.get("batch_size", spec.batch_size), spec.drop_last,
                                epoch)
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) \
            or not 0 <= step <= batches:
        raise ConfigError(f"state step {step!r} outside 0..{batches}")
    return int(step)


def _elastic_point(spec, states, epoch, resume):
    """Where the rest of ``epoch`` starts after the saved ranks' steps: ``(epoch, start)``,
    positions ``0 .. start - 1`` of its order read, or ``(epoch + 1, 0)`` at its end.

    Saved rank ``r`` (``per_r`` indices in the epoch, at step ``s_r``) has read positions
    ``r, r + W, ...`` of the order, its first ``c_r = min(s_r * batch_size, per_r)``. They
    form a prefix to continue from when every ``c_r`` is ``min(K, per_r)`` for one K; one
    state stands for every rank at its step.
    """
    ref = states[0]
    world, bs = ref["world_size"], ref["batch_size"]
    base = resume[1] if resume is not None else 0
    if len(states) > 1:
        ranks = sorted(st["rank"] for st in states)
        if ranks != list(range(world)) or any(
                (st["world_size"], st["batch_size"]) != (world, bs) for st in states):
            raise ConfigError(f"an elastic resume from a list of states needs the state "
                              f"of every rank 0..{world - 1} of one job, once each; got "
                              f"ranks {ranks}")
        epochs = {st.get("epoch") for st in states}
        if len(epochs) > 1:
            raise ConfigError(f"the saved ranks stood in different epochs {sorted(epochs)}: "
                              f"an elastic resume needs every rank at the same step")
        if any(_state_resume(st, epoch) != resume for st in states):
            raise ConfigError("the saved ranks' states have different resume points: "
                              "they are not the states of one job")
        steps = {st["rank"]: _state_step(spec, st, epoch, resume) for st in states}
    else:
        step = _state_step(spec, ref, epoch, resume)
        steps = {r: step for r in range(world)}
    samplers = [_sampler(spec, world, r, resume) for r in range(world)]
    if all(steps[r] >= s.num_batches(bs, spec.drop_last, epoch) for r, s in enumerate(samplers)):
        return epoch + 1, 0
    read = [min(steps[r] * bs, s.count(epoch)) for r, s in enumerate(samplers)]
    k = max(read)
    if any(c != min(k, s.count(epoch)) for c, s in zip(read, samplers)):
        raise ConfigError(
            "the saved ranks stood at different steps ("
            + ", ".join(f"rank {r} at step {steps[r]}" for r in range(world))
            + f") of epoch {epoch}: an elastic resume needs every rank at the same step, "
              f"as under DDP")
    n = len(spec.source)
    start = base + min(k * world, n - base)
    if start >= n:
        return epoch + 1, 0
    return epoch, start
