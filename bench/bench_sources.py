"""Sources: opening WebDataset shard sets, reading records, decoding per core from tar shards
vs an ImageFolder vs a packed dataset, and non-JPEG (PNG, WebP) decode per core vs Pillow.

    python bench/bench_sources.py [--members 1000000] [--n 400] [--rounds 3] [--json PATH]

* open: ``--members`` tar members (half images of 1 byte, half ``.cls`` labels) in 10
  generated shards; a fresh process opens them once with no index cache (the header scan)
  and once more from the cache. Reported: seconds, the resident memory the open source holds
  (``/proc/self/statm`` after minus before) and the peak growth while opening
  (``ru_maxrss``).
* records/s: every record of the ImageNet-like sample dataset (``--n`` images, made once
  under ``$XDG_CACHE_HOME/dpu_pipe``) fetched in shuffled batches of 64 through the
  source's batch path (``buffers`` where it has one, else ``read``), and with ``read`` alone
  as ``read`` copies; the batch path of tar shards and packed data hands the decoder
  pointers into the map (pages are read when decoded).
* img/s per core: ``Loader(train=True, size=224, num_threads=1)`` for one epoch over the
  same images as an ImageFolder, tar shards (10 shards) and a packed dataset
  (``transcode=False``, the same bytes).
* non-JPEG: the sample images re-encoded as PNG and WebP (quality 90); per core, dpu_pipe's
  train pass (OpenCV decode + the fused crop/resize/flip/normalize pass) vs Pillow (decode,
  RandomResizedCrop box, bilinear resize to 224, flip, float normalize), and OpenCV's decode
  alone at full size and with ``IMREAD_REDUCED_COLOR_2`` (the scaled decode OpenCV has).

Methods alternate within each round; the median of the rounds is reported. The machine is
shared: ratios within one run mean more than absolute rates. Nothing is asserted.
"""

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np

_OPEN_CHILD = r"""
import json, os, resource, sys, time
from dpu_pipe.sources import WebDataset
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
pattern = sys.argv[1]
before, peak0 = rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
src = WebDataset(pattern, label_key="cls")
t1 = time.perf_counter()
print(json.dumps({"seconds": t1 - t0, "rss_growth_mb": rss_mb() - before,
                  "peak_growth_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                  - peak0, "samples": len(src)}))
"""


