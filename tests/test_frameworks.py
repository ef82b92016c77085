"""Frameworks that drive the loader: Lightning's fit loop (the Loader returned from
``train_dataloader()``, and the ``iterable_dataset()`` view behind a DataLoader) and
Accelerate's ``DataLoaderShard``, which fetches one batch ahead of the training step.

A checkpoint taken in the training step must hold the position after the batch that step
consumed, not after one fetched ahead (``lookahead=1`` under a wrapper that fetches ahead;
Lightning fetches ahead only from loaders without a length, so it needs none): a run stopped
mid-epoch and resumed from it sees exactly the batches an uninterrupted run sees after it. Every batch is
identified by its samples (``meta["index"]``) and a digest of its pixels, compared with the
plain Loader's stream: an overwritten buffer under a batch held by the framework shows too.
"""
import hashlib
import warnings

import pytest

from dpu_pipe import ConfigError, Loader

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(300)

N, BS, EPOCHS = 24, 4, 2
PER_EPOCH = N // BS
KW = dict(size=32, seed=5, return_meta=True, output="torch", num_threads=1, prefetch=2)


@pytest.fixture(scope="module")
def root(photo_folder):
    return photo_folder(N, classes=3, shape=(50, 3, 60, 2))


def key(batch):
    """(sample indices, pixel digest) of a batch ``(images, labels, meta)``."""
    x, _, meta = batch
    return tuple(meta["index"].tolist()), hashlib.sha1(x.numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def reference(root):
    """The plain Loader's stream over EPOCHS epochs, one key per step."""
    with Loader(root, BS, **KW) as ref:
        return [key(b) for _ in range(EPOCHS) for b in ref]


def prefetch_one(iterable):
    """What Accelerate's DataLoaderShard and Lightning's fetcher do: fetch the next batch
    before handing out the current one, so the consumer learns the end with the last."""
    it = iter(iterable)
    try:
        current = next(it)
    except StopIteration:
        return
    for nxt in it:
        yield current
        current = nxt
    yield current


# --- the contract, with a faithful prefetch-one wrapper --------------------------------------

@pytest.mark.parametrize("stop", [1, 4, PER_EPOCH, PER_EPOCH + 2])
def test_prefetching_wrapper_saves_the_consumed_position(root, reference, stop):
    """Under a wrapper fetching one ahead, the state saved in training step ``stop`` resumes
    a new loader at step ``stop``; the batches the steps saw are the Loader's, unaltered."""
    seen, kept, state = [], [], None
    with Loader(root, BS, lookahead=1, **KW) as dl:
        for _ in range(EPOCHS):
            for batch in prefetch_one(dl):
                seen.append(key(batch))
                kept.append(batch)
                if len(seen) == stop:
                    state = dl.state_dict()
        assert dl.state_dict()["epoch"] == EPOCHS - 1 and dl.state_dict()["step"] == PER_EPOCH
    assert seen == reference
    # The batches are the caller's: none was overwritten by a later one (ring buffers would).
    assert [key(b) for b in kept] == reference
    assert state["epoch"] * PER_EPOCH + state["step"] == stop, state
    with Loader(root, BS, **KW) as again:
        again.load_state_dict(state)
        rest = [key(b) for _ in range(EPOCHS) for b in again][:len(reference) - stop]
    assert rest == reference[stop:]


def test_lookahead_zero_is_the_plain_loop(root, reference):
    """Without lookahead the state after a step is the position after it (a plain loop);
    a lookahead is a count of batches."""
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="lookahead"):
            Loader(root, BS, lookahead=bad, **KW)
    with Loader(root, BS, **KW) as dl:
        for s, batch in enumerate(dl):
            assert key(batch) == reference[s]
            assert dl.state_dict()["step"] == s + 1


# --- Accelerate ---------------------------------------------------------------------------------

