"""Typed producer stats: StepStats add field by field, and a DPULoader's stats() count the
batches made by every host-thread producer it owns, not only its first one (no MPI: the
producers are driven directly, as hybrid host threads drive them)."""
import dataclasses

import numpy as np
import pytest

from dpu_pipe.offload.host import DPULoader
from dpu_pipe.sources import FileList
from dpu_pipe.steps import StepStats

import jpeg_corpus as jc

N = 12


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("stats")
    paths = []
    for i in range(N):
        p = str(root / f"{i:02d}.jpg")
        jc.write_file(p, jc.pil_jpeg(jc.photo_sized(jc.PHOTOS[i % 3], 64 + i, 80), quality=90))
        paths.append((p, i))
    return FileList(paths)


def test_step_stats_add_every_field():
    a = StepStats(read_s=0.5, process_s=1.0, batches=2, samples=8, other_formats=1)
    b = StepStats(read_s=0.25, process_s=2.0, batches=3, samples=11, other_formats=0)
    total = a + b
    assert total == StepStats(read_s=0.75, process_s=3.0, batches=5, samples=19,
                              other_formats=1)
    assert set(total.as_dict()) == {f.name for f in dataclasses.fields(StepStats)}
    assert a == StepStats(read_s=0.5, process_s=1.0, batches=2, samples=8, other_formats=1)


def test_stats_count_every_host_thread_producer(files):
    with DPULoader(files, 4, mode="local", size=32, dtype="uint8", seed=3) as dl:
        lay = dl.layout
        made = 0
        for k, step in ((0, 0), (1, 1), (2, 2)):
            prod = dl.host_producer(k)
            assert (prod is dl.producer) == (k == 0)
            buf = np.zeros(dl.payload_bytes, np.uint8)
            images, labels, indices = lay.views(buf, lay.batch_size)
            made += prod.produce(0, step, images, labels, indices)
        assert dl.host_producer(2) is dl.host_producer(2)      # one per thread, kept
        s = dl.stats()
        assert made == N
        assert s["samples"] == N and s["batches"] == 3
        parts = [dl.host_producer(k).stats for k in range(3)]
        assert s["read_s"] == pytest.approx(sum(p.read_s for p in parts))
        assert s["process_s"] == pytest.approx(sum(p.process_s for p in parts))
        # The host threads share one record of bad samples with the loader.
        assert all(dl.host_producer(k).bad_samples is dl.producer.bad_samples
                   for k in range(3))
