"""Quantization quality, memory and speed tables for docs/quantization.md (one command).

    .venv/bin/python benchmarks/quant.py            # shipped model; writes benchmarks/results/quant.json
                                                    # and the tables block of docs/quantization.md

1. Validation perplexity of the shipped model (or `--checkpoint runs/.../checkpoint.safetensors` while it trains)
   at loops 1/4/8 for fp32, bf16, int8-rtn and int4/int2 x rtn/gptq x group 32/64/128, each through the
   real quantized modules (`tools.quantize.quantized_model`: what loading the quantized file gives), and
   for each KV format (fp32 weights). Validation text = the shipped model's held-out split: the last 1%
   of each corpus file (`train.data.split_text`), the first `--val-tokens` tokens of each file's split.
   GPTQ calibrates on windows drawn from the training split of the same files.
2. Bytes: model file (each quantized file is written), weights read per decode token (loops x core +
   prelude + coda + LM head, in the bytes the kernels read), KV bytes per token per slot.
3. Decode tokens/s at batch 1 and 8 per weight format, on the shipped model and on `tinyloop-407m`
   (random weights, `build_model`), all in the same run so the ratios compare like with like.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from tinyloop.config import ModelConfig, preset
from tinyloop.model import KVCache, LoopedTransformer, build_model
from tinyloop.modelfile.loader import DEFAULT_MODEL_NAME, FLOAT_MODEL_NAME, load_model, make_header, packaged_model_path, write_model
from tinyloop.quant.formats import quantized_weight_bytes
from tinyloop.quant.kv import KV_FORMATS
from tinyloop.quant.linear import QuantLinear
from tinyloop.tokenizer import Tokenizer
from tinyloop.tools.evaluate import kl_divergence, perplexity
from tinyloop.tools.gptq import QuantSpec, quantize_model
from tinyloop.tools.quantize import quantized_model, read_calibration
from tinyloop.train.data import read_text, split_text

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "data" / "corpus"  # make corpus (docs/data.md)
DOC = ROOT / "docs" / "quantization.md"
BEGIN, END = "<!-- quant-tables:begin -->", "<!-- quant-tables:end -->"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- data ------------------------------------------------------------------------------------
def corpus_files(corpus: Path) -> list[Path]:
    return sorted(corpus.glob("*.txt.gz")) + sorted(corpus.glob("*.txt"))


def validation_tokens(tok: Tokenizer, corpus: Path, per_file: int) -> list[int]:
    ids: list[int] = []
    for f in corpus_files(corpus):
        _, val = split_text(read_text(f), 0.01)
        ids += tok.encode(val[: per_file * 12])[:per_file] + [tok.eos_id]  # ~4 chars a token: 12 is ample
    return ids


# -- models ----------------------------------------------------------------------------------
def load_float(args) -> tuple[LoopedTransformer, Tokenizer, str, int | None]:
    if args.checkpoint:
        from tinyloop.train.checkpoint import checkpoint_model

        model, state = checkpoint_model(args.checkpoint)
        return model, Tokenizer.gpt2(), f"{args.checkpoint} (step {state.get('step')})", None
    path = Path(args.model) if args.model else packaged_model_path(FLOAT_MODEL_NAME)
    lm = load_model(path, dtype=torch.float32)
    return lm.model, lm.tokenizer, str(path), path.stat().st_size


def file_bytes(cfg, tok, tensors, quant, dtype) -> int:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.tinyloop"
        write_model(p, None, tokenizer=tok, tensors=tensors,
                    header=make_header(cfg, dtype, tok, {"tool": "benchmarks/quant.py"}, quant=quant))
        return p.stat().st_size


def float_file_bytes(model, tok) -> int:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.tinyloop"
        write_model(p, model, tokenizer=tok, provenance={"tool": "benchmarks/quant.py"})
        return p.stat().st_size


def weights_read_per_token(model: LoopedTransformer, loops: int) -> int:
    """Bytes one decode token reads: prelude + coda once, core x loops, the LM head (norm weights aside)."""
    cfg = model.cfg

    def blocks_bytes(blocks) -> int:
        total = 0
        for mod in blocks.modules():
            if isinstance(mod, QuantLinear):
                total += mod.weight_bytes
            elif isinstance(mod, torch.nn.Linear):
                total += mod.weight.numel() * mod.weight.element_size()
        return total

    head = model.head_weight
    return (blocks_bytes(model.prelude) + blocks_bytes(model.coda) + loops * blocks_bytes(model.core)
            + head.numel() * head.element_size() + (0 if cfg.injection != "concat-adapter" else
                                                    loops * model.adapter.weight.numel() * 2))


# -- measurements ----------------------------------------------------------------------------
def ppl_row(model, val, loops_list, seq_len, kv="fp16") -> dict[int, float]:
    out = {}
    for loops in loops_list:
        r = perplexity(model, val, loops, seq_len=seq_len, stride=seq_len - 128, kv_format=kv)
        out[loops] = r["perplexity"]
    return out


@torch.inference_mode()
def decode_speed(model, batch: int, loops: int, steps: int, prompt_len: int = 8, kv_format: str = "fp16") -> float:
    """Tokens/s (all rows) of one-token decode steps after a prefill of `prompt_len`; best of two timings."""
    cfg = model.cfg
    p = next(model.parameters())
    cache = KVCache(cfg, batch=batch, max_positions=prompt_len + 2 * steps + 4, loops=loops,
                    dtype=p.dtype, device=p.device, kv_format=kv_format)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=g)
    model(x, loops, cache=cache, start=0, last_only=True)
    cache.length = prompt_len
    tok = x[:, -1:]
    best = 0.0
    for _ in range(2):
        model(tok, loops, cache=cache, start=cache.length, last_only=True)  # warm-up
        cache.length += 1
        t0 = time.perf_counter()
        for _ in range(steps):
            model(tok, loops, cache=cache, start=cache.length, last_only=True)
            cache.length += 1
        best = max(best, batch * steps / (time.perf_counter() - t0))
        cache.length -= steps + 1
    return best


def quantize_copy(model, spec: QuantSpec, calib, out_dtype=torch.float32):
    m = copy.deepcopy(model)
    tensors, quant, report = quantize_model(m, spec, calib, progress=False)
    del m
    tensors = {k: v.to(out_dtype) if v.is_floating_point() and k in quant["high_precision"] else v
               for k, v in tensors.items()}
    return quantized_model(model.cfg, tensors, quant, out_dtype), tensors, quant, report


# -- main ------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="float .tinyloop file (default: the shipped fp16 model)")
    ap.add_argument("--checkpoint", help="a training checkpoint instead of a model file (development)")
    ap.add_argument("--corpus", default=str(CORPUS))
    ap.add_argument("--val-tokens", type=int, default=1536, help="validation tokens per corpus file")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--loops", default="1,4,8")
    ap.add_argument("--groups", default="32,64,128")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per speed measurement")
    ap.add_argument("--kv-context", type=int, default=256, help="prompt length before timing decode per KV format")
    ap.add_argument("--skip-407m", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quant.json"))
    ap.add_argument("--no-doc", action="store_true", help="do not rewrite docs/quantization.md's tables")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loops_list = [int(x) for x in args.loops.split(",")]
    groups = [int(x) for x in args.groups.split(",")]
    t_start = time.perf_counter()
    busy = os.popen("pgrep -f '[t]inyloop train'").read().strip()

    model, tok, source, src_bytes = load_float(args)
    cfg = model.cfg
    corpus = Path(args.corpus)
    val = validation_tokens(tok, corpus, args.val_tokens)
    # the same windows `tinyloop quantize --calib <corpus files> --calib-val-fraction 0.01` (make int4-model) uses
    calib = read_calibration(corpus_files(corpus), tok, args.calib_tokens, args.calib_seq_len, val_fraction=0.01)
    log(f"{source}: {len(val)} validation tokens, calibration {tuple(calib.shape)}")
    res: dict = {"source": source, "val_tokens": len(val), "seq_len": args.seq_len, "loops": loops_list,
                 "kv_context": args.kv_context,
                 "calibration": {"windows": list(calib.shape), "from": "training split of each corpus file"},
                 "weights": [], "kv": [], "speed": [], "hessian": []}

    # 1. weight formats: quality, bytes, speed (shipped model)
    # The first group size's rows, the KV formats and the speeds come first (every bar needs only them);
    # the other group sizes last, so a run cut short still answers the bars.
    configs = [("fp32", None), ("bf16", None), ("int8-rtn", QuantSpec(bits=8, group_size=None, method="rtn"))]
    later = []
    for G in groups:
        for bits in (4, 2):
            for method in ("rtn", "gptq"):
                (configs if G == groups[0] else later).append(
                    (f"int{bits}-{method}-g{G}", QuantSpec(bits=bits, group_size=G, method=method)))
    res["machine"] = {"cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
                      "python": platform.python_version(), "cpus": os.cpu_count(), "training_running": bool(busy)}
    res["kv_16bit_bytes_per_token_per_slot"] = 2 * cfg.n_kv_heads * cfg.head_dim * 2

    def save(final: bool = False) -> None:
        """Results so far -> JSON (and the doc's tables): a run cut short still leaves what it measured."""
        res["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        res["total_seconds"] = round(time.perf_counter() - t_start, 1)
        res["complete"] = final
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        if not args.no_doc:
            write_doc(tables(res, cfg))

    speed_models = {}
    run_weights(configs, res, model, tok, cfg, calib, val, loops_list, args, speed_models, groups, save)
    if not args.model and not args.checkpoint and packaged_model_path(DEFAULT_MODEL_NAME).exists():
        run_shipped_file(packaged_model_path(DEFAULT_MODEL_NAME), res, model, val, loops_list, args, save)
    run_kv_and_speed(res, model, cfg, val, loops_list, args, speed_models, save)
    run_weights(later, res, model, tok, cfg, calib, val, loops_list, args, {}, groups, save)
    save(final=True)
    print(tables(res, cfg))
    return 0


def run_weights(configs, res, model, tok, cfg, calib, val, loops_list, args, speed_models, groups, save):
    for name, spec in configs:
        t0 = time.perf_counter()
        report = None
        if spec is None:
            dtype = torch.float32 if name == "fp32" else torch.bfloat16
            m = copy.deepcopy(model).to(dtype)
            fbytes = float_file_bytes(m, tok)
        else:
            m, tensors, quant, report = quantize_copy(model, spec, calib if spec.method == "gptq" else None)
            fbytes = file_bytes(cfg, tok, tensors, quant, torch.float32)
        row = score(name, m, model, fbytes, val, loops_list, args, t0)
        if report and "core_hessian" in report:
            row["core_hessian"] = report["core_hessian"]
            res["hessian"].append({"name": name, **report["core_hessian"],
                                   "layers": [r for r in report["layers"] if "err_loop1_hessian" in r]})
        res["weights"].append(row)
        save()
        if name in ("bf16", "int8-rtn", f"int4-gptq-g{groups[0]}", f"int2-gptq-g{groups[0]}"):
            speed_models[name] = m
        else:
            del m
        gc.collect()


def score(name: str, m, model, fbytes: int, val, loops_list, args, t0: float) -> dict:
    """A weights-table row: perplexity per loop, KL from the fp32 `model` at the deepest loops, bytes."""
    ppl = ppl_row(m, val, loops_list, args.seq_len)
    kl = 0.0 if name == "fp32" else kl_divergence(model, m, val, max(loops_list), seq_len=args.seq_len,
                                              stride=args.seq_len - 128)["kl"]
    row = {"name": name, "ppl": ppl, "kl": kl, "file_bytes": fbytes,
           "weights_read_per_token": weights_read_per_token(m, model.cfg.default_loops),
           "seconds": round(time.perf_counter() - t0, 1)}
    log(f"{name}: ppl {' '.join(f'{v:.2f}' for v in ppl.values())}, KL {kl:.5f} ({row['seconds']} s)")
    return row


def run_shipped_file(path: Path, res, model, val, loops_list, args, save):
    """The packaged quantized model file itself (`make int4-model`), scored like the rows above."""
    t0 = time.perf_counter()
    res["weights"].append(score("shipped int4 file", load_model(path).model, model, path.stat().st_size, val,
                                loops_list, args, t0))
    save()


def run_kv_and_speed(res, model, cfg, val, loops_list, args, speed_models, save):
    # 2. KV formats (fp32 weights)
    for kv in KV_FORMATS:
        t0 = time.perf_counter()
        ppl = ppl_row(model, val, loops_list, args.seq_len, kv=kv)
        c = KVCache(cfg, max_positions=1, loops=cfg.default_loops, kv_format=kv, dtype=torch.float16)
        tps = decode_speed(model, 1, cfg.default_loops, args.steps, prompt_len=args.kv_context, kv_format=kv)
        res["kv"].append({"name": kv, "ppl": ppl, "bytes_per_token_per_slot": c.bytes_per_token_per_slot(),
                          "slots_at_default_loops": c.n_slots, "decode_tokens_per_s": tps,
                          "seconds": round(time.perf_counter() - t0, 1)})
        log(f"kv {kv}: ppl {' '.join(f'{v:.2f}' for v in ppl.values())}, {tps:.1f} tok/s")
        save()

    # 3. decode speed
    loops = cfg.default_loops
    for name, m in speed_models.items():
        for batch in (1, 8):
            tps = decode_speed(m, batch, loops, args.steps)
            res["speed"].append({"model": "shipped", "format": name.split("-g")[0], "batch": batch,
                                 "loops": loops, "tokens_per_s": tps})
            log(f"shipped {name} batch {batch}: {tps:.1f} tok/s")
        save()
    speed_models.clear()
    gc.collect()
    if not args.skip_407m:
        big_cfg = preset("tinyloop-407m")
        big = build_model(big_cfg, seed=0, dtype=torch.bfloat16)
        steps = max(4, args.steps // 4)
        rows = [("bf16", big)]
        for nm, spec in (("int8-rtn", QuantSpec(bits=8, group_size=None, method="rtn")),
                         ("int4-rtn", QuantSpec(bits=4, group_size=32, method="rtn")),
                         ("int2-rtn", QuantSpec(bits=2, group_size=32, method="rtn"))):
            rows.append((nm, None, spec))
        for item in rows:
            nm = item[0]
            if len(item) == 3:
                m, tensors, quant, _ = quantize_copy(big, item[2], None, out_dtype=torch.bfloat16)
                del tensors
            else:
                m = item[1]
            for batch in (1, 8):
                tps = decode_speed(m, batch, big_cfg.default_loops, steps)
                res["speed"].append({"model": "tinyloop-407m", "format": nm, "batch": batch,
                                     "loops": big_cfg.default_loops, "tokens_per_s": tps,
                                     "weights_read_per_token": weights_read_per_token(m, big_cfg.default_loops)})
                log(f"407m {nm} batch {batch}: {tps:.2f} tok/s")
            save()
            if m is not big:
                del m
            gc.collect()
        del big


# -- tables ------------------------------------------------------------------------------------
def tables(res: dict, cfg: ModelConfig) -> str:
    L = res["loops"]
    w = {r["name"]: r for r in res["weights"]}
    base = w["bf16"]["ppl"] if "bf16" in w else next(iter(w.values()))["ppl"]
    lines = [f"Measured {res['date']} by `benchmarks/quant.py` on {res['source']}: {res['val_tokens']} validation "
             f"tokens, windows of {res['seq_len']} (each token scored with >= 128 tokens of context after the first window), torch {res['machine']['torch']}, {res['machine']['cpu_threads']} "
             f"thread(s){' (while a training job shared the CPU)' if res['machine']['training_running'] else ''}; "
             f"{res['total_seconds']:.0f} s in all.", "",
             "### Weights: validation perplexity", "",
             f"KL = mean KL(fp32 || format) of the next-token distributions at loops {L[-1]}, over the same "
             "scored tokens (nats/token; lower is closer to the unquantized model). Unlike a perplexity "
             "difference it cannot favour a format by chance.", "",
             "| format | " + " | ".join(f"ppl loops {n}" for n in L) + f" | vs bf16 at loops {L[-1]} | "
             f"KL at loops {L[-1]} | file MiB | weights read / token MiB |",
             "|---|" + "---:|" * (len(L) + 4)]
    for r in res["weights"]:
        rel = r["ppl"][L[-1]] / base[L[-1]] - 1 if isinstance(next(iter(r["ppl"])), int) else \
            r["ppl"][str(L[-1])] / base[str(L[-1])] - 1
        ppl = r["ppl"]
        vals = [ppl.get(n, ppl.get(str(n))) for n in L]
        kl = f"{r['kl']:.2e}" if "kl" in r else "-"
        lines.append(f"| {r['name']} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {rel:+.1%} | {kl} | "
                     f"{r['file_bytes'] / 2**20:.1f} | {r['weights_read_per_token'] / 2**20:.2f} |")
    lines += ["", "### KV cache formats (fp32 weights): validation perplexity and bytes", "",
              "| KV format | " + " | ".join(f"ppl loops {n}" for n in L) + f" | vs fp16 at loops {L[-1]} | "
              "bytes / token / slot | vs 16-bit | bytes / token, all slots at default loops | "
              f"decode tok/s at {res.get('kv_context', '?')} tokens of context |",
              "|---|" + "---:|" * (len(L) + 5)]
    kv0 = res["kv"][0]["ppl"] if res["kv"] else {}
    fp16_bytes = res["kv_16bit_bytes_per_token_per_slot"]
    for r in res["kv"]:
        ppl = r["ppl"]
        vals = [ppl.get(n, ppl.get(str(n))) for n in L]
        last0 = kv0.get(L[-1], kv0.get(str(L[-1])))
        b = r["bytes_per_token_per_slot"]
        lines.append(f"| {r['name']} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {vals[-1] / last0 - 1:+.2%} | "
                     f"{b} | {b / fp16_bytes:.2f}x | {b * r['slots_at_default_loops']} | "
                     f"{r['decode_tokens_per_s']:.1f} |")
    lines += ["", "The fp16 row is the unquantized cache (stored in the model's float dtype, here fp32); its bytes "
              "column is a 16-bit cache's.", "",
              "### Decode speed (tokens/s, all rows of the batch)", "",
              "| model | format | batch 1 | batch 8 | weights read / token MiB |", "|---|---|---:|---:|---:|"]
    seen = {}
    for r in res["speed"]:
        seen.setdefault((r["model"], r["format"]), {})[r["batch"]] = r
    for (model, fmt), rows in seen.items():
        wr = next(iter(rows.values())).get("weights_read_per_token")
        if wr is None:
            wr = next((x["weights_read_per_token"] for x in res["weights"] if x["name"].startswith(fmt)), 0)
        b1, b8 = (f"{rows[b]['tokens_per_s']:.1f}" if b in rows else "-" for b in (1, 8))
        lines.append(f"| {model} | {fmt} | {b1} | {b8} | {wr / 2**20:.1f} |")
    if res["hessian"]:
        lines += ["", "### GPTQ on the shared core: Hessian over all loops vs loop 1 only, and vs RTN", "",
                  "Mean relative output error tr(dW H dW^T) / tr(W H W^T) of the core layers, scored on all "
                  "loops' inputs (lower is better); RTN = round-to-nearest at the same bits and group size.", "",
                  "| run | GPTQ, Hessian from all loops | GPTQ, from loop 1 only | ratio | RTN | RTN / GPTQ |",
                  "|---|---:|---:|---:|---:|---:|"]
        for h in res["hessian"]:
            rtn = h.get("mean_err_rtn")
            rtn_cols = (f"{rtn:.5f} | {rtn / max(h['mean_err_all_loops'], 1e-12):.2f}x" if rtn is not None
                        else "- | -")
            lines.append(f"| {h['name']} | {h['mean_err_all_loops']:.5f} | {h['mean_err_loop1']:.5f} | "
                         f"{h['mean_err_loop1'] / max(h['mean_err_all_loops'], 1e-12):.2f}x | {rtn_cols} |")
    try:
        lines += ["", bars(res)]
    except (KeyError, StopIteration, IndexError, ValueError, RuntimeError):
        lines += ["", "### Bars", "", "(this run stopped before every row the bars need was measured)"]
    if not res.get("complete"):
        lines += ["", "**Partial run**: the run was cut short; the rows above are all it measured."]
    return "\n".join(lines)


def bars(res: dict) -> str:
    L = res["loops"][-1]

    def p(rows, name):
        for x in rows:
            if x["name"] == name:
                return x["ppl"].get(L, x["ppl"].get(str(L)))
        raise KeyError(name)

    w, kv = res["weights"], res["kv"]
    names = {x["name"] for x in w}
    groups = sorted({int(x["name"].split("-g")[1]) for x in w if "-g" in x["name"]
                     if all(f"int{b}-{m}-g{x['name'].split('-g')[1]}" in names for b in (4, 2) for m in ("rtn", "gptq"))})
    g0 = groups[0]
    out = ["### Bars", ""]
    b = p(w, "bf16")
    best4 = min(p(w, f"int4-gptq-g{g}") for g in groups)
    out.append(f"- int4-gptq (g{g0}) within 5% of bf16 at loops {L}: {p(w, f'int4-gptq-g{g0}') / b - 1:+.1%} "
               f"({'met' if p(w, f'int4-gptq-g{g0}') <= 1.05 * b else 'NOT met'}; best group {best4 / b - 1:+.1%})")
    if "shipped int4 file" in names:
        sh = p(w, "shipped int4 file")
        out.append(f"- the shipped int4 file (the default model) within 5% of bf16 at loops {L}: {sh / b - 1:+.1%} "
                   f"({'met' if sh <= 1.05 * b else 'NOT met'})")
    kls = {x["name"]: x.get("kl") for x in w}
    for bits in (4, 2):
        wins = [(g, p(w, f"int{bits}-gptq-g{g}"), p(w, f"int{bits}-rtn-g{g}")) for g in groups]
        ok = all(gp < rp for _, gp, rp in wins)
        out.append(f"- GPTQ better than RTN at {bits} bits, by perplexity at loops {L}: "
                   + ", ".join(f"g{g} {gp:.2f} vs {rp:.2f}" for g, gp, rp in wins)
                   + f" ({'met' if ok else 'NOT met'})")
        kw = [(g, kls.get(f"int{bits}-gptq-g{g}"), kls.get(f"int{bits}-rtn-g{g}")) for g in groups]
        if all(a is not None and b is not None for _, a, b in kw):
            ok = all(a < b for _, a, b in kw)
            out.append(f"- GPTQ better than RTN at {bits} bits, by KL from fp32 at loops {L}: "
                       + ", ".join(f"g{g} {a:.2e} vs {b:.2e}" for g, a, b in kw)
                       + f" ({'met' if ok else 'NOT met'})")
    f = p(kv, "fp16")
    i8, i4, i4h = p(kv, "int8"), p(kv, "int4"), p(kv, "int4-h")
    out.append(f"- int8 KV within 1% of fp16: {i8 / f - 1:+.2%} ({'met' if i8 <= 1.01 * f else 'NOT met'})")
    out.append(f"- int4-h KV within 4% and better than int4: {i4h / f - 1:+.2%} vs int4 {i4 / f - 1:+.2%} "
               f"({'met' if i4h <= 1.04 * f and i4h < i4 else 'NOT met'})")
    kb = {r["name"]: r["bytes_per_token_per_slot"] for r in kv}
    ratio = kb["int4"] / res["kv_16bit_bytes_per_token_per_slot"]
    out.append(f"- int4 KV bytes per token <= 0.3x fp16: {ratio:.2f}x ({'met' if ratio <= 0.3 else 'NOT met'})")
    sp = {(r["model"], r["format"], r["batch"]): r["tokens_per_s"] for r in res["speed"]}
    if ("tinyloop-407m", "int4-rtn", 1) in sp:
        r = sp[("tinyloop-407m", "int4-rtn", 1)] / sp[("tinyloop-407m", "bf16", 1)]
        out.append(f"- tinyloop-407m int4 batch-1 decode >= 2x bf16: {r:.2f}x ({'met' if r >= 2 else 'NOT met'})")
    return "\n".join(out)


def write_doc(text: str) -> None:
    doc = DOC.read_text() if DOC.exists() else f"# Quantization\n\n{BEGIN}\n{END}\n"
    if BEGIN not in doc:
        doc += f"\n{BEGIN}\n{END}\n"
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


if __name__ == "__main__":
    sys.exit(main())
