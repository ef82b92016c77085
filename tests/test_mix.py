"""Batch ops: MixUp / CutMix against torchvision.transforms.v2 given the same λ, pairing and box;
label smoothing against timm's ``mixup_target`` formula (written here in numpy); the Beta draw
against scipy's Beta distribution; the Loader's mixed stream against torchvision applied to
the plain stream with the parameters ``describe`` reports; and ``batch_hook``.
"""

from pathlib import Path

import numpy as np
import pytest

from dpu_pipe import _mix, mix, rng
from dpu_pipe.errors import ConfigError, DpuPipeError
from dpu_pipe.loader import Loader
from dpu_pipe.transforms import TransformConfig


try:
    import torch
    from torchvision.transforms import v2
except ImportError:          # pragma: no cover - requirements-dev.txt installs them
    torch = v2 = None
needs_tv = pytest.mark.skipif(v2 is None, reason="torchvision is not importable")

ROOT = Path(__file__).resolve().parents[1]
SEED, K = 31, 4
MIX = dict(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=K)


@pytest.fixture(scope="module")
def data(photo_folder):
    """13 JPEGs in 4 classes: batches of 5 leave a last batch of 3."""
    return str(photo_folder(13, classes=K, shape=(70, 5, 96, -3), quality=90))


@pytest.fixture
def hooks_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))


def _batch(dtype, layout, n, seed=0):
    r = np.random.default_rng(seed)
    shape = (n, 3, 7, 9) if layout == "CHW" else (n, 7, 9, 3)
    if dtype == "uint8":
        return r.integers(0, 256, shape, dtype=np.uint8)
    x = r.standard_normal(shape).astype(np.float32) * 3
    if dtype == "float16":
        return x.astype(np.float16)
    if dtype == "bfloat16":
        return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return x


def _as_torch_f32(x, dtype):
    if dtype == "bfloat16":
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16).float()
    return torch.from_numpy(x.astype(np.float32))


def _from_torch_f32(t, dtype):
    """torchvision's float32 result in the batch's dtype, rounded once: to nearest even for
    float16 and bfloat16 (torch's casts), half up for uint8 (the kernels' uint8 rounding)."""
    if dtype == "uint8":
        return np.floor(t.numpy() + np.float32(0.5)).astype(np.uint8)
    if dtype == "bfloat16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return t.numpy().astype(dtype)


def _chw(t, layout):
    return t if layout == "CHW" else t.permute(0, 3, 1, 2)


@needs_tv
@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("layout", ["CHW", "HWC"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "uint8"])
def test_mixup_kernel_equals_torchvision(dtype, layout, n):
    """v2.MixUp's transform with the same λ (float32 exactly; the other dtypes mixed in
    float32 and rounded once)."""
    x = _batch(dtype, layout, n)
    labels = torch.arange(n) % K
    for lam in (0.0, 0.2718, 0.5, 0.9, 1.0):
        t = _chw(_as_torch_f32(x, dtype), layout).contiguous()
        ref = v2.MixUp(num_classes=K).transform(t, {"labels": labels, "lam": lam,
                                                    "batch_size": n})
        ref = _from_torch_f32(ref if layout == "CHW" else ref.permute(0, 2, 3, 1).contiguous(),
                              dtype)
        got = _mix.mixup(x.copy(), lam, dtype)
        assert got.dtype == x.dtype
        assert np.array_equal(got, ref), (dtype, layout, n, lam)


@needs_tv
@pytest.mark.parametrize("layout", ["CHW", "HWC"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "uint8"])
def test_cutmix_kernel_equals_torchvision(dtype, layout):
    """v2.CutMix's transform with the same box, empty and whole-image boxes included."""
    for n in (1, 3, 5):
        x = _batch(dtype, layout, n, seed=n)
        for box in ((2, 1, 7, 6), (0, 0, 9, 7), (3, 3, 3, 5), (8, 6, 9, 7)):
            t = _chw(torch.from_numpy(x.view(np.int16) if dtype == "bfloat16" else x),
                     layout)
            ref = v2.CutMix(num_classes=K).transform(
                t, {"labels": torch.zeros(n, dtype=torch.int64), "box": box,
                    "lam_adjusted": 0.5, "batch_size": n})
            ref = (ref if layout == "CHW" else ref.permute(0, 2, 3, 1)).contiguous().numpy()
            got = _mix.cutmix(x.copy(), box, layout)
            assert np.array_equal(got.view(ref.dtype), ref), (dtype, layout, n, box)


