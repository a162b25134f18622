"""The default speculation against plain decoding, idle and beside a busy neighbour (issue 57 item 5), on the routes a
user takes: `python` (Engine.generate: the Engine's own persistent core), `http` (a `tinyloop serve` subprocess, one
streaming client on `/v1/completions`, after the server's own warm-up) and `generate` (one `tinyloop generate
--stats` process a request: a fresh process whose policy knows nothing yet; its `wall_ms`, the load not counted).

Phases alternate (`--phases`, default idle,busy,idle,busy); a busy phase runs `--neighbours` processes spinning
`while True: pass` (started by this program, killed at the phase's end), so the host's two cores are shared as with
another user's job beside the server. In each phase each route runs `--reps` pairs of passes over serving.py's eight
prompts (greedy, `--tokens` each, ignore_eos), plain (the route's default: loops 8) and `mode: "speculative"` with
every knob at its default, their order swapped every pair; a pair's ratio is plain time / speculative time, and a
phase's figure the median of its pairs (`generate`: a pass is the sum of the eight requests' wall_ms). Each
speculative request's stats give the policy's mean k (`draft_ahead_chosen`), its plain rounds and the acceptance.

    .venv/bin/python benchmarks/spec_busy.py [--routes python,http,generate] [--phases idle,busy,idle,busy]
        [--reps 3] [--tokens 64] [--neighbours 1] [--threads 2] [--json benchmarks/results/spec_busy.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks/: local_server, serving's prompts
import local_server  # noqa: E402
from serving import PROMPTS  # noqa: E402

SPEC = {"mode": "speculative"}
PLAIN = {"loops": 8}


class Neighbour:
    """`n` processes spinning a core each, while the context is open."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs = []


def summary(stats: list[dict]) -> dict:
    spec = [s for s in stats if s.get("draft_ahead_chosen") is not None]
    if not spec:
        return {}
    return {"k_mean": round(statistics.mean(s["draft_ahead_chosen"] for s in spec), 2),
            "plain_rounds": sum(s.get("plain_rounds", 0) for s in spec),
            "rounds": sum(s.get("rounds", 0) for s in spec),
            "acceptance": round(statistics.mean(s.get("acceptance_rate") or 0 for s in spec), 3)}


class PythonRoute:
    name = "python"

    def __init__(self, tokens: int):
        from tinyloop.engine import Engine, SamplingParams
        self.eng = Engine.load()
        self.P = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, **PLAIN)
        self.S = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, **SPEC)
        self.outs: dict = {}

    def run(self, spec: bool) -> tuple[float, list[dict]]:
        t, sts = 0.0, []
        for p in PROMPTS:
            t0 = time.perf_counter()
            r = self.eng.generate(p, self.S if spec else self.P)
            t += time.perf_counter() - t0
            sts.append(r.stats)
            self.outs.setdefault((p, spec), r.token_ids)
        return t, sts

    def exact(self) -> bool:
        return all(self.outs[p, True] == self.outs[p, False] for p in PROMPTS)

    def close(self):
        pass


