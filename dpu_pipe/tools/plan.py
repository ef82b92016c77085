"""``dpu-pipe plan``: how many producer cores, how much memory and bandwidth a host needs to
feed its training at a given rate, and what a decoded-sample cache changes
(docs/guides/cli.md explains every figure, and how to find ``--arm-factor``).

A producer core's rate is ``--producer-rate`` (or ``--measure``: the batch kernel timed on one
core of *this* machine over a sample of ``--data``) × ``--arm-factor``, the producer core's
speed relative to that one.
"""

import json
import math
import os
import resource
import time

from .. import _validate as _v
from ..errors import ConfigError, DecodeError

__all__ = ["PRESETS", "plan", "cache_plan", "measure_kernel", "measure_cache", "cpu_name",
           "add_args", "run"]

GiB = 1 << 30

#: DPU presets: Arm cores available to producers, and memory (bytes).
PRESETS = {
    "bluefield2": {"name": "BlueField-2", "cores": 8, "core": "Cortex-A72",
                   "memory_bytes": 16 * GiB},
    "bluefield3": {"name": "BlueField-3", "cores": 16, "core": "Cortex-A78",
                   "memory_bytes": 32 * GiB},
}

#: Mean encoded size of an ImageNet-1k training JPEG (~140 GB / 1.28 M images), used when
#: no --data is measured and no --jpeg-bytes given.
IMAGENET_JPEG_BYTES = 110_000


def _rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _passes(sample, transform, passes, cache=None):
    """Seconds of each pass (epoch) of the one-thread batch kernel over a :func:`_sample`."""
    from ..kernel import BatchProcessor

    idx, bufs, src = sample
    proc = BatchProcessor(transform, 1, cache)
    times = []
    for epoch in range(passes):
        t = time.perf_counter()
        errors = proc.run(bufs, idx, epoch=epoch, seed=0)[2]
        times.append(time.perf_counter() - t)
        if errors:
            j = min(errors)
            raise DecodeError(f"--data: cannot time the kernel on an undecodable sample: "
                              f"{errors[j]}", index=int(idx[j]), path=src.describe(int(idx[j])))
    return times


def measure_kernel(data, *, images=200, size=224, dtype="float32", repeat=3):
    """Time the training batch kernel (RandomResizedCrop + flip + normalize) on one core of
    this machine over ``images`` samples of the dataset at ``data`` (spread over it).

    Returns ``{"rate_per_core": img/s (best of ``repeat`` passes), "images", "mean_jpeg_bytes",
    "kernel_memory_bytes": peak RSS the passes added to this process}``.
    """
    from ..transforms import TransformConfig

    sample = _sample(data, images)
    n = len(sample[1])
    before = _rss_bytes()
    times = _passes(sample, TransformConfig(train=True, size=size, dtype=dtype), repeat)
    return {"rate_per_core": n / min(times), "images": n,
            "mean_jpeg_bytes": sum(map(len, sample[1])) / n,
            "kernel_memory_bytes": max(0, _rss_bytes() - before)}


def measure_cache(data, max_side, *, images=200, size=224, dtype="float32", repeat=3):
    """Time the training batch kernel with ``decode_max_side=max_side`` and a cache on one
    core over ``images`` samples of ``data``: a cold pass (every sample decoded whole,
    reduced and stored) and warm passes (every sample cut from the cache, the best of
    ``repeat - 1``), and the reduced sizes.

    Returns ``{"miss_rate": img/s cold, "hit_rate": img/s warm, "bytes_per_sample": mean
    reduced bytes, "images"}``.
    """
    from ..cache import DecodedCache, table_bytes
    from ..transforms import TransformConfig

    sample = _sample(data, images)
    n, count = len(sample[1]), len(sample[2])
    cache = DecodedCache(table_bytes(count) + sum(map(len, sample[1])) * 64 + (1 << 20), count)
    transform = TransformConfig(train=True, size=size, dtype=dtype, decode_max_side=max_side)
    times = _passes(sample, transform, max(2, repeat), cache)
    st = cache.stats()
    return {"miss_rate": n / times[0], "hit_rate": n / min(times[1:]),
            "bytes_per_sample": st["bytes"] / max(1, st["entries"]), "images": n}


