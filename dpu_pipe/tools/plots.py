"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed). One function
per figure; each takes the result dict a benchmark returns (or its JSON) and a path."""

__all__ = ["plot_rates", "plot_split"]


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        from ..errors import ConfigError
        raise ConfigError("plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_rates(result, path):
    """Horizontal bars of images/s per method (median round) with min–max whiskers over the
    rounds. ``result["rows"]``: dicts with ``method`` (or ``description``), ``img_per_s`` and
    ``min``/``max`` (or ``img_per_s_min``/``img_per_s_max``)."""
    plt = _pyplot()
    rows = result["rows"]
    names = [r.get("description", r["method"]) for r in rows]
    med = [r["img_per_s"] for r in rows]
    lo = [r.get("min", r.get("img_per_s_min")) for r in rows]
    hi = [r.get("max", r.get("img_per_s_max")) for r in rows]
    err = [[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    try:
        ax.barh(names, med, xerr=err, capsize=4, color="#4c72b0")
        ax.invert_yaxis()
        ax.set_xlabel("images/s (median round; whiskers: min–max)")
        ax.set_title(f"{result.get('benchmark', 'benchmark')}: {result.get('n', '?')} images, "
                     f"{result.get('repeat', '?')} rounds")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def plot_split(result, path):
    """One stacked bar: milliseconds per image of the fused kernel, split into region decode
    and resample/flip/normalize. ``result["split_ms"]``: ``decode``, ``augment``, ``total``."""
    plt = _pyplot()
    sp = result["split_ms"]
    fig, ax = plt.subplots(figsize=(7, 2.6))
    try:
        ax.barh(["dpu_pipe"], [sp["decode"]], color="#4c72b0", label="region decode")
        ax.barh(["dpu_pipe"], [sp["augment"]], left=[sp["decode"]], color="#dd8452",
                label="resample + flip + normalize")
        ax.set_xlabel(f"ms per image (total {sp['total']:.2f})")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=2, fontsize="small",
                  frameon=False)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
