"""Data sources: where the encoded samples of a dataset come from.

The protocol every source follows is documented in :mod:`dpu_pipe.sources.base`. Built in:
:class:`ImageFolder`, :class:`FileList`, :class:`PackedSource`, :class:`WebDataset` (tar
shards) and :class:`ParquetSource` (Parquet and Arrow IPC files, Hugging Face datasets).
"""

import importlib
import json
import os

import numpy as np

from ..errors import ConfigError
from ..packed.reader import is_packed
from .base import Source, fingerprint_of, frozen_labels
from .filelist import LIST_EXTENSIONS, FileList
from .folder import IMG_EXTENSIONS, JPEG_EXTENSIONS, ImageFolder
from .packed import PackedSource
from .parquet import ARROW_EXTENSIONS, PARQUET_EXTENSIONS, ParquetSource, from_hf_dataset
from .webdataset import WebDataset, expand_shards

__all__ = ["Source", "ImageFolder", "FileList", "PackedSource", "WebDataset", "ParquetSource",
           "open_source", "open_path", "as_source", "check_rebuild", "path_kind",
           "from_hf_dataset", "expand_shards", "fingerprint_of", "frozen_labels", "IMG_EXTENSIONS",
           "JPEG_EXTENSIONS", "LIST_EXTENSIONS", "PARQUET_EXTENSIONS", "ARROW_EXTENSIONS"]

TAR_EXTENSIONS = (".tar",)

# Specs written before sources named their factory: {"kind": ..., <fields>, "count", ...}.
_LEGACY = {"image_folder": ("dpu_pipe.sources.folder:ImageFolder", {"root": "root"}),
           "file_list": ("dpu_pipe.sources.filelist:FileList",
                         {"path": "path_or_rows", "rows": "path_or_rows"}),
           "packed": ("dpu_pipe.sources.packed:PackedSource", {})}


def _is_hf_dataset(obj):
    return type(obj).__module__.split(".")[0] == "datasets" and hasattr(obj, "cache_files")


def _looks_like_source(obj):
    return all(hasattr(obj, a) for a in ("read", "labels", "describe", "__len__"))


def _factory(name):
    """The callable that ``"module:attr.attr"`` names."""
    if not isinstance(name, str) or name.count(":") != 1:
        raise ConfigError(f"a source spec's factory must be 'module:callable', got {name!r}")
    module, attr = name.split(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except ImportError as e:
        raise ConfigError(f"source factory {name!r}: cannot import {module!r}: {e}") from None
    except AttributeError:
        raise ConfigError(f"source factory {name!r}: {module!r} has no {attr!r}") from None
    if not callable(obj):
        raise ConfigError(f"source factory {name!r} is not callable")
    return obj


def _legacy(spec):
    factory, renames = _LEGACY[spec["kind"]]
    args = {renames.get(k, k): v for k, v in spec.items()
            if k not in ("kind", "count", "fingerprint")}
    return {"factory": factory, "args": args,
            **{k: spec[k] for k in ("count", "fingerprint") if k in spec}}


def open_source(spec):
    """The source that ``spec`` describes: ``{"factory": "module:callable", "args": {...}}``
    (from :meth:`Source.spec`) is rebuilt as ``callable(**args)``; a Hugging Face
    ``datasets.Dataset`` is opened through its Arrow files (:func:`from_hf_dataset`).

    Raises :class:`ConfigError` for a malformed spec, a factory that cannot be imported or
    fails, a result that is not a source, and when the source rebuilt differs from the one
    described (the spec's ``count`` or ``fingerprint``)."""
    if _is_hf_dataset(spec):
        return from_hf_dataset(spec)
    if isinstance(spec, dict) and spec.get("kind") in _LEGACY:
        spec = _legacy(spec)
    if not isinstance(spec, dict) or "factory" not in spec:
        what = spec.get("kind") if isinstance(spec, dict) else type(spec).__name__
        raise ConfigError(f"not a source spec ({what!r}): expected a dict with 'factory' "
                          f"('module:callable') and 'args'")
    factory = _factory(spec["factory"])
    args = spec.get("args", {})
    if not isinstance(args, dict):
        raise ConfigError(f"source spec of {spec['factory']}: args must be a dict, got "
                          f"{type(args).__name__}")
    try:
        src = factory(**args)
    except TypeError as e:
        raise ConfigError(f"source factory {spec['factory']} does not take args "
                          f"{sorted(args)}: {e}") from None
    if not _looks_like_source(src):
        raise ConfigError(f"source factory {spec['factory']} returned "
                          f"{type(src).__name__}, not a source (read, labels, describe, len)")
    if "count" in spec and spec["count"] != len(src):
        raise ConfigError(f"the dataset {spec['factory']} finds here has {len(src)} samples, "
                          f"the spec describes {spec['count']}: {spec}")
    if "fingerprint" in spec and hasattr(src, "fingerprint") \
            and spec["fingerprint"] != src.fingerprint():
        raise ConfigError(f"the dataset {spec['factory']} finds here differs from the one the "
                          f"spec describes (same count, different names or labels): {spec}")
    return src


_BUILT_IN = (ImageFolder, FileList, PackedSource, WebDataset, ParquetSource)


def check_rebuild(source):
    """The spec of ``source``, after proving on this process that producers can rebuild it:
    it is JSON-serialisable unchanged, and (for a source that is not built in) its factory
    imports and rebuilds a source of the same length, labels and fingerprint. Raises
    :class:`ConfigError` saying which step fails."""
    if not callable(getattr(source, "spec", None)):
        raise ConfigError(f"{type(source).__name__} has no spec(): producers cannot rebuild "
                          f"it (see dpu_pipe.sources.base for the source protocol)")
    spec = source.spec()
    try:
        again = json.loads(json.dumps(spec))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"the spec of {type(source).__name__} is not JSON-serialisable: "
                          f"{e}") from None
    if again != spec:
        raise ConfigError(f"the spec of {type(source).__name__} changes in JSON (tuples or "
                          f"non-string keys?): {spec!r} becomes {again!r}")
    if type(source) in _BUILT_IN:
        return spec
    rebuilt = open_source(again)
    same_labels = np.array_equal(np.asarray(rebuilt.labels), np.asarray(source.labels))
    if len(rebuilt) != len(source) or not same_labels:
        raise ConfigError(f"the spec of {type(source).__name__} rebuilds a different source "
                          f"({len(rebuilt)} samples vs {len(source)}, or other labels)")
    if hasattr(source, "fingerprint") and hasattr(rebuilt, "fingerprint") \
            and rebuilt.fingerprint() != source.fingerprint():
        raise ConfigError(f"the spec of {type(source).__name__} rebuilds a source with "
                          f"another fingerprint")
    return spec


