"""Loader throughput: the local Loader (num_threads 1 and 2) against the usual DataLoader path
done by hand without torch (Pillow decode + RandomResizedCrop with the same boxes + flip +
numpy normalize, in a thread pool and in a process pool of 1 and 2 workers), and the Loader's
overhead over the raw batch kernel — one interleaved run, see
``bench_loader.loader_benchmark``. The table is printed; timings are never asserted.

The session is pinned to one core (conftest.py); the benchmark widens the affinity to every
core for its own run and restores it afterwards. ``DPU_PIPE_BENCH_N`` sets the images per
epoch (default 200). That the Pillow baseline makes the kernel's images is checked in
tests/test_bench_scripts.py.
"""


import bench_loader
from conftest import _bench_n

BATCH = 32


def test_loader_throughput(imagenet_like, capsys):
    n = _bench_n()
    result = bench_loader.loader_benchmark(imagenet_like[0], n=n, batch_size=min(BATCH, n),
                                    size=224, threads=(1, 2), repeat=3)
    table = bench_loader.format_loader_table(result)
    with capsys.disabled():
        print("\n\nLoader throughput (ImageNet-like sample dataset)\n" + table + "\n")
    methods = {(r["method"], r["workers"]) for r in result["rows"]}
    assert methods == {(m, k) for m in bench_loader.LOADER_METHODS for k in (1, 2)}
    assert all(r["img_per_s"] > 0 for r in result["rows"])
    assert [o["workers"] for o in result["overhead"]] == [1, 2]
