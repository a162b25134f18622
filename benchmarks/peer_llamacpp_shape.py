"""TinyLoop against llama.cpp at a real looped model's size: the Ouro-1.4B shape, int4, loops 1 (issue 25).

At loops 1 a looped model reads the bytes of a plain stack: Ouro-1.4B's 24 core layers once, its
embedding row and its head. This program writes a llama-architecture GGUF of that shape (24 layers of
dim 2048, 16 heads, ffn 5632, vocab 49152, untied F16 embedding and head; random Q4_0 blocks: decode
speed does not depend on the values) and runs it with `llama-cpp-python`; TinyLoop runs the int4 file
`benchmarks/real_shapes.py` builds of the same shape (random weights, RTN int4 g128, bf16 embedding and
head) at loops 1 and at loops 4 (its trained depth), both at their best thread count, in one run, with the
read bandwidth measured just before and just after each engine's runs (the ceiling: weight bytes a token
reads / the higher of the two readings; this host's bandwidth moves by tens of percent within minutes).

    .venv/bin/pip install gguf llama-cpp-python
    .venv/bin/python benchmarks/peer_llamacpp_shape.py [--workdir DIR] [--threads 1,2] [--tokens 16] [--json PATH]

The GGUF's tokenizer is GPT-2's first 49152 tokens (with the merges among them): the prompt is ids.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import measure_bandwidth  # noqa: E402
from peer_llamacpp import gpt2_vocab  # noqa: E402
from real_shapes import SHAPES, run_shape  # noqa: E402

IDS = [5, 17, 42, 7, 99, 3, 11, 64]


def write_gguf(path: Path, hf: dict, qtype: str = "Q4_0") -> int:
    """A llama stack of the shape's core layers with random weights; returns the bytes one token reads."""
    import gguf

    d, L, F, V = hf["hidden_size"], hf["num_hidden_layers"], hf["intermediate_size"], hf["vocab_size"]
    H, Hkv = hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = d // H
    quant = getattr(gguf.GGMLQuantizationType, qtype)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"ouro-shape-{L}-layers")
    w.add_context_length(4096)
    w.add_embedding_length(d)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(hf["rope_theta"])
    tokens, merges = gpt2_vocab()
    keep = set(tokens[:V])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens[:V])
    w.add_token_types([gguf.TokenType.NORMAL] * V)
    w.add_token_merges([m for m in merges if "".join(m.split(" ")) in keep and all(p in keep for p in m.split(" "))])
    w.add_eos_token_id(0)
    rng = np.random.default_rng(0)
    nbytes = 0

    def matrix(name: str, n: int, k: int) -> None:
        """Random Q4_0 blocks written directly (an fp16 scale, then 16 bytes of nibbles per 32 weights):
        numpy quantization of 1.2 G weights takes minutes, and the speed does not depend on the values."""
        nonlocal nbytes
        assert qtype == "Q4_0"
        q = rng.integers(0, 256, size=(n, k // 32, 18), dtype=np.uint8)
        q[:, :, :2] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
        q = q.reshape(n, k // 32 * 18)
        w.add_tensor(name, q, raw_dtype=quant)
        nbytes += q.nbytes

    def f16(name: str, n: int, k: int) -> None:
        w.add_tensor(name, (rng.standard_normal((n, k), dtype=np.float32) * 0.02).astype(np.float16))

    f16("token_embd.weight", V, d)
    for i in range(L):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, dtype=np.float32))
        matrix(f"blk.{i}.attn_q.weight", H * hd, d)
        matrix(f"blk.{i}.attn_k.weight", Hkv * hd, d)
        matrix(f"blk.{i}.attn_v.weight", Hkv * hd, d)
        matrix(f"blk.{i}.attn_output.weight", d, H * hd)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, dtype=np.float32))
        matrix(f"blk.{i}.ffn_gate.weight", F, d)
        matrix(f"blk.{i}.ffn_up.weight", F, d)
        matrix(f"blk.{i}.ffn_down.weight", d, F)
    w.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    f16("output.weight", V, d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return nbytes + V * d * 2


def run_llama(path: Path, tokens: int, threads: int) -> float:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=64, n_threads=threads, n_threads_batch=threads, verbose=False)
    rates = []
    for _ in range(3):   # the first warms up
        llm.reset()
        stamps = []
        for _tok in llm.generate(IDS, temp=0.0, top_k=1, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == tokens:
                break
        rates.append(1 / statistics.median([b - a for a, b in zip(stamps, stamps[1:])]))
    del llm
    return statistics.median(rates[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="ouro-1.4b", choices=[s for s in SHAPES if s.startswith("ouro")])
    ap.add_argument("--workdir", help="keep the TinyLoop int4 file here (reused when present)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    _, hf = SHAPES[args.shape]
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp())
    work.mkdir(parents=True, exist_ok=True)
    def bandwidth() -> float:
        torch.set_num_threads(max(threads))
        return measure_bandwidth()["best_GBps"]

    with tempfile.TemporaryDirectory() as tmp:
        gguf_path = Path(tmp) / "shape-q4_0.gguf"
        t0 = time.perf_counter()
        llama_bytes = write_gguf(gguf_path, hf)
        print(f"wrote the GGUF ({gguf_path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
        bw0 = bandwidth()
        llama = {t: run_llama(gguf_path, args.tokens, t) for t in threads}
        bw1 = bandwidth()
    rows = [{"engine": "llama.cpp Q4_0 (24 layers, F16 embedding and head)", "loops": 1,
             "tok_s": round(max(llama.values()), 2), "by_threads": llama, "token_GB": round(llama_bytes / 1e9, 3),
             "bandwidth_GBps": [round(bw0, 1), round(bw1, 1)]}]
    for loops in (1, hf["total_ut_steps"]):
        bw0 = bandwidth()
        r = run_shape(args.shape, args.tokens, work, threads, "native", loops)
        bw1 = bandwidth()
        rows.append({"engine": "TinyLoop int4 g128 (bf16 embedding and head), native", "loops": loops,
                     "tok_s": r["decode_tok_s"], "by_threads": r["decode_tok_s_by_threads"], "token_GB": r["token_GB"],
                     "bandwidth_GBps": [round(bw0, 1), round(bw1, 1)]})
    print(f"# {args.shape}, {args.tokens} greedy tokens, best of threads {threads}; the ceiling of each row: the higher "
          "of two read-bandwidth readings (one fp32 sum over 1 GiB, best of 7) taken just before and just after it")
    print("| engine | loops | tok/s | GB a token | GB/s before / after | of the ceiling | vs llama.cpp |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        r["of_ceiling"] = round(r["tok_s"] * r["token_GB"] / max(r["bandwidth_GBps"]), 2)
        print(f"| {r['engine']} | {r['loops']} | {r['tok_s']:.2f} | {r['token_GB']:.3f} | "
              f"{r['bandwidth_GBps'][0]:.1f} / {r['bandwidth_GBps'][1]:.1f} | {r['of_ceiling']:.2f} | "
              f"{r['tok_s'] / rows[0]['tok_s']:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "tokens": args.tokens}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
