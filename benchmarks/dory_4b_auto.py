"""`loops: "auto"` on Dory's release shape against plain decoding at its mean depth (issue 55: "`auto` within 15%
of plain at its mean depth"), natively, batch 1.

On `dory_4b.py`'s int4 file: the random weights as they are, and the depth-agreeing copy `dory_4b_spec.py` uses
(each core layer's nGPT rate times `--damp`, in memory, so that the state settles in the first loop). For each:
`auto` (the engine's default exit criterion), then plain at the floor and the ceiling of its mean depth, the
time a token at the mean depth interpolated between those two; best of `--repeats` each, 32 tokens after an
8-token prompt (the prompt's pass runs at the deepest depth for `auto` and counts in its mean, as the engine
reports it: `loops_used`).

    PYTHONPATH=src .venv/bin/python benchmarks/dory_4b_auto.py --model /tmp/dory4b/dory-4b-int4.tinyloop
        [--tokens 32] [--repeats 3] [--damp 0.002] [--json benchmarks/results/dory_4b_auto.json]
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from dory_4b_spec import arguments, load  # (benchmarks/)
from hostinfo import host  # (benchmarks/)
from tinyloop.engine import SamplingParams


def main() -> None:
    args = arguments(__doc__).parse_args()
    load0 = os.getloadavg()
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    rows = {}
    for variant, damp in (("random weights", None), ("depth-agreeing", args.damp)):
        engine, _ = load(args.model, damp)

        def run(engine=engine, **kw):
            best, stats = math.inf, None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out = engine.generate(prompt, SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True,
                                                             **kw))
                dt = time.perf_counter() - t0
                if dt < best:
                    best, stats = dt, out.stats
            return args.tokens / best, stats

        auto, stats = run(loops="auto")
        mean = float(stats["loops_used"])
        lo, hi = max(1, math.floor(mean)), max(1, math.ceil(mean))
        r_lo = run(loops=lo)[0]
        r_hi = run(loops=hi)[0] if hi != lo else r_lo
        t_mean = 1 / r_lo + (mean - lo) * (1 / r_hi - 1 / r_lo) / max(hi - lo, 1)
        rows[variant] = {"auto_tok_s": round(auto, 3), "mean_loops": mean, "loops_histogram": stats.get("loops_histogram"),
                         f"plain_loops_{lo}_tok_s": round(r_lo, 3), f"plain_loops_{hi}_tok_s": round(r_hi, 3),
                         "plain_at_mean_depth_tok_s": round(1 / t_mean, 3), "auto_over_plain_at_mean": round(auto * t_mean, 3)}
        print(f"{variant}: auto {auto:.2f} tok/s at {mean:.3f} loops; plain there {1 / t_mean:.2f}: "
              f"{auto * t_mean:.3f}x", flush=True)
        del engine
    if args.json:
        Path(args.json).write_text(json.dumps({"host": host(), "model": args.model, "tokens": args.tokens,
                                               "repeats": args.repeats, "damp": args.damp, "load_average_start": load0,
                                               "load_average_end": os.getloadavg(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