def _open_bench(tmp, members, shards=10):
    per = members // 2 // shards
    for k in range(shards):
        with tarfile.open(os.path.join(tmp, f"big-{k:02d}.tar"), "w") as tf:
            for j in range(per):
                for ext, data in (("jpg", b"\xff"), ("cls", str(j % 1000).encode())):
                    info = tarfile.TarInfo(f"{k}/{j:07d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    pattern = os.path.join(tmp, f"big-{{00..{shards - 1:02d}}}.tar")
    out = {}
    for name in ("scan", "cached"):
        r = subprocess.run([sys.executable, "-c", _OPEN_CHILD, pattern], capture_output=True,
                           text=True, check=True)
        out[name] = json.loads(r.stdout)
    out["members"] = members
    out["tar_bytes"] = sum(os.path.getsize(os.path.join(tmp, f"big-{k:02d}.tar"))
                           for k in range(shards))
    return out


def _records(src, batch=64, seed=0):
    order = np.random.default_rng(seed).permutation(len(src)).astype(np.int64)
    t0 = time.perf_counter()
    total = 0
    gather = getattr(src, "buffers", None)
    for lo in range(0, len(order), batch):
        idx = order[lo:lo + batch]
        if gather is not None:
            bufs, _ = gather(idx)
            total += len(bufs)
        else:
            total += len([src.read(int(i)) for i in idx])
    return len(order) / (time.perf_counter() - t0)


def _read_all(src, seed=0):
    """Records/s of read(i) in shuffled order, every byte copied out."""
    order = np.random.default_rng(seed).permutation(len(src))
    t0 = time.perf_counter()
    nbytes = sum(len(src.read(int(i))) for i in order)
    dt = time.perf_counter() - t0
    return len(order) / dt, nbytes / dt / 1e6


def _loader_rate(src):
    from dpu_pipe import Loader
    ld = Loader(src, 64, train=True, size=224, num_threads=1, prefetch=1)
    t0 = time.perf_counter()
    n = sum(len(y) for _, y in ld)
    return n / (time.perf_counter() - t0)


def _reencode(datas, fmt):
    from PIL import Image
    out = []
    for d in datas:
        img = Image.open(io.BytesIO(d)).convert("RGB")
        buf = io.BytesIO()
        img.save(buf, format=fmt, **({"quality": 90} if fmt == "WEBP" else {}))
        out.append(buf.getvalue())
    return out


def _pillow_train(datas, seed=0):
    from PIL import Image
    rng = np.random.default_rng(seed)
    mean = np.array([0.485, 0.456, 0.406], np.float32) * 255
    std = np.array([0.229, 0.224, 0.225], np.float32) * 255
    t0 = time.perf_counter()
    for d in datas:
        img = Image.open(io.BytesIO(d)).convert("RGB")
        w, h = img.size
        area = w * h * rng.uniform(0.08, 1.0)
        ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        cw = min(w, int(round(np.sqrt(area * ratio))))
        ch = min(h, int(round(np.sqrt(area / ratio))))
        x, y = rng.integers(0, w - cw + 1), rng.integers(0, h - ch + 1)
        img = img.resize((224, 224), Image.BILINEAR, box=(x, y, x + cw, y + ch))
        if rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        arr = (np.asarray(img, np.float32) - mean) / std
        arr.transpose(2, 0, 1).copy()
    return len(datas) / (time.perf_counter() - t0)


def _dpu_train(datas):
    from dpu_pipe import _jpeg
    from dpu_pipe.kernel import BatchProcessor, load_other_formats
    from dpu_pipe.transforms import TransformConfig
    load_other_formats()
    bp = BatchProcessor(TransformConfig(train=True, size=224), 1)
    t0 = time.perf_counter()
    for lo in range(0, len(datas), 32):
        chunk = datas[lo:lo + 32]
        bp.run(_jpeg.BufferList.from_buffers(chunk), np.arange(lo, lo + len(chunk)))
    return len(datas) / (time.perf_counter() - t0)


def _cv2_decode(datas, flag):
    import cv2
    t0 = time.perf_counter()
    for d in datas:
        cv2.imdecode(np.frombuffer(d, np.uint8), flag)
    return len(datas) / (time.perf_counter() - t0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--members", type=int, default=1_000_000)
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import cv2

    from dpu_pipe import pack
    from dpu_pipe.sources import ImageFolder, WebDataset
    from dpu_pipe.tools.sample_data import sample_dataset

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import dataset_formats as dfm

    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.members:
            result["open"] = _open_bench(tmp, args.members)
            print("open:", json.dumps(result["open"]), flush=True)
        full = ImageFolder(sample_dataset(max(args.n, 1000), progress=False))
        from dpu_pipe.sources import FileList
        folder = FileList([(os.path.join(full.root, full.relpath(i)), int(full.labels[i]))
                           for i in range(args.n)])
        tars = WebDataset(dfm.write_tars(folder, os.path.join(tmp, "s-%02d.tar"),
                                         -(-args.n // 10)))
        packed = pack(folder, os.path.join(tmp, "packed"), transcode=False, progress=False)
        sources = {"ImageFolder": folder, "tar": tars, "packed": packed}
        datas = [folder.read(i) for i in range(len(folder))]
        formats = {"JPEG": datas, "PNG": _reencode(datas, "PNG"),
                   "WebP": _reencode(datas, "WEBP")}
        rates = {}
        for r in range(args.rounds):
            for name, src in sources.items():
                per_s, mb_s = _read_all(src, r)
                rates.setdefault(f"read {name} rec/s", []).append(per_s)
                rates.setdefault(f"read {name} MB/s", []).append(mb_s)
                rates.setdefault(f"batch records {name}", []).append(_records(src, seed=r))
                rates.setdefault(f"loader {name}", []).append(_loader_rate(src))
            for fmt, ds in formats.items():
                rates.setdefault(f"dpu_pipe {fmt}", []).append(_dpu_train(ds))
                rates.setdefault(f"Pillow {fmt}", []).append(_pillow_train(ds, r))
                rates.setdefault(f"cv2 full {fmt}", []).append(
                    _cv2_decode(ds, cv2.IMREAD_COLOR))
                rates.setdefault(f"cv2 reduced2 {fmt}", []).append(
                    _cv2_decode(ds, cv2.IMREAD_REDUCED_COLOR_2))
        med = {k: round(float(np.median(v)), 1) for k, v in rates.items()}
        result["rates"] = med
        result["bytes_per_image"] = {f: float(np.mean([len(d) for d in ds]))
                                     for f, ds in formats.items()}
        result["n"] = args.n
    for k, v in result["rates"].items():
        print(f"{k:28s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
