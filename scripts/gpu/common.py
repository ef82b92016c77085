"""What the steps of ``scripts/gpu_check.sh`` share: their result records, the datasets they
make, and the arithmetic of their measurements (pure functions, checked without a GPU by
``tests/test_gpu_check.py``).

A step writes one JSON record (:func:`write_result`): its name, whether it passed, one line
saying what it found, its checks (name, passed, detail) and its measurements. ``report.py``
turns the records of a run into the report. Only the standard library at import time: the
first step runs before anything else is known to be installed.
"""
import json
import math
import os
import statistics

__all__ = ["Checks", "write_result", "read_results", "make_image_folder", "interval_overlap",
           "summarize_ms", "check_train_records"]


class Checks:
    """The checks of one step, in order: ``add(name, passed, detail)``; :attr:`ok` when every
    one passed (and there is at least one)."""

    def __init__(self):
        self.items = []

    def add(self, name, passed, detail=""):
        """Record one check; returns ``passed`` as a bool."""
        passed = bool(passed)
        self.items.append({"name": str(name), "ok": passed, "detail": str(detail)})
        return passed

    @property
    def ok(self):
        return bool(self.items) and all(c["ok"] for c in self.items)

    def failed(self):
        return [c for c in self.items if not c["ok"]]


def write_result(path, step, checks, summary, **data):
    """Write the JSON record of ``step`` (a :class:`Checks`) to ``path``; returns it."""
    record = {"step": step, "ok": checks.ok, "summary": summary, "checks": checks.items,
              **data}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, default=str)
    os.replace(tmp, path)
    return record


def read_results(folder):
    """The records in ``folder`` (``*.json``), in the order of their ``order`` field, then of
    their names."""
    out = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                out.append(json.load(f))
    return sorted(out, key=lambda r: r.get("order", 99))


def make_image_folder(root, classes, per_class, *, seed=0, min_side=48, max_side=160):
    """An ImageFolder of JPEGs at ``root``: ``classes`` folders ``c000``.. of ``per_class``
    images each, of sizes between ``min_side`` and ``max_side`` pixels a side. Each image is a
    smooth gradient with noise whose class shows in one colour channel (a learnable signal),
    made from ``seed``: the same arguments make the same files. Returns ``root``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(classes):
        d = os.path.join(root, f"c{c:03d}")
        os.makedirs(d, exist_ok=True)
        for i in range(per_class):
            h, w = (int(v) for v in rng.integers(min_side, max_side + 1, 2))
            yy, xx = np.mgrid[0:h, 0:w]
            base = np.stack([(xx * (97 + 13 * k) // max(w, 1) + yy * (51 + 7 * k) // max(h, 1))
                             % 256 for k in range(3)], axis=-1)
            noise = rng.integers(-40, 41, (h, w, 3))
            img = np.clip(base + noise, 0, 255).astype(np.uint8)
            img[..., c % 3] = 255 - img[..., c % 3] // 4
            Image.fromarray(img).save(os.path.join(d, f"{i:04d}.jpg"),
                                      quality=int(70 + (i * 7) % 25),
                                      subsampling=(2, 0, 1)[i % 3])
    return root


def interval_overlap(a, b):
    """Length of the intersection of the intervals ``a = (start, end)`` and ``b`` (same unit;
    0 when they are disjoint)."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def summarize_ms(values):
    """``{"median", "min", "max", "n"}`` of a list of milliseconds (rounded to 1 us)."""
    if not values:
        raise ValueError("no values to summarize")
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "n": len(values)}


def check_train_records(records, *, epochs, producers, val_count, world_size=1):
    """Checks of the ``--json`` records written by ``examples/train_imagenet.py``: one record
    per epoch ``0..epochs-1``, a finite training loss, the expected world size and producer
    count, and a validation of every one of the ``val_count`` samples with metrics in range.
    Returns a :class:`Checks`."""
    checks = Checks()
    got = [r.get("epoch") for r in records]
    checks.add("one record per epoch", got == list(range(epochs)), f"epochs {got}")
    for r in records:
        e = r.get("epoch")
        loss = r.get("train_loss")
        checks.add(f"epoch {e}: finite training loss",
                   isinstance(loss, (int, float)) and math.isfinite(loss), f"train_loss {loss}")
        checks.add(f"epoch {e}: world size and producers",
                   r.get("world_size") == world_size and r.get("producers") == producers,
                   f"world_size {r.get('world_size')}, producers {r.get('producers')}")
        top1, top5 = r.get("val_top1"), r.get("val_top5")
        checks.add(f"epoch {e}: validated every sample",
                   r.get("val_count") == val_count and top1 is not None and top5 is not None
                   and 0.0 <= top1 <= top5 <= 1.0,
                   f"val_count {r.get('val_count')} of {val_count}, top1 {top1}, top5 {top5}")
    return checks
