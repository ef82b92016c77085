"""The datasets of ``scripts/gpu_check.sh`` (ImageFolders of generated JPEGs, see
:func:`common.make_image_folder`)::

    python scripts/gpu/make_data.py ROOT

makes ``ROOT/offload`` (16 classes x 4 images) for the offload check and ``ROOT/train``
(10 x 32) and ``ROOT/val`` (10 x 8) for the training run, and prints their sizes.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import make_image_folder  # noqa: E402

#: name: (classes, images per class, seed)
SETS = {"offload": (16, 4, 1), "train": (10, 32, 2), "val": (10, 8, 3)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root")
    args = ap.parse_args(argv)
    for name, (classes, per_class, seed) in SETS.items():
        make_image_folder(os.path.join(args.root, name), classes, per_class, seed=seed)
        print(f"{name}: {classes * per_class} images", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
