"""The AMX int8 tiles against the vector tiles, paired in one run on one host (issue 36): the same model,
the same build, `tl_set_amx` switching between the two for each measurement (outputs are bitwise equal, so
only time differs):

- a pass over a loop's core layers by the number of rows it carries (as pass_cost.py);
- 16 sequences decoding at once, in-process (aggregate tok/s);
- the prefill of a 512-token prompt (prompt tok/s, one request, max_tokens 1).

    .venv/bin/python benchmarks/amx.py MODEL [MODEL ...] [--threads 2] [--rows 1,4,8,16,32,64]
        [--tokens 32] [--prompt 512] [--out benchmarks/results/amx.json]

Prints one JSON object; exits 1 where the host or build has no AMX tiles to compare.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.serving import BatchEngine, run_to_completion
from tinyloop.kernels import lib as native
from tinyloop.kernels.executor import _forward


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def paired(fn, repeats: int) -> dict:
    """fn timed with the vector tiles and with AMX, alternated (best of `repeats` each)."""
    lib = native.load()
    times = {"vector": float("inf"), "amx": float("inf")}
    for _ in range(repeats):
        for name, on in (("vector", 0), ("amx", 1)):
            lib.tl_set_amx(on)
            times[name] = min(times[name], best_of(fn, 1))
    lib.tl_set_amx(1)
    return {"vector_ms": round(times["vector"] * 1e3, 3), "amx_ms": round(times["amx"] * 1e3, 3),
            "amx_speedup": round(times["vector"] / times["amx"], 3)}


def measure(path: str, args) -> dict:
    eng = Engine.load(path, draft_exit=False)
    ex = eng.model.executor
    if ex is None:
        return {"model": path, "error": "no native executor for this model"}
    descs = ex.linears("core")
    res: dict = {"model": Path(path).name, "int8_activation_layers": sum(bool(d.act_q8) for d in descs),
                 "layers": len(descs), "pass_by_rows": {}}
    for M in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(M, d.k) for d in descs]
        r = paired(lambda: [_forward(d, x, args.threads) for d, x in zip(descs, xs)], args.repeats)
        res["pass_by_rows"][M] = r
        print(Path(path).name, "pass", M, r, flush=True)
    torch.set_num_threads(args.threads)
    loops = eng.model.cfg.default_loops
    g = torch.Generator().manual_seed(0)
    vocab = eng.model.cfg.vocab_size
    prompts = [torch.randint(100, vocab - 100, (16,), generator=g).tolist() for _ in range(16)]
    params = SamplingParams(max_tokens=args.tokens, loops=loops, temperature=0, ignore_eos=True)

    def decode16():
        run_to_completion(BatchEngine(eng, max_num_seqs=16, prefix_caching=False), [(p, params) for p in prompts])

    r = paired(decode16, max(2, args.repeats // 2))
    r["vector_tok_s"] = round(16 * args.tokens / (r["vector_ms"] / 1e3), 1)
    r["amx_tok_s"] = round(16 * args.tokens / (r["amx_ms"] / 1e3), 1)
    res["decode_16_sequences"] = r
    print(Path(path).name, "decode16", r, flush=True)
    n_prompt = min(args.prompt, eng.max_seq_len - 1)   # (the shipped model's context is 512: 511)
    long_prompt = torch.randint(100, vocab - 100, (n_prompt,), generator=g).tolist()
    one = SamplingParams(max_tokens=1, loops=loops, temperature=0, ignore_eos=True)

    def prefill():
        run_to_completion(BatchEngine(eng, max_num_seqs=1, prefix_caching=False), [(long_prompt, one)])

    r = paired(prefill, max(2, args.repeats // 2))
    r["vector_prompt_tok_s"] = round(n_prompt / (r["vector_ms"] / 1e3), 1)
    r["amx_prompt_tok_s"] = round(n_prompt / (r["amx_ms"] / 1e3), 1)
    res[f"prefill_{n_prompt}"] = r
    print(Path(path).name, "prefill", r, flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lib = native.load()
    lib.tl_set_threads(args.threads)
    if not lib.tl_amx():
        print(f"no AMX tiles in this build/host ({lib.tl_isa().decode()})", file=sys.stderr)
        return 1
    out = {"isa": lib.tl_isa().decode(), "threads": args.threads,
           "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), ""),
           "results": [measure(p, args) for p in args.models]}
    print(json.dumps(out))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
