"""Multi-view recipes (dpu_pipe.views): the View and its presets, one decode per sample, the
views' shapes and labels in the Loader, each op against torchvision v2's functional ops with
the parameters describe() reports, and the determinism of every view's draws.

The offloaded modes' stream identity is in tests/mpi/test_views_offload.py."""
import numpy as np
import pytest

import dpu_pipe
from dpu_pipe import views as V
from dpu_pipe.errors import ConfigError
from dpu_pipe.kernel import BatchProcessor, SampleInfo
from dpu_pipe.offload import wire
from dpu_pipe.transforms import TransformConfig

import jpeg_corpus as jc

SEED, EPOCH = 5, 3
COLS = len(SampleInfo)

try:
    import torch
    import torchvision.transforms.v2.functional as F
except ImportError:          # pragma: no cover - requirements-dev.txt installs it
    torch = F = None
needs_tv = pytest.mark.skipif(F is None, reason="torchvision is not importable")


@pytest.fixture(scope="module")
def images():
    shapes = [("astronaut", 120, 160), ("coffee", 200, 90), ("chelsea", 97, 131),
              ("astronaut", 150, 199), ("coffee", 64, 64), ("chelsea", 181, 77)]
    return [jc.pil_jpeg(jc.photo_sized(n, h, w), quality=90) for n, h, w in shapes]


def _indices(n):
    return np.arange(n, dtype=np.int64) * 7919 + 3


def _run(images, indices, threads=1, **kw):
    proc = BatchProcessor(TransformConfig(**kw), num_threads=threads)
    bufs = [images[int(i) % len(images)] for i in indices]
    out, info, errors = proc.run(bufs, indices, seed=SEED, epoch=EPOCH)
    assert not errors
    return proc, out, info


def _describe(proc, images, index):
    return proc.describe(images[int(index) % len(images)], int(index), epoch=EPOCH, seed=SEED)


# --- the View, its checks and the presets --------------------------------------------------

@pytest.mark.parametrize("bad, match", [
    (dict(blur_kernel=8), "odd"),
    (dict(size=32, blur_kernel=65), "blur_kernel"),
    (dict(blur_p=1.5), "blur_p"),
    (dict(blur_sigma=(0.0, 1.0)), "blur_sigma"),
    (dict(solarize_threshold=300), "solarize_threshold"),
    (dict(interpolation="nearest"), "interpolation"),
    (dict(scale=(0.5, 0.2)), "scale"),
    (dict(color_jitter=(0.4, 0.4, 0.4, 0.7)), "color_jitter"),
    (dict(size=(0, 4)), "size"),
])
def test_view_settings_are_checked(bad, match):
    with pytest.raises(ConfigError, match=match):
        V.View(**bad)


def test_views_refuse_the_options_they_set_themselves():
    with pytest.raises(ConfigError, match="scale, auto_augment"):
        TransformConfig(views=V.simclr(32), scale=(0.2, 1.0), auto_augment="ta_wide")
    with pytest.raises(ConfigError, match="mixup_alpha"):
        TransformConfig(views=V.simclr(32), mixup_alpha=0.2, num_classes=10)
    with pytest.raises(ConfigError, match="list of dpu_pipe.views.View"):
        TransformConfig(views=V.View())
    with pytest.raises(ConfigError, match="1 to 64 views"):
        TransformConfig(views=[])


def test_presets_have_the_published_parameters():
    d = V.dino()
    assert len(d) == 10 and [v.size for v in d] == [(224, 224)] * 2 + [(96, 96)] * 8
    assert [v.blur_p for v in d] == [1.0, 0.1] + [0.5] * 8
    assert [v.solarize_p for v in d] == [0.0, 0.2] + [0.0] * 8
    assert [v.scale for v in d] == [(0.4, 1.0)] * 2 + [(0.05, 0.4)] * 8
    for v in d:
        assert (v.color_jitter, v.jitter_p, v.grayscale_p, v.flip_p) == (V.DINO_JITTER, 0.8,
                                                                          0.2, 0.5)
        assert (v.blur_kernel, v.blur_sigma, v.interpolation) == (9, (0.1, 2.0), "bicubic")
    s = V.simclr()
    assert len(s) == 2 and s[0] == s[1] and s[0].blur_kernel == 23 and s[0].blur_p == 0.5
    assert s[0].color_jitter == (0.8, 0.8, 0.8, 0.2) and s[0].jitter_p == 0.8
    assert V.simclr(96)[0].blur_kernel == 9
    b = V.byol()
    assert [(v.blur_p, v.solarize_p) for v in b] == [(1.0, 0.0), (0.1, 0.2)]
    assert b[0].blur_kernel == 23 and b[0].color_jitter == (0.4, 0.4, 0.2, 0.1)


