"""Progressive resolution (``size=dpu_pipe.progressive_size(...)``): the sizes per epoch are
FFCV's, the Loader yields them, each epoch's batches are those of a fixed-size Loader at that
epoch's size, and a resume across a size change — plain, at an epoch's end, elastic — makes
the stream of an uninterrupted run. The offloaded modes: tests/mpi/test_progressive_offload.py.
"""
import dataclasses
import itertools
import json

import numpy as np
import pytest

import dpu_pipe
from dpu_pipe import ConfigError, Loader, progressive_size
from dpu_pipe.kernel import BatchProcessor
from dpu_pipe.offload import wire
from dpu_pipe.spec import StreamSpec
from dpu_pipe.transforms import TransformConfig

N = 18
BS = 4
SEED = 7
#: 16 px in epochs 0-1, 24 px in epoch 2 (the ramp's midpoint, a multiple of 8), 32 px from
#: epoch 3: three sizes in four epochs.
SCHEDULE = dict(min_size=16, max_size=32, start_epoch=1, end_epoch=3, multiple=8)
SIZES = [16, 16, 24, 32, 32]


def ffcv_resolution(epoch, min_res, max_res, end_ramp, start_ramp, multiple):
    """FFCV's get_resolution (ffcv-imagenet's train_imagenet.py), from its formula: numpy's
    interp, then numpy's round (half to even) to a multiple."""
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    interp = np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])[0]
    return int(np.round(interp / multiple)) * multiple


@pytest.fixture(scope="module")
def data(photo_folder):
    return photo_folder(N)


def kw(**extra):
    return dict(dict(seed=SEED, dtype="uint8", num_threads=1), **extra)


def stream(loader, epochs):
    """Copies of every (images, labels) batch of ``epochs`` epochs from where it stands."""
    return [[(x.copy(), y.copy()) for x, y in loader] for _ in range(epochs)]


def same(a, b, where):
    assert len(a) == len(b), (where, len(a), len(b))
    for j, ((x, y), (u, v)) in enumerate(zip(a, b)):
        assert x.shape == u.shape and x.dtype == u.dtype, (where, j, x.shape, u.shape)
        assert np.array_equal(y, v), (where, j)
        assert np.array_equal(x, u), (where, j)


# --- the schedule ----------------------------------------------------------------------------

def test_sizes_follow_ffcv_rule():
    grid = itertools.product((1, 7, 32, 160, 171), (0, 1, 25, 64), (0, 3),
                             (0, 1, 2, 7, 11), (1, 8, 32))
    checked = 0
    for lo, extra, start, ramp, multiple in grid:
        hi, end = lo + extra, start + ramp
        want = [ffcv_resolution(e, lo, hi, end, start, multiple) for e in range(end + 3)]
        if min(want) < 1:
            with pytest.raises(ConfigError, match="use a smaller multiple"):
                progressive_size(lo, hi, start, end, multiple)
            continue
        ps = progressive_size(lo, hi, start, end, multiple)
        assert ps.sizes(end + 3) == want, (lo, hi, start, end, multiple)
        assert ps.largest == max(want)
        checked += 1
    assert checked > 300


def test_ffcv_recipe_and_ties_round_half_to_even():
    # FFCV's rn50 88-epoch recipe: 160 px to epoch 65, 192 px from 76.
    ps = progressive_size(160, 192, start_epoch=65, end_epoch=76)
    assert ps.sizes(88) == [ffcv_resolution(e, 160, 192, 76, 65, 32) for e in range(88)]
    assert ps.sizes(88)[:66] == [160] * 66 and ps.sizes(88)[76:] == [192] * 12
    assert ps.multiple == 32
    # interp / 32 = 5.5 and 4.5: numpy's round goes to the even neighbour.
    assert progressive_size(160, 192, 0, 2).size_at(1) == 192
    assert progressive_size(128, 160, 0, 2).size_at(1) == 128
    # A max_size that is no multiple: the ramp can round above it; buffers take the largest.
    ps = progressive_size(128, 190, 0, 10)
    assert ps.size_at(9) == 192 and ps.size_at(10) == 190 and ps.largest == 192


@pytest.mark.parametrize("args,match", [
    ((192, 160, 0, 4), "min_size <= max_size"),
    ((160, 192, 5, 4), "start_epoch <= end_epoch"),
    ((0, 192, 0, 4), "min_size must be an integer in"),
    ((160.0, 192, 0, 4), "min_size must be an integer"),
    ((True, 192, 0, 4), "min_size must be an integer"),
    ((160, 192, -1, 4), "start_epoch must be an integer in"),
    ((160, 192, 0, 2**32), "end_epoch must be an integer in"),
    ((160, 192, 0, 4, 0), "multiple must be an integer in"),
    ((4, 40, 0, 8, 32), "gives size 0 in epoch 1"),
])
def test_bad_schedules_are_config_errors(args, match):
    with pytest.raises(ConfigError, match=match):
        progressive_size(*args)


