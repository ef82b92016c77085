"""An ImageNet-like JPEG dataset made offline from real photographs.

Benchmarks and tests need JPEGs that look like ImageNet's to a decoder: natural image content,
ImageNet's spread of sizes and aspect ratios, its mix of JPEG qualities, chroma subsampling,
progressive and grayscale files (random noise has no spatial correlation: entropy decoding
would dominate every timing). The photographs ship inside installed packages (scikit-image's
sample data, and scikit-learn's or matplotlib's sample photos when installed), so nothing is
downloaded.

Each image is a random crop of one photo, rescaled to an ImageNet-like size, flipped at random,
jittered a little in brightness, contrast and saturation, sharpened as cameras do, and encoded
with per-image JPEG settings. Class ``k`` draws most of its images from one photo, so labels
are learnable. Everything is a pure function of ``(seed, n, classes, corpus, Pillow's JPEG
encoder)``: image ``i``'s randomness comes from ``numpy.random.SeedSequence([seed, i])``, never
from global state, so a dataset can be rebuilt bit for bit.
"""

import hashlib
import importlib.util
import io
import json
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from .. import _validate as _v
from ..errors import ConfigError
from .progress import bar

__all__ = ["make_imagenet_like", "photo_corpus", "dataset_files", "MANIFEST_NAME",
           "default_cache_dir", "sample_dataset"]

MANIFEST_NAME = "dpu_pipe_sample.json"
# Bump when the generator changes so an old cached dataset is rebuilt instead of reused.
_GENERATOR_VERSION = 1

# Colour photographs bundled with scikit-image. Its other sample images are grayscale, synthetic
# (colour wheel, chessboards, phantom) or drawings (horse, logo) and would not look like ImageNet.
_SKIMAGE_PHOTOS = (
    "astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png",
    "motorcycle_right.png", "hubble_deep_field.jpg", "retina.jpg", "ihc.png",
)
_OPTIONAL_PHOTOS = (
    ("sklearn", "datasets/images", ("china.jpg", "flower.jpg")),
    ("matplotlib", "mpl-data/sample_data", ("grace_hopper.jpg",)),
)

# Share of images that come from their class's own photo (the rest use any photo).
_CLASS_PHOTO_SHARE = 0.8
# JPEG settings, drawn per image. Pillow's ``subsampling``: 0 = 4:4:4, 1 = 4:2:2, 2 = 4:2:0.
# Quality is 95 - 20 * Beta(1, 5) rounded: 75..95, mean about 92, most files at 90 or above,
# as ImageNet's Flickr-sourced files are.
_QUALITY_RANGE = (75, 95)
_SUBSAMPLING_P = {"4:2:0": 0.80, "4:2:2": 0.10, "4:4:4": 0.10}
_PIL_SUBSAMPLING = {"4:4:4": 0, "4:2:2": 1, "4:2:0": 2}
_PROGRESSIVE_P = 0.10
_GRAY_P = 0.03
# Smallest crop side, as a share of the largest box of the output's aspect in the photo.
_MIN_CROP = 0.55


def _package_dir(name):
    # find_spec on a top-level name locates the package without importing it, so scikit-learn
    # or matplotlib are not loaded just to find two files.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@lru_cache(maxsize=1)
