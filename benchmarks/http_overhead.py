"""HTTP serving overhead: tokens/s streamed through `tinyloop serve` against the direct engine.

Same model, same prompt, same greedy settings, same thread count, in one run: the direct engine runs in
this process while the server (a `tinyloop serve` subprocess on loopback) idles, and the HTTP runs go
through real sockets with a streaming client that parses every SSE event. Runs alternate
(direct, native SSE, OpenAI SSE, direct, ...) so drifting machine load hits all paths alike; the table
reports medians.

Two measures per path: wall-clock tokens/s (what a client sees; issue 25's bar is HTTP >= 0.95 x direct; "paired"
is the median over repeats of each HTTP run against the direct run just before it, which drifting load
disturbs less than the ratio of two medians), and
tokens per CPU-second (CPU time of every process involved: for HTTP the server process, all its threads,
plus the client; for direct this process). The second is what the HTTP layer costs, and it stays
meaningful on a machine that other jobs are loading, where wall-clock figures swing run to run.

    .venv/bin/python benchmarks/http_overhead.py [--model M.tinyloop] [--max-tokens 128] [--repeats 5]
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

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: local_server
import local_server  # noqa: E402

PROMPT = "The king said to his people that"


def start_server(model: Path, threads: int) -> tuple[subprocess.Popen, str]:
    return local_server.start_server(model, env={"OMP_NUM_THREADS": str(threads)})


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_direct(engine, max_tokens: int, loops: int | None) -> dict:
    from tinyloop.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, loops=loops, temperature=0.0)
    c0 = time.process_time()
    t0 = time.perf_counter()
    ttft, n, text = None, 0, []
    for ev in engine.stream(PROMPT, params):
        if ev.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        text.append(ev.text)
        if ev.finish_reason is not None:
            n = ev.stats["completion_tokens"]
    wall = time.perf_counter() - t0
    return {"tokens": n, "wall_s": wall, "cpu_s": time.process_time() - c0, "ttft_s": ttft, "text": "".join(text)}


def run_http(client: httpx.Client, url: str, server_pid: int, route: str, max_tokens: int,
             loops: int | None) -> dict:
    if route == "/generate":
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "top_k": 0,
                "top_p": 1.0}
    else:
        body = {"model": "tinyloop", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
    if loops is not None:
        body["loops"] = loops
    c0, s0 = time.process_time(), proc_cpu_s(server_pid)
    t0 = time.perf_counter()
    ttft, n, text = None, 0, []
    with client.stream("POST", url + route, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if route == "/generate":
                if ev["token_id"] >= 0 and ttft is None:
                    ttft = time.perf_counter() - t0
                if ev["token_id"] == -1:
                    n = ev["stats"]["completion_tokens"]
                text.append(ev["text"])
            else:
                if ev.get("usage"):
                    n = ev["usage"]["completion_tokens"]
                for ch in ev["choices"]:
                    if ch["text"] and ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(ch["text"])
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0 + proc_cpu_s(server_pid) - s0
    return {"tokens": n, "wall_s": wall, "cpu_s": cpu, "ttft_s": ttft, "text": "".join(text)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a .tinyloop file (default: $TINYLOOP_MODEL_PATH or the shipped model)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--loops", type=int, help="default: the model's default_loops")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, for the engine and the server alike")
    ap.add_argument("--out", default="benchmarks/results/http_overhead.json")
    ap.add_argument("--quiet", action="store_true", help="no progress bar (none is shown off a terminal)")
    args = ap.parse_args()

    import torch

    from tinyloop.engine import Engine
    from tinyloop.modelfile.loader import resolve_model_path
    from tinyloop.tools.progress import progress

    torch.set_num_threads(args.threads)
    model = resolve_model_path(args.model)
    engine = Engine.load(model)
    proc, url = start_server(model, args.threads)
    paths = {"direct engine (Engine.stream)": None, "HTTP /generate (native SSE)": "/generate",
             "HTTP /v1/completions (OpenAI SSE)": "/v1/completions"}
    runs: dict[str, list[dict]] = {k: [] for k in paths}
    try:
        with httpx.Client(timeout=600) as client:
            for name, route in paths.items():  # warm-up, not counted
                run_direct(engine, 8, args.loops) if route is None else run_http(client, url, proc.pid, route, 8, args.loops)
            with progress(total=args.repeats * len(paths), desc="runs", unit="run", quiet=args.quiet) as bar:
                for _ in range(args.repeats):
                    for name, route in paths.items():
                        r = (run_direct(engine, args.max_tokens, args.loops) if route is None
                             else run_http(client, url, proc.pid, route, args.max_tokens, args.loops))
                        runs[name].append(r)
                        bar.update()
    finally:
        proc.terminate()
        proc.wait(10)

    texts = {r["text"] for rs in runs.values() for r in rs}
    assert len(texts) == 1, "greedy output differs between paths"
    rows = []
    base = base_cpu = None
    direct = list(runs.values())[0]
    for name, rs in runs.items():
        tps = statistics.median(r["tokens"] / r["wall_s"] for r in rs)
        # each run against the direct run of its own repeat (taken a moment before): robust to drifting load
        paired = statistics.median(d["wall_s"] / r["wall_s"] for d, r in zip(direct, rs))
        cps = statistics.median(r["tokens"] / r["cpu_s"] for r in rs)
        ttft = statistics.median(r["ttft_s"] for r in rs)
        base, base_cpu = base or tps, base_cpu or cps
        rows.append({"path": name, "tokens": rs[0]["tokens"], "tokens_per_s": round(tps, 2),
                     "ratio_vs_direct": round(tps / base, 3), "paired_ratio": round(paired, 3),
                     "tokens_per_cpu_s": round(cps, 2),
                     "cpu_ratio_vs_direct": round(cps / base_cpu, 3), "ttft_ms": round(ttft * 1000, 1),
                     "all_tokens_per_s": [round(r["tokens"] / r["wall_s"], 2) for r in rs],
                     "all_tokens_per_cpu_s": [round(r["tokens"] / r["cpu_s"], 2) for r in rs]})
    load = os.getloadavg()
    meta = {"model": str(model), "prompt": PROMPT, "max_tokens": args.max_tokens, "loops": args.loops,
            "repeats": args.repeats, "threads": args.threads, "cpu_count": os.cpu_count(),
            "loadavg_at_end": [round(x, 2) for x in load], "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    print(f"model {model}  max_tokens {args.max_tokens}  loops {args.loops or 'default'}  threads {args.threads}  "
          f"repeats {args.repeats}  load avg {load[0]:.2f}")
    print(f"| {'path':<36} | tokens | tokens/s | ratio | paired | tokens/CPU-s | CPU ratio | TTFT ms |")
    print(f"|{'-' * 38}|--------|----------|-------|--------|--------------|-----------|---------|")
    for r in rows:
        print(f"| {r['path']:<36} | {r['tokens']:>6} | {r['tokens_per_s']:>8.2f} | {r['ratio_vs_direct']:>5.3f} | "
              f"{r['paired_ratio']:>6.3f} | {r['tokens_per_cpu_s']:>12.2f} | {r['cpu_ratio_vs_direct']:>9.3f} | "
              f"{r['ttft_ms']:>7.1f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
