"""The perplexity cost of the native kernels' int8 activations (issue 25).

The native kernels quantize the input rows of int4 and int8 layers (the shipped int4 file's blocks and its
int8 head) to int8, per group of the weights' (up to 256 columns; per 32 before session 11), for integer
dot products. This scores the same file three ways: int8 activations everywhere (the default), the head's
in fp32, and every layer's in fp32 (`TINYLOOP_NATIVE_Q8=0`, exact to the dequantized weights):
`Engine.logits` at loops 8 over the held-out end (the last 1%) of a corpus file, in windows of 256 tokens.

    .venv/bin/python benchmarks/head_activations.py [--corpus data/corpus/brown.txt.gz] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import gzip
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from tinyloop.engine import Engine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tinyloop-16m-int4")
    ap.add_argument("--corpus", default=str(Path(__file__).resolve().parents[1] / "data" / "corpus" / "brown.txt.gz"))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--loops", type=int, default=8)
    args = ap.parse_args()
    opener = gzip.open if args.corpus.endswith(".gz") else open
    with opener(args.corpus, "rt") as f:
        text = f.read()
    text = text[len(text) * 99 // 100:]
    eng = Engine.load(args.model, draft_exit=False)
    ex = eng.model.executor
    if ex is None or not ex.head.act_q8:
        raise SystemExit("needs the native executor and a head with int8 activations (an int8 or int4 head)")
    ids = eng.tokenizer.encode(text)[:args.tokens]

    def ppl(eng) -> tuple[float, int]:
        nll, n = 0.0, 0
        for s in range(0, len(ids) - 1, 256):
            w = ids[s:s + 257]
            if len(w) < 2:
                break
            lg = eng.logits(w[:-1], loops=args.loops)[:, :eng.config.vocab_size]
            nll += F.cross_entropy(lg.double(), torch.tensor(w[1:]), reduction="sum").item()
            n += len(w) - 1
        return math.exp(nll / n), n

    q8, n = ppl(eng)
    ex.head.act_q8 = 0
    head_fp32, _ = ppl(eng)
    os.environ["TINYLOOP_NATIVE_Q8"] = "0"    # read as each layer's descriptor is made
    fp32, _ = ppl(Engine.load(args.model, draft_exit=False))
    print(f"{args.model}, loops {args.loops}, {n} held-out tokens: perplexity with int8 activations "
          f"{q8:.3f}, the head's in fp32 {head_fp32:.3f}, every layer's in fp32 {fp32:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
