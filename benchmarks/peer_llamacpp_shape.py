"""TinyLoop against llama.cpp at a real looped model's size (issues 25, 35): the Ouro-1.4B shape at loops 1, or
the Nanbeige4.2-3B shape against llama.cpp's own `nanbeige` architecture at its two loops.

Ouro: at loops 1 a looped model reads the bytes of a plain stack: Ouro-1.4B's 24 core layers once, its
embedding row and its head. This program writes a llama-architecture GGUF of that shape (24 layers of
dim 2048, 16 heads, ffn 5632, vocab 49152, untied F16 embedding and head; random Q4_0 blocks: decode
speed does not depend on the values) and runs it with `llama-cpp-python`; TinyLoop runs the int4 file
`benchmarks/real_shapes.py` builds of the same shape (random weights, RTN int4 g128, bf16 embedding and
head) at loops 1 and at loops 4 (its trained depth), both at their best thread count, in one run, with the
read bandwidth measured just before and just after each engine's runs (the ceiling: weight bytes a token
reads / the higher of the two readings; this host's bandwidth moves by tens of percent within minutes).

Nanbeige (`--shape nanbeige-3b`): a `nanbeige`-architecture GGUF (22 layers of 3072, 48 query / 8 key-value
heads of 128, ffn 10752, vocab 166,144, `nanbeige.num_loops` 2: llama.cpp runs the 22 layers twice, the final
norm after each loop) with random weights, in the formats of llama.cpp's own quantize: `--qtype Q4_0` (Q4_0
layers, a Q6_K head) against TinyLoop's int4 file (RTN int4 g128, an int8 head); `--qtype F16` against TinyLoop's
bf16 file of the shape. Both at 2 loops (and 1: `--loops 1,2`).

    .venv/bin/pip install gguf llama-cpp-python==0.3.36   (peers: never in the default install or CI)
    .venv/bin/python benchmarks/peer_llamacpp_shape.py [--shape ouro-1.4b|nanbeige-3b] [--qtype Q4_0|F16]
        [--loops 1,2] [--workdir DIR] [--gguf-dir DIR] [--threads 1,2] [--tokens 16] [--json PATH]

The GGUF's tokenizer is GPT-2's (its first 49152 tokens for Ouro's vocabulary; Nanbeige's 166,144 padded with
unused tokens): the prompt is ids.
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
from real_shapes import HEAD_BITS, SHAPES, run_shape  # noqa: E402

IDS = [5, 17, 42, 7, 99, 3, 11, 64]


def write_gguf(path: Path, hf: dict, qtype: str = "Q4_0", arch: str = "llama") -> int:
    """A llama stack of the shape's core layers with random weights (arch "nanbeige": looped num_loops times
    by llama.cpp, the head Q6_K under Q4_0 layers as llama.cpp's quantize makes it); returns the bytes one token
    reads (the layers once, the head, an embedding row neglected)."""
    import gguf

    d, L, F, V = hf["hidden_size"], hf["num_hidden_layers"], hf["intermediate_size"], hf["vocab_size"]
    H, Hkv = hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf.get("head_dim") or d // H
    quant = getattr(gguf.GGMLQuantizationType, qtype)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"{arch}-shape-{L}-layers")
    if arch == "nanbeige":
        w.add_uint32("nanbeige.num_loops", hf["num_loops"])
        w.add_key_length(hd)
        w.add_value_length(hd)
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
    types = [gguf.TokenType.NORMAL] * min(V, len(tokens)) + [gguf.TokenType.UNUSED] * max(0, V - len(tokens))
    tokens = tokens[:V] + [f"<|unused_{i}|>" for i in range(V - len(tokens))]
    keep = set(tokens[:V])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens[:V])
    w.add_token_types(types)
    w.add_token_merges([m for m in merges if "".join(m.split(" ")) in keep and all(p in keep for p in m.split(" "))])
    w.add_eos_token_id(0)
    rng = np.random.default_rng(0)
    nbytes = 0

    def blocks(n: int, k: int, per: int, size: int, scale_at: list[int]) -> np.ndarray:
        """Random quantized blocks written directly (numpy quantization of billions of weights takes minutes,
        and the speed does not depend on the values), their fp16 scales set to a small normal number: per
        weights a block, size bytes, the scales' byte offsets in it. One random stripe of rows is tiled
        down the matrix (generating 3 G random bytes would take longer than the run)."""
        stripe = rng.integers(0, 256, size=(min(n, 256), k // per, size), dtype=np.uint8)
        for at in scale_at:
            stripe[:, :, at:at + 2] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
        return np.tile(stripe, (n // stripe.shape[0] + 1, 1, 1))[:n].reshape(n, k // per * size)

    def matrix(name: str, n: int, k: int, kind: str = qtype, read: bool = True) -> None:
        """Q4_0: an fp16 scale, then 16 bytes of nibbles per 32 weights; Q6_K: per 256 weights 128 bytes of
        low bits, 64 of high bits, 16 int8 sub-block scales, an fp16 scale; F16: random normals. read: whether
        a token reads all of it (not the embedding: one row)."""
        nonlocal nbytes
        if kind == "F16":
            stripe = (rng.standard_normal((min(n, 256), k), dtype=np.float32) * 0.02).astype(np.float16)
            q = np.tile(stripe, (n // stripe.shape[0] + 1, 1))[:n]
            w.add_tensor(name, q)
        elif kind == "Q4_0":
            q = blocks(n, k, 32, 18, [0])
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        else:
            assert kind == "Q6_K"
            q = blocks(n, k, 256, 210, [208])
            q.reshape(n, k // 256, 210)[:, :, 192:208] = 8   # sub-block scales
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q6_K)
        nbytes += q.nbytes if read else 0

    matrix("token_embd.weight", V, d, "F16", read=False)
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
    nbytes *= hf.get("num_loops", 1) if arch == "nanbeige" else 1   # (the layers, read once a loop)
    w.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    if arch == "nanbeige":   # llama.cpp's quantize: a Q6_K head under Q4_0 layers
        matrix("output.weight", V, d, "Q6_K" if qtype == "Q4_0" else qtype)
    else:
        matrix("output.weight", V, d, "F16")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return nbytes


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
    ap.add_argument("--shape", default="ouro-1.4b", choices=[s for s in SHAPES if s.startswith(("ouro", "nanbeige"))])
    ap.add_argument("--qtype", default="Q4_0", choices=["Q4_0", "F16"],
                    help="llama.cpp's format; TinyLoop's int4 file against Q4_0, its bf16 file against F16")
    ap.add_argument("--loops", help="TinyLoop's depths (default: 1 and the trained depth)")
    ap.add_argument("--workdir", help="keep TinyLoop's file here (reused when present)")
    ap.add_argument("--gguf-dir", help="write the GGUF here and keep it (default: a temporary directory)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    family, hf = SHAPES[args.shape]
    arch = "nanbeige" if family == "nanbeige" else "llama"
    trained = hf.get("num_loops") or hf.get("total_ut_steps")
    loops = [int(x) for x in args.loops.split(",")] if args.loops else [1, trained]
    fmt = "int4" if args.qtype == "Q4_0" else "bf16"
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp())
    work.mkdir(parents=True, exist_ok=True)
    def bandwidth() -> float:
        torch.set_num_threads(max(threads))
        return measure_bandwidth()["best_GBps"]

    with tempfile.TemporaryDirectory() as tmp:
        gguf_path = Path(args.gguf_dir or tmp) / f"{args.shape}-{args.qtype.lower()}.gguf"
        t0 = time.perf_counter()
        if not gguf_path.exists() or not args.gguf_dir:
            llama_bytes = write_gguf(gguf_path, hf, args.qtype, arch)
            Path(str(gguf_path) + ".bytes").write_text(str(llama_bytes))
        llama_bytes = int(Path(str(gguf_path) + ".bytes").read_text())
        print(f"the GGUF ({gguf_path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
        bw0 = bandwidth()
        llama = {t: run_llama(gguf_path, args.tokens, t) for t in threads}
        bw1 = bandwidth()
    head = "a Q6_K head" if arch == "nanbeige" and args.qtype == "Q4_0" else f"{args.qtype} embedding and head"
    rows = [{"engine": f"llama.cpp {args.qtype} ({arch}, {hf['num_hidden_layers']} layers, {head})",
             "loops": trained if arch == "nanbeige" else 1,
             "tok_s": round(max(llama.values()), 2), "by_threads": llama, "token_GB": round(llama_bytes / 1e9, 3),
             "bandwidth_GBps": [round(bw0, 1), round(bw1, 1)]}]
    ours = ("TinyLoop int4 g128 (" + ("an int8 head" if args.shape in HEAD_BITS else "bf16 embedding and head") + ")"
            if fmt == "int4" else "TinyLoop bf16") + ", native"
    for n in loops:
        bw0 = bandwidth()
        r = run_shape(args.shape, args.tokens, work, threads, "native", n, fmt=fmt)
        bw1 = bandwidth()
        rows.append({"engine": ours, "loops": n, "tok_s": r["decode_tok_s"], "by_threads": r["decode_tok_s_by_threads"],
                     "token_GB": r["token_GB"], "bandwidth_GBps": [round(bw0, 1), round(bw1, 1)]})
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
        Path(args.json).write_text(json.dumps({"shape": args.shape, "qtype": args.qtype, "rows": rows,
                                               "tokens": args.tokens}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
