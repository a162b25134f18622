"""Peak memory and time of `tinyloop convert` on a real model shape (random weights, Hugging Face layout).

Builds an Ouro-1.4B-shape snapshot (config.json, tokenizer, bf16 weights in shards of about --shard-gib
with model.safetensors.index.json) in --workdir if missing, then runs `tinyloop convert` on it in a child
process and reports its wall time and peak RSS (ru_maxrss of the child) against the largest shard.

    python benchmarks/convert_memory.py --workdir /tmp/ouro14 [--shard-gib 1.0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def build_snapshot(folder: Path, shard_gib: float) -> None:
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).parent))
    from real_shapes import SHAPES, small_tokenizer  # noqa: E402

    _, hf = SHAPES["ouro-1.4b"]
    folder.mkdir(parents=True, exist_ok=True)
    d, f, L, V = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], hf["vocab_size"]
    names = [("model.embed_tokens.weight", (V, d)), ("lm_head.weight", (V, d)), ("model.norm.weight", (d,)),
             ("model.early_exit_gate.weight", (1, d)), ("model.early_exit_gate.bias", (1,))]
    for i in range(L):
        p = f"model.layers.{i}."
        names += [(p + n, (d,)) for n in ("input_layernorm.weight", "input_layernorm_2.weight",
                                          "post_attention_layernorm.weight", "post_attention_layernorm_2.weight")]
        names += [(p + f"self_attn.{n}_proj.weight", (d, d)) for n in "qkvo"]
        names += [(p + "mlp.gate_proj.weight", (f, d)), (p + "mlp.up_proj.weight", (f, d)),
                  (p + "mlp.down_proj.weight", (d, f))]
    g = torch.Generator().manual_seed(0)
    shards, cur, size = [], {}, 0
    for name, shape in names:
        t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        cur[name] = t
        size += t.numel() * 2
        if size >= shard_gib * 2**30:
            shards.append(cur)
            cur, size = {}, 0
    if cur:
        shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    del shards, cur
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({**hf, "torch_dtype": "bfloat16"}))
    tok = small_tokenizer()
    (folder / "tokenizer.json").write_text(tok.json_text)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--shard-gib", type=float, default=1.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    snap = args.workdir / "ouro-1.4b-hf"
    if not (snap / "config.json").exists():
        build_snapshot(snap, args.shard_gib)
    largest = max(p.stat().st_size for p in snap.glob("*.safetensors")) / 2**30
    out = args.workdir / "ouro-1.4b-converted.tinyloop"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "tinyloop", "convert", str(snap), str(out), "--quiet"],
                       capture_output=True, text=True, env={**os.environ})
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(r.stderr)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    row = {"snapshot_gib": round(sum(p.stat().st_size for p in snap.glob("*.safetensors")) / 2**30, 2),
           "largest_shard_gib": round(largest, 2), "convert_s": round(wall, 1), "peak_rss_gib": round(peak, 2),
           "output_gib": round(out.stat().st_size / 2**30, 2)}
    print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps(row, indent=2) + "\n")
    out.unlink()


if __name__ == "__main__":
    main()
