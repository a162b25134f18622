"""Serving under load: tokens/s and latency of `tinyloop serve` with 1, 4, 16, 32 concurrent streaming clients.

A load generator on loopback. It starts a `tinyloop serve` subprocess on a free port (or uses `--url`),
sends one short warm-up request (not counted; `--warmup N`: N full requests of each `--mix` kind), then runs one
level per concurrency C in `--clients`:
C clients start together, each with its own connection (one `httpx.AsyncClient` limited to one
connection), and each sends `--requests-per-client` requests back to back to `POST /v1/completions`
with `stream: true`, `stream_options: {"include_usage": true}`, `temperature: 0`, `max_tokens`, its
prompt taken round-robin from the fixed PROMPTS below (client i, request j gets prompt (i + j) % 8).
A level also stops at `--level-timeout-s`: requests still in flight then are cancelled (the connection
is closed, so the server aborts them) and counted as failed; requests not yet started are not sent and
are reported as `not_started` in the JSON.

Every SSE event is parsed (`data: {...}`, `data: [DONE]`; `: keepalive` comments are skipped). A request
is ok when the response is 200, no `{"error": ...}` event came, the stream ended with `[DONE]` and the
level's time did not run out. Its completion tokens come from the usage chunk (else, if the server sent
none, from the number of content events, i.e. events with non-empty text). Per level:

- requests ok / failed;
- aggregate tokens/s: completion tokens of the ok requests / the level's wall time (first request sent
  to last response finished, or the time limit);
- TTFT p50 / p99 (ms): request sent -> first content event received, over ok requests;
- ITL p50 / p99 (ms): gaps between consecutive content events of one request, pooled over ok requests.
  These are client-side arrival gaps: events the server writes together (it flushes whatever the engine
  has ready in one write) arrive ~0 ms apart, and an event that completes a multi-token character counts
  once;
- mean completion tokens per ok request.

Under the table: "speed-up 16 vs 1", aggregate tokens/s at 16 clients over that at 1 client, both from
this run. The client (asyncio, one process) shares the machine with the server; on a small machine its
own CPU time is part of what is measured. Percentiles interpolate linearly between order statistics.

    .venv/bin/python benchmarks/serving.py --json benchmarks/results/serving.json
    # options: [--model M.tinyloop] [--threads 2] [--clients 1,4,16,32] [--requests-per-client 3]
    #          [--max-tokens 64] [--level-timeout-s 300] [--url http://127.0.0.1:8000] [--quick]
    #          [--warmup N] [--quiet] [--no-plot]
    .venv/bin/python benchmarks/serving.py --json benchmarks/results/serving.json --plot-only   # replot only

With --json the plot (tokens/s, TTFT and ITL by clients) goes next to it as a PNG (benchmarks/plotting.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import ssl
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: local_server
import local_server  # noqa: E402

from tinyloop.tools.progress import progress

PROMPTS = [
    "The king said to his people that",
    "Once upon a time, in a small village by the sea,",
    "The most important thing to remember about cooking rice is",
    "In the morning the old man walked down to the river and",
    "Scientists have long wondered why the sky",
    "She opened the letter slowly, afraid of what it might say:",
    "The history of the city begins in the year",
    "When the train finally stopped, the passengers",
]

QUICK = {"clients": "1,4", "requests_per_client": 2, "max_tokens": 16}
DEFAULTS = {"clients": "1,4,16,32", "requests_per_client": 3, "max_tokens": 64}


def start_server(model: Path | None, threads: int) -> tuple[subprocess.Popen, str]:
    """`tinyloop serve` on a free loopback port; TINYLOOP_MODEL_PATH only when a model is given."""
    return local_server.start_server(model, env={"OMP_NUM_THREADS": str(threads)})


def server_info(url: str) -> dict:
    """What the server says about itself: /health, /api/v0/models (else /v1/models). Best effort."""
    info: dict = {}
    for key, route in (("health", "/health"), ("models", "/api/v0/models"), ("models", "/v1/models")):
        if key in info:
            continue
        try:
            r = httpx.get(url + route, timeout=10)
            if r.status_code == 200:
                info[key] = r.json()
                if key == "models":
                    info["models_route"] = route
        except (httpx.HTTPError, ValueError):
            pass
    return info


def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between order statistics (numpy's default); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


# --mix: TinyLoop's knobs per kind of client (client i sends MIXES[mix[i % len(mix)]])
MIXES = {"plain": {"loops": 8}, "auto": {"loops": "auto"}, "speculative": {"mode": "speculative"}}


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                      extra: dict | None = None) -> dict:
    """One streaming completion; returns its record. Raises only CancelledError/TimeoutError (the caller's)."""
    body = {"model": "tinyloop", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    rec: dict = {"ok": False, "error": None, "status": None, "tokens": 0, "token_source": None,
                 "content_events": 0, "ttft_ms": None, "wall_ms": None, "finish_reason": None, "done": False}
    times: list[float] = []  # arrival time of each content event
    rec["_times"] = times
    usage_tokens = None
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    msg = json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    msg = raw[:200].decode("utf-8", "replace")
                rec["error"] = f"HTTP {r.status_code}: {msg}"
                return rec
            data: list[str] = []

            def dispatch(payload: str) -> None:
                nonlocal usage_tokens
                now = time.perf_counter()
                if rec["done"]:
                    rec["error"] = rec["error"] or "event after [DONE]"
                    return
                if payload == "[DONE]":
                    rec["done"] = True
                    return
                ev = json.loads(payload)
                if "error" in ev:
                    err = ev["error"]
                    rec["error"] = rec["error"] or f"error event: {err.get('message', err) if isinstance(err, dict) else err}"
                    return
                if ev.get("usage"):
                    usage_tokens = ev["usage"]["completion_tokens"]
                for ch in ev.get("choices") or []:
                    if ch.get("text"):
                        times.append(now)
                        rec["content_events"] += 1
                    if ch.get("finish_reason") is not None:
                        rec["finish_reason"] = ch["finish_reason"]

            async for line in r.aiter_lines():
                if line == "":  # end of an SSE event
                    if data:
                        dispatch("\n".join(data))
                        data = []
                elif line.startswith(":"):  # comment (keepalive)
                    continue
                elif line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
                # other SSE fields (event:, id:, retry:) are not used by the server
            if data:  # stream ended without the blank line after its last event
                dispatch("\n".join(data))
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:  # transport failure, malformed event
        rec["error"] = rec["error"] or f"{type(e).__name__}: {e}"
    finally:
        rec["wall_ms"] = (time.perf_counter() - t0) * 1000
    if rec["error"] is None and not rec["done"]:
        rec["error"] = "stream ended without data: [DONE]"
    if times:
        rec["ttft_ms"] = (times[0] - t0) * 1000
    if usage_tokens is not None:
        rec["tokens"], rec["token_source"] = usage_tokens, "usage"
    else:
        rec["tokens"], rec["token_source"] = rec["content_events"], "content_events"
    rec["ok"] = rec["error"] is None
    return rec


async def run_level(url: str, clients: int, requests_per_client: int, max_tokens: int, timeout_s: float,
                    on_request=None, mix: tuple[str, ...] = ()) -> dict:
    """One concurrency level; `on_request()` is called as each request ends (a progress bar)."""
    loop = asyncio.get_running_loop()
    records: list[dict] = []
    not_started = 0
    http_timeout = httpx.Timeout(timeout_s + 30, connect=30)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)

    # Clients are built before the clock starts (building one is slow: an SSL context each unless shared).
    tls = ssl.create_default_context()
    pool = [httpx.AsyncClient(timeout=http_timeout, limits=limits, verify=tls) for _ in range(clients)]

    async def client_task(i: int, deadline: float) -> None:
        nonlocal not_started
        async with pool[i] as client:
            for j in range(requests_per_client):
                if loop.time() >= deadline:
                    not_started += requests_per_client - j
                    return
                p = (i + j) % len(PROMPTS)
                rec = {"client": i, "request": j, "prompt": p}
                holder: dict = {}
                t_send = time.perf_counter()
                try:
                    async with asyncio.timeout_at(deadline):
                        holder = await one_request(client, url, PROMPTS[p], max_tokens,
                                                   MIXES[mix[i % len(mix)]] if mix else None)
                except TimeoutError:
                    holder = {"ok": False, "error": "level time limit: cancelled in flight", "status": None,
                              "tokens": 0, "token_source": None, "content_events": 0, "ttft_ms": None,
                              "wall_ms": (time.perf_counter() - t_send) * 1000, "finish_reason": None,
                              "done": False, "_times": []}
                rec.update(holder)
                records.append(rec)
                if on_request is not None:
                    on_request()
                if not rec["ok"] and rec["error"].startswith("level time limit"):
                    not_started += requests_per_client - j - 1
                    return

    t0 = time.perf_counter()
    deadline = loop.time() + timeout_s
    await asyncio.gather(*(client_task(i, deadline) for i in range(clients)))
    wall = time.perf_counter() - t0

    ok = [r for r in records if r["ok"]]
    ttfts = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
    gaps = [(b - a) * 1000 for r in ok for a, b in zip(r["_times"], r["_times"][1:])]
    tokens = sum(r["tokens"] for r in ok)
    for r in records:
        r.pop("_times", None)
        for k in ("ttft_ms", "wall_ms"):
            if r[k] is not None:
                r[k] = round(r[k], 2)
    rnd = lambda x: None if x is None else round(x, 2)  # noqa: E731
    return {
        "clients": clients, "requests_ok": len(ok), "requests_failed": len(records) - len(ok),
        "requests_not_started": not_started, "wall_s": round(wall, 3),
        "completion_tokens": tokens, "tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        "ttft_p50_ms": rnd(percentile(ttfts, 50)), "ttft_p99_ms": rnd(percentile(ttfts, 99)),
        "itl_p50_ms": rnd(percentile(gaps, 50)), "itl_p99_ms": rnd(percentile(gaps, 99)), "itl_samples": len(gaps),
        "mean_tokens_per_request": round(tokens / len(ok), 2) if ok else None,
        "requests_without_usage": sum(1 for r in ok if r["token_source"] != "usage"),
        "failures": dict(Counter(r["error"] for r in records if not r["ok"])),
        "requests": records,
    }


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a .tinyloop file for the server (default: the server's own default, "
                                    "$TINYLOOP_MODEL_PATH or the shipped model)")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the server it starts (default 2)")
    ap.add_argument("--url", help="benchmark this running server instead of starting one")
    ap.add_argument("--clients", help=f"concurrency levels, comma-separated (default {DEFAULTS['clients']})")
    ap.add_argument("--requests-per-client", type=int, help=f"default {DEFAULTS['requests_per_client']}")
    ap.add_argument("--max-tokens", type=int, help=f"default {DEFAULTS['max_tokens']}")
    ap.add_argument("--level-timeout-s", type=float, default=300.0)
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: levels 1,4, 2 requests per client, 16 tokens (explicit flags still win)")
    ap.add_argument("--mix", default="", help="comma-separated client kinds, client i taking kind i mod n: "
                    f"{', '.join(MIXES)} (default: none, the server's defaults)")
    ap.add_argument("--warmup", type=int, default=0, metavar="N",
                    help="before the levels, N full requests of each --mix kind, not counted (default: one short "
                         "request): what a server that has run a while does")
    ap.add_argument("--json", metavar="PATH", help="write every figure (and each request's record) here")
    ap.add_argument("--no-plot", action="store_true", help="no PNG next to the --json file")
    ap.add_argument("--plot-only", action="store_true", help="only replot the existing --json file; run nothing")
    ap.add_argument("--quiet", action="store_true", help="no progress bar (none is shown off a terminal)")
    args = ap.parse_args()
    if args.plot_only:
        if not args.json:
            ap.error("--plot-only needs --json PATH (the results to plot)")
        from plotting import plot_any

        print(f"wrote {plot_any(args.json)}")
        return 0

    base = QUICK if args.quick else DEFAULTS
    pick = lambda given, key: base[key] if given is None else given  # noqa: E731
    clients_s = pick(args.clients, "clients")
    rpc = pick(args.requests_per_client, "requests_per_client")
    max_tokens = pick(args.max_tokens, "max_tokens")
    try:
        levels = [int(c) for c in clients_s.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--clients: not a comma-separated list of integers: {clients_s!r}")
    if not levels or min(levels) < 1 or rpc < 1 or max_tokens < 1 or args.level_timeout_s <= 0:
        ap.error("levels, --requests-per-client, --max-tokens and --level-timeout-s must be positive")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if args.url and (args.model or args.threads is not None):
        ap.error("--model and --threads apply to a server this script starts; not with --url")
    mix = tuple(k for k in args.mix.split(",") if k)
    if any(k not in MIXES for k in mix):
        ap.error(f"--mix: kinds are {', '.join(MIXES)}; got {args.mix!r}")
    threads = 2 if args.threads is None else args.threads
    if threads < 1:
        ap.error("--threads must be positive")
    model = Path(args.model).resolve() if args.model else None
    if model is not None and not model.is_file():
        ap.error(f"--model: no such file: {model}")

    proc = None
    if args.url:
        url = args.url.rstrip("/")
        local_server.wait_healthy(url)
    else:
        proc, url = start_server(model, threads)
    load_start = os.getloadavg()
    results = []
    try:
        info = server_info(url)
        # not counted: one short request, or with --warmup N, N full requests of each of the mix's kinds (a
        # process's first requests pay one-time costs: the head's cost table, the draft policy's first rounds)
        if args.warmup:
            kinds = max(1, len(mix))
            warm = asyncio.run(run_level(url, kinds, args.warmup, max_tokens, max(args.level_timeout_s, 120),
                                         mix=mix))
        else:
            warm = asyncio.run(run_level(url, 1, 1, min(4, max_tokens), max(args.level_timeout_s, 120)))
        if warm["requests_failed"]:
            print(f"# warm-up request failed: {next(iter(warm['failures']))}", file=sys.stderr, flush=True)
        with progress(total=sum(levels) * rpc, desc="requests", unit="req", quiet=args.quiet) as bar:
            for c in levels:
                bar.set_postfix(clients=c)
                res = asyncio.run(run_level(url, c, rpc, max_tokens, args.level_timeout_s, on_request=bar.update,
                                            mix=mix))
                results.append(res)
                bar.write(f"# level {c}: {res['requests_ok']} ok, {res['requests_failed']} failed, "
                          f"{res['wall_s']:.1f} s", file=sys.stderr)
    finally:
        if proc is not None:
            local_server.stop_server(proc)
    load_end = os.getloadavg()

    served_model = None
    models = info.get("models", {}).get("data") or []
    if models:
        served_model = models[0].get("id")
    by_c = {r["clients"]: r for r in results}
    speedup = None
    if 1 in by_c and 16 in by_c and by_c[1]["tokens_per_s"]:
        speedup = by_c[16]["tokens_per_s"] / by_c[1]["tokens_per_s"]

    print(f"model {served_model or model or '(server default)'}  max_tokens {max_tokens}  "
          f"requests/client {rpc}  server threads {'(external)' if args.url else threads}  "
          f"cpus {os.cpu_count()}  load avg {load_start[0]:.2f} -> {load_end[0]:.2f}")
    print("| clients | ok | failed | wall s | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
          "| tokens/req |")
    print("|--------:|---:|-------:|-------:|---------:|------------:|------------:|-----------:|-----------:"
          "|-----------:|")
    for r in results:
        print(f"| {r['clients']:>7} | {r['requests_ok']:>2} | {r['requests_failed']:>6} | {r['wall_s']:>6.1f} | "
              f"{fmt(r['tokens_per_s'], '8.2f'):>8} | {fmt(r['ttft_p50_ms'], '11.1f'):>11} | "
              f"{fmt(r['ttft_p99_ms'], '11.1f'):>11} | {fmt(r['itl_p50_ms'], '10.1f'):>10} | "
              f"{fmt(r['itl_p99_ms'], '10.1f'):>10} | {fmt(r['mean_tokens_per_request'], '10.1f'):>10} |")
    print(f"speed-up 16 vs 1: {speedup:.2f}x" if speedup is not None
          else "speed-up 16 vs 1: n/a (needs levels 1 and 16 in the same run)")
    for r in results:
        if r["requests_not_started"]:
            print(f"level {r['clients']}: {r['requests_not_started']} requests not started (level time limit)")
        for err, n in r["failures"].items():
            print(f"level {r['clients']}: {n} failed: {err}")
        if r["requests_without_usage"]:
            print(f"level {r['clients']}: {r['requests_without_usage']} ok requests had no usage chunk "
                  f"(tokens counted from content events)")

    if args.json:
        meta = {
            "command": shlex.join([sys.executable, *sys.argv]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "url": url if args.url else None, "started_server": proc is not None,
            "model_arg": str(model) if model else None, "model": served_model,
            "server_threads": None if args.url else threads, "cpu_count": os.cpu_count(),
            "loadavg_start": [round(x, 2) for x in load_start], "loadavg_end": [round(x, 2) for x in load_end],
            "levels": levels, "requests_per_client": rpc, "max_tokens": max_tokens, "mix": list(mix),
            "warmup_requests_per_kind": args.warmup,
            "level_timeout_s": args.level_timeout_s, "temperature": 0.0, "route": "/v1/completions",
            "prompts": PROMPTS, "server_info": info,
        }
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "levels": results,
                                   "speedup_16_vs_1": None if speedup is None else round(speedup, 3)},
                                  indent=2) + "\n")
        print(f"wrote {out}")
        if not args.no_plot:
            from plotting import plot_any

            print(f"wrote {plot_any(out)}")
    return 0 if all(r["requests_failed"] == 0 and r["requests_not_started"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
