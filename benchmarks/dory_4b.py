"""Dory at its release shape (issue 55's "4B shape" bars): a random checkpoint in the real layout, converted,
quantized to int4 and served, each step's peak memory and time measured.

The shape is the issue's: 16 input / 40 recurrent / 16 output sublayers, hidden 2560, 16 query and 4 KV heads of
256 (queries and the output gate 4096 wide, wider than the hidden size), MLP 7168, vocabulary 131,072, a 4,096-token
sliding window, attention and MLP sublayers alternating (the attention ones `S`, `S`, `*` in turn), both RoPE
profiles, `per_loop` KV. The weights are random bf16 (std 0.02; scale vectors around it), written as Hugging Face
shards of at most `--shard-gib`, with the tokenizer of the tests' tiny checkpoint (its ids are a subset of the
vocabulary). Nothing here is trained: the figures are memory, time and decode speed, not quality.

Steps, each in its own process so that its peak resident memory (`ru_maxrss` of the child) is its own:

1. `tinyloop convert SNAPSHOT dory-4b.tinyloop` (bf16 -> fp16); bar: peak <= the largest shard + 1.5 GiB.
2. `tinyloop quantize dory-4b.tinyloop dory-4b-int4.tinyloop --method rtn`; the same bar.
3. `tinyloop serve --model dory-4b-int4.tinyloop`: seconds from the process's start to `/health` 200; bar <= 5 s.
4. Decode tok/s at loops 1, 2 and 4 on the int4 file in process (`Engine`, greedy, `--tokens` after the first;
   one 4-token request first, so that the weights' first reads are not timed), with the executor the engine picks
   (`executor` in the output says which).

    PYTHONPATH=src .venv/bin/python benchmarks/dory_4b.py --workdir /tmp/dory4b [--keep] [--skip-decode]
        [--reuse] [--json benchmarks/results/dory_4b.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from hostinfo import host  # (benchmarks/)

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "tests" / "fixtures" / "reference" / "nanbeige-tiny"
STD = 0.02
D, NH, NK, HD, FF, VOCAB, WINDOW = 2560, 16, 4, 256, 7168, 131_072, 4096
COUNTS = (16, 40, 16)
GIB = 2**30


def pattern(n: int) -> str:
    attn = "SS*"
    return "".join("-" if i % 2 else attn[(i // 2) % 3] for i in range(n))


def hf_config() -> dict:
    pat = "".join(pattern(c) for c in COUNTS)
    return {"architectures": ["DoryForCausalLM"], "model_type": "dory", "dory_format_version": 1,
            "vocab_size": VOCAB, "hidden_size": D, "num_hidden_layers": len(pat), "intermediate_size": FF,
            "num_attention_heads": NH, "num_key_value_heads": NK, "attention_head_dim": HD, "head_dim": HD,
            "max_position_embeddings": 32768, "tie_word_embeddings": False, "hybrid_layer_pattern": pat,
            "swa_window_size": WINDOW, "swa_num_attention_heads": None, "swa_num_key_value_heads": None,
            "swa_head_dim": None, "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rope_theta_2": 500000.0,
            "partial_rotary_factor_2": 0.5, "rope_profile_layers": [2 if c == "S" else 1 for c in pat],
            "no_rope_layers": [0] * len(pat), "ngpt": True, "fngpt": True, "init_method_std": STD,
            "ngpt_alpha_init": 0.05, "ngpt_enable_final_norm": False, "attention_output_gate": True,
            "attention_output_gate_logit_scale_init": None, "mlp_hidden_act": "silu", "mlp_bias": False,
            "attention_bias": False, "n_input_layers": COUNTS[0], "n_recurrent_layers": COUNTS[1],
            "n_output_layers": COUNTS[2], "n_recurrent_loops": 4, "recurrent_kv_cache_mode": "per_loop",
            "initial_state": "input_copy", "input_transform": "residual", "output_transform": "replace",
            "mixer_type": None, "eos_token_id": 2, "torch_dtype": "bfloat16"}


def tensors(cfg: dict):
    """(name, shape, kind) of every tensor, in file order; kind "mat" or "vec" (a scale vector)."""
    yield "backbone.embeddings.weight", (VOCAB, D), "mat"
    for i, c in enumerate(cfg["hybrid_layer_pattern"]):
        p = f"backbone.layers.{i}."
        if c == "-":
            yield p + "mlp_alpha", (D,), "vec"
            yield p + "mixer.gate_proj.weight", (FF, D), "mat"
            yield p + "mixer.up_proj.weight", (FF, D), "mat"
            yield p + "mixer.down_proj.weight", (D, FF), "mat"
            yield p + "mixer.suv_gate", (FF,), "vec"
            yield p + "mixer.suv_up", (FF,), "vec"
        else:
            yield p + "attn_alpha", (D,), "vec"
            for role, rows in (("q", NH * HD), ("k", NK * HD), ("v", NK * HD), ("g", NH * HD)):
                yield p + f"mixer.{role}_proj.weight", (rows, D), "mat"
            yield p + "mixer.o_proj.weight", (D, NH * HD), "mat"
            yield p + "mixer.sqk", (NH * HD,), "vec"
            yield p + "mixer.s_gate", (NH * HD,), "vec"
    yield "lm_head.weight", (VOCAB, D), "mat"
    yield "lm_head.logit_scale", (VOCAB,), "vec"


def write_snapshot(path: Path, shard_gib: float) -> dict:
    """The checkpoint as shards of at most `shard_gib` (one shard's tensors in memory at a time)."""
    cfg = hf_config()
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, weight_map, params, largest = 0, {}, 0, 0
    files: list[str] = []

    def flush():
        nonlocal size, largest
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shards[-1], str(path / name), metadata={"format": "pt"})
        largest = max(largest, (path / name).stat().st_size)
        for k in shards[-1]:
            weight_map[k] = name
        files.append(name)
        shards[-1] = {}
        size = 0

    for name, shape, kind in tensors(cfg):
        if kind == "mat":
            t = torch.randn(shape, generator=gen).mul_(STD).to(torch.bfloat16)
        else:
            t = torch.empty(shape).uniform_(0.7 * STD, 1.3 * STD, generator=gen).to(torch.bfloat16)
        nbytes = t.numel() * 2
        if size and size + nbytes > shard_gib * GIB:
            flush()
        shards[-1][name] = t
        size += nbytes
        params += t.numel()
    flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": params * 2},
                                                                     "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        shutil.copy(TOKENIZER / name, path / name)
    return {"params": params, "shards": len(files), "largest_shard_bytes": largest}


