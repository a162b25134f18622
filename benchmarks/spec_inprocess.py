"""The shipped model in-process: plain decoding at loops 8 against the loop-aware modes, paired per repeat.

Every setting runs the four prompts (64 greedy tokens each, each alone on an engine core), right after a
plain loops-8 run of the same prompts; the ratio is the median over `reps` of plain time / setting time
(`x_plain8`), and of the time after the first token (`x_plain8_decode`: the prompt's pass runs at the ceiling
depth in `auto` too, so this is the ratio to set against `auto`'s mean loops). Rows: plain loops 3, `loops: "auto"`, speculation with the engine's policy (default and draft_ahead <= 8),
fixed draft lengths (the policy off), the stepwise native path (one engine step per pass, as before the
one-call round), and tree speculation at K = 1 and 2 (K = 2: choosing tree or chain rounds by measured speed,
tree rounds only in one native call, and stepwise). `exact`: every output equals plain decoding's.

    OMP_NUM_THREADS=1 TINYLOOP_NATIVE_THREADS=1 .venv/bin/python benchmarks/spec_inprocess.py [reps] [out.json]
"""
import time, torch, statistics, sys, json
from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.serving import run_ids
eng = Engine.load()
PROMPTS = ["In the beginning God created the heaven and the earth. And the earth was without form, and",
    "ROMEO. But soft, what light through yonder window breaks? It is the east, and",
    "The :mod:`os` module provides a portable way of using operating system dependent functionality.",
    "The jury further said in term-end presentments that the City Executive Committee, which had"]
ids = [eng.tokenizer.encode(p) for p in PROMPTS]
N = 64
def run(params, **kw):
    t = 0.0; st_all = []
    for i in ids:
        st = {}
        t0 = time.perf_counter(); out = run_ids(eng, i, params, stats=st, **kw); t += time.perf_counter() - t0
        st_all.append((out, st))
    return t, st_all
def decode_s(st_all):   # after the first token (the prompt's pass at the ceiling depth, for `auto` too)
    return sum(s["wall_ms"] - s["time_to_first_token_ms"] for _, s in st_all) / 1000
plain = SamplingParams(max_tokens=N, temperature=0, loops=8)
settings = [("plain loops 3", SamplingParams(max_tokens=N, temperature=0, loops=3), {}),
            ("auto", SamplingParams(max_tokens=N, temperature=0, loops="auto"), {}),
            ("spec default (d=2, ahead<=4, adaptive)", SamplingParams(max_tokens=N, temperature=0, mode="speculative"), {}),
            ("spec d=2 k=4 fixed", SamplingParams(max_tokens=N, temperature=0, mode="speculative", draft_loops=2, draft_ahead=4), dict(adaptive=False)),
            ("spec d=1 k=4 fixed", SamplingParams(max_tokens=N, temperature=0, mode="speculative", draft_loops=1, draft_ahead=4), dict(adaptive=False)),
            ("spec d=2 ahead<=8 adaptive", SamplingParams(max_tokens=N, temperature=0, mode="speculative", draft_loops=2, draft_ahead=8), {}),
            ("spec d=2 k=4 stepwise (session 12 path)", SamplingParams(max_tokens=N, temperature=0, mode="speculative", draft_loops=2, draft_ahead=4), dict(adaptive=False, native_round=False)),
            ("tree d=2 k=4 K=1", SamplingParams(max_tokens=N, temperature=0, mode="tree_speculative", draft_loops=2, draft_ahead=4, k_branches=1), {}),
            ("tree d=1 k=4 K=2", SamplingParams(max_tokens=N, temperature=0, mode="tree_speculative", draft_loops=1, draft_ahead=4, k_branches=2), {}),
            ("tree d=2 k=4 K=2", SamplingParams(max_tokens=N, temperature=0, mode="tree_speculative", draft_loops=2, draft_ahead=4, k_branches=2), {}),
            ("tree d=2 k=4 K=2, tree rounds only", SamplingParams(max_tokens=N, temperature=0, mode="tree_speculative", draft_loops=2, draft_ahead=4, k_branches=2), dict(adaptive=False)),
            ("tree d=2 k=4 K=2 stepwise", SamplingParams(max_tokens=N, temperature=0, mode="tree_speculative", draft_loops=2, draft_ahead=4, k_branches=2), dict(adaptive=False, native_round=False))]
run(plain)
rows = []
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
for name, p, kw in settings:
    ratios = []; tps = []; dec = []
    for _ in range(reps):
        tp, ref = run(plain)
        ts, got = run(p, **kw)
        ratios.append(tp / ts); tps.append(len(ids) * N / ts); dec.append(decode_s(ref) / decode_s(got))
    st = got[0][1]
    exact = all(a[0] == b[0] for a, b in zip(got, ref)) if "loops 3" not in name and name != "auto" else None
    acc = statistics.mean(s.get("acceptance_rate", 0) or 0 for _, s in got)
    k = [s.get("draft_ahead_chosen") for _, s in got]
    shapes = [(s["tree_rounds"], s["chain_rounds"]) for _, s in got if "tree_rounds" in s] or None
    loops = statistics.mean(s.get("loops_used", 0) or 0 for _, s in got) if name == "auto" else None
    rows.append(dict(setting=name, tok_s=round(statistics.median(tps), 1), x_plain8=round(statistics.median(ratios), 3),
                     x_plain8_decode=round(statistics.median(dec), 3),
                     acceptance=round(acc, 3), draft_ahead_chosen=k, tree_chain_rounds=shapes, mean_loops=loops,
                     exact=exact))
    print(rows[-1], flush=True)
json.dump(dict(plain_tok_s=round(len(ids)*N/tp, 1), rows=rows),
          open(sys.argv[2] if len(sys.argv) > 2 else "spec_inprocess.json", "w"), indent=1)
