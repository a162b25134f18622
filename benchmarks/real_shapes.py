"""Imported families at their real sizes on this CPU: load, memory, decode tok/s and bytes per token.

No checkpoint can be downloaded here, so each shape is built with random weights from the family's real
`config.json` values (docs/models.md), written as the `.tinyloop` file `tinyloop convert` would write
(bf16), quantized to int4 round-to-nearest (`tinyloop quantize --method rtn`: GPTQ needs the real weights
to mean anything) and served by `Engine.load` on the engine core. Reported per shape: file sizes, the
resident memory after loading, decode tok/s of one greedy request at the trained depth (the tokens after the
first over the time from the first to the last), the weight bytes one token reads, and that over the read bandwidth
measured in the same run (the ceiling).

    .venv/bin/python benchmarks/real_shapes.py [--shapes ouro-1.4b] [--tokens 16] [--threads 1,2] [--loops 1,4]
        [--executors native,torch] [--workdir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import measure_bandwidth  # noqa: E402

from tinyloop.engine import Engine, SamplingParams  # noqa: E402
from tinyloop.model import build_model, param_count  # noqa: E402
from tinyloop.modelfile.loader import write_model  # noqa: E402
from tinyloop.model.families import huginn, nanbeige, ouro, parcae  # noqa: E402
from tinyloop.tools.gptq import QuantSpec  # noqa: E402
from tinyloop.tools.quantize import quantize_file  # noqa: E402
from tinyloop.tokenizer import HFTokenizer  # noqa: E402

# the families' real config.json values (their Hugging Face repositories' config.json)
SHAPES = {
    "ouro-1.4b": ("ouro", dict(model_type="ouro", hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                               intermediate_size=5632, num_hidden_layers=24, total_ut_steps=4, vocab_size=49152,
                               max_position_embeddings=65536, rope_theta=1e6, rms_norm_eps=1e-6,
                               tie_word_embeddings=False)),
    "ouro-2.6b": ("ouro", dict(model_type="ouro", hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                               intermediate_size=5632, num_hidden_layers=48, total_ut_steps=4, vocab_size=49152,
                               max_position_embeddings=65536, rope_theta=1e6, rms_norm_eps=1e-6,
                               tie_word_embeddings=False)),
    "huginn-3.5b": ("huginn", dict(model_type="huginn_raven", n_embd=5280, n_heads=55, intermediate_size=17920,
                                   n_layers_in_prelude=2, n_layers_in_recurrent_block=4, n_layers_in_coda=2,
                                   mean_recurrence=32, padded_vocab_size=65536, block_size=4096, rope_base=50000,
                                   qk_bias=True, norm_eps=1e-6)),
    # Nanbeige4.2-3B (issue 35): 22 Llama layers looped twice, d 3072, 48 query / 8 key-value heads of 128, vocab
    # 166,144, rope_theta 7e7, untied head. Its intermediate size is not given anywhere here: 10,752 (3.5 x 3072)
    # is what the "llama.cpp's Q4_0 file reads ~3.96 GB a token with a Q6_K head" implies
    # (2 x 22 x 0.5625 B x (44.0 M + 3 x 3072 x F) + 0.82 B x 510 M = 3.96 GB gives F = 10,746)
    "nanbeige-3b": ("nanbeige", dict(model_type="nanbeige", hidden_size=3072, intermediate_size=10752,
                                     num_hidden_layers=22, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                                     vocab_size=166144, max_position_embeddings=65536, rope_theta=7e7,
                                     rms_norm_eps=1e-6, num_loops=2, tie_word_embeddings=False)),
    # Parcae-1.3B (issue 35): the reference's parcae_lm/configs/parcae/parcae-xlarge-1_3b.py (sandyresearch/parcae
    # at dee8363): 8 + 8 + 8 blocks of 1536, 12 heads, ReLU^2 MLP of 6144, 8 recurrences, vocab 32768, tied
    "parcae-1.3b": ("parcae", dict(n_embd=1536, num_attention_heads=12, num_key_value_heads=12, intermediate_size=6144,
                                   n_layers_in_prelude=8, n_layers_in_recurrent_block=8, n_layers_in_coda=8,
                                   mean_recurrence=8, mean_backprop_depth=4, vocab_size=32768, padding_multiple=64,
                                   block_size=2048, norm_eps=1e-5, qk_norm=True, prelude_norm=True,
                                   logit_softcap=None, injection_type="diagonal", state_init="like-init",
                                   init_strategy="scaled-zero", tie_embeddings=True,
                                   recurrent_embedding_dimension=1536,
                                   recurrent_intermediation_embedding_dimension=6144)),
}
CONFIG_OF = {"ouro": ouro.config, "huginn": huginn.huginn_config, "nanbeige": nanbeige.config, "parcae": parcae.config}
HEAD_BITS = {"nanbeige-3b": 8}   # (its 510 M-parameter head at 16 bits would read more than both loops' int4 layers)


def small_tokenizer() -> HFTokenizer:
    """A byte-level BPE (a few hundred tokens): the shapes are what is measured, not the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. " * 50], trainer)
    return HFTokenizer(tok.to_str(), eos_ids=[0], eos_token="<|endoftext|>")


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def module_bytes(mod: torch.nn.Module) -> int:
    """Weight bytes one pass through `mod` reads (quantized kernels' buffers, fp16 packs, float weights)."""
    total = 0
    for sub in mod.modules():
        if hasattr(sub, "weight_bytes"):          # QuantLinear
            total += sub.weight_bytes
        elif hasattr(sub, "weight_nbytes"):       # FP16Linear
            total += sub.weight_nbytes
        elif isinstance(sub, torch.nn.Linear):
            total += sub.weight.numel() * sub.weight.element_size()
    return total


