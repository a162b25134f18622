"""Batch-1 decode speed: the fast path against a plain eager loop and the memory-bandwidth ceiling.

For each model (random weights, `tinyloop.model.build_model`) and weight dtype, at each loop count:

- eager:    the unmodified LoopedTransformer forward (nn.Linear in the model's dtype), at torch's default
            thread count and at 1 thread; the better of the two is the baseline;
- fast:     the same weights after `tinyloop.model.fast.prepare_for_decode` (its default options);
- ceiling:  bytes of weights one decode token reads (prelude + coda + loops x core blocks + LM head, in the
            bytes per weight of that format) over the read bandwidth measured here, in this run, by summing a
            1 GiB tensor.

Every figure is tokens/s of one request's decode steps on the engine core (`BatchEngine.step`, the path
the server and `Engine.generate` use: scheduling, the batched forward over the paged pool, sampling)
after an 8-token prefill, timed over `--tokens` steps after 2 warm-up steps. Run on an otherwise idle machine:

    .venv/bin/python benchmarks/decode.py            # table + benchmarks/results/decode.json (+ decode.png)
    .venv/bin/python benchmarks/decode.py --plot-only  # replot decode.png from decode.json, run nothing
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from tinyloop.config import ModelConfig, preset
from tinyloop.engine import Engine, SamplingParams
from tinyloop.modelfile.loader import LoadedModel
from tinyloop.model import build_model
from tinyloop.model.fast import prepare_for_decode
from tinyloop.tools.progress import progress

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROMPT = [464, 3797, 286, 262, 9814, 318, 257, 890]  # 8 GPT-2 ids


def measure_bandwidth(gib: float = 1.0, repeats: int = 7) -> dict:
    """Read bandwidth (GB/s) of a large fp32 tensor, summed with torch's threads: best and median."""
    n = int(gib * (1 << 30)) // 4
    big = torch.ones(n, dtype=torch.float32)
    big.sum()  # fault the pages in
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        big.sum()
        rates.append(n * 4 / (time.perf_counter() - t) / 1e9)
    del big
    return {"best_GBps": max(rates), "median_GBps": statistics.median(rates), "bytes": n * 4,
            "threads": torch.get_num_threads()}


def weight_bytes_per_token(cfg: ModelConfig, loops: int, bytes_per_weight: int) -> int:
    """Bytes of weights one decode token reads: every block's matrices and norms once per use, the head."""
    d, hd = cfg.dim, cfg.head_dim
    attn = d * cfg.n_heads * hd + 2 * d * cfg.n_kv_heads * hd + cfg.n_heads * hd * d
    mlp = (3 if cfg.mlp == "swiglu" else 2) * d * cfg.ffn_dim
    block = attn + mlp + 2 * d
    weights = (cfg.n_prelude + cfg.n_coda + loops * cfg.n_core) * block
    weights += loops * d  # core_norm
    if cfg.injection == "concat-adapter":
        weights += loops * 2 * d * d
    weights += cfg.vocab_size * d + d  # LM head + final norm (the embedding row is negligible)
    return weights * bytes_per_weight


@torch.inference_mode()
def decode_rate(model, loops: int, tokens: int, warmup: int = 2) -> dict:
    engine = Engine(LoadedModel(model, None, {}, None))
    plan = engine.plan(PROMPT, SamplingParams(max_tokens=warmup + tokens + 2, loops=loops, ignore_eos=True))
    core = engine.core(plan)
    req = core.add(plan, lambda ev: None)
    for _ in range(1 + warmup):  # prefill (and the first token), then warm-up steps
        core.step()
    times = []
    for _ in range(tokens):
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    core.abort(req)
    return {"tok_s": len(times) / sum(times), "median_ms": 1000 * statistics.median(times)}


def bench_model(name: str, dtype_name: str, loops_list: list[int], tokens: int, default_threads: int,
                bandwidth: float, log) -> list[dict]:
    cfg = preset(name)
    small = cfg.dim < 1024
    model = build_model(cfg, seed=0, dtype=torch.float32)
    if dtype_name != "fp32":
        model = model.to(DTYPES[dtype_name])
    bpw = 4 if dtype_name == "fp32" else 2
    rows = {loops: {"model": name, "dtype": dtype_name, "loops": loops,
                    "weight_bytes_per_token": weight_bytes_per_token(cfg, loops, bpw)} for loops in loops_list}
    thread_options = sorted({default_threads, 1}, reverse=True)

    def run(m, label: str, threads: int | None) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        for loops in loops_list:
            r = decode_rate(m, loops, tokens)
            rows[loops][f"{label}_tok_s"] = r["tok_s"]
            n = getattr(m, "decode_threads", None) or torch.get_num_threads()
            log(f"  {name} {dtype_name} loops={loops} {label} ({n} decode threads): "
                f"{r['tok_s']:.2f} tok/s")

    for threads in thread_options:
        run(model, f"eager_{threads}t", threads)
    # Opt-in lossy variant for the small fp32 model: fp32 weights rounded to fp16 (FBGEMM).
    fp16w = copy.deepcopy(model) if small and dtype_name == "fp32" else None
    torch.set_num_threads(default_threads)
    t = time.perf_counter()
    prepare_for_decode(model)  # default options, thread policy included
    prep_s = time.perf_counter() - t
    info = dict(model.decode_prepared)
    policy = model.decode_threads
    policy_threads = default_threads if policy is None else policy
    run(model, "fast", default_threads)
    if small:  # check the thread policy: the fast path's decode steps at every thread count
        for threads in thread_options:
            model.decode_threads = threads
            run(model, f"fast_{threads}t", threads)
        model.decode_threads = policy
    if fp16w is not None:
        prepare_for_decode(fp16w, weights="fp16", threads=policy)
        run(fp16w, "fast_fp16_weights", default_threads)
        del fp16w
    for loops in loops_list:
        row = rows[loops]
        row["fast_threads"] = policy_threads
        row["fast_options"] = info
        row["prepare_s"] = prep_s
        row["eager_threads"] = thread_options
        row["eager_best_tok_s"] = max(row[f"eager_{t}t_tok_s"] for t in thread_options)
        row["eager_default_tok_s"] = row[f"eager_{default_threads}t_tok_s"]
        row["speedup_vs_eager_best"] = row["fast_tok_s"] / row["eager_best_tok_s"]
        row["ceiling_tok_s"] = bandwidth * 1e9 / row["weight_bytes_per_token"]
        row["fast_of_ceiling"] = row["fast_tok_s"] / row["ceiling_tok_s"]
        row["eager_of_ceiling"] = row["eager_best_tok_s"] / row["ceiling_tok_s"]
        if "fast_fp16_weights_tok_s" in row:
            row["fp16_weights_speedup_vs_eager_best"] = row["fast_fp16_weights_tok_s"] / row["eager_best_tok_s"]
        log(f"  {name} {dtype_name} loops={loops}: fast {row['fast_tok_s']:.2f} tok/s = "
            f"{row['speedup_vs_eager_best']:.2f}x eager, {row['fast_of_ceiling']:.2f} of ceiling")
    torch.set_num_threads(default_threads)
    del model
    gc.collect()
    return list(rows.values())