def path_kind(path):
    """``"webdataset"`` (``*.tar``), ``"parquet"`` (``*.parquet``, ``*.arrow``...) or None
    for a path, by its name."""
    low = path.lower()
    if low.endswith(TAR_EXTENSIONS):
        return "webdataset"
    if low.endswith(PARQUET_EXTENSIONS + ARROW_EXTENSIONS):
        return "parquet"
    return None


def open_path(path, *, root=None):
    """Open a dataset path as a source: a packed dataset (its directory or manifest) is a
    :class:`PackedSource`, any other directory an :class:`ImageFolder`, ``*.tar`` (brace
    patterns allowed) a :class:`WebDataset`, ``*.parquet``/``*.arrow`` a
    :class:`ParquetSource`, any other file a :class:`FileList` (``root`` applies to file
    lists only)."""
    path = os.fspath(path)
    kind = "packed" if is_packed(path) else path_kind(path)
    if kind is None and os.path.isdir(path):
        kind = "folder"
    if kind is not None and root is not None:
        where = "the dataset directory " if kind in ("packed", "folder") else ""
        raise ConfigError(f"root= applies to file lists, not to {where}{path}")
    if kind is None and not os.path.exists(path):
        raise ConfigError(f"dataset path does not exist: {path}")
    opener = {"packed": PackedSource, "folder": ImageFolder, "webdataset": WebDataset,
              "parquet": ParquetSource}.get(kind)
    return opener(path) if opener else FileList(path, root=root)


def as_source(obj):
    """A source from what a loader was given: a source object is returned as it is; a
    Hugging Face ``datasets.Dataset`` is opened through its Arrow files; a path is opened by
    :func:`open_path`; a list of tar (or of Parquet) paths opens them together. Anything
    else raises :class:`ConfigError`."""
    if isinstance(obj, (str, bytes, os.PathLike)):
        path = os.fsdecode(obj)
        if (os.path.isfile(path) and not is_packed(path) and path_kind(path) is None
                and not path.lower().endswith(LIST_EXTENSIONS)):
            raise ConfigError(f"{path} is not a dataset: expected a directory (ImageFolder), "
                              f"a packed dataset, tar shards, Parquet/Arrow files, or a file "
                              f"list ({', '.join(LIST_EXTENSIONS)})")
        return open_path(path)
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(p, (str, os.PathLike))
                                                      for p in obj):
        kinds = {path_kind(os.fsdecode(p)) for p in obj}
        if kinds == {"webdataset"}:
            return WebDataset(list(obj))
        if kinds == {"parquet"}:
            return ParquetSource(list(obj))
        raise ConfigError(f"a list of paths must all be tar shards or all Parquet/Arrow "
                          f"files, got {[os.fsdecode(p) for p in obj[:3]]}"
                          f"{'...' if len(obj) > 3 else ''}")
    if _is_hf_dataset(obj):
        return from_hf_dataset(obj)
    if _looks_like_source(obj):
        return obj
    raise ConfigError(f"source must be a dpu_pipe source (ImageFolder, FileList, PackedSource, "
                      f"WebDataset, ParquetSource, or one following dpu_pipe.sources.base's "
                      f"protocol), a datasets.Dataset, a dataset path, or a list of tar "
                      f"shards or of Parquet/Arrow files, got {type(obj).__name__}")