@needs_tv
def test_cutmix_box_and_lam_equal_v2_make_params(monkeypatch):
    """v2.CutMix.make_params with its λ and box centre draws replaced by given values."""
    r = np.random.default_rng(5)
    for _ in range(300):
        h, w = int(r.integers(1, 60)), int(r.integers(1, 60))
        lam = float(r.choice([0.0, 1.0, r.random()]))
        r_x, r_y = int(r.integers(0, w)), int(r.integers(0, h))
        draws = iter([torch.tensor([r_x]), torch.tensor([r_y])])
        monkeypatch.setattr(torch, "randint", lambda *a, **k: next(draws))
        cm = v2.CutMix(num_classes=K)
        monkeypatch.setattr(cm._dist, "sample", lambda *a: torch.tensor(lam))
        want = cm.make_params([torch.zeros(2, 3, h, w)])
        box, lam_adj = mix.cutmix_box(lam, r_x, r_y, h, w)
        assert box == want["box"] and lam_adj == want["lam_adjusted"], (h, w, lam, r_x, r_y)


def timm_mixup_target(labels, num_classes, lam, smoothing):
    """timm.data.mixup.mixup_target in numpy, float32 as torch computes it, with the partner
    of row j being row j - 1 (torchvision's roll; timm's own is the flipped batch)."""
    off = smoothing / num_classes
    on = 1.0 - smoothing + off
    y1 = np.full((len(labels), num_classes), np.float32(off), np.float32)
    y1[np.arange(len(labels)), labels] = np.float32(on)
    y2 = np.roll(y1, 1, axis=0)
    return y1 * np.float32(lam) + y2 * np.float32(1.0 - lam)


@needs_tv
def test_soft_labels_follow_timm_and_torchvision():
    r = np.random.default_rng(2)
    for n in (1, 2, 7):
        for k in (1, 3, 10):
            labels = r.integers(0, k, n)
            for lam in (0.0, 0.33, 0.5, 1.0):
                for s in (0.0, 0.1, 0.3):
                    got = _mix.soft_labels(labels, k, lam, s)
                    assert got.dtype == np.float32 and got.shape == (n, k)
                    assert np.array_equal(got, timm_mixup_target(labels, k, lam, s))
                ref = v2.MixUp(num_classes=k)._mixup_label(torch.from_numpy(labels), lam=lam)
                assert np.array_equal(_mix.soft_labels(labels, k, lam), ref.numpy())
    with pytest.raises(ConfigError, match="row 1 has label 5"):
        _mix.soft_labels(np.array([0, 5]), 5, 0.5)


def test_beta_draws_follow_the_beta_distribution():
    """Kolmogorov-Smirnov against Beta(α, α), and the same test rejecting a wrong α (the
    check can fail)."""
    from scipy import stats

    n = 1500
    for alpha, wrong in ((0.2, 0.4), (1.0, 2.0), (2.5, 1.25)):
        lam = np.array([_mix.beta_variate(SEED, 3, i, rng.STREAM_MIX, alpha, alpha, 2)
                        for i in range(n)])
        assert lam.min() >= 0.0 and lam.max() <= 1.0
        assert stats.kstest(lam, stats.beta(alpha, alpha).cdf).pvalue > 1e-3, alpha
        assert stats.kstest(lam, stats.beta(wrong, wrong).cdf).pvalue < 1e-6, alpha
    # Asymmetric shapes, for the Gamma ratio itself.
    lam = np.array([_mix.beta_variate(7, 0, i, rng.STREAM_MIX, 0.5, 3.0) for i in range(n)])
    assert stats.kstest(lam, stats.beta(0.5, 3.0).cdf).pvalue > 1e-3


def test_beta_kernel_equals_its_numpy_twin():
    """The kernel's Beta draw and block uniforms give rng.py's bits (the documented scheme)."""
    for i in range(150):
        a = (0.1, 0.2, 1.0, 2.5, 40.0)[i % 5]
        key = (2**64 - 1 - i, i % 7, i * 2654435761 + (i << 40))
        assert _mix.beta_variate(*key, rng.STREAM_MIX, a, a, 2) == \
            rng.beta_variate(*key, rng.STREAM_MIX, a, a, 2), (key, a)
        assert _mix.uniforms(*key, rng.STREAM_MIX, i) == \
            tuple(float(v) for v in rng.uniforms(*key, rng.STREAM_MIX, i))


