"""Step of ``scripts/gpu_check.sh``: how long a batch takes to reach the GPU by each path of
``dpu_pipe.device``, copies included, and whether the copy overlaps the training's compute.

    python scripts/gpu/copy_timing.py --result R.json [--batch 256] [--size 224] [--batches 20]

The batch (bfloat16, channels-last, as a GPU training run takes it, plus int64 labels) lies
in a stand-in for the RMA window: anonymous page-aligned memory registered in place with
``cudaHostRegister`` (:class:`~dpu_pipe.device.PinnedRegion` over
:class:`~dpu_pipe.device.CudaBackend`). Paths, interleaved batch by batch:

* ``window``: :class:`~dpu_pipe.device.DeviceStage` copies from the registered memory;
* ``staging``: the same, without the region: host copy into a pinned staging buffer first;
* ``pageable``: ``tensor.to("cuda")`` from ordinary memory (what a loader without pinning
  does), for scale.

Per path: the host time of the call (what the training loop waits for), the time until the
copy has completed (``torch.cuda.synchronize``), the copy stream's time (CUDA events), GB/s.
Checked: every path delivers the batch bit for bit; the window path's call returns before its
copy completes (asynchronous).

Overlap: a compute stream runs matrix products on batch k (calibrated to several times the
copy's length) while batch k+1 is sent; CUDA events on both streams give the two intervals,
and the share of the copy's interval inside the compute's must be >= ``--min-overlap`` for the
window and the staging paths. A control copy on the compute stream itself (serial by
construction) must show none, or the measurement is not to be trusted.
"""
import argparse
import math
import mmap
import os
import statistics
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import Checks, interval_overlap, summarize_ms, write_result  # noqa: E402

__all__ = ["WindowBatch", "time_paths", "stage_sender", "overlap_share"]


