"""The source distribution round trip: build the sdist, install it into a fresh venv, import
dpu_pipe from there and decode an image — what `pip install dpu_pipe-X.tar.gz` does for a user.
``python -m build`` and ``pip install`` of it print no deprecation warning.

To stay offline and quick, the fresh venv borrows the build tools and numpy of the running
interpreter's environment (a path in a .pth file, so nothing of that environment's own .pth
files — an editable dpu_pipe, say — comes along) and pip builds without isolation. The build
uses DPU_PIPE_DEBUG=1 (-O1), which compiles about three times faster than -O3.

The install matrix (marked slow) is the path a DPU user without a matching wheel takes: for
every CPython 3.9-3.13 of this machine (pyenv's; 3.10 in the long form only), a fresh venv,
numpy (and mpi4py + mpich) from the package index, ``pip install dpu_pipe-X.tar.gz`` with
build isolation, then one Loader epoch, which must equal this process's bit for bit, a
loader whose source fails (the error must reach the user), and, on Ubuntu 24.04's 3.12, one
offloaded epoch under mpiexec
(DPULoader, one producer). The short form builds with DPU_PIPE_DEBUG=1; the long one,
``DPU_PIPE_INSTALL_MATRIX=full``, builds as users do (-O3) and offloads on every version:

    DPU_PIPE_INSTALL_MATRIX=full .venv/bin/python -m pytest -v tests/test_sdist.py -k matrix
"""

import glob
import io
import json
import os
import re
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
from helpers import run

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


# A deprecation warning of setuptools, pip or the compiler, in any spelling
# (SetuptoolsDeprecationWarning, "is deprecated", -Wdeprecated-declarations).
_DEPRECATION = re.compile(r"deprecat", re.I)


def _deprecations(r):
    return [line for line in (r.stdout + r.stderr).splitlines() if _DEPRECATION.search(line)]


@pytest.fixture(scope="module")
def sdist_build(tmp_path_factory):
    """(path of the sdist, the output of ``python -m build --sdist``)."""
    tmp = tmp_path_factory.mktemp("sdist")
    tree = tmp / "tree"
    shutil.copytree(REPO, tree, ignore=_NOT_SOURCE)
    r = run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir",
             tmp / "dist", tree], cwd=tree, timeout=600)
    (path,) = (tmp / "dist").glob("dpu_pipe-*.tar.gz")
    return path, r


@pytest.fixture(scope="module")
def sdist(sdist_build):
    return sdist_build[0]


def test_build_prints_no_deprecation_warning(sdist_build):
    assert _deprecations(sdist_build[1]) == []


def test_pyproject_lists_every_package_of_the_tree():
    # The package list is explicit: a subpackage left out of it is missing from every wheel
    # and sdist install, while an editable install still finds it.
    text = open(os.path.join(REPO, "pyproject.toml")).read()
    block = re.search(r"^packages = \[(.*?)\]", text, re.M | re.S).group(1)
    listed = set(re.findall(r'"([\w.]+)"', block))
    tree = {os.path.relpath(d, REPO).replace(os.sep, ".")
            for d, _, files in os.walk(os.path.join(REPO, "dpu_pipe")) if "__init__.py" in files}
    assert listed == tree


