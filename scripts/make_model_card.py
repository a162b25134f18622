"""Measure what docs/model-card.md reports about a trained model, and draw its loss curve.

    python scripts/make_model_card.py MODEL.tinyloop --run-dir runs/shipped --corpus data/corpus \
        --out docs/model-card-data.json --plot docs/img/loss-curve.png

Validation text = the last 1% of each corpus file (the split training never saw, same rule as
tinyloop.train.data.split_text). Prints markdown tables to paste into the card, and writes the raw
figures to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tinyloop.engine import Engine, SamplingParams
from tinyloop.tools.evaluate import perplexity
from tinyloop.train.data import read_text, split_text

PROMPTS = ["The king said", "In the beginning", "To be, or not to be", "The function returns",
           "She opened the door and"]


def validation_ids(engine: Engine, corpus: Path, val_fraction: float,
                   per_file: int | None = None) -> tuple[list[int], dict]:
    """The validation split of every corpus file, each cut to its first `per_file` tokens if given."""
    ids: list[int] = []
    counts = {}
    for f in sorted(corpus.glob("*.txt.gz")):
        _, val = split_text(read_text(f), val_fraction)
        part = engine.tokenizer.encode(val)[:per_file]
        counts[f.name] = len(part)
        ids += part + [engine.tokenizer.eos_id]
    return ids, counts


def plot(run_dir: Path, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    steps, losses = zip(*train)
    k = 25
    smooth = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1]) for i in range(len(losses))]
    ax.plot(steps, losses, color="0.8", lw=0.6, label="train loss (per step, random depth)")
    ax.plot(steps, smooth, color="0.3", lw=1.2, label=f"train loss ({k}-step mean)")
    for loops, color in (("1", "tab:red"), ("4", "tab:orange"), ("8", "tab:blue")):
        xs = [s for s, v in val if loops in v]
        ax.plot(xs, [v[loops] for s, v in val if loops in v], "o-", color=color, ms=3, label=f"validation, loops={loops}")
    ax.set_xlabel("optimizer step (2048 tokens each)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(top=min(8.0, max(losses)))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("tinyloop-16m training")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--run-dir", type=Path)
    ap.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    ap.add_argument("--loops", default="1,2,4,8,12,16")
    ap.add_argument("--per-file-tokens", type=int, help="score only the first N validation tokens of each file")
    ap.add_argument("--out", type=Path, default=Path("docs/model-card-data.json"))
    ap.add_argument("--plot", type=Path, default=Path("docs/img/loss-curve.png"))
    args = ap.parse_args()

    engine = Engine.load(args.model, dtype=torch.float32)  # 16-bit files are storage; CPU math in fp32
    ids, per_file = validation_ids(engine, args.corpus, 0.01, args.per_file_tokens)
    rows = []
    for loops in [int(x) for x in args.loops.split(",")]:
        r = perplexity(engine.model, ids, loops, seq_len=engine.config.max_seq_len)
        rows.append(r)
        print(f"loops {loops:>2}: ppl {r['perplexity']:.2f} ({r['tokens_scored']} tokens, {r['seconds']} s)", flush=True)

    samples = {}
    settings = {"temperature": 0.7, "top_k": 40, "seed": 1, "max_tokens": 48}
    for prompt in PROMPTS:
        for loops in (1, 4, 8):
            res = engine.generate(prompt, SamplingParams(loops=loops, **settings))
            samples[f"{prompt}|{loops}"] = res.text
    greedy = {}
    for prompt in PROMPTS:
        greedy[prompt] = engine.generate(prompt, SamplingParams(loops=8, max_tokens=32)).text

    data = {"model": str(args.model), "validation_tokens_per_file": per_file, "perplexity": rows,
            "sample_settings": settings, "samples": samples, "greedy_loops8": greedy,
            "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    if args.run_dir:
        plot(args.run_dir, args.plot)

    print("\n| loops | validation perplexity | vs loops=1 |\n|---|---|---|")
    base = rows[0]["perplexity"]
    for r in rows:
        print(f"| {r['loops']} | {r['perplexity']:.2f} | {r['perplexity'] / base:.3f} |")
    for prompt in PROMPTS:
        print(f"\n**{prompt}**\n")
        for loops in (1, 4, 8):
            print(f"- loops {loops}: {json.dumps(prompt + samples[f'{prompt}|{loops}'])}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
