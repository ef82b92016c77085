"""dpu_pipe: JPEG decode and ImageNet-style augmentation in Cython kernels, runnable on the
host or offloaded to DPU cores that ship ready batches into the host's memory over MPI RMA."""

from .errors import ConfigError, DecodeError, DpuPipeError, PipeTimeout, ProducerError
from .build_info import build_info
from .loader import Loader
from .offload import DPULoader
from .packed import pack
from .transforms import TransformConfig
from .validation import RemoteValidation
from .sources import FileList, ImageFolder, PackedSource, open_source

__version__ = "0.1.0"

__all__ = [
    "build_info",
    "FileList",
    "ImageFolder",
    "Loader",
    "open_source",
    "pack",
    "PackedSource",
    "ConfigError",
    "DecodeError",
    "DPULoader",
    "DpuPipeError",
    "PipeTimeout",
    "ProducerError",
    "RemoteValidation",
    "TransformConfig",
]
