"""Images per second on one core for three training recipes: dpu_pipe's batch kernel against
torchvision v2 (PIL backend) inside a DataLoader worker.

Recipes:
  classic  RandomResizedCrop(224) + flip
  tv-new   torchvision's new recipe: RRC + TrivialAugmentWide + RandomErasing(0.1)
  timm-vit RRC bicubic + RandAugment(2, m9, mstd 0.5) + ColorJitter(0.4) + RandomErasing(0.25)
(Mixup/CutMix are batch ops on float tensors, outside this per-sample comparison.)

Methods run interleaved, one round each per repeat, on the same files: the ratio is measured
under the same machine load. Data: dpu_pipe.tools.sample_data (ImageNet-like JPEGs made from
real photographs).

    .venv/bin/python bench/bench_recipes.py --n 256 --repeat 3
"""

import argparse
import io
import os
import time

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _dpu_pipe_method(bufs, recipe):
    from dpu_pipe.batch import BatchProcessor
    from dpu_pipe.transforms import TransformConfig

    kw = {"classic": {}, "tv-new": dict(auto_augment="ta_wide", random_erase=0.1),
          "timm-vit": dict(interpolation="bicubic", auto_augment="ra", ra_num_ops=2,
                           ra_magnitude=9, ra_mstd=0.5, color_jitter=0.4,
                           random_erase=0.25)}[recipe]
    proc = BatchProcessor(TransformConfig(size=224, **kw), num_threads=1)
    idx = np.arange(len(bufs), dtype=np.int64)
    epoch = [0]

    def run():
        epoch[0] += 1
        for s in range(0, len(bufs), 64):
            proc.run(bufs[s:s + 64], idx[s:s + 64], epoch=epoch[0])
    return run


def _torchvision_method(bufs, recipe):
    import torch
    import torchvision.transforms.v2 as T
    from PIL import Image

    norm = [T.PILToTensor(), T.ToDtype(torch.float32, scale=True),
            T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]
    if recipe == "classic":
        tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()] + norm)
    elif recipe == "tv-new":
        tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(),
                        T.TrivialAugmentWide()] + norm + [T.RandomErasing(0.1)])
    else:
        tf = T.Compose([T.RandomResizedCrop(224, interpolation=T.InterpolationMode.BICUBIC),
                        T.RandomHorizontalFlip(), T.RandAugment(2, 9),
                        T.ColorJitter(0.4, 0.4, 0.4)] + norm + [T.RandomErasing(0.25)])

    class Files(torch.utils.data.Dataset):
        def __len__(self):
            return len(bufs)

        def __getitem__(self, i):
            return tf(Image.open(io.BytesIO(bufs[i])).convert("RGB")), 0

    loader = torch.utils.data.DataLoader(Files(), batch_size=64, num_workers=1,
                                         persistent_workers=True,
                                         worker_init_fn=lambda _: torch.set_num_threads(1))

    def run():
        for _ in loader:
            pass
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from dpu_pipe.tools.sample_data import dataset_files, sample_dataset

    root = sample_dataset(args.n, progress=False)
    paths, _ = dataset_files(root)
    bufs = [p.read_bytes() for p in paths[:args.n]]
    methods = {}
    for recipe in ("classic", "tv-new", "timm-vit"):
        methods[("dpu_pipe", recipe)] = _dpu_pipe_method(bufs, recipe)
        methods[("torchvision", recipe)] = _torchvision_method(bufs, recipe)
    for run in methods.values():        # warm-up: worker start, first allocations
        run()
    times = {k: [] for k in methods}
    for _ in range(args.repeat):
        for k, run in methods.items():
            t = time.perf_counter()
            run()
            times[k].append(time.perf_counter() - t)
    rate = {k: len(bufs) / min(v) for k, v in times.items()}
    load = os.getloadavg()
    print(f"{len(bufs)} images, best of {args.repeat}, img/s on one core; load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
    print(f"{'recipe':10s} {'dpu_pipe':>9s} {'torchvision':>12s} {'ratio':>6s} {'cost vs classic':>16s}")
    for recipe in ("classic", "tv-new", "timm-vit"):
        d, t = rate[("dpu_pipe", recipe)], rate[("torchvision", recipe)]
        print(f"{recipe:10s} {d:9.0f} {t:12.0f} {d / t:6.2f} "
              f"{rate[('dpu_pipe', 'classic')] / d:16.2f}")


if __name__ == "__main__":
    main()
