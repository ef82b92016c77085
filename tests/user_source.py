"""A source written the way a user writes one: a subclass of dpu_pipe.sources.Source that
producers rebuild from its spec (this module must be importable on them)."""

import numpy as np

from dpu_pipe.sources import ImageFolder, Source


class EveryKth(Source):
    """Every ``k``-th image of an ImageFolder, starting at ``start``, labels kept."""

    def __init__(self, root, k=2, start=0):
        self._folder = ImageFolder(root)
        self._root, self._k, self._start = root, int(k), int(start)
        self._picked = np.arange(self._start, len(self._folder), self._k)
        self._labels = np.asarray(self._folder.labels)[self._picked]
        self.classes = self._folder.classes

    def read(self, i):
        self._check_index(i)
        return self._folder.read(int(self._picked[i]))

    def relpath(self, i):
        self._check_index(i)
        return self._folder.relpath(int(self._picked[i]))

    def _spec(self):
        return {"root": self._root, "k": self._k, "start": self._start}


class ForgetsStart(EveryKth):
    """A spec that leaves out an argument: rebuilt, it is another dataset."""

    def _spec(self):
        return {"root": self._root, "k": self._k}


class NotJson(EveryKth):
    def _spec(self):
        return {"root": self._root, "k": (self._k,), "start": self._start}


def every_kth(root, k=2, start=0):
    """The factory form: a plain function."""
    return EveryKth(root, k, start)