def test_views_round_trip_through_to_dict():
    tc = TransformConfig(views=V.dino(64, 32, 3), dtype="uint8")
    d = tc.to_dict()
    assert len(d["views"]) == 5 and d["views"][1]["solarize_p"] == 0.2
    back = TransformConfig.from_dict(d)
    assert back == tc and back.views == tuple(V.dino(64, 32, 3))
    # Views larger than the recipe's default size (its validation resize is not theirs).
    assert [c.recipe.size for c, _ in
            TransformConfig(views=[V.View(size=320), V.View(size=16)]).per_view()] == \
        [(320, 320), (16, 16)]
    # A one-view transform's dict (saved states, producers' stream keys) is unchanged.
    assert "views" not in TransformConfig().to_dict()


# --- the kernel: shapes, one decode, determinism ----------------------------------------------

def test_views_shapes_and_one_decode_scale_per_sample(images):
    idx = _indices(8)
    proc, out, info = _run(images, idx, views=V.dino(48, 24, 3), dtype="float16",
                           layout="HWC")
    assert isinstance(out, list) and [o.shape for o in out] == \
        [(8, 48, 48, 3)] * 2 + [(8, 24, 24, 3)] * 3
    assert all(o.dtype == np.float16 for o in out) and info.shape == (8, 5 * COLS)
    per_view = info.reshape(8, 5, COLS)
    # One decode: every view of a sample was cut from the same region, at one DCT scale.
    assert (per_view[:, :, 6] == per_view[:, :1, 6]).all()
    for i in range(8):
        for v in range(5):
            assert np.isfinite(out[v][i].astype(np.float32)).all()


def test_view_zero_draws_what_the_one_view_recipe_draws(images):
    """View 0 with the classic recipe's parameters: the same crop, flip, jitter and
    grayscale, and, alone, the same pixels."""
    idx = _indices(12)
    kw = dict(size=40, scale=(0.3, 1.0), interpolation="bicubic",
              color_jitter=(0.4, 0.4, 0.2, 0.1), grayscale_p=0.3)
    classic, plain, pinfo = _run(images, idx, dtype="uint8", **kw)
    view = V.View(**kw)
    multi, out, info = _run(images, idx, dtype="uint8", views=[view])
    np.testing.assert_array_equal(pinfo, info)
    np.testing.assert_array_equal(plain, out[0])
    multi2, _, info2 = _run(images, idx, dtype="uint8", views=[view, V.View(size=16)])
    np.testing.assert_array_equal(pinfo[:, 1:6], info2[:, 1:6])   # crop and flip
    for index in idx[:4]:
        d = _describe(classic, images, index)
        for got in (_describe(multi, images, index)[0], _describe(multi2, images, index)[0]):
            assert {k: got[k] for k in ("crop", "flip", "jitter", "grayscale")} == \
                {k: d[k] for k in ("crop", "flip", "jitter", "grayscale")}


def test_each_view_is_a_function_of_seed_epoch_index_and_view(images):
    """Threads and batch composition do not change a view; another view list keeps the
    draws of the views they share."""
    idx = _indices(10)
    _, a, _ = _run(images, idx, views=V.byol(32), dtype="uint8")
    _, b, _ = _run(images, idx[::-1].copy(), threads=2, views=V.byol(32), dtype="uint8")
    for v in range(2):
        np.testing.assert_array_equal(a[v], b[v][::-1])
    small, _, _ = _run(images, idx[:1], views=V.dino(48, 24, 2), dtype="uint8")
    large, _, _ = _run(images, idx[:1], views=V.dino(48, 24, 5), dtype="uint8")
    for index in idx:
        ds, dl = _describe(small, images, index), _describe(large, images, index)
        for v in range(4):
            assert {k: x for k, x in ds[v].items() if k != "scale"} == \
                {k: x for k, x in dl[v].items() if k != "scale"}
        # Views differ from each other (their own streams), global 1 and 2 alike.
        assert ds[0]["crop"] != ds[1]["crop"] or ds[0]["flip"] != ds[1]["flip"]


