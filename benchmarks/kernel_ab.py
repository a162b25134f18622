"""Two builds of the native library against each other on one model's loop (issues 33, 36): every core matrix of
the loop through `tl_linear_forward` of library A, then of library B, alternated `--repeats` times, best of each,
for M input rows. The layer descriptors come from this checkout's Python (so a flag such as `act_q8` is today's;
a library that does not take it runs its own fallback). Build A from an older commit with
`PYTHONPATH=<worktree>/src python -m tinyloop.kernels.build` (the libraries are cached by source hash in
~/.cache/tinyloop/kernels).

    .venv/bin/python benchmarks/kernel_ab.py LIB_A.so LIB_B.so MODEL [--threads 2] [--rows 1,2,4,9,32] [--repeats 3]
        [--layers core|blocks|head]   (one loop's matrices, every block's, or the LM head alone)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time

import torch

from tinyloop.engine import Engine
from tinyloop.kernels import lib as native


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lib_a")
    ap.add_argument("lib_b")
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,9,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", choices=["core", "blocks", "head"], default="core")
    ap.add_argument("--json")
    args = ap.parse_args()
    ref = native.load()
    libs = {"A": ctypes.CDLL(args.lib_a), "B": ctypes.CDLL(args.lib_b)}
    for lib in libs.values():
        lib.tl_linear_forward.argtypes = ref.tl_linear_forward.argtypes
        lib.tl_set_threads.argtypes = [ctypes.c_int]
        lib.tl_set_threads(args.threads)
    ex = Engine.load(args.model, draft_exit=False).model.executor
    descs = [ex.head] if args.layers == "head" else ex.linears("core" if args.layers == "core" else "all")
    out = {"a": args.lib_a, "b": args.lib_b, "model": args.model, "threads": args.threads, "layers": args.layers,
           "rows": {}}
    for M in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(M, d.k) for d in descs]
        ys = [torch.empty(M, d.n) for d in descs]
        scratch = torch.empty(M * max(d.k for d in descs) * 3 + 64)
        best = {"A": float("inf"), "B": float("inf")}
        for _ in range(args.repeats):
            for tag, lib in libs.items():
                t = time.perf_counter()
                for d, x, y in zip(descs, xs, ys):
                    lib.tl_linear_forward(ctypes.byref(d), x.data_ptr(), M, y.data_ptr(), scratch.data_ptr())
                best[tag] = min(best[tag], time.perf_counter() - t)
        out["rows"][M] = {"a_ms": round(best["A"] * 1e3, 2), "b_ms": round(best["B"] * 1e3, 2),
                          "b_over_a": round(best["B"] / best["A"], 3)}
        print(M, out["rows"][M], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
