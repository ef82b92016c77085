"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed). One function
per figure; each takes the result dict a benchmark returns (or its JSON) and a path."""

import os
import textwrap

import numpy as np

from ..errors import ConfigError

__all__ = ["plot_rates", "plot_split", "plot_breakdown", "plot_timeline", "write_plots"]


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, path, **kw):
    try:
        fig.tight_layout()
        fig.savefig(path, dpi=100, **kw)
    finally:
        plt.close(fig)
    return path


def plot_rates(result, path):
    """Horizontal bars of images/s per method (median round) with min–max whiskers over the
    rounds. ``result["rows"]``: dicts with ``method`` (or ``description``), ``img_per_s`` and
    ``min``/``max`` (or ``img_per_s_min``/``img_per_s_max``)."""
    plt = _pyplot()
    rows = result["rows"]
    med = [r["img_per_s"] for r in rows]
    lo = [r.get("min", r.get("img_per_s_min")) for r in rows]
    hi = [r.get("max", r.get("img_per_s_max")) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    ax.barh([r.get("description", r["method"]) for r in rows], med, capsize=4,
            xerr=[[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]],
            color="#4c72b0")
    ax.invert_yaxis()
    ax.set_xlabel("images/s (median round; whiskers: min–max)")
    ax.set_title(f"{result.get('benchmark', 'benchmark')}: {result.get('n', '?')} images, "
                 f"{result.get('repeat', '?')} rounds")
    return _save(plt, fig, path)


def plot_split(result, path):
    """One stacked bar: milliseconds per image of the fused kernel, split into region decode
    and resample/flip/normalize. ``result["split_ms"]``: ``decode``, ``augment``, ``total``."""
    plt = _pyplot()
    sp = result["split_ms"]
    fig, ax = plt.subplots(figsize=(7, 2.6))
    ax.barh(["dpu_pipe"], [sp["decode"]], color="#4c72b0", label="region decode")
    ax.barh(["dpu_pipe"], [sp["augment"]], left=[sp["decode"]], color="#dd8452",
            label="resample + flip + normalize")
    ax.set_xlabel(f"ms per image (total {sp['total']:.2f})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=2, fontsize="small",
              frameon=False)
    return _save(plt, fig, path)


def plot_breakdown(results, path):
    """Stacked bars per configuration and operating point of a training benchmark (host
    compute, host waiting for data, validation on the host's path, the rest; seconds per
    epoch), each labelled with its configuration's name."""
    plt = _pyplot()
    points = list(results["points"])
    fig, axes = plt.subplots(1, len(points), figsize=(6 * len(points), 4.2), squeeze=False)
    parts = (("compute_s", "host compute"), ("wait_s", "host waits for data"),
             ("val_host_s", "validation on host"), ("other_s", "other"))
    for ax, point in zip(axes[0], points):
        rs = [r for r in results["points"][point]["configs"] if "skipped" not in r]
        x = np.arange(len(rs))
        bottom = np.zeros(len(rs))
        for key, label in parts:
            v = np.array([r[key] / r["epochs_run"] for r in rs])
            ax.bar(x, v, bottom=bottom, label=label)
            bottom += v
        ax.set_xticks(x, ["\n".join(textwrap.wrap(r["name"], 18, break_long_words=False))
                          for r in rs], fontsize=7)
        ax.set_ylabel("seconds per epoch")
        ax.set_title(point)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.tight_layout()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=4,
               fontsize=8, frameon=False)
    return _save(plt, fig, path, bbox_inches="tight")


def plot_timeline(result, path, title):
    """Per step of a training run: host compute and host wait as time spans on the host's
    row, and the producer's busy seconds for the batch that step consumed (drawn ending when
    it arrived)."""
    plt = _pyplot()
    tl = result["timeline"]
    fig, ax = plt.subplots(figsize=(10, 2.8))
    ax.broken_barh([(w, r - w) for w, r in zip(tl["wait_start"], tl["ready"])], (20, 8),
                   color="tab:orange", label="host waits")
    ax.broken_barh([(r, d - r) for r, d in zip(tl["ready"], tl["done"])], (20, 8),
                   color="tab:blue", label="host computes")
    if tl.get("producer_s"):
        ax.broken_barh([(r - p, p) for r, p in zip(tl["ready"], tl["producer_s"])], (8, 8),
                       color="tab:green", label="producer busy (per batch)")
    ax.set_yticks([12, 24], ["producer", "host"])
    ax.set_xlabel("seconds since start")
    ax.set_title(title)
    # Below the axes: inside, it covered the last steps of the timeline.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=3, fontsize=8,
              frameon=False)
    return _save(plt, fig, path, bbox_inches="tight")


def write_plots(results, outdir):
    """The plots of a training benchmark (``results["points"]``) in ``outdir``: the epoch-time
    breakdown, and the timelines of configurations 2 and 5. Returns their paths."""
    os.makedirs(outdir, exist_ok=True)
    paths = [plot_breakdown(results, os.path.join(outdir, "breakdown.png"))]
    for point, res in results["points"].items():
        for r in res["configs"]:
            if r["config"] in (2, 5) and "skipped" not in r:
                paths.append(plot_timeline(
                    r, os.path.join(outdir, f"timeline_{point}_config{r['config']}.png"),
                    f"{point}, configuration {r['config']}: {r['name']}"))
    return paths
