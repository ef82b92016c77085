"""One version: the package's (dpu_pipe/_version.py) is the one pyproject.toml builds."""
import re
from pathlib import Path

import dpu_pipe
from dpu_pipe.build_info import build_info
from dpu_pipe._version import __version__


def test_the_package_version_is_pyprojects():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    declared = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)
    assert __version__ == declared == dpu_pipe.__version__
    assert build_info()["dpu_pipe"] == declared
