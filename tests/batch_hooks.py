"""Batch hooks the tests name as ``batch_hook="tests.batch_hooks:<function>"`` (importable from
the repository root, which the tests and the MPI launches put on sys.path)."""

import numpy as np


def noise(images, labels, rng):
    """Adds the Generator's noise to every image value (in place); a hook whose output shows
    whether the Generator is the batch's."""
    if images.dtype == np.uint8:
        images ^= rng.integers(0, 4, size=images.shape, dtype=np.uint8)
    else:
        images += rng.standard_normal(images.shape).astype(images.dtype)


def reverse_rows(images, labels, rng):
    """Returns new arrays: the batch in reverse row order (a hook that returns its result)."""
    return images[::-1].copy(), labels[::-1].copy()


def always_fails(images, labels, rng):
    """Raises on every batch."""
    raise RuntimeError("broken hook")


def wrong_shape(images, labels, rng):
    """Returns images of the wrong shape."""
    return images[:1], labels