def cache_plan(*, cache_bytes, max_side, shard_samples, num_samples=None,
               bytes_per_sample=None, miss_rate, hit_rate, train_rate=None, arm_factor=1.0,
               headroom=0.1):
    """How much of a node's shard a decoded-sample cache holds, and the rate that gives: a
    sample takes its reduced pixels plus its alignment padding, the table ``ENTRY_BYTES`` per
    sample of the dataset; from epoch 2 on the fraction ``f`` that fits is served from the
    cache, so a core makes ``1 / (f / hit_rate + (1 - f) / miss_rate)`` img/s. Invalid values
    raise a ConfigError naming the option.

    Parameters
    ----------
    cache_bytes, max_side, shard_samples : int
        The node cache's bytes (``cache_bytes``), its ``decode_max_side`` in pixels, and the
        samples the node's producers read each epoch.
    num_samples : int, optional
        Samples of the dataset (one table entry each); default ``shard_samples``.
    bytes_per_sample : float, optional
        Mean reduced pixels' bytes; default a 4:3 image at ``max_side``.
    miss_rate, hit_rate : float
        img/s of one core (where measured) on a decoded / a cached sample.
    train_rate : float, optional
        img/s the host trains at: then the producer cores the steady state needs.
    arm_factor, headroom : float
        Producer core speed / the measuring core's; spare producer capacity, a fraction.

    Returns
    -------
    dict
        Bytes, counts, the fraction cached and img/s per producer core (epoch 1, later).
    """
    from ..cache import ALIGN, ENTRY_BYTES, table_bytes

    cache_bytes = _v.positive_int(cache_bytes, "--cache-bytes")
    max_side = _v.positive_int(max_side, "--max-side")
    shard_samples = _v.positive_int(shard_samples, "--shard-samples")
    num_samples = shard_samples if num_samples is None else _v.positive_int(num_samples,
                                                                             "num_samples")
    if bytes_per_sample is None:
        bytes_per_sample = max_side * round(max_side * 3 / 4) * 3
    miss_rate = _v.number(miss_rate, "--miss-rate", 0, low_open=True)
    hit_rate = _v.number(hit_rate, "--hit-rate", 0, low_open=True)
    table = table_bytes(num_samples)
    # Each sample is stored at an ALIGN-aligned offset: half an alignment unit of padding on
    # average.
    per_sample = bytes_per_sample + (ALIGN - 1) / 2
    fit = max(0, min(shard_samples, int((cache_bytes - table) // per_sample)))
    f = fit / shard_samples
    later = 1.0 / (f / hit_rate + (1 - f) / miss_rate)
    out = {"cache_bytes": cache_bytes, "max_side": max_side, "shard_samples": shard_samples,
           "table_bytes": table, "entry_bytes": ENTRY_BYTES,
           "bytes_per_sample": bytes_per_sample, "samples_fit": fit, "fraction_cached": f,
           "bytes_for_whole_shard": table + math.ceil(per_sample * shard_samples),
           "miss_rate": miss_rate, "hit_rate": hit_rate,
           "rate_per_core_first_epoch": miss_rate * arm_factor,
           "rate_per_core_later": later * arm_factor}
    if train_rate is not None:
        out["producer_cores_later"] = math.ceil(round(
            train_rate * (1 + headroom) / (later * arm_factor), 9))
    return out


def _sample(data, images):
    """(indices, encoded bytes, source) of ``images`` samples spread over the dataset."""
    import numpy as np

    from ..sources import open_path

    images = _v.positive_int(images, "--images")
    src = open_path(data)
    idx = np.unique(np.linspace(0, len(src) - 1, min(images, len(src))).astype(np.int64))
    return idx, [src.read(int(i)) for i in idx], src


def plan(*, train_rate, producer_rate, batch=256, size=224, dtype="float32", arm_factor=1.0,
         preset=None, headroom=0.1, jpeg_bytes=IMAGENET_JPEG_BYTES, process_bytes=0,
         kernel_memory_bytes=None, slots=None):
    """The capacity plan of one host: producer cores ``ceil(train_rate × (1 + headroom) /
    (producer_rate × arm_factor))``; the window's slots and bytes (a slot holds the transport's
    payload of ``batch`` samples); each producer rank's memory (process + batch buffers +
    kernel); bandwidth to the host and from the dataset; with a preset, the DPUs per host.

    ``train_rate``: images/s the host trains at; ``producer_rate``: images/s of one core
    where it was measured; ``arm_factor``: producer core speed / that core's speed;
    ``preset``: a key of :data:`PRESETS` or None; ``headroom``: spare producer capacity as
    a fraction; ``jpeg_bytes``: mean encoded image size; ``process_bytes``: one producer
    process's memory before its buffers; ``kernel_memory_bytes``: the kernel's working
    memory, when measured; ``slots``: the window's slots, default one per producer core + 2.
    Returns a dict of plain numbers (bytes, bytes/s, images/s).
    """
    from ..offload.wire import PayloadLayout, image_shapes
    from ..transforms import TransformConfig

    train_rate = _v.number(train_rate, "--train-rate", 0, low_open=True)
    producer_rate = _v.number(producer_rate, "--producer-rate", 0, low_open=True)
    arm_factor = _v.number(arm_factor, "--arm-factor", 0, low_open=True)
    batch = _v.positive_int(batch, "--batch")
    jpeg_bytes = _v.number(jpeg_bytes, "--jpeg-bytes", 0, low_open=True)
    headroom = _v.number(headroom, "--headroom", 0, 10)
    if preset is not None:
        _v.choice(preset, "--preset", tuple(PRESETS))
    transform = TransformConfig(train=True, size=size, dtype=dtype)
    sample_bytes = transform.sample_bytes

    core_rate = producer_rate * arm_factor
    # rounded first: 1000 * 1.1 / 50 is 22.000000000000004 in binary floating point
    cores = math.ceil(round(train_rate * (1 + headroom) / core_rate, 9))
    # A producer writes into the slot it claimed: one slot per producer (a batch in flight
    # each) + 2 (the batch training holds, one ready ahead), or producers idle (6 producers on
    # 3 slots deliver 0.52x the ideal rate).
    slots = cores + 2 if slots is None else _v.positive_int(slots, "--slots")
    layout = PayloadLayout(batch, image_shapes(transform), transform.np_dtype)
    slot = layout.nbytes
    buffers = layout.end(batch)     # a producer's batch buffer: the payload before its report
    per_rank = process_bytes + buffers + (kernel_memory_bytes or 0)
    out = {
        "inputs": {"train_rate": train_rate, "producer_rate": producer_rate,
                   "arm_factor": arm_factor, "batch": batch, "size": size, "dtype": dtype,
                   "headroom": headroom, "jpeg_bytes": jpeg_bytes, "preset": preset},
        "sample_bytes": sample_bytes,
        "producer_core_rate": core_rate,
        "producer_cores": cores,
        "producer_capacity": cores * core_rate,
        "batch_seconds_per_core": batch / core_rate,
        "slots": slots,
        "slot_bytes": slot,
        "window_bytes": slots * slot,
        "producer_rank_bytes": per_rank,
        "producer_rank_parts": {"process": process_bytes, "batch_buffers": buffers,
                                "kernel": kernel_memory_bytes},
        "producer_memory_bytes": cores * per_rank,
        "to_host_bytes_per_s": train_rate * (sample_bytes + 16),
        "dataset_read_bytes_per_s": train_rate * jpeg_bytes,
    }
    if preset is not None:
        p = PRESETS[preset]
        ranks_per_dpu = min(cores, p["cores"])
        out["dpu"] = {**p, "dpus_per_host": math.ceil(cores / p["cores"]),
                      "rate_per_dpu": p["cores"] * core_rate,
                      "ranks_per_dpu": ranks_per_dpu,
                      "memory_per_dpu_bytes": ranks_per_dpu * per_rank,
                      "memory_share": ranks_per_dpu * per_rank / p["memory_bytes"]}
    return out


def format_plan(p):
    """The plan as lines of text for the terminal."""
    i = p["inputs"]
    mb = 1e6
    lines = [
        f"training at {i['train_rate']:.0f} img/s, batch {i['batch']}, {i['size']} px "
        f"{i['dtype']} ({p['sample_bytes']} bytes per sample)",
        f"producer core: {i['producer_rate']:.1f} img/s measured x arm factor "
        f"{i['arm_factor']:g} = {p['producer_core_rate']:.1f} img/s "
        f"({p['batch_seconds_per_core']:.2f} s per batch)",
        f"producer cores per host:  {p['producer_cores']}  "
        f"(capacity {p['producer_capacity']:.0f} img/s, headroom {i['headroom']:.0%})",
    ]
    if "dpu" in p:
        d = p["dpu"]
        lines.append(f"{d['name']} ({d['cores']} x {d['core']}, {d['memory_bytes'] / GiB:.0f} "
                     f"GiB): {d['dpus_per_host']} per host, one sustains "
                     f"{d['rate_per_dpu']:.0f} img/s; {d['ranks_per_dpu']} producer ranks use "
                     f"{d['memory_per_dpu_bytes'] / mb:.0f} MB ({d['memory_share']:.1%} of "
                     f"its memory)")
    parts = p["producer_rank_parts"]
    kernel = ("not measured (--measure)" if parts["kernel"] is None
              else f"{parts['kernel'] / mb:.0f} MB kernel")
    if "cache" in p:
        c = p["cache"]
        lines.append(
            f"decoded cache: {c['cache_bytes'] / mb:.0f} MB at max side {c['max_side']} "
            f"({c['bytes_per_sample'] / 1e3:.1f} kB per sample, table {c['table_bytes'] / mb:.1f}"
            f" MB at {c['entry_bytes']} B per sample) holds {c['samples_fit']} of "
            f"{c['shard_samples']} samples ({c['fraction_cached']:.0%}; the whole shard needs "
            f"{c['bytes_for_whole_shard'] / mb:.0f} MB); a producer core makes "
            f"{c['rate_per_core_first_epoch']:.0f} img/s in epoch 1, "
            f"{c['rate_per_core_later']:.0f} after"
            + (f": {c['producer_cores_later']} cores" if "producer_cores_later" in c else ""))
    lines += [
        f"slots: {p['slots']} of {p['slot_bytes'] / mb:.1f} MB -> host window "
        f"{p['window_bytes'] / mb:.0f} MB",
        f"producer memory per rank: {p['producer_rank_bytes'] / mb:.0f} MB "
        f"({parts['process'] / mb:.0f} MB process + {parts['batch_buffers'] / mb:.0f} MB "
        f"batch buffers + {kernel}); all ranks {p['producer_memory_bytes'] / mb:.0f} MB",
        f"network per host: batches to the host {p['to_host_bytes_per_s'] / mb:.0f} MB/s "
        f"({p['to_host_bytes_per_s'] * 8 / 1e9:.2f} Gbit/s); dataset reads "
        f"{p['dataset_read_bytes_per_s'] / mb:.0f} MB/s "
        f"({p['dataset_read_bytes_per_s'] * 8 / 1e9:.2f} Gbit/s)",
    ]
    return "\n".join(lines)


def add_args(p):
    p.add_argument("--train-rate", type=float, required=True, metavar="IMG_S",
                   help="images/s one host's training consumes")
    p.add_argument("--batch", type=int, default=256, help="batch size (default: 256)")
    p.add_argument("--size", type=int, default=224, help="output size in pixels (default: 224)")
    p.add_argument("--dtype", choices=("float32", "float16", "uint8"), default="float32",
                   help="batch element type (default: float32)")
    rate = p.add_mutually_exclusive_group(required=True)
    rate.add_argument("--producer-rate", type=float, metavar="IMG_S_PER_CORE",
                      help="images/s of the batch kernel on one core")
    rate.add_argument("--measure", action="store_true",
                      help="time the batch kernel on one core of this machine over --data")
    p.add_argument("--data", help="dataset to measure (ImageFolder, file list or packed "
                                  "file); also gives the mean JPEG size")
    p.add_argument("--images", "-n", type=int, default=200,
                   help="samples of --data to time (default: 200)")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="DPU model: BlueField-2 (8 x A72, 16 GiB), BlueField-3 (16 x A78, "
                        "32 GiB)")
    p.add_argument("--arm-factor", type=float, metavar="F",
                   help="producer core speed / speed of the core the rate was measured on "
                        "(required with --preset; see docs/guides/cli.md)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="spare producer capacity, a fraction (default: 0.1)")
    p.add_argument("--slots", type=int,
                   help="slots of the host's window (default: producer cores + 2)")
    p.add_argument("--jpeg-bytes", type=float,
                   help=f"mean JPEG size when --data is not given (default: "
                        f"{IMAGENET_JPEG_BYTES}, ImageNet-1k train)")
    p.add_argument("--cache-bytes", type=float, metavar="BYTES",
                   help="model a decoded-sample cache of this size per node (with --max-side)")
    p.add_argument("--max-side", type=int, metavar="S",
                   help="decode_max_side of the cache model, pixels")
    p.add_argument("--shard-samples", type=int, metavar="N",
                   help="samples a node reads per epoch (default: the --data set's)")
    p.add_argument("--miss-rate", type=float, metavar="IMG_S_PER_CORE",
                   help="a core's rate on samples decoded with --max-side (default: the "
                        "producer rate; measured with --measure)")
    p.add_argument("--hit-rate", type=float, metavar="IMG_S_PER_CORE",
                   help="a core's rate on cached samples (measured with --measure)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args):
    if args.preset is not None and args.arm_factor is None:
        raise ConfigError("--preset needs --arm-factor: the speed of one DPU core relative to "
                          "the core --producer-rate/--measure timed (1 if measured on the DPU)")
    if args.measure and not args.data:
        raise ConfigError("--measure needs --data: the dataset whose images are timed")
    arm_factor = 1.0 if args.arm_factor is None else args.arm_factor
    # What a producer process has imported (the worker brings in the whole package): counted
    # below as its baseline memory.
    from ..offload import producer_loop  # noqa: F401

    measured = None
    process = _rss_bytes()
    jpeg_bytes = args.jpeg_bytes
    rate = args.producer_rate
    if args.measure:
        measured = measure_kernel(args.data, images=args.images, size=args.size,
                                  dtype=args.dtype)
        rate = measured["rate_per_core"]
        if jpeg_bytes is None:
            jpeg_bytes = measured["mean_jpeg_bytes"]
    elif args.data and jpeg_bytes is None:
        bufs = _sample(args.data, args.images)[1]
        jpeg_bytes = sum(map(len, bufs)) / len(bufs)
    p = plan(train_rate=args.train_rate, producer_rate=rate, batch=args.batch, size=args.size,
             dtype=args.dtype, arm_factor=arm_factor, preset=args.preset, headroom=args.headroom,
             jpeg_bytes=jpeg_bytes or IMAGENET_JPEG_BYTES, process_bytes=process,
             kernel_memory_bytes=measured["kernel_memory_bytes"] if measured else None,
             slots=args.slots)
    if measured:
        p["measured"] = {**measured, "data": os.path.abspath(args.data), "cpu": cpu_name()}
    if args.cache_bytes is not None:
        p["cache"] = _run_cache(args, rate, arm_factor)
    if args.json:
        print(json.dumps(p, indent=2))
    else:
        if measured:
            print(f"measured on this machine ({p['measured']['cpu']}): "
                  f"{measured['rate_per_core']:.1f} img/s per core over {measured['images']} "
                  f"images of {args.data}")
        print(format_plan(p))
    return 0


def _run_cache(args, rate, arm_factor):
    """``plan --cache-bytes``: the cache model, measured on ``--data`` with ``--measure``."""
    if args.max_side is None:
        raise ConfigError("--cache-bytes needs --max-side (the decode_max_side it caches)")
    num, per_sample = None, None
    miss, hit = args.miss_rate, args.hit_rate
    if args.data:
        from ..sources import open_path
        num = len(open_path(args.data))
    if args.measure:
        m = measure_cache(args.data, args.max_side, images=args.images, size=args.size,
                          dtype=args.dtype)
        miss = m["miss_rate"] if miss is None else miss
        hit = m["hit_rate"] if hit is None else hit
        per_sample = m["bytes_per_sample"]
    if hit is None:
        raise ConfigError("--cache-bytes needs --hit-rate (a core's img/s on cached samples) "
                          "or --measure --data")
    shard = args.shard_samples or num
    if shard is None:
        raise ConfigError("--cache-bytes needs --shard-samples (or --data)")
    return cache_plan(cache_bytes=int(args.cache_bytes), max_side=args.max_side,
                      shard_samples=shard, num_samples=max(num or 0, shard),
                      bytes_per_sample=per_sample, miss_rate=miss or rate, hit_rate=hit,
                      train_rate=args.train_rate, arm_factor=arm_factor,
                      headroom=args.headroom)


def cpu_name():
    """The CPU's model name (``/proc/cpuinfo``), or the machine type where it has none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine
