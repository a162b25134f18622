"""Paired in-process comparisons (session 19): tree K=2 (tree rounds only) against the chain at the same d and k,
`auto` against loops 3 and 8, and (session 20) the default speculation against plain loops 8, end to end and
after the first token; 7 alternating pairs each.

    OMP_NUM_THREADS=1 TINYLOOP_NATIVE_THREADS=1 .venv/bin/python benchmarks/spec_pairs.py [OUT.json] [NAME-FILTER]
"""
import sys, time, statistics, json
from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.serving import run_ids
eng = Engine.load()
PROMPTS = ["In the beginning God created the heaven and the earth. And the earth was without form, and",
    "ROMEO. But soft, what light through yonder window breaks? It is the east, and",
    "The :mod:`os` module provides a portable way of using operating system dependent functionality.",
    "The jury further said in term-end presentments that the City Executive Committee, which had"]
ids = [eng.tokenizer.encode(p) for p in PROMPTS]
def run(p, **kw):
    tot = dec = 0.0
    for i in ids:
        st = {}
        t0 = time.perf_counter(); run_ids(eng, i, p, stats=st, **kw); tot += time.perf_counter() - t0
        dec += (st["wall_ms"] - st["time_to_first_token_ms"]) / 1000
    return tot, dec
g = dict(max_tokens=64, temperature=0)
pairs = {"tree K=2 (tree rounds) / chain, d=2 k=4 fixed":
             ((SamplingParams(**g, mode="tree_speculative", draft_loops=2, draft_ahead=4, k_branches=2), dict(adaptive=False)),
              (SamplingParams(**g, mode="speculative", draft_loops=2, draft_ahead=4), dict(adaptive=False))),
         "tree K=2 (tree rounds) / chain, d=1 k=4 fixed":
             ((SamplingParams(**g, mode="tree_speculative", draft_loops=1, draft_ahead=4, k_branches=2), dict(adaptive=False)),
              (SamplingParams(**g, mode="speculative", draft_loops=1, draft_ahead=4), dict(adaptive=False))),
         "auto / loops 3": ((SamplingParams(**g, loops="auto"), {}), (SamplingParams(**g, loops=3), {})),
         "auto / loops 8": ((SamplingParams(**g, loops="auto"), {}), (SamplingParams(**g, loops=8), {})),
         "speculative default / loops 8": ((SamplingParams(**g, mode="speculative"), {}), (SamplingParams(**g, loops=8), {}))}
if len(sys.argv) > 2:
    pairs = {k: v for k, v in pairs.items() if sys.argv[2] in k}
out = {}
for name, ((pa, ka), (pb, kb)) in pairs.items():
    run(pa, **ka); run(pb, **kb)
    r, rd = [], []
    for _ in range(7):
        ta, da = run(pa, **ka); tb, db = run(pb, **kb)
        r.append(tb / ta); rd.append(db / da)
    out[name] = {"speed_ratio": round(statistics.median(r), 3), "decode_speed_ratio": round(statistics.median(rd), 3),
                 "pairs": [round(x, 3) for x in r]}
    print(name, out[name], flush=True)
json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/spec_pairs.json", "w"), indent=1)
