"""A quantized LM head: its perplexity cost and its decode speed on the shipped model (issue 25).

The shipped int4 file's GPTQ g32 blocks with three heads: the fp16 head (the tied embedding), and the head
quantized by round-to-nearest as `tinyloop quantize --head-bits` does (here applied to the shipped file's
own tensors so that the blocks stay the same): int8 per channel (what `make int4-model` ships) and int4 in
groups of 32. Each file is
scored (perplexity at loops 8 on the held-out 1% of each corpus file, as benchmarks/quant.py) and decoded
greedily through `Engine.load` with the executor in use (tok/s, files alternating in each round).

    .venv/bin/python benchmarks/quant_head.py --corpus data/corpus --json benchmarks/results/quant_head.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tinyloop.engine import Engine, SamplingParams
from tinyloop.modelfile.loader import load_model, map_tensors, write_model
from tinyloop.modelfile.header import read_header, resolve_model_path
from tinyloop.quant.formats import quantize_head
from tinyloop.tools.evaluate import perplexity
from tinyloop.train.data import read_text, split_text

PROMPT = "The old man looked at the sea and said"


def validation_tokens(tok, corpus: Path, per_file: int) -> list[int]:
    ids: list[int] = []
    for f in sorted(corpus.glob("*.txt.gz")) + sorted(corpus.glob("*.txt")):
        _, val = split_text(read_text(f), 0.01)
        ids += tok.encode(val[: per_file * 12])[:per_file] + [tok.eos_id]
    return ids


def with_head(src: Path, dst: Path, bits: int | None) -> Path:
    """`src` (a quantized file) rewritten with its LM head quantized to `bits` (None: the float head alone),
    its blocks untouched."""
    header, index = read_header(src)
    tensors = map_tensors(src, index)
    tensors.pop(header["tokenizer"]["tensor"])
    for k in [k for k in tensors if k.startswith("head.")]:
        del tensors[k]
    header["weights"]["quant"].pop("head", None)
    loaded = load_model(src)
    if bits is not None:
        head_tensors, header["weights"]["quant"]["head"] = quantize_head(loaded.model, bits, 32)
        tensors.update(head_tensors)
    header["provenance"]["tool"] = f"benchmarks/quant_head.py (head {'fp16' if bits is None else f'int{bits}'})"
    return write_model(dst, None, tokenizer=loaded.tokenizer, tensors=tensors, header=header)


def decode_rate(engine, ids, tokens: int, loops: int) -> float:
    params = SamplingParams(max_tokens=tokens, loops=loops, ignore_eos=True)
    stamps = []
    for ev in engine.stream(ids, params):
        if ev.token_ids:
            stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    ap.add_argument("--per-file", type=int, default=1536, help="validation tokens per corpus file")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-perplexity", action="store_true", help="decode speed only")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shipped = resolve_model_path("tinyloop-16m-int4")
    ref = load_model(resolve_model_path("tinyloop-16m"), dtype=torch.float32)
    val = validation_tokens(ref.tokenizer, args.corpus, args.per_file)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = {"fp32 (the fp16 file widened)": None,
                 "int4 GPTQ g32, fp16 head": with_head(shipped, Path(tmp) / "h16.tinyloop", None),
                 "int4 GPTQ g32, int8 head (shipped)": with_head(shipped, Path(tmp) / "h8.tinyloop", 8),
                 "int4 GPTQ g32, int4 g32 head": with_head(shipped, Path(tmp) / "h4.tinyloop", 4)}
        for name, path in files.items():
            if args.no_perplexity:
                rows.append({"file": name, "bytes": None if path is None else path.stat().st_size, "perplexity": None})
                continue
            model = ref.model if path is None else load_model(path).model
            r = perplexity(model, val, args.loops, seq_len=256, stride=128)
            rows.append({"file": name, "bytes": None if path is None else path.stat().st_size,
                         "perplexity": round(r["perplexity"], 3)})
            print(f"{name}: perplexity {r['perplexity']:.3f}", file=sys.stderr, flush=True)
        engines = {name: Engine.load(str(path), draft_exit=False) for name, path in files.items() if path}
        ids = next(iter(engines.values())).encode_prompt(PROMPT)
        for e in engines.values():
            e.model.decode_threads = args.threads
            if e.model.executor is not None:
                e.model.executor.threads = args.threads
            decode_rate(e, ids, 8, args.loops)   # warm-up
        rates = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, e in engines.items():
                rates[name].append(decode_rate(e, ids, args.tokens, args.loops))
        executor = next(iter(engines.values())).model_info().get("executor", "")
    base = rows[0]["perplexity"]
    print(f"# loops {args.loops}, {len(val)} validation tokens; decode: {args.tokens} greedy tokens, "
          f"{args.threads} threads, median of {args.rounds} alternating rounds, executor {executor}")
    print("| file | size | perplexity | vs fp32 | decode tok/s | vs the fp16 head |")
    print("|---|---:|---:|---:|---:|---:|")
    shipped_rate = statistics.median(rates["int4 GPTQ g32, fp16 head"])
    for r in rows:
        rate = statistics.median(rates[r["file"]]) if r["file"] in rates else None
        r["tok_s"] = None if rate is None else round(rate, 1)
        size = "" if r["bytes"] is None else f"{r['bytes'] / 2**20:.1f} MiB"
        ppl = "" if base is None else f"{r['perplexity']:.2f} | {100 * (r['perplexity'] / base - 1):+.2f}%"
        print(f"| {r['file']} | {size} | {ppl or ' | '} | "
              f"{'' if rate is None else f'{rate:.1f}'} | {'' if rate is None else f'{rate / shipped_rate:.2f}x'} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "loops": args.loops, "threads": args.threads,
                                         "tokens": args.tokens, "rounds": args.rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
