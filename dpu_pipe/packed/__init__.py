"""Packed datasets: a dataset's records in memory-mappable shards plus a manifest.

:mod:`.format` defines every on-disk structure and the checks that parse them,
:mod:`.reader` reads datasets lazily, :mod:`.writer` writes them (``dpu_pipe.pack``). The
writer reads any source and so sits above :mod:`dpu_pipe.sources`; it is not imported here,
which keeps ``sources`` → ``packed`` one-way.
"""

from .format import MANIFEST_NAME, VERSION
from .reader import PackedDataset, PackedShard, is_packed

__all__ = ["VERSION", "MANIFEST_NAME", "PackedDataset", "PackedShard", "is_packed"]
