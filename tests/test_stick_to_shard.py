"""stick_to_shard=True: every rank reads the same subset of the samples every epoch, in another
order each epoch; the subsets are disjoint and complete over the ranks, shard_tail applies as
without it, memory is O(1), and states resume it — elastically too, re-partitioning after the
resumed epoch."""
import numpy as np
import pytest

from dpu_pipe import ConfigError, Loader, rng
from dpu_pipe.sampler import EpochSampler

SEED = 12345


def _real(n, ws, r):
    """Rank r's positions below n (its samples that are not padding)."""
    return -(-(n - r) // ws) if n > r else 0


@pytest.mark.parametrize("shard_tail", ["pad", "drop", "uneven", "mask"])
@pytest.mark.parametrize("n", [1, 3, 7, 13, 65, 257])
@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_subsets_are_fixed_disjoint_and_complete(ws, n, shard_tail):
    if shard_tail == "drop" and n < ws:
        pytest.skip("every rank empty: refused")
    samplers = [EpochSampler(n, seed=SEED, rank=r, world_size=ws, shard_tail=shard_tail,
                             stick_to_shard=True) for r in range(ws)]
    subsets, orders = {}, {}
    for epoch in range(4):
        everyone = []
        for r, s in enumerate(samplers):
            idx = s.indices(epoch)
            assert len(idx) == len(s)
            mine = n // ws if shard_tail == "drop" else _real(n, ws, r)
            assert s.num_valid(epoch) == (mine if shard_tail in ("mask", "uneven", "drop")
                                          else len(s))
            real = idx[:mine]
            assert len(set(real.tolist())) == mine          # no sample twice in a rank
            if shard_tail in ("pad", "mask"):
                # The padding comes last and repeats samples of the epoch.
                assert set(idx[mine:].tolist()) <= set(range(n))
            subsets.setdefault(r, set(real.tolist()))
            assert set(real.tolist()) == subsets[r], f"rank {r} changed subset in {epoch}"
            orders.setdefault(r, []).append(real.tolist())
            everyone += real.tolist()
        if shard_tail == "drop":
            assert len(everyone) == len(set(everyone)) == ws * (n // ws)
        else:
            assert sorted(everyone) == list(range(n)), "not every sample exactly once"
    for r, seq in orders.items():
        if len(seq[0]) >= 4:
            assert any(o != seq[0] for o in seq[1:]), f"rank {r} reads one order every epoch"


def test_the_order_is_the_documented_one():
    """Position r + k*W of epoch e is F(r + W * P_{r,e}(k)), F keyed by the seed alone and
    P_{r,e} by (seed, rank, world size) and the epoch (STREAM_STICK keys); computed here with
    rng's numpy twin of the permutation kernel."""
    n, ws = 29, 3

    def key(index, block):
        return int(rng.random_u64(SEED, 0, index, rng.STREAM_STICK, block)[0])

    for r in range(ws):
        s = EpochSampler(n, seed=SEED, rank=r, world_size=ws, shard_tail="uneven",
                         stick_to_shard=True)
        for epoch in (0, 5):
            k = np.arange(_real(n, ws, r))
            inner = rng.permutation_at(k, len(k), key((ws << 32) | r, 1), epoch)
            want = rng.permutation_at(r + ws * inner, n, key(0, 0), 0)
            assert s.indices(epoch).tolist() == want.tolist()


def test_without_shuffle_it_is_index_order():
    for r in range(3):
        a = EpochSampler(10, rank=r, world_size=3, shuffle=False, stick_to_shard=True)
        b = EpochSampler(10, rank=r, world_size=3, shuffle=False)
        assert a.indices(1).tolist() == b.indices(1).tolist()


def test_memory_is_o1_for_huge_datasets():
    s = EpochSampler(1 << 40, seed=3, rank=2, world_size=4, stick_to_shard=True)
    idx = s.indices(7, 10**9, 10**9 + 500)
    assert len(set(idx.tolist())) == 500 and idx.min() >= 0 and idx.max() < 1 << 40
    # The same samples in epoch 8, for this rank's subset is fixed: position-wise different.
    assert s.batch(8, 2 * 10**6, 500).shape == (500,)


@pytest.fixture(scope="module")
def data(photo_folder):
    # One class folder per sample: a label is its sample index.
    return str(photo_folder(29, shape=(40, 1, 50, 1)))


KW = dict(size=16, dtype="uint8", seed=4, stick_to_shard=True, shard_tail="uneven")


def _labels(ld, steps=None):
    out = []
    for _, y in ld:
        out += y.tolist()
        if steps is not None and ld.state_dict()["step"] == steps:
            break
    return out


def test_state_records_stick_to_shard_and_resumes(data):
    ld = Loader(data, 3, rank=1, world_size=2, **KW)
    first = _labels(ld)
    state = ld.state_dict()
    assert state["stick_to_shard"] is True and state["version"] == 4
    a = Loader(data, 3, rank=1, world_size=2, **KW)
    a.load_state_dict(state)
    b = Loader(data, 3, rank=1, world_size=2, **KW)
    b.set_epoch(1)
    assert _labels(a) == _labels(b)
    assert sorted(_labels(a)) == sorted(first)                  # the same subset
    plain = Loader(data, 3, rank=1, world_size=2, **dict(KW, stick_to_shard=False))
    with pytest.raises(ConfigError, match="stick_to_shard"):
        plain.load_state_dict(state)
    # A state of an older version (no stick_to_shard recorded) means it was off.
    old = dict(plain.state_dict(), version=3)
    del old["stick_to_shard"]
    plain.load_state_dict(old)
    with pytest.raises(ConfigError, match="stick_to_shard"):
        ld.load_state_dict(old)


def test_elastic_resume_on_another_world_size_repartitions(data):
    """A job of 2 ranks reads 2 steps of epoch 1 and saves; a job of 3 ranks resumes
    elastically: the rest of epoch 1 (in the order the 2 ranks began it) is split over the 3,
    so every sample of epoch 1 is read once across both jobs; from epoch 2 on, each of the 3
    ranks keeps a subset of its own — a new partition — every epoch."""
    n = 29
    old = [Loader(data, 3, rank=r, world_size=2, **KW) for r in range(2)]
    old_subsets, read = [], []
    for ld in old:
        old_subsets.append(set(_labels(ld)))
        read += _labels(ld, steps=2)
    states = [ld.state_dict() for ld in old]
    new = [Loader(data, 3, rank=r, world_size=3, **KW) for r in range(3)]
    for ld in new:
        ld.load_state_dict(states, elastic=True)
        assert ld.stream_spec.resume == (1, 12, 2)
    rest = [_labels(ld) for ld in new]
    assert sorted(read + sum(rest, [])) == list(range(n))
    # A state saved inside the resumed epoch carries the order's world size and resumes.
    again = Loader(data, 3, rank=1, world_size=3, **KW)
    again.load_state_dict(states, elastic=True)
    _labels(again, steps=1)
    mid = again.state_dict()
    assert mid["resume"] == [1, 12, 2]
    other = Loader(data, 3, rank=1, world_size=3, **KW)
    other.load_state_dict(mid)
    assert _labels(other) == rest[1][3:]
    subsets = [set(_labels(ld)) for ld in new]
    for ld, sub in zip(new, subsets):
        assert set(_labels(ld)) == sub                          # epoch 3: the same subset
    assert sorted(sum((sorted(s) for s in subsets), [])) == list(range(n))
    assert subsets[0] not in old_subsets                         # re-partitioned


def test_stick_to_shard_travels_in_the_wire_spec_only_when_set(data):
    import json

    from dpu_pipe.spec import StreamSpec
    from dpu_pipe.sources import ImageFolder
    from dpu_pipe.transforms import TransformConfig

    src, cfg = ImageFolder(data), TransformConfig(size=16)
    plain = StreamSpec(src, 3, cfg, world_size=2, rank=1)
    assert "stick_to_shard" not in plain.to_wire()        # other streams' specs unchanged
    spec = StreamSpec(src, 3, cfg, world_size=2, rank=1, stick_to_shard=True,
                      resume=(3, 10, 4))
    wire = json.loads(json.dumps(spec.to_wire()))
    assert wire["stick_to_shard"] is True and wire["resume"] == [3, 10, 4]
    back = StreamSpec.from_wire(wire)
    assert back.to_wire() == spec.to_wire() and back.resume == (3, 10, 4)
    assert back.stick_to_shard is True
    with pytest.raises(ConfigError, match="resume"):
        StreamSpec(src, 3, cfg, resume=(3, 10, 4))          # a third item needs stick_to_shard
