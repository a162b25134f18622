"""Prefix caching: time to first token of chat turns that share a long system prompt, cached vs uncached.

Two `tinyloop serve` processes on the same model, one with prefix caching (the default) and one with
TINYLOOP_PREFIX_CACHING=0, both up for the whole run with the same thread count, each reached through one
kept-alive client connection (as an SDK client keeps one; since session 11). Each turn sends the same
~400-token system prompt and a different short user message (streamed chat completion, greedy) to
both servers in alternation, so machine load hits both alike. The first turn on the caching server fills
its cache (a miss, reported apart); every later turn finds the system prompt's full blocks there.

Reports median time to first token (client side: request sent -> first content chunk) per server, their
ratio, `usage.prompt_tokens_details.cached_tokens`, and whether the two servers' texts are identical.

    .venv/bin/python benchmarks/prefix_cache.py [--model M.tinyloop] [--turns 8] [--system-tokens 400]
        [--threads 1] [--json benchmarks/results/prefix_cache.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: local_server
import local_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["What is a looped model?", "Who wrote this?", "Say something about the weather.",
             "Tell me a story.", "What is speculation?", "How fast is it?", "Where are the docs?",
             "What does the server do?", "Name a colour.", "Count to five.", "What is a cache?",
             "Why loops?"]


def system_prompt(n_tokens: int) -> str:
    """About `n_tokens` GPT-2 tokens of English: the project's own docs (always present, deterministic)."""
    from tinyloop.tokenizer import Tokenizer

    tok = Tokenizer.gpt2()
    text = " ".join((ROOT / "docs" / "architecture.md").read_text().split())
    ids = tok.encode(text)[:n_tokens]
    return "You are a helpful assistant. Background follows. " + tok.decode(ids)


_CLIENTS: dict[str, httpx.Client] = {}   # one kept-alive connection per server, as an SDK client keeps


def turn(url: str, system: str, question: str, max_tokens: int) -> dict:
    body = {"model": "tinyloop", "stream": True, "temperature": 0, "max_tokens": max_tokens,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    if url not in _CLIENTS:   # (made once, outside the timing: a new httpx.Client builds an SSL context, ~30 ms)
        _CLIENTS[url] = httpx.Client(timeout=300)
    client = _CLIENTS[url]
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    return {"ttft_s": ttft, "wall_s": time.perf_counter() - t0, "text": "".join(text), "usage": usage}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="model file (default: the shipped model)")
    ap.add_argument("--turns", type=int, default=8, help="chat turns per server (the first fills the cache)")
    ap.add_argument("--system-tokens", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads of each server")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    system = system_prompt(args.system_tokens)
    env = {"OMP_NUM_THREADS": str(args.threads)}
    cached_srv, cached_url = local_server.start_server(args.model, env=env)
    plain_srv, plain_url = local_server.start_server(args.model, env={**env, "TINYLOOP_PREFIX_CACHING": "0"})
    try:
        turn(plain_url, "Warm up.", "Hi", 2)                  # first-request costs (allocations, imports)
        turn(cached_url, "Warm up.", "Hi", 2)
        rows = []
        for i in range(args.turns):
            q = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" ({i})")
            a = turn(plain_url, system, q, args.max_tokens)
            b = turn(cached_url, system, q, args.max_tokens)
            rows.append({"question": q, "uncached": a, "cached": b})
    finally:
        local_server.stop_server(cached_srv)
        local_server.stop_server(plain_srv)

    hits = rows[1:]
    ttft_plain = statistics.median(r["uncached"]["ttft_s"] for r in hits)
    ttft_hit = statistics.median(r["cached"]["ttft_s"] for r in hits)
    prompt_tokens = rows[0]["cached"]["usage"]["prompt_tokens"]
    cached_tokens = [r["cached"]["usage"]["prompt_tokens_details"]["cached_tokens"] for r in rows]
    same = all(r["uncached"]["text"] == r["cached"]["text"] for r in rows)
    result = {
        "turns": args.turns, "threads": args.threads, "prompt_tokens": prompt_tokens, "max_tokens": args.max_tokens,
        "ttft_uncached_ms": round(ttft_plain * 1000, 1), "ttft_cached_ms": round(ttft_hit * 1000, 1),
        "ttft_first_turn_ms": round(rows[0]["cached"]["ttft_s"] * 1000, 1),
        "speedup": round(ttft_plain / ttft_hit, 2), "cached_tokens": cached_tokens, "identical_text": same,
        "rows": [{"question": r["question"], **{k: {"ttft_ms": round(r[k]["ttft_s"] * 1000, 1),
                                                   "cached_tokens": r[k]["usage"]["prompt_tokens_details"]["cached_tokens"]}
                                               for k in ("uncached", "cached")}} for r in rows],
    }
    print(f"prompt tokens {prompt_tokens}, {len(hits)} repeated turns, {args.threads} thread(s) per server")
    print("| server | median TTFT (ms) | cached prompt tokens |")
    print("|---|---:|---:|")
    print(f"| prefix caching off | {result['ttft_uncached_ms']} | 0 |")
    print(f"| prefix caching on, first turn | {result['ttft_first_turn_ms']} | {cached_tokens[0]} |")
    print(f"| prefix caching on, later turns | {result['ttft_cached_ms']} | {statistics.median(cached_tokens[1:]):g} |")
    print(f"speedup {result['speedup']}x; identical text: {same}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
