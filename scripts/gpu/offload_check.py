"""Step of ``scripts/gpu_check.sh``: DPULoader(device="cuda") offloading to 2 producer ranks,
batches copied to the GPU straight from the registered RMA window. The host side of::

    mpiexec -n 1 python -m mpi4py scripts/gpu/offload_check.py --data D --result R.json \\
          : -n 2 python -m mpi4py -m dpu_pipe.worker

Streams, each compared bit for bit with the same stream made by a local :class:`Loader` on the
CPU (numpy or CPU tensors), the device tensors of an epoch all kept and read only after it,
so a window slot handed back to the producers before its copy completed would show:

* uint8 CHW, batch 8, one slot: two epochs;
* bfloat16 channels-last, batch 16, three slots: one epoch — a larger batch, so the window is
  made again and registered anew;
* the first loader again (third epoch) in the new window;
* hybrid mode, one epoch: the producers' batches from the window, the host thread's staged.

Checked as well: ``stats()`` says ``device_path == "window"`` with no reason and counts every
offloaded batch as copied from the window, none staged; the registered region is the
transport's window memory, which CUDA reports as pinned; every region is unregistered once
the loaders are closed. ``--fake-device`` runs the same on ``tests/fake_device.py``'s runtime
(no GPU), for the check's own tests.
"""
import argparse
import logging
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import Checks, write_result  # noqa: E402

KW = dict(size=64, dtype="uint8", seed=11)
BIG = dict(size=96, dtype="bfloat16", memory_format="channels_last", seed=11)


class Runtime:
    """Where the device tensors live: the CUDA device, or the fake runtime (CPU tensors
    whose copies land late) of ``tests/fake_device.py``."""

    def __init__(self, torch, fake_delay=None, refuse=None):
        self.torch = torch
        self.fake = None
        if fake_delay is not None:
            sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
            from fake_device import FakeDevice

            self.fake = FakeDevice(delay=fake_delay, refuse=refuse)
        self.device_type = "cpu" if self.fake else "cuda"

    def attach(self, loader):
        """Give ``loader`` this runtime (before its first batch)."""
        if self.fake is not None:
            loader.out.backend = self.fake

    def synchronize(self):
        if self.fake is not None:
            self.fake.synchronize()
        else:
            self.torch.cuda.synchronize()

    def pinned(self, mem):
        """Whether the runtime sees ``mem`` (numpy) as page-locked host memory."""
        if self.fake is not None:
            return mem.ctypes.data in self.fake.registered
        return bool(self.torch.from_numpy(mem).is_pinned())


