"""``dpu-pipe bench-train``'s baselines, configurations 1 and 2: torchvision's training recipe
(or its Pillow + torch rendition when torchvision cannot be imported) run serially in the
training process and through ``DataLoader(num_workers=1)``.
"""

import functools
import io
import math
import random

import numpy as np

from ..errors import ConfigError
from .harness import HOST_CORE, Run, load_torch, now, pin, recipe_options

__all__ = ["Recipe", "RecipeDataset", "run_serial", "run_dataloader"]


class Recipe:
    """torchvision's ImageNet transforms for one sample: ``(bytes, key) -> float32 CHW tensor``.

    Train ``classic``: RandomResizedCrop(size) + RandomHorizontalFlip + ToTensor + Normalize;
    the other recipes of :data:`~dpu_pipe.tools.harness.RECIPES` add their ops with
    torchvision's ``transforms.v2`` (and need torchvision), and their batch ops in
    :meth:`batch`. Val: Resize(size / 0.875) + CenterCrop(size) + ToTensor + Normalize. With
    torchvision importable, its own transforms run (randomness from torch's generator, seeded
    per sample from ``key``); otherwise the classic steps with Pillow and torch, parameters
    drawn as torchvision draws them from ``random.Random(key)``.
    """

    def __init__(self, size, train, recipe="classic", num_classes=None):
        from ..transforms import IMAGENET_MEAN, IMAGENET_STD

        self.size, self.train = int(size), bool(train)
        self.recipe = recipe if train else "classic"
        self.options = recipe_options(self.recipe, num_classes or 1)
        self.resize = int(round(self.size / 0.875))
        try:
            import torchvision.transforms as T
        except Exception:  # noqa: BLE001 - any import failure means: not usable here
            T = None
        self.T = T
        if T is None and self.recipe != "classic":
            raise ConfigError(f"recipe {recipe!r} needs torchvision (pip install torchvision)")
        self.kind = "torchvision" if T is not None else "Pillow + torch (torchvision's recipe)"
        if self.recipe != "classic":
            self.kind += f" v2, {self.recipe} recipe"
        torch = load_torch()
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
        self.mix = None
        if T is not None and self.recipe == "classic":
            head = ([T.RandomResizedCrop(self.size), T.RandomHorizontalFlip()] if train
                    else [T.Resize(self.resize), T.CenterCrop(self.size)])
            self.tf = T.Compose(head + [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
        elif T is not None:
            self.tf, self.mix = self._v2(self.options, IMAGENET_MEAN, IMAGENET_STD, torch)

    def _v2(self, o, mean, std, torch):
        from torchvision.transforms import InterpolationMode, v2

        interp = InterpolationMode.BICUBIC if o.get("interpolation") == "bicubic" \
            else InterpolationMode.BILINEAR
        ops = [v2.RandomResizedCrop(self.size, interpolation=interp, antialias=True),
               v2.RandomHorizontalFlip()]
        if o.get("auto_augment") == "ta_wide":
            ops.append(v2.TrivialAugmentWide())
        elif o.get("auto_augment") == "ra":
            ops.append(v2.RandAugment(num_ops=2, magnitude=o.get("ra_magnitude", 9)))
        if o.get("color_jitter"):
            ops.append(v2.ColorJitter(*o["color_jitter"]))
        ops += [v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
        if o.get("random_erase"):
            ops.append(v2.RandomErasing(o["random_erase"]))
        mixes = [cls(alpha=o[key], num_classes=o["num_classes"])
                 for key, cls in (("mixup_alpha", v2.MixUp), ("cutmix_alpha", v2.CutMix))
                 if o.get(key)]
        mix = v2.RandomChoice(mixes) if len(mixes) > 1 else (mixes[0] if mixes else None)
        return v2.Compose(ops), mix

    def batch(self, images, labels, key):
        """The recipe's batch ops (MixUp / CutMix, as torchvision's reference applies them in
        its ``collate_fn``) on stacked ``images`` (B, 3, H, W) and int64 ``labels`` (B,):
        returns the images and float32 (B, num_classes) labels, or both unchanged."""
        if self.mix is None:
            return images, labels
        load_torch().manual_seed(key)
        return self.mix(images, labels)

    def __call__(self, data, key):
        from PIL import Image

        torch = load_torch()
        img = Image.open(io.BytesIO(data)).convert("RGB")
        if self.T is not None:
            torch.manual_seed(key)
            return self.tf(img)
        if self.train:
            rng = random.Random(key)
            i, j, h, w = self._crop_params(img.height, img.width, rng)
            img = img.crop((j, i, j + w, i + h)).resize((self.size, self.size),
                                                        Image.BILINEAR)
            if rng.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
        else:
            scale = self.resize / min(img.width, img.height)
            img = img.resize((max(self.resize, round(img.width * scale)),
                              max(self.resize, round(img.height * scale))), Image.BILINEAR)
            top = int(round((img.height - self.size) / 2.0))
            left = int(round((img.width - self.size) / 2.0))
            img = img.crop((left, top, left + self.size, top + self.size))
        x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float().div_(255)
        return x.sub_(self.mean).div_(self.std)

    @staticmethod
    def _crop_params(height, width, rng, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        """torchvision's RandomResizedCrop.get_params."""
        area = height * width
        log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return rng.randint(0, height - h), rng.randint(0, width - w), h, w
        in_ratio = width / height
        if in_ratio < ratio[0]:
            w, h = width, int(round(width / ratio[0]))
        elif in_ratio > ratio[1]:
            h, w = height, int(round(height * ratio[1]))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w


class RecipeDataset:
    """Map-style dataset for ``torch.utils.data.DataLoader``: sample i of a dpu_pipe source
    through :class:`Recipe`; yields (image, label, seconds spent on it)."""

    def __init__(self, source, recipe, seed, epoch):
        self.source, self.recipe, self.seed, self.epoch = source, recipe, seed, epoch

    def __len__(self):
        return len(self.source)

    def __getitem__(self, i):
        t = now()
        x = self.recipe(self.source.read(i), _key(self.seed, self.epoch, i))
        return x, int(self.source.labels[i]), now() - t


def stack(torch, items):
    """(images (B, 3, H, W), int64 labels (B,), seconds) of :class:`RecipeDataset` items."""
    xs, ys, secs = zip(*items)
    return torch.stack(xs), torch.tensor(ys, dtype=torch.int64), float(sum(secs))


def _key(seed, epoch, index):
    return (int(seed) * 1_000_003 + int(epoch)) * 1_000_000_007 + int(index)


def _recipes(job):
    """(train, val) :class:`Recipe` of a bench-train job."""
    classes = job["model_kwargs"]["classes"]
    return (Recipe(job["size"], True, job.get("recipe", "classic"), classes),
            Recipe(job["size"], False))


def run_serial(job, train_src, val_src):
    """Configuration 1: the recipe in the training loop."""
    run = Run(job, 1)
    torch = run.torch
    train_rec, val_rec = _recipes(job)
    ds_val = RecipeDataset(val_src, val_rec, job["seed"], 0)
    B = job["batch_size"]
    busy = 0.0

    def batches(epoch):
        nonlocal busy
        ds = RecipeDataset(train_src, train_rec, job["seed"], epoch)
        order = np.random.default_rng([job["seed"], epoch]).permutation(len(ds))
        for s in range(len(order) // B):
            t = now()
            images, labels, sec = stack(torch, [ds[int(i)] for i in order[s * B:(s + 1) * B]])
            images, labels = train_rec.batch(images, labels, _key(job["seed"], epoch, -1 - s))
            busy += sec + (now() - t)
            yield images, labels

    def val_batches():
        for s in range(0, len(ds_val), B):
            yield stack(torch, [ds_val[i] for i in range(s, min(len(ds_val), s + B))])[:2]

    for epoch in range(job["epochs"]):
        run.train_epoch(batches(epoch))
        run.validate_host(epoch, val_batches())
        job["tick"]()
    return run.result({"recipe": train_rec.kind, "producer_busy_s": busy,
                       "producers": 0, "name": f"host serial + {train_rec.kind}"})


def _pin_worker(_):
    pin(HOST_CORE, strict=False)
    load_torch()


def run_dataloader(job, train_src, val_src):
    """Configuration 2: DataLoader(num_workers=1), the worker pinned to the host's core."""
    run = Run(job, 2)
    torch = run.torch
    from torch.utils.data import DataLoader

    train_rec, val_rec = _recipes(job)
    busy = 0.0

    def collate(items, rec=None):
        t = now()
        images, labels, sec = stack(torch, items)
        if rec is not None:     # the batch ops in the worker, as torchvision's reference does
            images, labels = rec.batch(images, labels, int(torch.randint(1 << 62, ())))
        return images, labels, torch.tensor(sec + (now() - t) if rec is not None else sec)

    def batches(rec, train, epoch, seconds):
        """The DataLoader's (images, labels); each batch's worker seconds go to ``seconds``."""
        nonlocal busy
        g = torch.Generator().manual_seed(job["seed"] * 1000 + epoch)
        ds = RecipeDataset(train_src if train else val_src, rec, job["seed"], epoch)
        loader = DataLoader(ds, batch_size=job["batch_size"], shuffle=train, generator=g,
                            num_workers=1, worker_init_fn=_pin_worker, drop_last=train,
                            collate_fn=functools.partial(collate, rec=rec if train else None),
                            prefetch_factor=2)
        for images, labels, sec in loader:
            busy += float(sec)
            seconds.append(float(sec))
            yield images, labels

    for epoch in range(job["epochs"]):
        # The worker's seconds per delivered training batch are the timeline's producer_s.
        run.train_epoch(batches(train_rec, True, epoch, run.timeline["producer_s"]))
        run.validate_host(epoch, batches(val_rec, False, 0, []))
        job["tick"]()
    return run.result({"recipe": train_rec.kind, "producer_busy_s": busy, "producers": 1,
                       "name": f"DataLoader(num_workers=1) + {train_rec.kind}"})