def test_mix_and_switch_probabilities():
    """The share of mixed batches is mix_p and CutMix's share of them mix_switch_p (binomial,
    within 4.5 standard deviations), each batch its own draw."""
    cfg = TransformConfig(size=32, mixup_alpha=0.5, cutmix_alpha=1.0, mix_p=0.7,
                          mix_switch_p=0.3, num_classes=K)
    modes = [mix.mix_params(cfg, SEED, 1, s)["mode"] for s in range(2000)]
    mixed = sum(m is not None for m in modes)
    cut = sum(m == "cutmix" for m in modes)
    assert abs(mixed - 1400) < 4.5 * np.sqrt(2000 * 0.7 * 0.3)
    assert abs(cut - 0.3 * mixed) < 4.5 * np.sqrt(mixed * 0.3 * 0.7)
    only_cut = TransformConfig(size=32, cutmix_alpha=1.0, num_classes=K)
    assert {mix.mix_params(only_cut, 0, 0, s)["mode"] for s in range(50)} == {"cutmix"}
    # Ranks draw their own λ, and a batch's draw is a pure function of its key.
    lams = [mix.mix_params(cfg, SEED, 1, 0, rank)["lam"] for rank in range(4)]
    assert len(set(lams)) == 4
    assert mix.mix_params(cfg, SEED, 1, 9) == mix.mix_params(cfg, SEED, 1, 9)


def _stream(loader, epochs=(0, 1)):
    out = []
    for e in epochs:
        loader.set_epoch(e)
        out += [(np.array(x), np.array(y), np.array(m["index"])) for x, y, m in loader]
    return out


@needs_tv
@pytest.mark.parametrize("out", [dict(dtype="float32"), dict(dtype="uint8", layout="HWC")])
def test_loader_mix_is_torchvision_on_the_plain_stream(data, out):
    """Each batch of a mixing Loader is v2.MixUp / v2.CutMix (with the batch's λ and box)
    applied to the plain Loader's batch, its labels timm's smoothed mixup_target, and
    describe() names each sample's partner, λ and box."""
    kw = dict(size=32, seed=SEED, return_meta=True, **out)
    with Loader(data, 5, **kw) as plain, Loader(data, 5, **kw, **MIX) as mixed:
        ref, got = _stream(plain), _stream(mixed)
        cfg = mixed.transform
        modes = set()
        for b, ((xp, yp, ip), (xm, ym, im)) in enumerate(zip(ref, got)):
            epoch, step = (0, b) if b < len(plain) else (1, b - len(plain))
            assert np.array_equal(ip, im)
            p = mix.mix_params(cfg, SEED, epoch, step)
            modes.add(p["mode"])
            hwc = cfg.recipe.layout == "HWC"
            t = _as_torch_f32(xp, cfg.recipe.dtype)
            t = (t.permute(0, 3, 1, 2) if hwc else t).contiguous()
            params = {"labels": torch.from_numpy(yp), "batch_size": len(yp),
                      "lam_adjusted": p["lam"], **p}
            if p["mode"] == "mixup":
                t = v2.MixUp(num_classes=K).transform(t, params)
            elif p["mode"] == "cutmix":
                t = v2.CutMix(num_classes=K).transform(t, params)
            t = (t.permute(0, 2, 3, 1) if hwc else t).contiguous()
            assert np.array_equal(xm, _from_torch_f32(t, cfg.recipe.dtype)), (b, p)
            assert ym.dtype == np.float32 and ym.shape == (len(yp), K)
            assert np.array_equal(ym, timm_mixup_target(yp, K, p["lam"], 0.1)), (b, p)
            for row, index in enumerate(im.tolist()):
                d = mixed.describe(epoch, index)["mix"]
                assert (d["step"], d["row"], d["partner"]) == (step, row,
                                                               int(im[row - 1]))
                assert (d["mode"], d["lam"]) == (p["mode"], p["lam"])
                if p["mode"] == "cutmix":
                    x1, y1, x2, y2 = p["box"]
                    assert d["box"] == [y1, x1, y2 - y1, x2 - x1]
                else:
                    assert d["box"] is None
        assert modes >= {"mixup", "cutmix"}, modes


def test_threads_and_makers_give_the_same_mixed_stream(data, hooks_importable):
    """Mixing and the hook are per batch, keyed by the batch: 1 or 2 threads, two loaders."""
    kw = dict(size=32, seed=SEED, batch_hook="tests.batch_hooks:noise", **MIX)
    with Loader(data, 4, num_threads=1, **kw) as a, Loader(data, 4, num_threads=2, **kw) as b:
        sa, sb = _stream_xy(a), _stream_xy(b)
    assert len(sa) == len(sb) == 8
    for (xa, ya), (xb, yb) in zip(sa, sb):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)


def _stream_xy(loader, epochs=(0, 1)):
    out = []
    for e in epochs:
        loader.set_epoch(e)
        out += [(np.array(x), np.array(y)) for x, y in loader]
    return out


