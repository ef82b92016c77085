"""What this installation of dpu_pipe was built with."""

import platform
import sys


def build_info():
    """A dict describing the build: dpu_pipe, libjpeg-turbo, SIMD target, compiler, Cython,
    numpy and Python versions, machine. ``dpu-pipe info`` prints it."""
    import numpy

    from . import __version__, _jpeg

    info = {"dpu_pipe": __version__}
    info.update(_jpeg.build_flags())
    try:
        import Cython
        info["cython"] = Cython.__version__
    except ImportError:  # installed from a wheel: Cython is a build-time dependency only
        info["cython"] = None
    info["numpy"] = numpy.__version__
    info["python"] = sys.version.split()[0]
    info["machine"] = platform.machine()
    return info
