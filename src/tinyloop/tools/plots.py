"""PNG plots of results (matplotlib, headless: the Agg backend). matplotlib is optional: the `plot` and
`test` extras install it, and a missing one is a clear error, not an ImportError deep in a command."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class PlotError(RuntimeError):
    pass


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotError("plots need matplotlib: pip install 'tinyloop[plot]' (or pip install matplotlib)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def perplexity_by_loops(rows: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Perplexity against loop depth, one point per row of `tinyloop eval` (`loops`, `perplexity`)."""
    plt = pyplot()
    rows = sorted(rows, key=lambda r: r["loops"])
    x = [r["loops"] for r in rows]
    y = [r["perplexity"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(x, y, marker="o", color="#2f6fdf")
    for xi, yi in zip(x, y):
        ax.annotate(f"{yi:.2f}", (xi, yi), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax.minorticks_off()
    ax.set_xlabel("loops (the core's depth)")
    ax.set_ylabel("perplexity (lower is better)")
    scored = rows[0].get("tokens_scored")
    ax.set_title(title or "Perplexity by loop depth" + (f" ({scored} tokens scored)" if scored else ""), fontsize=10)
    ax.margins(y=0.15)
    ax.grid(alpha=0.3)
    return save(fig, path)
