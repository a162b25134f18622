"""Self-speculation on Dory's release shape (issue 55: "a depth-agreeing 4B shape: default speculation at loops 4
>= 1.5x plain"), natively, batch 1.

The model is `dory_4b.py`'s int4 file (random weights). Random weights' shallow and deep greedy tokens disagree,
so drafts would never be accepted; the depth-agreeing variant damps the recurrent layers' nGPT rate (each core
layer's alpha times `--damp`, in memory before the executor is attached: every loop then moves the state by
almost nothing), so that 1 and 4 loops give the same greedy text, as a model trained for every depth mostly does.
Timed, alternating, `--repeats` times: plain greedy at loops 4 and at loops 1, the default speculation (draft 1
loop, verify 4, the draft-length policy's choice up to draft_ahead 4) and `--ahead` as a fixed longer draft; the
ratio is best against best. Every speculative output is checked equal to plain loops 4's.

    PYTHONPATH=src .venv/bin/python benchmarks/dory_4b_spec.py --model /tmp/dory4b/dory-4b-int4.tinyloop
        [--tokens 32] [--repeats 3] [--damp 0.002] [--json benchmarks/results/dory_4b_spec.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from hostinfo import host  # (benchmarks/)
from tinyloop.engine import Engine, SamplingParams
from tinyloop.model.fast import attach_executor


def load(model: str, damp: float | None):
    """The int4 file on the native executor, its core layers' nGPT rate times `damp` (None: as they are), once its
    codes are packed (in the background after the load); (engine, the executor's name)."""
    engine = Engine.load(model)
    if damp is not None:
        with torch.no_grad():
            for blk in engine.model.core:
                blk.alpha.mul_(damp)
        attach_executor(engine.model)   # (described again from the damped weights)
    engine.model.executor.packing_done()
    return engine, engine.model_info()["executor"]


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options this script and dory_4b_auto.py share: the int4 file, tokens, repeats, the damping, --json."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="dory_4b.py's int4 file")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--damp", type=float, default=0.002)
    ap.add_argument("--json")
    return ap


def main() -> None:
    ap = arguments(__doc__)
    ap.add_argument("--ahead", type=int, default=8, help="a fixed draft length to time beside the default")
    args = ap.parse_args()
    load0 = os.getloadavg()
    engine, executor = load(args.model, args.damp)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    runs = {"plain loops 4": dict(loops=4), "plain loops 1": dict(loops=1),
            "speculative (default)": dict(mode="speculative", verify_loops=4),
            f"speculative draft_ahead {args.ahead}": dict(mode="speculative", verify_loops=4, draft_ahead=args.ahead)}
    engine.generate(prompt, SamplingParams(max_tokens=4, loops=4, temperature=0, ignore_eos=True))
    times: dict[str, list[float]] = {k: [] for k in runs}
    ids, stats = {}, {}
    for rep in range(args.repeats):
        for name, kw in runs.items():
            params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, **kw)
            t0 = time.perf_counter()
            out = engine.generate(prompt, params)
            times[name].append(time.perf_counter() - t0)
            ids[name], stats[name] = out.token_ids, out.stats
            print(f"{rep} {name}: {args.tokens / times[name][-1]:.3f} tok/s", flush=True)
    plain = ids["plain loops 4"]
    rows = {name: {"tok_s": round(args.tokens / min(t), 3), "over_plain_loops_4": round(min(times["plain loops 4"]) / min(t), 3),
                   "equal_to_plain_loops_4": ids[name] == plain,
                   "acceptance_rate": stats[name].get("acceptance_rate")} for name, t in times.items()}
    for name, row in rows.items():
        print(f"{name:28s} {row['tok_s']:7.3f} tok/s  {row['over_plain_loops_4']:.3f}x plain loops 4  "
              f"equal {row['equal_to_plain_loops_4']}  acceptance {row['acceptance_rate']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"host": host(), "executor": executor, "model": args.model,
                                               "damp": args.damp, "tokens": args.tokens, "repeats": args.repeats,
                                               "load_average_start": load0, "load_average_end": os.getloadavg(),
                                               "seconds": times, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
