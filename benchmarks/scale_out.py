"""Scale-out on Ray Serve: aggregate tokens/s at 16 streaming clients, one process vs 1 and 2 replicas;
time to healthy; recovery after a replica is SIGKILLed under load (issue 18).

Three servers, one after the other, each started fresh on a loopback port (`local_server.py`), each
engine with --threads T torch threads (default 1):

    single     `tinyloop serve` (no Ray), OMP_NUM_THREADS = T
    1 replica  `tinyloop serve --replicas 1 --replica-cpus T --threads T`
    2 replicas `tinyloop serve --replicas 2 --replica-cpus T --threads T`   (2T threads in all)

On a 2-core machine with T = 1 the two replicas use both cores where the others use one, and they share
those cores with Ray's own processes and the load generator. (T = 2 on 2 cores is a trap on a shared
machine: OpenMP's two threads spin against every other process; see docs/benchmarks.md.) Each server
runs one level of `serving.py`'s load generator (the same client code and accounting): 16 clients, each
sending --requests-per-client greedy streaming /v1/completions back to back. Reported: aggregate
tokens/s (and the ratio to the single process), TTFT p50, time from process start to `/health` "ok"
(every replica loaded), and the summed RSS of the server's process group when idle (Ray's processes in
that group included).

Recovery (2 replicas): 16 clients stream long generations; once all have tokens, one replica (the
first `/health` lists) is SIGKILLed. Reported: streams that ended with an error event (those on the
killed replica) vs completed, seconds from the kill to the last failed stream's error event, to
`/health` "degraded", and to "ok" again with a new replica.

    .venv/bin/python benchmarks/scale_out.py --json benchmarks/results/scale_out.json
    # options: [--model M.tinyloop] [--threads 1] [--requests-per-client 2] [--max-tokens 64] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: local_server, serving
import local_server  # noqa: E402
import serving  # noqa: E402

CLIENTS = 16


def group_rss_mib(pgid: int) -> float:
    """Summed resident memory of every process in the process group `pgid`."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return round(total / 1024, 1)


def start(model: Path | None, args: list[str], threads: int, log: Path) -> tuple:
    env = {"OMP_NUM_THREADS": str(threads), "RAY_TMPDIR": str(log.parent)}
    t0 = time.monotonic()
    proc, url = local_server.start_server(model, env=env, args=args, log=log, timeout_s=600)
    return proc, url, round(time.monotonic() - t0, 2)


def throughput(name: str, model: Path | None, args: list[str], threads: int, opts, tmp: Path) -> dict:
    proc, url, healthy_s = start(model, args, threads, tmp / f"{name}.log")
    try:
        time.sleep(3)  # idle: Ray's processes settled
        rss = group_rss_mib(proc.pid)
        asyncio.run(serving.run_level(url, 2, 1, 8, 120))  # warm-up, not counted
        level = asyncio.run(serving.run_level(url, CLIENTS, opts.requests_per_client, opts.max_tokens, 900))
        health = httpx.get(url + "/health", timeout=10).json()
    finally:
        local_server.stop_server(proc, timeout_s=90)
    level.pop("requests")
    threads_each = [r["threads"] for r in health.get("replicas", {}).get("each", [])] or [threads]
    return {"config": name, "args": args, "threads_per_replica": threads_each, "time_to_healthy_s": healthy_s,
            "idle_rss_mib": rss, **level}


