"""Plumbing shared by the tests (through ``tests/conftest.py``) and by the scripts they start
under mpiexec (``tests/mpi/*_host.py``, which run outside pytest and import this module
directly): the checkout's paths, environments for child processes, commands under a deadline,
resident memory, and the small JPEG datasets the tests read.

Everything here is deterministic; datasets are made from photographs bundled with
scikit-image (no download).
"""
import io
import os
import subprocess
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")


# --- child processes ---------------------------------------------------------------------------

def repo_env(*paths, **extra):
    """``os.environ`` for a child process that imports this checkout's ``dpu_pipe``.

    Parameters
    ----------
    *paths : str or Path
        Directories put on ``PYTHONPATH`` right after the checkout's root.
    **extra : str
        Variables set (or replaced) in the environment.

    Returns
    -------
    dict
        The environment: ``PYTHONPATH`` is the root, ``paths``, then what was there before.
    """
    env = dict(os.environ)
    before = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *map(str, paths), *before])
    env.update(extra)
    return env


def run(argv, *, timeout, check=True, **kw):
    """Run a command to its end within ``timeout`` seconds, output captured as text.

    Parameters
    ----------
    argv : sequence
        The command; items are converted with ``str``.
    timeout : float
        Seconds; past them ``subprocess.TimeoutExpired`` is raised (the child is killed).
    check : bool
        Assert a zero exit status, the message holding the end of both outputs.
    **kw
        Passed to ``subprocess.run`` (``cwd``, ``env``, ``input`` ...).

    Returns
    -------
    subprocess.CompletedProcess
    """
    argv = [str(a) for a in argv]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check:
        assert proc.returncode == 0, \
            f"{argv}: exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n" \
            f"--- stderr\n{proc.stderr[-3000:]}"
    return proc


def free_port():
    """A TCP port of 127.0.0.1 that nothing listens on now (int): for a launcher's rendezvous
    (torchrun's default, 29500, is shared by jobs the suite's workers run at once)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes():
    """Resident memory of this process in bytes (``/proc/self/statm``, Linux only)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --- datasets ----------------------------------------------------------------------------------

def photo_folder(root, n, *, classes=None, shape=(40, 3, 50, 2), quality=75):
    """Write an ImageFolder of ``n`` JPEGs (Pillow's encoder), each a photograph at a size of
    its own: ``root/<class>/<i:03d>.jpg``.

    Parameters
    ----------
    root : str or Path
        Directory to write into (made when missing).
    n : int
        Number of samples.
    classes : int or None
        ``None``: one class folder per sample (``c000``, ``c001`` ...), so a label is its
        sample index. Otherwise sample ``i`` goes to ``class<i % classes>``.
    shape : (int, int, int, int)
        ``(h0, dh, w0, dw)``: sample ``i`` is ``h0 + dh*i`` pixels high and ``w0 + dw*i``
        wide.
    quality : int
        JPEG quality.

    Returns
    -------
    Path
        ``root``.
    """
    import jpeg_corpus as jc

    root = Path(root)
    h0, dh, w0, dw = shape
    for i in range(n):
        d = root / (f"c{i:03d}" if classes is None else f"class{i % classes}")
        d.mkdir(parents=True, exist_ok=True)
        img = jc.photo_sized(jc.PHOTOS[i % 3], h0 + dh * i, w0 + dw * i)
        (d / f"{i:03d}.jpg").write_bytes(jc.pil_jpeg(img, quality=quality))
    return root


def sample_jpeg(i):
    """Sample ``i``'s JPEG in :func:`make_dataset`: a scikit-image photo at a size of its own
    (64..199 px a side), quality, chroma subsampling and progressive mode varying with ``i``."""
    import skimage.data
    from PIL import Image

    photo = Image.fromarray(np.ascontiguousarray(getattr(skimage.data, PHOTOS[i % 4])()[..., :3]))
    w, h = 64 + (i * 53) % 136, 64 + (i * 37) % 136
    buf = io.BytesIO()
    photo.resize((w, h), Image.BILINEAR).save(buf, format="JPEG", quality=80 + i % 15,
                                              subsampling=(2, 0, 1)[i % 3],
                                              progressive=i % 7 == 3)
    return buf.getvalue()


def bad_jpeg(kind):
    """A file that does not decode: ``"corrupt"`` (garbage over a JPEG's header) or
    ``"not-jpeg"`` (text)."""
    good = sample_jpeg(0)
    return {"corrupt": good[:2] + bytes(range(180)) + good[182:],
            "not-jpeg": b"this is not a JPEG file\n" * 40}[kind]


def make_dataset(root, n, bad=None):
    """ImageFolder of ``n`` samples, one class folder each (``c<i:03d>/img.jpg``), so label ==
    sample index.

    Parameters
    ----------
    root : str
        Directory to write into.
    n : int
        Number of samples.
    bad : dict or None
        ``{index: "corrupt" | "not-jpeg"}``: samples written as :func:`bad_jpeg`.

    Returns
    -------
    str
        ``root``.
    """
    bad = bad or {}
    for i in range(n):
        d = os.path.join(root, f"c{i:03d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "img.jpg"), "wb") as f:
            f.write(bad_jpeg(bad[i]) if i in bad else sample_jpeg(i))
    return root


class TinySource:
    """A source of ``n`` 24-byte records (a PNG signature, then the index as 16 bytes) with
    labels ``index % 1000``: packing and index-loading at the scale of millions of records,
    where what is measured is the format, not the images."""

    classes = None

    def __init__(self, n):
        self.labels = np.arange(n, dtype=np.int64) % 1000

    def __len__(self):
        return len(self.labels)

    def read(self, i):
        return b"\x89PNG\r\n\x1a\n" + int(i).to_bytes(16, "little")

    def relpath(self, i):
        return f"d/{i}.png"

    def spec(self):
        return {"kind": "tiny", "count": len(self)}
