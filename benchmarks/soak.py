"""Soak: 32 concurrent clients against `tinyloop serve` on loopback for a bounded time (issue 19).

Every client loops until the deadline, each time picking at random: a route (/v1 and /api/v0 chat and
completions, /generate and its two speculative routes), streaming or not, a generation mode, loop depth,
max_tokens, stop strings or ids, n, and sometimes a cancellation (the client closes a stream mid-way), a
disconnect (a non-streaming client gives up early) or a malformed request. Every response is checked
completely:

- greedy and seeded outputs against references made one request at a time before the soak starts (the
  model is float64, where batching cannot change a greedy choice: docs/server.md, Determinism; with `--model`,
  a real file such as the shipped int4 one, where the native executor's batch invariance must hold); for
  n > 1 every choice of a greedy request equals the reference, and seeded choice i equals seed + i's;
- usage: prompt_tokens equals the reference's; completion_tokens the tokens made; total their sum;
- SSE framing: `data:` lines and blank lines only (and `: keepalive`), one final event per choice, the
  usage chunk when asked, `[DONE]` last; errors OpenAI-shaped with the request id.

Once a second it samples the server's RSS, open file descriptors and `tinyloop_kv_pages_used`. At the end
the server must be idle with every KV page back. Results: benchmarks/results/soak.json (summary and the
per-second series), quoted in docs/reliability.md.

    .venv/bin/python benchmarks/soak.py               # 30 minutes
    .venv/bin/python benchmarks/soak.py --quick       # 2 minutes
    .venv/bin/python benchmarks/soak.py --minutes 10 --clients 32
    .venv/bin/python benchmarks/soak.py --quick --model shipped --threads 2 --out benchmarks/results/soak-shipped.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: local_server
import local_server  # noqa: E402

HERE = Path(__file__).resolve().parent
PROMPTS = ["The king said to his people that", "Once upon a time", "\u65e5\u672c\u8a9e\u306e\u6587",
           "emoji \U0001F642 test"]
SEEDED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "max_tokens": 16, "loops": 4}  # seeded requests
STOPS = [None, ["\n"], [" the", "e"]]
LOOPS = [2, 4, 8]
LENGTHS = [4, 16, 40]
OPENAI_ROUTES = ["/v1/chat/completions", "/v1/completions", "/api/v0/chat/completions", "/api/v0/completions"]
NATIVE_ROUTES = {"generate": "/generate", "speculative": "/generate/speculative",
                 "tree_speculative": "/generate/tree_speculative"}
ERROR_KEYS = {"message", "type", "param", "code", "request_id"}


# -- the server --------------------------------------------------------------------------------------------
def make_model(path: Path) -> Path:
    """A random `tiny` model in float64 (batch-invariant greedy choices), weights scaled up so that its
    outputs vary from token to token (at init scale a random model repeats one token)."""
    import torch

    from tinyloop.config import preset
    from tinyloop.model import build_model
    from tinyloop.modelfile.loader import write_model
    from tinyloop.tokenizer import Tokenizer

    model = build_model(preset("tiny").replace(max_seq_len=512), seed=0, dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
    return write_model(path, model, tokenizer=Tokenizer.gpt2(), provenance={"tool": "benchmarks/soak.py"})


def start_server(model: Path, log_path: Path, threads: int = 1) -> tuple[subprocess.Popen, str]:
    """JSON access logs into `log_path` (counted at the end)."""
    return local_server.start_server(model, env={"OMP_NUM_THREADS": str(threads), "TINYLOOP_LOG_FORMAT": "json"},
                                     log_level="info", log=log_path, timeout_s=120)


def proc_sample(pid: int) -> tuple[float, int]:
    """(RSS in MiB, open file descriptors) of a process."""
    rss = 0.0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, flags=re.M)
    return float(m.group(1)) if m else float("nan")


# -- requests and their references ---------------------------------------------------------------------------
@dataclass
class Spec:
    """One request: what is sent, and what it must come back as."""
    route: str
    body: dict[str, Any]
    ref_key: tuple | None = None     # the reference it must equal (greedy or seeded), or None
    action: str = "normal"           # normal | cancel | disconnect | bad


def _native_body(rng: random.Random, mode: str) -> dict[str, Any]:
    loops = rng.choice(LOOPS)
    body: dict[str, Any] = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.choice(LENGTHS), "loops": loops,
                            "temperature": 0.0}
    stop = rng.choice(STOPS)
    if stop:
        body["stop"] = stop
    if mode != "generate":
        body.update(draft_loops=rng.choice([1, 2]) if loops > 2 else 1, verify_loops=loops,
                    draft_ahead=rng.choice([2, 4]))
        if mode == "tree_speculative":
            body["K_branches"] = rng.choice([1, 2])
    return body


def reference_key(route: str, body: dict[str, Any]) -> tuple:
    """Requests that must produce the same text: the prompt as the model sees it, the output's loops, length,
    stops and sampling (speculative greedy equals plain greedy at verify_loops)."""
    chat = "chat" in route
    prompt = json.dumps(body.get("messages")) if chat else body.get("prompt")
    loops = body.get("verify_loops") or body.get("loops")
    seed = body.get("seed", body.get("sample_seed")) if body.get("temperature", 0) > 0 else None
    stop = body.get("stop")
    stop = tuple(stop) if isinstance(stop, list) else stop
    return (chat, prompt, loops, body["max_tokens"], stop, seed, body.get("temperature", 0) > 0)


def make_spec(rng: random.Random) -> Spec:
    r = rng.random()
    if r < 0.45:
        mode = rng.choice(["generate", "generate", "speculative", "tree_speculative"])
        route = NATIVE_ROUTES[mode]
        body = _native_body(rng, mode)
        body["stream"] = rng.random() < 0.6
        if rng.random() < 0.15 and mode == "generate":  # seeded sampling
            body.update(SEEDED, sample_seed=rng.randrange(2))
            body.pop("stop", None)
    else:
        route = rng.choice(OPENAI_ROUTES)
        body = {"model": "tinyloop", "max_tokens": rng.choice(LENGTHS), "loops": rng.choice(LOOPS),
                "temperature": 0.0}
        if "chat" in route:
            body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        else:
            body["prompt"] = rng.choice(PROMPTS)
        stop = rng.choice(STOPS)
        if stop:
            body["stop"] = stop
        body["n"] = rng.choice([1, 1, 2, 3])
        if rng.random() < 0.15 and body["n"] == 1:
            body.update(SEEDED, seed=rng.randrange(2))
            body.pop("stop", None)
        if route.startswith("/api/v0") and body["n"] == 1 and body["temperature"] == 0 and rng.random() < 0.4:
            body.update(mode=rng.choice(["speculative", "tree_speculative"]), draft_loops=1,
                        verify_loops=body["loops"], draft_ahead=4)
        body["stream"] = rng.random() < 0.6
        if body["stream"] and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    spec = Spec(route, body, reference_key(route, body))
    a = rng.random()
    if a < 0.06 and body.get("stream"):
        spec.action = "cancel"
    elif a < 0.09 and not body.get("stream"):
        spec.action, body["max_tokens"] = "disconnect", 48
    elif a < 0.12:
        spec.action = "bad"
        spec.body = {**body, rng.choice(["temperature", "n", "loops", "max_tokens"]): rng.choice([-1, "x", 10**6])}
        if "chat" in route and rng.random() < 0.5:
            spec.body["messages"] = []
    return spec


def ref_request(key: tuple) -> tuple[str, dict[str, Any]]:
    """The one request, run alone, that makes the reference for `key`: n=1, not streamed, native for text
    prompts (same tokens as /v1/completions) and /v1/chat/completions for chats."""
    chat, prompt, loops, max_tokens, stop, seed, sampled = key
    if chat:
        body = {"model": "tinyloop", "messages": json.loads(prompt), "max_tokens": max_tokens, "loops": loops,
                "temperature": 0.0}
        route = "/v1/chat/completions"
    else:
        body = {"prompt": prompt, "max_tokens": max_tokens, "loops": loops, "temperature": 0.0}
        route = "/generate"
    if stop:
        body["stop"] = list(stop)
    if sampled:
        body.update(temperature=SEEDED["temperature"], top_k=SEEDED["top_k"], top_p=SEEDED["top_p"])
        body["seed" if chat else "sample_seed"] = seed
    return route, body


@dataclass
class Ref:
    text: str
    prompt_tokens: int
    completion_tokens: int


async def make_reference(client: httpx.AsyncClient, url: str, key: tuple) -> Ref:
    route, body = ref_request(key)
    r = await client.post(url + route, json=body, timeout=120)
    r.raise_for_status()
    out = r.json()
    if route == "/generate":
        return Ref(out["text"], out["stats"]["prompt_tokens"], out["stats"]["completion_tokens"])
    return Ref(out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"])


# -- checking a response ------------------------------------------------------------------------------------
class Corrupt(Exception):
    pass


def need(ok: bool, what: str) -> None:
    if not ok:
        raise Corrupt(what)


def parse_sse(raw: bytes) -> list[Any]:
    need(raw.endswith(b"\n\n"), "SSE body does not end with a blank line")
    out: list[Any] = []
    for f in raw[:-2].split(b"\n\n"):
        if f == b": keepalive":
            continue
        need(f.startswith(b"data: ") and b"\n" not in f, f"bad SSE frame {f[:60]!r}")
        out.append("[DONE]" if f == b"data: [DONE]" else json.loads(f[6:]))
    need(out and out[-1] == "[DONE]", "no [DONE] at the end")
    need(out.count("[DONE]") == 1, "[DONE] more than once")
    return out[:-1]


def check_error(resp: httpx.Response, body: Any) -> None:
    need(isinstance(body, dict) and set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, f"bad error {body}")
    need(body["error"]["request_id"] == resp.headers.get("x-request-id"), "error's request_id is not the header's")


def refs_for(spec: Spec, refs: dict[tuple, Ref], choices: int) -> list[Ref | None]:
    """The reference of every choice (seeded choice i is seed + i's)."""
    if spec.ref_key is None:
        return [None] * choices
    out = []
    for i in range(choices):
        key = spec.ref_key
        if key[6] and i:
            key = (*key[:5], key[5] + i, True)
        out.append(refs.get(key))
    return out


def check_native(spec: Spec, resp: httpx.Response, refs: dict[tuple, Ref]) -> int:
    (ref,) = refs_for(spec, refs, 1)
    if spec.body.get("stream"):
        events = parse_sse(resp.content)
        need(all("error" not in e for e in events), f"error event {events[-1]}")
        final = events[-1]
        need(final.get("token_id") == -1 and all(e["token_id"] >= 0 for e in events[:-1]), "bad native events")
        text = "".join(e["text"] for e in events)
        tokens, stats = [e["token_id"] for e in events[:-1]], final["stats"]
        reason = final["finish_reason"]
    else:
        out = resp.json()
        text, tokens, stats, reason = out["text"], out["tokens"], out["stats"], out["finish_reason"]
    made = stats["completion_tokens"]
    need(len(tokens) == made or (reason == "stop" and len(tokens) == made - 1), "tokens vs completion_tokens")
    need(made <= spec.body["max_tokens"], "more tokens than max_tokens")
    if ref is not None:
        need(text == ref.text, f"text {text!r} != reference {ref.text!r}")
        need(stats["prompt_tokens"] == ref.prompt_tokens and made == ref.completion_tokens, "usage != reference")
    return made


def check_openai(spec: Spec, resp: httpx.Response, refs: dict[tuple, Ref]) -> int:
    chat, n = "chat" in spec.route, spec.body.get("n", 1)
    refs_i = refs_for(spec, refs, n)
    texts = [""] * n
    if spec.body.get("stream"):
        events = parse_sse(resp.content)
        need(all("error" not in e for e in events), f"error event {events[-1] if events else None}")
        finals, usage = 0, None
        for e in events:
            need(e["object"] == ("chat.completion.chunk" if chat else "text_completion"), "bad chunk object")
            if not e["choices"]:
                usage = e["usage"]
                continue
            for c in e["choices"]:
                if chat:
                    texts[c["index"]] += c["delta"].get("content") or ""
                    need(c["delta"].get("content") != "", "empty content delta")
                else:
                    texts[c["index"]] += c["text"]
                finals += c["finish_reason"] is not None
        need(finals == n, f"{finals} final chunks for n={n}")
        want_usage = (spec.body.get("stream_options") or {}).get("include_usage")
        need((usage is not None) == bool(want_usage), "usage chunk present iff asked")
        completion = usage["completion_tokens"] if usage else None
        prompt = usage["prompt_tokens"] if usage else None
        if usage:
            need(usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], "usage total")
    else:
        out = resp.json()
        need(len(out["choices"]) == n, "number of choices")
        for c in out["choices"]:
            texts[c["index"]] = c["message"]["content"] if chat else c["text"]
        u = out["usage"]
        need(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], "usage total")
        completion, prompt = u["completion_tokens"], u["prompt_tokens"]
        if spec.route.startswith("/api/v0"):
            need({"stats", "model_info", "runtime"} <= set(out), "/api/v0 extras missing")
    for text, ref in zip(texts, refs_i):
        if ref is not None:
            need(text == ref.text, f"text {text!r} != reference {ref.text!r}")
    if refs_i[0] is not None and completion is not None and all(r is not None for r in refs_i):
        need(prompt == refs_i[0].prompt_tokens, "prompt_tokens != reference")
        need(completion == sum(r.completion_tokens for r in refs_i), "completion_tokens != references")
    return completion or 0


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    disconnected: int = 0
    refused_as_expected: int = 0
    lost: int = 0
    corrupted: int = 0
    tokens: int = 0
    checked: int = 0      # completed answers whose text was compared with a lone request's (greedy or seeded)
    by_route: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def problem(self, kind: str, spec: Spec, what: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.problems) < 50:
            self.problems.append(f"{kind}: {spec.route} {json.dumps(spec.body)[:300]}: {what}")


