"""Self-speculative decoding benchmark: plain generate at V loops against chain and tree speculation.

    OMP_NUM_THREADS=1 python benchmarks/speculative.py                      # the shipped model, full grid
    python benchmarks/speculative.py --checkpoint runs/shipped/checkpoint.safetensors --quick
    python benchmarks/speculative.py --json benchmarks/results/speculative.json --plot-only   # replot only

Greedy, `--tokens` new tokens per prompt over a fixed prompt set, one thread, on the model as
`Engine.load` prepares it (the decode fast path; `--eager` for plain fp32 modules). For every setting it
reports tokens/s and the speed-up over plain generate, paired: per prompt, plain generate and the
setting run back to back `--repeats` times and the speed-up is the median of those pairs' time ratios
(the machine is shared and drifts by tens of percent within a run), acceptance figures, and
whether the tokens equal plain generate's (float32: a batched pass may flip a near-tie; it is counted,
not hidden). With --json, a PNG goes next to it: tokens/s by setting and acceptance by draft depth
(benchmarks/plotting.py; --no-plot to skip). A cost model section times the pieces (one loop, the full and the draft LM head at a few
widths) and the per-round figures the runs report (time per draft token, per verification pass, per
round). Results go to stdout as markdown and, with --json, to a file.

The "ceiling" column is the speed-up a setting would reach if every round emitted its most tokens
(draft_ahead + 1: every draft accepted) at the round cost this run measured for it: (k + 1) x plain
ms/token / ms per round. A chain or tree round does the same work whatever is accepted (k drafts, one
verification pass over every drafted position), so no model, however well its shallow loops agree with
its deep ones, can beat that column on this machine with this engine. Rows with `draft_stop` > 0 end
rounds early and have no ceiling.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from tinyloop.engine import Engine
from tinyloop.engine.knobs import SamplingParams
from tinyloop.engine.serving import run_ids
from tinyloop.engine.draft_head import DRAFT_VOCAB
from tinyloop.engine.speculative import DRAFT_STOP
from tinyloop.modelfile.loader import LoadedModel
from tinyloop.model.layers import StepContext
from tinyloop.tools.progress import progress

PROMPTS = [
    "In the beginning God created the heaven and the earth. And the earth was without form, and",
    "ROMEO. But soft, what light through yonder window breaks? It is the east, and",
    "The :mod:`os` module provides a portable way of using operating system dependent functionality.",
    "The jury further said in term-end presentments that the City Executive Committee, which had",
]


def load(args):
    from tinyloop.tokenizer import Tokenizer

    if args.checkpoint:
        from tinyloop.train.checkpoint import checkpoint_model

        model, state = checkpoint_model(args.checkpoint)
        return model, Tokenizer.gpt2(), f"{args.checkpoint} (step {state.get('step')})"
    from tinyloop.engine import Engine
    from tinyloop.modelfile.loader import resolve_model_path

    path = resolve_model_path(args.model)  # default: the package's default model (int4)
    exit_flag = not args.no_draft_exit
    if args.eager:  # the plain modules in fp32, as sessions 1-2 measured
        engine = Engine.load(path, dtype=torch.float32, fast=False, draft_exit=exit_flag)
    else:           # what `tinyloop serve` and Engine.load() run: the decode fast path
        engine = Engine.load(path, draft_exit=exit_flag)
    info = engine.model_info()["draft_exit"]
    exits = f", draft exits {info['file']} d={info['draft_loops']}" if info else ", no draft exits"
    return engine.model.eval(), engine.tokenizer, f"{path}{' (eager fp32)' if args.eager else ''}{exits}"


def run(model, prompts, params, **kw):
    """(tokens per prompt, seconds, stats summed over prompts): each prompt alone on the engine core."""
    engine = Engine(LoadedModel(model, None, {}, None))
    outs, total, stats = [], 0.0, {"cpu_s": 0.0}
    for ids in prompts:
        st: dict = {}
        t0, c0 = time.perf_counter(), time.process_time()
        out = run_ids(engine, ids, params, stats=st, **kw)
        total += time.perf_counter() - t0
        stats["cpu_s"] += time.process_time() - c0
        outs.append(out)
        for k in ("rounds", "draft_tokens", "verify_positions", "draft_ms", "verify_ms"):
            stats[k] = stats.get(k, 0) + st.get(k, 0)
        stats.setdefault("acc", []).append(st.get("acceptance_rate", 0.0))
        stats.setdefault("tpr", []).append(st.get("mean_tokens_per_round", 0.0))
    return outs, total, stats


def timeit(fn, n=20, reps=3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1000


@torch.inference_mode()
def pieces(model) -> dict[str, float]:
    """Milliseconds for the pieces a round is made of (no cache: attention over T tokens only)."""
    dim = model.cfg.dim
    out = {}
    for T in (1, 5, 9, 17, 33):
        x = torch.randn(1, T, dim)
        ctx = StepContext(rotary=model.rotary, positions=torch.arange(T), dtype=x.dtype)
        out[f"loop T={T}"] = timeit(lambda: model.core_loop(x, x, 0, ctx))
        out[f"full head T={T}"] = timeit(lambda: model.logits(x))
    x = torch.randn(1, 1, dim)
    ctx = StepContext(rotary=model.rotary, positions=torch.arange(1), dtype=x.dtype)
    out["prelude+coda T=1"] = timeit(lambda: [b(x, ctx, None) for b in list(model.prelude) + list(model.coda)])
    from tinyloop.quant.fp16 import FP16Linear

    h16 = FP16Linear(model.head_weight.detach().float())
    for T in (1, 5, 9, 17):
        xs = torch.randn(T, dim)
        out[f"fp16-weight head T={T}"] = timeit(lambda: h16(xs))
    for n in (4096, 8192):
        w = model.head_weight[:n].float().contiguous()  # the draft head keeps fp32 rows (DraftHead)
        out[f"draft head {n} T=1"] = timeit(lambda: torch.nn.functional.linear(model.norm(x), w), n=100)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a .tinyloop file or packaged model name (default: the shipped default, int4)")
    ap.add_argument("--eager", action="store_true", help="plain fp32 modules instead of the decode fast path")
    ap.add_argument("--checkpoint", help="a training checkpoint instead of a model file")
    ap.add_argument("--no-draft-exit", action="store_true",
                    help="do not attach the model's draft exits: draft through the model's own coda")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--verify-loops", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="defaults and a few settings only")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N prompts")
    ap.add_argument("--no-variants", action="store_true", help="skip the draft vocabulary/stop/head variants")
    ap.add_argument("--defaults-only", action="store_true",
                    help="only the defaults (d=2, k=4) and, if the model has draft exits, the same without them: "
                         "with a high --repeats, the tightest paired figure for the defaults bar")
    ap.add_argument("--repeats", type=int, default=4,
                    help="pairs (plain, setting) per prompt; the speed-up is the median pair ratio")
    ap.add_argument("--json", help="write every figure here (and a plot next to it)")
    ap.add_argument("--no-plot", action="store_true", help="no PNG next to the --json file")
    ap.add_argument("--plot-only", action="store_true", help="only replot the existing --json file; run nothing")
    ap.add_argument("--quiet", action="store_true", help="no progress bar (none is shown off a terminal)")
    args = ap.parse_args(argv)
    if args.plot_only:
        if not args.json:
            ap.error("--plot-only needs --json PATH (the results to plot)")
        from plotting import plot_any

        print(f"wrote {plot_any(args.json)}")
        return 0
    torch.set_num_threads(1)
    model, tok, source = load(args)
    V, N = args.verify_loops, args.tokens
    prompts = [tok.encode(p) for p in PROMPTS[: args.prompts]]
    print(f"# speculative benchmark: {source}, V={V}, {N} new tokens x {len(prompts)} prompts, greedy, "
          f"1 thread, torch {torch.__version__}, {platform.processor() or platform.machine()}\n")

    # warm-up: one-time costs (draft vocabulary table, fp16 argmax head packing, allocator) stay out of rows
    for mode in ("generate", "speculative", "tree_speculative"):
        run(model, prompts[:1], SamplingParams(max_tokens=8, loops=V, verify_loops=V, mode=mode, k_branches=2,
                                               ignore_eos=True))
    base = SamplingParams(max_tokens=N, loops=V, ignore_eos=True)
    ref, t_plain, pst = run(model, prompts, base)
    plain_tps = N * len(prompts) / t_plain
    plain_cpu_tps = N * len(prompts) / pst["cpu_s"]
    print(f"plain generate V={V}: {plain_tps:.1f} tok/s wall ({t_plain / (N * len(prompts)) * 1000:.2f} ms/token), "
          f"{plain_cpu_tps:.1f} tok/s per CPU-second\n")

    grid = []
    ds, ks, Ks = ((1, 2, 4), (2, 4, 8, 16), (1, 2, 4)) if not args.quick else ((1, 2), (4, 8, 16), (1, 4))
    for K in Ks[:1] + Ks[1:][::-1]:  # chain, then the widest tree
        for d in ds:
            for k in ks:
                grid.append(dict(mode="speculative" if K == 1 else "tree_speculative", draft_loops=d,
                                 draft_ahead=k, k_branches=K))
    variants = [("draft vocab full", dict(draft_vocab=None)), ("draft vocab 8192", dict(draft_vocab=8192)),
                ("draft_stop 0.3", dict(draft_stop=0.3)), ("draft_stop 0.6", dict(draft_stop=0.6)),
                ("fp32 verify head", dict(fast_head=False))]
    if getattr(model, "draft_exits", None):
        variants.insert(0, ("no draft exit (coda)", dict(draft_exit=False)))

    rows = []
    print("| mode | d | k | K | tok/s | plain tok/s | speed-up | CPU speed-up | acceptance | tokens/round | "
          "draft ms/token | verify ms/pass | ms/round | ceiling | = plain |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def report(label, knobs, kw):
        # Paired: for each prompt, plain generate and this setting run back to back (about a second
        # each), `--repeats` times; the speed-up is the median of those pairs' time ratios, so a slow
        # spell of the shared machine hits both sides of a pair or neither.
        params = SamplingParams(max_tokens=N, verify_loops=V, ignore_eos=True, **knobs)
        ratios, cpu_ratios, t_base, t, outs, st = [], [], float("inf"), float("inf"), None, None
        for _ in range(max(1, args.repeats)):
            tb_sum, tr_sum, o, s_r = 0.0, 0.0, [], None
            for p in prompts:
                _, t_b, s_b = run(model, [p], base)
                o_p, t_r, s_p = run(model, [p], params, **kw)
                ratios.append(t_b / t_r)
                cpu_ratios.append(s_b["cpu_s"] / s_p["cpu_s"])
                tb_sum, tr_sum = tb_sum + t_b, tr_sum + t_r
                o += o_p
                s_r = s_p if s_r is None else {k: (v + s_p[k] if k in s_p else v) for k, v in s_r.items()}
            t_base = min(t_base, tb_sum)
            if tr_sum < t:
                t, outs, st = tr_sum, o, s_r
        tps = N * len(prompts) / t
        rounds = max(st["rounds"], 1)
        row = dict(label=label, **knobs, **kw, tokens_per_s=tps, speedup=statistics.median(ratios),
                   speedup_pairs=[round(r, 3) for r in ratios],
                   plain_tokens_per_s=N * len(prompts) / t_base,
                   acceptance=statistics.mean(st["acc"]), tokens_per_round=statistics.mean(st["tpr"]),
                   draft_ms_per_token=st["draft_ms"] / max(st["draft_tokens"], 1),
                   verify_ms_per_pass=st["verify_ms"] / rounds, ms_per_round=t * 1000 / rounds,
                   cpu_speedup=statistics.median(cpu_ratios),
                   exact=sum(o == r for o, r in zip(outs, ref)))
        row["ceiling"] = None if kw.get("draft_stop") else \
            (knobs["draft_ahead"] + 1) * (t_base / (N * len(prompts)) * 1000) / row["ms_per_round"]
        rows.append(row)
        print(f"| {label} | {knobs['draft_loops']} | {knobs['draft_ahead']} | {knobs['k_branches']} | "
              f"{tps:.1f} | {row['plain_tokens_per_s']:.1f} | {row['speedup']:.2f}x | {row['cpu_speedup']:.2f}x | {row['acceptance']:.2f} | {row['tokens_per_round']:.2f} | "
              f"{row['draft_ms_per_token']:.2f} | {row['verify_ms_per_pass']:.2f} | {row['ms_per_round']:.2f} | "
              f"{'-' if row['ceiling'] is None else format(row['ceiling'], '.2f') + 'x'} | "
              f"{row['exact']}/{len(prompts)} |", flush=True)
        save(partial=True)

    def save(partial=False, **extra):
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(dict(
                source=source, V=V, tokens=N, prompts=PROMPTS[: args.prompts], plain_tokens_per_s=plain_tps,
                plain_tokens_per_cpu_s=plain_cpu_tps,
                draft_vocab=DRAFT_VOCAB, draft_stop=DRAFT_STOP, partial=partial, rows=rows, **extra), indent=1))

    default = dict(mode="speculative", draft_loops=2, draft_ahead=4, k_branches=1)
    if args.defaults_only:
        grid = []
        variants = [v for v in variants if v[1].get("draft_exit") is False]
    settings = [default] + [g for g in grid if g != default]  # the defaults first
    n_variants = 0 if args.no_variants else len(variants)
    with progress(total=len(settings) + n_variants, desc="settings", unit="setting", quiet=args.quiet) as bar:
        for knobs in settings:
            report("chain" if knobs["k_branches"] == 1 else "tree", knobs, {})
            bar.update()
            if knobs is default:
                for label, kw in ([] if args.no_variants else variants):
                    report(label, default, kw)
                    bar.update()
    # plain generate again: how much the machine drifted during the run
    _, t_plain2, _ = run(model, prompts, base)
    plain2 = N * len(prompts) / t_plain2
    print(f"\nplain generate again at the end: {plain2:.1f} tok/s (drift {plain2 / plain_tps - 1:+.1%})")
    best = max(rows, key=lambda r: r["speedup"])
    top = max((r for r in rows if r["ceiling"] is not None), key=lambda r: r["ceiling"])
    print(f"highest ceiling (every draft accepted): {top['label']} d={top['draft_loops']} k={top['draft_ahead']} "
          f"K={top['k_branches']} {top['ceiling']:.2f}x")
    print(f"best: {best['label']} d={best['draft_loops']} k={best['draft_ahead']} K={best['k_branches']} "
          f"{best['speedup']:.2f}x; defaults (d=2, k=4, chain): "
          f"{next(r for r in rows if r['label'] == 'chain' and r['draft_loops'] == 2 and r['draft_ahead'] == 4)['speedup']:.2f}x")

    cost = pieces(model)
    print("\n## cost model: pieces (ms, best of 3)\n")
    for k, v in cost.items():
        print(f"- {k}: {v:.3f}")
    save(plain_again=plain2, pieces=cost)
    if args.json and not args.no_plot:
        from plotting import plot_any

        print(f"wrote {plot_any(args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