class WindowBatch:
    """A batch of ``batch`` bfloat16 channels-last images of ``size`` pixels and its int64
    labels, laid out in anonymous page-aligned memory as in a window slot, filled from
    ``seed``. :attr:`mem` is the whole memory (1-D uint8), :attr:`x` and :attr:`y` torch
    views of it ((B, 3, H, W) bfloat16 channels-last; (B,) int64)."""

    def __init__(self, torch, batch, size, seed=0):
        shape = (batch, size, size, 3)
        self.image_bytes = int(np.prod(shape)) * 2
        self.nbytes = self.image_bytes + 8 * batch
        pages = -(-self.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self._map = mmap.mmap(-1, pages)
        self.mem = np.frombuffer(self._map, np.uint8)
        rng = np.random.default_rng(seed)
        images = self.mem[:self.image_bytes].view(np.uint16).reshape(shape)
        # bfloat16 bit patterns of values in [-4, 4): finite, both signs.
        f = rng.uniform(-4, 4, shape).astype(np.float32)
        images[...] = (f.view(np.uint32) >> 16).astype(np.uint16)
        labels = self.mem[self.image_bytes:self.nbytes].view(np.int64)
        labels[:] = rng.integers(0, 1000, batch)
        self.x = torch.from_numpy(images).view(torch.bfloat16).permute(0, 3, 1, 2)
        self.y = torch.from_numpy(labels)

    def pageable_copy(self):
        """The batch again, in ordinary (pageable) memory."""
        return self.x.clone(), self.y.clone()


def _same(torch, out, ref):
    a = out.detach().to("cpu")
    return a.dtype == ref.dtype and tuple(a.shape) == tuple(ref.shape) and torch.equal(
        a.contiguous().view(torch.int16) if a.dtype == torch.bfloat16 else a,
        ref.contiguous().view(torch.int16) if ref.dtype == torch.bfloat16 else ref)


def time_paths(torch, paths, wb, batches, sync, event=None):
    """Time ``batches`` sends of the batch ``wb`` along each of ``paths``, interleaved batch
    by batch after one warm-up round. A path is a callable ``send(event)`` that starts the
    batch's way to the device and returns ``(images, labels, marks, finish)``: ``marks`` two
    timing events around the copy on its stream (None without ``event``), ``finish`` what to
    call once the copy is known to be complete (or None). ``sync()`` waits for every copy;
    ``event()`` makes a timing event (None: no stream times). Returns ({name: {"host_ms",
    "total_ms"[, "stream_ms"]: summaries}}, {name: delivered bit for bit}). Milliseconds."""
    times = {name: {"host_ms": [], "total_ms": [], "stream_ms": []} for name in paths}
    exact = {}
    for round_ in range(batches + 1):
        for name, send in paths.items():
            sync()
            t0 = time.perf_counter()
            x, y, marks, finish = send(event)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            if finish is not None:
                finish()
            if round_ == 0:
                exact[name] = _same(torch, x, wb.x) and _same(torch, y, wb.y)
                continue
            times[name]["host_ms"].append(1e3 * (t1 - t0))
            times[name]["total_ms"].append(1e3 * (t2 - t0))
            if marks is not None:
                times[name]["stream_ms"].append(marks[0].elapsed_time(marks[1]))
    out = {name: {k: summarize_ms(v) for k, v in t.items() if v} for name, t in times.items()}
    return out, exact


def overlap_share(compute, copy):
    """Share of the interval ``copy`` (start, end) inside ``compute``: 1.0 when the copy ran
    entirely while the compute did, 0.0 when they did not meet. A copy of no length counts
    as inside when its instant is."""
    length = copy[1] - copy[0]
    if length <= 0:
        return 1.0 if compute[0] <= copy[0] <= compute[1] else 0.0
    return interval_overlap(compute, copy) / length


def stage_sender(stage, wb):
    """A path for :func:`time_paths`: ``stage`` (a DeviceStage) sends ``wb``'s batch; its
    window copies are fenced once complete."""
    def send(event):
        marks = None
        if event is not None:
            marks = (event(), event())
            marks[0].record(stage.backend.stream)
        x, y = stage.send(wb.x, wb.y, wb.x.dtype)
        if marks is not None:
            marks[1].record(stage.backend.stream)
        return x, y, marks, stage.fence
    return send


def _paths(torch, dev, wb):
    """The three ways to the device (callables for :func:`time_paths`), the two stages and
    the registered region."""
    from dpu_pipe.device import CudaBackend, DeviceStage, PinnedRegion

    region = PinnedRegion(CudaBackend(torch, dev))
    if not region.attach(wb.mem):
        raise RuntimeError(f"registration refused: {region.reason}")
    window = DeviceStage(torch, dev, backend=CudaBackend(torch, dev))
    window.window = region
    staging = DeviceStage(torch, dev, backend=CudaBackend(torch, dev))
    px, py = wb.pageable_copy()

    def pageable(event):
        stream = torch.cuda.current_stream(dev)
        marks = None
        if event is not None:
            marks = (event(), event())
            marks[0].record(stream)
        x, y = px.to(dev), py.to(dev)
        if marks is not None:
            marks[1].record(stream)
        return x, y, marks, None

    paths = {"window": stage_sender(window, wb), "staging": stage_sender(staging, wb),
             "pageable": pageable}
    return paths, {"window": window, "staging": staging}, region


def measure_overlap(torch, dev, stages, wb, iters, copy_ms):
    """Overlap of the copy of batch k+1 with compute on batch k, for each stage and for the
    serial control. Returns {name: {"shares": [...], "compute_ms": summary,
    "copy_ms": summary}} and the matrix products per iteration."""
    event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    compute = torch.cuda.Stream(device=dev)
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.float16)
    b = torch.randn(n, n, device=dev, dtype=torch.float16)
    c = torch.empty(n, n, device=dev, dtype=torch.float16)

    def work(reps, batch):
        # One kernel per product: a few launches keep the host free to send the next batch.
        for _ in range(reps):
            torch.matmul(a, b, out=c)
        return c[0, 0].float() + batch.float().mean()

    with torch.cuda.stream(compute):
        work(2, wb.x.to(dev))                   # warm-up (kernels, cuBLAS handle)
        e0, e1 = event(), event()
        e0.record(compute)
        work(10, wb.x.to(dev))
        e1.record(compute)
    torch.cuda.synchronize()
    per_rep = max(e0.elapsed_time(e1) / 10, 1e-3)
    # The copy (and, staged, the host copy before it) must fit several times over.
    reps = max(5, math.ceil(max(20.0, 4 * copy_ms) / per_rep))

    def serial_send():
        x = wb.x.to(dev, non_blocking=True)
        return x, compute

    senders = {name: (lambda s=s: (s.send(wb.x, wb.y, wb.x.dtype)[0], s.backend.stream))
               for name, s in stages.items()}
    senders["serial control"] = serial_send
    result = {}
    for name, send in senders.items():
        shares, comp_ms, copy_ms_ = [], [], []
        with torch.cuda.stream(compute):
            prev = wb.x.to(dev)
            for _ in range(iters):
                torch.cuda.synchronize()
                ref, c0, c1, s0, s1 = (event() for _ in range(5))
                ref.record(compute)
                c0.record(compute)
                work(reps, prev)
                c1.record(compute)
                side = stages[name].backend.stream if name in stages else compute
                s0.record(side)
                prev, stream = send()
                s1.record(stream)
                torch.cuda.synchronize()
                if name in stages:
                    stages[name].fence()
                comp = (ref.elapsed_time(c0), ref.elapsed_time(c1))
                cp = (ref.elapsed_time(s0), ref.elapsed_time(s1))
                shares.append(overlap_share(comp, cp))
                comp_ms.append(comp[1] - comp[0])
                copy_ms_.append(cp[1] - cp[0])
        result[name] = {"shares": [round(s, 3) for s in shares],
                        "compute_ms": summarize_ms(comp_ms), "copy_ms": summarize_ms(copy_ms_)}
    return result, reps


