"""The fuzz targets on their seeds and on every checked-in regression input.

Each file under tests/fuzz/regressions/<target>/ is an input that once crashed or tripped a
sanitizer (or a target's own check); replaying it through the same target in the normal build
keeps the fix. The seeds (real JPEGs of every kind, a packed dataset, file lists) pass through
the targets too, so a target's own checks are tested on valid data.
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import seeds  # noqa: E402
import targets  # noqa: E402

pytestmark = pytest.mark.timeout(300)

REGRESSIONS = sorted(
    (t, name) for t in targets.TARGETS
    for name in (os.listdir(os.path.join(HERE, "regressions", t))
                 if os.path.isdir(os.path.join(HERE, "regressions", t)) else ()))


@pytest.fixture(scope="module")
def seed_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("seeds"))
    seeds.write_all(d)
    return d


@pytest.mark.parametrize("target", sorted(targets.TARGETS))
def test_seeds_pass_their_target(seed_dir, target):
    d = os.path.join(seed_dir, target)
    names = sorted(os.listdir(d))
    assert names
    for name in names:
        with open(os.path.join(d, name), "rb") as f:
            targets.TARGETS[target](f.read())


def test_decode_seeds_decode():
    """The decoder seeds are valid JPEGs (except the ones made to be refused): the fuzzer
    starts inside the decoder, not at its first check."""
    from dpu_pipe import DecodeError, jpeg

    refused = {"exif_only", "precision12_header"}
    for name, data in seeds.jpegs().items():
        if name in refused:
            with pytest.raises(DecodeError):
                jpeg.decode(data)
        else:
            assert jpeg.decode(data).size, name


@pytest.mark.parametrize("target,name", REGRESSIONS or [pytest.param(None, None, marks=pytest.mark.skip(reason="no regression inputs"))])
def test_regression_input(target, name):
    with open(os.path.join(HERE, "regressions", target, name), "rb") as f:
        targets.TARGETS[target](f.read())
