"""TinyLoop against llama.cpp on the same model, in one run: the shipped looped model written *unrolled*.

The shipped model has no injection and no loop norm, so its forward is a plain stack of pre-norm llama
blocks: prelude, then the core blocks `loops` times, then the coda, the final norm and the tied head.
This program writes that stack to a GGUF file (`gguf` package: llama architecture, every loop's copy of
the core weights stored again, q/k rows permuted from the half-split RoPE layout TinyLoop uses to the
interleaved one llama.cpp computes, GPT-2 BPE tokenizer), runs it with `llama-cpp-python`, and runs
TinyLoop on the `.tinyloop` file, same prompt ids, greedy, at 1 and 2 threads. It prints decode tok/s
(after the first token) for each and whether the greedy tokens agree (a cross-check of both engines: they
should, up to fp16 rounding in near-ties).

Pairs: the fp16 file against GGUF F16; the int4 file (GPTQ g32 blocks, int8 head, fp16 embedding) against
GGUF Q4_0 and Q4_1 (the head in Q8_0, the embedding F16); TinyLoop's default self-speculation (fp16 file, draft exits, `mode="speculative"` with its default
knobs) and adaptive depth (`loops: "auto"`, default threshold) against llama.cpp's plain F16 decode. Each
TinyLoop row runs with the native executor and, as the baseline of the same run, with the PyTorch path
(`executor="torch"`). Neither peer package is in the default install or CI:

    .venv/bin/pip install gguf llama-cpp-python      # compiles llama.cpp once (minutes)
    .venv/bin/python benchmarks/peer_llamacpp.py [--tokens 64] [--loops 8] [--threads 1,2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

PROMPT = "The king said to his people that"
GPT2_DIR = Path(__file__).resolve().parents[1] / "src" / "tinyloop" / "assets" / "gpt2"


def gpt2_vocab() -> tuple[list[str], list[str]]:
    """(tokens in id order, merges) of the GPT-2 BPE, as llama.cpp's gpt2 tokenizer reads them."""
    enc = json.loads((GPT2_DIR / "encoder.json").read_text())
    tokens = [None] * len(enc)
    for tok, i in enc.items():
        tokens[i] = tok
    merges = [ln for ln in (GPT2_DIR / "vocab.bpe").read_text().splitlines()[1:] if ln.strip()]
    return tokens, merges


def permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """q/k projection rows from the half-split RoPE layout to llama.cpp's interleaved pairs."""
    out, inp = w.shape
    return w.reshape(n_head, 2, out // n_head // 2, inp).swapaxes(1, 2).reshape(out, inp)


def write_unrolled_gguf(model, path: Path, loops: int, qtype: str) -> Path:
    """The looped model as a plain llama stack: prelude, core x loops, coda. qtype: F16, Q4_0, Q4_1."""
    import gguf

    cfg = model.cfg
    if cfg.injection != "none" or cfg.loop_norm:
        raise SystemExit("only models without injection and loop norm unroll to a plain llama stack")
    blocks = list(model.prelude) + [b for _ in range(loops) for b in model.core] + list(model.coda)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"tinyloop-unrolled-{loops}")
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_block_count(len(blocks))
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    tokens, merges = gpt2_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.eos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    quant = {"F16": None, "Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q4_1": gguf.GGMLQuantizationType.Q4_1}[qtype]

    def matrix(name: str, t: torch.Tensor, rope_heads: int | None = None) -> None:
        a = t.detach().float().numpy()
        if rope_heads:
            a = permute_rope(a, rope_heads)
        if quant is None:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, quant), raw_dtype=quant)

    def vector(name: str, t: torch.Tensor) -> None:
        w.add_tensor(name, t.detach().float().numpy().astype(np.float32))

    w.add_tensor("token_embd.weight", model.embed.weight.detach().float().numpy().astype(np.float16))
    for i, blk in enumerate(blocks):
        a, m = blk.attn, blk.mlp
        vector(f"blk.{i}.attn_norm.weight", blk.attn_norm.weight)
        matrix(f"blk.{i}.attn_q.weight", a.wq.weight, cfg.n_heads)
        matrix(f"blk.{i}.attn_k.weight", a.wk.weight, cfg.n_kv_heads)
        matrix(f"blk.{i}.attn_v.weight", a.wv.weight)
        matrix(f"blk.{i}.attn_output.weight", a.wo.weight)
        vector(f"blk.{i}.ffn_norm.weight", blk.mlp_norm.weight)
        matrix(f"blk.{i}.ffn_gate.weight", m.w_gate.weight)
        matrix(f"blk.{i}.ffn_up.weight", m.w_up.weight)
        matrix(f"blk.{i}.ffn_down.weight", m.w_down.weight)
    vector("output_norm.weight", model.norm.weight)
    if quant is not None:   # as the int4 file's int8 head (make int4-model): the head in Q8_0, the embedding F16
        head = model.head_weight.detach().float().numpy()
        w.add_tensor("output.weight", gguf.quants.quantize(head, gguf.GGMLQuantizationType.Q8_0),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def run_llama(path: Path, ids: list[int], tokens: int, threads: int, repeats: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=len(ids) + tokens + 8, n_threads=threads, n_threads_batch=threads,
                n_batch=64, verbose=False)
    rates, out = [], []
    for _ in range(repeats + 1):  # the first run warms up
        llm.reset()
        out, stamps = [], []
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            stamps.append(time.perf_counter())
            out.append(int(tok))
            if len(out) == tokens:
                break
        rates.append((len(out) - 1) / (stamps[-1] - stamps[0]))
    return {"tok_s": statistics.median(rates[1:]), "tokens": out}


def run_tinyloop(engine, ids: list[int], tokens: int, loops: int, threads: int, repeats: int,
                 mode: str = "generate") -> dict:
    from tinyloop.engine import SamplingParams

    torch.set_num_threads(threads)
    engine.model.decode_threads = threads
    if engine.model.executor is not None:
        engine.model.executor.threads = threads
    params = SamplingParams(max_tokens=tokens, loops="auto" if mode == "auto" else loops, ignore_eos=True,
                            mode="generate" if mode == "auto" else mode)
    rates, out = [], []
    for _ in range(repeats + 1):
        stamps, out = [], []
        for ev in engine.stream(ids, params):
            if ev.token_ids:
                stamps.append(time.perf_counter())
                out += ev.token_ids
        rates.append((len(out) - 1) / (stamps[-1] - stamps[0]))
    return {"tok_s": statistics.median(rates[1:]), "tokens": out}


def tinyloop_rows(engines: dict, specs: dict, ids: list[int], args, threads: int) -> dict:
    """Every TinyLoop row at `threads`: the plain engines, then default speculation and loops auto per executor."""
    tl = {k: run_tinyloop(e, ids, args.tokens, args.loops, threads, args.repeats) for k, e in engines.items()}
    for ex, e in specs.items():
        tl[f"fp16 speculative (defaults) {ex}"] = run_tinyloop(e, ids, args.tokens, args.loops, threads,
                                                               args.repeats, mode="speculative")
        tl[f"fp16 loops auto {ex}"] = run_tinyloop(e, ids, args.tokens, args.loops, threads, args.repeats,
                                                   mode="auto")
    return tl


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--tinyloop-only", action="store_true",
                    help="only the TinyLoop rows (native against torch), without the peer packages")
    args = ap.parse_args()
    if not args.tinyloop_only:
        try:
            import gguf  # noqa: F401
            import llama_cpp  # noqa: F401
        except ImportError as exc:
            print(f"needs the peer packages: .venv/bin/pip install gguf llama-cpp-python ({exc})", file=sys.stderr)
            return 2
    from tinyloop.engine import Engine
    from tinyloop.model.fused import split_projections
    from tinyloop.modelfile.loader import load_model, resolve_model_path

    source = load_model(resolve_model_path("tinyloop-16m"), dtype=torch.float32).model
    split_projections(source)  # GGUF names q, k, v, gate and up apart (row views of the fused weights)
    engines, specs = {}, {}
    for ex in ("native", "torch"):
        engines[f"fp16 {ex}"] = Engine.load("tinyloop-16m", draft_exit=False, executor=ex)
        engines[f"int4 {ex}"] = Engine.load("tinyloop-16m-int4", draft_exit=False, executor=ex)
        specs[ex] = Engine.load("tinyloop-16m", executor=ex)  # draft exits on: the default speculative settings
    ids = engines["fp16 native"].encode_prompt(PROMPT)
    threads = [int(t) for t in args.threads.split(",")]
    rows = []
    if args.tinyloop_only:
        for t in threads:
            tl = tinyloop_rows(engines, specs, ids, args, t)
            for name in ("fp16", "int4", "fp16 speculative (defaults)", "fp16 loops auto"):
                a, b = tl[f"{name} native"], tl[f"{name} torch"]
                same = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
                rows.append({"threads": t, "tinyloop": name, "native_tok_s": round(a["tok_s"], 1),
                             "torch_tok_s": round(b["tok_s"], 1), "ratio": round(a["tok_s"] / b["tok_s"], 2),
                             "same_tokens": f"{same}/{len(a['tokens'])}"})
        print("| threads | TinyLoop | native tok/s | torch tok/s | native / torch | same greedy tokens |")
        print("|---|---|---:|---:|---:|---|")
        for r in rows:
            print(f"| {r['threads']} | {r['tinyloop']} | {r['native_tok_s']} | {r['torch_tok_s']} | {r['ratio']}x "
                  f"| {r['same_tokens']} |")
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "tokens": args.tokens, "loops": args.loops}, indent=1))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        ggufs = {q: write_unrolled_gguf(source, Path(tmp) / f"unrolled-{q}.gguf", args.loops, q)
                 for q in ("F16", "Q4_0", "Q4_1")}
        sizes = {q: os.path.getsize(p) for q, p in ggufs.items()}
        for t in threads:
            tl = tinyloop_rows(engines, specs, ids, args, t)
            lc = {q: run_llama(p, ids, args.tokens, t, args.repeats) for q, p in ggufs.items()}
            pairs = [(f"{name} {ex}", q) for ex in ("native", "torch")
                     for name, q in (("fp16", "F16"), ("int4", "Q4_0"), ("int4", "Q4_1"),
                                     ("fp16 speculative (defaults)", "F16"), ("fp16 loops auto", "F16"))]
            for tl_name, q in pairs:
                a, b = tl[tl_name], lc[q]
                agree = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
                first_diff = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
                rows.append({"threads": t, "tinyloop": tl_name, "llama_cpp": q, "tinyloop_tok_s": round(a["tok_s"], 1),
                             "llama_cpp_tok_s": round(b["tok_s"], 1), "ratio": round(a["tok_s"] / b["tok_s"], 3),
                             "greedy_agree": f"{agree}/{len(a['tokens'])}", "first_difference": first_diff,
                             "gguf_bytes": sizes[q]})
    print(f"# {PROMPT!r}, {len(ids)} prompt ids, {args.tokens} greedy tokens, loops {args.loops}, "
          f"median of {args.repeats} after a warm-up; decode tok/s after the first token")
    print("| threads | TinyLoop file | tok/s | llama.cpp GGUF (unrolled) | tok/s | ratio | greedy tokens agree |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['threads']} | {r['tinyloop']} | {r['tinyloop_tok_s']} | {r['llama_cpp']} "
              f"({r['gguf_bytes'] / 1e6:.1f} MB) | {r['llama_cpp_tok_s']} | {r['ratio']:.2f}x | {r['greedy_agree']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "tokens": args.tokens, "loops": args.loops}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
