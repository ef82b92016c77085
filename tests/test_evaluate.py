"""Evaluation: weights buffers (round trip, refusals), metrics against torch's own
CrossEntropyLoss and topk, exact merging of partial results, and the producer-side shard
evaluation against the same snapshot evaluated through ``Loader(train=False)``.
"""

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dpu_pipe import ConfigError, Loader  # noqa: E402
from dpu_pipe.kernel import BatchProcessor  # noqa: E402
from dpu_pipe.evaluate import (Metrics, ShardEvaluator, build_model, check_topk,  # noqa: E402
                               evaluate_batch, evaluate_loader, load_factory, require_torch)
from dpu_pipe.models import resnet_tiny  # noqa: E402
from dpu_pipe.sources import ImageFolder  # noqa: E402
from dpu_pipe.weights import (TENSOR_ENTRY, WEIGHTS_HEADER, load_state,  # noqa: E402
                              pack_state, read_entries)


pytestmark = pytest.mark.timeout(120)

CLASSES = 5
MODEL = "dpu_pipe.models:resnet_tiny"
MODEL_KW = {"classes": CLASSES, "width": 8}


@pytest.fixture(scope="module")
def val_folder(photo_folder):
    """ImageFolder of 23 photos of different sizes in 5 classes (23 is prime: no batch size
    or shard count divides it)."""
    return str(photo_folder(23, classes=CLASSES, shape=(48, 2, 48, 2), quality=90))


