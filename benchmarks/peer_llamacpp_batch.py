"""TinyLoop against llama.cpp on many rows at once (issue 36): the prefill of a long prompt (pp512) and 16
sequences decoding together, in-process, in one run, best thread count each.

- prefill: one prompt of `--prompt` tokens (511 on the shipped model, whose context is 512), llama.cpp in one
  `llama_decode` of the whole prompt (n_batch = n_ubatch = the prompt, the last position's logits out) against
  TinyLoop's time to the first token on a fresh engine core (no prefix cache: a new pool every repeat);
  tokens/s of prompt.
- batched decode: 16 sequences (16 different short prompts), greedy, `--tokens` each. llama.cpp through its
  batch API as `llama-batched-bench` drives it (one `llama_batch` of the 16 next tokens a step, each its own
  sequence id, the argmax of each row's logits in numpy); TinyLoop through its engine core (`BatchEngine`, 16
  requests at once). Aggregate decode tok/s: the tokens after each sequence's first over the time after the
  prompts (llama.cpp: the steps timed alone; TinyLoop: the run's time less the same requests' time to their
  first tokens, measured right after).

Models: the shipped model at `--loops` (default 8) written *unrolled* to a GGUF, as `peer_llamacpp.py` does (fp16
file against F16, int4 file against Q4_0 with a Q8_0 head); or any pair given with `--gguf FILE --tinyloop FILE`
(the Ouro-1.4B shape: `peer_llamacpp_shape.py --gguf-dir DIR` keeps its GGUF, `real_shapes.py --workdir DIR` its
int4 file; `--loops 1` there). Neither peer package is in the default install or CI:

    .venv/bin/pip install gguf llama-cpp-python==0.3.36
    .venv/bin/python benchmarks/peer_llamacpp_batch.py [--threads 1,2] [--tokens 32] [--repeats 3] [--json PATH]
    .venv/bin/python benchmarks/peer_llamacpp_batch.py --gguf G.gguf --tinyloop T.tinyloop --loops 1 --prompt 512
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_llamacpp import write_unrolled_gguf  # noqa: E402

SEQS = 16
TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
        "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. ")


class LlamaRunner:
    """llama.cpp's C API through llama-cpp-python's bindings: one model, one context of SEQS sequences."""

    def __init__(self, path: Path, threads: int, n_ctx: int, n_batch: int):
        import llama_cpp as L

        self.L = L
        self._quiet = L.llama_log_callback(lambda level, text, data: None)   # (kept: the library holds it)
        L.llama_log_set(self._quiet, ctypes.c_void_p(0))
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, SEQS
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(n_batch, 0, SEQS)

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        b.n_tokens = len(rows)
        for i, (tok, pos, seq, out) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(out)
            b.seq_id[i][0] = seq
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax_rows(self, n: int) -> list[int]:
        ptr = self.L.llama_get_logits(self.ctx)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n, self.n_vocab))
        return logits.argmax(axis=1).tolist()

    def clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def prefill_s(self, ids: list[int]) -> float:
        self.clear()
        t = time.perf_counter()
        self._decode([(tok, i, 0, i == len(ids) - 1) for i, tok in enumerate(ids)])
        return time.perf_counter() - t

    def batched(self, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
        """Decode seconds for tokens - 1 steps of every sequence, and the tokens."""
        self.clear()
        rows = [(tok, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, tok in enumerate(p)]
        self._decode(rows)
        nxt = self._argmax_rows(len(prompts))
        out = [[t] for t in nxt]
        pos = [len(p) for p in prompts]
        t0 = time.perf_counter()
        for _ in range(tokens - 1):
            self._decode([(nxt[s], pos[s], s, True) for s in range(len(prompts))])
            nxt = self._argmax_rows(len(prompts))
            for s in range(len(prompts)):
                out[s].append(nxt[s])
                pos[s] += 1
        return time.perf_counter() - t0, out


def set_threads(engine, threads: int) -> None:
    torch.set_num_threads(threads)
    engine.model.decode_threads = threads
    if engine.model.executor is not None:
        engine.model.executor.threads = threads


def tinyloop_prefill_s(engine, ids: list[int], loops: int) -> float:
    from tinyloop.engine import SamplingParams
    from tinyloop.engine.serving import BatchEngine, run_to_completion

    core = BatchEngine(engine, max_num_seqs=1)
    t = time.perf_counter()
    run_to_completion(core, [(ids, SamplingParams(max_tokens=1, temperature=0, loops=loops, ignore_eos=True))])
    return time.perf_counter() - t


def tinyloop_batched(engine, prompts: list[list[int]], tokens: int, loops: int) -> tuple[float, list[list[int]]]:
    from tinyloop.engine import SamplingParams
    from tinyloop.engine.serving import BatchEngine, run_to_completion

    def run(n: int) -> tuple[float, list]:
        core = BatchEngine(engine, max_num_seqs=SEQS)
        params = SamplingParams(max_tokens=n, temperature=0, loops=loops, ignore_eos=True)
        t = time.perf_counter()
        events = run_to_completion(core, [(p, params) for p in prompts])
        return time.perf_counter() - t, [[t for e in ev for t in e.token_ids] for ev in events]

    whole, out = run(tokens)
    first, _ = run(1)
    return whole - first, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens a sequence in the batched decode")
    ap.add_argument("--prompt", type=int, default=511, help="prompt tokens of the prefill")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gguf", help="a GGUF to run against --tinyloop (default: the shipped model unrolled)")
    ap.add_argument("--tinyloop", help="the TinyLoop file of the same model as --gguf")
    ap.add_argument("--json")
    args = ap.parse_args()
    if bool(args.gguf) != bool(args.tinyloop):
        ap.error("--gguf and --tinyloop go together")
    from tinyloop.engine import Engine

    threads = [int(t) for t in args.threads.split(",")]
    tmp = tempfile.TemporaryDirectory()
    if args.gguf:
        pairs = [(Path(args.tinyloop).name, args.tinyloop, Path(args.gguf))]
    else:
        from tinyloop.model.fused import split_projections
        from tinyloop.modelfile.loader import load_model, resolve_model_path

        source = load_model(resolve_model_path("tinyloop-16m"), dtype=torch.float32).model
        split_projections(source)
        pairs = [(f"{name} (shipped, loops {args.loops})", name,
                  write_unrolled_gguf(source, Path(tmp.name) / f"unrolled-{q}.gguf", args.loops, q))
                 for name, q in (("tinyloop-16m", "F16"), ("tinyloop-16m-int4", "Q4_0"))]
    rows = []
    for label, model, gguf_path in pairs:
        engine = Engine.load(model, draft_exit=False)
        tok = engine.tokenizer
        long_ids = (tok.encode(TEXT * 40))[: args.prompt]
        prompts = [tok.encode(f"Chapter {i + 1}. {TEXT[: 40 + 7 * i]}")[-12:] for i in range(SEQS)]   # (12 ids each)
        per_seq = 12 + args.tokens + 8
        for t in threads:
            set_threads(engine, t)
            llama = LlamaRunner(gguf_path, t, n_ctx=max(args.prompt + 8, SEQS * per_seq),
                                n_batch=max(args.prompt, SEQS * 12))
            try:
                lp, tp, lb, tb = [], [], [], []
                for _ in range(args.repeats + 1):   # the first warms both up
                    lp.append(llama.prefill_s(long_ids))
                    tp.append(tinyloop_prefill_s(engine, long_ids, args.loops))
                    s, l_out = llama.batched(prompts, args.tokens)
                    lb.append(s)
                    s, t_out = tinyloop_batched(engine, prompts, args.tokens, args.loops)
                    tb.append(s)
            finally:
                llama.close()
            agree = sum(a == b for x, y in zip(l_out, t_out) for a, b in zip(x, y))
            n_dec = SEQS * (args.tokens - 1)
            row = {"model": label, "gguf": gguf_path.name, "threads": t,
                   "prefill_tok_s": {"llama_cpp": round(len(long_ids) / statistics.median(lp[1:]), 1),
                                     "tinyloop": round(len(long_ids) / statistics.median(tp[1:]), 1)},
                   "batched_tok_s": {"llama_cpp": round(n_dec / statistics.median(lb[1:]), 1),
                                     "tinyloop": round(n_dec / statistics.median(tb[1:]), 1)},
                   "greedy_agree": f"{agree}/{SEQS * args.tokens}", "prompt_tokens": len(long_ids)}
            print(row, flush=True)
            rows.append(row)
        del engine
    print(f"# prefill of {args.prompt} prompt tokens; {SEQS} sequences x {args.tokens} greedy tokens; median of "
          f"{args.repeats} after a warm-up; best thread count of {threads} each")
    print("| TinyLoop file | GGUF | prefill tok/s llama.cpp / TinyLoop | ratio | 16-sequence decode tok/s llama.cpp / "
          "TinyLoop | ratio |")
    print("|---|---|---:|---:|---:|---:|")
    summary = []
    for label in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == label]
        best = {k: {e: max(r[k][e] for r in rs) for e in ("llama_cpp", "tinyloop")}
                for k in ("prefill_tok_s", "batched_tok_s")}
        ratio = {k: round(v["tinyloop"] / v["llama_cpp"], 2) for k, v in best.items()}
        summary.append({"model": label, "gguf": rs[0]["gguf"], "best": best, "ratio": ratio})
        print(f"| {label} | {rs[0]['gguf']} | {best['prefill_tok_s']['llama_cpp']} / {best['prefill_tok_s']['tinyloop']} "
              f"| {ratio['prefill_tok_s']:.2f}x | {best['batched_tok_s']['llama_cpp']} / "
              f"{best['batched_tok_s']['tinyloop']} | {ratio['batched_tok_s']:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary, "tokens": args.tokens,
                                               "loops": args.loops}, indent=1))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