def _bits(torch, t):
    """A CPU tensor of ``t``'s raw bits, in logical (N, C, H, W) order."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t


def epoch_on_device(checks, torch, rt, loader, ref, where, channels_last=False):
    """One epoch of ``loader``, compared with ``ref`` (the local Loader's batches); returns
    the number of batches."""
    outs = [(x, y) for x, y in loader]
    rt.synchronize()
    problems = []
    if len(outs) != len(ref):
        problems.append(f"{len(outs)} batches, the Loader makes {len(ref)}")
    for j, ((x, y), (rx, ry)) in enumerate(zip(outs, ref)):
        if x.device.type != rt.device_type or y.device.type != rt.device_type:
            problems.append(f"step {j}: on {x.device}/{y.device}")
            continue
        if channels_last and not x.is_contiguous(memory_format=torch.channels_last):
            problems.append(f"step {j}: not channels_last")
        rx = rx if isinstance(rx, torch.Tensor) else torch.from_numpy(rx)
        ry = ry if isinstance(ry, torch.Tensor) else torch.from_numpy(ry)
        if x.dtype != rx.dtype or tuple(x.shape) != tuple(rx.shape):
            problems.append(f"step {j}: {x.dtype}{tuple(x.shape)}, the Loader gives "
                            f"{rx.dtype}{tuple(rx.shape)}")
            continue
        if not torch.equal(_bits(torch, y), _bits(torch, ry)):
            problems.append(f"step {j}: labels differ")
        a, b = _bits(torch, x), _bits(torch, rx)
        if not torch.equal(a, b):
            n = int((a != b).sum())
            problems.append(f"step {j}: {n} image values differ")
    checks.add(f"{where}: bit for bit the local Loader's stream", not problems,
               "; ".join(problems[:5]) or f"{len(outs)} batches")
    return len(outs)


def device_stats(loader):
    return {k: v for k, v in loader.stats().items() if k.startswith("device")}


def check_window(checks, rt, loader, transport, where, batches):
    s = device_stats(loader)
    checks.add(f"{where}: stats() says the registered window",
               s.get("device_path") == "window" and s.get("device_path_reason") is None
               and s.get("device_batches_from_window") == batches
               and s.get("device_batches_staged") == 0, str(s))
    region, mem = loader.out.window, transport.mem
    same = region is not None and (region.base, region.nbytes) == (mem.ctypes.data, mem.nbytes)
    checks.add(f"{where}: the registered region is the window",
               same and rt.pinned(mem),
               f"region {None if region is None else (region.base, region.nbytes)}, window "
               f"{(mem.ctypes.data, mem.nbytes)}, pinned {rt.pinned(mem)}")
    return s


def run(args, checks, torch):
    from dpu_pipe import DPULoader
    from dpu_pipe.offload.group import host_group, shutdown
    from dpu_pipe.sources import open_path

    from dpu_pipe import Loader

    rt = Runtime(torch, args.fake_device, args.fake_refuse)
    warned = []

    class Said(logging.Handler):
        def emit(self, record):
            warned.append(record.getMessage())

    logging.getLogger("dpu_pipe").addHandler(Said(logging.WARNING))
    src = open_path(args.data)
    one = dict(rank=0, world_size=1)    # the reference Loader's shard: the only host's

    def reference(batch, epochs, **kw):
        out = "torch" if kw.get("dtype") == "bfloat16" else "numpy"
        with Loader(src, batch, output=out, **one, **kw) as ref:
            def copy(v):
                return v.clone() if isinstance(v, torch.Tensor) else v.copy()
            return [[(copy(x), copy(y)) for x, y in ref] for _ in range(epochs)]

    ref = reference(8, 3, **KW)
    ref_big = reference(16, 1, **BIG)[0]
    stats = {}

    dl = DPULoader(src, 8, slots=1, device="cuda", **KW)
    rt.attach(dl)
    n = sum(epoch_on_device(checks, torch, rt, dl, ref[e], f"uint8 epoch {e}")
            for e in range(2))
    t = host_group().transport
    stats["uint8"] = check_window(checks, rt, dl, t, "uint8, 2 epochs", n)
    first_window = (t.mem.ctypes.data, t.mem.nbytes)

    big = DPULoader(src, 16, slots=3, device="cuda", **BIG)
    rt.attach(big)
    nb = epoch_on_device(checks, torch, rt, big, ref_big, "bfloat16 channels_last",
                         channels_last=True)
    t = host_group().transport
    checks.add("a larger batch made the window again", (t.mem.ctypes.data, t.mem.nbytes)
               != first_window, f"{first_window} -> {(t.mem.ctypes.data, t.mem.nbytes)}")
    stats["bfloat16"] = check_window(checks, rt, big, t, "bfloat16 channels_last", nb)
    n += epoch_on_device(checks, torch, rt, dl, ref[2], "uint8 epoch 2, in the new window")
    stats["uint8_again"] = check_window(checks, rt, dl, t, "uint8, 3 epochs", n)
    big.close()
    dl.close()

    hy = DPULoader(src, 8, mode="hybrid", host_threads=1, slots=1, device="cuda", **KW)
    rt.attach(hy)
    nh = epoch_on_device(checks, torch, rt, hy, ref[0], "hybrid epoch 0")
    s = hy.stats()
    by_host = s["steps_per_producer"].get("0", 0)
    stats["hybrid"] = device_stats(hy)
    checks.add("hybrid: producers' batches from the window, the host thread's staged",
               s["device_path"] == "window" and s["device_batches_staged"] == by_host
               and s["device_batches_from_window"] == nh - by_host,
               f"{stats['hybrid']}, host thread made {by_host}")
    region = hy.out.window
    hy.close()
    shutdown()
    checks.add("the window unregistered once the loaders closed", region.nbytes == 0,
               f"region still holds {region.nbytes} bytes" if region.nbytes else "")
    if rt.fake is not None:
        checks.add("the runtime holds no registration", not rt.fake.registered,
                   str(rt.fake.registered))
    pinned_said = [m for m in warned if "pinned" in m]
    checks.add("no registration refused", not pinned_said, "; ".join(pinned_said))
    return stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="an ImageFolder (common.make_image_folder)")
    ap.add_argument("--result", required=True, help="JSON record of this step")
    ap.add_argument("--fake-device", type=float, default=None, metavar="DELAY",
                    help="tests/fake_device.py's runtime, copies landing DELAY s late")
    ap.add_argument("--fake-refuse", default=None, metavar="TEXT",
                    help="with --fake-device: registration refused with TEXT")
    args = ap.parse_args(argv)
    import torch

    checks = Checks()
    t0 = time.monotonic()
    stats, error = {}, None
    try:
        stats = run(args, checks, torch)
    except Exception as exc:  # noqa: BLE001 - reported as the step's failure
        error = traceback.format_exc()
        checks.add("ran to the end", False, f"{type(exc).__name__}: {exc}")
        print(error, file=sys.stderr, flush=True)
    seconds = round(time.monotonic() - t0, 2)
    bad = checks.failed()
    summary = (f"{len(checks.items)} checks passed in {seconds} s" if not bad
               else f"{len(bad)} of {len(checks.items)} checks failed: {bad[0]['name']}")
    write_result(args.result, "offload", checks, summary, stats=stats, seconds=seconds,
                 error=error, order=2)
    for c in checks.items:
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}", flush=True)
    print(f"offload: {summary}", flush=True)
    if error is not None:
        # python -m mpi4py turns this into MPI_Abort: the producers do not wait for a host
        # that will never release them.
        raise SystemExit(1)
    return 0 if checks.ok else 1


if __name__ == "__main__":
    sys.exit(main())
