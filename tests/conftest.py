"""Fixtures shared by the test files: datasets made once per session and read by every file
that asks for the same one. Tests must not write into a session dataset; the helpers behind
them live in ``tests/helpers.py``, which the scripts run under mpiexec import too.

pytest puts this directory on ``sys.path`` (rootdir-relative conftest, no ``__init__.py``),
so ``import helpers`` and the other modules here work from ``tests/mpi/`` as well.
"""
import pytest

import helpers


@pytest.fixture(scope="session")
def photo_folder(tmp_path_factory):
    """``photo_folder(n, classes=None, shape=(40, 3, 50, 2), quality=75)``: the path of an
    ImageFolder of ``n`` photographs written by :func:`helpers.photo_folder` with those
    arguments, made once per session (read-only)."""
    made = {}

    def get(n, classes=None, shape=(40, 3, 50, 2), quality=75):
        key = (n, classes, tuple(shape), quality)
        if key not in made:
            root = tmp_path_factory.mktemp("photos") / "ds"
            made[key] = helpers.photo_folder(root, n, classes=classes, shape=shape,
                                             quality=quality)
        return made[key]

    return get


@pytest.fixture(scope="session")
def mpi_dataset(tmp_path_factory):
    """``mpi_dataset(n, bad=None)``: the root (str) of :func:`helpers.make_dataset`'s
    ImageFolder of ``n`` samples, label == sample index, ``bad`` ``{index: kind}`` files that
    do not decode; made once per session (read-only)."""
    made = {}

    def get(n, bad=None):
        key = (n, tuple(sorted((bad or {}).items())))
        if key not in made:
            root = tmp_path_factory.mktemp("mpi-data") / "data"
            made[key] = helpers.make_dataset(str(root), n, bad=bad)
        return made[key]

    return get


@pytest.fixture(scope="session")
def format_folder(tmp_path_factory):
    """The ImageFolder (path, str) that ``dataset_formats`` writes other formats from:
    3 classes x 7 samples, a few of them PNG (read-only)."""
    import dataset_formats as dfm

    return dfm.make_folder(str(tmp_path_factory.mktemp("formats") / "folder"))