def table(rows: list[dict]) -> str:
    head = ("| model | weights | loops | GB/token | ceiling tok/s | eager tok/s (threads: n / 1) | fast tok/s | "
            "fast / eager | fast / ceiling | eager / ceiling | fast, fp32 weights as fp16 (opt-in) |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        eager = " / ".join(f"{r[f'eager_{t}t_tok_s']:.2f}" for t in r["eager_threads"])
        opt = (f"{r['fast_fp16_weights_tok_s']:.2f} ({r['fp16_weights_speedup_vs_eager_best']:.2f}x)"
               if "fast_fp16_weights_tok_s" in r else "")
        w = r["dtype"] if r["dtype"] == "fp32" else f"{r['dtype']} -> {r['fast_options']['weights']}"
        lines.append(f"| {r['model']} | {w} | {r['loops']} | {r['weight_bytes_per_token'] / 1e9:.3f} | "
                     f"{r['ceiling_tok_s']:.2f} | {eager} | {r['fast_tok_s']:.2f} | {r['speedup_vs_eager_best']:.2f}x | "
                     f"{r['fast_of_ceiling']:.2f} | {r['eager_of_ceiling']:.2f} | {opt} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tinyloop-small:fp32,tinyloop-small:bf16,tinyloop-407m:fp32,tinyloop-407m:bf16",
                    help="comma-separated preset:dtype pairs (dtype fp32 or bf16)")
    ap.add_argument("--loops", default="1,4,8")
    ap.add_argument("--tokens-small", type=int, default=48, help="timed decode steps per point, small models")
    ap.add_argument("--tokens-large", type=int, default=8, help="timed decode steps per point, 407m")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode.json"))
    ap.add_argument("--no-plot", action="store_true", help="no PNG next to the JSON")
    ap.add_argument("--plot-only", action="store_true", help="only replot the existing --out JSON; run nothing")
    ap.add_argument("--quiet", action="store_true", help="no progress bar (none is shown off a terminal)")
    args = ap.parse_args(argv)
    if args.plot_only:
        from plotting import plot_any

        print(f"wrote {plot_any(args.out)}", file=sys.stderr)
        return 0
    specs = args.models.split(",")
    bar = progress(total=len(specs), desc="decode", unit="model", quiet=args.quiet)

    def log(msg: str) -> None:
        bar.write(msg, file=sys.stderr)

    default_threads = torch.get_num_threads()
    load_start = os.getloadavg()
    torch.set_num_threads(1)
    bw_1t = measure_bandwidth()
    torch.set_num_threads(default_threads)
    bw = measure_bandwidth()
    log(f"read bandwidth: {bw['best_GBps']:.1f} GB/s best, {bw['median_GBps']:.1f} median "
        f"({default_threads} threads, 1 GiB fp32 sum); 1 thread: {bw_1t['best_GBps']:.1f} GB/s")
    loops_list = [int(x) for x in args.loops.split(",")]
    rows = []
    t0 = time.perf_counter()
    for spec in specs:
        name, dtype_name = spec.split(":")
        bar.set_postfix_str(spec)
        tokens = args.tokens_large if preset(name).dim >= 1024 else args.tokens_small
        rows += bench_model(name, dtype_name, loops_list, tokens, default_threads, bw["best_GBps"], log)
        bar.update()
    bar.close()
    bw_after = measure_bandwidth()
    md = table(rows)
    print(md)
    print(f"\nread bandwidth {bw['best_GBps']:.1f} GB/s (before) / {bw_after['best_GBps']:.1f} GB/s (after); "
          f"ceiling uses the first. {time.perf_counter() - t0:.0f} s.")
    out = {
        "benchmark": "decode", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "default_threads": default_threads, "bandwidth": bw, "bandwidth_1_thread": bw_1t,
        "bandwidth_after": bw_after, "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
        "rows": rows, "table_md": md,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    log(f"wrote {args.out}")
    if not args.no_plot:
        from plotting import plot_any

        log(f"wrote {plot_any(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
