"""The ``dpu-pipe`` command line (also ``python -m dpu_pipe``).

Each subcommand is one entry of :data:`COMMANDS`: ``name -> (help, add_args, run)``, where
``add_args(parser)`` declares its arguments on an ``argparse`` sub-parser and
``run(args) -> int`` does the work and returns the exit status. ``add_args`` and ``run`` may
also be ``"module:function"`` strings (relative to ``dpu_pipe.tools``, e.g. ``".demo:run"``),
imported only when needed.

Exit status: 0 on success, 1 when the work failed, 2 for invalid arguments or configuration
(argparse's convention), 130 when interrupted.
"""

import argparse
import importlib
import json
import os
import sys

import numpy as np

from ..errors import ConfigError, DpuPipeError

__all__ = ["COMMANDS", "main", "add_data", "add_images", "add_seed", "add_json", "add_plots",
           "positive_int", "nonnegative_int"]


# -- the flags every subcommand spells the same way ---------------------------------------
# One meaning everywhere, help on every option, and argparse errors that name the flag
# ("argument -n/--images: ...").

def _int_at_least(text, low):
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
    return value


def positive_int(text):
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def nonnegative_int(text):
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def add_data(p, what="dataset to use"):
    p.add_argument("--data", metavar="PATH",
                   help=f"{what}: an ImageFolder directory, a packed file or a file list "
                        f"(default: an ImageNet-like dataset made once from real photographs "
                        f"under $XDG_CACHE_HOME/dpu_pipe, i.e. ~/.cache/dpu_pipe)")


def add_images(p, default):
    p.add_argument("-n", "--images", type=positive_int, default=default, metavar="N",
                   help=f"number of images (default: {default})")


def add_seed(p):
    p.add_argument("--seed", type=nonnegative_int, default=0,
                   help="seed of the random crops and of a generated dataset (default: 0)")


def add_json(p):
    p.add_argument("--json", metavar="PATH", nargs="?", const="-",
                   help="write the results as JSON to PATH; without PATH (or with '-'), print "
                        "them as JSON on stdout instead of the table")


def add_plots(p):
    p.add_argument("--plots", metavar="DIR",
                   help="also write PNG plots of the results into DIR (needs matplotlib)")


def write_json(path, result):
    """Write ``result`` as JSON to ``path`` (``-`` = stdout)."""
    text = json.dumps(result, indent=2, default=_jsonable)
    if path == "-":
        print(text)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")


def _jsonable(obj):
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")


# -- pack -------------------------------------------------------------------------------