async def run_one(client: httpx.AsyncClient, url: str, spec: Spec, refs: dict[tuple, Ref], tally: Tally,
                  rng: random.Random) -> None:
    tally.sent += 1
    tally.by_route[spec.route] = tally.by_route.get(spec.route, 0) + 1
    try:
        if spec.action == "cancel":
            async with client.stream("POST", url + spec.route, json=spec.body, timeout=120) as r:
                need(r.status_code == 200, f"status {r.status_code}")
                stop_after = rng.randint(1, 3)
                async for _ in r.aiter_bytes():
                    stop_after -= 1
                    if stop_after <= 0:
                        break
            tally.cancelled += 1
            return
        if spec.action == "disconnect":
            try:
                await client.post(url + spec.route, json=spec.body, timeout=rng.uniform(0.02, 0.2))
            except httpx.TimeoutException:
                pass
            tally.disconnected += 1
            return
        resp = await client.post(url + spec.route, json=spec.body, timeout=300)
        if spec.action == "bad":
            need(resp.status_code in (400, 422), f"a malformed request got {resp.status_code}")
            check_error(resp, resp.json())
            tally.refused_as_expected += 1
            return
        if resp.status_code != 200:
            tally.problem("lost", spec, f"status {resp.status_code}: {resp.text[:200]}")
            return
        made = check_native(spec, resp, refs) if spec.route in NATIVE_ROUTES.values() else check_openai(spec, resp, refs)
        tally.completed += 1
        tally.tokens += made
        tally.checked += spec.ref_key is not None and refs.get(spec.ref_key) is not None
    except Corrupt as exc:
        tally.problem("corrupted", spec, str(exc))
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        tally.problem("lost", spec, f"{type(exc).__name__}: {exc}")


