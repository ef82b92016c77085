"""A known race through Python threads, for scripts/tsan/check.sh: one BatchProcessor run
from two threads at once. Its kernel keeps one decoder state per OpenMP thread, not per
caller, so both callers write the same state: TSAN must report it, or the run cannot see the
kernels' accesses (run through scripts/tsan/python.sh, from the checkout's root). If
BatchProcessor ever serialises its callers, this needs another shared kernel."""
import sys
import threading

import numpy as np

sys.path.insert(0, "tests")
import jpeg_corpus as jc  # noqa: E402
from dpu_pipe.batch import BatchProcessor  # noqa: E402

data = [jc.pil_jpeg(jc.photo_sized(jc.PHOTOS[i % 3], 64, 64), quality=90) for i in range(4)]
bp = BatchProcessor(num_threads=1)
start = threading.Barrier(2, timeout=60)


def run():
    start.wait()
    for _ in range(10):
        bp.run(data, np.arange(len(data)))


threads = [threading.Thread(target=run) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join(120)
    assert not t.is_alive(), "a caller did not finish within 120 s"