def peak_of(cmd: list[str]) -> dict:
    """Run one step in a fresh process: its seconds and its peak resident memory (the kernel's high-water mark,
    VmHWM, read every 50 ms while it runs)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
        except OSError:
            pass
        time.sleep(0.05)
    out = proc.stdout.read()
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out[-3000:]}")
    return {"seconds": round(seconds, 1), "peak_rss_bytes": peak, "tail": out.strip().splitlines()[-2:]}


def serve_start(model: Path) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import httpx

    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tinyloop", "serve", "--model", str(model), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.TransportError:
                pass
            if time.perf_counter() - t0 > 600:
                raise SystemExit("serve never became healthy in 600 s")
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)


def decode(model: Path, loops: list[int], tokens: int) -> dict:
    from tinyloop.engine import Engine, SamplingParams
    from tinyloop.model.fast import executor_name

    eng = Engine.load(str(model))
    out = {"executor": executor_name(eng.model)}
    prompt = list(range(10, 42))
    eng.generate(prompt, SamplingParams(max_tokens=4, loops=max(loops), temperature=0.0, ignore_eos=True))  # warm
    for k in loops:
        params = SamplingParams(max_tokens=tokens + 1, loops=k, temperature=0.0, ignore_eos=True)
        st = eng.generate(prompt, params).stats
        first = st["time_to_first_token_ms"] / 1000
        tok_s = (st["completion_tokens"] - 1) / (st["wall_ms"] / 1000 - first)
        out[f"loops_{k}"] = {"tok_s": round(tok_s, 3), "first_token_s": round(first, 2)}
        print(f"decode loops {k}: {tok_s:.2f} tok/s after the first token ({first:.1f} s)", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--shard-gib", type=float, default=4.0)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the files (else removed at the end)")
    ap.add_argument("--reuse", action="store_true", help="files kept by an earlier --keep run: only serve and decode")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    w = args.workdir
    w.mkdir(parents=True, exist_ok=True)
    snap, fp16, int4 = w / "dory-4b", w / "dory-4b.tinyloop", w / "dory-4b-int4.tinyloop"
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": host(),
                    "load_average_start": os.getloadavg()}
    t0 = time.perf_counter()
    if not (snap / "model.safetensors.index.json").exists():
        report["snapshot"] = write_snapshot(snap, args.shard_gib)
    else:
        idx = json.loads((snap / "model.safetensors.index.json").read_text())
        files = sorted(set(idx["weight_map"].values()))
        report["snapshot"] = {"params": idx["metadata"]["total_size"] // 2, "shards": len(files),
                              "largest_shard_bytes": max((snap / f).stat().st_size for f in files)}
    report["snapshot"]["seconds"] = round(time.perf_counter() - t0, 1)
    largest = report["snapshot"]["largest_shard_bytes"]
    print(f"snapshot: {report['snapshot']['params'] / 1e9:.2f} B params, {report['snapshot']['shards']} shards, "
          f"largest {largest / GIB:.2f} GiB", flush=True)
    tl = [sys.executable, "-m", "tinyloop"]
    if not (args.reuse and fp16.exists() and int4.exists()):
        report["convert"] = peak_of(tl + ["convert", str(snap), str(fp16)])
        report["quantize"] = peak_of(tl + ["quantize", str(fp16), str(int4), "--method", "rtn"])
        for step in ("convert", "quantize"):
            r = report[step]
            r["bar_bytes"] = largest + int(1.5 * GIB)
            r["met"] = r["peak_rss_bytes"] <= r["bar_bytes"]
            print(f"{step}: {r['seconds']} s, peak RSS {r['peak_rss_bytes'] / GIB:.2f} GiB (bar "
                  f"{r['bar_bytes'] / GIB:.2f}: {'met' if r['met'] else 'NOT met'})", flush=True)
    report["files"] = {"fp16_bytes": fp16.stat().st_size, "int4_bytes": int4.stat().st_size}
    starts = [serve_start(int4) for _ in range(3)]   # the first reads the file from disk, the others from the page cache
    report["serve_start_s"] = [round(s, 2) for s in starts]
    print(f"serve --model int4: healthy after {', '.join(f'{s:.2f}' for s in starts)} s (bar 5 s)", flush=True)
    if not args.skip_decode:
        report["decode_int4"] = decode(int4, [1, 2, 4], args.tokens)
    report["load_average_end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if not args.keep:
        shutil.rmtree(snap, ignore_errors=True)
        fp16.unlink(missing_ok=True)
        int4.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
