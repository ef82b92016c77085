"""The Loader's jpeg_decoder option: dpu_pipe's own decoder (src/dpu_pipe/_huffman.h,
_idct.h) on the pixel path gives the batches libjpeg-turbo gives, bit for bit, over transcoded
packs (a restart marker every MCU) and over the original files, train and val, on 1 and 2
threads; it does decode (counted), hands damaged data to libjpeg-turbo, whose DecodeError
names the sample, and travels in the stream spec without changing saved states."""

import numpy as np
import pytest

import jpeg_corpus as jc
from dpu_pipe import jpeg, pack
from dpu_pipe.batch import BatchProcessor
from dpu_pipe.errors import ConfigError, DecodeError
from dpu_pipe.loader import Loader
from dpu_pipe.sources import FileList, ImageFolder
from dpu_pipe.spec import StreamSpec
from dpu_pipe.transforms import TransformConfig

pytestmark = pytest.mark.timeout(120)

N = 15


def _image(i):
    """Photos at odd sizes, 4:2:0 / 4:4:4 / 4:2:2, every 7th grey, every 5th progressive
    (libjpeg-turbo's in the original files, baseline once transcoded)."""
    h, w = 40 + (i * 37) % 90, 50 + (i * 53) % 90
    return jc.pil_jpeg(jc.photo_sized(jc.PHOTOS[i % 3], h, w), quality=80 + i % 15,
                       subsampling=("420", "444", "422")[i % 3], progressive=i % 5 == 2,
                       mode="L" if i % 7 == 3 else None)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("own") / "folder"
    for i in range(N):
        jc.write_file(str(root / f"c{i % 3}" / f"img{i:03d}.jpg"), _image(i))
    return ImageFolder(root)


@pytest.fixture(scope="module")
def transcoded(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("own_pack") / "ds"
    return pack(folder, out, transcode=True, progress=False, shard_size=8000)


def _epochs(src, **kw):
    with Loader(src, 4, size=32, seed=5, **kw) as loader:
        return [[(x.copy(), y.copy()) for x, y in loader] for _ in range(2)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
@pytest.mark.parametrize("which", ["folder", "transcoded"])
def test_loader_batches_equal_between_decoders(request, which, train, threads):
    src = request.getfixturevalue(which)
    kw = dict(train=train, num_threads=threads)
    ref = _epochs(src, jpeg_decoder="libjpeg", **kw)
    got = _epochs(src, jpeg_decoder="own", **kw)
    assert len(ref) == len(got) == 2
    for ea, eb in zip(ref, got):
        assert len(ea) == len(eb) == -(-N // 4)
        for (xa, ya), (xb, yb) in zip(ea, eb):
            assert np.array_equal(xa, xb) and np.array_equal(ya, yb)


@pytest.mark.parametrize("fast", [False, True], ids=["accurate", "fast"])
def test_the_own_decoder_decodes_what_it_takes(folder, transcoded, fast):
    """Every transcoded record, and every baseline original, goes through the own decoder;
    progressive originals go to libjpeg-turbo."""
    for src, expect in ((transcoded, N), (folder, sum(i % 5 != 2 for i in range(N)))):
        cfg = TransformConfig(size=32, fast=fast, jpeg_decoder="own")
        bp = BatchProcessor(cfg, 1)
        ref = BatchProcessor(TransformConfig(size=32, fast=fast), 1)
        bufs = [src.read(i) for i in range(N)]
        out, info, errors = bp.run(bufs, np.arange(N), seed=1)
        want, want_info, want_errors = ref.run(bufs, np.arange(N), seed=1)
        assert not errors and not want_errors
        assert np.array_equal(out, want) and np.array_equal(info, want_info)
        assert bp._kernel.own_decoded == expect
        assert ref._kernel.own_decoded == 0


@pytest.mark.parametrize("threads", [1, 2])
def test_a_damaged_record_raises_naming_the_sample(tmp_path, threads):
    """A transcoded record cut inside its scan: the own decoder finds the interval short and
    libjpeg-turbo reports it, as it does without the own decoder."""
    rows = []
    for i in range(8):
        data = jpeg.transcode(_image(i), restart_interval=1)
        if i == 5:
            data = data[:jc.first_scan_data(data) + 20]
        path = tmp_path / f"{i}.jpg"
        path.write_bytes(data)
        rows.append((str(path), i))
    src = FileList(rows)
    errors = []
    for decoder in ("libjpeg", "own"):
        with Loader(src, 4, size=32, train=False, num_threads=threads,
                    jpeg_decoder=decoder) as loader:
            with pytest.raises(DecodeError) as info:
                for _ in loader:
                    pass
        errors.append(info.value)
    for err in errors:
        assert err.index == 5 and err.path == src.describe(5)
        assert "sample 5" in str(err)
    assert str(errors[0]) == str(errors[1])


def test_option_validated_and_carried_in_the_spec(folder):
    with pytest.raises(ConfigError, match="jpeg_decoder"):
        TransformConfig(jpeg_decoder="auto")
    with pytest.raises(ConfigError, match="jpeg_decoder"):
        Loader(folder, 4, jpeg_decoder="turbo")
    own = TransformConfig(jpeg_decoder="own")
    assert own.to_dict()["jpeg_decoder"] == "own"
    assert TransformConfig.from_dict(own.to_dict()) == own
    # The default is not written: specs of streams that do not choose stay as they were.
    assert "jpeg_decoder" not in TransformConfig().to_dict()
    a = StreamSpec(folder, 4, TransformConfig())
    b = StreamSpec(folder, 4, own)
    assert b.to_wire()["transform"]["jpeg_decoder"] == "own"
    assert StreamSpec.from_wire(b.to_wire()).transform.jpeg_decoder == "own"
    # A saved state resumes under either decoder: the batches are the same.
    assert a.state() == b.state()
