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

Dory (`--shape dory-4b`, issue 55: "decode at loops 1, 2 and 4 >= 1.2x llama.cpp on the same matrices unrolled"):
TinyLoop's int4 file of Dory1.0-4B's shape (`--tinyloop PATH`: `benchmarks/dory_4b.py`'s, random weights, RTN int4
g32, bf16 embedding and head; not rebuilt here) at each depth L of `--loops` (default 1,2,4) against llama.cpp on
one `llama`-architecture GGUF per depth holding the attention + MLP pairs a token passes through at that depth:
the input block's, L times the recurrent block's, the output block's. Dory's layers are single sublayers
(attention `S`/`*`, MLP `-`, by the file's `layer_pattern`); the release pattern alternates them, so its 16 / 40 / 16
sublayers are 8 / 20 / 8 attention + MLP pairs, one llama layer each: 8 + 20 L + 8 layers (36, 56, 96 at 1, 2, 4;
~2.9, ~3.9, ~5.8 GB). A llama layer: q 2560 -> 4096 (16 heads of 256: `llama.attention.key_length` /
`value_length` 256), k and v 2560 -> 1024 (4 KV heads), o 4096 -> 2560, gate and up 2560 -> 7168, down 7168 -> 2560,
random Q4_0 blocks; F16 untied embedding and head of 131,072 (as the Ouro shape's). Llama has no output-gate
projection: Dory's g (2560 -> 4096, one per attention sublayer) is in TinyLoop's file and not in the GGUF, so
llama.cpp reads fewer bytes a token (both sides' bytes a token are reported: llama.cpp's its Q4_0 layers and F16
head; TinyLoop's every block matrix once, the recurrent ones once a loop, and its head, from the native
executor's descriptors as `benchmarks/dory_4b_limits.py` counts them). nGPT's norms and scale vectors are
negligible bytes and not in the GGUF. Each engine at each thread count of `--threads`: three greedy requests of
`--tokens` (the first a warm-up), the median of the other two; the best thread count is the figure, the ratio
TinyLoop / llama.cpp. The GGUFs go to `--gguf-dir` (default: a temporary directory), written as a stream (a few
MB in memory whatever the size), and are removed at the end unless `--keep`; `--reuse-gguf` reuses those a
`--keep` run left there. The load average at the start and the end is in the JSON.

    .venv/bin/pip install gguf llama-cpp-python==0.3.36   (peers: never in the default install or CI)
    .venv/bin/python benchmarks/peer_llamacpp_shape.py [--shape ouro-1.4b|nanbeige-3b] [--qtype Q4_0|F16]
        [--loops 1,2] [--workdir DIR] [--gguf-dir DIR] [--threads 1,2] [--tokens 16] [--json PATH]
    PYTHONPATH=src .venv/bin/python benchmarks/peer_llamacpp_shape.py --shape dory-4b
        --tinyloop /tmp/dory4b/dory-4b-int4.tinyloop [--loops 1,2,4] [--gguf-dir DIR] [--keep] [--reuse-gguf]
        [--threads 1,2] [--tokens 16] [--json PATH]

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


class _Tiled:
    """A matrix that is one stripe of rows repeated down n rows, written to the file a stripe at a time (never
    built: the writer streams, one tensor's stripe in memory at a time). Duck-types what `GGUFWriter.
    write_tensor_data` uses of an array: `nbytes` and `tofile`."""

    def __init__(self, stripe: np.ndarray, n: int):
        self.stripe, self.n = np.ascontiguousarray(stripe), n
        self.nbytes = n * self.stripe[0].nbytes

    def tofile(self, f) -> None:
        full, rest = divmod(self.n, self.stripe.shape[0])
        for _ in range(full):
            self.stripe.tofile(f)
        if rest:
            self.stripe[:rest].tofile(f)


def write_gguf(path: Path, hf: dict, qtype: str = "Q4_0", arch: str = "llama") -> int:
    """A llama stack of the shape's core layers with random weights (arch "nanbeige": looped num_loops times
    by llama.cpp, the head Q6_K under Q4_0 layers as llama.cpp's quantize makes it); returns the bytes one token
    reads (the layers once, the head, an embedding row neglected). Streamed: the tensors are declared first, then
    generated and written one at a time (a stripe of rows each), so memory stays at a few MB whatever the size
    (the same bytes as building every tensor and writing them at the end)."""
    import gguf

    d, L, F, V = hf["hidden_size"], hf["num_hidden_layers"], hf["intermediate_size"], hf["vocab_size"]
    H, Hkv = hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf.get("head_dim") or d // H
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"{arch}-shape-{L}-layers")
    if arch == "nanbeige":
        w.add_uint32("nanbeige.num_loops", hf["num_loops"])
    if arch == "nanbeige" or hd != d // H:   # (llama: a head_dim other than hidden / heads, as Dory's 256)
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
    plan: list[tuple] = []   # (name, n, k, kind, read) of a matrix, or (name, d) of a norm, in file order
    LAYOUT = {"F16": (1, 2, []), "Q4_0": (32, 18, [0]), "Q6_K": (256, 210, [208])}   # weights, bytes, scale offsets

    def matrix(name: str, n: int, k: int, kind: str = qtype, read: bool = True) -> None:
        """Q4_0: an fp16 scale, then 16 bytes of nibbles per 32 weights; Q6_K: per 256 weights 128 bytes of
        low bits, 64 of high bits, 16 int8 sub-block scales, an fp16 scale; F16: random normals. read: whether
        a token reads all of it (not the embedding: one row)."""
        nonlocal nbytes
        per, size, _ = LAYOUT[kind]
        row = k * 2 if kind == "F16" else k // per * size
        if kind == "F16":
            w.add_tensor_info(name, (n, k), np.dtype(np.float16), n * row)
        else:
            w.add_tensor_info(name, (n, row), np.dtype(np.uint8), n * row,
                              raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
        plan.append((name, n, k, kind, read))
        nbytes += n * row if read else 0

    def norm(name: str) -> None:
        w.add_tensor_info(name, (d,), np.dtype(np.float32), d * 4)
        plan.append((name, d))

    def data(n: int, k: int, kind: str) -> _Tiled:
        """Random blocks written directly (numpy quantization of billions of weights takes minutes, and the
        speed does not depend on the values), their fp16 scales set to a small normal number. One random
        stripe of rows is tiled down the matrix (generating 3 G random bytes would take longer than the run)."""
        if kind == "F16":
            return _Tiled((rng.standard_normal((min(n, 256), k), dtype=np.float32) * 0.02).astype(np.float16), n)
        per, size, scale_at = LAYOUT[kind]
        stripe = rng.integers(0, 256, size=(min(n, 256), k // per, size), dtype=np.uint8)
        for at in scale_at:
            stripe[:, :, at:at + 2] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
        if kind == "Q6_K":
            stripe[:, :, 192:208] = 8   # sub-block scales
        return _Tiled(stripe.reshape(stripe.shape[0], k // per * size), n)

    matrix("token_embd.weight", V, d, "F16", read=False)
    for i in range(L):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", H * hd, d)
        matrix(f"blk.{i}.attn_k.weight", Hkv * hd, d)
        matrix(f"blk.{i}.attn_v.weight", Hkv * hd, d)
        matrix(f"blk.{i}.attn_output.weight", d, H * hd)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", F, d)
        matrix(f"blk.{i}.ffn_up.weight", F, d)
        matrix(f"blk.{i}.ffn_down.weight", d, F)
    nbytes *= hf.get("num_loops", 1) if arch == "nanbeige" else 1   # (the layers, read once a loop)
    norm("output_norm.weight")
    if arch == "nanbeige":   # llama.cpp's quantize: a Q6_K head under Q4_0 layers
        matrix("output.weight", V, d, "Q6_K" if qtype == "Q4_0" else qtype)
    else:
        matrix("output.weight", V, d, "F16")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for p in plan:
        w.write_tensor_data(np.ones(p[1], dtype=np.float32) if len(p) == 2 else data(*p[1:4]))
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


def dory_layout(cfg) -> dict:
    """Dory's blocks as a llama stack: each block's attention (`S`, `*`) and MLP (`-`) sublayers counted from the
    file's `layer_pattern`, one llama layer per attention + MLP pair (a block with unequal counts gets the larger
    count of layers, its lone sublayers' partners read extra; the release pattern alternates them one to one)."""
    pat = cfg.layer_pattern
    cuts = [0, cfg.n_prelude, cfg.n_prelude + cfg.n_core, cfg.n_prelude + cfg.n_core + cfg.n_coda]
    assert len(pat) == cuts[-1], (len(pat), cuts)
    blocks = {}
    for name, a, b in zip(("input", "recurrent", "output"), cuts, cuts[1:]):
        attn, mlp = sum(c in "S*" for c in pat[a:b]), pat[a:b].count("-")
        blocks[name] = {"sublayers": b - a, "attention": attn, "mlp": mlp, "llama_layers": max(attn, mlp),
                        "paired_one_to_one": attn == mlp}
    return blocks


def dory_hf(cfg, layers: int) -> dict:
    return dict(hidden_size=cfg.dim, num_hidden_layers=layers, intermediate_size=cfg.ffn_dim,
                vocab_size=cfg.vocab_size, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                head_dim=cfg.head_dim, rms_norm_eps=1e-6, rope_theta=10000.0)


def git_state() -> dict:
    """The checkout TinyLoop ran from: its commit and the files under src/ that differ from it (the working tree
    is what runs)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout   # noqa: E731
    try:
        return {"head": git("rev-parse", "HEAD").strip(),
                "src_changes": git("status", "--porcelain", "--", "src").splitlines()}
    except OSError:
        return {}


def tinyloop_rate(engine, loops: int, tokens: int, threads: int) -> float:
    """Greedy tokens after the first over the time they took (as `real_shapes.run_shape` counts them: a native
    call may yield several tokens), three requests, the first a warm-up, the median of the other two."""
    from tinyloop.engine import SamplingParams

    torch.set_num_threads(threads)
    engine.model.decode_threads = threads
    if engine.model.executor is not None:
        engine.model.executor.threads = threads
    rates = []
    for _ in range(3):
        first = last = None
        count = 0
        for ev in engine.stream(IDS, SamplingParams(max_tokens=tokens, ignore_eos=True, loops=loops, temperature=0.0)):
            if ev.token_ids:
                now = time.perf_counter()
                if first is None:
                    first, count = now, len(ev.token_ids) - 1
                else:
                    last, count = now, count + len(ev.token_ids)
        if last is None:
            raise SystemExit("TinyLoop yielded every token in one event: raise --tokens")
        rates.append(count / (last - first))
    return statistics.median(rates[1:])


def run_dory(args, threads: list[int]) -> int:
    """`--shape dory-4b`: TinyLoop's int4 file of Dory's 4B shape at each depth L of `--loops` against llama.cpp on
    a llama GGUF of the same matrices unrolled to that depth (see the module's docstring)."""
    import os
    import shutil

    import llama_cpp
    from dory_4b_limits import weight_bytes
    from hostinfo import host
    from tinyloop.engine import Engine
    from tinyloop.model.fast import executor_name

    if not args.tinyloop:
        raise SystemExit("--shape dory-4b needs --tinyloop PATH (benchmarks/dory_4b.py's int4 file)")
    loops = [int(x) for x in (args.loops or "1,2,4").split(",")]
    report: dict = {"shape": "dory-4b", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": host(),
                    "load_average_start": os.getloadavg(), "tokens": args.tokens, "threads": threads,
                    "tinyloop_file": str(args.tinyloop), "tinyloop_native_pack": os.environ.get("TINYLOOP_NATIVE_PACK"),
                    "llama_cpp_python": llama_cpp.__version__,
                    "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode(), "git": git_state()}
    gdir = Path(args.gguf_dir) if args.gguf_dir else Path(tempfile.mkdtemp(prefix="dory-gguf-"))
    gdir.mkdir(parents=True, exist_ok=True)
    report["gguf_dir"] = str(gdir)

    def bandwidth() -> float:
        torch.set_num_threads(max(threads))
        return round(measure_bandwidth()["best_GBps"], 1)

    t0 = time.perf_counter()
    engine = Engine.load(args.tinyloop, draft_exit=False, executor="native")
    cfg, ex = engine.config, engine.model.executor
    report["tinyloop_load_s"] = round(time.perf_counter() - t0, 1)
    if ex is not None:   # (a large model's int4 codes are packed in the background after the load: executor._pack)
        ex.packing_done()
        report["tinyloop_packed_after_s"] = round(time.perf_counter() - t0, 1)
    report["executor"] = executor_name(engine.model)
    if ex is None:
        raise SystemExit("the native executor did not load the file")
    blocks = dory_layout(cfg)
    pre, core, coda = (blocks[b]["llama_layers"] for b in ("input", "recurrent", "output"))
    every, core_descs = ex.linears("all"), ex.linears("core")
    block_b, core_b, head_b = (sum(weight_bytes(d) for d in every), sum(weight_bytes(d) for d in core_descs),
                               weight_bytes(ex.head))
    gates = [d for d in every if (d.n, d.k) == (cfg.n_heads * cfg.head_dim, cfg.dim)]
    attn_all = sum(b["attention"] for b in blocks.values())
    gate_b = weight_bytes(gates[0]) if len(gates) == attn_all else None   # (q is fused with k and v: one such shape)
    report["mapping"] = {
        "blocks": blocks,
        "llama_layers_at_depth": f"{pre} + L x {core} + {coda}",
        "shape": {"dim": cfg.dim, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
                  "ffn": cfg.ffn_dim, "vocab": cfg.vocab_size},
        "llama_layer": "attn_norm, q (dim -> heads x head_dim), k, v (dim -> kv_heads x head_dim), o, ffn_norm, "
                       "gate, up, down: Q4_0 random blocks; F16 untied embedding and head",
        "not_in_llama": "Dory's output gate g (dim -> heads x head_dim, one per attention sublayer): llama has no "
                        "such projection, so llama.cpp reads fewer bytes a token; nGPT's justnorms, alphas, sqk/"
                        "s_gate/suv scales and logit scale are vectors (negligible bytes) and not in the GGUF either",
        "tinyloop_gate_bytes_each": gate_b}
    print(f"TinyLoop: {report['executor']}, loaded in {report['tinyloop_load_s']} s; llama layers at depth L: "
          f"{pre} + L x {core} + {coda}; {json.dumps(blocks)}", file=sys.stderr, flush=True)

    rows = []
    for n in loops:
        layers = pre + n * core + coda
        path = gdir / f"dory-4b-unrolled-loops{n}-q4_0.gguf"
        side = Path(str(path) + ".bytes")
        t0 = time.perf_counter()
        if not (args.reuse_gguf and path.exists() and side.exists()):
            side.write_text(str(write_gguf(path, dory_hf(cfg, layers), "Q4_0", "llama")))
            how = "written"
        else:
            how = "reused"
        llama_bytes = int(side.read_text())
        print(f"loops {n}: GGUF of {layers} layers ({path.stat().st_size / 1e9:.2f} GB) {how} in "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        bw0 = bandwidth()
        llama = {t: round(run_llama(path, args.tokens, t), 3) for t in threads}
        bw1 = bandwidth()
        # TinyLoop at the most threads here, at fewer ones after every depth's (below): the native pool run at
        # fewer threads and then at more again was measured slower (Dory 4B, loops 1: 9.2 tok/s at 2 threads after
        # a 1-thread phase against 11.8 before it), a state no server is in (it sets its threads once)
        ours = {max(threads): round(tinyloop_rate(engine, n, args.tokens, max(threads)), 3)}
        bw2 = bandwidth()
        tl_bytes = block_b + (n - 1) * core_b + head_b
        gate_tok = None if gate_b is None else gate_b * (blocks["input"]["attention"] + n * blocks["recurrent"][
            "attention"] + blocks["output"]["attention"])
        row = {"loops": n, "llama_layers": layers, "gguf_bytes": path.stat().st_size, "gguf": how,
               "llama_tok_s_by_threads": llama, "llama_tok_s": max(llama.values()),
               "tinyloop_tok_s_by_threads": ours,
               "llama_bytes_a_token": llama_bytes, "tinyloop_bytes_a_token": tl_bytes,
               "tinyloop_gate_bytes_a_token": gate_tok,
               "bandwidth_GBps_before_llama_after_llama_after_tinyloop": [bw0, bw1, bw2]}
        rows.append(row)
        if not args.keep:
            path.unlink(missing_ok=True)
            side.unlink(missing_ok=True)
    for t in sorted(set(threads) - {max(threads)}, reverse=True):
        for row in rows:
            row["tinyloop_tok_s_by_threads"][t] = round(tinyloop_rate(engine, row["loops"], args.tokens, t), 3)
    for row in rows:
        row["tinyloop_tok_s_by_threads"] = dict(sorted(row["tinyloop_tok_s_by_threads"].items()))
        row["tinyloop_tok_s"] = max(row["tinyloop_tok_s_by_threads"].values())
        row["ratio"] = round(row["tinyloop_tok_s"] / row["llama_tok_s"], 3)
        row["llama_GB_s"] = round(row["llama_tok_s"] * row["llama_bytes_a_token"] / 1e9, 2)
        row["tinyloop_GB_s"] = round(row["tinyloop_tok_s"] * row["tinyloop_bytes_a_token"] / 1e9, 2)
        row["bar_1.2x_met"] = row["ratio"] >= 1.2
        print(json.dumps(row), file=sys.stderr, flush=True)
    del engine
    report["rows"] = rows
    report["load_average_end"] = os.getloadavg()
    if not args.keep and not args.gguf_dir:
        shutil.rmtree(gdir, ignore_errors=True)
    print(f"# dory-4b, {args.tokens} greedy tokens, best of threads {threads}; load average "
          f"{report['load_average_start'][0]:.2f} at the start, {report['load_average_end'][0]:.2f} at the end")
    print("| loops | llama layers | llama.cpp tok/s (by threads) | TinyLoop tok/s (by threads) | TinyLoop / llama.cpp "
          "| GB a token llama.cpp / TinyLoop (of which g) | GB/s llama.cpp / TinyLoop |")
    print("|---:|---:|---|---|---:|---|---|")
    for r in rows:
        by = lambda d: f"{max(d.values()):.2f} ({', '.join(f'{t}: {v:.2f}' for t, v in d.items())})"   # noqa: E731
        g = "" if r["tinyloop_gate_bytes_a_token"] is None else f" ({r['tinyloop_gate_bytes_a_token'] / 1e9:.3f})"
        print(f"| {r['loops']} | {r['llama_layers']} | {by(r['llama_tok_s_by_threads'])} | "
              f"{by(r['tinyloop_tok_s_by_threads'])} | {r['ratio']:.2f}x | {r['llama_bytes_a_token'] / 1e9:.3f} / "
              f"{r['tinyloop_bytes_a_token'] / 1e9:.3f}{g} | {r['llama_GB_s']} / {r['tinyloop_GB_s']} |")
    print("llama.cpp's layers have no output-gate projection (Dory's g): it reads fewer bytes a token than TinyLoop.")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="ouro-1.4b",
                    choices=[s for s in SHAPES if s.startswith(("ouro", "nanbeige"))] + ["dory-4b"])
    ap.add_argument("--qtype", default="Q4_0", choices=["Q4_0", "F16"],
                    help="llama.cpp's format; TinyLoop's int4 file against Q4_0, its bf16 file against F16")
    ap.add_argument("--loops", help="TinyLoop's depths (default: 1 and the trained depth; dory-4b: 1,2,4)")
    ap.add_argument("--workdir", help="keep TinyLoop's file here (reused when present)")
    ap.add_argument("--gguf-dir", help="write the GGUF here and keep it (default: a temporary directory); dory-4b: "
                    "kept only with --keep")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--json")
    ap.add_argument("--tinyloop", help="dory-4b: TinyLoop's int4 file of the shape (benchmarks/dory_4b.py writes it)")
    ap.add_argument("--keep", action="store_true", help="dory-4b: keep the GGUFs (else removed at the end)")
    ap.add_argument("--reuse-gguf", action="store_true",
                    help="dory-4b: reuse the GGUFs a --keep run left in --gguf-dir (else written anew)")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    if args.shape == "dory-4b":
        return run_dory(args, threads)
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