def run(args, checks):
    import torch

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    wb = WindowBatch(torch, args.batch, args.size)
    paths, stages, region = _paths(torch, dev, wb)
    checks.add("the stand-in window is registered and pinned",
               region.nbytes == wb.mem.nbytes and torch.from_numpy(wb.mem).is_pinned(),
               f"{region.nbytes} bytes at {region.base:#x}")
    try:
        times, exact = time_paths(torch, paths, wb, args.batches, torch.cuda.synchronize,
                                  lambda: torch.cuda.Event(enable_timing=True))
        for name, ok in exact.items():
            checks.add(f"{name}: the batch arrives bit for bit", ok)
        checks.add("window path: copied from the registered memory, none staged",
                   stages["window"].staged == 0 and stages["window"].direct > 0
                   and stages["staging"].direct == 0,
                   f"window direct {stages['window'].direct} staged "
                   f"{stages['window'].staged}; staging path staged {stages['staging'].staged}")
        gb = wb.nbytes / 1e9
        for name, t in times.items():
            t["GB_per_s"] = round(gb / (t["total_ms"]["median"] / 1e3), 2)
        w = times["window"]
        checks.add("window path: the call returns before its copy completes (asynchronous)",
                   w["host_ms"]["median"] < 0.5 * w["stream_ms"]["median"],
                   f"host {w['host_ms']['median']} ms, copy stream {w['stream_ms']['median']} ms")
        copy_ms = max(times["staging"]["total_ms"]["median"], w["total_ms"]["median"])
        overlap, reps = measure_overlap(torch, dev, stages, wb, args.overlap_iters, copy_ms)
        for name, o in overlap.items():
            share = statistics.median(o["shares"])
            o["median_share"] = round(share, 3)
            if name == "serial control":
                checks.add("serial control: the measurement sees no overlap where there is "
                           "none", share <= 0.05, f"median share {share:.3f}")
            else:
                checks.add(f"{name}: the copy of batch k+1 overlaps compute on batch k",
                           share >= args.min_overlap,
                           f"median {share:.3f} of the copy inside the compute (>= "
                           f"{args.min_overlap}); copy {o['copy_ms']['median']} ms, compute "
                           f"{o['compute_ms']['median']} ms")
    finally:
        region.detach()
    return {"batch_bytes": wb.nbytes, "shape": [args.batch, 3, args.size, args.size],
            "dtype": "bfloat16 channels_last", "times": times, "overlap": overlap,
            "matmuls_per_iteration": reps}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--result", required=True, help="JSON record of this step")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batches", type=int, default=20, help="timed batches per path")
    ap.add_argument("--overlap-iters", type=int, default=8)
    ap.add_argument("--min-overlap", type=float, default=0.9,
                    help="share of the copy that must lie inside the compute")
    args = ap.parse_args(argv)
    checks = Checks()
    data, error = {}, None
    try:
        data = run(args, checks)
    except Exception as exc:  # noqa: BLE001 - reported as the step's failure
        error = traceback.format_exc()
        checks.add("ran to the end", False, f"{type(exc).__name__}: {exc}")
        print(error, file=sys.stderr, flush=True)
    bad = checks.failed()
    if data:
        t = data["times"]
        summary = (f"{data['batch_bytes'] / 1e6:.1f} MB batch: window "
                   f"{t['window']['total_ms']['median']} ms ({t['window']['GB_per_s']} GB/s), "
                   f"staging {t['staging']['total_ms']['median']} ms "
                   f"({t['staging']['GB_per_s']} GB/s), pageable "
                   f"{t['pageable']['total_ms']['median']} ms; overlap window "
                   f"{data['overlap']['window']['median_share']}, staging "
                   f"{data['overlap']['staging']['median_share']}")
    else:
        summary = bad[0]["detail"] if bad else "no data"
    if bad and data:
        summary = f"{len(bad)} check(s) failed: {bad[0]['name']}; " + summary
    write_result(args.result, "copy-timing", checks, summary, error=error, order=3, **data)
    for c in checks.items:
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}", flush=True)
    print(f"copy timing: {summary}", flush=True)
    return 0 if checks.ok else 1


if __name__ == "__main__":
    sys.exit(main())
