"""Host side of the device scenarios, run under mpiexec (MPMD) by ``test_device_offload.py``::

    mpiexec -n 1 python -m mpi4py tests/mpi/device_host.py --data D --out O \\
          [--refuse TEXT | --real] \\
          : -n 2 python -m mpi4py -m dpu_pipe.worker

DPULoaders with ``device="cuda"`` on the fake device runtime of ``tests/fake_device.py``,
whose copies complete ``--copy-delay`` seconds after they start and read their source when
they complete. Every delivered device tensor is compared with the local Loader's stream.

Without ``--refuse`` the runtime registers memory: a loader of batch 4 and one slot runs two
epochs, a loader of batch 6 and three slots makes the window again (resize) and runs one,
then the first loader a third epoch in the new window; every copy must read the window
registered at the time, no staging buffer may exist, no copy's source may change before the
copy completed, and each window must be unregistered once, while it still exists. Then one
hybrid epoch: batches of the producers from the window, of the host threads staged. With
``--refuse TEXT`` registration fails with TEXT: two epochs through staging buffers, the reason
logged once and reported by ``stats()``. With ``--real``: two epochs on the CUDA device.

Writes ``<out>/host0.json`` and prints ``OK host=0`` on success.
"""
import argparse
import logging
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))    # fake_device

from offload_host import Warnings, check_same, reference_epochs, write_json  # noqa: E402


def epoch_on_device(dl, dev, ref, where):
    """One epoch of ``dl``: the device tensors are kept, read only after the epoch (so a
    copy still in flight when its slot went back would read the next batch), then compared
    with ``ref``. Returns the copies of the epoch."""
    first = len(dev.copies)
    outs = [(x, y) for x, y in dl]
    dev.synchronize()
    assert len(outs) == len(ref), (where, len(outs), len(ref))
    for j, (x, y) in enumerate(outs):
        check_same((x, y), ref[j], f"{where} step {j}")
    copies = dev.copies[first:]
    assert len(copies) == 2 * len(ref), (where, len(copies))     # images, labels
    late = [c for c in copies if c.event.overwritten]
    assert not late, (f"{where}: {len(late)} copies whose source was overwritten before they "
                      f"completed")
    return copies


def run(args):
    from dpu_pipe import DPULoader
    from dpu_pipe.offload.group import host_group, shutdown
    from dpu_pipe.sources import open_path
    from fake_device import FakeDevice

    warnings = Warnings()
    logging.getLogger("dpu_pipe").addHandler(warnings)
    src = open_path(args.data)
    kw = dict(size=32, dtype="uint8", seed=11)
    one = dict(rank=0, world_size=1)    # the reference Loader's shard: the only host's
    alive = []

    def window_alive(ptr):
        t = host_group().transport
        alive.append(t.win is not None and t.mem is not None and t.mem.ctypes.data == ptr)

    ref = reference_epochs(src, 4, 3, **one, **kw)
    if args.real:
        return run_real(src, ref, kw)
    dev = FakeDevice(delay=args.copy_delay, refuse=args.refuse, on_unregister=window_alive)
    dl = DPULoader(src, 4, slots=1, device="cuda", **kw)
    dl.out.backend = dev
    result = {}
    if args.refuse:
        for e in range(2):
            copies = epoch_on_device(dl, dev, ref[e], f"refused, epoch {e}")
            assert all(dev.in_staging(c) for c in copies), "a copy did not read a staging buffer"
        s = dl.stats()
        said = [m for m in warnings.messages if "pinned in place" in m]
        result.update(stats={k: v for k, v in s.items() if k.startswith("device")},
                      said=said, staging_buffers=len(dev.pinned))
    else:
        windows = []

        def in_window(copies, where):
            mem = host_group().transport.mem
            window = (mem.ctypes.data, mem.nbytes)
            region = dl.out.window
            assert (region.base, region.nbytes) == window, \
                f"{where}: registered {region.base, region.nbytes} ({region.reason}), " \
                f"the window is {window}"
            outside = [c for c in copies if not c.inside(*window)]
            assert not outside, f"{where}: {len(outside)} copies not from the window"
            if window not in windows:
                windows.append(window)

        waited = 0
        for e in range(2):
            copies = epoch_on_device(dl, dev, ref[e], f"slots=1 epoch {e}")
            in_window(copies, f"slots=1 epoch {e}")
            waited += sum(c.event.early_queries > 0 for c in copies)
        big = DPULoader(src, 6, slots=3, device="cuda", **kw)
        big.out.backend = dev
        ref_big = reference_epochs(src, 6, 1, **one, **kw)[0]
        copies = epoch_on_device(big, dev, ref_big, "after the resize, batch 6")
        in_window(copies, "after the resize, batch 6")
        copies = epoch_on_device(dl, dev, ref[2], "after the resize, slots=1 epoch 2")
        in_window(copies, "after the resize, slots=1 epoch 2")
        s, sb = dl.stats(), big.stats()
        big.close()
        dl.close()
        assert not dev.pinned, f"{len(dev.pinned)} staging buffers were made"
        # Hybrid: batches of the producers from the window, those of host threads staged.
        hy = DPULoader(src, 4, mode="hybrid", host_threads=1, slots=1, device="cuda", **kw)
        hy.out.backend = dev
        copies = epoch_on_device(hy, dev, ref[0], "hybrid epoch 0")
        sh = hy.stats()
        region = hy.out.window
        from_window = sum(c.inside(region.base, region.nbytes) for c in copies)
        staged = sum(dev.in_staging(c) for c in copies)
        assert from_window + staged == len(copies), (from_window, staged, len(copies))
        by_host = sh["steps_per_producer"].get("0", 0)
        assert (sh["device_batches_staged"], sh["device_batches_from_window"]) == \
            (by_host, len(ref[0]) - by_host) == (staged // 2, from_window // 2), sh
        hy.close()
        result.update(stats={k: v for k, v in s.items() if k.startswith("device")},
                      big_stats={k: v for k, v in sb.items() if k.startswith("device")},
                      hybrid_by_host=by_host, windows=windows, fence_waited=waited,
                      said=[m for m in warnings.messages if "pinned" in m])
    dl.close()
    shutdown()
    result.update(log=[list(e) for e in dev.log], alive=alive, registered=len(dev.registered))
    return result


def run_real(src, ref, kw):
    """Two epochs on the CUDA device, compared with the Loader's stream."""
    import torch
    from dpu_pipe import DPULoader
    from dpu_pipe.offload.group import shutdown

    dl = DPULoader(src, 4, slots=1, device="cuda", **kw)
    for e in range(2):
        outs = [(x, y) for x, y in dl]
        torch.cuda.synchronize()
        assert len(outs) == len(ref[e])
        for j, (x, y) in enumerate(outs):
            assert x.device.type == y.device.type == "cuda", (x.device, y.device)
            check_same((x.cpu(), y.cpu()), ref[e][j], f"cuda epoch {e} step {j}")
    s = dl.stats()
    dl.close()
    shutdown()
    return {"stats": {k: v for k, v in s.items() if k.startswith("device")}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--copy-delay", type=float, default=0.03, help="fake copy time, s")
    ap.add_argument("--refuse", default=None, help="registration fails with this message")
    ap.add_argument("--real", action="store_true", help="the CUDA device, no fake")
    args = ap.parse_args()
    t0 = time.monotonic()
    result = run(args)
    result["elapsed"] = round(time.monotonic() - t0, 3)
    write_json(os.path.join(args.out, "host0.json"), result)
    print(f"OK host=0 elapsed={result['elapsed']:.2f}s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
