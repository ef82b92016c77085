"""The Loader with dpu_pipe's own JPEG decoder (``jpeg_decoder="own"``) against libjpeg-turbo,
over a transcoded pack (a restart marker every MCU; the own decoder takes the restart
intervals from the pack's interval index, or, in the "marker scan" row, scans for them) and
over the original files, and where one image's time goes.

    python bench/bench_loader_decoder.py [--n 200] [--rounds 3] [--seed 0]

One core: ``num_threads=1``, train recipe (RandomResizedCrop 224, flip, float32 CHW), on the
ImageNet-like dataset of real photographs (dpu_pipe.tools.sample_data) and its transcoded pack
(``dpu_pipe.pack(..., transcode=True)``). Times are CPU seconds of the whole process
(``time.process_time``: the loader's thread included, other jobs on the machine excluded),
µs per image, median of the rounds.

Loader table: one epoch per method in turn within each round (methods interleaved).
Breakdown table, the pack's records, methods interleaved image by image:

  entropy          the own entropy decoder on the MCUs covering the crop box
  decode           the own region decode at the Loader's DCT scale (entropy + IDCT,
                   upsampling, colour); idct+colour = decode - entropy
  kernel           the fused batch kernel on one sample (decode + resample/flip/normalize);
                   resample = kernel - decode
  (and the same decode and kernel with libjpeg-turbo)
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from dpu_pipe import _huffman, _jpeg, pack
from dpu_pipe.batch import BatchProcessor
from dpu_pipe.loader import Loader
from dpu_pipe.rng import random_resized_crop
from dpu_pipe.sources import FileList, ImageFolder, PackedSource
from dpu_pipe.tools.sample_data import sample_dataset
from dpu_pipe.transforms import TransformConfig

from bench_entropy import mcu_rect, print_table  # bench/, beside this one

MAX_PIXELS = 1 << 28
SIZE = 224


def time_cpu(methods, items, rounds):
    """{method: [µs of CPU per item, each round]}, methods interleaved item by item."""
    totals = {m: [] for m in methods}
    for _ in range(rounds):
        acc = dict.fromkeys(methods, 0.0)
        for it in items:
            for m, fn in methods.items():
                t0 = time.process_time()
                fn(it)
                acc[m] += time.process_time() - t0
        for m in methods:
            totals[m].append(acc[m] / len(items) * 1e6)
    return totals


class ScanOnly(PackedSource):
    """The same one-shard pack, its records handed to the kernel without their interval
    index entries: the own decoder finds the intervals by the marker scan."""

    def buffers(self, indices):
        sh = self.dataset.shard(0)
        rec = sh.records[np.asarray(indices, dtype=np.int64) - sh.first]
        return _jpeg.BufferList.from_packed(sh.buffer, rec["offset"].astype(np.int64),
                                            rec["length"].astype(np.int64)), {}


def loader_table(sources, n, rounds, seed):
    """{method: [µs of CPU per image of one epoch, each round]}."""
    loaders = {name: Loader(src, 32, size=SIZE, seed=seed, num_threads=1, jpeg_decoder=dec)
               for name, (src, dec) in sources.items()}
    totals = {m: [] for m in loaders}
    try:
        for rnd in range(rounds + 1):          # round 0 warms the page cache and the buffers
            for m, loader in loaders.items():
                t0 = time.process_time()
                for _ in loader:
                    pass
                if rnd:
                    totals[m].append((time.process_time() - t0) / n * 1e6)
    finally:
        for loader in loaders.values():
            loader.close()
    return totals


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    full = ImageFolder(sample_dataset(args.n, progress=False))
    folder = FileList([(full.describe(i), int(full.labels[i]))
                       for i in range(min(args.n, len(full)))])
    with tempfile.TemporaryDirectory() as tmp:
        packed = pack(folder, Path(tmp) / "ds", transcode=True, progress=False)
        n = len(folder)
        totals = loader_table({"loader/originals, libjpeg": (folder, "libjpeg"),
                               "loader/originals, own": (folder, "own"),
                               "loader/pack, libjpeg": (packed, "libjpeg"),
                               "loader/pack, own": (packed, "own"),
                               "loader/pack, own, marker scan": (ScanOnly(packed.path), "own")},
                              n, args.rounds, args.seed)
        print(f"Loader, {n} images (ImageNet-like, real photographs), one thread, train 224, "
              f"float32 CHW; CPU µs per image, {args.rounds} rounds, methods interleaved per "
              f"epoch")
        med = print_table(totals)
        base, today = med["loader/originals, libjpeg"], med["loader/pack, libjpeg"]
        for m, v in med.items():
            print(f"  {m}: {base / v:.2f}x originals/libjpeg, {today / v:.2f}x pack/libjpeg")

        items = []
        for i in range(n):
            data = np.frombuffer(packed.read(i), np.uint8)
            hdr = _huffman.header(data)
            box = tuple(int(x) for x in random_resized_crop(args.seed, 0, i, hdr["height"],
                                                             hdr["width"]))
            items.append((data, box, mcu_rect(hdr, *box), np.array([i], np.int64)))
        own = BatchProcessor(TransformConfig(size=SIZE, jpeg_decoder="own"), 1)
        lj = BatchProcessor(TransformConfig(size=SIZE), 1)
        out = own.empty(1)
        methods = {
            "entropy": lambda it: _huffman.read_coefficients(it[0], it[2]),
            "decode, own": lambda it: _huffman.decode(it[0], it[1], SIZE, SIZE, False, False,
                                                     MAX_PIXELS, 100),
            "kernel, own": lambda it: own.run([it[0]], it[3], seed=args.seed, out=out),
            "decode, libjpeg": lambda it: _jpeg.decode(it[0], it[1], SIZE, SIZE, False, False,
                                                      MAX_PIXELS, 100),
            "kernel, libjpeg": lambda it: lj.run([it[0]], it[3], seed=args.seed, out=out),
        }
        totals = time_cpu(methods, items, args.rounds)
        sub = lambda a, b: [x - y for x, y in zip(totals[a], totals[b])]  # noqa: E731
        totals["idct+colour, own"] = sub("decode, own", "entropy")
        totals["resample, own"] = sub("kernel, own", "decode, own")
        totals["resample, libjpeg"] = sub("kernel, libjpeg", "decode, libjpeg")
        print(f"\nper image, the pack's {n} records, RandomResizedCrop box of (seed "
              f"{args.seed}, epoch 0, index), CPU µs, {args.rounds} rounds, methods "
              f"interleaved per image")
        print_table(totals)
        ratio = statistics.median(totals["kernel, libjpeg"]) / statistics.median(
            totals["kernel, own"])
        print(f"own decoder kernel / libjpeg kernel speed: {ratio:.2f}x")


if __name__ == "__main__":
    main()