def test_pyproject_asks_for_the_setuptools_that_reads_its_license():
    # `license = "BSD-3-Clause"` (an SPDX expression) needs setuptools >= 77; an older one
    # fails to make the metadata ("project.license must be valid exactly by one definition").
    text = open(os.path.join(REPO, "pyproject.toml")).read()
    assert re.search(r'^license = "BSD-3-Clause"$', text, re.M)
    assert re.search(r'requires = \["setuptools>=(\d+)"', text).group(1) == "77"
    reqs = open(os.path.join(REPO, "requirements-dev.txt")).read().splitlines()
    assert "setuptools>=77" in reqs


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
    site = run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               timeout=600)
    with open(os.path.join(site.stdout.strip(), "borrowed.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return py, env


_ABI3_WHEEL = []   # a cp311-abi3 debug wheel an earlier test built from the sdist


def test_sdist_installs_into_a_fresh_venv_and_decodes(sdist, tmp_path):
    env_dir = tmp_path / "venv"
    py, env = _fresh_venv(env_dir)
    env["DPU_PIPE_DEBUG"] = "1"
    # What `pip install dpu_pipe-X.tar.gz` does, in its two steps, so that the install matrix
    # can take the stable-ABI wheel instead of compiling the same extensions once more.
    pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
    r = run([*pip, "wheel", "-v", "--no-index", "--no-deps", "--no-build-isolation",
             "-w", tmp_path / "wheels", str(sdist)], cwd=tmp_path, env=env, timeout=600)
    assert _deprecations(r) == []
    (wheel,) = (tmp_path / "wheels").glob("dpu_pipe-*.whl")
    r = run([*pip, "install", "-v", "--no-index", "--no-deps", wheel], cwd=tmp_path, env=env,
            timeout=600)
    assert _deprecations(r) == []
    if "-abi3-" in wheel.name:
        _ABI3_WHEEL[:] = [wheel]

    buf = io.BytesIO()
    img = np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    Image.fromarray(img).save(buf, format="JPEG", quality=95)
    (tmp_path / "x.jpg").write_bytes(buf.getvalue())
    script = ("import dpu_pipe, dpu_pipe.jpeg as j, numpy as np\n"
              "a = j.decode(open('x.jpg', 'rb').read())\n"
              "print(dpu_pipe.__file__); print(a.shape); np.save('decoded.npy', a)\n")
    out = run([str(py), "-c", script], cwd=tmp_path, env=env, timeout=600).stdout.split("\n")
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


# --- the install matrix: the sdist on every CPython of this machine -----------------------------

# 3.12 (Ubuntu 24.04's, the current BlueField images') before 3.11 and 3.13: in the short form
# those install the stable-ABI wheel built from the sdist before them (by the fresh-venv test
# above, when it ran, else by 3.12) instead of compiling the same extensions again.
FULL = os.environ.get("DPU_PIPE_INSTALL_MATRIX", "") == "full"
# The short form builds one version-specific ABI (3.9's, the oldest) and takes the stable-ABI
# wheel on the others; the long one builds 3.10's too (about 95 s more here).
MATRIX = ["3.9", "3.10", "3.12", "3.11", "3.13"] if FULL else ["3.9", "3.12", "3.11", "3.13"]
OFFLOAD = MATRIX if FULL else ["3.12"]
EPOCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "install_epoch.py")


def _interpreter(ver):
    """An x86-64 CPython ``ver`` of this machine: pyenv's, else pythonX.Y on PATH."""
    root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip() \
        if shutil.which("pyenv") else os.path.expanduser("~/.pyenv")
    found = sorted(glob.glob(os.path.join(root or "", "versions", f"{ver}.*", "bin",
                                          f"python{ver}")))
    return found[-1] if found else shutil.which(f"python{ver}")


@pytest.fixture(scope="module")
def matrix_data(tmp_path_factory):
    """An ImageFolder of 14 JPEGs in 3 classes (sizes, subsamplings, a progressive and a grey
    one) and the Loader epoch of tests/install_epoch.py made from it by this checkout."""
    import install_epoch

    root = tmp_path_factory.mktemp("matrix") / "data"
    rng = np.random.default_rng(7)
    for i in range(14):
        h, w = 40 + 9 * i, 64 + 7 * (13 - i)
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        if i == 5:
            img = img.convert("L")
        d = root / f"class{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        img.save(d / f"{i:02d}.jpg", quality=70 + 2 * i, progressive=i == 8,
                 **({} if i == 5 else {"subsampling": ("4:2:0", "4:2:2", "4:4:4")[i % 3]}))
    images, labels = install_epoch.epoch(
        dpu_pipe.Loader(str(root), install_epoch.BATCH, **install_epoch.KW))
    return root, images, labels


def _same_epoch(npz, images, labels):
    with np.load(npz) as z:
        assert z["images"].shape == images.shape and z["images"].tobytes() == images.tobytes()
        assert np.array_equal(z["labels"], labels)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("ver", MATRIX)