def test_the_numpy_twin_gives_each_views_draws(images):
    """dpu_pipe.rng's view streams (rng.view_stream) give the crop, the flip and the blur
    that the kernel's view v gets, as the stream table documents."""
    from dpu_pipe import rng

    vs = [V.View(size=24, scale=(0.1, 0.9), flip_p=0.5, blur_p=0.5, blur_kernel=5,
                 blur_sigma=(0.3, 1.7)), V.View(size=16, scale=(0.3, 1.0), flip_p=0.3)]
    proc, _, _ = _run(images, _indices(1), views=vs * 2, dtype="uint8")
    for index in _indices(12):
        head = dpu_pipe.jpeg.read_header(images[int(index) % len(images)])
        h, w = head.height, head.width
        for v, d in enumerate(_describe(proc, images, index)):
            view = vs[v % 2]
            crop = rng.random_resized_crop(SEED, EPOCH, int(index), h, w, view.scale,
                                           view.ratio, view=v)
            assert d["crop"] == list(crop), (index, v)
            assert d["flip"] == rng.random_flip(SEED, EPOCH, int(index), view.flip_p, view=v)
            u0, u1 = rng.uniforms(SEED, EPOCH, int(index), rng.view_stream(rng.STREAM_BLUR, v))
            if view.blur_p > 0 and u0 < view.blur_p:
                assert d["blur"] == {"sigma": 0.3 + 1.4 * u1, "kernel": 5}
            else:
                assert d["blur"] is None


@pytest.mark.parametrize("off", ["blur_p", "solarize_p", "jitter_p", "grayscale_p", "flip_p"])
def test_turning_one_op_off_moves_no_other_draw(images, off):
    view = V.View(size=32, color_jitter=(0.4, 0.4, 0.2, 0.1), jitter_p=0.8, grayscale_p=0.4,
                  blur_p=0.6, blur_kernel=5, solarize_p=0.5, flip_p=0.5)
    on, _, _ = _run(images, _indices(1), views=[view, view], dtype="uint8")
    from dataclasses import replace
    quiet = replace(view, **{off: 0.0})
    offp, _, _ = _run(images, _indices(1), views=[quiet, quiet], dtype="uint8")
    key = {"blur_p": "blur", "solarize_p": "solarize", "jitter_p": "jitter",
           "grayscale_p": "grayscale", "flip_p": "flip"}[off]
    seen = 0
    for index in _indices(30):
        for a, b in zip(_describe(on, images, index), _describe(offp, images, index)):
            assert b[key] in (None, {}, False)
            seen += a[key] not in (None, {}, False)
            assert {k: x for k, x in a.items() if k != key} == \
                {k: x for k, x in b.items() if k != key}
    assert seen > 0


def test_jitter_is_empty_when_not_applied(images):
    proc, _, _ = _run(images, _indices(1), dtype="uint8",
                      views=[V.View(size=24, color_jitter=0.4, jitter_p=0.5)])
    got = [bool(_describe(proc, images, i)[0]["jitter"]) for i in _indices(40)]
    assert 5 < sum(got) < 35


# --- each op against torchvision v2 ------------------------------------------------------------

def _tv(img_hwc, d):
    """torchvision v2's functional ops on (h, w, 3) uint8 with describe's parameters, in the
    view's order: jitter (its order), grayscale, blur, solarize."""
    t = torch.from_numpy(np.ascontiguousarray(img_hwc)).permute(2, 0, 1).contiguous()
    for name, factor in d["jitter"].items():
        t = {"brightness": F.adjust_brightness, "contrast": F.adjust_contrast,
             "saturation": F.adjust_saturation, "hue": F.adjust_hue}[name](t, factor)
    if d["grayscale"]:
        t = F.rgb_to_grayscale(t, num_output_channels=3)
    if d["blur"] is not None:
        k, s = d["blur"]["kernel"], d["blur"]["sigma"]
        t = F.gaussian_blur(t, [k, k], [s, s])
    if d["solarize"] is not None:
        t = F.solarize(t, d["solarize"])
    return t.permute(1, 2, 0).numpy()


