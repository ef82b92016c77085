"""When does ``fast=True`` pay? Accurate against fast decoding, side by side on one core.

    python bench/bench_fast.py [--data DIR] [--n 1000] [--rounds 7] [--json PATH]

``fast=True`` changes two things in libjpeg: the IDCT (``JDCT_IFAST`` instead of
``JDCT_ISLOW``) and chroma upsampling (plain, which for 4:2:0 and 4:2:2 means libjpeg's merged
upsampler, instead of fancy triangle-filter upsampling). What each costs depends on the CPU's
SIMD: libjpeg-turbo has AVX2 code for the accurate IDCT and the upsamplers but only SSE2 code
for the fast IDCT, so on an AVX2 CPU the "fast" IDCT is the slower one. And the DCT scale: a
decode at 1/2, 1/4 or 1/8 scale uses the reduced-size IDCTs whatever ``dct_method`` says, so
there only the upsampling differs.

Measured here, on the ImageNet-like sample dataset (real photographs, as ``dpu-pipe bench``
makes it) or ``--data``, file bytes in memory, one process pinned to one core, the two modes
interleaved in chunks of 32 images within every round (``dpu_pipe.tools.harness.interleaved``),
the median round reported:

* ``full``: whole-image decode;
* ``region``: the RandomResizedCrop boxes of ``bench/bench_decode.py`` at ``min_size=(224, 224)``,
  as the loaders decode them, split by the DCT scale libjpeg ends up using (1 = the 8x8 IDCT);
* ``batch``: the loaders' batch kernel (decode + crop + resample + flip + normalize, float32
  CHW 224), the figure a training run sees.

Numbers only; nothing is asserted.
"""

import argparse
import json
import os
import platform
import sys
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dpu_pipe import jpeg  # noqa: E402
from bench_decode import random_resized_crop_boxes  # noqa: E402
from dpu_pipe.tools.harness import interleaved, load_buffers, one_core  # noqa: E402

CHUNK = 32


def main():
    from dpu_pipe.kernel import BatchProcessor
    from dpu_pipe.tools.sample_data import sample_dataset
    from dpu_pipe.transforms import TransformConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", help="JPEG dataset (default: the cached sample dataset)")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    root = args.data or sample_dataset(args.n, progress=False)
    _, bufs = load_buffers(root, args.n)
    heads = [jpeg.read_header(b) for b in bufs]
    boxes = random_resized_crop_boxes([(h.height, h.width) for h in heads], seed=0)
    n = len(bufs)
    scales = np.array([jpeg.choose_scale(int(b[2]), int(b[3]), (224, 224)) for b in boxes])

    def full(fast):
        return lambda a, b: [jpeg.decode(bufs[i], fast=fast) for i in range(a, b)]

    def region(fast, pick):
        def fn(a, b):
            for i in pick[a:b]:
                jpeg.decode(bufs[i], region=tuple(int(v) for v in boxes[i]),
                            min_size=(224, 224), fast=fast)
        return fn

    procs = {f: BatchProcessor(TransformConfig(train=True, size=224, fast=f), num_threads=1)
             for f in (False, True)}
    index = np.arange(n, dtype=np.int64)

    def batch(fast):
        def fn(a, b):
            procs[fast].run([bufs[i] for i in range(a, b)], index[a:b], epoch=0, seed=0)
        return fn

    full_scale = [i for i in range(n) if scales[i] == 8]
    reduced = [i for i in range(n) if scales[i] != 8]
    groups = {
        "full decode": ({"accurate": full(False), "fast": full(True)}, n),
        "region, min_size 224, all boxes": ({"accurate": region(False, list(range(n))),
                                             "fast": region(True, list(range(n)))}, n),
        "region, boxes decoded at full scale (8/8)": ({"accurate": region(False, full_scale),
                                              "fast": region(True, full_scale)},
                                             len(full_scale)),
        "region, boxes decoded at 1/2 or smaller": ({"accurate": region(False, reduced),
                                                "fast": region(True, reduced)}, len(reduced)),
        "batch kernel (decode + augment, float32 CHW 224)": (
            {"accurate": batch(False), "fast": batch(True)}, n),
    }
    out = {"machine": platform.processor() or platform.machine(), "n": n,
           "rounds": args.rounds, "rows": []}
    with one_core() as cores:
        out["core"] = cores
        for name, (methods, count) in groups.items():
            for fn in methods.values():
                fn(0, min(count, CHUNK))   # warm-up
            times = interleaved(methods, count, chunk=CHUNK, repeat=args.rounds)
            acc = count / float(np.median(times["accurate"]))
            fst = count / float(np.median(times["fast"]))
            out["rows"].append({"what": name, "images": count, "accurate_img_s": acc,
                                "fast_img_s": fst, "fast_vs_accurate": fst / acc})
    print("| decode | images | accurate img/s | fast img/s | fast / accurate |")
    print("|---|---:|---:|---:|---:|")
    for r in out["rows"]:
        print(f"| {r['what']} | {r['images']} | {r['accurate_img_s']:.0f} | "
              f"{r['fast_img_s']:.0f} | {r['fast_vs_accurate']:.2f}x |")
    print(f"\n{n} images, pinned to core(s) {out['core']}, median of {args.rounds} interleaved "
          f"rounds")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