async def soak(url: str, pid: int, *, seconds: float, clients: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    plans = [make_spec(rng) for _ in range(4000)]
    keys = sorted({p.ref_key for p in plans if p.ref_key is not None}, key=repr)
    refs: dict[tuple, Ref] = {}
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        for key in keys:  # one at a time: references from lone requests
            refs[key] = await make_reference(client, url, key)
        ref_s = time.perf_counter() - t0
        tally = Tally()
        series: list[dict[str, float]] = []
        deadline = time.monotonic() + seconds
        start = time.monotonic()

        async def sampler():
            async with httpx.AsyncClient() as mc:
                while time.monotonic() < deadline + 1:
                    try:
                        text = (await mc.get(url + "/metrics", timeout=10)).text
                        rss, fds = proc_sample(pid)
                        series.append({"t": round(time.monotonic() - start, 1), "rss_mib": round(rss, 1), "fds": fds,
                                       "kv_pages": metric(text, "tinyloop_kv_pages_used"),
                                       "running": metric(text, "tinyloop_running_sequences")})
                    except (httpx.HTTPError, OSError):
                        pass
                    await asyncio.sleep(1.0)

        async def worker(i: int):
            wrng = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                spec = make_spec(wrng)
                if spec.ref_key is not None and spec.ref_key not in refs:
                    spec.ref_key = None  # a combination the reference pass did not meet: checked for shape only
                await run_one(client, url, spec, refs, tally, wrng)

        sampling = asyncio.create_task(sampler())
        await asyncio.gather(*(worker(i) for i in range(clients)))
        elapsed = time.monotonic() - start
        await asyncio.sleep(1.5)  # let aborted requests' pages come back
        final = (await client.get(url + "/metrics")).text
        health = (await client.get(url + "/health")).json()
        await sampling
    rss = [s["rss_mib"] for s in series]
    warm_i = min(len(rss) - 1, max(0, int(len(rss) * 0.1)))  # "warm": after the first tenth of the run
    warm = statistics.median(rss[warm_i:warm_i + 10]) if rss else float("nan")
    end = statistics.median(rss[-10:]) if rss else float("nan")
    return {
        "seconds": round(elapsed, 1), "clients": clients, "seed": seed, "reference_requests": len(refs),
        "reference_seconds": round(ref_s, 1), "sent": tally.sent, "completed": tally.completed,
        "checked_against_reference": tally.checked,
        "cancelled": tally.cancelled, "disconnected": tally.disconnected,
        "refused_as_expected": tally.refused_as_expected, "lost": tally.lost, "corrupted": tally.corrupted,
        "completion_tokens": tally.tokens, "requests_per_s": round(tally.sent / elapsed, 2),
        "by_route": tally.by_route, "problems": tally.problems,
        "rss_mib": {"start": rss[0] if rss else None, "warm": warm, "end": end, "max": max(rss) if rss else None,
                    "end_vs_warm": round(end / warm - 1, 4) if rss else None},
        "fds": {"start": series[0]["fds"] if series else None, "end": series[-1]["fds"] if series else None,
                "max": max(s["fds"] for s in series) if series else None},
        "kv_pages": {"max": max(s["kv_pages"] for s in series) if series else None,
                     "after": metric(final, "tinyloop_kv_pages_used")},
        "aborted_total": metric(final, "tinyloop_aborted_requests_total"),
        "failed_total": metric(final, "tinyloop_failed_requests_total"),
        "health_after": health.get("status"), "queue_depth_after": health.get("queue_depth"),
        "series": series,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--quick", action="store_true", help="2 minutes")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seed", type=int, default=19)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "soak.json")
    ap.add_argument("--model", help="a .tinyloop file (or 'shipped', the packaged default) instead of the random "
                                    "float64 model: its greedy and seeded answers must come back bitwise the "
                                    "same in any batch (the native executor's batch invariance, issue 36)")
    ap.add_argument("--threads", type=int, default=1, help="the server's threads (OMP_NUM_THREADS)")
    args = ap.parse_args()
    minutes = 2.0 if args.quick else args.minutes
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        if args.model is None:
            model = make_model(Path(tmp) / "soak.tinyloop")
        else:
            from tinyloop.modelfile.loader import resolve_model_path
            model = resolve_model_path(None if args.model == "shipped" else args.model)
        proc, url = start_server(model, log, args.threads)
        try:
            res = asyncio.run(soak(url, proc.pid, seconds=minutes * 60, clients=args.clients, seed=args.seed))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        server_log = log.read_text(errors="replace")
    res["server_tracebacks"] = server_log.count("Traceback")
    res["access_log_lines"] = server_log.count('"logger": "tinyloop.access"')
    res["command"] = "benchmarks/soak.py " + " ".join(sys.argv[1:])
    res["model"] = "random tiny, float64" if args.model is None else str(model)
    res["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    ok = (res["lost"] == 0 and res["corrupted"] == 0 and res["kv_pages"]["after"] == 0
          and res["health_after"] == "ok" and res["server_tracebacks"] == 0)
    res["ok"] = ok
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    summary = {k: v for k, v in res.items() if k != "series"}
    print(json.dumps(summary, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
