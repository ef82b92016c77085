"""What a PyTorch user passes to a loader: dataset paths, argument checks in one place, dtypes
(numpy, torch, bfloat16), channels_last, devices (their copy logic: test_device.py), rank
defaults — and the Cython kernels raising dpu_pipe's own errors."""

import io

import numpy as np
import pytest
from PIL import Image

import jpeg_corpus as jc
from dpu_pipe import ConfigError, DecodeError, Loader, TransformConfig, pack
from dpu_pipe import _jpeg, _pipeline
from dpu_pipe.device import BatchOutput
from dpu_pipe.loader import default_shard
from dpu_pipe.sources import FileList, ImageFolder, PackedSource

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(120)

N = 10
KW = dict(size=24, seed=3, shuffle=False, drop_last=False)


@pytest.fixture(scope="module")
def folder(photo_folder):
    """An ImageFolder of N samples, label = index (the session's, shared: read only)."""
    return photo_folder(N)


def sample(folder, i):
    return folder / f"c{i:03d}" / f"{i:03d}.jpg"


@pytest.fixture(scope="module")
def data(folder, tmp_path_factory):
    """The folder's samples as a .txt and a .csv list and a packed file, in a directory of
    this module's own."""
    d = tmp_path_factory.mktemp("user")
    rows = [(str(sample(folder, i)), i) for i in range(N)]
    (d / "list.txt").write_text("".join(f"{p} {i}\n" for p, i in rows))
    (d / "list.csv").write_text("path,label\n" + "".join(f"{p},{i}\n" for p, i in rows))
    pack(ImageFolder(folder), d / "data.dpk", progress=False)
    return d


def batches(loader):
    return [(np.array(x.float() if hasattr(x, "float") else x), np.array(y)) for x, y in loader]


# --- Loader(path) -----------------------------------------------------------------------------

@pytest.mark.parametrize("name, kind", [("folder", ImageFolder), ("data.dpk", PackedSource),
                                        ("list.txt", FileList), ("list.csv", FileList)])
def test_loader_accepts_a_dataset_path(data, folder, name, kind):
    path = folder if name == "folder" else data / name
    with Loader(path, 4, **KW) as by_path, Loader(ImageFolder(folder), 4, **KW) as by_source:
        assert isinstance(by_path.source, kind)
        got, ref = batches(by_path), batches(by_source)
    assert len(got) == len(ref) == 3
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
               for a, b in zip(got, ref))


@pytest.mark.parametrize("what, message", [
    ("notes.json", "is not a dataset"), ("missing", "does not exist"), (42, "source must be"),
    (["a.jpg"], "a list of paths must all be tar shards or all Parquet")])
def test_loader_rejects_what_is_not_a_dataset(data, what, message):
    if isinstance(what, str):
        if what == "notes.json":
            (data / what).write_text("{}")
        what = str(data / what)
    with pytest.raises(ConfigError, match=message):
        Loader(what, 4)


# --- one validation module ---------------------------------------------------------------------

@pytest.mark.parametrize("kw, name", [
    (dict(train="no"), "train"), (dict(shuffle="no"), "shuffle"), (dict(copy=1), "copy"),
    (dict(drop_last="False"), "drop_last"), (dict(pin_memory="yes"), "pin_memory"),
    (dict(fast="yes"), "fast"), (dict(prefetch=True), "prefetch"),
    (dict(num_threads=0), "num_threads"), (dict(timeout=float("inf")), "timeout"),
    (dict(mean=(0.5, float("nan"), 0.5)), "mean"), (dict(std=(1, 1, float("inf"))), "std"),
    (dict(ratio=(0.75, float("nan"))), "ratio"), (dict(scale=(float("nan"), 1)), "scale"),
    (dict(flip_p=float("nan")), "flip_p"), (dict(size=(24, True)), "size"),
    (dict(dtype="float64"), "dtype"), (dict(dtype=np.int32), "dtype"),
    (dict(layout="NCHW"), "layout"), (dict(output="jax"), "output"),
    (dict(memory_format="nhwc"), "memory_format"),
])
def test_bad_arguments_are_config_errors_naming_them(folder, kw, name):
    with pytest.raises(ConfigError, match=name):
        Loader(folder, 4, **{**KW, **kw})


@pytest.mark.parametrize("field, value", [("mean", (0.4, float("nan"), 0.4)),
                                          ("std", (0.2, 0.2, float("inf"))),
                                          ("ratio", (float("nan"), 1.0)), ("train", "no")])
def test_transform_config_rejects_before_the_kernel(field, value):
    with pytest.raises(ConfigError, match=field):
        TransformConfig(**{field: value})


