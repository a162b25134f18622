"""GPTQ against round-to-nearest on the whole validation split: the shipped int4 file vs RTN, same bits/group.

    .venv/bin/python benchmarks/gptq_vs_rtn.py [--loops 8] [--json benchmarks/results/gptq_vs_rtn.json]

`benchmarks/quant.py` scores every format on a 6k-token sample, where a 0.2% perplexity difference is
inside the noise. This scores three models on every held-out token of the corpus (the last 1% of each
file, the split training never saw): the fp16 file (in fp32), the packaged int4 file (GPTQ, `make
int4-model`) and RTN at the int4 file's bits and group size, quantized in memory from the fp16 file.
Perplexity and mean KL(fp32 || model) at `--loops`, windows of 512 with stride 256 (perplexity) and 384
(KL, as in the quant tables).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from tinyloop.modelfile.loader import DEFAULT_MODEL_NAME, FLOAT_MODEL_NAME, load_model, packaged_model_path
from tinyloop.tools.evaluate import kl_divergence, perplexity
from tinyloop.tools.gptq import QuantSpec, quantize_model
from tinyloop.tools.quantize import quantized_model
from tinyloop.train.data import read_text, split_text

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default=str(ROOT.parent / "shared" / "corpus"))
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ref = load_model(packaged_model_path(FLOAT_MODEL_NAME), dtype=torch.float32)
    tok = ref.tokenizer
    ids: list[int] = []
    for f in sorted(Path(args.corpus).glob("*.txt.gz")):
        ids += tok.encode(split_text(read_text(f), 0.01)[1]) + [tok.eos_id]
    shipped = load_model(packaged_model_path(DEFAULT_MODEL_NAME))
    q = shipped.header["weights"]["quant"]
    spec = QuantSpec(bits=q["bits"], group_size=q["group_size"], method="rtn")
    tensors, quant, _ = quantize_model(copy.deepcopy(ref.model), spec, progress=False)  # works in place
    rtn = quantized_model(ref.config, tensors, quant, torch.float32)
    print(f"{len(ids)} validation tokens; loops {args.loops}; shipped file: {q['method']} int{q['bits']} "
          f"g{q['group_size']}\n\n| model | perplexity | vs fp32 | KL from fp32 |\n|---|---:|---:|---:|", flush=True)
    rows = []
    for name, m in [("fp32 (the fp16 file)", ref.model), (f"shipped int{q['bits']} file ({q['method']} g{q['group_size']})",
                                                          shipped.model),
                    (f"rtn int{q['bits']} g{q['group_size']}", rtn)]:
        t0 = time.perf_counter()
        ppl = perplexity(m, ids, args.loops, seq_len=512)
        kl = 0.0 if m is ref.model else kl_divergence(ref.model, m, ids, args.loops, seq_len=512, stride=384)["kl"]
        rows.append({"name": name, "perplexity": ppl["perplexity"], "tokens_scored": ppl["tokens_scored"], "kl": kl,
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(f"| {name} | {ppl['perplexity']:.3f} | {ppl['perplexity'] / rows[0]['perplexity'] - 1:+.2%} | "
              f"{kl:.2e} |", flush=True)
    better = rows[1]["perplexity"] < rows[2]["perplexity"] and rows[1]["kl"] < rows[2]["kl"]
    print(f"\n{rows[1]['tokens_scored']} tokens scored; GPTQ better than RTN by perplexity and KL: {better}")
    if args.json:
        Path(args.json).write_text(json.dumps({"loops": args.loops, "rows": rows, "gptq_better": better}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
