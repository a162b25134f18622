"""Two builds of the native library against each other on one model's loop (issues 33, 36): every core matrix of
the loop through `tl_linear_forward` of library A, then of library B, alternated `--repeats` times, best of each,
for M input rows. The layer descriptors come from this checkout's Python (so a flag such as `act_q8` is today's;
a library that does not take it runs its own fallback). Build A from an older commit with
`PYTHONPATH=<worktree>/src python -m tinyloop.kernels.build` (the libraries are cached by source hash in
~/.cache/tinyloop/kernels).

    .venv/bin/python benchmarks/kernel_ab.py LIB_A.so LIB_B.so [LIB_C.so ...] MODEL [--threads 2] [--rows 1,2,4,9,32] [--repeats 3]
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
    ap.add_argument("libs", nargs="+", metavar="LIB", help="two builds or more (B, C, ... against A), then MODEL")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,9,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", choices=["core", "blocks", "head"], default="core")
    ap.add_argument("--json")
    args = ap.parse_args()
    ref = native.load()
    *paths, args.model = args.libs
    if len(paths) < 2:
        ap.error("two libraries or more, then the model")
    libs = {chr(ord("A") + i): ctypes.CDLL(p) for i, p in enumerate(paths)}
    ex = Engine.load(args.model, draft_exit=False).model.executor
    for lib in libs.values():   # (after the load: the engine sets the threads of its own library, which may be one of these)
        lib.tl_linear_forward.argtypes = ref.tl_linear_forward.argtypes
        lib.tl_set_threads.argtypes = [ctypes.c_int]
        lib.tl_set_threads(args.threads)
    descs = [ex.head] if args.layers == "head" else ex.linears("core" if args.layers == "core" else "all")
    out = {"libs": dict(zip(libs, paths)), "model": args.model, "threads": args.threads, "layers": args.layers,
           "rows": {}}
    for M in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(M, d.k) for d in descs]
        ys = [torch.empty(M, d.n) for d in descs]
        scratch = torch.empty(M * max(d.k for d in descs) * 3 + 64)
        best = {tag: float("inf") for tag in libs}
        for _ in range(args.repeats):
            for tag, lib in libs.items():
                t = time.perf_counter()
                for d, x, y in zip(descs, xs, ys):
                    lib.tl_linear_forward(ctypes.byref(d), x.data_ptr(), M, y.data_ptr(), scratch.data_ptr())
                best[tag] = min(best[tag], time.perf_counter() - t)
        out["rows"][M] = {f"{tag.lower()}_ms": round(t * 1e3, 3) for tag, t in best.items()}
        out["rows"][M].update({f"{tag.lower()}_over_a": round(t / best["A"], 3) for tag, t in best.items() if tag != "A"})
        print(M, out["rows"][M], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
