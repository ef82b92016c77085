"""The source distribution round trip: build the sdist, install it into a fresh venv, import
dpu_pipe from there and decode an image — what `pip install dpu_pipe-X.tar.gz` does for a user.

To stay offline and quick, the fresh venv borrows the build tools and numpy of the running
interpreter's environment (a path in a .pth file, so nothing of that environment's own .pth
files — an editable dpu_pipe, say — comes along) and pip builds without isolation. The build
uses DPU_PIPE_DEBUG=1 (-O1), which compiles about three times faster than -O3.
"""

import io
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import venv

import numpy as np
import pytest
from PIL import Image

import dpu_pipe

# Minutes of wheel builds, emulation or fresh venvs: the slow tier.
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(dpu_pipe.__file__)))
# What a checkout holds that is not source: build products, tests, local data. Of the tests,
# the extensions that are compiled like the kernels stay in the copy: the sdist must not take
# them along.
_BUILD_PRODUCTS = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "*.so",
                                         "*.c", "__pycache__", ".cache", "data", ".pytest_cache",
                                         ".benchmarks", "bench")


def _NOT_SOURCE(directory, names):
    ignored = set(_BUILD_PRODUCTS(directory, names))
    if os.path.realpath(directory) == os.path.join(os.path.realpath(REPO), "tests"):
        ignored |= set(names) - {"kernels", "kernel_probes.py"}
    return ignored


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sdist")
    tree = tmp / "tree"
    shutil.copytree(REPO, tree, ignore=_NOT_SOURCE)
    _run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp / "dist")],
         cwd=tree)
    (path,) = (tmp / "dist").glob("dpu_pipe-*.tar.gz")
    return path


def test_sdist_ships_the_kernel_sources(sdist):
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    expected = {os.path.relpath(os.path.join(d, f), REPO)
                for d, _, files in os.walk(os.path.join(REPO, "src", "dpu_pipe"))
                for f in files if f.endswith((".pyx", ".pxd"))}
    assert expected and expected <= names, sorted(expected - names)
    # The tests' own extensions (tests/kernels/*.pyx) are in the tree the sdist was made from.
    assert not [n for n in names if n.startswith("tests/")]
    assert {"LICENSE", "setup.py", "pyproject.toml", "MANIFEST.in"} <= names


def _fresh_venv(env_dir):
    """A venv without dpu_pipe that borrows this environment's packages; returns its python
    and an environment for subprocesses."""
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    with open(os.path.join(site.stdout.strip(), "borrowed.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return py, env


def test_sdist_installs_into_a_fresh_venv_and_decodes(sdist, tmp_path):
    env_dir = tmp_path / "venv"
    py, env = _fresh_venv(env_dir)
    env["DPU_PIPE_DEBUG"] = "1"
    _run([str(py), "-m", "pip", "install", "-q", "--no-index", "--no-deps",
          "--no-build-isolation", "--disable-pip-version-check", str(sdist)],
         cwd=tmp_path, env=env)

    buf = io.BytesIO()
    img = np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    Image.fromarray(img).save(buf, format="JPEG", quality=95)
    (tmp_path / "x.jpg").write_bytes(buf.getvalue())
    script = ("import dpu_pipe, dpu_pipe.jpeg as j, numpy as np\n"
              "a = j.decode(open('x.jpg', 'rb').read())\n"
              "print(dpu_pipe.__file__); print(a.shape); np.save('decoded.npy', a)\n")
    out = _run([str(py), "-c", script], cwd=tmp_path, env=env).stdout.split("\n")
    assert out[0].startswith(str(env_dir)), out  # the installed copy, not the checkout
    assert out[1] == "(40, 56, 3)"
    ref = np.asarray(Image.open(tmp_path / "x.jpg").convert("RGB"))
    assert np.abs(np.load(tmp_path / "decoded.npy").astype(int) - ref).mean() < 2.0


def test_setup_refuses_a_tree_without_kernel_sources(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(REPO, tree, ignore=_NOT_SOURCE)
    shutil.rmtree(tree / "src")
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext"], cwd=tree,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "no Cython sources" in r.stderr


def test_import_without_kernels_says_they_are_not_built(tmp_path):
    py, env = _fresh_venv(tmp_path / "venv")
    shutil.copytree(os.path.join(REPO, "dpu_pipe"), tmp_path / "dpu_pipe",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    r = subprocess.run([str(py), "-c", "import dpu_pipe"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "the compiled kernels are not built" in r.stderr
    assert "circular import" not in r.stderr.splitlines()[-1]
