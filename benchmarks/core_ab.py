"""Two source trees of TinyLoop against each other on a persistent engine core, alternated (A B A B ...), each
run in its own process with PYTHONPATH=<tree>/src (so each loads its own native library, built from its own
sources on first use): the way to tell a few-percent change from this host's drift, which moves a single
figure by 5-10% within minutes.

Workloads (the shipped model unless --model; greedy; the eight serving.py prompts):
- `batch16`: 16 requests at once (the prompts twice), `--tokens` each, tokens/s over the whole run (prefill
  included), on a core of 16 sequences;
- `one`: one request at a time, plain loops 8, ms per request;
- `spec`: the same requests with `mode: "speculative"` (the engine's default policy), ms per request;
- `first`: max_tokens 1, plain and speculative: the per-request overhead (ms).
Each run warms up once, then times `--repeats` passes; a tree's figure is the median over its runs.

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/core_ab.py /tmp/base . [--workloads batch16,one,spec,first] [--runs 4]
        [--tokens 64] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, statistics, sys, time
from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.serving import BatchEngine, run_to_completion
work, tokens, repeats, model = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] or None
PROMPTS = ["The king said to his people that", "Once upon a time, in a small village by the sea,",
           "The most important thing to remember about cooking rice is",
           "In the morning the old man walked down to the river and", "Scientists have long wondered why the sky",
           "She opened the letter slowly, afraid of what it might say:", "The history of the city begins in the year",
           "When the train finally stopped, the passengers"]
eng = Engine.load(model)
ids = [eng.tokenizer.encode(p) for p in PROMPTS]
core = BatchEngine(eng, max_num_seqs=16, prefix_caching=False)
out = {}
def each(params):
    for i in ids:
        run_to_completion(core, [(i, params)])
if work == "batch16":
    p = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    run_to_completion(core, [(i, p) for i in ids * 2])
    t = time.perf_counter()
    for _ in range(repeats):
        run_to_completion(core, [(i, p) for i in ids * 2])
    out["batch16_tok_s"] = repeats * 16 * tokens / (time.perf_counter() - t)
else:
    kinds = {"one": [("plain_ms", dict(loops=8), tokens)], "spec": [("spec_ms", dict(mode="speculative"), tokens)],
             "first": [("first_plain_ms", dict(loops=8), 1), ("first_spec_ms", dict(mode="speculative"), 1)]}[work]
    for key, kw, n in kinds:
        p = SamplingParams(max_tokens=n, temperature=0, **kw)
        each(p)
        reps = repeats * (8 if n == 1 else 1)
        t = time.perf_counter()
        for _ in range(reps):
            each(p)
        out[key] = (time.perf_counter() - t) / (reps * len(ids)) * 1000
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs=2, metavar="TREE", help="two checkouts (A, then B), each with a src/")
    ap.add_argument("--workloads", default="batch16,one,spec,first")
    ap.add_argument("--runs", type=int, default=4, help="runs of each tree, alternated")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes a run")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="")
    ap.add_argument("--json")
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TINYLOOP_NATIVE_THREADS=str(args.threads))
    got: dict = {}
    for work in args.workloads.split(","):
        for _ in range(args.runs):
            for tag, tree in zip("AB", args.trees):
                e = dict(env, PYTHONPATH=str(Path(tree).resolve() / "src"))
                r = subprocess.run([sys.executable, "-c", CHILD, work, str(args.tokens), str(args.repeats), args.model],
                                   env=e, capture_output=True, text=True, check=True)
                for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items():
                    got.setdefault(k, {"A": [], "B": []})[tag].append(round(v, 3))
    table = {k: {**v, "median_a": statistics.median(v["A"]), "median_b": statistics.median(v["B"]),
                 "b_over_a": round(statistics.median(v["B"]) / statistics.median(v["A"]), 3)} for k, v in got.items()}
    for k, v in table.items():
        print(f"{k:16s} A {v['median_a']:9.3f}  B {v['median_b']:9.3f}  B/A {v['b_over_a']:.3f}   A {v['A']}  B {v['B']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"trees": args.trees, "threads": args.threads, "tokens": args.tokens,
                                               "results": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
