"""The ``dpu-pipe`` command line (also ``python -m dpu_pipe``).

Each subcommand is one entry of :data:`COMMANDS`: ``name -> (help, add_args, run)``, where
``add_args(parser)`` declares its arguments on an ``argparse`` sub-parser and
``run(args) -> int`` does the work and returns the exit status. Adding a subcommand is
adding one entry; ``add_args`` and ``run`` may also be ``"module:function"`` strings
(relative to ``dpu_pipe.tools``, e.g. ``".bench:run"``), imported only when
needed, so a subcommand can live in its own module.

Exit status: 0 on success, 1 when the work failed, 2 for invalid arguments or configuration
(argparse's convention), 130 when interrupted.
"""

import argparse
import importlib
import json
import os
import sys

from ..errors import ConfigError, DpuPipeError

__all__ = ["COMMANDS", "main"]


# -- pack -------------------------------------------------------------------------------

def _pack_args(p):
    p.add_argument("src", help="dataset: an ImageFolder directory (root/<class>/*.jpg), "
                               "a file list ('path,label' or 'path label' per line), "
                               "or a packed file")
    p.add_argument("out", help="packed file to write (replaced atomically)")
    p.add_argument("--root", help="directory that relative paths of a file list are "
                                  "resolved against (default: the list's directory)")
    p.add_argument("--alignment", type=int, default=64,
                   help="record alignment in bytes, a power of two (default: 64)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip re-reading the written file to check every record's CRC")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def _pack_run(args):
    from ..packed import pack
    from ..sources import open_path

    src = open_path(args.src, root=args.root)
    packed = pack(src, args.out, progress=not args.quiet, verify=args.verify,
                  alignment=args.alignment)
    size = os.path.getsize(packed.path)
    print(f"wrote {packed.path}: {len(packed)} records, {size} bytes"
          f"{', verified' if args.verify else ''}")
    return 0


# -- info -------------------------------------------------------------------------------

def _info_args(p):
    p.add_argument("path", nargs="?",
                   help="also summarise this dataset (directory, file list or packed file)")
    p.add_argument("--root", help="root for relative paths of a file list")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _summary(path, root):
    """Count, classes, total bytes and format of the dataset at ``path``."""
    from ..packed import VERSION
    from ..sources import PackedSource, open_path

    src = open_path(path, root=root)
    labels = src.labels
    if isinstance(src, PackedSource):
        total = src.file.total_bytes
        fmt = f"dpu_pipe packed v{VERSION}"
        missing = 0
    else:
        # File sizes come from stat: one call per file, no data read.
        total, missing = 0, 0
        for i in range(len(src)):
            try:
                total += os.stat(src.describe(i)).st_size
            except OSError:
                missing += 1
        fmt = {"image_folder": "ImageFolder directory", "file_list": "file list"}[src.kind]
    out = {
        "path": os.path.abspath(path),
        "format": fmt,
        "count": len(src),
        "total_bytes": total,
        "classes": src.classes,
        "num_labels": int(len(set(labels.tolist()))),
        "label_range": [int(labels.min()), int(labels.max())],
    }
    if missing:
        out["unreadable_files"] = missing
    return out


def _print_kv(title, d):
    print(f"{title}:")
    width = max(len(k) for k in d) if d else 0
    for k, v in d.items():
        if k == "classes" and isinstance(v, list) and len(v) > 8:
            v = f"{len(v)}: {', '.join(v[:8])}, ..."
        elif k == "classes" and isinstance(v, list):
            v = f"{len(v)}: {', '.join(v)}"
        elif k == "total_bytes":
            v = f"{v} ({v / 2**20:.1f} MiB)"
        print(f"  {k:<{width}}  {v}")


def _info_run(args):
    result, status = {}, 0
    try:
        # Imported here: it loads the compiled kernels, which `pack` does not need.
        from ..build_info import build_info
        result["build"] = build_info()
    except ImportError as e:
        result["build"] = {"error": f"compiled kernels unavailable: {e}"}
        status = 1
    if args.path is not None:
        result["dataset"] = _summary(args.path, args.root)
        status = 0  # the question was about the dataset, and it was answered
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_kv("dpu_pipe build", result["build"])
        if "dataset" in result:
            _print_kv("dataset", result["dataset"])
    return status


# -- registry and entry point -----------------------------------------------------------

#: name -> (help, add_args, run); see the module docstring.
COMMANDS = {
    "pack": ("pack a dataset into one memory-mappable file", _pack_args, _pack_run),
    "info": ("show how dpu_pipe was built, and summarise a dataset", _info_args, _info_run),
    "demo": ("make a dataset from real photographs, train a small CNN on it, report phases",
             ".demo:add_args", ".demo:run"),
    "bench": ("decode + RandomResizedCrop + flip + normalize img/s against Pillow and OpenCV",
              ".bench_augment:add_args", ".bench_augment:run"),
    "bench-train": ("epoch time of a CNN's training with torchvision, DataLoader, Loader, offload "
                    "and offloaded validation, side by side (table, JSON, plots)",
                    ".bench_train:add_args", ".bench_train:run"),
    "bench-decode": ("JPEG decode img/s (full, region, DCT-scaled) against Pillow and OpenCV",
                     ".bench:add_args", ".bench:run"),
}


def _resolve(fn):
    if callable(fn):
        return fn
    module, _, attr = fn.partition(":")
    return getattr(importlib.import_module(module, package=__package__), attr)


def _parser():
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="dpu-pipe",
        description="JPEG decode and augmentation for DNN training, on the host or on DPUs.")
    parser.add_argument("--version", action="version", version=f"dpu_pipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
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
    except ConfigError as e:
        print(f"dpu-pipe {args.command}: error: {e}", file=sys.stderr)
        return 2
    except DpuPipeError as e:
        print(f"dpu-pipe {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"dpu-pipe {args.command}: interrupted", file=sys.stderr)
        return 130
