"""Speculation at a real model shape, in-process: plain decoding against self-speculation on the engine core.

Builds the Ouro-1.4B shape (`--shape ouro-1.4b`, 4 loops) or the Huginn-3.5B shape (`--shape huginn-3.5b`: 2 + 4
+ 2 blocks of width 5280, 32 loops) with random weights (as `real_shapes.py` does: the family's config.json
values, bf16, int4 round-to-nearest, group 128) in two variants:

- `random`: random weights, whose shallow and deep greedy tokens disagree (drafts are never accepted:
  speculation should stop drafting and run at plain speed);
- `agree`: the same weights with the core blocks' sandwich post-norms scaled by 0.0002, so that each loop
  barely moves the state and plain greedy tokens are equal at loops 1, 2 and 4 (checked and reported):
  a 1-loop draft predicts the 4-loop verifier, and speculation should pay.

For each: plain tok/s at the shape's loops V and at 1, speculation with fixed settings (`--fixed d:k`, adaptive
off; each as a chain round and as depth-aligned passes, the pipeline), the default (the engine's policy) and
`loops: "auto"` (`--auto`), each paired with a plain run just before it (x_plain), acceptance, the policy's mean
draft length, and what a round costs in plain tokens (round ms over plain ms per token). Greedy outputs are
compared with plain decoding's.

    .venv/bin/python benchmarks/spec_shape.py [--shape ouro-1.4b] [--tokens 48] [--threads 2] [--workdir DIR]
        [--fixed 1:4,2:4] [--variants random,agree] [--auto] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_shapes import CONFIG_OF, HEAD_BITS, SHAPES, small_tokenizer  # noqa: E402

from tinyloop.engine import Engine, SamplingParams  # noqa: E402
from tinyloop.engine.serving import run_ids  # noqa: E402
from tinyloop.model import build_model  # noqa: E402
from tinyloop.modelfile.loader import write_model  # noqa: E402
from tinyloop.tools.gptq import QuantSpec  # noqa: E402
from tinyloop.tools.quantize import quantize_file  # noqa: E402

PROMPT = [5, 17, 42, 7, 99, 3, 11, 64]


def shape_config(shape: str, workdir: Path):
    family, hf = SHAPES[shape]
    return CONFIG_OF[family](hf, workdir, [0])


def build(workdir: Path, shape: str, variant: str, scale: float) -> Path:
    """The int4 file of a shape and variant (kept in `workdir` for the next run). Groups of 128 columns, or 32
    where 128 does not divide the width (Huginn's 5280 = 32 x 165)."""
    out = workdir / f"{shape}-{variant}-int4.tinyloop"
    if out.exists():
        return out
    cfg = shape_config(shape, workdir)
    if variant == "agree" and SHAPES[shape][0] not in ("ouro", "huginn"):
        raise SystemExit(f"--variants agree scales the core's sandwich post-norms: Ouro and Huginn shapes only, "
                         f"not {shape}")
    bf16 = workdir / f"{shape}-{variant}.tinyloop"
    if not bf16.exists():   # (a build stopped after writing it)
        model = build_model(cfg, seed=0, dtype=torch.bfloat16)
        if variant == "agree":
            with torch.no_grad():
                for blk in model.core:
                    for norm in (blk.attn_out_norm, blk.mlp_out_norm):
                        norm.weight.mul_(scale)
        write_model(bf16, model, tokenizer=small_tokenizer())
        del model
        gc.collect()
    group = 128 if cfg.dim % 128 == 0 else 32
    quantize_file(bf16, out, QuantSpec(bits=4, group_size=group, method="rtn", compare_loop1=False), progress=False,
                  head_bits=HEAD_BITS.get(shape))
    os.remove(bf16)
    gc.collect()
    return out


def timed(engine, params, **spec) -> tuple[list[int], float, dict]:
    stats: dict = {}
    t0 = time.perf_counter()
    ids = run_ids(engine, PROMPT, params, stats=stats, **spec)
    return ids, time.perf_counter() - t0, stats


def measure(path: Path, tokens: int, fixed: list[tuple[int, int]], V: int, auto: bool = False) -> dict:
    engine = Engine.load(path, draft_exit=False)
    base = dict(max_tokens=tokens, ignore_eos=True, temperature=0)
    res: dict = {"file": path.name}
    plain_ids = {}
    for loops in (V, 1):
        timed(engine, SamplingParams(**{**base, "max_tokens": 4}, loops=loops))   # warm
        ids, dt, _ = timed(engine, SamplingParams(**base, loops=loops))
        plain_ids[loops] = ids
        res[f"plain_loops{loops}_tok_s"] = round(tokens / dt, 3)
    res["greedy_equal_loops1_and_V"] = plain_ids[1] == plain_ids[V]
    runs = [(f"d={d} k={k} fixed, {'pipeline' if pipe else 'chain'}", dict(draft_loops=d, draft_ahead=k), False, pipe)
            for d, k in fixed for pipe in (False, True)]
    runs += [("default", {}, True, None), ("default, warm", {}, True, None)]   # (warm: the costs the first
    # default request measured, as a serving engine has them from its earlier requests)
    if auto:
        runs.append(("auto", {}, None, None))
    for name, kw, adaptive, pipe in runs:
        if name == "auto":   # adaptive depth, plain decoding: its mean loops against V
            _, dt_plain, _ = timed(engine, SamplingParams(**base, loops=V))
            _, dt, st = timed(engine, SamplingParams(**base, loops="auto"))
            res[name] = {"tok_s": round(tokens / dt, 3), "x_plain": round(dt_plain / dt, 3),
                         "plain_tok_s": round(tokens / dt_plain, 3), "mean_loops": st.get("loops_used")}
            print(name, res[name], flush=True)
            continue
        p = SamplingParams(**base, mode="speculative", verify_loops=V, **kw)
        _, dt_plain, _ = timed(engine, SamplingParams(**base, loops=V))   # paired: plain right before
        plain_ms = 1000 * dt_plain / tokens
        ids, dt, st = timed(engine, p, adaptive=adaptive, pipeline=pipe)
        rounds = max(1, st.get("rounds", 1))
        res[name] = {"tok_s": round(tokens / dt, 3), "x_plain": round(dt_plain / dt, 3),
                     "plain_tok_s": round(tokens / dt_plain, 3),
                     "acceptance": st.get("acceptance_rate"), "tokens_per_round": st.get("mean_tokens_per_round"),
                     "draft_ahead_chosen": st.get("draft_ahead_chosen"), "plain_rounds": st.get("plain_rounds"),
                     "round_ms": round((st.get("draft_ms", 0) + st.get("verify_ms", 0)) / rounds, 2),
                     "round_in_plain_tokens": round((st.get("draft_ms", 0) + st.get("verify_ms", 0)) / rounds / plain_ms, 3),
                     "exact": ids == plain_ids[V]}
        if adaptive:   # what the policy measured on this host (ms): a draft, a verification by k
            from tinyloop.engine.draft_policy import round_costs
            c = round_costs(engine.model, p.effective_draft_loops(V), V, False, engine.model.executor.streamed)
            res[name]["costs_ms"] = {"draft": round(c.draft_ms or 0, 2), "plain_token": round(plain_ms, 2),
                                     "verify": {k: round(v, 2) for k, v in sorted(c.verify_ms.items())}}
        print(name, res[name], flush=True)
    del engine
    gc.collect()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="ouro-1.4b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tinyloop-spec-shape"))
    ap.add_argument("--variants", default="random,agree")
    ap.add_argument("--scale", type=float, default=0.0002)
    ap.add_argument("--fixed", default=None, help="d:k,... (default: 1:4,2:4 for Ouro, 4:8 for Huginn)")
    ap.add_argument("--auto", action="store_true", help='also loops: "auto" against plain')
    ap.add_argument("--json", type=Path)
    ap.add_argument("--build-only", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TINYLOOP_NATIVE_THREADS", str(args.threads))
    args.workdir.mkdir(parents=True, exist_ok=True)
    V = shape_config(args.shape, args.workdir).default_loops
    spec = args.fixed if args.fixed is not None else ("1:4,2:4" if args.shape.startswith("ouro") else f"{max(1, V // 4)}:4"
                                                      if not args.shape.startswith("huginn") else "4:8")
    fixed = [tuple(int(x) for x in s.split(":")) for s in spec.split(",") if s]
    out = {"shape": args.shape, "loops": V, "host": platform.processor() or platform.machine(), "threads": args.threads, "tokens": args.tokens,
           "torch": torch.__version__, "run": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "variants": {}}
    for v in args.variants.split(","):
        path = build(args.workdir, args.shape, v, args.scale)
        if args.build_only:
            continue
        print(f"== {v}", flush=True)
        out["variants"][v] = measure(path, args.tokens, fixed, V=V, auto=args.auto)
        print(json.dumps(out["variants"][v]), flush=True)
    if args.json and not args.build_only:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