class HttpRoute:
    name = "http"

    def __init__(self, tokens: int, threads: int, path: str):
        self.path = path
        self.proc, self.url = local_server.start_server(None, env={"OMP_NUM_THREADS": str(threads)})
        self.client = httpx.Client(timeout=300, limits=httpx.Limits(max_connections=1))
        self.tokens = tokens
        self.outs: dict = {}

    def one(self, prompt: str, extra: dict) -> tuple[str, dict]:
        body = {"model": "tinyloop", "prompt": prompt, "max_tokens": self.tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, **extra}
        text, stats = [], {}
        with self.client.stream("POST", self.url + self.path, json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                for ch in ev.get("choices") or []:
                    text.append(ch.get("text") or "")
                stats = ev.get("stats") or stats   # (/api/v0 only: the policy's figures)
        return "".join(text), stats

    def run(self, spec: bool) -> tuple[float, list[dict]]:
        t, sts = 0.0, []
        for p in PROMPTS:
            t0 = time.perf_counter()
            text, st = self.one(p, SPEC if spec else PLAIN)
            t += time.perf_counter() - t0
            sts.append(st)
            self.outs.setdefault((p, spec), text)
        return t, sts

    def exact(self) -> bool:
        return all(self.outs[p, True] == self.outs[p, False] for p in PROMPTS)

    def close(self):
        self.client.close()
        local_server.stop_server(self.proc)


class GenerateRoute:
    name = "generate"

    def __init__(self, tokens: int, threads: int):
        self.exe = str(Path(sys.executable).with_name("tinyloop"))
        self.tokens, self.env = tokens, {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.outs: dict = {}

    def run(self, spec: bool) -> tuple[float, list[dict]]:
        t, sts = 0.0, []
        for p in PROMPTS:
            cmd = [self.exe, "generate", p, "--max-tokens", str(self.tokens), "--temperature", "0", "--stats",
                   *(["--mode", "speculative"] if spec else ["--loops", "8"])]
            r = subprocess.run(cmd, capture_output=True, text=True, env=self.env, check=True)
            st = json.loads(r.stderr.strip().splitlines()[-1])
            t += st["wall_ms"] / 1000
            sts.append(st)
            self.outs.setdefault((p, spec), r.stdout)
        return t, sts

    def exact(self) -> bool:
        return all(self.outs[p, True] == self.outs[p, False] for p in PROMPTS)

    def close(self):
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routes", default="python,http,generate")
    ap.add_argument("--phases", default="idle,busy,idle,busy")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--neighbours", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--http-path", default="/v1/completions",
                    help="/api/v0/completions: the same run, with the policy's figures in the last chunk's stats")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    routes = []
    for name in args.routes.split(","):
        if name == "python":
            routes.append(PythonRoute(args.tokens))
        elif name == "http":
            routes.append(HttpRoute(args.tokens, args.threads, args.http_path))
        elif name == "generate":
            routes.append(GenerateRoute(args.tokens, args.threads))
        else:
            ap.error(f"--routes: python, http, generate; got {name!r}")
    rows = []
    try:
        for r in routes:   # (warm: the python route's core and policy, the server's first requests)
            if r.name != "generate":
                r.run(False)
                r.run(True)
        for phase in args.phases.split(","):
            with Neighbour(args.neighbours if phase == "busy" else 0):
                for r in routes:
                    load0 = os.getloadavg()[0]
                    ratios, sts, tp_all, ts_all = [], [], [], []
                    for i in range(args.reps):
                        if i % 2 == 0:
                            tp, _ = r.run(False)
                            ts, st = r.run(True)
                        else:
                            ts, st = r.run(True)
                            tp, _ = r.run(False)
                        ratios.append(tp / ts)
                        sts += st
                        tp_all.append(tp)
                        ts_all.append(ts)
                    n = len(PROMPTS) * args.tokens
                    row = {"phase": phase, "route": r.name, "x_plain": round(statistics.median(ratios), 3),
                           "pairs": [round(x, 3) for x in ratios],
                           "plain_ms_per_token": round(1000 * statistics.median(tp_all) / n, 3),
                           "spec_ms_per_token": round(1000 * statistics.median(ts_all) / n, 3),
                           "loadavg": round(load0, 2), **summary(sts)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        exact = {r.name: r.exact() for r in routes}
        print("exact (speculative text == plain text):", exact)
    finally:
        for r in routes:
            r.close()
    for route in dict.fromkeys(row["route"] for row in rows):
        for phase in ("idle", "busy"):
            xs = [row["x_plain"] for row in rows if row["route"] == route and row["phase"] == phase]
            if xs:
                print(f"{route:9s} {phase}: x_plain {', '.join(f'{x:.3f}' for x in xs)}")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"command": shlex.join([sys.executable, *sys.argv]),
                "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "cpu_count": os.cpu_count(),
                "prompts": PROMPTS, "tokens": args.tokens, "neighbours": args.neighbours, "threads": args.threads}
        out.write_text(json.dumps({"meta": meta, "rows": rows, "exact": exact}, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
