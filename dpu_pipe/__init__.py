"""dpu_pipe: JPEG decode and ImageNet-style augmentation in Cython kernels, runnable on the
host or offloaded to DPU cores that ship ready batches into the host's memory over MPI RMA."""

try:
    from . import _jpeg, _ops, _pipeline, _rng  # noqa: F401 - the compiled kernels
except ImportError as exc:
    # Without this, the first module that needs a kernel fails with a confusing "cannot
    # import name ... (most likely due to a circular import)".
    import os as _os
    import sysconfig as _sysconfig

    raise ImportError(
        f"dpu_pipe: the compiled kernels are not built: no importable dpu_pipe._jpeg/_ops/"
        f"_pipeline/_rng{_sysconfig.get_config_var('EXT_SUFFIX')} in "
        f"{_os.path.dirname(_os.path.abspath(__file__))}. Install a binary wheel, or "
        f"build from a source tree (pip install . with Cython, a C compiler and libjpeg-turbo "
        f"headers; in a checkout: python setup.py build_ext --inplace)") from exc

from .errors import ConfigError, DecodeError, DpuPipeError, PipeTimeout, ProducerError
from .build_info import build_info
from .loader import DPULoader, Loader
from .packed.writer import pack
from .progressive import ProgressiveSize, progressive_size
from .transforms import TransformConfig
from .offload.validation import RemoteValidation
from .sources import FileList, ImageFolder, PackedSource, ParquetSource, WebDataset, open_source

from ._version import __version__

__all__ = [
    "build_info", "FileList", "ImageFolder", "Loader", "open_source", "pack", "PackedSource",
    "ParquetSource", "ConfigError", "DecodeError", "DPULoader", "DpuPipeError", "PipeTimeout",
    "ProducerError", "progressive_size", "ProgressiveSize", "RemoteValidation",
    "TransformConfig", "WebDataset",
]