def trained_model(seed=3):
    """A model whose weights and BatchNorm statistics moved away from their initial values."""
    model = resnet_tiny(**MODEL_KW, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(2):
        x = torch.randn(6, 3, 24, 24, generator=g)
        y = torch.randint(0, CLASSES, (6,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval()


# --- weights buffers ----------------------------------------------------------------------------

def test_weights_round_trip_is_exact():
    src = trained_model()
    state = src.state_dict()
    buf = pack_state(state)
    assert buf.dtype == np.uint8 and buf.ndim == 1 and buf.size % 64 == 0
    dst = load_state(resnet_tiny(**MODEL_KW, seed=99), buf)
    got = dst.state_dict()
    assert list(got) == list(state)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    # num_batches_tracked: a 0-d int64 tensor travels too.
    assert any(t.dim() == 0 and t.dtype == torch.int64 for t in state.values())
    names = [e[0] for e in read_entries(buf)]
    assert names == list(state)


def test_weights_into_a_reused_buffer_and_other_dtypes():
    state = {"a": torch.arange(6, dtype=torch.float16).reshape(2, 3),
             "b": torch.tensor([True, False]), "c": torch.ones(3, dtype=torch.bfloat16) / 3,
             "empty": torch.zeros(0, 4), "t": torch.arange(12.0).reshape(3, 4).t()}
    out = np.zeros(1 << 16, np.uint8)
    buf = pack_state(state, out=out)
    assert np.shares_memory(buf, out)

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for k, v in state.items():
                self.register_buffer(k, torch.full_like(v.contiguous(), 7))

    got = load_state(Holder(), buf).state_dict()
    for k, v in state.items():
        assert torch.equal(got[k], v), k


def test_weights_checked_against_the_model():
    buf = pack_state(trained_model().state_dict())
    with pytest.raises(ConfigError, match=r"0.weight: weights have float32\[8, 3, 3, 3\], "
                                          r"the model float32\[16, 3, 3, 3\]"):
        load_state(resnet_tiny(classes=CLASSES, width=16), buf)
    with pytest.raises(ConfigError, match="missing .*unexpected"):
        load_state(torch.nn.Linear(2, 2), buf)
    state = trained_model().state_dict()
    state["0.weight"] = state["0.weight"].double()
    with pytest.raises(ConfigError, match="0.weight: weights have float64"):
        load_state(resnet_tiny(**MODEL_KW), pack_state(state))


def test_weights_refuse_bad_buffers():
    buf = pack_state(trained_model().state_dict())
    bad = buf.copy()
    bad[:4] = np.frombuffer(b"XXXX", np.uint8)
    with pytest.raises(ConfigError, match="bad magic"):
        load_state(resnet_tiny(**MODEL_KW), bad)
    bad = buf.copy()
    bad[4:8] = np.frombuffer(np.uint32(9).tobytes(), np.uint8)
    with pytest.raises(ConfigError, match="version 9"):
        load_state(resnet_tiny(**MODEL_KW), bad)
    with pytest.raises(ConfigError, match="truncated"):
        load_state(resnet_tiny(**MODEL_KW), buf[:buf.size // 2].copy())
    bad = buf.copy()   # first entry's data pointing past the end
    entry = bad[64:64 + TENSOR_ENTRY.itemsize].view(TENSOR_ENTRY)
    entry["data_offset"] = buf.size
    with pytest.raises(ConfigError, match="outside"):
        load_state(resnet_tiny(**MODEL_KW), bad)
    with pytest.raises(ConfigError, match="not a tensor"):
        pack_state({"x": np.zeros(3)})
    assert WEIGHTS_HEADER.itemsize == 64


# --- metrics ------------------------------------------------------------------------------------

class Fixed(torch.nn.Module):
    """Returns the logits it was given for each input row (input = row numbers)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, x):
        return self.logits[x.long()]


def reference(logits, labels, ks):
    loss = torch.nn.CrossEntropyLoss(reduction="sum")(logits, labels).item()
    top = torch.topk(logits, max(ks), dim=1).indices
    return {"count": len(labels), "loss": loss / len(labels),
            **{f"top{k}": (top[:, :k] == labels[:, None]).any(1).sum().item() / len(labels)
               for k in ks}}


@pytest.mark.parametrize("split", [[50], [1, 49], [7] * 7 + [1], [20, 0, 30]],
                         ids=["one", "1+49", "7x7+1", "with-empty"])
def test_metrics_equal_torch_and_merge_exactly(split):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 7, generator=g)
    # Ties: rows whose logits are all equal, and rows with a tie at the top; topk's choice
    # among them is the reference.
    logits[3] = 0.5
    logits[10, :3] = 2.0
    logits[11, [1, 4]] = 9.0
    labels = torch.randint(0, 7, (50,), generator=g)
    labels[3], labels[10], labels[11] = 0, 1, 4
    model = Fixed(logits)
    total = Metrics((1, 5, 3))
    rows = torch.arange(50)
    at = 0
    for n in split:
        part = evaluate_batch(model, rows[at:at + n], labels[at:at + n], Metrics((5, 1, 3)))
        total.merge(Metrics.from_dict(part.to_dict()))
        at += n
    got, ref = total.result(), reference(logits, labels, (1, 3, 5))
    assert got["count"] == ref["count"] == 50
    assert got["top1"] == ref["top1"] and got["top3"] == ref["top3"] \
        and got["top5"] == ref["top5"]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)


def test_topk_larger_than_the_classes_counts_everything():
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.3, 0.2]])
    m = evaluate_batch(Fixed(logits), torch.arange(3), torch.tensor([0, 0, 1]), Metrics((1, 5)))
    assert m.result()["top5"] == 1.0 and m.correct[1] == 1


def test_metrics_argument_checks():
    assert check_topk((5, 1, 5)) == (1, 5) and check_topk(3) == (3,)
    for bad in ((), (0,), ("a",), (True,)):
        with pytest.raises(ConfigError):
            check_topk(bad)
    with pytest.raises(ConfigError, match="merge"):
        Metrics((1,)).merge(Metrics((1, 5)))
    with pytest.raises(ConfigError, match="logits of shape"):
        evaluate_batch(lambda x: x.sum(), torch.zeros(2, 3), torch.zeros(2), Metrics())
    assert np.isnan(Metrics().result()["loss"])


def test_model_specs():
    assert load_factory(MODEL) is resnet_tiny
    assert isinstance(build_model(MODEL, MODEL_KW), torch.nn.Module)
    for bad, msg in (("dpu_pipe.models", "module:factory"), ("no_such_mod:f", "cannot import"),
                     ("dpu_pipe.models:nope", "no attribute"), ("dpu_pipe.models:__doc__",
                                                                "not callable"),
                     ("dpu_pipe.evaluate:check_topk", "not a torch.nn.Module")):
        with pytest.raises(ConfigError, match=msg):
            build_model(bad, {"topk": (1,)} if "check_topk" in bad else None)


def test_without_torch_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ConfigError, match=r"dpu_pipe\[torch\]"):
        require_torch()
    with pytest.raises(ConfigError, match=r"dpu_pipe\[torch\]"):
        pack_state({})


# --- the producer's shard evaluation against the host's Loader(train=False) -------------------

def host_reference(model, folder, batch_size, rank=0, world_size=1, ks=(1, 5), src=None,
                   **kw):
    """The snapshot evaluated on the host through Loader(train=False) and its defaults."""
    loader = Loader(src or ImageFolder(folder), batch_size, train=False, size=32, rank=rank,
                    world_size=world_size, output="torch", **kw)
    with loader:
        return evaluate_loader(model, loader, topk=ks)


@pytest.mark.parametrize("batch_size,parts", [(4, 3), (32, 2)])
def test_shard_evaluation_equals_host_loader(val_folder, batch_size, parts):
    snapshot = trained_model()
    ref = host_reference(snapshot, val_folder, batch_size)
    spec = {"source": ImageFolder(val_folder).spec(),
            "transform": Loader(ImageFolder(val_folder), 1, train=False, size=32)
            .transform.to_dict(),
            "batch_size": batch_size, "rank": 0, "world_size": 1, "model": MODEL,
            "model_kwargs": MODEL_KW, "topk": [1, 5], "num_threads": 1}
    weights = pack_state(snapshot.state_dict())
    total = Metrics((1, 5))
    ev = ShardEvaluator()     # one per producer, reused across requests as on a producer
    for part in range(parts):
        m, make_s, model_s = ev.run(spec, weights, part, parts)
        assert make_s > 0 and model_s > 0 or m.count == 0
        total.merge(m)
    assert total.count == ref.count == 23
    assert total.correct == ref.correct
    assert total.loss_sum == pytest.approx(ref.loss_sum, rel=1e-6)
    # The model is built once per factory and reloaded per request: a second snapshot
    # through the same evaluator gives that snapshot's metrics.
    other = trained_model(seed=8)
    m, _, _ = ev.run(spec, pack_state(other.state_dict()))
    ref2 = host_reference(other, val_folder, batch_size)
    assert m.correct == ref2.correct and m.loss_sum == pytest.approx(ref2.loss_sum, rel=1e-6)
    assert len(ev._models) == 1


@pytest.mark.parametrize("tail", ["mask", "uneven"])
def test_exact_counts_on_two_ranks(val_folder, tail):
    """7 samples, 2 ranks, batch 3: ranks evaluate 4 and 3 samples (batches 3+1 and 3, or
    with the default "mask" 3+1 and 3+1 with rank 1's last row padding), every sample once,
    and the merged metrics equal the whole set's."""
    from dpu_pipe.sources import FileList

    src = ImageFolder(val_folder)
    seven = FileList([(src.describe(i), int(src.labels[i])) for i in range(7)])
    snapshot = trained_model()
    whole = host_reference(snapshot, None, 3, src=seven)
    assert whole.count == 7
    spec = {"source": seven.spec(),
            "transform": Loader(seven, 1, train=False, size=32).transform.to_dict(),
            "batch_size": 3, "world_size": 2, "model": MODEL, "model_kwargs": MODEL_KW,
            "topk": [1, 5], "num_threads": 1, "shard_tail": tail}
    weights = pack_state(snapshot.state_dict())
    ev = ShardEvaluator()
    total, seen = Metrics((1, 5)), []
    for rank in range(2):
        loader = Loader(seven, 3, train=False, size=32, rank=rank, world_size=2,
                        shard_tail=tail)
        sizes = [len(labels) for _, labels in loader]
        assert sizes == ([3, 1] if rank == 0 or tail == "mask" else [3])
        seen += loader.maker.sampler.indices(0)[:loader.maker.sampler.num_valid(0)].tolist()
        m, _, _ = ev.run(dict(spec, rank=rank), weights)
        assert m.count == (4 if rank == 0 else 3)
        ref = host_reference(snapshot, None, 3, rank=rank, world_size=2, src=seven,
                             shard_tail=tail)
        assert m.correct == ref.correct and m.count == ref.count
        total.merge(m)
    assert sorted(seen) == list(range(7))
    assert total.count == 7 and total.correct == whole.correct
    assert total.loss_sum == pytest.approx(whole.loss_sum, rel=1e-6)


# --- DDP-safe exact evaluation: shard_tail="mask" ----------------------------------------------

def _dataset(folder, n):
    """n samples over the folder's photos (cycled), labels 0..CLASSES-1 cycled."""
    from dpu_pipe.sources import FileList

    src = ImageFolder(folder)
    return FileList([(src.describe(i % len(src)), (i * 3) % CLASSES) for i in range(n)])


@pytest.fixture(scope="module")
def masked_case(val_folder):
    """(model, {n: (dataset, reference metrics, single-rank Metrics)}): the reference
    computed directly — every sample made alone by the validation kernel, the logits of all
    of them at once, torch's CrossEntropyLoss and topk — and the evaluation of one rank with
    evaluate_loader (batch 5)."""
    from dpu_pipe.transforms import TransformConfig

    # Tiny convolutions: one thread, as on a producer, is faster than two that contend.
    torch.set_num_threads(1)
    model = trained_model()
    out = {}
    for n in (1, 7, 64):
        src = _dataset(val_folder, n)
        kernel = BatchProcessor(TransformConfig(train=False, size=32), 1)
        rows = [kernel.run([src.read(i)], np.array([i], np.int64), epoch=0, seed=0)[0][0]
                for i in range(n)]
        with torch.no_grad():
            logits = model(torch.from_numpy(np.stack(rows)))
        out[n] = (src, reference(logits, torch.tensor(np.asarray(src.labels)), (1, 5)),
                  host_reference(model, None, 5, src=src))
    return model, out


@pytest.mark.parametrize("n", [1, 7, 64], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda w: f"world{w}")
def test_masked_evaluation_is_exact_with_equal_batches(masked_case, n, world_size):
    """Loader(train=False) on 1-4 ranks: every rank has the same batch lengths (per-batch
    collectives cannot hang), the valid rows are every sample once, and the summed metrics
    equal the single-rank evaluation and the direct reference."""
    model, cases = masked_case
    src, ref, single = cases[n]
    batch_size = 5
    lengths, total, valid_index = [], Metrics((1, 5)), []
    for rank in range(world_size):
        with Loader(src, batch_size, train=False, size=32, rank=rank, world_size=world_size,
                    output="torch", return_meta=True) as loader:
            assert loader.stream_spec.shard_tail == "mask"
            mine, m = [], Metrics((1, 5))
            for images, labels, meta in loader:
                mine.append(len(labels))
                assert meta["valid"].dtype == torch.bool
                assert int(meta["valid"].sum()) == loader.valid_rows
                assert meta["valid"][:loader.valid_rows].all()
                valid_index += meta["index"][meta["valid"]].tolist()
                evaluate_batch(model, images, labels, m, valid=meta["valid"])
            lengths.append(mine)
        total.merge(m)
    assert all(x == lengths[0] for x in lengths), lengths
    assert sorted(valid_index) == list(range(n))
    assert total.count == single.count == ref["count"] == n
    assert total.correct == single.correct
    got = total.result()
    assert got["top1"] == ref["top1"] and got["top5"] == ref["top5"]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert total.loss_sum == pytest.approx(single.loss_sum, rel=1e-6)
    # The producer side (RemoteValidation) shards and counts the same way.
    spec = {"source": src.spec(),
            "transform": Loader(src, 1, train=False, size=32).transform.to_dict(),
            "batch_size": batch_size, "world_size": world_size, "model": MODEL,
            "model_kwargs": MODEL_KW, "topk": [1, 5], "num_threads": 1}
    weights = pack_state(model.state_dict())
    ev, remote = ShardEvaluator(), Metrics((1, 5))
    for rank in range(world_size):
        for part in range(2):
            remote.merge(ev.run(dict(spec, rank=rank), weights, part, 2)[0])
    assert remote.count == n and remote.correct == total.correct


def test_evaluate_batch_valid_argument():
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    labels = torch.tensor([0, 0, 1])
    model = Fixed(logits)
    rows = torch.arange(3)
    assert evaluate_batch(model, rows, labels, Metrics((1,)), valid=1).correct == {1: 1}
    m = evaluate_batch(model, rows, labels, Metrics((1,)), valid=np.array([False, True, True]))
    assert m.count == 2 and m.correct == {1: 0}
    assert evaluate_batch(model, rows, labels, Metrics((1,)), valid=0).count == 0
    for bad in (4, -1, np.array([1, 0, 1]), np.ones(2, bool)):
        with pytest.raises(ConfigError, match="valid"):
            evaluate_batch(model, rows, labels, Metrics((1,)), valid=bad)
