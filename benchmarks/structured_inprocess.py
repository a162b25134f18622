"""One client's cost of a JSON schema, in-process: tokens/s of constrained over free-text requests, paired.

`BatchEngine` on the shipped model (or `--model`), one request at a time, as the server's engine thread runs
it: benchmarks/structured.py's prompts and schema, 64 tokens at temperature 0.8 (free text with
`ignore_eos`; the schema needs more than 64 tokens). Constrained and free requests alternate, so each pair
runs under the same load; the ratio per pair is free ms/token over constrained ms/token, and the median of
the pairs is printed (robust on a shared host, where a level swings 2x between seconds). `--old-sampler`
adds a third variant: the sampler as it was before issue-27c (the full masked row where more than a
quarter of the vocabulary is allowed), to compare the two in one run. `--per-step` adds the constrained
request as it ran before session 22: one engine step per token, the Python sampler masking the row (the
native head neither masks nor picks, so no multi-token native call).

    PYTHONPATH=src .venv/bin/python benchmarks/structured_inprocess.py [--rounds 5] [--requests 8] [--old-sampler] [--per-step]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured import PROMPTS, SCHEMA  # noqa: E402

from tinyloop.engine.constraint import Constraint  # noqa: E402
from tinyloop.engine.engine import Engine  # noqa: E402
from tinyloop.engine.knobs import SamplingParams  # noqa: E402
from tinyloop.engine.sampling import Sampler, draw_row, processed_logits  # noqa: E402
from tinyloop.engine.serving import BatchEngine  # noqa: E402

NEW_SAMPLE = Sampler.sample
HEAD_MATCHER = Sampler.head_matcher


def old_sample(self, logits):
    """Sampler.sample before issue-27c: allowed ids only where at most V/4 are allowed, else the masked row."""
    if self.params.greedy:
        return self.greedy_token(logits)
    if self.matcher is not None and not self.penalized:
        ids = self.matcher.allowed_ids()
        if 4 * ids.numel() <= self.vocab_size:
            sub = logits[: self.vocab_size].index_select(0, ids.to(logits.device))
            return int(ids[draw_row(sub, self.key(), self.inv_temp, ids=ids)])
    return draw_row(processed_logits(self._row(logits), self.params, self._seen(), self.counts), *self.draw_params())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=8, help="requests per variant per round")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--old-sampler", action="store_true")
    ap.add_argument("--per-step", action="store_true")
    args = ap.parse_args()
    eng = Engine.load(args.model)
    batch = BatchEngine(eng)
    con = Constraint.json_schema(SCHEMA)
    names = ["free", "json"] + (["json_old_sampler"] if args.old_sampler else []) \
        + (["json_per_step"] if args.per_step else [])

    def one(i: int, v: str) -> tuple[float, list[int]]:
        Sampler.sample = old_sample if v == "json_old_sampler" else NEW_SAMPLE
        Sampler.head_matcher = property(lambda self: None) if v == "json_per_step" else HEAD_MATCHER
        extra = {"ignore_eos": True} if v == "free" else {"constraint": con}
        p = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=1000 + i, **extra)
        evs = []
        batch.add(eng.plan(eng.tokenizer.encode(PROMPTS[i % len(PROMPTS)]), p),
                  lambda ev: ev is not None and evs.append(ev))
        t0 = time.perf_counter()
        while batch.has_work:
            batch.step()
        toks = [t for e in evs for t in e.token_ids]
        return (time.perf_counter() - t0) / len(toks) * 1e3, toks

    res: dict[str, list[float]] = {v: [] for v in names}
    outs: dict[tuple[str, int], list[int]] = {}
    with torch.inference_mode():
        for v in names:
            one(0, v)   # warm-up (the grammar's tokenizer and compile)
        k = 0
        for r in range(args.rounds):
            for j in range(args.requests):
                order = names[k % len(names):] + names[:k % len(names)]
                k += 1
                for v in order:
                    ms, toks = one(j, v)
                    res[v].append(ms)
                    outs.setdefault((v, j), toks)
            print(f"round {r + 1}: " + ", ".join(f"{v} {statistics.median(res[v][-args.requests:]):.3f} ms/token"
                                                for v in names), flush=True)
    Sampler.sample, Sampler.head_matcher = NEW_SAMPLE, HEAD_MATCHER
    for v in names[1:]:
        pairs = [f / c for f, c in zip(res["free"], res[v])]
        print(f"{v}: tokens/s over free text, paired: median {statistics.median(pairs):.3f} "
              f"mean {statistics.mean(pairs):.3f} ({len(pairs)} pairs)")
    if args.old_sampler:
        same = sum(outs[("json", j)] == outs[("json_old_sampler", j)] for j in range(args.requests))
        print(f"same tokens, json vs json_old_sampler: {same} of {args.requests} requests")
    if args.per_step:
        same = sum(outs[("json", j)] == outs[("json_per_step", j)] for j in range(args.requests))
        print(f"same tokens, json vs json_per_step: {same} of {args.requests} requests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
