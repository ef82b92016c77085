"""Images per second on one core for three training recipes: dpu_pipe's batch kernel against
torchvision v2 (PIL backend) inside a DataLoader worker.

Recipes:
  classic  RandomResizedCrop(224) + flip
  tv-new   torchvision's new recipe: RRC + TrivialAugmentWide + RandomErasing(0.1)
  timm-vit RRC bicubic + RandAugment(2, m9, mstd 0.5) + ColorJitter(0.4) + RandomErasing(0.25)
(Mixup/CutMix are batch ops on float tensors, outside this per-sample comparison.)

Methods run interleaved, one round each per repeat, on the same files: the ratio is measured
under the same machine load. The "pack" columns are dpu_pipe on the same files transcoded as
``dpu-pipe pack`` stores them (lossless: the same decoded pixels; a restart marker every MCU,
so the region decode reads only the intervals covering the crop), against torchvision on the
original files. Data: dpu_pipe.tools.sample_data (ImageNet-like JPEGs made from
real photographs).

DALI's CPU pipeline (device_id=None, one thread) is a third column when nvidia.dali imports:
decoders.image_random_crop + resize (antialiased bilinear; bicubic for timm-vit) +
crop_mirror_normalize with a random mirror; tv-new adds auto_aug.trivial_augment_wide and
erasing (p 0.1, scale 0.02-0.33, ratio 0.3-3.3, zeros after normalize); timm-vit adds
auto_aug.rand_augment(n=2, m=9) (no magnitude noise: DALI has no mstd), color_twist with
brightness, contrast and saturation in [0.6, 1.4] and erasing with p 0.25. Install it with
``pip install nvidia-dali-cuda120`` (its CPU operators need no GPU), or point ``--dali-path``
at a directory holding it. Without it the column is skipped with a message.

    taskset -c 0 .venv/bin/python bench/bench_recipes.py --n 256 --repeat 3
"""

import argparse
import io
import os

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _dpu_pipe_method(bufs, recipe):
    from dpu_pipe.kernel import BatchProcessor
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