def token_bytes(engine: Engine, loops: int | None = None) -> int:
    """Weight bytes one decode token reads: prelude and coda once, the core (and adapter) every loop, the
    head once (norms and the embedding row are negligible)."""
    m, loops = engine.model, loops or engine.config.default_loops
    core = sum(module_bytes(b) for b in m.core) + (module_bytes(m.adapter) if m.adapter is not None else 0)
    head = module_bytes(m.head_linear) if m.head_linear is not None else m.head_weight.numel() * m.head_weight.element_size()
    return sum(module_bytes(b) for b in [*m.prelude, *m.coda]) + loops * core + head


def run_shape(name: str, tokens: int, workdir: Path, threads: list[int], executor: str = "native",
              loops: int | None = None, fmt: str = "int4") -> dict:
    """fmt: "int4" (RTN g128, the shape's HEAD_BITS head) or "bf16" (the built file as it is)."""
    family, hf = SHAPES[name]
    tok = small_tokenizer()
    cfg = CONFIG_OF[family](hf, workdir, [0])
    path = workdir / f"{name}-{fmt}.tinyloop"   # (--workdir keeps it for the next run)
    t_write = t_quant = None
    if not path.exists():
        t0 = time.perf_counter()
        model = build_model(cfg, seed=0, dtype=torch.bfloat16)
        bf16 = write_model(workdir / f"{name}.tinyloop" if fmt == "int4" else path, model, tokenizer=tok)
        del model
        gc.collect()
        t_write = round(time.perf_counter() - t0, 1)
    if fmt == "int4" and t_write is not None:
        t0 = time.perf_counter()
        quantize_file(bf16, path, QuantSpec(bits=4, group_size=128, method="rtn", compare_loop1=False),
                      progress=False, head_bits=HEAD_BITS.get(name))
        t_quant = round(time.perf_counter() - t0, 1)
        os.remove(bf16)
        gc.collect()
    rss0 = rss_gib()
    t0 = time.perf_counter()
    engine = Engine.load(path, draft_exit=False, executor=executor)
    t_load = time.perf_counter() - t0
    if engine.model.executor is not None:   # (a large model's int4 codes are packed in the background after the load)
        engine.model.executor.packing_done()
    rss1 = rss_gib()
    decode = {}
    loops = loops or cfg.default_loops
    for n in threads:
        torch.set_num_threads(n)
        engine.model.decode_threads = n
        if engine.model.executor is not None:
            engine.model.executor.threads = n
        # tokens after the first over the time they took: a lone request makes several tokens a native call
        # (docs/decode.md), so its events come in bursts and the gaps between them say nothing on their own
        first = last = None
        count = 0
        for ev in engine.stream([5, 17, 42, 7, 99, 3, 11, 64],
                                SamplingParams(max_tokens=tokens, ignore_eos=True, loops=loops)):
            if ev.token_ids:
                now = time.perf_counter()
                if first is None:
                    first, count = now, len(ev.token_ids) - 1
                else:
                    last, count = now, count + len(ev.token_ids)
        decode[n] = round(count / (last - first), 2)
    nbytes = token_bytes(engine, loops)
    del engine
    gc.collect()
    return {"shape": name, "executor": executor, "params": param_count(cfg), "loops": loops,
            "format": fmt, "int4_file_GiB" if fmt == "int4" else "file_GiB": round(path.stat().st_size / 2**30, 2), "rss_after_load_GiB": round(rss1, 2),
            "rss_before_load_GiB": round(rss0, 2), "build_write_s": t_write, "quantize_s": t_quant,
            "load_s": round(t_load, 1), "decode_tok_s_by_threads": decode, "decode_tok_s": max(decode.values()),
            "token_GB": round(nbytes / 1e9, 3),
            "peak_rss_GiB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="ouro-1.4b", help=f"comma-separated: {', '.join(SHAPES)}")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", default="1,2", help="decode thread counts to time")
    ap.add_argument("--executors", default="native,torch", help="decode executors to time (docs/decode.md)")
    ap.add_argument("--loops", default="", help="comma-separated depths (default: the family's trained depth)")
    ap.add_argument("--workdir", help="keep the built int4 files here (reused when present); default: a temp dir")
    ap.add_argument("--json")
    args = ap.parse_args()
    bw = measure_bandwidth()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir) if args.workdir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in args.shapes.split(","):
            for loops in [int(x) for x in args.loops.split(",") if x] or [None]:
                for ex in args.executors.split(","):
                    r = run_shape(name, args.tokens, work, [int(t) for t in args.threads.split(",")], ex, loops)
                    r["ceiling_tok_s"] = round(bw["best_GBps"] / r["token_GB"], 2)
                    r["fraction_of_ceiling"] = round(r["decode_tok_s"] / r["ceiling_tok_s"], 2)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                    gc.collect()
    print(f"# read bandwidth {bw['best_GBps']:.1f} GB/s (best of 7, {torch.get_num_threads()} threads)")
    print("| shape | executor | params | loops | int4 file GiB | RSS after load GiB | decode tok/s by threads | "
          "GB/token | ceiling tok/s | best / ceiling |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        by = ", ".join(f"{n}: {v}" for n, v in r["decode_tok_s_by_threads"].items())
        print(f"| {r['shape']} | {r['executor']} | {r['params'] / 1e9:.2f}B | {r['loops']} | {r['int4_file_GiB']} | "
              f"{r['rss_after_load_GiB']} | {by} | {r['token_GB']} | {r['ceiling_tok_s']} | "
              f"{r['fraction_of_ceiling']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"bandwidth": bw, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