def photo_corpus():
    """The real colour photographs the sample dataset is made from: a tuple of ``(name,
    image)`` in a fixed order, ``image`` a read-only RGB ``uint8`` array ``(H, W, 3)``, names
    like ``"skimage/astronaut"``. Read once per process from files installed with scikit-image
    (required) and scikit-learn or matplotlib (when installed); raises :class:`ConfigError`
    naming the pip package when Pillow or scikit-image is missing.
    """
    try:
        from PIL import Image
    except ImportError as exc:
        raise ConfigError("dpu_pipe.tools.sample_data needs Pillow to read and write images: "
                          "pip install pillow") from exc
    skimage_dir = _package_dir("skimage")
    if skimage_dir is None:
        raise ConfigError("dpu_pipe.tools.sample_data takes its photographs from scikit-image's "
                          "sample data: pip install scikit-image")
    paths = [(f"skimage/{f.rsplit('.', 1)[0]}", skimage_dir / "data" / f)
             for f in _SKIMAGE_PHOTOS]
    missing = [str(p) for _, p in paths if not p.is_file()]
    if missing:
        raise ConfigError(f"scikit-image is installed without its sample photographs (missing "
                          f"{', '.join(missing)}): pip install --force-reinstall scikit-image")
    for pkg, sub, files in _OPTIONAL_PHOTOS:
        d = _package_dir(pkg)
        if d is not None:
            paths += [(f"{pkg}/{f.rsplit('.', 1)[0]}", d / sub / f) for f in files
                      if (d / sub / f).is_file()]
    photos = []
    for name, path in paths:
        with Image.open(path) as im:
            arr = np.asarray(im.convert("RGB"))
        arr.setflags(write=False)  # shared by every caller through the cache
        photos.append((name, arr))
    return tuple(photos)


def _corpus_digest(photos):
    h = hashlib.sha256()
    for name, arr in photos:
        h.update(name.encode())
        h.update(repr(arr.shape).encode())
        h.update(arr.tobytes())
    return h.hexdigest()[:16]


def class_names(classes):
    """ImageNet-style synset-like folder names (``n00000000`` ...) for ``classes`` classes."""
    return [f"n{k:08d}" for k in range(classes)]


def _draw_size(rng):
    """Output (width, height) in pixels, as ImageNet's training images: mostly a long side of
    500 px, 4:3 and 3:2 dominating, a quarter in portrait orientation; a minority larger (up to
    ~1000 px or more), some small thumbnails."""
    kind = rng.random()
    if kind < 0.78:
        long_side = 500
    elif kind < 0.90:
        long_side = int(round(600 + 600 * rng.beta(1.0, 2.5)))   # 600..1200, mostly < 900
    else:
        long_side = int(rng.integers(90, 420))
    a = rng.random()
    if a < 0.45:
        aspect = 4 / 3
    elif a < 0.70:
        aspect = 3 / 2
    elif a < 0.78:
        aspect = 1.0
    else:
        aspect = float(rng.uniform(1.0, 2.0))
    short_side = max(1, int(round(long_side / aspect)))
    if rng.random() < 0.25:
        return short_side, long_side
    return long_side, short_side


def _make_one(photos, label, rng):
    """Encode one sample; returns (jpeg bytes, info dict)."""
    from PIL import Image, ImageEnhance, ImageFilter

    if rng.random() < _CLASS_PHOTO_SHARE:
        p = label % len(photos)
    else:
        p = int(rng.integers(len(photos)))
    src = photos[p][1]
    sh, sw = src.shape[:2]
    width, height = _draw_size(rng)

    # Largest box of the output's aspect inside the photo, then a random share of it at a random
    # place: the same photo yields many different views. The box is kept at least as large as
    # the output where the photo allows, since ImageNet's photos are downscaled camera
    # originals: upscaling would make them smoother, and smaller as JPEG, than the real thing.
    aspect = width / height
    box_w = min(sw, sh * aspect)
    box_h = box_w / aspect
    smallest = min(1.0, max(_MIN_CROP, width / box_w))
    scale = rng.uniform(smallest, 1.0)
    box_w, box_h = box_w * scale, box_h * scale
    x0 = rng.uniform(0, max(0.0, sw - box_w))
    y0 = rng.uniform(0, max(0.0, sh - box_h))
    im = Image.fromarray(src).resize((width, height), Image.Resampling.LANCZOS,
                                     box=(x0, y0, x0 + box_w, y0 + box_h))
    if rng.random() < 0.5:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    im = ImageEnhance.Brightness(im).enhance(rng.uniform(0.85, 1.15))
    im = ImageEnhance.Contrast(im).enhance(rng.uniform(0.9, 1.1))
    im = ImageEnhance.Color(im).enhance(rng.uniform(0.85, 1.15))
    # Cameras and photo sites sharpen what they save; without it the bundled photos, most of
    # them smaller than a camera frame, encode to far fewer bits per pixel than ImageNet's.
    im = im.filter(ImageFilter.UnsharpMask(radius=rng.uniform(0.8, 2.0),
                                           percent=int(rng.integers(60, 161)), threshold=0))

    gray = bool(rng.random() < _GRAY_P)
    progressive = bool(rng.random() < _PROGRESSIVE_P)
    lo, hi = _QUALITY_RANGE
    quality = hi - int(round((hi - lo) * rng.beta(1.0, 5.0)))
    names = list(_SUBSAMPLING_P)
    sub = names[int(rng.choice(len(names), p=list(_SUBSAMPLING_P.values())))]
    kwargs = dict(quality=quality, progressive=progressive)
    if gray:
        im = im.convert("L")
        sub = "gray"
    else:
        kwargs["subsampling"] = _PIL_SUBSAMPLING[sub]
    buf = io.BytesIO()
    im.save(buf, format="JPEG", **kwargs)
    info = dict(width=width, height=height, quality=quality, progressive=progressive,
                subsampling=sub, photo=photos[p][0])
    return buf.getvalue(), info