def test_accelerate_dataloader_shard(root, reference):
    """``prepare_data_loader`` (Accelerate's DataLoaderShard) over the iterable_dataset view:
    the state saved in step 3 resumes a new loader exactly after that step."""
    accelerate_data = pytest.importorskip("accelerate.data_loader")
    stop = 3

    def prepared(dl):
        return accelerate_data.prepare_data_loader(
            torch.utils.data.DataLoader(dl.iterable_dataset(), batch_size=None),
            device=torch.device("cpu"), num_processes=1, process_index=0, put_on_device=False)

    seen, state = [], None
    with Loader(root, BS, lookahead=1, **KW) as dl:
        shard = prepared(dl)
        assert type(shard).__name__ == "DataLoaderShard"
        for batch in shard:
            seen.append(key(batch))
            if len(seen) == stop:
                state = shard.dataset.state_dict()
    assert seen == reference[:PER_EPOCH]
    with Loader(root, BS, lookahead=1, **KW) as dl:
        dl.load_state_dict(state)
        shard = prepared(dl)
        rest = [key(b) for _ in range(EPOCHS) for b in shard]
    assert rest == reference[stop:]


# --- Lightning --------------------------------------------------------------------------------

def lightning_module(L, make_loader, wrap):
    class Module(L.LightningModule):
        """Trains a linear layer on the batches' mean colours; records every batch."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(3, 1)
            self.loader = make_loader()
            self.seen = []

        def train_dataloader(self):
            if wrap:
                return torch.utils.data.DataLoader(self.loader.iterable_dataset(),
                                                   batch_size=None)
            return self.loader

        def training_step(self, batch, batch_idx):
            self.seen.append(key(batch))
            return self.net(batch[0].float().mean((2, 3))).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        # A DataLoader is not stateful for Lightning: the view's state goes into the
        # checkpoint by these hooks (the Loader itself is saved by the fit loop).
        def on_save_checkpoint(self, checkpoint):
            if wrap:
                checkpoint["dpu_pipe"] = self.loader.state_dict()

        def on_load_checkpoint(self, checkpoint):
            if wrap:
                self.loader.load_state_dict(checkpoint["dpu_pipe"])

    return Module()


def fit(L, module, tmp_path, max_steps=-1, every=None, ckpt_path=None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks = ([ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every, save_top_k=-1,
                                  filename="{step}")] if every else [])
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=EPOCHS, max_steps=max_steps,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=bool(every), callbacks=callbacks,
                        num_sanity_val_steps=0, limit_val_batches=0)
    with warnings.catch_warnings():
        # Lightning's advice for few CPU cores and for no validation loop.
        warnings.simplefilter("ignore")
        trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("wrap", [False, True], ids=["loader", "iterable-dataset"])
def test_lightning_stops_mid_epoch_and_resumes(root, reference, tmp_path, wrap):
    """Stopped by ``max_steps`` after a checkpoint at step ``stop`` (in the second epoch) and
    resumed from it (``fit(ckpt_path=...)``): the two runs' training steps see the
    uninterrupted stream, each batch once; the checkpoint's loader state is the position
    after step ``stop`` — saved by Lightning's fit loop for the Loader (it calls
    ``state_dict``/``load_state_dict`` of stateful iterables), by the module's checkpoint
    hooks for the view (a DataLoader is not stateful for Lightning)."""
    L = pytest.importorskip("lightning")
    stop = PER_EPOCH + 2

    def make():
        return Loader(root, BS, **KW)

    first = lightning_module(L, make, wrap)
    fit(L, first, tmp_path, max_steps=stop, every=stop)
    assert first.seen == reference[:stop]
    ckpt = tmp_path / f"step={stop}.ckpt"
    saved = torch.load(ckpt, weights_only=False)
    state = saved["dpu_pipe"] if wrap else \
        saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert state["epoch"] * PER_EPOCH + state["step"] == stop, state
    first.loader.close()

    resumed = lightning_module(L, make, wrap)
    fit(L, resumed, tmp_path, ckpt_path=str(ckpt))
    assert resumed.seen == reference[stop:]
    resumed.loader.close()