def test_validation_never_mixes(data):
    kw = dict(train=False, size=32, seed=SEED)
    with Loader(data, 5, **kw) as plain, Loader(data, 5, **kw, **MIX) as val:
        for (xp, yp), (xv, yv) in zip(_stream_xy(plain, (0,)), _stream_xy(val, (0,))):
            assert yv.dtype == np.int64 and yv.ndim == 1
            assert np.array_equal(xp, xv) and np.array_equal(yp, yv)
        assert "mix" not in val.describe(0, 3)


def test_smoothing_alone_gives_smoothed_one_hot(data):
    with Loader(data, 5, size=32, seed=SEED) as plain, \
            Loader(data, 5, size=32, seed=SEED, label_smoothing=0.2, num_classes=6) as sm:
        for (xp, yp), (xs, ys) in zip(_stream_xy(plain, (0,)), _stream_xy(sm, (0,))):
            assert np.array_equal(xp, xs)
            assert np.array_equal(ys, timm_mixup_target(yp, 6, 1.0, 0.2))
        assert sm.describe(0, 2)["mix"]["mode"] is None


@pytest.mark.parametrize("kw, match", [
    (dict(mixup_alpha=0.2), "need num_classes"),
    (dict(mixup_alpha=-1, num_classes=3), "mixup_alpha must be"),
    (dict(cutmix_alpha=float("nan"), num_classes=3), "cutmix_alpha must be finite"),
    (dict(mix_switch_p=1.5), "mix_switch_p"),
    (dict(mix_p=-0.1), "mix_p"),
    (dict(label_smoothing=2.0, num_classes=3), "label_smoothing"),
    (dict(num_classes=0), "num_classes"),
    (dict(batch_hook="no colon"), "batch_hook must be 'module:function'"),
    (dict(batch_hook=print), "batch_hook must be 'module:function'"),
])
def test_batch_op_settings_are_checked(kw, match):
    with pytest.raises(ConfigError, match=match):
        TransformConfig(**kw)


def test_bad_hooks_and_labels_are_named(data, hooks_importable, tmp_path):
    with pytest.raises(ConfigError, match="'no_such_module_x:f'.*cannot import"):
        Loader(data, 4, batch_hook="no_such_module_x:f")
    with pytest.raises(ConfigError, match="'tests.batch_hooks:nope'.*no function 'nope'"):
        Loader(data, 4, batch_hook="tests.batch_hooks:nope")
    with Loader(data, 4, size=32, mixup_alpha=1.0, num_classes=3) as few:
        with pytest.raises(DpuPipeError, match=r"sample \d+ has label 3, outside 0..2"):
            _stream_xy(few, (0,))
    from dpu_pipe.sources import FileList

    src = FileList([(str(p), 0.5) for p in sorted(Path(data).rglob("*.jpg"))])
    with pytest.raises(ConfigError, match="one integer class per sample"):
        Loader(src, 4, mixup_alpha=1.0, num_classes=3)


def test_hook_gets_the_batch_and_its_generator(data, hooks_importable):
    """The hook's effect equals the hook applied by hand, after mixing, to the batch with
    mix.hook_rng(seed, epoch, step); a hook may return new arrays instead."""
    from tests import batch_hooks

    kw = dict(size=32, seed=SEED, **MIX)
    with Loader(data, 5, **kw) as ref, \
            Loader(data, 5, batch_hook="tests.batch_hooks:noise", **kw) as hooked, \
            Loader(data, 5, batch_hook="tests.batch_hooks:reverse_rows", **kw) as rev:
        for step, ((x, y), (xh, yh), (xr, yr)) in enumerate(zip(
                _stream_xy(ref, (1,)), _stream_xy(hooked, (1,)), _stream_xy(rev, (1,)))):
            want = x.copy()
            batch_hooks.noise(want, y.copy(), mix.hook_rng(SEED, 1, step))
            assert np.array_equal(xh, want) and np.array_equal(yh, y)
            assert not np.array_equal(xh, x)
            assert np.array_equal(xr, x[::-1]) and np.array_equal(yr, y[::-1])


def test_hook_errors_name_the_batch_and_do_not_hang(data, hooks_importable):
    with Loader(data, 4, size=32, seed=SEED, batch_hook="tests.batch_hooks:always_fails",
                timeout=60) as bad:
        with pytest.raises(DpuPipeError, match=r"batch_hook 'tests.batch_hooks:always_fails'"
                                               r" raised on batch 0 of epoch 0.*broken hook"):
            next(iter(bad))
    with Loader(data, 4, size=32, batch_hook="tests.batch_hooks:wrong_shape") as bad:
        with pytest.raises(DpuPipeError, match="must return None or"):
            next(iter(bad))
