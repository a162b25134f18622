"""Sampled (temperature > 0) decoding of the shipped model in-process: plain sampling at loops 8 against
speculation under the same sampling, paired per repeat; and the same with greedy decoding for reference.

Every setting (chain speculation, and a K = 2 tree, sampled alike since session 18) runs the four prompts (64 tokens each, seeds 0-3, `ignore_eos`), each alone on an engine core,
right after a plain sampled loops-8 run of the same prompts; the ratio is the median over `reps` of plain
time / setting time. `same_tokens`: whether each speculative output equals plain sampling's output for its
seed (sampling by shared noise makes it so: engine/sampling.py); a build without that property reports False.

    OMP_NUM_THREADS=1 TINYLOOP_NATIVE_THREADS=1 .venv/bin/python benchmarks/spec_sampled.py [--reps 5]
        [--samplings 0.7,1.0,0.7:0.9] [--json OUT]     (T, or T:top_p)
"""
import argparse
import json
import statistics
import time

from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.serving import run_ids

PROMPTS = ["In the beginning God created the heaven and the earth. And the earth was without form, and",
           "ROMEO. But soft, what light through yonder window breaks? It is the east, and",
           "The :mod:`os` module provides a portable way of using operating system dependent functionality.",
           "The jury further said in term-end presentments that the City Executive Committee, which had"]
N = 64


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--samplings", default="0.7,1.0,0.7:0.9", help="T or T:top_p, comma-separated")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    eng = Engine.load()
    ids = [eng.tokenizer.encode(p) for p in PROMPTS]

    def run(params):
        t, outs, stats = 0.0, [], []
        for seed, i in enumerate(ids):
            st = {}
            t0 = time.perf_counter()
            outs.append(run_ids(eng, i, params.replace(seed=seed), stats=st))
            t += time.perf_counter() - t0
            stats.append(st)
        return t, outs, stats

    rows = []
    for item in args.samplings.split(","):
        T, _, top_p = item.partition(":")
        T, top_p = float(T), float(top_p or 1.0)
        plain = SamplingParams(max_tokens=N, temperature=T, top_p=top_p, loops=8, ignore_eos=True)
        settings = [("plain greedy loops 8", SamplingParams(max_tokens=N, temperature=0, loops=8, ignore_eos=True)),
                    ("speculative, default", plain.replace(loops=None, mode="speculative")),
                    ("speculative d=2 ahead<=4", plain.replace(loops=None, mode="speculative", draft_loops=2, draft_ahead=4)),
                    ("speculative d=1 ahead<=4", plain.replace(loops=None, mode="speculative", draft_loops=1, draft_ahead=4)),
                    ("tree d=2 ahead<=3 K=2", plain.replace(loops=None, mode="tree_speculative", draft_loops=2,
                                                            draft_ahead=3, k_branches=2)),
                    ("speculative greedy, default", SamplingParams(max_tokens=N, temperature=0, mode="speculative",
                                                                   ignore_eos=True))]
        run(plain)
        for name, p in settings:
            ratios, tps = [], []
            for _ in range(args.reps):
                tp, ref, _ = run(plain)
                ts, got, stats = run(p)
                ratios.append(tp / ts)
                tps.append(len(ids) * N / ts)
            row = dict(temperature=T, top_p=top_p, setting=name, tok_s=round(statistics.median(tps), 1),
                       plain_sampled_tok_s=round(len(ids) * N / tp, 1),
                       x_plain_sampled=round(statistics.median(ratios), 3),
                       acceptance=round(statistics.mean(s.get("acceptance_rate") or 0 for s in stats), 3),
                       draft_ahead_chosen=[s.get("draft_ahead_chosen") for s in stats],
                       tree_chain_rounds=[(s["tree_rounds"], s["chain_rounds"]) for s in stats if "tree_rounds" in s] or None,
                       same_tokens=(got == ref) if p.temperature > 0 and p.mode != "generate" else None)
            rows.append(row)
            print(row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
