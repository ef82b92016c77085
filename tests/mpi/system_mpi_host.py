"""Host rank for the system-MPI check: DPULoader over the producers equals Loader, 2 epochs.
Prints one OK line per epoch; any mismatch raises (and python -m mpi4py aborts the job)."""
import sys

import numpy as np

from dpu_pipe import DPULoader, ImageFolder, Loader

src = ImageFolder(sys.argv[1])
remote = DPULoader(src, 8, size=48, seed=3, timeout=120)
local = Loader(src, 8, size=48, seed=3)
for epoch in range(2):
    got = [(x.copy(), y.copy()) for x, y in remote]
    want = [(x.copy(), y.copy()) for x, y in local]
    assert len(got) == len(want) == len(local)
    for (a, b), (c, d) in zip(got, want):
        assert np.array_equal(a, c) and np.array_equal(b, d)
    steps = remote.stats()["steps_per_producer"]
    print(f"OK epoch {epoch}: {len(got)} batches identical to Loader; steps per producer "
          f"{steps}", flush=True)
remote.close()
local.close()
