"""The batch kernel (BatchProcessor) against its parts: per sample, the region decode of
``dpu_pipe.jpeg`` followed by ``dpu_pipe.ops.resize_crop`` on the box scaled into the decoded
region, with the crop and flip of the Python RNG twin (``dpu_pipe.rng``) — bit for bit, for
any thread count, sample order and batch split, and with a bad sample failing alone.
"""

import math

import numpy as np
import pytest

from dpu_pipe import ConfigError, DecodeError, jpeg, ops, rng
from dpu_pipe.kernel import SampleInfo, BatchProcessor
from dpu_pipe.transforms import TransformConfig

import jpeg_corpus as jc

SEED, EPOCH = 1234, 3
COL = {name: k for k, name in enumerate(SampleInfo)}

# (photo, height, width, encoder options): odd sizes, every chroma subsampling, progressive,
# grayscale and CMYK files, sizes that make the kernel pick each DCT scale for size 32.
SAMPLES = [
    ("astronaut", 120, 160, {}),
    ("coffee", 200, 90, {"subsampling": "444"}),
    ("chelsea", 64, 64, {"subsampling": "422"}),
    ("astronaut", 150, 199, {"progressive": True}),
    ("coffee", 97, 131, {"quality": 95}),
    ("chelsea", 77, 181, {"gray": True}),
    ("astronaut", 133, 101, {"mode": "CMYK"}),
    ("coffee", 199, 187, {"subsampling": "444", "quality": 60}),
]


def _encode(name, h, w, opts):
    opts = dict(opts)
    img = jc.photo_sized(name, h, w)
    if opts.pop("gray", False):
        img = np.ascontiguousarray(img[..., 1])
    return jc.pil_jpeg(img, **opts)


@pytest.fixture(scope="module")
def images():
    return [_encode(*s) for s in SAMPLES]


@pytest.fixture(scope="module")
def indices():
    # Sample indices far apart (they key the RNG), not in order.
    return np.array([5, 0, 17, 2**40 + 3, 9, 123456, 31, 4], dtype=np.int64)


def _header(data):
    h = jpeg.read_header(data)
    return h.height, h.width


