"""A quick look at one speculation setting's round (session 23): plain loops 8 against the chain and the pipeline
at d=2 k=4 (fixed), d=1 k=4 and the default, each prompt alone on an engine core, 64 greedy tokens, `reps`
alternating passes, medians; per setting ms a token, the ratio to plain, ms a round and tokens a round, the
acceptance and whether every output equals plain decoding's. `--prompts serving` takes benchmarks/serving.py's
eight prompts (what the HTTP runs send), else spec_inprocess.py's four.

    OMP_NUM_THREADS=1 TINYLOOP_NATIVE_THREADS=1 .venv/bin/python benchmarks/spec_probe.py [--reps 3] [--prompts serving]
"""
import argparse
import statistics
import time

from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.serving import run_ids

INPROCESS = ["In the beginning God created the heaven and the earth. And the earth was without form, and",
             "ROMEO. But soft, what light through yonder window breaks? It is the east, and",
             "The :mod:`os` module provides a portable way of using operating system dependent functionality.",
             "The jury further said in term-end presentments that the City Executive Committee, which had"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", choices=("inprocess", "serving"), default="inprocess")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
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
                ("d=1 k=4 chain, fixed", S(mode="speculative", draft_loops=1, draft_ahead=4), fixed),
                ("default", S(mode="speculative"), {})]

    def run(p, kw):
        t, sts, outs = 0.0, [], []
        for i in ids:
            st = {}
            t0 = time.perf_counter()
            outs.append(run_ids(eng, i, p, stats=st, **kw))
            t += time.perf_counter() - t0
            sts.append(st)
        return t, sts, outs

    run(settings[0][1], {})
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