def _dali_method(bufs, recipe):
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import math as dmath, pipeline_def
    from nvidia.dali.auto_aug import rand_augment, trivial_augment

    def erase(imgs, p):
        # RandomErasing's box: area scale in [0.02, 0.33] and log-uniform ratio in [0.3, 3.3],
        # in units of the side; DALI clips a box that leaves the image.
        if fn.random.coin_flip(probability=p):
            scale = fn.random.uniform(range=[0.02, 0.33])
            ratio = dmath.exp(fn.random.uniform(range=[float(np.log(0.3)), float(np.log(3.3))]))
            bh = dmath.min(dmath.sqrt(scale * ratio), 0.99)
            bw = dmath.min(dmath.sqrt(scale / ratio), 0.99)
            anchor = fn.stack(fn.random.uniform(range=[0.0, 1.0]) * (1.0 - bh),
                              fn.random.uniform(range=[0.0, 1.0]) * (1.0 - bw))
            imgs = fn.erase(imgs, anchor=anchor, shape=fn.stack(bh, bw), axis_names="HW",
                            normalized_anchor=True, normalized_shape=True, fill_value=0.0)
        return imgs

    arrays = [np.frombuffer(b, np.uint8) for b in bufs]

    # Synchronous: a pipelined executor would compute batches ahead while the other methods
    # run, and its timed round would only collect them.
    @pipeline_def(batch_size=64, num_threads=1, device_id=None, seed=1,
                  enable_conditionals=True, exec_async=False, exec_pipelined=False)
    def pipe():
        jpegs = fn.external_source(source=lambda info: arrays[info.idx_in_epoch % len(arrays)],
                                   batch=False, dtype=types.UINT8)
        imgs = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
        interp = types.INTERP_CUBIC if recipe == "timm-vit" else types.INTERP_LINEAR
        imgs = fn.resize(imgs, size=(224, 224), interp_type=interp, antialias=True)
        if recipe == "tv-new":
            imgs = trivial_augment.trivial_augment_wide(imgs)
        elif recipe == "timm-vit":
            imgs = rand_augment.rand_augment(imgs, n=2, m=9)
            imgs = fn.color_twist(imgs, brightness=fn.random.uniform(range=[0.6, 1.4]),
                                  contrast=fn.random.uniform(range=[0.6, 1.4]),
                                  saturation=fn.random.uniform(range=[0.6, 1.4]))
        out = fn.crop_mirror_normalize(imgs, dtype=types.FLOAT, output_layout="CHW",
                                       mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
                                       std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
                                       mirror=fn.random.coin_flip())
        if recipe != "classic":
            out = erase(out, 0.1 if recipe == "tv-new" else 0.25)
        return out

    p = pipe()
    p.build()

    def run():
        for _ in range(0, len(bufs), 64):
            p.run()
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dali-path", default=None,
                    help="directory appended to sys.path to import nvidia.dali from")
    args = ap.parse_args()
    if args.dali_path:
        import sys
        sys.path.append(args.dali_path)
    try:
        import nvidia.dali  # noqa: F401
        have_dali = True
    except ImportError:
        have_dali = False
        print("DALI not installed (pip install nvidia-dali-cuda120): its column is skipped")

    from dpu_pipe.tools.harness import interleaved
    from dpu_pipe.tools.sample_data import dataset_files, sample_dataset

    root = sample_dataset(args.n, progress=False)
    paths, _ = dataset_files(root)
    bufs = [p.read_bytes() for p in paths[:args.n]]
    # The records of a transcoded pack (dpu-pipe pack): the same decoded pixels, with a restart
    # marker every MCU, so the region decode reads only the intervals covering the crop.
    from dpu_pipe import jpeg
    packed = [jpeg.transcode(b, restart_interval=1) for b in bufs]
    methods = {}
    for recipe in ("classic", "tv-new", "timm-vit"):
        methods[("dpu_pipe", recipe)] = _dpu_pipe_method(bufs, recipe)
        methods[("dpu_pipe pack", recipe)] = _dpu_pipe_method(packed, recipe)
        methods[("torchvision", recipe)] = _torchvision_method(bufs, recipe)
        if have_dali:
            methods[("dali", recipe)] = _dali_method(bufs, recipe)
    for run in methods.values():        # warm-up: worker start, first allocations
        run()
    times = interleaved({k: (lambda run: lambda a, b: run())(run) for k, run in methods.items()},
                        1, chunk=1, repeat=args.repeat)
    rate = {k: len(bufs) / min(v) for k, v in times.items()}
    load = os.getloadavg()
    print(f"{len(bufs)} images, best of {args.repeat}, img/s on one core; load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
    dali = " (DALI CPU: the same recipe in its own operators)" if have_dali else ""
    print(f"{'recipe':10s} {'dpu_pipe':>9s} {'torchvision':>12s} {'ratio':>6s}"
          + (f" {'DALI':>6s} {'ratio':>6s}" if have_dali else "")
          + f" {'cost vs classic':>16s} {'pack':>6s} {'ratio':>6s} {'cost':>5s}{dali}")
    for recipe in ("classic", "tv-new", "timm-vit"):
        d, t = rate[("dpu_pipe", recipe)], rate[("torchvision", recipe)]
        k = rate[("dpu_pipe pack", recipe)]
        extra = ""
        if have_dali:
            g = rate[("dali", recipe)]
            extra = f" {g:6.0f} {d / g:6.2f}"
        print(f"{recipe:10s} {d:9.0f} {t:12.0f} {d / t:6.2f}{extra} "
              f"{rate[('dpu_pipe', 'classic')] / d:16.2f} {k:6.0f} {k / t:6.2f} "
              f"{rate[('dpu_pipe pack', 'classic')] / k:5.2f}")


if __name__ == "__main__":
    main()