OPS = {
    "jitter": dict(color_jitter=(0.4, 0.4, 0.4, 0.1), jitter_p=0.8),
    "grayscale": dict(grayscale_p=0.5),
    "blur": dict(blur_p=0.7, blur_kernel=9, blur_sigma=(0.1, 2.0)),
    "solarize": dict(solarize_p=0.6, solarize_threshold=128),
    "dino-global-2": dict(color_jitter=V.DINO_JITTER, jitter_p=0.8, grayscale_p=0.2,
                          blur_p=0.5, blur_kernel=7, solarize_p=0.5),
}


@needs_tv
@pytest.mark.parametrize("op", list(OPS))
def test_ops_match_torchvision_on_the_same_view(images, op):
    """The op's output equals torchvision v2 applied, with describe()'s parameters, to the
    same view with the colour ops off (p = 0 moves no draw, so the crop is the same):
    exactly for grayscale, solarize, brightness, contrast and hue; within one level for a
    blur or a saturation blend alone."""
    idx = _indices(40)
    base = dict(size=(36, 44), scale=(0.2, 1.0), interpolation="bicubic")
    _, plain, pinfo = _run(images, idx, dtype="uint8", layout="HWC", views=[V.View(**base)])
    proc, aug, ainfo = _run(images, idx, dtype="uint8", layout="HWC",
                            views=[V.View(**base, **OPS[op])])
    np.testing.assert_array_equal(pinfo, ainfo)
    applied = 0
    for i, index in enumerate(idx):
        d = _describe(proc, images, index)[0]
        ref = _tv(plain[0][i], d)
        diff = np.abs(ref.astype(int) - aug[0][i].astype(int))
        inexact = d["blur"] is not None or "saturation" in d["jitter"]
        ops = len(d["jitter"]) + d["grayscale"] + (d["blur"] is not None) \
            + (d["solarize"] is not None)
        applied += ref.tobytes() != plain[0][i].tobytes()
        if not inexact:
            assert diff.max() == 0, (index, d)
        elif ops == 1:
            assert diff.max() <= 1, (index, d, diff.max())
        else:
            # A one-level difference of a blend can move the next op (contrast's mean, a
            # solarize threshold) by more; it stays rare.
            assert (diff > 1).mean() < 0.01, (index, d, diff.max())
    assert applied >= 10, applied


# --- the Loader ---------------------------------------------------------------------------------

def test_loader_yields_one_batch_per_view_with_the_labels(photo_folder):
    root = photo_folder(10, classes=3)
    views = V.dino(40, 24, 2)
    with dpu_pipe.Loader(root, 4, views=views, seed=SEED, num_threads=2,
                         return_meta=True) as ld:
        src = ld.source
        seen = []
        for x, y, meta in ld:
            assert isinstance(x, list) and len(x) == 4
            assert [a.shape[1:] for a in x] == [(3, 40, 40)] * 2 + [(3, 24, 24)] * 2
            assert all(a.shape[0] == len(y) and a.dtype == np.float32 for a in x)
            index = np.asarray(meta["index"])
            np.testing.assert_array_equal(y, np.asarray(src.labels)[index])
            seen += index.tolist()
        assert sorted(seen) == list(range(10))
        d = ld.describe(0, 3)
        assert isinstance(d, list) and len(d) == 4
        assert all({"crop", "flip", "jitter", "grayscale", "blur", "solarize"} <= set(v)
                   for v in d)
    # Threads, batch size and the order of reading do not change a sample's views.
    def per_sample(**kw):
        out = {}
        with dpu_pipe.Loader(root, kw.pop("batch"), views=views, seed=SEED, dtype="uint8",
                             return_meta=True, **kw) as ld:
            for x, _, meta in ld:
                for r, i in enumerate(np.asarray(meta["index"]).tolist()):
                    out[i] = [a[r].copy() for a in x]
        return out
    a = per_sample(batch=4, num_threads=1)
    b = per_sample(batch=3, num_threads=2)
    assert a.keys() == b.keys()
    for i in a:
        for u, w in zip(a[i], b[i]):
            np.testing.assert_array_equal(u, w)


