"""A ``torch.utils.data.IterableDataset`` view of a loader, for frameworks that expect a
dataset behind a ``DataLoader`` (Lightning, Accelerate).

    ds = loader.iterable_dataset()
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)

Each element is one whole batch made by the loader, ``(images, labels)`` or, with
``return_meta=True``, ``(images, labels, meta)`` (``batch_size=None`` turns off the
DataLoader's own batching; its default conversion leaves the meta dict's lists and tensors as
they are); determinism, ``len``, ``set_epoch`` and ``state_dict`` are the loader's. The loader has its own threads (or DPU producers): DataLoader workers would each
copy it and read the dataset once per worker, so the view refuses to run in one (a
:class:`~dpu_pipe.ConfigError` naming ``num_workers``, which the DataLoader raises in the
main process).

A wrapper that fetches one batch ahead of the training step (Accelerate's ``DataLoaderShard``)
needs the loader built with ``lookahead=1``: the batches it holds stay valid and
``state_dict()`` is the position of the step, not of the batch fetched ahead.
"""

from .errors import ConfigError
from .device import torch_module

__all__ = ["LoaderDataset"]


def _base():
    return torch_module("an IterableDataset view").utils.data.IterableDataset


class LoaderDataset(_base()):
    """Iterable dataset over the batches of ``loader`` (a :class:`~dpu_pipe.Loader` or
    :class:`~dpu_pipe.DPULoader`). Iterating it is iterating the loader: an epoch continues
    where the loader stands, as ``for batch in loader`` does."""

    def __init__(self, loader):
        super().__init__()
        self.loader = loader

    def __iter__(self):
        import torch

        info = torch.utils.data.get_worker_info()
        if info is not None:
            # Each worker would hold a copy of the loader and yield every batch once more.
            raise ConfigError(f"a dpu_pipe loader makes its batches on its own threads (or "
                              f"DPU producers): a DataLoader worker (num_workers="
                              f"{info.num_workers}) would read the whole stream again; use "
                              f"DataLoader(dataset, batch_size=None, num_workers=0)")
        return iter(self.loader)

    def __len__(self):
        """Batches per epoch (the DataLoader's len with batch_size=None)."""
        return len(self.loader)

    def set_epoch(self, epoch):
        self.loader.set_epoch(epoch)

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)
