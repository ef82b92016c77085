"""decode_max_side and the decoded-sample cache (cache_bytes) of a local Loader.

decode_max_side=S decodes a sample whole at a DCT scale, reduces it to a longest side of S and
cuts every crop from that reduced image; the cache keeps the reduced images. The stream with a
cache must be the stream without it, bit for bit, whatever the cache holds (all, part, none),
over epochs and resumes, on any thread count; corrupt files are never cached; resident memory
grows by at most cache_bytes.
"""
import io
import sys
import textwrap

import numpy as np
import pytest

import helpers
import jpeg_corpus as jc
from dpu_pipe import ConfigError, DecodeError, DPULoader, Loader, TransformConfig, jpeg, ops
from dpu_pipe import _jpeg, _pipeline, rng
from dpu_pipe.cache import ENTRY_BYTES, table_bytes
from dpu_pipe.sources import ImageFolder

N = 24          # samples of the main dataset
S = 96          # decode_max_side of most tests
SIZE = 48       # output size


@pytest.fixture(scope="module")
def data(photo_folder):
    # 150..311 x 200..315 pixels: every sample is reduced, at DCT scales 3/8..6/8.
    return str(photo_folder(N, shape=(150, 7, 200, 5)))


def _geometry(h, w, s):
    """decode_max_side's (scale, h', w') computed here from its definition."""
    longest = max(h, w)
    if longest <= s:
        return 8, h, w
    scale = next((k for k in range(1, 8) if -(-longest * k // 8) >= s), 8)
    if h >= w:
        return scale, s, max(1, (2 * w * s + longest) // (2 * longest))
    return scale, max(1, (2 * h * s + longest) // (2 * longest)), s


@pytest.mark.parametrize("h, w, s", [(500, 375, 256), (375, 500, 256), (512, 384, 128),
                                     (256, 256, 256), (90, 70, 96), (97, 96, 96),
                                     (10000, 3, 100), (3, 10000, 100), (301, 300, 299),
                                     (1, 1, 1), (641, 480, 320)])
def test_reduced_geometry(h, w, s):
    """Scale: the smallest s/8 whose scaled longest side is >= S; size: longest side S, the
    other rounded half up, at least 1; an image no larger than S kept."""
    assert _pipeline.decode_max_side_geometry(h, w, s) == _geometry(h, w, s)


def _reference_reduced(data, s):
    """The reduced image of decode_max_side=s, made by hand: the whole JPEG decoded at the
    scale of the definition, then ops.resize_crop (antialiased bilinear, uint8 HWC) of the
    whole decoded image to the reduced size (the decoded image itself when it has that size)."""
    info = jpeg.read_header(data)
    scale, th, tw = _geometry(info.height, info.width, s)
    whole, got = _jpeg.decode(data, None, 0, 0, False, False, 1 << 40, 1000, scale=scale)
    assert got == scale
    if whole.shape[:2] == (th, tw):
        return whole, scale, whole
    return ops.resize_crop(whole, (0, 0, whole.shape[0], whole.shape[1]), (th, tw),
                           dtype="uint8", layout="HWC"), scale, whole


@pytest.fixture(scope="module")
def geometry_data(tmp_path_factory):
    """Samples picked for their geometry at S=128: DCT scale 2/8 with no resampling left
    (512x384 -> 128x96), 2/8 then resampled (160x400 -> 51x128), 3/8 (300x200), one no larger
    than S (90x70, kept), a grayscale and a progressive one, and a PNG (OpenCV's path)."""
    root = tmp_path_factory.mktemp("geometry") / "ds"
    files = [("a", jc.pil_jpeg(jc.photo_sized("astronaut", 512, 384), quality=90)),
             ("b", jc.pil_jpeg(jc.photo_sized("coffee", 160, 400), subsampling="444")),
             ("c", jc.pil_jpeg(jc.photo_sized("chelsea", 300, 200), progressive=True)),
             ("d", jc.pil_jpeg(jc.photo_sized("astronaut", 90, 70))),
             ("e", jc.pil_jpeg(jc.photo_sized("coffee", 333, 251)[..., 0]))]
    for name, blob in files:
        (root / name).mkdir(parents=True)
        (root / name / "img.jpg").write_bytes(blob)
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(jc.photo_sized("chelsea", 250, 181)).save(buf, format="PNG")
    (root / "f").mkdir()
    (root / "f" / "img.png").write_bytes(buf.getvalue())
    return str(root)


@pytest.mark.parametrize("train", [True, False])
def test_reduction_and_crops_match_the_reference(geometry_data, train):
    """The cached image of every sample is the reference reduction (Pillow's scaled decode for
    the power-of-two scales too); the crop box lies in the reduced image, is the one the RNG
    draws from the reduced size (train) or the centre box of it (val); the output sample is
    ops.resize_crop of the reference image with that box (train: of the box cut out)."""
    pytest.importorskip("cv2")
    s = 128
    src = ImageFolder(geometry_data)
    ld = Loader(src, 2, train=train, size=40, seed=5, dtype="uint8", layout="HWC",
                decode_max_side=s, cache_bytes=1 << 22, shuffle=False, return_meta=True)
    out = {}
    for x, _, meta in _with_meta(ld):
        for img, i in zip(x, meta):
            out[i] = img.copy()
    assert sorted(out) == list(range(len(src)))
    for i in range(len(src)):
        data = src.read(i)
        got, scale = ld.cache.sample(i)
        if data[:2] == b"\xff\xd8":
            ref, ref_scale, whole = _reference_reduced(data, s)
            assert scale == ref_scale
            if scale in (1, 2, 4, 8):
                assert np.array_equal(whole, jc.pil_decode(data, scale))
        else:
            import cv2
            rgb = cv2.cvtColor(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR),
                               cv2.COLOR_BGR2RGB)
            _, th, tw = _geometry(rgb.shape[0], rgb.shape[1], s)
            ref = ops.resize_crop(rgb, (0, 0) + rgb.shape[:2], (th, tw), dtype="uint8",
                                  layout="HWC")
            assert scale == 8
        assert got.shape == ref.shape and np.array_equal(got, ref), i
        h, w = ref.shape[:2]
        d = ld.describe(0, i)
        top, left, bh, bw = d["crop"]
        assert 0 <= top and 0 <= left and top + bh <= h and left + bw <= w
        if train:
            box = tuple(int(v) for v in rng.random_resized_crop(5, 0, i, h, w))
            assert (top, left, bh, bw) == box
            flip = bool(rng.random_flip(5, 0, i))
        else:
            box = ops.center_crop_box(h, w, 40, ld.transform.recipe.resize)
            assert [top, left, bh, bw] == [int(np.floor(v)) for v in box]
            flip = False
        assert d["flip"] == flip
        if train:
            # RandomResizedCrop: the box cut out, then resized (torchvision's resized_crop).
            t, l, bh, bw = box
            want = ops.resize_crop(ref[t:t + bh, l:l + bw], (0, 0, bh, bw), 40, flip=flip,
                                   dtype="uint8", layout="HWC")
        else:
            # Resize of the whole image, then the centre crop.
            want = ops.resize_crop(ref, box, 40, dtype="uint8", layout="HWC")
        assert np.array_equal(out[i], want), i
    # Sample "d" is no larger than S: kept as decoded, at full scale.
    assert ld.cache.sample(3)[0].shape == (90, 70, 3) and ld.cache.sample(3)[1] == 8
    assert ld.cache.sample(0)[1] == 2 and ld.cache.sample(0)[0].shape == (128, 96, 3)


def _with_meta(ld):
    for x, y, meta in ld:
        yield x, y, meta["index"].tolist()


def _stream(ld, epochs, *, stop=None):
    """[(epoch, images, labels)] of ``epochs`` more epochs of ``ld``; with ``stop`` = (epoch,
    step) it ends there (before that step) and returns the state too."""
    got = []
    while ld.epoch < epochs:
        e = ld.epoch
        for x, y in ld:
            got.append((e, x.copy(), y.copy()))
            if stop is not None and (ld.epoch, ld.state_dict()["step"]) == stop:
                return got, ld.state_dict()
    return got, ld.state_dict()


def _same(a, b):
    assert len(a) == len(b)
    for j, ((e1, x1, y1), (e2, x2, y2)) in enumerate(zip(a, b)):
        assert e1 == e2 and np.array_equal(y1, y2), j
        assert np.array_equal(x1, x2), f"batch {j} (epoch {e1}) differs"


@pytest.mark.parametrize("fill", ["all", "part"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("train", [True, False])
def test_cached_stream_equals_uncached(data, train, threads, fill):
    """Three epochs, a state saved in epoch 1 and resumed both in the same loader (warm
    cache) and in a new one (cold): every batch equals the uncached loader's. A cache that
    holds everything serves epoch 1 from the cache alone; one too small for the data
    (did_not_fit > 0) holds what fitted and decodes the rest every epoch."""
    kw = dict(train=train, size=SIZE, seed=7, num_threads=threads, decode_max_side=S)
    ref, _ = _stream(Loader(data, 5, **kw), 3)
    sample = S * S * 3 // 2     # about one reduced sample (4:3)
    cache_bytes = 1 << 24 if fill == "all" else table_bytes(N) + 6 * sample
    ld = Loader(data, 5, cache_bytes=cache_bytes, **kw)
    first, _ = _stream(ld, 1)
    st0 = ld.stats()["cache"]
    assert set(st0) == {"hits", "misses", "bytes", "entries", "did_not_fit"}
    assert st0["hits"] == 0 and st0["misses"] == N
    assert st0["entries"] + st0["did_not_fit"] == N
    got, state = _stream(ld, 3, stop=(1, 2))
    st1 = ld.stats()["cache"]
    if fill == "all":
        assert st0["did_not_fit"] == 0 and st0["entries"] == N
        assert st1["misses"] == N and st1["hits"] >= 10      # epoch 1: hits only
    else:
        assert st0["did_not_fit"] > 0 and 0 < st0["entries"] < N
        assert st0["bytes"] <= cache_bytes - table_bytes(N)
    rest_warm, _ = _stream(ld, 3)
    _same(first + got + rest_warm, ref)
    if fill == "all":
        st = ld.stats()["cache"]
        # Epochs 1 and 2 all hits (batches made ahead before the break were made again).
        assert st["misses"] == N and st["hits"] >= 2 * N
    ld.load_state_dict(state)
    again, _ = _stream(ld, 3)
    _same(first + got + again, ref)
    cold = Loader(data, 5, cache_bytes=cache_bytes, **kw)
    cold.load_state_dict(state)
    rest_cold, _ = _stream(cold, 3)
    _same(first + got + rest_cold, ref)


def test_validation_epoch_two_is_served_from_the_cache(data):
    ld = Loader(data, 8, train=False, size=SIZE, decode_max_side=S, cache_bytes=1 << 24)
    a = [x.copy() for x, _ in ld]
    assert ld.stats()["cache"]["misses"] == N and ld.stats()["cache"]["hits"] == 0
    b = [x.copy() for x, _ in ld]
    st = ld.stats()["cache"]
    assert st["misses"] == N and st["hits"] == N and st["entries"] == N
    assert all(np.array_equal(u, v) for u, v in zip(a, b))   # val: the same every epoch


def test_stats_have_no_cache_without_one(data):
    ld = Loader(data, 8, size=SIZE, decode_max_side=S)
    next(iter(ld))
    assert "cache" not in ld.stats() and ld.cache is None


def test_decode_max_side_changes_the_stream_and_info(data):
    """The crops are drawn from the reduced image: the stream differs from the full decode's,
    and the info row gives the box in reduced pixels and the whole decode's scale."""
    full = [x.copy() for x, _ in Loader(data, 8, size=SIZE, seed=1)]
    red = [x.copy() for x, _ in Loader(data, 8, size=SIZE, seed=1, decode_max_side=S)]
    assert not all(np.array_equal(u, v) for u, v in zip(full, red))
    from dpu_pipe.kernel import BatchProcessor
    src = ImageFolder(data)
    bp = BatchProcessor(TransformConfig(size=SIZE, decode_max_side=S))
    _, info, errors = bp.run([src.read(i) for i in range(4)], np.arange(4))
    assert not errors
    for i in range(4):
        h = jpeg.read_header(src.read(i))
        scale, th, tw = _geometry(h.height, h.width, S)
        assert info[i, 6] == scale
        assert info[i, 1] + info[i, 3] <= th and info[i, 2] + info[i, 4] <= tw


@pytest.mark.parametrize("threads", [1, 2])
def test_corrupt_files_are_never_cached(tmp_path, threads):
    """A corrupt JPEG and a text file in the folder: on_error="raise" raises the same
    DecodeError at the same batch with or without the cache, every epoch it is met;
    on_error="skip" gives the same stream and bad samples, and the cache holds only the good
    samples."""
    root = helpers.make_dataset(str(tmp_path / "ds"), 14, bad={3: "corrupt", 9: "not-jpeg"})
    kw = dict(size=32, seed=2, num_threads=threads, decode_max_side=48, dtype="uint8")

    def until_error(ld):
        got = []
        with pytest.raises(DecodeError) as err:
            for x, y in ld:
                got.append((x.copy(), y.copy()))
        return got, err.value

    for ep in range(2):
        plain, cached = Loader(root, 4, **kw), Loader(root, 4, cache_bytes=1 << 22, **kw)
        plain.set_epoch(ep)
        cached.set_epoch(ep)
        a, ea = until_error(plain)
        b, eb = until_error(cached)
        assert (ea.index, ea.path) == (eb.index, eb.path) and ea.index in (3, 9)
        assert len(a) == len(b) and all(np.array_equal(u[0], v[0]) for u, v in zip(a, b))
        assert cached.cache.sample(ea.index) is None
    plain = Loader(root, 4, on_error="skip", **kw)
    cached = Loader(root, 4, on_error="skip", cache_bytes=1 << 22, **kw)
    ref, _ = _stream(plain, 2)
    got, _ = _stream(cached, 2)
    _same(got, ref)
    assert sorted(cached.bad_samples) == sorted(plain.bad_samples) == [3, 9]
    assert cached.cache.sample(3) is None and cached.cache.sample(9) is None
    st = cached.stats()["cache"]
    assert st["entries"] == 12 and st["did_not_fit"] == 0


def test_cache_arguments_are_checked(data):
    with pytest.raises(ConfigError, match="needs decode_max_side"):
        Loader(data, 4, cache_bytes=1 << 20)
    with pytest.raises(ConfigError, match="table alone"):
        Loader(data, 4, decode_max_side=S, cache_bytes=table_bytes(N))
    with pytest.raises(ConfigError, match="cache_bytes"):
        Loader(data, 4, decode_max_side=S, cache_bytes=-1)
    with pytest.raises(ConfigError, match="decode_max_side"):
        Loader(data, 4, decode_max_side=0)
    # Checked before any MPI start-up (the offloaded modes cache on the producers: see
    # tests/mpi/test_node_cache.py).
    for mode in ("offload", "hybrid"):
        with pytest.raises(ConfigError, match="cache_bytes"):
            DPULoader(data, 4, mode=mode, decode_max_side=S, cache_bytes=-1)
    assert table_bytes(N) == -(-(128 + ENTRY_BYTES * N) // 64) * 64
    assert ENTRY_BYTES == 24


def test_cache_is_shared_and_attachable(data):
    """The C cache works over memory it is handed: a second SampleCache attached to the same
    bytes (as another process on a node would) sees what the first stored, and refuses
    memory that holds no cache of that size."""
    import mmap

    m = mmap.mmap(-1, 1 << 22)
    first = _pipeline.SampleCache(m, N)
    cfg = TransformConfig(size=SIZE, decode_max_side=S, dtype="uint8")
    kernel = _pipeline.Pipeline(cfg.to_dict(), 1, first)
    src = ImageFolder(data)
    bufs = _jpeg.BufferList.from_buffers([src.read(i) for i in range(8)])
    info = np.zeros((8, 7), np.int32)
    assert kernel.run(bufs, np.arange(8), 0, 0, np.empty((8, 3, SIZE, SIZE), np.uint8),
                      info) == {}
    second = _pipeline.SampleCache(m, N, init=False)
    assert second.stats() == first.stats() and first.stats()["entries"] == 8
    stored = np.flatnonzero(second.ready(np.arange(N)))
    assert len(stored) == 8
    assert np.array_equal(second.sample(int(stored[0]))[0], first.sample(int(stored[0]))[0])
    with pytest.raises(ConfigError, match="holds no cache"):
        _pipeline.SampleCache(m, N + 1, init=False)
    with pytest.raises(ConfigError, match="holds no cache"):
        _pipeline.SampleCache(mmap.mmap(-1, 1 << 16), N, init=False)


_RSS_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import helpers
    from dpu_pipe import Loader
    root, cache_bytes = sys.argv[1], int(sys.argv[2])
    kw = dict(size=64, decode_max_side=320, num_threads=2, seed=3)
    # The same loader without a cache first: whatever the loader itself allocates (buffers,
    # decoders, the allocator's arenas) is resident before the measurement starts.
    for _ in Loader(root, 8, **kw):
        pass
    before = helpers.rss_bytes()
    ld = Loader(root, 8, cache_bytes=cache_bytes, **kw)
    for _ in range(2):
        for _ in ld:
            pass
    print(json.dumps({"growth": helpers.rss_bytes() - before, **ld.stats()["cache"]}))
""")


@pytest.fixture(scope="module")
def big_photos(tmp_path_factory):
    # 40 photographs of 480x360 and more: reduced to 320 x ~240, ~230 KB each, ~9 MB in all.
    return helpers.photo_folder(tmp_path_factory.mktemp("big") / "ds", 40,
                                shape=(360, 2, 480, 2), quality=85)


#: What resident memory may grow by beyond what the cache stores: the table's pages, the last
#: pixel page, and the allocator's noise.
RSS_SLACK = 8 << 20


@pytest.mark.parametrize("cache_mib", [64, 4])
def test_resident_memory_grows_by_at_most_cache_bytes(big_photos, cache_mib):
    """A 64 MiB cache holding ~9 MiB of samples makes ~9 MiB resident, not 64 (pixel pages
    become resident as samples land); a 4 MiB cache, too small for the data, grows by at
    most 4 MiB."""
    cache_bytes = cache_mib << 20
    proc = helpers.run([sys.executable, "-c", _RSS_SCRIPT, big_photos, cache_bytes],
                       timeout=240, env=helpers.repo_env(helpers.TESTS))
    res = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert res["growth"] <= min(cache_bytes, res["bytes"] + table_bytes(40)) + RSS_SLACK, res
    if cache_mib == 64:
        assert res["did_not_fit"] == 0 and res["bytes"] > 8 << 20 and res["hits"] == 40
    else:
        assert res["did_not_fit"] > 0 and res["bytes"] <= cache_bytes


def test_concurrent_fills_store_each_sample_once(data):
    """Four kernels on four Python threads (the GIL released in the batch kernel) make the
    same batches at once over one cache: every output equals the uncached kernel's, and each
    sample is stored once (the writers that lose the race for an entry skip it)."""
    import mmap
    import threading

    cfg = TransformConfig(size=SIZE, decode_max_side=S, dtype="uint8")
    src = ImageFolder(data)
    bufs = _jpeg.BufferList.from_buffers([src.read(i) for i in range(N)])
    idx = np.arange(N, dtype=np.int64)

    def run(kernel, out):
        info = np.zeros((N, 7), np.int32)
        assert kernel.run(bufs, idx, 3, 1, out, info) == {}

    ref = np.empty((N, 3, SIZE, SIZE), np.uint8)
    run(_pipeline.Pipeline(cfg.to_dict(), 1), ref)
    cache = _pipeline.SampleCache(mmap.mmap(-1, 1 << 24), N)
    outs = [np.empty_like(ref) for _ in range(4)]
    threads = [threading.Thread(target=run, args=(_pipeline.Pipeline(cfg.to_dict(), 1, cache),
                                                  out)) for out in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert all(np.array_equal(o, ref) for o in outs)
    st = cache.stats()
    assert st["entries"] == N and st["hits"] + st["misses"] == 4 * N
    assert st["did_not_fit"] == 0


def test_an_entry_left_filling_is_never_read(data):
    """A writer that died in the middle of a fill leaves its entry FILLING (state 1) for
    good: lookups treat it as a miss and decode the sample, nobody else stores it, and the
    output is the uncached one. (The table starts after the 128-byte header, 24 bytes per
    sample, the state first: src/dpu_pipe/_cache.h.)"""
    import mmap

    cfg = TransformConfig(size=SIZE, decode_max_side=S, dtype="uint8")
    src = ImageFolder(data)
    bufs = _jpeg.BufferList.from_buffers([src.read(i) for i in range(N)])
    idx = np.arange(N, dtype=np.int64)
    m = mmap.mmap(-1, 1 << 24)
    cache = _pipeline.SampleCache(m, N)
    for i in (2, 5):
        m[128 + 24 * i:128 + 24 * i + 4] = (1).to_bytes(4, "little")
    ref = np.empty((N, 3, SIZE, SIZE), np.uint8)
    _pipeline.Pipeline(cfg.to_dict(), 1).run(bufs, idx, 0, 1, ref, np.zeros((N, 7), np.int32))
    kernel = _pipeline.Pipeline(cfg.to_dict(), 2, cache)
    for _ in range(2):
        out = np.empty_like(ref)
        assert kernel.run(bufs, idx, 0, 1, out, np.zeros((N, 7), np.int32)) == {}
        assert np.array_equal(out, ref)
    st = cache.stats()
    assert st["entries"] == N - 2 and st["misses"] == N + 2 and st["hits"] == N - 2
    assert cache.sample(2) is None and cache.sample(5) is None
