"""The loader as a PyTorch user drives it: a training loop on the CPU device with bfloat16
channels-last batches, labels kept across batches, len, set_epoch and state_dict; the
IterableDataset view behind a DataLoader; rank defaults from a gloo process group of two
processes."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dpu_pipe import ConfigError, Loader
from dpu_pipe.sources import ImageFolder
from helpers import free_port, repo_env

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(240)

N, CLASSES, BS = 22, 4, 4
KW = dict(size=32, seed=11, drop_last=True)  # full batches, as a training loop wants


@pytest.fixture(scope="module")
def root(photo_folder):
    return photo_folder(N, classes=CLASSES, shape=(60, 5, 70, 3))


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(8, CLASSES))


def _reference(root, epoch):
    """(images as float32, labels) of every batch of ``epoch``, from a plain numpy loader."""
    with Loader(root, BS, **KW) as ref:
        ref.set_epoch(epoch)
        return [(x.copy(), y.copy()) for x, y in ref]


def test_training_loop_bfloat16_channels_last_on_the_cpu_device(root):
    model = _net().to(dtype=torch.bfloat16, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = Loader(str(root), BS, device="cpu", dtype=torch.bfloat16,
                    memory_format=torch.channels_last, **KW)
    assert len(loader) == N // BS          # drop_last drops the last partial batch
    held, losses = {}, []
    with loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            held[epoch] = []
            for step, (x, y) in enumerate(loader):
                assert x.dtype == torch.bfloat16 and x.shape == (BS, 3, 32, 32)
                assert x.is_contiguous(memory_format=torch.channels_last)
                assert y.dtype == torch.int64 and x.device.type == "cpu"
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
                # Kept as users do: labels are fresh tensors; images alias the loader's
                # ring buffer (as without bfloat16), so they are cloned to be kept.
                held[epoch].append((x.clone(), y))
            assert step + 1 == len(loader)
    assert all(np.isfinite(losses))
    # Kept batches are still the batches that were yielded.
    for epoch in range(2):
        ref = _reference(root, epoch)
        assert len(held[epoch]) == len(ref)
        for (x, y), (rx, ry) in zip(held[epoch], ref):
            assert torch.equal(x, torch.from_numpy(rx).to(torch.bfloat16))
            assert np.array_equal(y.numpy(), ry)
    assert [y.tolist() for _, y in held[0]] != [y.tolist() for _, y in held[1]]


def test_state_dict_resumes_mid_epoch_in_a_new_loader(root):
    opts = dict(dtype="bfloat16", memory_format=torch.channels_last, **KW)
    with Loader(root, BS, **opts) as full:
        full.set_epoch(3)
        whole = [(x.clone(), y) for x, y in full]
    with Loader(root, BS, **opts) as first:
        first.set_epoch(3)
        it = iter(first)
        head = [tuple(t.clone() for t in next(it)) for _ in range(2)]
        state = first.state_dict()
    with Loader(root, BS, **opts) as resumed:
        resumed.load_state_dict(state)
        tail = [(x.clone(), y) for x, y in resumed]
    got = head + tail
    assert len(got) == len(whole)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, whole))


def test_iterable_dataset_view_behind_a_dataloader(root):
    with Loader(root, BS, **KW) as loader:
        ds = loader.iterable_dataset()
        assert isinstance(ds, torch.utils.data.IterableDataset)
        dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
        assert len(dl) == len(loader)
        ds.set_epoch(2)
        it = iter(dl)
        first = [t.clone() for t in next(it)]      # images alias the loader's ring
        state = ds.state_dict()
        rest = [(x.clone(), y) for x, y in it]
        with Loader(root, BS, **KW) as other:
            view = other.iterable_dataset()
            view.load_state_dict(state)
            resumed = [(x.clone(), y)
                       for x, y in torch.utils.data.DataLoader(view, batch_size=None)]
    ref = _reference(root, 2)
    got = [first] + rest
    assert len(got) == len(ref) and len(resumed) == len(ref) - 1
    for (x, y), (rx, ry) in zip(got, ref):
        assert isinstance(x, torch.Tensor) and np.array_equal(x.numpy(), rx)
        assert np.array_equal(y.numpy(), ry)
    for (x, y), (rx, ry) in zip(resumed, ref[1:]):
        assert np.array_equal(x.numpy(), rx) and np.array_equal(y.numpy(), ry)


def test_iterable_dataset_refuses_dataloader_workers(root):
    with Loader(root, BS, **KW) as loader:
        dl = torch.utils.data.DataLoader(loader.iterable_dataset(), batch_size=None,
                                         num_workers=1)
        with pytest.raises(ConfigError, match="num_workers=0"):
            next(iter(dl))


_RANK_SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from dpu_pipe import Loader

    warnings.simplefilter("error", RuntimeWarning)   # rank defaults must not warn here
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    loader = Loader(sys.argv[1], 2, size=16, seed=5, dtype="uint8")
    seen = [int(v) for _, y in loader for v in y]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    print(json.dumps({"rank": dist.get_rank(), "state": [loader.state_dict()["rank"],
                      loader.state_dict()["world_size"]], "seen": seen, "all": everyone}))
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_rank_defaults_from_a_gloo_process_group_of_two(root, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = repo_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                       WORLD_SIZE="2", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script), str(root)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=180)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    labels = ImageFolder(root).labels
    by_rank = {o["rank"]: o for o in outs}
    assert sorted(by_rank) == [0, 1]
    for r, o in by_rank.items():
        assert o["state"] == [r, 2]
    # Each rank read its own shard: together, every sample once (N = 22 splits evenly).
    seen = by_rank[0]["all"]
    assert len(seen[0]) == len(seen[1]) == N // 2
    counts = np.bincount(seen[0] + seen[1], minlength=CLASSES)
    assert counts.sum() == len(seen[0]) * 2
    assert np.all(counts <= np.bincount(labels, minlength=CLASSES))
