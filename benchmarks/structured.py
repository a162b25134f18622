"""Structured output's cost: aggregate tokens/s of clients asking for a JSON schema vs unconstrained clients.

Starts `tinyloop serve` (the shipped model unless `--model`), then runs, in alternating order and
`--rounds` times each, four levels: 16 clients unconstrained, 16 clients with `response_format`
json_schema, 1 client unconstrained, 1 client json_schema. Each client sends `--requests` non-streaming
`/v1/completions` requests back to back (prompt i of PROMPTS, `max_tokens`, temperature 0.8, a seed per
request; unconstrained ones pass `ignore_eos` so that every request makes `max_tokens` tokens, and the
schema needs more than `max_tokens` tokens, so constrained ones do too: both sides generate the same
number of tokens). Aggregate tokens/s = completion tokens / the level's wall time; the table gives the
median over rounds and the ratio constrained / unconstrained at 16 and at 1 client (bars: >= 0.85 and
>= 0.9). Constrained outputs that finished with "stop" are checked against the schema (jsonschema).

    .venv/bin/python benchmarks/structured.py --json benchmarks/results/structured.json
    # options: [--model M.tinyloop] [--rounds 3] [--requests 2] [--max-tokens 64] [--threads 2] [--clients 16,1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: local_server
import local_server  # noqa: E402

PROMPTS = ["The king said", "A list of the towns we passed:", "Here is the inventory, as JSON:", "Once upon a time",
           "The report reads", "In the beginning", "Names of the crew:", "The weather today"]
# needs more than 64 tokens to complete: every request runs to max_tokens, constrained or not
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["tool", "food", "cloth", "other"]}}, "required": ["name", "count", "kind"],
        "additionalProperties": False}, "minItems": 6, "maxItems": 6}},
    "required": ["title", "items"], "additionalProperties": False}


async def client_run(url: str, i: int, requests: int, max_tokens: int, constrained: bool) -> list[dict]:
    out = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1)) as client:
        for j in range(requests):
            body = {"model": "tinyloop", "prompt": PROMPTS[(i + j) % len(PROMPTS)], "max_tokens": max_tokens,
                    "temperature": 0.8, "seed": 1000 * i + j}
            if constrained:
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "inventory", "schema": SCHEMA}}
            else:
                body["ignore_eos"] = True
            r = await client.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            data = r.json()
            out.append({"tokens": data["usage"]["completion_tokens"], "text": data["choices"][0]["text"],
                        "finish_reason": data["choices"][0]["finish_reason"]})
    return out


async def level(url: str, clients: int, requests: int, max_tokens: int, constrained: bool) -> dict:
    t0 = time.perf_counter()
    runs = await asyncio.gather(*(client_run(url, i, requests, max_tokens, constrained) for i in range(clients)))
    wall = time.perf_counter() - t0
    recs = [r for run in runs for r in run]
    tokens = sum(r["tokens"] for r in recs)
    valid = invalid = 0
    if constrained:
        import jsonschema

        for r in recs:
            if r["finish_reason"] == "stop":
                try:
                    jsonschema.validate(json.loads(r["text"]), SCHEMA)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    invalid += 1
    return {"clients": clients, "constrained": constrained, "requests": len(recs), "tokens": tokens,
            "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2), "stopped_valid": valid,
            "stopped_invalid": invalid, "length": sum(r["finish_reason"] == "length" for r in recs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2, help="requests per client per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    ap.add_argument("--clients", default="16,1", help="the concurrency levels, e.g. 16,1 (the default) or 1")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    proc, url = local_server.start_server(args.model, env={"OMP_NUM_THREADS": str(args.threads)})
    rows: dict[tuple[int, bool], list[dict]] = {}
    try:
        asyncio.run(level(url, 1, 1, 8, True))   # warm-up: the grammar tokenizer and the schema's compile
        for r in range(args.rounds):
            order = [(c, k) for c in levels for k in (False, True)]
            if r % 2:
                order = [(c, not k) for c, k in order]
            for clients, constrained in order:
                res = asyncio.run(level(url, clients, args.requests, args.max_tokens, constrained))
                rows.setdefault((clients, constrained), []).append(res)
                print(f"round {r + 1}: {clients:2d} clients {'json_schema' if constrained else 'free text  '} "
                      f"{res['tokens_per_s']:8.2f} tokens/s ({res['tokens']} tokens in {res['wall_s']} s)", flush=True)
    finally:
        local_server.stop_server(proc)
    med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in rows.items()}
    print("\n| clients | free text tokens/s | json_schema tokens/s | ratio |\n|---|---|---|---|")
    ratios = {}
    for clients in levels:
        ratios[clients] = med[(clients, True)] / med[(clients, False)]
        print(f"| {clients} | {med[(clients, False)]:.2f} | {med[(clients, True)]:.2f} | {ratios[clients]:.3f} |")
    bad = sum(x["stopped_invalid"] for v in rows.values() for x in v)
    print(f"\nconstrained outputs that stopped and failed validation: {bad}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "levels": [x for v in rows.values() for x in v],
                                         "median_tokens_per_s": {f"{c}{'_json' if k else ''}": v for (c, k), v in med.items()},
                                         "ratios": {str(c): r for c, r in ratios.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
