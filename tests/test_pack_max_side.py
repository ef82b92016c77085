"""dpu-pipe pack --max-side: a lossy pack-time downscale, off by default."""

import io
import json
import os

import numpy as np
import pytest
from PIL import Image, JpegImagePlugin

from dpu_pipe import jpeg
from dpu_pipe.errors import ConfigError
from dpu_pipe.packed import format as fmt
from dpu_pipe.packed.writer import RESIZE_QUALITY, pack
from dpu_pipe.sources import open_path
from dpu_pipe.tools import cli
from dpu_pipe.tools.sample_data import make_imagenet_like

N = 16
SIDE = 200


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    make_imagenet_like(root, n=N, classes=4, seed=11)
    return root


@pytest.fixture(scope="module")
def source(photos):
    return open_path(str(photos))


@pytest.fixture(scope="module")
def default(source, tmp_path_factory):
    return pack(source, tmp_path_factory.mktemp("a") / "ds", progress=False)


@pytest.fixture(scope="module")
def small(source, tmp_path_factory):
    return pack(source, tmp_path_factory.mktemp("b") / "ds", progress=False, max_side=SIDE)


def _size(data):
    h = jpeg.read_header(data)
    return h.width, h.height


def test_sizes_bounded_aspect_kept_labels_and_order_unchanged(source, small):
    ds = small.dataset
    resized = 0
    for i in range(N):
        W, H = _size(source.read(i))
        w, h = _size(small.read(i))
        flags = int(ds.entry(i)["flags"])
        assert small.label(i) == source.label(i) and small.relpath(i) == source.relpath(i)
        if max(W, H) <= SIDE:
            assert (w, h) == (W, H) and not flags & fmt.RESIZED
            continue
        resized += 1
        assert flags & fmt.RESIZED and flags & fmt.TRANSCODED
        assert max(w, h) == SIDE
        s = SIDE / max(W, H)
        assert abs(w - W * s) <= 0.5 + 1e-9 and abs(h - H * s) <= 0.5 + 1e-9
        # Pixels: exactly Pillow's antialiased resize of the source encoded at quality 90
        # (the transcoding after it is lossless), which is that resize up to the JPEG loss.
        with Image.open(io.BytesIO(source.read(i))) as im:
            sampling = JpegImagePlugin.get_sampling(im)
            resized_ref = im.convert("RGB").resize((w, h), Image.Resampling.LANCZOS)
        buf = io.BytesIO()
        resized_ref.save(buf, "JPEG", quality=RESIZE_QUALITY, subsampling=sampling)
        with Image.open(buf) as im:
            ref = np.asarray(im.convert("RGB"))
        got = jpeg.decode(small.read(i))
        np.testing.assert_array_equal(got, ref)
        loss = np.abs(got.astype(np.float64) - np.asarray(resized_ref, np.float64)).mean()
        assert loss < 5.0, (i, loss)
    assert resized >= N // 2
    meta = ds.meta["max_side"]
    assert meta == {"max_side": SIDE, "resized": resized, "quality": RESIZE_QUALITY,
                    "resampler": "Pillow LANCZOS"}
    assert ds.meta["orig_bytes"] == sum(len(source.read(i)) for i in range(N))


def test_default_leaves_records_unchanged(source, default, tmp_path):
    """Without max_side each record is the source's file transcoded, as before the option
    existed; a max_side no image exceeds writes the same shards."""
    for i in range(N):
        assert default.read(i) == jpeg.transcode(source.read(i), restart_interval=1)
        assert not int(default.dataset.entry(i)["flags"]) & fmt.RESIZED
    assert default.dataset.meta["max_side"] is None
    big = max(max(_size(source.read(i))) for i in range(N))
    same = pack(source, tmp_path / "same", progress=False, max_side=big)
    assert same.dataset.meta["max_side"]["resized"] == 0
    for k in range(default.dataset.num_shards):
        a = open(default.dataset.shard_path(k), "rb").read()
        b = open(same.dataset.shard_path(k), "rb").read()
        assert a == b


def test_without_transcoding(source, tmp_path):
    ds = pack(source, tmp_path / "plain", progress=False, transcode=False, max_side=SIDE)
    for i in range(N):
        w, h = _size(ds.read(i))
        assert max(w, h) <= SIDE
        flags = int(ds.dataset.entry(i)["flags"])
        assert not flags & fmt.TRANSCODED
        assert bool(flags & fmt.RESIZED) == (max(_size(source.read(i))) > SIDE)


@pytest.mark.parametrize("bad", [0, -5, True, 2.5, "256", 65501])
def test_max_side_validated(source, tmp_path, bad):
    with pytest.raises(ConfigError, match="max_side"):
        pack(source, tmp_path / "x", progress=False, max_side=bad)
    assert not os.path.exists(tmp_path / "x")


def test_cli_max_side(photos, tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli.main(["pack", str(photos), str(out), "--max-side", "128", "-q",
                     "--json", "-"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["max_side"]["max_side"] == 128 and summary["max_side"]["resized"] == N
    src = open_path(str(out))
    assert all(max(_size(src.read(i))) == 128 for i in range(N))
    with pytest.raises(SystemExit):
        cli.main(["pack", str(photos), str(tmp_path / "bad"), "--max-side", "0"])
    assert "--max-side" in capsys.readouterr().err