def test_kernels_raise_dpu_pipe_errors():
    good = jc.pil_jpeg(jc.photo_sized("coffee", 32, 48))
    with pytest.raises(DecodeError, match="JPEG"):
        _jpeg.read_header(b"not a jpeg at all", 10**8, 100)
    with pytest.raises(DecodeError):
        _jpeg.decode(good[:40], None, 0, 0, False, False, 10**8, 100)
    with pytest.raises(ConfigError, match="not inside"):
        _jpeg.decode(good, (30, 0, 10, 10), 0, 0, False, False, 10**8, 100)
    with pytest.raises(ConfigError, match="offsets and lengths"):
        _jpeg.BufferList.from_packed(np.zeros(8, np.uint8), np.zeros(2, np.int64),
                                     np.zeros(1, np.int64))
    cfg = TransformConfig(size=8).to_dict()
    with pytest.raises(ConfigError, match="num_threads"):
        _pipeline.Pipeline(cfg, 0)
    with pytest.raises(ConfigError, match="scale"):
        _pipeline.Pipeline({**cfg, "scale": [0.5, 0.1]}, 1)


# --- dtypes, layouts, devices ------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(folder):
    with Loader(folder, 4, **KW) as loader:
        return batches(loader)


@pytest.mark.parametrize("dtype", ["float32", np.float32, np.dtype("float32"),
                                   torch.float32], ids=str)
def test_dtype_as_string_numpy_or_torch(folder, reference, dtype):
    with Loader(folder, 4, dtype=dtype, **KW) as loader:
        x, _ = next(iter(loader))
        assert isinstance(x, torch.Tensor) == (dtype is torch.float32)
        assert np.array_equal(np.asarray(x), reference[0][0])


def test_float16_from_torch_dtype(folder, reference):
    with Loader(folder, 4, dtype=torch.float16, **KW) as loader:
        x, y = next(iter(loader))
    assert x.dtype == torch.float16 and y.dtype == torch.int64
    np.testing.assert_allclose(x.float().numpy(), reference[0][0], atol=2e-2, rtol=1e-3)


def test_bfloat16_is_the_float32_stream_rounded(folder, reference):
    """The kernel writes bfloat16 itself: bit for bit what torch makes of the float32 stream."""
    with Loader(folder, 4, dtype="bfloat16", **KW) as loader:
        got = [(x.clone(), y) for x, y in loader]
        assert loader.transform.sample_bytes == 3 * 24 * 24 * 2
    assert len(got) == len(reference)
    for (x, y), (rx, ry) in zip(got, reference):
        assert x.dtype == torch.bfloat16 and x.shape == rx.shape
        assert torch.equal(x.view(torch.int16), torch.from_numpy(rx).to(torch.bfloat16)
                           .view(torch.int16))
        assert np.array_equal(y.numpy(), ry)