def test_install_matrix_sdist_on_each_python(ver, sdist, matrix_data, tmp_path):
    py = _interpreter(ver)
    if py is None:
        pytest.skip(f"no CPython {ver} on this machine (pyenv install {ver})")
    data, ref_images, ref_labels = matrix_data
    env_dir = tmp_path / f"venv{ver}"
    run([py, "-m", "venv", env_dir], timeout=600)
    vpy = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    if not FULL:
        env["DPU_PIPE_DEBUG"] = "1"
    pip = [vpy, "-m", "pip", "--disable-pip-version-check"]
    run([*pip, "install", "-q", "numpy", *(["mpi4py", "mpich"] if ver in OFFLOAD else [])],
        env=env, cwd=tmp_path, timeout=900)
    abi3 = ver not in ("3.9", "3.10")
    if abi3 and _ABI3_WHEEL and not FULL:
        wheel = _ABI3_WHEEL[0]
    else:
        # With build isolation: pip fetches setuptools and Cython as pyproject.toml asks.
        r = run([*pip, "wheel", "-v", "--no-deps", "-w", tmp_path / "wheels", sdist], env=env,
                cwd=tmp_path, timeout=1500)
        assert _deprecations(r) == []
        (wheel,) = (tmp_path / "wheels").glob("dpu_pipe-*.whl")
        if abi3:
            _ABI3_WHEEL[:] = [wheel]
    print(f"\nCPython {ver}: installs {wheel.name}")
    run([*pip, "install", "-q", "--no-deps", wheel], env=env, cwd=tmp_path, timeout=600)

    # Out of the checkout: only the installed dpu_pipe is importable.
    shutil.copy(EPOCH, tmp_path / "install_epoch.py")
    r = run([vpy, "install_epoch.py", "loader", data, "epoch.npz"], env=env, cwd=tmp_path,
            timeout=600)
    info = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"\nCPython {info['python']}: abi {info['abi']}, {info['installed_from']}, "
          f"libjpeg {info['libjpeg_library']}, cpu check: {info['cpu_check']}")
    assert info["python"].startswith(ver + ".")
    assert info["abi"] == ("abi3" if ver not in ("3.9", "3.10") else "cp" + ver.replace(".", ""))
    assert info["installed_from"] == "built here from the source distribution"
    assert info["wheel"].endswith("-linux_x86_64")
    assert ("-abi3-" in info["wheel"]) == (info["abi"] == "abi3")
    assert os.path.exists(info["libjpeg_library"]) and not info["libjpeg_bundled"]
    assert info["cpu_ok"] is True and info["debug_build"] is not FULL
    _same_epoch(tmp_path / "epoch.npz", ref_images, ref_labels)

    # The error of a producer thread reaches the user as itself (on 3.9 the one-argument
    # traceback.format_exception raised a TypeError in its place).
    r = run([vpy, "install_epoch.py", "failing", data], env=env, cwd=tmp_path, timeout=600)
    err = json.loads(r.stdout.strip().splitlines()[-1])
    assert err["type"] == "ProducerError", err
    assert "RuntimeError: storage went away reading sample 2" in err["message"]
    assert "storage went away" in err["traceback"] and "Traceback" in err["traceback"]

    if ver in OFFLOAD:
        mpiexec = env_dir / "bin" / "mpiexec"
        assert mpiexec.exists(), "the mpich wheel brings mpiexec"
        r = run(["timeout", "-k", "5", "240", mpiexec, "-n", "1", vpy, "-m", "mpi4py",
                 "install_epoch.py", "offload", data, "offload.npz", ":", "-n", "1", vpy,
                 "-m", "mpi4py", "-m", "dpu_pipe.worker"], env=env, cwd=tmp_path, timeout=300)
        assert f"OK offload {len(ref_labels)}" in r.stdout, r.stdout + r.stderr[-3000:]
        _same_epoch(tmp_path / "offload.npz", ref_images, ref_labels)
