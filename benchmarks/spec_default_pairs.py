"""The default speculation against plain decoding on one model file, paired: a plain request at the model's depth,
then the same request with `mode: "speculative"` (the engine's policy), 48 greedy tokens, REPS pairs in one process
(the policy's costs carry over between requests, as on a serving engine). Prints each pair's ratio and the policy's
stats (session 20: the long-run rule, docs/speculative.md).

    .venv/bin/python benchmarks/spec_default_pairs.py MODEL.tinyloop [REPS]
"""
import sys
import time

from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.serving import run_ids

eng = Engine.load(sys.argv[1], draft_exit=False)
P = [5, 17, 42, 7, 99, 3, 11, 64]
base = dict(max_tokens=48, temperature=0, ignore_eos=True)
for rep in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
    t = time.perf_counter()
    run_ids(eng, P, SamplingParams(**base, loops=eng.config.default_loops))
    tp = time.perf_counter() - t
    st: dict = {}
    t = time.perf_counter()
    run_ids(eng, P, SamplingParams(**base, mode="speculative"), stats=st)
    ts = time.perf_counter() - t
    print(rep, "x_plain %.3f" % (tp / ts),
          {k: st.get(k) for k in ("rounds", "plain_rounds", "draft_ahead_chosen", "acceptance_rate")}, flush=True)