def reference_sample(data, index, cfg, *, seed=SEED, epoch=EPOCH):
    """One sample made from the public parts: returns (output, (top, left, h, w, flip, scale))."""
    H, W = _header(data)
    cfg = cfg.recipe
    oh, ow = cfg.size
    kw = dict(dtype=cfg.dtype, layout=cfg.layout, mean=cfg.mean, std=cfg.std)
    if cfg.train:
        top, left, h, w = rng.random_resized_crop(seed, epoch, index, H, W, cfg.scale, cfg.ratio)
        flip = rng.random_flip(seed, epoch, index, cfg.flip_p)
        scale = jpeg.choose_scale(h, w, (oh, ow))
        img = jpeg.decode(data, region=(top, left, h, w), min_size=(oh, ow))
        f = scale / 8
        # The decoded region starts at the scaled pixel that covers the box's first one.
        r0, c0 = top * scale // 8, left * scale // 8
        out = ops.resize_crop(img, (top * f - r0, left * f - c0, h * f, w * f), (oh, ow),
                              flip=flip, **kw)
        return out, (top, left, h, w, int(flip), scale)
    box = ops.center_crop_box(H, W, (oh, ow), cfg.resize)
    top, left, h, w = (int(math.floor(v)) for v in box)
    scale = jpeg.choose_scale(h, w, (oh, ow))
    f = scale / 8
    # Validation resizes the whole image: reference on the whole image decoded at that scale.
    full = jpeg.decode(data, min_size=(H * scale // 8, W * scale // 8))
    assert full.shape[:2] == (-(-H * scale // 8), -(-W * scale // 8))
    out = ops.resize_crop(full, tuple(v * f for v in box), (oh, ow), **kw)
    return out, (top, left, h, w, 0, scale)


CONFIGS = {
    "train-f32-CHW": dict(train=True, size=32),
    "train-u8-CHW": dict(train=True, size=32, dtype="uint8"),
    "train-f16-HWC": dict(train=True, size=32, dtype="float16", layout="HWC"),
    "train-f32-HWC-24x40": dict(train=True, size=(24, 40), layout="HWC"),
    "train-u8-scale-ratio-flip0.9": dict(train=True, size=32, dtype="uint8",
                                         scale=(0.3, 0.6), ratio=(0.5, 2.0), flip_p=0.9),
    "train-f32-mean-std": dict(train=True, size=32, mean=(0.5, 0.4, 0.3), std=(0.1, 0.2, 0.3)),
    "val-f32-CHW": dict(train=False, size=32),
    "val-u8-HWC": dict(train=False, size=32, dtype="uint8", layout="HWC"),
    "val-f16-CHW-resize48": dict(train=False, size=32, dtype="float16", resize=48),
    "val-u8-CHW-24x40-resize46": dict(train=False, size=(24, 40), dtype="uint8", resize=46),
}


@pytest.mark.parametrize("options", list(CONFIGS.values()), ids=list(CONFIGS))
def test_batch_equals_decode_then_resize_crop(images, indices, options):
    cfg = TransformConfig(**options)
    out, info, errors = BatchProcessor(cfg, 2).run(images, indices, epoch=EPOCH, seed=SEED)
    assert errors == {}
    assert out.shape == (len(images),) + cfg.sample_shape and out.dtype == cfg.np_dtype
    assert info.dtype == np.int32 and info.shape == (len(images), len(SampleInfo))
    assert (info[:, COL["status"]] == 0).all()
    for i, data in enumerate(images):
        ref, params = reference_sample(data, int(indices[i]), cfg)
        assert tuple(int(v) for v in info[i, 1:]) == params, f"sample {i}"
        assert np.array_equal(out[i], ref), f"sample {i} ({SAMPLES[i]}) differs"


def test_scales_and_flips_are_exercised(images, indices):
    """The reference test above covers several DCT scales and both flip values."""
    info = BatchProcessor(TransformConfig(size=32), 1).run(images, indices, epoch=EPOCH,
                                                             seed=SEED)[1]
    assert len(set(info[:, COL["scale"]].tolist())) >= 2
    assert set(info[:, COL["flip"]].tolist()) == {0, 1}


@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
def test_bit_identical_for_threads_order_and_split(images, indices, train):
    cfg = TransformConfig(train=train, size=32)
    ref, ref_info, _ = BatchProcessor(cfg, 1).run(images, indices, epoch=EPOCH, seed=SEED)
    order = np.random.default_rng(0).permutation(len(images))
    for threads in (1, 2, 4):
        bp = BatchProcessor(cfg, threads)
        for split in ([len(images)], [3, 5], [1, 1, 6], [1] * len(images)):
            got = np.empty_like(ref)
            got_info = np.empty_like(ref_info)
            start = 0
            for n in split:
                pos = order[start:start + n]
                out, info, errors = bp.run([images[p] for p in pos], indices[pos],
                                           epoch=EPOCH, seed=SEED)
                assert errors == {}
                got[pos], got_info[pos] = out, info
                start += n
            assert np.array_equal(got, ref), (threads, split)
            assert np.array_equal(got_info, ref_info), (threads, split)
        # The same processor again, into a caller's buffer: no state carried between batches.
        out = bp.empty(len(images))
        assert bp.run(images, indices, epoch=EPOCH, seed=SEED, out=out)[0] is out
        assert np.array_equal(out, ref)


def test_same_bytes_same_index_same_output(images):
    """A sample's output depends on its bytes and index, not on its position or neighbours."""
    bp = BatchProcessor(TransformConfig(size=32, dtype="uint8"), 2)
    data = images[0]
    out, info, _ = bp.run([data, images[1], data, data], np.array([7, 7, 8, 7]), epoch=EPOCH,
                          seed=SEED)
    assert np.array_equal(out[0], out[3]) and np.array_equal(info[0], info[3])
    assert not np.array_equal(info[0], info[2])  # another index: another crop


def test_train_crop_and_flip_follow_the_python_twin():
    """Crop box and flip of each sample equal dpu_pipe.rng's, over many indices, seeds and
    epochs, for default and custom scale/ratio/flip_p (one small image, many samples)."""
    data = _encode("astronaut", 90, 140, {})
    H, W = _header(data)
    n = 300
    idx = np.arange(n, dtype=np.int64) * 7919 + 11
    for seed, epoch, opts in [(0, 0, {}), (SEED, EPOCH, {}), (2**64 - 1, 2**32 - 1, {}),
                              (5, 1, dict(scale=(0.5, 0.9), ratio=(0.2, 5.0), flip_p=0.25)),
                              (6, 2, dict(scale=(1.0, 1.0), ratio=(1.0, 1.0), flip_p=1.0))]:
        cfg = TransformConfig(size=16, dtype="uint8", **opts)
        info = BatchProcessor(cfg, 2).run([data] * n, idx, epoch=epoch, seed=seed)[1]
        top, left, h, w = rng.random_resized_crop(seed, epoch, idx, H, W, cfg.recipe.scale,
                                                  cfg.recipe.ratio)
        flip = rng.random_flip(seed, epoch, idx, cfg.recipe.flip_p)
        assert np.array_equal(info[:, COL["top"]], top)
        assert np.array_equal(info[:, COL["left"]], left)
        assert np.array_equal(info[:, COL["height"]], h)
        assert np.array_equal(info[:, COL["width"]], w)
        assert np.array_equal(info[:, COL["flip"]].astype(bool), flip)
    # Another epoch or seed gives other crops.
    cfg = TransformConfig(size=16, dtype="uint8")
    a = BatchProcessor(cfg).run([data] * 20, idx[:20], epoch=0, seed=0)[1]
    b = BatchProcessor(cfg).run([data] * 20, idx[:20], epoch=1, seed=0)[1]
    c = BatchProcessor(cfg).run([data] * 20, idx[:20], epoch=0, seed=1)[1]
    assert not np.array_equal(a, b) and not np.array_equal(a, c)


def test_val_is_the_center_crop_box(images):
    cfg = TransformConfig(train=False, size=32)
    idx = np.arange(len(images), dtype=np.int64)
    info = BatchProcessor(cfg).run(images, idx)[1]
    for i, data in enumerate(images):
        H, W = _header(data)
        box = ops.center_crop_box(H, W, 32, cfg.recipe.resize)
        assert tuple(info[i, 1:5]) == tuple(int(math.floor(v)) for v in box)
        assert info[i, COL["flip"]] == 0
    # Validation ignores the RNG: another seed or epoch gives the very same batch.
    bp = BatchProcessor(cfg)
    assert np.array_equal(bp.run(images, idx, epoch=0, seed=0)[0],
                          bp.run(images, idx + 100, epoch=9, seed=77)[0])


def test_val_non_square_size_with_default_resize(images, indices):
    """torchvision's Resize(round(24 / 0.875)) + CenterCrop((24, 40)) works on any image (it
    pads when needed); here the default resize must at least make such a config usable."""
    cfg = TransformConfig(train=False, size=(24, 40))
    out, info, errors = BatchProcessor(cfg).run(images, indices)
    assert errors == {}


def test_dtypes_and_layouts_are_one_computation(images, indices):
    """float16 is the float32 result rounded; HWC is CHW transposed; uint8 is not normalized
    (flat mean 0, std 1/255 in float32 gives the same values before rounding)."""
    def run(**kw):
        return BatchProcessor(TransformConfig(size=32, **kw), 2).run(
            images, indices, epoch=EPOCH, seed=SEED)[0]
    f32 = run()
    assert f32.dtype == np.float32 and f32.shape == (len(images), 3, 32, 32)
    f16 = run(dtype="float16")
    assert f16.dtype == np.float16 and np.array_equal(f16, f32.astype(np.float16))
    hwc = run(layout="HWC")
    assert hwc.shape == (len(images), 32, 32, 3)
    assert np.array_equal(hwc, f32.transpose(0, 2, 3, 1))
    u8 = run(dtype="uint8")
    assert u8.dtype == np.uint8
    raw = run(mean=(0, 0, 0), std=(1 / 255,) * 3)   # the resampled values, unrounded
    assert np.abs(u8.astype(np.float32) - np.clip(raw, 0, 255)).max() <= 0.5 + 1e-3
    assert np.array_equal(run(dtype="uint8", layout="HWC"), u8.transpose(0, 2, 3, 1))


def _bad_inputs(good):
    scan = jc.first_scan_data(good)
    return {
        "garbage-header": good[:2] + bytes(range(200)) + good[202:],
        "zero-height": jc.patch_size(good, 0, 40),
        "truncated": good[:scan + 16],
        "empty": b"",
        "not-jpeg": b"\x89PNG\r\n\x1a\n" + bytes(100),
    }


@pytest.mark.parametrize("kind", list(_bad_inputs(jc.pil_jpeg(np.zeros((8, 8, 3), np.uint8)))))
@pytest.mark.parametrize("threads", [1, 3])
def test_bad_sample_fails_alone(images, indices, kind, threads):
    bad = _bad_inputs(images[0])[kind]
    cfg = TransformConfig(size=32)
    bp = BatchProcessor(cfg, threads)
    clean = bp.run(images, indices, epoch=EPOCH, seed=SEED)[0]
    for pos in (0, 3, len(images) - 1):
        batch = list(images)
        batch[pos] = bad
        out, info, errors = bp.run(batch, indices, epoch=EPOCH, seed=SEED)
        assert list(errors) == [pos]
        err = errors[pos]
        assert isinstance(err, DecodeError) and err.index == int(indices[pos])
        assert f"sample {int(indices[pos])}" in str(err)
        assert info[pos, COL["status"]] < 0
        ok = np.arange(len(images)) != pos
        assert (info[ok, COL["status"]] == 0).all()
        assert np.array_equal(out[ok], clean[ok])


def test_several_bad_samples_in_one_batch(images, indices):
    bads = list(_bad_inputs(images[0]).values())
    batch = [bads[0], images[1], bads[1], images[3], bads[2], bads[3], images[6], bads[4]]
    out, info, errors = BatchProcessor(TransformConfig(size=32), 2).run(
        batch, indices, epoch=EPOCH, seed=SEED)
    assert sorted(errors) == [0, 2, 4, 5, 7]
    assert {e.index for e in errors.values()} == {int(indices[j]) for j in (0, 2, 4, 5, 7)}
    clean = BatchProcessor(TransformConfig(size=32), 1).run(images, indices, epoch=EPOCH,
                                                            seed=SEED)[0]
    for j in (1, 3, 6):
        assert np.array_equal(out[j], clean[j])


@pytest.mark.parametrize("bad", [
    pytest.param(dict(out=np.empty((8, 3, 32, 32), np.float64)), id="out-dtype"),
    pytest.param(dict(out=np.empty((8, 3, 32, 31), np.float32)), id="out-shape"),
    pytest.param(dict(out=np.empty((8, 32, 32, 3), np.float32).transpose(0, 3, 1, 2)),
                 id="out-not-contiguous"),
    pytest.param(dict(indices=np.arange(7)), id="indices-length"),
    pytest.param(dict(indices=np.arange(8) - 1), id="indices-negative"),
    pytest.param(dict(epoch=-1), id="epoch-negative"),
    pytest.param(dict(epoch=2**32), id="epoch-too-large"),
    pytest.param(dict(seed=2**64), id="seed-too-large"),
])
def test_run_arguments_are_checked(images, indices, bad):
    kw = dict(indices=indices, epoch=0, seed=0)
    kw.update(bad)
    with pytest.raises(ConfigError):
        BatchProcessor(TransformConfig(size=32)).run(images, kw.pop("indices"), **kw)


@pytest.mark.parametrize("bad", [
    pytest.param(dict(num_threads=0), id="threads-0"),
    pytest.param(dict(config="train"), id="config-str"),
    pytest.param(dict(config={"size": 32, "colour": "red"}), id="config-unknown-key"),
])
def test_processor_arguments_are_checked(bad):
    with pytest.raises(ConfigError):
        BatchProcessor(**bad)


def test_one_processor_called_from_several_threads(images, indices):
    """Calls from several threads take turns on the processor's decoders and scratch memory
    (sharing them crashed): each thread gets the batch a lone call gives."""
    import threading

    proc = BatchProcessor(TransformConfig(size=48, dtype="uint8"), num_threads=2)
    want = [proc.run(images, indices, epoch=e, seed=SEED)[0] for e in range(4)]
    got, errors = [None] * 4, []

    def work(e):
        try:
            for _ in range(3):
                got[e] = proc.run(images, indices, epoch=e, seed=SEED)[0]
        except BaseException as exc:   # noqa: B902 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(e,)) for e in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    for e in range(4):
        np.testing.assert_array_equal(got[e], want[e])
