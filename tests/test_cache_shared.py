"""The decoded-sample cache shared between processes, as the producers of a node share theirs
(the MPI side is in tests/mpi/test_node_cache.py): a writer process SIGKILLed in the middle of a
fill never leaves an entry another process reads as whole; an evaluator with ``cache_bytes``
evaluates from its cache after the first run, with the same metrics; the test-only stall is
off unless its variable is set."""
import importlib.util
import mmap
import os
import signal
import time

import numpy as np
import pytest

from dpu_pipe import TransformConfig, _jpeg, _pipeline
from dpu_pipe.sources import ImageFolder

N = 16
S = 96
SIZE = 48
HAVE_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture(scope="module")
def data(photo_folder):
    return str(photo_folder(N, shape=(150, 7, 200, 5)))


def _batch(src, idx):
    return _jpeg.BufferList.from_buffers([src.read(int(i)) for i in idx])


def test_a_writer_killed_mid_fill_leaves_an_entry_nobody_reads(data, monkeypatch):
    """A forked process maps the parent's arena (as a producer maps its node's window) and
    starts storing sample 3, stalled with half its pixels copied
    (DPU_PIPE_TEST_FILL_STALL); it is SIGKILLed there. The entry stays FILLING: the parent's
    lookups take it for a miss, decode the sample, never store it, and the output is the
    uncached kernel's."""
    cfg = TransformConfig(size=SIZE, decode_max_side=S, dtype="uint8").to_dict()
    src = ImageFolder(data)
    idx = np.arange(N, dtype=np.int64)
    bufs = _batch(src, idx)
    ref = np.empty((N, 3, SIZE, SIZE), np.uint8)
    _pipeline.Pipeline(cfg, 1).run(bufs, idx, 0, 1, ref, np.zeros((N, 7), np.int32))
    m = mmap.mmap(-1, 1 << 22)
    parent = _pipeline.SampleCache(m, N)
    assert parent.stall_ms == 0      # off unless the variable is set
    pid = os.fork()
    if pid == 0:                     # the writer: stores samples 0.. and stalls on 3
        try:
            os.environ["DPU_PIPE_TEST_FILL_STALL"] = "3:600000"
            child = _pipeline.SampleCache(m, N, init=False)
            _pipeline.Pipeline(cfg, 1, child).run(_batch(src, idx[:5]), idx[:5], 0, 1,
                                                  np.empty((5, 3, SIZE, SIZE), np.uint8),
                                                  np.zeros((5, 7), np.int32))
        finally:
            os._exit(1)
    try:
        deadline = time.monotonic() + 60
        while parent.state(3) != 1:  # FILLING: the writer is in its stall
            assert time.monotonic() < deadline, "the writer never reached sample 3"
            time.sleep(0.01)
        assert [parent.state(i) for i in range(3)] == [2, 2, 2]
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert parent.state(3) == 1 and parent.sample(3) is None
    kernel = _pipeline.Pipeline(cfg, 2, parent)
    seen = []
    for _ in range(2):
        out = np.empty_like(ref)
        assert kernel.run(bufs, idx, 0, 1, out, np.zeros((N, 7), np.int32)) == {}
        assert np.array_equal(out, ref)
        seen.append(parent.stats())
    assert parent.state(3) == 1 and seen[-1]["entries"] == N - 1
    # The second pass: every sample a hit but the one left FILLING.
    assert seen[1]["hits"] - seen[0]["hits"] == N - 1
    assert seen[1]["misses"] - seen[0]["misses"] == 1


@pytest.mark.skipif(not HAVE_TORCH, reason="evaluation needs torch")
def test_evaluator_with_cache_bytes_evaluates_from_its_cache(data):
    """ShardEvaluator (what a producer runs for RemoteValidation) with cache_bytes: the
    metrics of every run equal the uncached evaluator's, and the second run is served from
    the cache (no new miss)."""
    import torch

    from dpu_pipe.evaluate import ShardEvaluator
    from dpu_pipe.models import resnet_tiny
    from dpu_pipe.weights import pack_state

    src = ImageFolder(data)
    torch.manual_seed(0)
    kw = {"classes": N, "width": 8, "seed": 1}
    weights = pack_state(resnet_tiny(**kw).state_dict())
    spec = {"source": src.spec(), "batch_size": 5, "rank": 0, "world_size": 1,
            "model": "dpu_pipe.models:resnet_tiny", "model_kwargs": kw, "topk": [1, 5],
            "num_threads": 1,
            "transform": TransformConfig(train=False, size=SIZE, decode_max_side=S).to_dict()}
    plain = ShardEvaluator().run(spec, weights)[0]
    cached = dict(spec, cache_bytes=1 << 22)
    ev = ShardEvaluator()
    runs = [ev.run(cached, weights)[0] for _ in range(2)]
    assert runs[0] == plain and runs[1] == plain and plain.count == N
    st = ev.cache_stats(cached)
    assert st["entries"] == N and st["misses"] == N and st["hits"] == N
    assert ShardEvaluator().cache_stats(spec) is None
