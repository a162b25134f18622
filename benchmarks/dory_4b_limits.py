"""Which limit binds Dory's 4B-shape decode on this host, and how near it runs (issue 55: "decode at loops 1, 2 and 4
>= 0.8 of whichever limit binds: the read-bandwidth ceiling, or the arithmetic peak measured on the same kernels").

In one process, on `dory_4b.py`'s int4 file, natively, `--threads` threads:

- **read ceiling**: a float64 sum over `--read-gib` GiB (torch, the same thread count), best of 5: what the
  memory gives a sequential reader;
- **kernel peak**: each distinct matrix shape of the recurrent block through `tl_linear_forward` at one row, 20
  times in a row (its ~10 MB stay in the last-level cache: what the same kernels compute when memory is not what
  waits), best of 5, as bytes of weights (codes, scales, zero points) per second; the slowest shape is the peak;
- **decode** (once a large model's background packing is done: its time is reported): greedy tokens after the first at loops 1, 2 and 4 (`Engine.generate`, 2 tokens of warm-up first),
  as bytes of weights read per token (every block matrix once, the recurrent ones once a loop, and the head: from
  the executor's own descriptors) times tokens per second.

The binding limit is the lower of the two; decode's fraction of it is the bar's figure.

    PYTHONPATH=src .venv/bin/python benchmarks/dory_4b_limits.py --model /tmp/dory4b/dory-4b-int4.tinyloop
        [--threads 2] [--tokens 24] [--json benchmarks/results/dory_4b_limits.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
from pathlib import Path

import torch

from hostinfo import host  # (benchmarks/)
from tinyloop.engine import Engine, SamplingParams
from tinyloop.kernels import lib as native

BITS = {native.TL_F32: 32, native.TL_F16: 16, native.TL_BF16: 16, native.TL_Q8: 8, native.TL_Q4: 4, native.TL_Q2: 2}


def weight_bytes(d) -> int:
    """Bytes a pass over one linear layer reads: its codes (or floats), and a quantized one's per-group scales
    (float16) and zero points (uint8) or minimums (float16)."""
    n = d.n * d.k * BITS[d.kind] // 8
    if d.kind in (native.TL_Q8, native.TL_Q4, native.TL_Q2):
        n += d.n * (d.k // d.group) * (4 if d.mins else 3)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--read-gib", type=float, default=2.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    load0 = os.getloadavg()
    torch.set_num_threads(args.threads)
    buf = torch.ones(int(args.read_gib * 2**30) // 8, dtype=torch.float64)
    best = min(_timed(buf.sum) for _ in range(5))
    ceiling = buf.numel() * 8 / best
    del buf
    print(f"read ceiling ({args.threads} threads): {ceiling / 1e9:.1f} GB/s", flush=True)

    t0 = time.perf_counter()
    engine = Engine.load(args.model, draft_exit=False)
    ex = engine.model.executor
    loaded = time.perf_counter() - t0
    ex.packing_done()   # (a large model's int4 codes packed in the background after the load: executor._pack)
    packed = time.perf_counter() - t0
    print(f"loaded in {loaded:.1f} s; int4 codes packed {sum(bool(d.packed) for d in ex.linears())} of "
          f"{len(ex.linears())} layers, {packed:.1f} s after the start", flush=True)
    lib = native.load()
    lib.tl_set_threads(args.threads)
    core, every = ex.linears("core"), ex.linears("all")
    shapes = {}
    for d in core:
        shapes.setdefault((d.n, d.k), d)
    scratch = torch.empty(4 * max(d.k for d in every) + 64)
    peaks = {}
    for (n, k), d in shapes.items():
        x, y = torch.randn(1, k), torch.empty(1, n)

        def twenty(d=d, x=x, y=y):
            for _ in range(20):
                lib.tl_linear_forward(ctypes.byref(d), x.data_ptr(), 1, y.data_ptr(), scratch.data_ptr())
        t = min(_timed(twenty) for _ in range(5))
        peaks[f"{n}x{k}"] = 20 * weight_bytes(d) / t
        print(f"kernel peak, {n} x {k} resident: {peaks[f'{n}x{k}'] / 1e9:.1f} GB/s", flush=True)
    peak = min(peaks.values())

    block_bytes, core_bytes, head_bytes = (sum(weight_bytes(d) for d in every), sum(weight_bytes(d) for d in core),
                                          weight_bytes(ex.head))
    prompt = list(range(10, 42))
    engine.generate(prompt, SamplingParams(max_tokens=2, loops=1, temperature=0.0, ignore_eos=True))
    decode = {}
    binding = min(ceiling, peak)
    for loops in (1, 2, 4):
        st = engine.generate(prompt, SamplingParams(max_tokens=args.tokens + 1, loops=loops, temperature=0.0,
                                                     ignore_eos=True)).stats
        first = st["time_to_first_token_ms"] / 1000
        tok_s = (st["completion_tokens"] - 1) / (st["wall_ms"] / 1000 - first)
        per_token = block_bytes + (loops - 1) * core_bytes + head_bytes
        rate = tok_s * per_token
        decode[loops] = {"tok_s": round(tok_s, 3), "bytes_a_token": per_token, "gb_s": round(rate / 1e9, 2),
                         "of_read_ceiling": round(rate / ceiling, 3), "of_kernel_peak": round(rate / peak, 3)}
        print(f"decode loops {loops}: {tok_s:.2f} tok/s, {per_token / 1e9:.2f} GB a token = {rate / 1e9:.1f} GB/s: "
              f"{rate / ceiling:.2f} of the read ceiling, {rate / peak:.2f} of the kernel peak, "
              f"{rate / binding:.2f} of the binding limit", flush=True)
    out = {"host": host(), "executor": ex.name, "threads": args.threads, "load_average_start": load0,
           "load_s": round(loaded, 2), "packed_after_s": round(packed, 2),
           "packed_layers": sum(bool(d.packed) for d in ex.linears()),
           "load_average_end": os.getloadavg(), "read_ceiling_gb_s": round(ceiling / 1e9, 2),
           "kernel_peak_gb_s": {k: round(v / 1e9, 2) for k, v in peaks.items()},
           "binding": "read ceiling" if ceiling <= peak else "kernel peak", "decode": decode}
    print(f"binding: {out['binding']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
