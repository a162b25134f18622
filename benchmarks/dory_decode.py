"""Batch-1 decode speed of an NVIDIA Dory model (nGPT single-sublayer layers: model/families/dory.py) on the native
executor (csrc/dory.cpp, described from model/families/dory.py NGPTBlock.native_fields) against the PyTorch path, at loops 1, 2 and 4.

A small random Dory shape (`init_ngpt`'s weights; no checkpoint needed): hidden 512, 16 query heads of 64 (q and
the gate 1024 wide, twice the hidden size, as in the release), 4 kv heads, ffn 1536, vocabulary 32,000, layers
"S-*-" / "S-S-*-" / "S-*-" (input, recurrent, output), a window of 64, two RoPE profiles with partial rotary, in
each KV mode (per_loop, last_loop). Each executor decodes one request on the engine core (`BatchEngine`, the
path `Engine.generate` and the server take) after a 96-token prompt (longer than the window), timed from its
first token out until `--tokens` more are (the tokens emitted counted, not the steps: on the native executor a
lone request's plain steps run up to 8 tokens a library call); the figure is the best of `--repeats` runs (the
median beside it), the two executors measured in turn after a warm-up each, in the same process, on the same
weights (fp32, and int4 RTN groups of 32 with `--int4`), so that a busy host's load falls on both. Run on an otherwise idle machine:

    .venv/bin/python benchmarks/dory_decode.py [--tokens 48] [--int4]   # table + benchmarks/results/dory_decode.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from tinyloop.config import ModelConfig
from tinyloop.engine import Engine, SamplingParams
from tinyloop.model import build_model
from tinyloop.model.families import dory
from tinyloop.model.fast import prepare_for_decode
from tinyloop.modelfile.loader import LoadedModel
from hostinfo import cpu_name  # (benchmarks/)

PROMPT = [(i * 7919) % 32000 for i in range(1, 97)]


def dory_config(kv_mode: str) -> ModelConfig:
    pattern = "S-*-" + "S-S-*-" + "S-*-"
    return ModelConfig(dim=512, n_heads=16, n_kv_heads=4, head_dim=64, ffn_dim=1536, n_prelude=4, n_core=6,
                       n_coda=4, vocab_size=32000, default_loops=4, max_loops=16, max_seq_len=1024,
                       rope_theta=10000.0, rotary_dim=32, rope_theta_2=500.0, rotary_dim_2=48,
                       rope_profile=tuple(2 if c == "S" else 1 for c in pattern), mlp="swiglu",
                       tie_embeddings=False, injection="add", loop_start="embed", loop_norm=False, head_norm=False,
                       layer_pattern=pattern, sliding_window=64, family_params=dory.params(0.02),
                       kv_mode=kv_mode, eos_token_id=31999)


def int4(model) -> None:
    """Every block projection as RTN int4 codes in groups of 32 (the native kernel where the executor is native,
    torch's otherwise: quant.linear's choice at load)."""
    from tinyloop.model.fast import swap_linears
    from tinyloop.quant.linear import QuantLinear
    from tinyloop.quant.packing import pack, quantize_rtn

    def factory(name, lin):
        q, s, z = quantize_rtn(lin.weight.detach(), 4, 32)
        return QuantLinear.from_portable(pack(q, 4), s, z, 4)

    swap_linears(model, factory)


def decode_rate(engine, loops: int, tokens: int) -> dict:
    """One measurement: a request on the engine core (`BatchEngine`, the path `Engine.generate` and the server
    take), stepped until its first token is out (the prompt's prefill), then timed until `tokens` more are: tokens
    / seconds. (On the native executor a lone request's plain steps run up to 8 tokens in one library call,
    engine/fast_steps.py: the tokens a step emits are counted, not the steps.)"""
    plan = engine.plan(PROMPT, SamplingParams(max_tokens=tokens + 16, loops=loops, temperature=0, ignore_eos=True))
    core = engine.core(plan)
    got: list[int] = []
    req = core.add(plan, lambda ev: ev is not None and got.extend(ev.token_ids))
    t = time.perf_counter()
    while not got:
        core.step()
    prefill = time.perf_counter() - t
    n0, t = len(got), time.perf_counter()
    while len(got) < n0 + tokens:
        core.step()
    dt = time.perf_counter() - t
    core.abort(req)
    return {"decode_s": dt / (len(got) - n0) * tokens, "prefill_s": prefill}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--loops", default="1,2,4")
    ap.add_argument("--int4", action="store_true", help="also int4 weights")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "dory_decode.json"))
    args = ap.parse_args(argv)
    loops_list = [int(x) for x in args.loops.split(",")]
    rows = []
    for kv_mode in ("per_loop", "last_loop"):
        base = build_model(dory_config(kv_mode), seed=0)
        for weights in ["fp32"] + (["int4"] if args.int4 else []):
            engines = {}
            for executor in ("torch", "native"):
                model = copy.deepcopy(base)
                if weights == "int4":
                    from tinyloop.kernels.lib import choose
                    with choose(executor):
                        int4(model)
                prepare_for_decode(model, executor=executor)
                engines[executor] = Engine(LoadedModel(model, None, {}, None))
            for loops in loops_list:
                runs = {e: [] for e in engines}
                for e, eng in engines.items():   # (a warm-up each)
                    decode_rate(eng, loops, 4)
                for _ in range(args.repeats):   # the executors in turn, so that the host's load falls on both
                    for e, eng in engines.items():
                        runs[e].append(decode_rate(eng, loops, args.tokens))
                for e, rs in runs.items():
                    best = min(r["decode_s"] for r in rs)
                    med = statistics.median(r["decode_s"] for r in rs)
                    r = {"tok_s": args.tokens / best, "median_tok_s": args.tokens / med,
                         "prefill_ms": 1000 * min(x["prefill_s"] for x in rs)}
                    name = engines[e].model.executor.name if engines[e].model.executor is not None else "torch"
                    rows.append({"kv_mode": kv_mode, "weights": weights, "executor": e, "loops": loops,
                                 "detail": name, **r})
                    print(f"{kv_mode:9} {weights:5} {e:6} loops {loops}: {r['tok_s']:8.1f} tok/s best "
                          f"({r['median_tok_s']:.1f} median; prefill {r['prefill_ms']:.0f} ms)",
                          file=sys.stderr, flush=True)
    print(f"\n| KV mode | weights | loops | torch tok/s | native tok/s | native / torch |\n|---|---|---|---|---|---|")
    for kv_mode in ("per_loop", "last_loop"):
        for weights in ["fp32"] + (["int4"] if args.int4 else []):
            for loops in loops_list:
                t, n = (next(r for r in rows if (r["kv_mode"], r["weights"], r["executor"], r["loops"])
                             == (kv_mode, weights, e, loops))["tok_s"] for e in ("torch", "native"))
                print(f"| {kv_mode} | {weights} | {loops} | {t:.1f} | {n:.1f} | {n / t:.2f}x |")
    out = {"command": "python " + " ".join(["benchmarks/dory_decode.py", *(argv if argv is not None else sys.argv[1:])]),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host_cpu": cpu_name(),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "prompt_tokens": len(PROMPT),
           "tokens": args.tokens, "repeats": args.repeats, "load_average": os.getloadavg(),
           "shape": "dim 512, 16 q / 4 kv heads of 64, ffn 1536, vocab 32000, S-*- / S-S-*- / S-*-, window 64",
           "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
