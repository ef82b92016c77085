"""Run a fixed set of dpu_pipe computations on a directory of JPEGs and save every output array.

    python batch_digest.py DATA_DIR OUT.npz

Run once by the x86-64 build on the host and once by the aarch64 build under emulation;
tests/test_aarch64.py then compares the two files byte for byte. DATA_DIR is an ImageFolder
(class sub-folders of .jpg files). Every section is a public entry point of dpu_pipe: JPEG decode
(full, region, DCT-scaled, fast), lossless transcoding and the region decode of transcoded
records, the per-image transform, the Gaussian blur and solarize ops, the fused batch kernel,
the epoch permutation and the samplers' shards, the local Loader (one view, and multi-view
DINO and BYOL batches), the decoded-sample cache (an epoch filling it, one served from it, the
cached images), the batch ops (MixUp, CutMix,
soft labels); a section whose entry point this build lacks is recorded as missing, not failed.
Standard library and numpy only, no subprocesses: it runs inside the emulated userland.
"""

import json
import os
import sys
import traceback

import numpy as np


def files(root):
    out = []
    for d in sorted(os.listdir(root)):
        sub = os.path.join(root, d)
        if os.path.isdir(sub):
            out += [os.path.join(sub, f) for f in sorted(os.listdir(sub)) if f.endswith(".jpg")]
    return out