def test_schedule_is_frozen_plain_data():
    ps = progressive_size(**SCHEDULE)
    assert ps == dpu_pipe.ProgressiveSize(16, 32, 1, 3, 8) and hash(ps) == hash(
        progressive_size(16, 32, 1, 3, 8))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ps.min_size = 8
    d = json.loads(json.dumps(ps.to_dict()))
    assert d["kind"] == "progressive" and dpu_pipe.ProgressiveSize.from_dict(d) == ps
    with pytest.raises(ConfigError, match="progressive_size"):
        dpu_pipe.ProgressiveSize.from_dict(dict(d, extra=1))


def test_schedule_travels_in_the_stream_spec(data):
    ps = progressive_size(**SCHEDULE)
    cfg = TransformConfig(size=ps, dtype="uint8", cutmix_alpha=1.0, num_classes=N)
    assert cfg.progressive and cfg.sample_shape == (3, 32, 32)
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["size"] == ps.to_dict()
    assert TransformConfig.from_dict(d) == cfg
    assert [cfg.at_epoch(e).recipe.size for e in range(5)] == [(s, s) for s in SIZES]
    assert not cfg.at_epoch(2).progressive and cfg.at_epoch(2).batch_ops == cfg.batch_ops
    assert cfg.sample_shape_at(2) == (3, 24, 24)
    spec = StreamSpec(dpu_pipe.sources.as_source(data), BS, cfg)
    wire_dict = json.loads(json.dumps(spec.to_wire()))
    assert StreamSpec.from_wire(wire_dict).transform == cfg
    # A fixed size keeps its dict: the specs and states of every other stream are unchanged.
    assert TransformConfig(size=24).to_dict()["size"] == [24, 24]


def test_train_only_and_one_size_per_kernel():
    ps = progressive_size(**SCHEDULE)
    with pytest.raises(ConfigError, match="give the evaluation loader a fixed size"):
        TransformConfig(train=False, size=ps)
    with pytest.raises(ConfigError, match="at_epoch"):
        BatchProcessor(TransformConfig(size=ps))
    # Checks that depend on the size use the largest one.
    with pytest.raises(ConfigError, match="resize"):
        TransformConfig(size=ps, resize=20)


# --- the Loader --------------------------------------------------------------------------------

RECIPES = {"plain": {},
           "cutmix-hwc": dict(cutmix_alpha=1.0, mixup_alpha=0.5, num_classes=N, layout="HWC",
                              auto_augment="ta_wide", random_erase=0.5)}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_loader_yields_each_epochs_size_as_a_fixed_size_loader(data, recipe):
    """Epoch e of the progressive stream is epoch e of Loader(size=size_at(e)), bit for bit:
    the crops, the ops and the CutMix boxes of each epoch at its own size."""
    extra = RECIPES[recipe]
    ps = progressive_size(**SCHEDULE)
    with Loader(data, BS, size=ps, **kw(**extra)) as loader:
        got = stream(loader, 5)
        for e, side in enumerate(SIZES):
            with Loader(data, BS, size=side, **kw(**extra)) as fixed:
                fixed.set_epoch(e)
                want = stream(fixed, 1)[0]
                shape = (3, side, side) if "layout" not in extra else (side, side, 3)
                assert {x.shape[1:] for x, _ in got[e]} == {shape}, (e, side)
                same(got[e], want, f"epoch {e}")
                assert loader.describe(e, 5) == fixed.describe(e, 5)


def test_two_threads_make_the_same_stream(data):
    ps = progressive_size(**SCHEDULE)
    with Loader(data, BS, size=ps, **kw()) as one, \
            Loader(data, BS, size=ps, **kw(num_threads=2, prefetch=3)) as two:
        for e in range(4):
            same(stream(one, 1)[0], stream(two, 1)[0], f"epoch {e}")


def test_resume_across_a_size_change_equals_an_uninterrupted_run(data):
    ps = progressive_size(**SCHEDULE)
    with Loader(data, BS, size=ps, **kw()) as ref:
        full = stream(ref, 5)
    steps = len(full[0])
    # (epoch, batches taken): mid-epoch in 16 px before 24 px; mid-epoch in 24 px before
    # 32 px; the end of epoch 1 (the next batch is epoch 2's, at the next size).
    for epoch, take in ((1, 2), (2, 1), (1, steps)):
        with Loader(data, BS, size=ps, **kw()) as first:
            first.set_epoch(epoch)
            it = iter(first)
            for _ in range(take):
                next(it)
            state = json.loads(json.dumps(first.state_dict()))
        assert state["transform"]["size"] == ps.to_dict()
        want = ([full[epoch][take:]] if take < steps else []) + full[epoch + 1:4]
        with Loader(data, BS, size=ps, **kw()) as second:
            second.load_state_dict(state)
            rest = stream(second, len(want))
        assert rest[0][0][0].shape[-1] == SIZES[epoch if take < steps else epoch + 1]
        for k, (g, w) in enumerate(zip(rest, want)):
            same(g, w, f"resumed at epoch {epoch} step {take}, part {k}")


