"""PNG plots of the benchmarks' JSON results (matplotlib), written next to the JSON (`x.json` -> `x.png`).

Each benchmark writes its plot after its run (`--no-plot` to skip) and can replot an earlier result without
running anything (`--plot-only`). This program replots any of them, telling them apart by their content:

    .venv/bin/python benchmarks/plotting.py                  # decode, speculative and serving results
    .venv/bin/python benchmarks/plotting.py benchmarks/results/speculative_fp16.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tinyloop.tools.plots import pyplot, save

RESULTS = Path(__file__).parent / "results"
DEFAULTS = ("decode.json", "speculative.json", "serving.json")


def png_for(json_path: str | Path) -> Path:
    return Path(json_path).with_suffix(".png")


def plot_decode(data: dict[str, Any], path: str | Path) -> Path:
    """Tokens/s by loops, one panel per model: the fast path and eager per weight format, and the
    bandwidth ceiling measured in the same run."""
    plt = pyplot()
    rows = data["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.0), squeeze=False)
    colours = {"fp32": "#2f6fdf", "bf16": "#d9480f"}
    for ax, name in zip(axes[0], models):
        for dtype in dict.fromkeys(r["dtype"] for r in rows if r["model"] == name):
            rs = sorted((r for r in rows if r["model"] == name and r["dtype"] == dtype), key=lambda r: r["loops"])
            x = [r["loops"] for r in rs]
            label = dtype if dtype == "fp32" else f"{dtype} -> {rs[0]['fast_options']['weights']}"
            c = colours.get(dtype, None)
            ax.plot(x, [r["fast_tok_s"] for r in rs], marker="o", color=c, label=f"fast, {label}")
            ax.plot(x, [r["eager_best_tok_s"] for r in rs], marker="s", ls="--", color=c, label=f"eager, {dtype}")
            ax.plot(x, [r["ceiling_tok_s"] for r in rs], ls=":", color=c, label=f"ceiling, {dtype}")
            ax.set_xticks(x)
        ax.set_yscale("log")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("loops")
        ax.set_ylabel("decode tokens/s (batch 1, log scale)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"Decode speed by loops ({data.get('date', '')[:16]}, threads: {data.get('default_threads')})",
                 fontsize=10)
    return save(fig, path)


def plot_speculative(data: dict[str, Any], path: str | Path) -> Path:
    """Left: tokens/s by draft length for each (draft depth, tree width), against plain generate.
    Right: acceptance by draft depth, one line per draft length (chain rows)."""
    plt = pyplot()
    grid = [r for r in data["rows"] if r["label"] in ("chain", "tree")]
    seen, rows = set(), []
    for r in grid:  # the defaults row comes first and again in the grid: keep one
        key = (r["mode"], r["draft_loops"], r["draft_ahead"], r["k_branches"])
        if key not in seen:
            seen.add(key)
            rows.append(r)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 5.0))
    styles = {1: "-", 2: "--", 4: ":"}
    colours = {1: "#2f6fdf", 2: "#d9480f", 4: "#2b8a3e"}
    for K in sorted({r["k_branches"] for r in rows}):
        for d in sorted({r["draft_loops"] for r in rows}):
            rs = sorted((r for r in rows if r["k_branches"] == K and r["draft_loops"] == d),
                        key=lambda r: r["draft_ahead"])
            if rs:
                kind = "chain" if K == 1 else f"tree K={K}"
                ax.plot([r["draft_ahead"] for r in rs], [r["tokens_per_s"] for r in rs], marker="o",
                        ls=styles.get(K, "-."), color=colours.get(d), label=f"{kind}, d={d}")
    ax.axhline(data["plain_tokens_per_s"], color="grey", lw=1.5, label=f"plain generate, V={data['V']}")
    low = min([data["plain_tokens_per_s"]] + [r["tokens_per_s"] for r in rows])
    ax.set_ylim(low * 0.9, max(r["tokens_per_s"] for r in rows) * 1.05)
    ax.set_xscale("log", base=2)
    ks = sorted({r["draft_ahead"] for r in rows})
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    ax.set_xlabel("draft_ahead k (drafts per round, or tree depth)")
    ax.set_ylabel("tokens/s")
    ax.set_title("Tokens/s by setting", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    chain = [r for r in rows if r["k_branches"] == 1]
    for k in sorted({r["draft_ahead"] for r in chain}):
        rs = sorted((r for r in chain if r["draft_ahead"] == k), key=lambda r: r["draft_loops"])
        ax2.plot([r["draft_loops"] for r in rs], [r["acceptance"] for r in rs], marker="o", label=f"k={k}")
    ds = sorted({r["draft_loops"] for r in chain})
    ax2.set_xticks(ds)
    ax2.set_xlabel(f"draft depth d (loops; the verifier runs {data['V']})")
    ax2.set_ylabel("acceptance rate")
    ax2.set_title("Acceptance by draft depth (chain)", fontsize=10)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8, title="draft_ahead", title_fontsize=8)
    src = Path(str(data.get("source", "")).split(",")[0]).name
    fig.suptitle(f"Self-speculative decoding, {src}, greedy, {data['tokens']} tokens x {len(data['prompts'])} prompts",
                 fontsize=10)
    return save(fig, path)


def plot_serving(data: dict[str, Any], path: str | Path) -> Path:
    """Aggregate tokens/s, and TTFT / inter-token latency percentiles, by concurrent clients."""
    plt = pyplot()
    levels = sorted(data["levels"], key=lambda lv: lv["clients"])
    x = [lv["clients"] for lv in levels]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.0))
    ax.plot(x, [lv["tokens_per_s"] for lv in levels], marker="o", color="#2f6fdf", label="aggregate tokens/s")
    for xi, lv in zip(x, levels):
        ax.annotate(f"{lv['tokens_per_s']:.0f}", (xi, lv["tokens_per_s"]), textcoords="offset points",
                    xytext=(0, -13), ha="center", fontsize=8)
    ax.set_ylim(0, max(lv["tokens_per_s"] for lv in levels) * 1.3)
    ax.set_ylabel("completion tokens/s (all clients)")
    ax.set_title("Throughput", fontsize=10)
    for name, key, colour in (("TTFT", "ttft", "#d9480f"), ("inter-token", "itl", "#2b8a3e")):
        ax2.plot(x, [lv[f"{key}_p50_ms"] for lv in levels], marker="o", color=colour, label=f"{name} p50")
        ax2.plot(x, [lv[f"{key}_p99_ms"] for lv in levels], marker="^", ls="--", color=colour, label=f"{name} p99")
    ax2.set_yscale("log")
    ax2.set_ylabel("ms (log scale)")
    ax2.set_title("Latency at the client", fontsize=10)
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(x, [str(v) for v in x])
        a.minorticks_off()
        a.set_xlabel("concurrent streaming clients")
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=8)
    meta = data.get("meta", {})
    fig.suptitle(f"tinyloop serve under load: {Path(str(meta.get('model', ''))).name}, "
                 f"{meta.get('max_tokens')} tokens per request, {meta.get('date', '')}", fontsize=10)
    return save(fig, path)


def plot_any(json_path: str | Path, out: str | Path | None = None) -> Path:
    """Plot a result file of decode.py, speculative.py or serving.py (told apart by their content)."""
    data = json.loads(Path(json_path).read_text())
    out = out or png_for(json_path)
    if data.get("benchmark") == "decode":
        return plot_decode(data, out)
    if "levels" in data and "meta" in data:
        return plot_serving(data, out)
    if data.get("rows") and "draft_ahead" in data["rows"][0]:
        return plot_speculative(data, out)
    raise ValueError(f"{json_path}: not a result of decode.py, speculative.py or serving.py")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a.startswith("-") for a in args):
        print(__doc__, file=sys.stderr)
        return 2
    for path in args or [RESULTS / name for name in DEFAULTS]:
        print(f"wrote {plot_any(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