def decode_section(paths, put):
    from dpu_pipe import jpeg

    for p in paths:
        name = os.path.basename(p)
        data = open(p, "rb").read()
        h = jpeg.read_header(data)
        put(f"decode/{name}/full", jpeg.decode(data))
        top, left = h.height // 5, h.width // 7
        region = (top, left, max(1, h.height // 2), max(1, h.width // 2))
        put(f"decode/{name}/region", jpeg.decode(data, region=region))
        for m in (8, 24, 64):
            put(f"decode/{name}/min{m}", jpeg.decode(data, min_size=(m, m)))
            put(f"decode/{name}/region-min{m}", jpeg.decode(data, region=region, min_size=(m, m)))
        put(f"decode/{name}/fast", jpeg.decode(data, fast=True))
    bufs = [open(p, "rb").read() for p in paths]
    out, shapes = jpeg.decode_batch(bufs)[:2]
    put("decode_batch/out", out)
    put("decode_batch/shapes", shapes)


def transcode_section(paths, put):
    """Transcoded records (restart markers every MCU, and every MCU row): their bytes, and their
    region decodes, which read only the restart intervals covering the region."""
    from dpu_pipe import jpeg
    from dpu_pipe.kernel import BatchProcessor
    from dpu_pipe.transforms import TransformConfig

    for interval in (1, "row"):
        trans = []
        for p in paths:
            name = os.path.basename(p)
            t = jpeg.transcode(open(p, "rb").read(), restart_interval=interval)
            trans.append(t)
            put(f"transcode/{interval}/{name}/bytes", np.frombuffer(t, dtype=np.uint8))
            h = jpeg.read_header(t)
            for k, (a, b, c, d) in enumerate(((5, 3, 2, 2), (3, 1, 3, 2), (1, 2, 2, 1))):
                region = (h.height * a // 8, h.width * b // 8, max(1, h.height * c // 8),
                          max(1, h.width * d // 8))
                for m in (0, 24, 64):
                    put(f"transcode/{interval}/{name}/region{k}-min{m}",
                        jpeg.decode(t, region=region, min_size=(m, m) if m else None))
                put(f"transcode/{interval}/{name}/region{k}-fast", jpeg.decode(t, region=region, fast=True))
        idx = np.arange(len(trans), dtype=np.int64) * 7 + 3
        for cname, kw in (("train", dict(train=True, size=48)), ("val", dict(train=False, size=40))):
            out, info, errors = BatchProcessor(TransformConfig(**kw), num_threads=2).run(
                trans, idx, epoch=1, seed=9)
            put(f"transcode/{interval}/batch-{cname}/out", out)
            put(f"transcode/{interval}/batch-{cname}/info", info)


def ops_section(paths, put):
    from dpu_pipe import jpeg, ops

    for p in paths[:6]:
        name = os.path.basename(p)
        img = jpeg.decode(open(p, "rb").read())
        H, W = img.shape[:2]
        boxes = [(0.0, 0.0, H, W), (H * 0.1, W * 0.2, H * 0.55, W * 0.7), (1.5, 2.25, H / 3.0, W / 2.5)]
        for b, box in enumerate(boxes):
            for size in ((32, 32), (17, 45), (int(H * 1.3) + 1, int(W * 1.1) + 1)):
                for flip in (False, True):
                    for dtype in ("float32", "uint8", "float16"):
                        for layout in ("CHW", "HWC"):
                            put(f"ops/{name}/box{b}/{size[0]}x{size[1]}/flip{int(flip)}/{dtype}/{layout}",
                                ops.resize_crop(img, box, size, flip=flip, dtype=dtype, layout=layout))


def blur_section(paths, put):
    """The multi-view recipes' whole-image ops: Gaussian blurs (the SimCLR kernel, per-axis
    sizes and sigmas, a strided view) and solarize."""
    from dpu_pipe import jpeg, ops

    for p in paths[:4]:
        name = os.path.basename(p)
        img = jpeg.decode(open(p, "rb").read())
        H, W = img.shape[:2]
        for label, k, s in (("k3-s0.7", 3, 0.7), ("k23-s1.9", 23, 1.9),
                            ("k9x23-s0.45x2", (9, 23), (0.45, 2.0)), ("k9-s0.1", 9, 0.1)):
            if max(np.atleast_1d(k)) // 2 < min(H, W):
                put(f"blur/{name}/{label}", ops.gaussian_blur(img, k, s))
        put(f"blur/{name}/view", ops.gaussian_blur(img[H // 4:, W // 5:W - 1], 5, 1.3))
        put(f"blur/{name}/solarize", ops.solarize(img, 128))


def batch_section(paths, put):
    from dpu_pipe.kernel import BatchProcessor
    from dpu_pipe.errors import ConfigError
    from dpu_pipe.transforms import TransformConfig

    bufs = [open(p, "rb").read() for p in paths]
    idx = np.arange(len(bufs), dtype=np.int64) * 7 + 3
    configs = {
        "train-f32-chw": dict(train=True, size=48),
        "train-u8-hwc": dict(train=True, size=40, dtype="uint8", layout="HWC"),
        "train-f16-chw": dict(train=True, size=(24, 56), dtype="float16"),
        "val-f32-chw": dict(train=False, size=48),
        # Every recipe option: bicubic, the three auto-augment policies (with mstd: the
        # Gaussian level), jitter with hue, grayscale, erasing, non-zero fill.
        "train-ta-bicubic-erase": dict(train=True, size=48, auto_augment="ta_wide",
                                       interpolation="bicubic", random_erase=0.5),
        "train-ra-mstd-jitter-bf16": dict(train=True, size=(40, 56), auto_augment="ra",
                                          ra_num_ops=3, ra_mstd=0.5, ra_num_bins=11,
                                          color_jitter=(0.4, 0.4, 0.4, 0.2), grayscale_p=0.3,
                                          dtype="bfloat16", layout="HWC"),
        "train-imagenet-fill-f16": dict(train=True, size=48, auto_augment="imagenet",
                                        fill=(128, 0, 255), dtype="float16",
                                        random_erase=0.25, erase_value=(0.5, -0.5, 1.0)),
        "val-bicubic-u8": dict(train=False, size=48, interpolation="bicubic", dtype="uint8"),
        "train-ta-erase-random-f16": dict(train=True, size=48, auto_augment="ta_wide",
                                          random_erase=0.6, erase_value="random",
                                          dtype="float16"),
        # The timm ViT recipe into float32, CHW and HWC: the conversion through value maps.
        "train-vit-f32-chw": dict(train=True, size=64, interpolation="bicubic",
                                  auto_augment="ra", ra_num_ops=2, ra_magnitude=9, ra_mstd=0.5,
                                  color_jitter=0.4, random_erase=0.25),
        "train-ra-jitter-f32-hwc": dict(train=True, size=(36, 52), auto_augment="ra",
                                        color_jitter=0.4, layout="HWC"),
    }
    for cname, kw in configs.items():
        try:
            cfg = TransformConfig(**kw)
        except (TypeError, ConfigError):  # a keyword or value this build does not take: skip
            continue
        for threads in (1, 2):
            proc = BatchProcessor(cfg, num_threads=threads)
            for seed, epoch in ((0, 0), (0, 1), (1234, 5)):
                out, info, errors = proc.run(bufs, idx, epoch=epoch, seed=seed)
                put(f"batch/{cname}/t{threads}/s{seed}/e{epoch}/out", out)
                put(f"batch/{cname}/t{threads}/s{seed}/e{epoch}/info", info)
                put(f"batch/{cname}/t{threads}/s{seed}/e{epoch}/errors",
                    np.array(sorted(errors), dtype=np.int64))


def permutation_section(put):
    """The epoch order: the C kernel and the numpy twin (integer-only, so the same bits on
    every machine) over small and huge datasets, and shards of every tail policy."""
    from dpu_pipe import _rng, rng
    from dpu_pipe.sampler import EpochSampler

    for n in (1, 2, 3, 255, 256, 257, 1000, 65537, 1_281_167, 10**9 + 7, 2**40):
        pos = np.unique(np.concatenate([np.arange(min(n, 2000)),
                                        (np.arange(500, dtype=np.uint64) * np.uint64(0x9E3779B1))
                                        % np.uint64(n)]).astype(np.int64))
        for seed, epoch in ((0, 0), (2**64 - 1, 2**32 - 1), (20240611, 3)):
            put(f"perm/n{n}/s{seed}/e{epoch}/kernel", _rng.permute(pos, n, seed, epoch))
        put(f"perm/n{n}/twin", rng.permutation_at(pos[:300], n, 7, 1))
    for tail in ("pad", "drop", "uneven", "mask"):
        for r in range(3):
            s = EpochSampler(1000, seed=5, rank=r, world_size=3, shard_tail=tail)
            put(f"shard/{tail}/r{r}", s.indices(2))
            put(f"shard/{tail}/r{r}/batches", np.concatenate(s.batches(2, 64, drop_last=True)))
            put(f"shard/{tail}/r{r}/valid", s.valid(2))
            # The rest of epoch 2 after an elastic resume at position 337, over 3 ranks.
            s = EpochSampler(1000, seed=5, rank=r, world_size=3, shard_tail=tail,
                             resume=(2, 337))
            put(f"shard/{tail}/r{r}/resumed", s.indices(2))
            put(f"shard/{tail}/r{r}/resumed-valid", s.valid(2))


def loader_section(root, put):
    import dpu_pipe

    src = dpu_pipe.ImageFolder(root)
    loader = dpu_pipe.Loader(src, 4, train=True, size=32, seed=7, shuffle=True, drop_last=False)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        for b, (images, labels) in enumerate(loader):
            put(f"loader/e{epoch}/b{b}/images", np.asarray(images))
            put(f"loader/e{epoch}/b{b}/labels", np.asarray(labels))
    val = dpu_pipe.Loader(src, 5, train=False, size=40, seed=7, shuffle=False, drop_last=False,
                          dtype="uint8", layout="HWC")
    for b, (images, labels) in enumerate(val):
        put(f"loader/val/b{b}/images", np.asarray(images))
        put(f"loader/val/b{b}/labels", np.asarray(labels))


def cache_section(root, put):
    """decode_max_side with the decoded-sample cache: an epoch that fills the cache and one
    served from it (the same batches as without a cache), and the cached reduced images."""
    import dpu_pipe

    src = dpu_pipe.ImageFolder(root)
    kw = dict(train=True, size=32, seed=7, decode_max_side=48, num_threads=2)
    loader = dpu_pipe.Loader(src, 4, cache_bytes=1 << 22, **kw)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        for b, (images, labels) in enumerate(loader):
            put(f"cache/e{epoch}/b{b}/images", np.asarray(images))
    st = loader.stats()["cache"]
    if st["hits"] < len(src):
        raise AssertionError(f"epoch 1 was not served from the cache: {st}")
    for i in range(len(src)):
        pixels, scale = loader.cache.sample(i)
        put(f"cache/sample{i}/pixels", pixels)
        put(f"cache/sample{i}/scale", np.array(scale))


def views_section(root, put):
    """A DINO multi-crop batch (decoded once, bicubic crops, jitter, grayscale, blur,
    solarize) into float32 CHW and uint8 HWC, and BYOL's two views, two epochs each."""
    import dpu_pipe
    from dpu_pipe import views

    src = dpu_pipe.ImageFolder(root)
    configs = {"dino-f32": dict(views=views.dino(48, 24, 4)),
               "dino-u8-hwc": dict(views=views.dino(40, 16, 2), dtype="uint8", layout="HWC"),
               "byol-f16": dict(views=views.byol(32), dtype="float16")}
    for cname, kw in configs.items():
        loader = dpu_pipe.Loader(src, 3, seed=9, **kw)
        for epoch in (0, 2):
            loader.set_epoch(epoch)
            for b, (images, labels) in enumerate(loader):
                for v, x in enumerate(images):
                    put(f"views/{cname}/e{epoch}/b{b}/v{v}", np.asarray(x))
                put(f"views/{cname}/e{epoch}/b{b}/labels", np.asarray(labels))
        loader.close()


def mix_section(root, put):
    """The batch ops: MixUp and CutMix batches and soft labels (the Beta draw uses the portable
    exp/log, so λ has the same bits everywhere), each output dtype and layout, and the kernel
    alone at fixed λ and box."""
    import dpu_pipe
    from dpu_pipe import _mix, mix, rng

    src = dpu_pipe.ImageFolder(root)
    configs = {
        "mix-f32-chw": dict(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1),
        "mixup-u8-hwc": dict(mixup_alpha=0.2, dtype="uint8", layout="HWC"),
        "cutmix-f16-p": dict(cutmix_alpha=1.0, mix_p=0.6, dtype="float16"),
        "mix-f32-hwc-switch": dict(mixup_alpha=0.4, cutmix_alpha=0.7, mix_switch_p=0.8,
                                   layout="HWC"),
    }
    classes = int(np.max(src.labels)) + 1
    for cname, kw in configs.items():
        loader = dpu_pipe.Loader(src, 3, size=(24, 32), seed=5, num_classes=classes, **kw)
        for epoch in (0, 3):
            loader.set_epoch(epoch)
            for b, (images, labels) in enumerate(loader):
                put(f"mix/{cname}/e{epoch}/b{b}/images", np.asarray(images))
                put(f"mix/{cname}/e{epoch}/b{b}/labels", np.asarray(labels))
        cfg = loader.transform
        put(f"mix/{cname}/params", np.array(
            [[mix.mix_params(cfg, 5, e, s)["lam"] for s in range(40)] for e in (0, 9)]))
        loader.close()
    put("mix/beta", np.array([rng.beta_variate(3, 1, i, rng.STREAM_MIX, a, a, 2)
                              for a in (0.1, 0.5, 1.0, 3.0) for i in range(50)]))
    r = np.random.default_rng(1)
    x = r.standard_normal((4, 3, 9, 11)).astype(np.float32)
    put("mix/kernel/mixup", _mix.mixup(x.copy(), 0.3141))
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)      # bfloat16 bits
    put("mix/kernel/mixup-bf16", _mix.mixup(bits, 0.3141, "bfloat16"))
    put("mix/kernel/mixup-f16", _mix.mixup(x.astype(np.float16), 0.3141))
    put("mix/kernel/mixup-u8", _mix.mixup((np.abs(x) * 60).astype(np.uint8), 0.3141))
    put("mix/kernel/cutmix", _mix.cutmix(x.copy(), (2, 1, 9, 7)))
    put("mix/kernel/labels", _mix.soft_labels(np.array([0, 4, 2, 4]), 6, 0.377, 0.1))


def main(root, out_path):
    import dpu_pipe

    arrays, report = {}, {"build": {k: str(v) for k, v in dpu_pipe.build_info().items()},
                          "sections": {}}

    def put(key, value):
        arrays[key] = np.ascontiguousarray(value)

    paths = files(root)
    sections = [("decode", lambda: decode_section(paths, put)),
                ("transcode", lambda: transcode_section(paths, put)),
                ("ops", lambda: ops_section(paths, put)),
                ("blur", lambda: blur_section(paths, put)),
                ("batch", lambda: batch_section(paths, put)),
                ("permutation", lambda: permutation_section(put)),
                ("loader", lambda: loader_section(root, put)),
                ("cache", lambda: cache_section(root, put)),
                ("mix", lambda: mix_section(root, put)),
                ("views", lambda: views_section(root, put))]
    for name, fn in sections:
        before = len(arrays)
        try:
            fn()
            report["sections"][name] = f"{len(arrays) - before} arrays"
        except (ImportError, AttributeError) as exc:  # entry point not in this build
            report["sections"][name] = f"missing: {exc!r}"
        except Exception:
            report["sections"][name] = "error: " + traceback.format_exc()
    arrays["__report__"] = np.frombuffer(json.dumps(report).encode(), dtype=np.uint8)
    np.savez(out_path, **arrays)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:3])
