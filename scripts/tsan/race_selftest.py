"""A known race through Python threads, for scripts/tsan/check.sh: two BatchProcessors (each
with its own kernel and decoder state) run from two threads at once into the same output
array, so the kernels of both write the same bytes unordered. TSAN must report it, or the run
cannot see the kernels' accesses (run through scripts/tsan/python.sh, from the checkout's
root)."""
import sys
import threading

import numpy as np

sys.path.insert(0, "tests")
import jpeg_corpus as jc  # noqa: E402
from dpu_pipe.kernel import BatchProcessor  # noqa: E402

data = [jc.pil_jpeg(jc.photo_sized(jc.PHOTOS[i % 3], 64, 64), quality=90) for i in range(4)]
makers = [BatchProcessor(num_threads=1) for _ in range(2)]
out = makers[0].empty(len(data))
start = threading.Barrier(2, timeout=60)


def run(bp):
    start.wait()
    for _ in range(3):
        bp.run(data, np.arange(len(data)), out=out)


threads = [threading.Thread(target=run, args=(bp,)) for bp in makers]
for t in threads:
    t.start()
for t in threads:
    t.join(120)
    assert not t.is_alive(), "a caller did not finish within 120 s"