def _read_manifest(root):
    try:
        with open(Path(root) / MANIFEST_NAME) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _complete(root, params):
    """The manifest's stats if ``root`` holds a finished dataset made with ``params``."""
    m = _read_manifest(root)
    if not m or m.get("params") != params:
        return None
    sizes = m.get("sizes", {})
    for rel, size in sizes.items():
        try:
            if os.path.getsize(Path(root) / rel) != size:
                return None
        except OSError:
            return None
    return m["stats"] if len(sizes) == params["n"] else None


def default_cache_dir():
    """Where generated data goes by default: ``$XDG_CACHE_HOME/dpu_pipe``, else
    ``~/.cache/dpu_pipe`` (never the working directory)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dpu_pipe")


def sample_dataset(n=1000, seed=0, *, progress=True):
    """Path of the ImageNet-like dataset of ``n`` images (10 classes) under
    :func:`default_cache_dir`, made once and then reused. Sample ``i`` depends on ``(seed, i)``
    only, so one dataset of ``max(n, 1000)`` images serves every smaller ``n``."""
    size = max(int(n), 1000)
    root = os.path.join(default_cache_dir(), f"imagenet_like_n{size}_s{seed}")
    make_imagenet_like(root, n=size, classes=10, seed=seed, progress=progress)
    return root


def make_imagenet_like(root, n=1000, classes=10, seed=0, *, progress=False):
    """Write an ImageNet-like JPEG dataset in ImageFolder layout and return its statistics.

    Files are ``root/<class>/<index>.JPEG`` (:func:`class_names`, the six-digit sample number);
    sample ``i`` has label ``i % classes``. Sizes follow ImageNet's (:func:`_draw_size`); JPEG
    quality is 75..95 skewed high (mean about 92), chroma subsampling 80 % 4:2:0, 10 % 4:2:2,
    10 % 4:4:4; about 10 % of files are progressive and 3 % grayscale. With scikit-image's
    photos alone, ``n=1000, seed=0`` gives a mean of 474 x 406 px and 78 kB per file (ImageNet's
    ~110 kB: camera originals carry finer texture than the few small bundled photos).

    Idempotent: a ``root`` holding a complete dataset of the same parameters and photo corpus
    (its manifest and the file sizes it records say so) is left as it is; one of other
    parameters is replaced; a non-empty ``root`` not made here raises :class:`ConfigError`. The
    dataset is built in a temporary sibling directory and moved into place, so concurrent
    callers and interrupted builds never leave a half-written ``root``. ``progress=True`` shows
    a progress bar on stderr.

    Returns
    -------
    dict
        ``count``, ``classes``, ``mean_width``, ``mean_height``, ``min_side``, ``max_side``
        (pixels), ``mean_bytes``, ``total_bytes``, ``progressive`` and ``gray`` (file counts),
        ``subsampling`` (counts keyed ``"4:2:0"``, ``"4:2:2"``, ``"4:4:4"``, ``"gray"``),
        ``quality_mean``, ``corpus`` (photo names) and ``root``.
    """
    n = _v.integer(n, "n", 1, 999_999)    # six-digit file names
    classes = _v.positive_int(classes, "classes")
    seed = _v.integer(seed, "seed", 0)
    photos = photo_corpus()
    import PIL
    from PIL import features

    encoder = f"Pillow {PIL.__version__} libjpeg-turbo {features.version('libjpeg_turbo')}"
    params = dict(generator=_GENERATOR_VERSION, n=n, classes=classes, seed=seed,
                  corpus=_corpus_digest(photos), encoder=encoder)

    root = Path(root)
    stats = _complete(root, params)
    if stats is not None:
        return dict(stats, root=str(root))
    if root.exists():
        if not root.is_dir():
            raise ConfigError(f"{root} exists and is not a directory")
        if any(root.iterdir()) and _read_manifest(root) is None:
            raise ConfigError(f"{root} is not empty and was not made by make_imagenet_like; "
                              "pass an empty or new directory")
    root.parent.mkdir(parents=True, exist_ok=True)

    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        names = class_names(classes)
        for c in names:
            (tmp / c).mkdir()
        infos, sizes = [], {}
        with bar(n, f"making {root.name}", enabled=progress) as b:
            for i in range(n):
                label = i % classes
                rng = np.random.default_rng(np.random.SeedSequence([seed, i]))
                data, info = _make_one(photos, label, rng)
                rel = f"{names[label]}/{i:06d}.JPEG"
                (tmp / rel).write_bytes(data)
                sizes[rel] = len(data)
                info["bytes"] = len(data)
                infos.append(info)
                b.update(1)
        stats = _summarize(infos, classes, photos)
        with open(tmp / MANIFEST_NAME, "w") as f:
            json.dump(dict(params=params, stats=stats, sizes=sizes), f, indent=1)
        _install(tmp, root, params)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    final = _complete(root, params)
    if final is None:
        raise ConfigError(f"could not install the dataset at {root}: another process keeps "
                          "writing a different dataset there")
    return dict(final, root=str(root))


def _install(tmp, root, params):
    """Move the finished dataset ``tmp`` to ``root``, replacing an older sample dataset."""
    old = None
    if root.exists():
        if _complete(root, params) is not None:
            return  # a concurrent caller finished the same dataset first
        if any(root.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{root.name}.old-", dir=root.parent))
            os.rename(root, old / "d")
        else:
            root.rmdir()
    try:
        os.rename(tmp, root)
    except OSError:
        if _complete(root, params) is None:
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _summarize(infos, classes, photos):
    w = np.array([i["width"] for i in infos], dtype=np.float64)
    h = np.array([i["height"] for i in infos], dtype=np.float64)
    b = np.array([i["bytes"] for i in infos], dtype=np.float64)
    sub = {k: 0 for k in (*_SUBSAMPLING_P, "gray")}
    for i in infos:
        sub[i["subsampling"]] += 1
    return dict(
        count=len(infos), classes=classes,
        mean_width=round(float(w.mean()), 1), mean_height=round(float(h.mean()), 1),
        mean_bytes=round(float(b.mean()), 1), total_bytes=int(b.sum()),
        min_side=int(min(w.min(), h.min())), max_side=int(max(w.max(), h.max())),
        progressive=sum(i["progressive"] for i in infos), gray=sub["gray"], subsampling=sub,
        quality_mean=round(float(np.mean([i["quality"] for i in infos])), 2),
        corpus=[name for name, _ in photos],
    )


def dataset_files(root):
    """Paths of a dataset made by :func:`make_imagenet_like`, in sample order, with labels.

    Returns ``(paths, labels)``: :class:`pathlib.Path` objects sorted by sample index, and
    ints. Raises :class:`ConfigError` when ``root`` holds no such dataset.
    """
    m = _read_manifest(root)
    if not m or "sizes" not in m:
        raise ConfigError(f"{root} holds no dataset made by make_imagenet_like "
                          f"(no readable {MANIFEST_NAME})")
    index = {c: k for k, c in enumerate(class_names(m["params"]["classes"]))}
    rels = sorted(m["sizes"], key=lambda r: r.rsplit("/", 1)[1])
    return [Path(root) / r for r in rels], [index[r.split("/", 1)[0]] for r in rels]
