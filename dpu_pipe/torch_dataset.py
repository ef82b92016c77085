"""A ``torch.utils.data.IterableDataset`` of a loader's whole batches, for frameworks that
expect a dataset behind a ``DataLoader`` (Lightning, Accelerate)::

    dl = torch.utils.data.DataLoader(loader.iterable_dataset(), batch_size=None)

``len``, ``set_epoch`` and ``state_dict`` are the loader's; DataLoader workers are refused.
Accelerate, fetching ahead, needs ``lookahead=1`` ("Lightning and Accelerate" in
docs/guides/loading.md).
"""

from .errors import ConfigError
from ._torch import require_torch

__all__ = ["LoaderDataset"]


class LoaderDataset(require_torch("an IterableDataset view").utils.data.IterableDataset):
    """The batches of ``loader`` (a :class:`~dpu_pipe.Loader`): iterating it iterates the
    loader, continuing where it stands."""

    def __init__(self, loader):
        super().__init__()
        self.loader = loader

    def __iter__(self):
        import torch
        info = torch.utils.data.get_worker_info()
        if info is not None:
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