def recovery(model: Path | None, threads: int, opts, tmp: Path) -> dict:
    args = ["--replicas", "2", "--replica-cpus", str(threads), "--threads", str(threads)]
    proc, url, healthy_s = start(model, args, threads, tmp / "recovery.log")
    body = {"model": "tinyloop", "max_tokens": opts.recovery_tokens, "temperature": 0, "stream": True}
    started = threading.Barrier(CLIENTS + 1)
    out: dict[int, dict] = {}

    def client(i: int) -> None:
        rec = {"events": 0, "error_at": None, "done": False}
        out[i] = rec
        with httpx.stream("POST", url + "/v1/completions", json={**body, "prompt": serving.PROMPTS[i % 8]},
                          timeout=600) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    rec["done"] = True
                elif line.startswith("data: {\"error\""):
                    rec["error_at"] = time.monotonic()
                elif line.startswith("data: "):
                    rec["events"] += 1
                    if rec["events"] == 2:
                        started.wait(300)

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        started.wait(300)
        victim = httpx.get(url + "/health", timeout=10).json()["replicas"]["each"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        degraded_s = ok_s = None
        while time.monotonic() - killed < 300:
            h = httpx.get(url + "/health", timeout=10).json()
            if h["status"] == "degraded" and degraded_s is None:
                degraded_s = time.monotonic() - killed
            if h["status"] == "ok" and victim not in {r["pid"] for r in h["replicas"]["each"]}:
                ok_s = time.monotonic() - killed
                break
            time.sleep(0.1)
        for t in threads:
            t.join(600)
        after = httpx.post(url + "/v1/completions", json={**body, "prompt": serving.PROMPTS[0], "stream": False,
                                                          "max_tokens": 8}, timeout=120)
    finally:
        local_server.stop_server(proc, timeout_s=90)
    failed = [r for r in out.values() if r["error_at"] is not None]
    rnd = lambda x: None if x is None else round(x, 2)  # noqa: E731
    return {"config": "recovery", "args": args, "time_to_healthy_s": healthy_s, "streams": CLIENTS,
            "streams_failed_with_error_event": len(failed),
            "streams_completed": sum(r["done"] and r["error_at"] is None for r in out.values()),
            "streams_without_done": sum(not r["done"] for r in out.values()),
            "last_error_event_s": rnd(max((r["error_at"] - killed for r in failed), default=None)),
            "degraded_after_s": rnd(degraded_s), "recovered_after_s": rnd(ok_s),
            "request_after_recovery_status": after.status_code}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="default: the server's own default (the shipped model)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine (default 1)")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--recovery-tokens", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="1 request per client, 16 tokens")
    ap.add_argument("--json", type=Path)
    opts = ap.parse_args()
    if opts.quick:
        opts.requests_per_client, opts.max_tokens, opts.recovery_tokens = 1, 16, 64
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="tlso-", dir="/tmp"))  # Ray's files (short socket paths) and logs
    t = str(opts.threads)
    configs = [("single process", [], opts.threads),
               ("1 replica", ["--replicas", "1", "--replica-cpus", t, "--threads", t], opts.threads),
               ("2 replicas", ["--replicas", "2", "--replica-cpus", t, "--threads", t], opts.threads)]
    rows = [throughput(name, opts.model, args, threads, opts, tmp) for name, args, threads in configs]
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["ratio_vs_single"] = round(r["tokens_per_s"] / base, 3) if base else None
    rows[2]["ratio_vs_1_replica"] = round(rows[2]["tokens_per_s"] / rows[1]["tokens_per_s"], 3)
    rec = recovery(opts.model, opts.threads, opts, tmp)

    print(f"\n{CLIENTS} clients x {opts.requests_per_client} streaming requests of {opts.max_tokens} tokens, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print("| config | threads per replica | time to healthy (s) | idle RSS (MiB) | requests ok | tokens/s "
          "| vs single | TTFT p50 (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['threads_per_replica']} | {r['time_to_healthy_s']} | {r['idle_rss_mib']} "
              f"| {r['requests_ok']}/{r['requests_ok'] + r['requests_failed']} | {r['tokens_per_s']} "
              f"| {r['ratio_vs_single']} | {r['ttft_p50_ms']} |")
    print(f"\nrecovery: {json.dumps(rec)}")
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps({"clients": CLIENTS, "requests_per_client": opts.requests_per_client,
                                         "max_tokens": opts.max_tokens, "cpu_count": os.cpu_count(),
                                         "load_average_end": os.getloadavg(), "model": str(opts.model or "default"),
                                         "throughput": rows, "recovery": rec,
                                         "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