def _pack_args(p):
    p.add_argument("paths", nargs="+", metavar="SRC OUT",
                   help="SRC: the dataset, an ImageFolder directory (root/<class>/*.jpg), a "
                        "file list ('path,label' or 'path label' per line), WebDataset tar "
                        "shards ('train-{0000..0146}.tar'), Parquet or Arrow files, or a "
                        "packed dataset (left out with --factory); OUT: the packed dataset "
                        "directory to write (an existing packed dataset there is replaced "
                        "once the new one is complete)")
    p.add_argument("--factory", metavar="MODULE:CALLABLE",
                   help="build the source by calling this importable callable (a source "
                        "following dpu_pipe.sources.base's protocol) with --args")
    p.add_argument("--args", dest="factory_args", default="{}", metavar="JSON",
                   help="keyword arguments of --factory, a JSON object (default: {})")
    p.add_argument("--image-key", action="append", metavar="EXT",
                   help="tar shards: extension of the image member, repeatable, in order of "
                        "preference (default: jpg jpeg png webp)")
    p.add_argument("--label-key", default="cls",
                   help="tar shards: 'cls' (a <key>.cls member), 'json:FIELD', or 'none' "
                        "(default: cls)")
    p.add_argument("--image-column", default="image",
                   help="Parquet/Arrow: the image column (default: image)")
    p.add_argument("--label-column", default="label",
                   help="Parquet/Arrow: the label column, or 'none' (default: label)")
    p.add_argument("--shard-size", type=_size, default="1GiB", metavar="SIZE",
                   help="target bytes per shard, e.g. 1GiB, 256MiB, 500MB (default: 1GiB)")
    p.add_argument("--no-transcode", dest="transcode", action="store_false",
                   help="keep each JPEG's original bytes instead of transcoding it losslessly "
                        "to baseline with restart markers")
    p.add_argument("--restart-interval", type=_interval, default=1, metavar="MCUS",
                   help="MCUs per restart interval of transcoded JPEGs, or 'row' for one "
                        "interval per MCU row (default: 1)")
    p.add_argument("--max-side", type=positive_int, default=None, metavar="PIXELS",
                   help="lossy, off by default: downscale every JPEG whose longer side "
                        "exceeds PIXELS to that longer side (aspect ratio kept; Pillow, "
                        "antialiased Lanczos, re-encoded at quality 90) before transcoding")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="threads reading and transcoding records (default: one per CPU this "
                        "process may use); the output does not depend on it")
    p.add_argument("--root", help="directory that relative paths of a file list are "
                                  "resolved against (default: the list's directory)")
    p.add_argument("--alignment", type=positive_int, default=64,
                   help="record alignment in bytes, a power of two (default: 64)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip re-reading each written shard to check every record's CRC")
    add_json(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def _interval(text):
    """argparse type of --restart-interval: 'row' or a number of MCUs."""
    return text if text == "row" else _int_at_least(text, 1)


def _size(text):
    """argparse type of --shard-size: bytes, from e.g. '1GiB'."""
    from ..packed.writer import parse_size
    try:
        return parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _pack_source(args):
    """``(source, out)`` of the pack command's arguments."""
    from ..sources import ParquetSource, WebDataset, open_path, open_source, path_kind

    if len(args.paths) != (1 if args.factory else 2):
        raise ConfigError("pack takes SRC OUT, or OUT alone with --factory")
    if args.factory:
        try:
            kwargs = json.loads(args.factory_args)
        except ValueError as e:
            raise ConfigError(f"--args is not JSON: {e}") from None
        if not isinstance(kwargs, dict):
            raise ConfigError("--args must be a JSON object of keyword arguments")
        return open_source({"factory": args.factory, "args": kwargs}), args.paths[0]
    src, out = args.paths
    kind = path_kind(src)
    if kind == "webdataset":
        label_key = None if args.label_key.lower() == "none" else args.label_key
        return WebDataset(src, image_keys=args.image_key or ("jpg", "jpeg", "png", "webp"),
                          label_key=label_key), out
    if kind == "parquet":
        label = None if args.label_column.lower() == "none" else args.label_column
        return ParquetSource(src, image_column=args.image_column, label_column=label), out
    return open_path(src, root=args.root), out


def _pack_run(args):
    from ..packed.writer import pack

    src, out = _pack_source(args)
    packed = pack(src, out, shard_size=args.shard_size,
                  transcode=args.transcode, restart_interval=args.restart_interval,
                  threads=args.threads, progress=False if args.quiet else None,
                  verify=args.verify, alignment=args.alignment, max_side=args.max_side)
    summary = _packed_summary(packed)
    summary["verified"] = bool(args.verify)
    if args.json:
        write_json(args.json, summary)
        if args.json == "-":
            return 0
    formats = ", ".join(f"{n} {name.upper()}" for name, n in summary["formats"].items())
    print(f"wrote {summary['path']}: {summary['count']} records ({formats}) in "
          f"{summary['shards']} shards, {summary['total_bytes']} bytes of records; "
          f"{summary['transcoded']} JPEGs transcoded"
          + (f" ({100 * summary['size_growth']:+.1f} % in size)" if summary["transcoded"] else "")
          + (f"; {summary['max_side']['resized']} downscaled to at most "
             f"{summary['max_side']['max_side']} pixels a side" if summary["max_side"] else "")
          + (", every shard re-read and its CRCs checked" if args.verify else ""))
    if summary["unreadable"]:
        print(f"{summary['unreadable']} records have a header their decoder cannot read "
              f"(kept; a loader reports them): "
              f"{', '.join(packed.dataset.meta['unreadable_examples'][:5])}"
              f"{', ...' if summary['unreadable'] > 5 else ''}")
    return 0


# -- info -------------------------------------------------------------------------------

def _info_args(p):
    p.add_argument("path", nargs="?", help="the same as --data")
    p.add_argument("--data", metavar="PATH",
                   help="also summarise this dataset (directory, file list or packed dataset)")
    p.add_argument("--root", help="root for relative paths of a file list")
    p.add_argument("--verify", action="store_true",
                   help="packed dataset: check every shard (index and record CRCs) and "
                        "name the ones that fail; a shard file given alone is checked alone")
    add_json(p)


def _packed_summary(src):
    """What a packed dataset's manifest says: counts, shards, sizes, formats, transcoding."""
    from ..packed.format import FORMATS

    ds = src.dataset
    meta = ds.meta
    data, orig = int(meta["data_bytes"]), int(meta["orig_bytes"])
    return {
        "path": ds.path,
        "format": f"dpu_pipe packed v{ds.header['version']}",
        "count": len(src),
        "shards": ds.num_shards,
        "total_bytes": data,
        "original_bytes": orig,
        "size_growth": data / orig - 1 if orig else 0.0,
        "transcoded": int(ds.shards["transcoded"].sum()),
        "transcode": meta.get("transcode"),
        "max_side": meta.get("max_side"),
        "formats": {name: meta["formats"][name] for name in FORMATS
                    if name in meta.get("formats", {})},
        "unreadable": int(meta.get("unreadable", 0)),
        "classes": src.classes,
        # From the manifest: a billion labels are not read to summarise them.
        "num_labels": meta["num_labels"],
        "label_range": meta["label_range"],
    }


def _shard_summary(path, verify):
    """One shard of a packed dataset, on its own (None when ``path`` is not a shard)."""
    from ..packed.format import SHARD_MAGIC
    from ..packed.reader import PackedShard

    try:
        with open(path, "rb") as f:
            if f.read(len(SHARD_MAGIC)) != SHARD_MAGIC:
                return None
    except OSError:
        return None
    sh = PackedShard(path)
    h, recs = sh.header, sh.records
    out = {
        "path": os.path.abspath(path),
        "format": f"dpu_pipe packed v{h['version']} shard",
        "shard": h["shard"],
        "records": [h["first"], h["first"] + h["count"] - 1],
        "count": h["count"],
        "total_bytes": int(recs["length"].sum()),
        "original_bytes": int(recs["orig_length"].sum()),
    }
    if verify:
        try:
            sh.verify()
            out["bad_shards"] = {}
        except ConfigError as e:
            out["bad_shards"] = {str(h["shard"]): str(e)}
    sh.close()
    return out


def _summary(path, root, verify):
    """Count, classes, total bytes and format of the dataset at ``path``."""
    from ..sources import PackedSource, open_path

    shard = _shard_summary(path, verify)
    if shard is not None:
        return shard
    src = open_path(path, root=root)
    if isinstance(src, PackedSource):
        out = _packed_summary(src)
        if verify:
            failures = src.dataset.check()
            out["bad_shards"] = {str(k): msg for k, msg in sorted(failures.items())}
        return out
    if verify:
        raise ConfigError("--verify applies to packed datasets")
    kind = getattr(src, "kind", None)
    if kind in ("image_folder", "file_list"):
        files = [src.describe(i) for i in range(len(src))]
        fmt = {"image_folder": "ImageFolder directory", "file_list": "file list"}[kind]
    else:
        # Container sources (tar shards, Parquet/Arrow files): the containers' sizes.
        args = src.spec().get("args", {})
        files = args.get("shards") or args.get("paths") or []
        fmt = f"{type(src).__name__} ({len(files)} files)"
    # Sizes come from stat: one call per file, no data read.
    total, missing = 0, 0
    for f in files:
        try:
            total += os.stat(f).st_size
        except OSError:
            missing += 1
    labels = src.labels
    out = {
        "path": os.path.abspath(path),
        "format": fmt,
        "count": len(src),
        "total_bytes": total,
        "classes": src.classes,
        "num_labels": int(len(np.unique(labels, axis=0))),
        "label_range": [labels.min().item(), labels.max().item()],
        "label_dtype": str(labels.dtype),
        "label_shape": list(labels.shape[1:]),
    }
    if missing:
        out["unreadable_files"] = missing
    return out


def _print_kv(title, d):
    print(f"{title}:")
    width = max(map(len, d), default=0)
    for k, v in d.items():
        if k == "classes" and isinstance(v, list):
            v = f"{len(v)}: {', '.join(v[:8])}{', ...' if len(v) > 8 else ''}"
        elif k in ("total_bytes", "original_bytes"):
            v = f"{v} ({v / 2**20:.1f} MiB)"
        elif k == "size_growth":
            v = f"{100 * v:+.2f} %"
        print(f"  {k:<{width}}  {v}")


def _info_run(args):
    from ..build_info import build_info
    from ..cache import ALIGN, ENTRY_BYTES, table_bytes

    if args.path is not None and args.data is not None:
        raise ConfigError("info: give the dataset once, as PATH or as --data")
    path = args.data if args.data is not None else args.path
    if path is None and (args.verify or args.root):
        raise ConfigError("--verify and --root need a dataset (--data PATH)")
    result = {"build": build_info()}
    if path is not None:
        result["dataset"] = _summary(path, args.root, args.verify)
    # What a decoded-sample cache spends beside the pixels: its table's bytes per sample of
    # the source, the alignment of each stored sample, and the dataset's whole table.
    result["cache"] = {"entry_bytes": ENTRY_BYTES, "align": ALIGN}
    if result.get("dataset", {}).get("count"):
        result["cache"]["table_bytes"] = table_bytes(result["dataset"]["count"])
    if args.json:
        write_json(args.json, result)
    build = result["build"]
    if args.json != "-":
        _print_kv("dpu_pipe build", {k: v for k, v in build.items()
                                     if k not in ("cpu_ok", "cpu_check")})
        verdict = {True: "ok", False: "FAILS", None: "unknown"}[build["cpu_ok"]]
        print(f"cpu check: {verdict}: {build['cpu_check']}")
        if "dataset" in result:
            _print_kv("dataset", result["dataset"])
        _print_kv("decoded cache (cache_bytes)", result["cache"])
    return 1 if result.get("dataset", {}).get("bad_shards") or build["cpu_ok"] is False else 0


# -- registry and entry point -----------------------------------------------------------

#: name -> (help, add_args, run); see the module docstring.
COMMANDS = {
    "pack": ("pack a dataset into memory-mappable shards plus a manifest", _pack_args,
             _pack_run),
    "info": ("show how dpu_pipe was built, and summarise a dataset", _info_args, _info_run),
    "demo": ("make a dataset from real photographs, train a small CNN on it, report phases",
             ".demo:add_args", ".demo:run"),
    "bench": ("decode + RandomResizedCrop + flip + normalize img/s against Pillow and OpenCV",
              ".bench_augment:add_args", ".bench_augment:run"),
    "bench-train": ("epoch time of a CNN's training with torchvision, DataLoader, Loader, offload "
                    "and offloaded validation, side by side (table, JSON, plots)",
                    ".bench_train:add_args", ".bench_train:run"),
    "plan": ("producer cores, window and producer memory, bandwidth a host needs for a "
             "training rate", ".plan:add_args", ".plan:run"),
}


def _resolve(fn):
    if callable(fn):
        return fn
    module, _, attr = fn.partition(":")
    return getattr(importlib.import_module(module, package=__package__), attr)


def _parser():
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog="dpu-pipe",
        description="JPEG decode and augmentation for DNN training, on the host or on DPUs.")
    parser.add_argument("--version", action="version", version=f"dpu_pipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, add_args, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        _resolve(add_args)(p)
    return parser


def main(argv=None):
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    args = _parser().parse_args(argv)
    run = _resolve(COMMANDS[args.command][2])
    try:
        return int(run(args) or 0)
    except DpuPipeError as e:
        print(f"dpu-pipe {args.command}: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except KeyboardInterrupt:
        print(f"dpu-pipe {args.command}: interrupted", file=sys.stderr)
        return 130