def test_a_state_of_another_schedule_is_refused(data):
    with Loader(data, BS, size=progressive_size(**SCHEDULE), **kw()) as a:
        state = a.state_dict()
    other = dict(SCHEDULE, end_epoch=4)
    for size in (progressive_size(**other), 32):
        with Loader(data, BS, size=size, **kw()) as b:
            with pytest.raises(ConfigError, match="transform"):
                b.load_state_dict(state)


def test_elastic_resume_across_a_size_change(data):
    """2 ranks stop one batch into epoch 2 (24 px); 3 ranks continue elastically: the rest
    of epoch 2 at 24 px, every sample of it once, then epoch 3 at 32 px as a fixed-size
    Loader of 3 ranks makes it."""
    ps = progressive_size(**SCHEDULE)
    tail = dict(shard_tail="mask")
    states = []
    seen = []
    for r in range(2):
        with Loader(data, BS, size=ps, rank=r, world_size=2, **kw(**tail)) as old:
            old.set_epoch(2)
            x, y = next(iter(old))
            assert x.shape[-1] == 24
            seen += y.tolist()
            states.append(json.loads(json.dumps(old.state_dict())))
    rest_labels = []
    for r in range(3):
        with Loader(data, BS, size=ps, rank=r, world_size=3, **kw(**tail)) as new, \
                Loader(data, BS, size=24, rank=r, world_size=3, **kw(**tail)) as ref24, \
                Loader(data, BS, size=32, rank=r, world_size=3, **kw(**tail)) as ref32:
            new.load_state_dict(states, elastic=True)
            # The fixed-size references load the same states, their size in place of the
            # schedule: the same resume point, at epoch 2's size.
            fixed = ref24.state_dict()["transform"]
            ref24.load_state_dict([dict(s, transform=fixed) for s in states], elastic=True)
            got, want = [], []
            for x, y in new:
                got.append((x.copy(), y.copy()))
                rest_labels += y[:new.valid_rows].tolist()
            want = stream(ref24, 1)[0]
            same(got, want, f"rank {r} rest of epoch 2")
            assert all(x.shape[-1] == 24 for x, _ in got)
            ref32.set_epoch(3)
            same(stream(new, 1)[0], stream(ref32, 1)[0], f"rank {r} epoch 3")
    assert sorted(seen + rest_labels) == list(range(N))


# --- the wire ----------------------------------------------------------------------------------

def test_payload_carries_each_batchs_shape():
    """A slot is sized for the largest size; a smaller batch fills its start and its header
    names the shape, which the reader takes its views with."""
    layout = wire.PayloadLayout(3, (3, 8, 8), "uint8")
    small = (3, 4, 6)
    buf = np.zeros(layout.nbytes, np.uint8)
    images, labels, indices = layout.views(buf, 3)
    assert images.shape == (3, 3, 8, 8)
    rows = np.arange(2 * 72, dtype=np.uint8).reshape((2,) + small)
    images.reshape(-1)[:rows.size] = rows.reshape(-1)
    labels[:2] = (5, 6)
    indices[:2] = (1, 2)
    report = json.dumps({"9": "bad"}).encode()
    at = layout.end(2, small)
    assert at == layout.images_offset + 2 * 72 < layout.end(2)
    buf[at:at + len(report)] = np.frombuffer(report, np.uint8)
    layout.write_header(buf, n=2, bad_bytes=len(report), sample_shape=small)
    head = wire.unpack(buf, wire.PAYLOAD_HEADER)
    assert head["version"] == wire.WIRE_VERSION and layout.shape_of(head) == small
    x, y, i = layout.views(buf, 2, small)
    assert np.array_equal(x, rows) and y.tolist() == [5, 6] and i.tolist() == [1, 2]
    assert layout.report(buf, 2, len(report), small) == {9: "bad"}
    # Without a shape the header names the layout's own.
    layout.write_header(buf, n=1)
    assert layout.shape_of(wire.unpack(buf, wire.PAYLOAD_HEADER)) == (3, 8, 8)
    for bad in ((3, 8, 9), (3, 0, 8)):
        with pytest.raises(ConfigError, match="do not fit"):
            layout.shape_of({"sample_shape": list(bad)})


def test_loader_buffers_hold_the_largest_size(data):
    """Slot memory: batch_size x the largest sample, whatever epoch the loader starts in."""
    ps = progressive_size(16, 22, 0, 10, multiple=8)     # ramps to 24 px, ends at 22 px
    assert ps.largest == 24
    with Loader(data, BS, size=ps, **kw()) as loader:
        assert loader.maker.batch_shape == (BS, 3, 24, 24)
        loader.set_epoch(9)
        x, _ = next(iter(loader))
        assert x.shape[1:] == (3, 24, 24)
        loader.set_epoch(10)
        x, _ = next(iter(loader))
        assert x.shape[1:] == (3, 22, 22) and x.flags.c_contiguous


def test_an_empty_ramp_switches_after_start_epoch():
    # FFCV tests start_ramp first: with start == end that epoch keeps min_size.
    ps = progressive_size(128, 192, 4, 4)
    assert ps.sizes(7) == [ffcv_resolution(e, 128, 192, 4, 4, 32) for e in range(7)] \
        == [128] * 5 + [192] * 2
    assert ps.largest == 192