@pytest.mark.parametrize("layout", ["CHW", "HWC"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
def test_bfloat16_kernel_matches_torch_rounding(folder, layout, train):
    from dpu_pipe.kernel import BatchProcessor
    bufs = [sample(folder, i).read_bytes() for i in range(N)]
    idx = np.arange(N)
    f32 = BatchProcessor(TransformConfig(size=(20, 28), layout=layout, train=train)) \
        .run(bufs, idx, seed=2)[0]
    bf = BatchProcessor(TransformConfig(size=(20, 28), layout=layout, train=train,
                                        dtype="bfloat16")).run(bufs, idx, seed=2)[0]
    assert bf.dtype == np.uint16
    want = torch.from_numpy(f32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bf, want)


def test_bfloat16_needs_torch_output(folder):
    with pytest.raises(ConfigError, match="output='torch'"):
        Loader(folder, 4, dtype="bfloat16", output="numpy")


def test_channels_last_is_nhwc_memory_with_nchw_shape(folder, reference):
    with Loader(folder, 4, memory_format=torch.channels_last, **KW) as loader:
        x, _ = next(iter(loader))
        assert x.shape == (4, 3, 24, 24)
        assert x.is_contiguous(memory_format=torch.channels_last)
        assert not x.is_contiguous()
        assert np.array_equal(x.numpy(), reference[0][0])


def test_device_cpu_yields_tensors_like_output_torch(folder, reference):
    with Loader(folder, 4, device="cpu", **KW) as loader:
        got = [(x.clone(), y) for x, y in loader]
    assert all(x.device.type == "cpu" and np.array_equal(x.numpy(), r[0])
               for (x, _), r in zip(got, reference))


def test_pin_memory_without_an_accelerator_warns_and_yields_cpu_tensors(folder, reference):
    if torch.cuda.is_available():
        pytest.skip("an accelerator is present: pinning works")
    with pytest.warns(RuntimeWarning, match="no accelerator"):
        loader = Loader(folder, 4, pin_memory=True, **KW)
    with loader:
        x, _ = next(iter(loader))
    assert isinstance(x, torch.Tensor) and np.array_equal(x.numpy(), reference[0][0])


def test_output_spec_chooses_torch_for_torch_options():
    assert BatchOutput().output == "numpy"
    assert BatchOutput(dtype=torch.float16).output == "torch"
    assert BatchOutput(memory_format="channels_last").kernel_layout == "HWC"
    with pytest.raises(ConfigError, match="layout"):
        BatchOutput(memory_format=torch.channels_last, layout="HWC")


# --- rank defaults -----------------------------------------------------------------------------

def test_rank_defaults_warn_in_a_multi_rank_job(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.warns(RuntimeWarning, match="WORLD_SIZE=4"):
        assert default_shard(None, None) == (0, 1)
    assert default_shard(2, 4) == (2, 4)


def test_rank_defaults_single_process_is_quiet(monkeypatch, recwarn):
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    assert default_shard(None, None) == (0, 1)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


# --- any image -------------------------------------------------------------------------------

def _encoded(arr, fmt, **kw):
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
def test_other_formats_posing_as_jpg_take_the_same_fused_pass(tmp_path, train):
    """PNG, WebP, BMP, TIFF and GIF files named .jpg decode through OpenCV into the same
    crop/resample/flip/normalize pass: with the pixels of a JPEG (decoded at full scale, as
    the JPEG path does at this size) the output is bit-identical to the JPEG's."""
    from dpu_pipe import jpeg
    from dpu_pipe.kernel import BatchProcessor

    jpg = jc.pil_jpeg(jc.photo_sized("chelsea", 64, 80), quality=95)
    rgb = jpeg.decode(jpg)
    gif = _encoded(rgb, "GIF")
    with Image.open(io.BytesIO(gif)) as im:
        gif_rgb = np.asarray(im.convert("RGB"))
    files = [("jpeg", jpg, jpg), ("png", _encoded(rgb, "PNG"), jpg),
             ("webp", _encoded(rgb, "WEBP", lossless=True), jpg),
             ("bmp", _encoded(rgb, "BMP"), jpg), ("tiff", _encoded(rgb, "TIFF"), jpg),
             ("gif", gif, _encoded(gif_rgb, "PNG")),
             ("cmyk", jc.pil_jpeg(jc.photo_sized("coffee", 60, 70), mode="CMYK"), None)]
    rows = []
    for i, (name, data, _) in enumerate(files):
        (tmp_path / f"{i}_{name}.jpg").write_bytes(data)
        rows.append((str(tmp_path / f"{i}_{name}.jpg"), i))
    kw = dict(train=train, size=48, seed=5, shuffle=False, drop_last=False)
    with Loader(FileList(rows), len(rows), **kw) as loader:
        images, labels = next(iter(loader))
        stats = loader.stats()
    assert labels.tolist() == list(range(len(rows)))
    assert stats["other_formats"] == 5              # png, webp, bmp, tiff, gif; not the JPEGs
    bp = BatchProcessor(TransformConfig(train=train, size=48), 1)
    for i, (name, _, ref_bytes) in enumerate(files):
        if ref_bytes is None:
            continue
        ref, info, errors = bp.run([ref_bytes], np.array([i]), seed=5)
        assert not errors and info[0, 6] == 8, name   # the reference decoded at full scale
        assert np.array_equal(images[i], ref[0]), name


def test_undecodable_non_jpeg_is_a_decode_error_naming_the_file(tmp_path):
    bad = tmp_path / "x.jpg"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    with Loader(FileList([(str(bad), 0)]), 1, size=16) as loader:
        with pytest.raises(DecodeError, match="neither a JPEG") as info:
            next(iter(loader))
    assert info.value.path == str(bad)


# --- labels beyond one int ---------------------------------------------------------------------

@pytest.mark.parametrize("labels, dtype, shape", [
    ([0.5 * i for i in range(N)], np.float32, ()),
    ([(i % 2, i % 3, 1) for i in range(N)], np.int64, (3,)),
    ([(0.1 * i, -i) for i in range(N)], np.float32, (2,))], ids=["float", "multi", "multi-float"])
def test_loader_yields_float_and_multi_labels(folder, labels, dtype, shape):
    rows = [(str(sample(folder, i)), lab) for i, lab in enumerate(labels)]
    src = FileList(rows)
    with Loader(src, 4, **KW) as loader, Loader(folder, 4, **KW) as ref_loader:
        got, ref = list(batches(loader)), batches(ref_loader)
    want = np.asarray(labels, dtype=dtype)
    for k, ((x, y), (rx, _)) in enumerate(zip(got, ref)):
        assert y.dtype == dtype and y.shape == (len(x),) + shape
        assert np.array_equal(y, want[4 * k:4 * k + len(x)])
        assert np.array_equal(x, rx)
