"""What batch-invariant mode (`TINYLOOP_BATCH_INVARIANT`, issue 36) costs: every linear layer of a model's blocks
(prelude, the core once, coda) and its LM head through the native library for M input rows (a decode step of M sequences, a prefill chunk), with
the mode off (16-bit and fp32-activation quantized layers take the outer-product panels from 12 / 6 rows) and
on (they keep the dot-product tiles, whose sums do not depend on M), alternated, best of `--repeats`. int4/int8
layers with int8 activations never take the panels: on the shipped int4 model the mode changes nothing.

    .venv/bin/python benchmarks/batch_invariant_cost.py MODEL [--threads 2] [--rows 1,4,16,64,512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from tinyloop.engine import Engine
from tinyloop.kernels import lib as native
from tinyloop.kernels.executor import _forward


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,16,64,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    eng = Engine.load(args.model, draft_exit=False)
    ex = eng.model.executor
    if ex is None:
        print("no native executor for this model", file=sys.stderr)
        return 1
    lib = native.load()
    layers = ex.linears() + [ex.head]
    out = {"model": args.model, "threads": args.threads, "isa": lib.tl_isa().decode(), "rows": {}}
    for M in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(M, d.k) for d in layers]
        best = {0: float("inf"), 1: float("inf")}
        for _ in range(args.repeats):
            for mode in (0, 1):
                old = lib.tl_set_batch_invariant(mode)
                t = time.perf_counter()
                for d, x in zip(layers, xs):
                    _forward(d, x, args.threads)
                best[mode] = min(best[mode], time.perf_counter() - t)
                lib.tl_set_batch_invariant(old)
        out["rows"][M] = {"off_ms": round(best[0] * 1e3, 3), "on_ms": round(best[1] * 1e3, 3),
                          "on_over_off": round(best[1] / best[0], 3)}
        print(M, out["rows"][M], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
