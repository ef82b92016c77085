"""Sources of individual image files: :class:`ImageFolder` (class sub-folders) and the file
reading that :class:`~dpu_pipe.sources.filelist.FileList` shares."""

import os
import stat

from .. import _validate as _v
from ..errors import ConfigError, DecodeError
from .base import Source, frozen_labels

__all__ = ["ImageFolder", "JPEG_EXTENSIONS", "IMG_EXTENSIONS"]

JPEG_EXTENSIONS = (".jpg", ".jpeg")
#: The file extensions ImageFolder takes: torchvision's ``IMG_EXTENSIONS``. JPEGs take the fast
#: path; other formats (and non-JPEG data behind any name) are decoded by OpenCV.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class FileSource(Source):
    """A source whose samples are individual files: ``_root`` plus relative paths."""

    @property
    def root(self):
        """The directory relative paths are resolved against."""
        return self._root

    def _path(self, i):
        self._check_index(i)
        return os.path.join(self._root, self._relpaths[i])

    def relpath(self, i):
        self._check_index(i)
        return self._relpaths[i]

    def _all_relpaths(self):
        return self._relpaths

    def describe(self, i):
        return self._path(i)

    def read(self, i):
        path = self._path(i)
        if "\0" in path:  # the OS cannot name it: open() would raise ValueError
            raise DecodeError("cannot read: the path contains a NUL byte", index=i, path=path)
        try:
            # Non-blocking, and regular files only: a FIFO would block until a writer
            # appears and a device such as /dev/zero never ends.
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise DecodeError("cannot read: not a regular file", index=i, path=path)
                # closefd=False: the finally closes fd once, even on Ctrl-C in between.
                with open(fd, "rb", closefd=False) as f:
                    return f.read()
            finally:
                os.close(fd)
        except OSError as e:
            raise DecodeError(f"cannot read: {e}", index=i, path=path) from e


class ImageFolder(FileSource):
    """Image files in class sub-folders: ``root/<class>/**/<file>.jpg`` (or .png, ...).

    Classes are the sub-directories of ``root`` in sorted (code point) order, labelled
    ``0 .. C-1`` as torchvision's ``ImageFolder`` does. Files with an extension of
    :data:`IMG_EXTENSIONS` in any letter case are taken from each class folder and its
    sub-folders (symlinks followed); files directly in ``root`` and hidden entries are
    ignored. Samples are ordered by class, directory, then file name, so every node listing
    the same tree gets the same indices.

    Raises :class:`ConfigError` when ``root`` is not a directory or holds no image, and, as
    torchvision does, for a class folder without a usable file unless ``allow_empty=True``
    (which keeps its label).
    """

    kind = "image_folder"

    def __init__(self, root, *, allow_empty=False):
        self._allow_empty = _v.boolean(allow_empty, "allow_empty")
        root = os.path.abspath(os.fspath(root))
        if not os.path.isdir(root):
            raise ConfigError(f"ImageFolder root is not a directory: {root}")
        try:
            classes = sorted(e.name for e in os.scandir(root)
                             if e.is_dir() and not e.name.startswith("."))
        except OSError as e:
            raise ConfigError(f"cannot list ImageFolder root: {e}") from e

        def walk_error(err):
            # Skipping an unreadable sub-folder on one node only would make listings differ.
            raise ConfigError(f"cannot list ImageFolder sub-folder: {err}") from err
        relpaths, labels, empty = [], [], []
        for label, cls in enumerate(classes):
            found = []
            for dirpath, dirnames, filenames in os.walk(os.path.join(root, cls),
                                                        onerror=walk_error, followlinks=True):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
                for name in filenames:
                    if not name.startswith(".") and name.lower().endswith(IMG_EXTENSIONS):
                        found.append((rel, name))
            found.sort()  # os.walk's order depends on the file system; this does not
            relpaths.extend(f"{d}/{n}" for d, n in found)
            labels.extend([label] * len(found))
            if not found:
                empty.append(cls)
        if not relpaths:
            what = (f"class folders {classes[:5]}{'...' if len(classes) > 5 else ''}"
                    if classes else "no class sub-folders")
            raise ConfigError(f"no image files found under ImageFolder root {root} ({what}); "
                              f"expected root/<class>/<image>.jpg, with extensions "
                              f"{', '.join(IMG_EXTENSIONS)}")
        if empty and not self._allow_empty:
            raise ConfigError(f"Found no valid file for the classes {', '.join(empty)} under "
                              f"{root}. Supported extensions are: {', '.join(IMG_EXTENSIONS)} "
                              f"(allow_empty=True keeps empty classes)")
        self._root = root
        self._relpaths = relpaths
        self._labels = frozen_labels(labels)
        self.classes = classes

    def _spec(self):
        return {"root": self._root, "allow_empty": self._allow_empty}
