"""The default model against the fp16 file it is quantized from: batch-1 decode speed on the fast path.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/default_model.py [--pairs 10] [--tokens 64] [--json PATH]

Both packaged files load through `Engine.load` (what `tinyloop serve` runs); greedy generation at the
default loops, one thread. The two run back to back `--pairs` times and the ratio reported is the median
of the pairs' tokens/s ratios, so a slow spell of the shared machine hits both sides of a pair or
neither. Also reports whether the two write the same greedy text (int4 rounding may change it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from tinyloop.engine import Engine, SamplingParams
from tinyloop.modelfile.loader import DEFAULT_MODEL_NAME, FLOAT_MODEL_NAME, packaged_model_path
from tinyloop.tools.progress import progress

PROMPT = "The king said unto his servants, "


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json")
    ap.add_argument("--quiet", action="store_true", help="no progress bar (none is shown off a terminal)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = {"int4 (default)": DEFAULT_MODEL_NAME, "fp16": FLOAT_MODEL_NAME}
    engines = {k: Engine.load(packaged_model_path(v)) for k, v in names.items()}
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    texts = {k: e.generate(PROMPT, params).text for k, e in engines.items()}  # warm-up
    tps: dict[str, list[float]] = {k: [] for k in engines}
    with progress(total=args.pairs, desc="pairs", unit="pair", quiet=args.quiet) as bar:
        for _ in range(args.pairs):
            for k, e in engines.items():
                t0 = time.perf_counter()
                e.generate(PROMPT, params)
                tps[k].append(args.tokens / (time.perf_counter() - t0))
            bar.update()
    ratios = [a / b for a, b in zip(tps["int4 (default)"], tps["fp16"])]
    out = {"pairs": args.pairs, "tokens": args.tokens, "tokens_per_s": tps,
           "median_tokens_per_s": {k: statistics.median(v) for k, v in tps.items()},
           "int4_over_fp16_median": statistics.median(ratios), "ratios": ratios,
           "same_greedy_text": texts["int4 (default)"] == texts["fp16"],
           "file_bytes": {k: packaged_model_path(v).stat().st_size for k, v in names.items()}}
    for k, v in out["median_tokens_per_s"].items():
        print(f"{k}: median {v:.1f} tok/s ({out['file_bytes'][k] / 2**20:.1f} MiB file)")
    print(f"int4 / fp16: median {out['int4_over_fp16_median']:.2f}x over {args.pairs} pairs "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}); same greedy text: {out['same_greedy_text']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