def test_a_file_is_decoded_once_per_sample(photo_folder):
    """The cache of decode_max_side stores what is decoded: one entry, and one miss, per
    sample, whatever the number of views; the source is read once per sample."""
    root = photo_folder(8)
    reads = []

    class Counting(dpu_pipe.ImageFolder):
        def read(self, i):
            reads.append(i)
            return super().read(i)

    src = Counting(root)
    with dpu_pipe.Loader(src, 4, views=V.dino(32, 16, 4), decode_max_side=48,
                         cache_bytes=1 << 20, dtype="uint8", seed=SEED) as ld:
        first = [[a.copy() for a in x] for x, _ in ld]
        st = ld.stats()["cache"]
        assert st["misses"] == 8 and st["entries"] == 8 and st["hits"] == 0, st
        assert sorted(reads) == list(range(8))
        ld.set_epoch(0)
        again = [[a.copy() for a in x] for x, _ in ld]     # from the cache: the same views
        assert ld.stats()["cache"]["hits"] == 8
    for p, q in zip(first, again):
        for u, w in zip(p, q):
            np.testing.assert_array_equal(u, w)


def test_payload_layout_places_one_block_per_view():
    shapes = [(3, 8, 8), (3, 4, 4), (3, 4, 4)]
    lay = wire.PayloadLayout(5, shapes, np.float32)
    assert lay.multi_view and lay.sample_bytes == 4 * (192 + 48 + 48)
    assert lay.view_offsets == [0, wire.align(5 * 768), wire.align(5 * 768) + wire.align(5 * 192)]
    payload = np.zeros(lay.nbytes, np.uint8)
    imgs, labels, idx = lay.views(payload, 5)
    for v, a in enumerate(imgs):
        a[...] = v + 1
    got, _, _ = lay.views(payload, 3)       # a short batch: each view's first rows
    assert [g.shape for g in got] == [(3,) + s for s in shapes]
    assert [float(g.min()) for g in got] == [1.0, 2.0, 3.0]
    assert lay.end(3) == lay.images_offset + lay.view_offsets[2] + 3 * 192
    one = wire.PayloadLayout(5, (3, 8, 8), np.float32)
    assert not one.multi_view and one.end(5) == one.images_offset + 5 * 768
    tc = TransformConfig(views=V.simclr(16))
    assert wire.image_shapes(tc) == [(3, 16, 16)] * 2


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_views_reach_a_device_each_through_its_own_staging(photo_folder):
    """On a device each view is staged and copied as a one-view batch is (a staging buffer
    per view and slot, reused only after its copy completed); the values are the numpy
    stream's."""
    from fake_device import FakeDevice

    root = photo_folder(10)
    kw = dict(views=V.dino(32, 16, 2), seed=SEED, shuffle=False)
    with dpu_pipe.Loader(root, 4, **kw) as ld:
        want = [([a.copy() for a in x], y.copy()) for x, y in ld]
    dev = FakeDevice(delay=0.002)
    with dpu_pipe.Loader(root, 4, device="cuda", **kw) as ld:
        ld.out.backend = dev
        got = [(x, y) for x, y in ld]
        stats = ld.stats()
    dev.synchronize()
    assert len(got) == len(want) == 3
    for (x, y), (u, v) in zip(got, want):
        assert len(x) == 4 and np.array_equal(y.numpy(), v)
        for a, b in zip(x, u):
            assert np.array_equal(a.numpy(), b)
    assert stats["device_batches_staged"] == 3
    assert not any(c.event.overwritten for c in dev.copies)


def test_a_resumed_multi_view_loader_continues_the_stream(photo_folder):
    """state_dict carries the views (the transform's dict): a loader resumed mid-epoch
    gives the rest of the uninterrupted stream; another view list is refused."""
    root = photo_folder(10)
    kw = dict(views=V.byol(24), seed=SEED, dtype="uint8")
    with dpu_pipe.Loader(root, 3, **kw) as ld:
        whole = [[a.copy() for a in x] for x, _ in ld]
    with dpu_pipe.Loader(root, 3, **kw) as ld:
        it = iter(ld)
        next(it)
        state = ld.state_dict()
    with dpu_pipe.Loader(root, 3, **kw) as ld:
        ld.load_state_dict(state)
        rest = [[a.copy() for a in x] for x, _ in ld]
    assert len(rest) == len(whole) - 1
    for got, want in zip(rest, whole[1:]):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    with dpu_pipe.Loader(root, 3, views=V.simclr(24), seed=SEED, dtype="uint8") as other:
        with pytest.raises(ConfigError):
            other.load_state_dict(state)
