"""A quick look at one speculation setting's round (session 23): plain loops 8 against the chain and the pipeline
at d=2 k=4 (fixed), other fixed chains (`--fixed d:k,...`, default 1:4) and the default, each prompt alone on an
engine core, 64 greedy tokens, `reps` alternating passes, medians; per setting ms a token, the ratio to plain, ms a
round and tokens a round, the acceptance and whether every output equals plain decoding's. `--prompts serving`
takes benchmarks/serving.py's eight prompts (what the HTTP runs send), else spec_inprocess.py's four. `--core`:
one engine core per policy kept for the whole run (as a server's: the pool made once, the costs carried over),
instead of one sized for each request.

    OMP_NUM_THREADS=1 TINYLOOP_NATIVE_THREADS=1 .venv/bin/python benchmarks/spec_probe.py [--reps 3] [--prompts serving]
        [--fixed 1:4,2:2,2:6] [--core]
"""
import argparse
import statistics
import time

from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.serving import BatchEngine, run_ids, run_to_completion

INPROCESS = ["In the beginning God created the heaven and the earth. And the earth was without form, and",
             "ROMEO. But soft, what light through yonder window breaks? It is the east, and",
             "The :mod:`os` module provides a portable way of using operating system dependent functionality.",
             "The jury further said in term-end presentments that the City Executive Committee, which had"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", choices=("inprocess", "serving"), default="inprocess")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--fixed", default="1:4", help="more fixed chain settings, d:k comma-separated")
    ap.add_argument("--core", action="store_true", help="one persistent engine core per policy (as a server)")
    args = ap.parse_args()
    try:
        more = [tuple(int(x) for x in dk.split(":")) for dk in args.fixed.split(",") if dk]
        assert all(len(dk) == 2 for dk in more)
    except (ValueError, AssertionError):
        ap.error(f"--fixed: d:k pairs, comma-separated; got {args.fixed!r}")
    if args.prompts == "serving":
        from serving import PROMPTS
    else:
        PROMPTS = INPROCESS
    eng = Engine.load()
    ids = [eng.tokenizer.encode(p) for p in PROMPTS]
    N = args.tokens

    def S(**k):
        return SamplingParams(max_tokens=N, temperature=0, **k)
    fixed = dict(adaptive=False, pipeline=False)
    settings = [("plain loops 8", S(loops=8), {}),
                ("d=2 k=4 chain, fixed", S(mode="speculative", draft_loops=2, draft_ahead=4), fixed),
                ("d=2 k=4 pipeline, fixed", S(mode="speculative", draft_loops=2, draft_ahead=4),
                 dict(fixed, pipeline=True)),
                *[(f"d={d} k={k} chain, fixed", S(mode="speculative", draft_loops=d, draft_ahead=k), fixed)
                  for d, k in more],
                ("default", S(mode="speculative"), {})]
    cores: dict = {}

    def one(i, p, kw, st):
        if not args.core:
            return run_ids(eng, i, p, stats=st, **kw)
        key = tuple(sorted(kw.items()))
        if key not in cores:
            cores[key] = BatchEngine(eng, max_num_seqs=16, prefix_caching=False, speculation=kw)
        events = run_to_completion(cores[key], [(i, p)])[0]
        st.update(events[-1].stats)
        return [t for e in events for t in e.token_ids]

    def run(p, kw):
        t, sts, outs = 0.0, [], []
        for i in ids:
            st = {}
            t0 = time.perf_counter()
            outs.append(one(i, p, kw, st))
            t += time.perf_counter() - t0
            sts.append(st)
        return t, sts, outs

    for _, p, kw in settings:   # (every setting once first: the cores, the head's cost table, the policy's costs)
        run(p, kw)
    times: dict[str, list[float]] = {n: [] for n, _, _ in settings}
    info, ref = {}, None
    for _ in range(args.reps):
        for name, p, kw in settings:
            t, sts, outs = run(p, kw)
            times[name].append(t)
            ref = outs if ref is None else ref
            info[name] = dict(exact=outs == ref, rounds=sum(s.get("rounds", 0) or 0 for s in sts),
                              acceptance=round(statistics.mean(s.get("acceptance_rate") or 0 for s in sts), 3))
    plain = statistics.median(times["plain loops 8"])
    for name in times:
        t, r = statistics.median(times[name]), info[name]["rounds"]
        tok = len(ids) * N
        print(f"{name:26s} {1000 * t / tok:.3f} ms/token  x{plain / t:.3f}  "
              f"ms/round {1000 * t / r if r else 0:.3f}  tokens/round {tok / r if r else 0:.2f}  {info[name]}")


if __name__ == "__main__":
    main()
