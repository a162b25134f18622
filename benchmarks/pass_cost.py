"""What one pass over a loop's weights costs by the number of rows it carries (issue 33: "measure what a
pass costs by row count"): every core layer of a model's loop (q/k/v, output, MLP up and down) through the
native library for M = 1..8 input rows, against one row. In a memory-bound pass extra rows are nearly free
(ratio ~1); once the integer products dominate, each row costs its own arithmetic (ratio ~M).

    .venv/bin/python benchmarks/pass_cost.py MODEL [--threads 2] [--rows 1,2,3,4,5,6,8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from tinyloop.engine import Engine
from tinyloop.kernels.executor import _forward


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,3,4,5,6,8")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    eng = Engine.load(args.model, draft_exit=False)
    ex = eng.model.executor
    if ex is None:
        print("no native executor for this model", file=sys.stderr)
        return 1
    descs = ex.linears("core")
    macs = sum(d.n * d.k for d in descs)
    out = {"model": args.model, "threads": args.threads, "loop_macs": macs, "rows": {}}
    base = None
    for M in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(M, d.k) for d in descs]
        best = float("inf")
        for _ in range(args.repeats):
            t = time.perf_counter()
            for d, x in zip(descs, xs):
                _forward(d, x, args.threads)
            best = min(best, time.perf_counter() - t)
        base = base or best
        out["rows"][M] = {"ms": round(best * 1000, 2), "x_one_row": round(best / base, 2),
                          "GMAC_s": round(macs * M / best / 1e9, 1)}
        print(M, out["rows"][M], flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
