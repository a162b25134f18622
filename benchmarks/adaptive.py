"""Adaptive depth (`loops: "auto"`) on the shipped model: loops per token, quality and speed, against fixed depth.

For each criterion (latent; kl, whose every check runs the read-out: a coda pass and the full LM head;
gate, with the model's gate or the one `tinyloop train-gate` made beside it) and threshold, and for the
loop-shared KV budget, on held-out text (the last 1% of each corpus file, which training left
out), all on the engine core:

- perplexity, teacher-forced with the exits applied per position: each window's tokens are fed one at a
  time as the request's "sampled" tokens (a forcing sampler in this script), so every position exits by its
  own criterion and later positions attend to its fallback keys exactly as in generation;
- mean loops per token, and the histogram;
- agreement of greedy tokens with fixed `loops` 8 (the first 64 tokens of a few prompts);
- decode tok/s at batch 1 and at 16 concurrent requests, against fixed 8 loops in the same run (alternating).

    .venv/bin/python benchmarks/adaptive.py [--thresholds 0.1,0.15,0.2,0.3] [--windows 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.serving import BatchEngine, run_to_completion, sequence_layout
from tinyloop.train.data import read_calibration

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus"
FILES = ["brown.txt.gz", "kjv.txt.gz", "pydocs.txt.gz", "shakespeare.txt.gz"]
PROMPTS = ["The king said to his people that", "In the beginning", "def main():\n    ", "Once upon a time there"]


class ForcedSampler:
    """Samples the text's next token whatever the logits say, and keeps its log-probability."""

    plain_greedy = False

    def __init__(self, targets: list[int]):
        self.targets, self.i, self.nll = targets, 0, []

    def sample(self, logits: torch.Tensor) -> int:
        tok = self.targets[self.i]
        self.nll.append(-float(torch.log_softmax(logits.double(), -1)[tok]))
        self.i += 1
        return tok

    def accept(self, tok: int) -> None:
        pass


def teacher_forced(engine: Engine, windows: torch.Tensor, params: SamplingParams) -> tuple[float, dict]:
    """Perplexity of the windows' tokens 1.. given token 0, and the loops histogram of those positions."""
    nll, hist = [], {}
    for w in windows.tolist():
        batch = BatchEngine(engine, page_size=16, max_num_seqs=1)
        events = []
        req = batch.add(engine.plan(w[:1], params.replace(max_tokens=len(w) - 1, ignore_eos=True)), events.append)
        forced = ForcedSampler(w[1:])
        req.outputs[0].sampler = forced
        while batch.has_work:
            batch.step()
        nll += forced.nll
        final = [ev for ev in events if ev is not None and getattr(ev, "stats", None)][-1]
        for k, v in final.stats.get("loops_histogram", {}).items():
            hist[k] = hist.get(k, 0) + v
    return math.exp(sum(nll) / len(nll)), hist


def decode_rate(engine: Engine, params: SamplingParams, clients: int, tokens: int) -> float:
    items = [(engine.encode_prompt(PROMPTS[i % len(PROMPTS)]), params.replace(max_tokens=tokens, ignore_eos=True))
             for i in range(clients)]
    batch = BatchEngine(engine, page_size=16)
    t0 = time.perf_counter()
    run_to_completion(batch, items)
    return clients * tokens / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tinyloop-16m")
    ap.add_argument("--thresholds", default="0.1,0.15,0.2,0.3,0.5", help="latent criterion thresholds")
    ap.add_argument("--kl-thresholds", default="0.05,0.2,1.0", help="kl criterion thresholds ('' for none)")
    ap.add_argument("--gate-thresholds", default="0.9,0.99,0.999",
                    help="gate criterion thresholds, when the model has a gate (its own or train-gate's)")
    ap.add_argument("--min-loops", type=int, default=2)
    ap.add_argument("--windows", type=int, default=4, help="held-out windows per perplexity (of --seq tokens)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=48, help="decode tokens per request in the speed runs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = Engine.load(args.model, draft_exit=False)
    engine.model.decode_threads = 1
    windows = read_calibration([CORPUS / f for f in FILES], engine.tokenizer, args.windows * args.seq, args.seq,
                               seed=0, val_fraction=0.01, held_out=True)
    fixed = SamplingParams(loops=8)
    settings = [("fixed 8", fixed)] + [
        (f"latent {t}", SamplingParams(loops="auto", exit_criterion="latent", exit_threshold=float(t),
                                       min_loops=args.min_loops, max_loops=8))
        for t in args.thresholds.split(",")] + [
        (f"kl {t}", SamplingParams(loops="auto", exit_criterion="kl", exit_threshold=float(t),
                                   min_loops=args.min_loops, max_loops=8))
        for t in args.kl_thresholds.split(",") if t] + [
        (f"gate {t}", SamplingParams(loops="auto", exit_criterion="gate", exit_threshold=float(t),
                                     min_loops=1, max_loops=8))
        for t in args.gate_thresholds.split(",") if t and engine.model.exit_gate is not None] + [
        ("fixed 8, kv_loops last", SamplingParams(loops=8, kv_loops="last")),
        ("fixed 8, kv_loops 2", SamplingParams(loops=8, kv_loops=2)),
        ("latent 0.3, kv_loops last", SamplingParams(loops="auto", exit_threshold=0.3, min_loops=args.min_loops,
                                                     max_loops=8, kv_loops="last"))]
    greedy_ref = {p: engine.generate(p, fixed.replace(max_tokens=64, ignore_eos=True)).token_ids for p in PROMPTS}
    rows = []
    for name, params in settings:
        ppl, hist = teacher_forced(engine, windows, params)
        n = sum(hist.values())
        mean_loops = sum(int(k) * v for k, v in hist.items()) / n
        agree = [sum(a == b for a, b in zip(engine.generate(p, params.replace(max_tokens=64, ignore_eos=True))
                                                 .token_ids, greedy_ref[p])) / 64 for p in PROMPTS]
        layout = sequence_layout(engine.model, engine.plan([0], params))
        rows.append({"setting": name, "perplexity": round(ppl, 3), "mean_loops": round(mean_loops, 3),
                     "kv_slots_per_token": layout.n_slots,
                     "histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
                     "greedy_agreement_with_fixed_8": round(statistics.mean(agree), 3)})
        print(json.dumps(rows[-1]), flush=True)
    # speed: each setting against fixed 8, alternating, in this run
    for row, (name, params) in zip(rows, settings):
        for clients in (1, 16):
            mine, base = [], []
            for _ in range(args.repeats):
                base.append(decode_rate(engine, fixed, clients, args.tokens))
                mine.append(decode_rate(engine, params, clients, args.tokens))
            row[f"tok_s_{clients}"] = round(statistics.median(mine), 1)
            row[f"speedup_{clients}"] = round(statistics.median(m / b for m, b in zip(mine, base)), 3)
    ref = rows[0]["perplexity"]
    print(f"# {args.model}, {args.windows} held-out windows of {args.seq} tokens, min_loops {args.min_loops}, 1 thread")
    print("| setting | mean loops | KV slots / token | perplexity | vs fixed 8 | greedy agreement | tok/s batch 1 | "
          "speedup | tok/s 16 clients | speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['setting']} | {r['mean_loops']:.2f} | {r['kv_slots_per_token']} | {r['perplexity']:.2f} | "
              f"{r['perplexity'] / ref - 1:+.1%} | "
              f"{r['greedy_agreement_with_fixed_8']:.0%} | {r['tok_s_1']} | {r['speedup_1']:.2f}x | {r['tok_s_16']} | "
              f"{r['speedup_16']:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "rows": rows, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
