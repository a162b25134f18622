"""Schema fuzzing: schemathesis against the server's own OpenAPI document (issue 19).

Starts `tinyloop serve` on a tiny random model (loopback, `TINYLOOP_MAX_TOKENS=16` so that generating
cases stay fast; the document then says 16 too), and runs `schemathesis run` on its /openapi.json with
every built-in check (server errors, status codes, content types, response schemas and headers, schema-
valid requests refused, schema-invalid requests accepted, unsupported methods, ...) over every phase
(examples, coverage, fuzzing, stateful), positive and negative cases.

Two built-in checks are replaced by stricter ones of ours (registered below, loaded by the CLI through
SCHEMATHESIS_HOOKS), because JSON Schema cannot state a few rules that cross fields:

- `tinyloop_positive_acceptance` (for `positive_data_acceptance`): a schema-valid request must succeed,
  unless its 400 is explained by a rule the document states in words, which this check re-derives from
  the request itself (an oracle): prompt_tokens + max_tokens over the context or the KV pool
  (`context_length_exceeded` / `kv_capacity_exceeded`), draft_loops >= verify_loops, K_branches x
  draft_ahead > 64, tree speculation with K_branches > 1 that is not greedy or has a cache window,
  `stream_options` without `stream`, `loops: "auto"` with a speculative mode, with min_loops above its
  max_loops, or with exit_criterion "gate" (the fuzzed model has no exit gate; a gate threshold is at
  most 1), a `kv_loops` budget other than "all" with a speculative mode,
  chat `top_logprobs` without `logprobs: true`, a prompt that alone fills the context (naming `prompt`, or
  `messages` for chat), a constraint the grammar library refuses (an invalid regex, grammar or schema:
  naming `json_schema`, `regex`, `grammar`, `response_format` or `tools`) or more than one of them,
  `tool_choice` without `tools`, a tool message without `tool_call_id`, chat's `max_tokens` and
  `max_completion_tokens` both given and different. The 400 must also name the right
  field. A 408 (the request's own `timeout_s` ran
  out while it was queued) is excused for a `timeout_s` under a second.
- `tinyloop_no_server_error` (for `not_a_server_error`): no 5xx at all, except a 504 `timeout` for a
  request whose own `timeout_s` was under a second (it asked to be dropped if not started by then).

And three more: every error is OpenAI-shaped with the request id (`tinyloop_error_shape`, any status,
405s and 404s included); every SSE body is framed right and its events well-formed, ending in one final
event per choice and `[DONE]` (`tinyloop_sse`); usage and token counts add up (`tinyloop_counts`).

    .venv/bin/python benchmarks/fuzz.py                     # 10,000+ cases (about 3 minutes)
    .venv/bin/python benchmarks/fuzz.py --max-examples 8    # a quick run (tests/server/test_fuzz.py)

Writes benchmarks/results/fuzz.json (cases, failures, seconds, the command).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import schemathesis

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: local_server
import local_server  # noqa: E402
from tinyloop.server.knobs import model_loops  # noqa: E402

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 16
REPLACED = ("not_a_server_error", "positive_data_acceptance")
OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions", "/api/v0/chat/completions", "/api/v0/completions")
NATIVE_MODES = {"/generate": "generate", "/generate/speculative": "speculative",
                "/generate/tree_speculative": "tree_speculative"}
ERROR_KEYS = {"message", "type", "param", "code", "request_id"}
VOCAB = 50257   # the fuzzed model's vocabulary (GPT-2's)


# -- the oracle: which 400s a schema-valid request may get ------------------------------------------------
def _given(body: dict, name: str, default: Any) -> Any:
    value = body.get(name)
    return default if value is None else value


def explained_rejection(path: str, body: Any, error: dict, default_loops: int) -> str | None:
    """Why a schema-valid request may be refused with this 400 (None: it may not). Re-derived from the
    request, and the error must name the field the rule is about."""
    if not isinstance(body, dict):
        return None
    code, param = error.get("code"), error.get("param")
    if code in ("context_length_exceeded", "kv_capacity_exceeded") and param == "max_tokens":
        return code  # depends on the prompt's token count and the pool: no schema can say it
    prompt_field = "messages" if path.endswith("/chat/completions") else "prompt"
    if code == "context_length_exceeded" and param == prompt_field:
        return "the prompt alone fills the context"
    if path.startswith("/v1/") or path.startswith("/api/v0/"):
        if body.get("stream_options") is not None and not body.get("stream") and param == "stream_options":
            return "stream_options without stream"
    if path in NATIVE_MODES:
        mode = NATIVE_MODES[path]
    elif path in OPENAI_ROUTES:  # /v1 takes TinyLoop's knobs as /api/v0 does
        mode = _given(body, "mode", "generate")
    else:
        mode = "generate"
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and param == "logit_bias" and any(int(k) >= VOCAB for k in bias if k.isdigit()):
        return "a logit_bias token id outside the vocabulary (a key pattern cannot state the vocabulary's size)"
    if path.endswith("/chat/completions") and body.get("top_logprobs") and not body.get("logprobs") \
            and param == "top_logprobs":
        return "top_logprobs without logprobs: true"
    given = [n for n in ("json_schema", "regex", "grammar", "response_format", "tools") if body.get(n) is not None]
    if param in given:   # whether a regex, grammar or schema compiles is not something JSON Schema can state
        return "a constraint the grammar library refuses, or more than one constraint"
    if path.endswith("/chat/completions"):
        if param == "max_tokens" and body.get("max_tokens") is not None and body.get("max_completion_tokens") \
                is not None and body["max_tokens"] != body["max_completion_tokens"]:
            return "max_tokens and max_completion_tokens disagree"
        if param == "tool_choice" and body.get("tool_choice") not in (None, "none") and not body.get("tools"):
            return "tool_choice without tools"
        for i, m in enumerate(body.get("messages") or []):
            if isinstance(m, dict) and m.get("role") == "tool" and not m.get("tool_call_id") \
                    and param == f"messages[{i}].tool_call_id":
                return "a tool message without tool_call_id"
    named = model_loops(body["model"]) if isinstance(body.get("model"), str) else None
    if named is not None and param == "loops":
        return "a depth in the model name (model@loops=K) out of range or unlike the body's loops"
    if body.get("loops") is None and named is not None:
        body = {**body, "loops": named}  # the depth the request runs at
    if path.endswith("/completions") and not path.endswith("/chat/completions"):
        if body.get("max_tokens") == 0 and not body.get("echo") and param == "max_tokens":
            return "max_tokens 0 without echo"
        scored = body.get("logprobs") is not None or body.get("max_tokens") == 0
        if body.get("echo") and scored and mode != "generate" and param == "echo":
            return "echo with logprobs or max_tokens 0 (prompt scoring) in a speculative mode"
    if path in NATIVE_MODES:
        if body.get("max_tokens") == 0 and body.get("prompt_logprobs") is None and param == "max_tokens":
            return "max_tokens 0 without prompt_logprobs"
        if body.get("prompt_logprobs") is not None and mode != "generate" and param == "prompt_logprobs":
            return "prompt_logprobs with a speculative mode"
    if _given(body, "kv_loops", "all") != "all" and mode != "generate" and param == "kv_loops":
        return "a loop-shared KV budget with a speculative mode"
    if body.get("loops") == "auto":
        if mode != "generate" and param == "loops":
            return '"auto" loops with a speculative mode'
        if _given(body, "min_loops", 1) > _given(body, "max_loops", default_loops) and param == "min_loops":
            return "min_loops > max_loops"
        if _given(body, "exit_criterion", "latent") == "gate" and param == "exit_criterion":
            return "exit_criterion gate on a model without an exit gate (the fuzzed model has none)"
        if _given(body, "exit_criterion", "latent") == "gate" and _given(body, "exit_threshold", 0.9) > 1 \
                and param == "exit_threshold":
            return "a gate threshold above 1"
    if mode == "generate":
        return None
    draft = _given(body, "draft_loops", 2)
    verify = _given(body, "verify_loops", _given(body, "loops", default_loops))
    if draft >= verify and param == "draft_loops":
        return "draft_loops >= verify_loops"
    if mode != "tree_speculative":
        return None
    k, ahead = _given(body, "K_branches", 1), _given(body, "draft_ahead", 4)
    temperature = _given(body, "temperature", 0.0 if path in NATIVE_MODES else 1.0)
    if k * ahead > 64 and param == "K_branches":
        return "K_branches x draft_ahead > 64"
    if k > 1 and temperature != 0 and param == "temperature":
        return "tree speculation with K_branches > 1 is greedy only"
    if k > 1 and _given(body, "cache_window", 0) != 0 and param == "cache_window":
        return "tree speculation with K_branches > 1 needs cache_window 0"
    return None


def _json(response) -> Any:
    try:
        return json.loads(response.content)
    except (ValueError, UnicodeDecodeError):
        return None


def _content_type(response) -> str:
    """The response's content type (schemathesis may hand a header as a list of values)."""
    ctype = response.headers.get("content-type") or ""
    return ctype[0] if isinstance(ctype, list) else ctype


def _fail(message: str) -> None:
    raise AssertionError(message)


@schemathesis.check
def tinyloop_positive_acceptance(ctx, response, case):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code < 400:
        return None
    if response.status_code in (429, 503):  # load, not the request's fault
        return None
    body = _json(response) or {}
    error = body.get("error") if isinstance(body, dict) else None
    if response.status_code == 400 and isinstance(error, dict):
        if explained_rejection(case.path, case.body, error, int(os.environ.get("TINYLOOP_FUZZ_DEFAULT_LOOPS", 3))):
            return None
    if response.status_code in (408, 504) and _short_timeout(case.body):
        return None
    _fail(f"a schema-valid request was refused ({response.status_code}) and no documented rule explains it: "
          f"{response.text[:300]}")


def _short_timeout(body: Any) -> bool:
    return isinstance(body, dict) and isinstance(body.get("timeout_s"), (int, float)) and body["timeout_s"] < 1


@schemathesis.check
def tinyloop_no_server_error(ctx, response, case):
    if response.status_code < 500:
        return None
    body = _json(response)
    code = body.get("error", {}).get("code") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
    if response.status_code == 504 and code == "timeout" and _short_timeout(case.body):
        return None
    _fail(f"server error {response.status_code}: {response.text[:300]}")


@schemathesis.check
def tinyloop_error_shape(ctx, response, case):
    rid = response.headers.get("x-request-id") or response.headers.get("X-Request-Id")
    rid = rid[0] if isinstance(rid, list) else rid
    if not rid:
        _fail("no X-Request-Id header")
    if response.status_code < 400:
        return None
    body = _json(response)
    if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)
            and set(body["error"]) == ERROR_KEYS and isinstance(body["error"]["message"], str)
            and isinstance(body["error"]["type"], str)):
        _fail(f"error body is not OpenAI-shaped: {response.text[:300]}")
    if body["error"]["request_id"] != rid:
        _fail(f"error body's request_id {body['error']['request_id']!r} is not the header's {rid!r}")


def sse_problems(path: str, raw: bytes, n: int) -> str | None:
    """What is wrong with an SSE body (None: nothing)."""
    if not raw.endswith(b"\n\n"):
        return "body does not end with a blank line"
    frames = [f for f in raw[:-2].split(b"\n\n") if f != b": keepalive"]
    if not frames or frames[-1] != b"data: [DONE]":
        return "the last event is not data: [DONE]"
    finals = 0
    for i, f in enumerate(frames[:-1]):
        if not f.startswith(b"data: ") or b"\n" in f:
            return f"event {i} is not one data line: {f[:80]!r}"
        try:
            ev = json.loads(f[6:])
        except ValueError:
            return f"event {i} is not JSON: {f[:80]!r}"
        if "error" in ev:
            if i != len(frames) - 2 or set(ev) != {"error"} or set(ev["error"]) != ERROR_KEYS:
                return f"bad error event {ev}"
            return None
        if path in NATIVE_MODES:
            if not isinstance(ev.get("token_id"), int) or not isinstance(ev.get("text"), str):
                return f"bad native event {ev}"
            finals += ev["token_id"] == -1
        else:
            want = "chat.completion.chunk" if "chat" in path else "text_completion"
            if ev.get("object") != want or not isinstance(ev.get("choices"), list):
                return f"bad chunk {ev}"
            for choice in ev["choices"]:
                if "chat" in path and "delta" in choice and choice["delta"].get("content") == "":
                    return "empty content delta"
                finals += choice.get("finish_reason") is not None
    if finals != n:
        return f"{finals} final events for n={n}"
    return None


def choices(path: str, body: dict) -> int:
    """Choices a request streams: n, times the prompts of a text completion's batch (a list of strings or
    of token-id lists)."""
    n = int(body.get("n") or 1)
    prompt = body.get("prompt")
    if path.endswith("/completions") and not path.endswith("/chat/completions") and isinstance(prompt, list) \
            and prompt and isinstance(prompt[0], (str, list)):
        return n * len(prompt)
    return n


@schemathesis.check
def tinyloop_sse(ctx, response, case):
    ctype = _content_type(response)
    if response.status_code != 200 or not ctype.startswith("text/event-stream"):
        return None
    if getattr(response, "stream_cut_short", False):  # the client stopped reading (fuzz.toml sets the limit)
        _fail("stream longer than max-stream-events; raise it in benchmarks/fuzz.toml")
    body = case.body if isinstance(case.body, dict) else {}
    problem = sse_problems(case.path, response.content, choices(case.path, body))
    if problem:
        _fail(f"SSE: {problem}; the body ends {response.content[-300:]!r}")


@schemathesis.check
def tinyloop_counts(ctx, response, case):
    ctype = _content_type(response)
    if response.status_code != 200 or not ctype.startswith("application/json"):
        return None
    out, body = _json(response), case.body if isinstance(case.body, dict) else {}
    if case.path in OPENAI_ROUTES:
        u = out["usage"]
        if u["total_tokens"] != u["prompt_tokens"] + u["completion_tokens"]:
            _fail(f"usage does not add up: {u}")
        if len(out["choices"]) != choices(case.path, body):   # n, times a batch's prompts
            _fail(f"{len(out['choices'])} choices for n={body.get('n')} and {choices(case.path, body)} expected")
        cap = body.get("max_completion_tokens") or body.get("max_tokens") or MAX_TOKENS
        if u["completion_tokens"] > cap * len(out["choices"]):
            _fail(f"{u['completion_tokens']} completion tokens over max_tokens {cap}")
    elif case.path in NATIVE_MODES:
        # completion_tokens counts every generated token; a stop token id (EOS) ends the output unshown
        made, shown = out["stats"]["completion_tokens"], len(out["tokens"])
        if not (shown == made or (out["finish_reason"] == "stop" and shown == made - 1)):
            _fail(f"{shown} tokens but stats.completion_tokens {made} ({out['finish_reason']})")
        if len(out["tokens"]) > (body.get("max_tokens") or MAX_TOKENS):
            _fail("more tokens than max_tokens")


# -- running it -----------------------------------------------------------------------------------------
def make_model(path: Path) -> Path:
    from tinyloop.config import preset
    from tinyloop.model import build_model
    from tinyloop.modelfile.loader import write_model
    from tinyloop.tokenizer import Tokenizer

    return write_model(path, build_model(preset("tiny"), seed=0), tokenizer=Tokenizer.gpt2(),
                       provenance={"tool": "benchmarks/fuzz.py"})


class Server:
    """`tinyloop serve` (benchmarks/local_server.py) on the fuzzed model, its output kept for the report."""

    def __init__(self, model: Path, env: dict[str, str] | None = None):
        self.model, self.env = model, {"OMP_NUM_THREADS": "1", "TINYLOOP_MAX_TOKENS": str(MAX_TOKENS), **(env or {})}
        self.log = tempfile.TemporaryFile()

    def __enter__(self) -> "Server":
        self.proc, self.url = local_server.start_server(self.model, env=self.env, log=self.log, timeout_s=120)
        return self

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def __exit__(self, *exc) -> None:
        local_server.stop_server(self.proc, 15)


def run_schemathesis(url: str, *, max_examples: int, seed: int, workers: int = 1, phases: str | None = None,
                     max_time: float | None = None, default_loops: int = 3) -> dict[str, Any]:
    """Run the schemathesis CLI with our checks; returns {cases, failures, errors, seconds, ok, output}."""
    exe = Path(sys.executable).with_name("schemathesis")
    cmd = [str(exe), "--config-file", str(HERE / "fuzz.toml"), "run", url + "/openapi.json", "--seed", str(seed), "--max-examples", str(max_examples),
           "--checks", "all", "--exclude-checks", ",".join(REPLACED), "--workers", str(workers),
           "--request-timeout", "60", "--no-shrink", "--output-sanitize", "false", "--suppress-health-check",
           "all", "--generation-database", "none"]
    if phases:
        cmd += ["--phases", phases]
    if max_time:
        cmd += ["--max-time", str(int(max_time))]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz", "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TINYLOOP_FUZZ_DEFAULT_LOOPS": str(default_loops), "NO_COLOR": "1"}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as cwd:  # schemathesis leaves its state in the working directory
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=cwd)
    seconds = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    m = re.search(r"(\d+) generated, (?:(\d+) found (\d+) unique failures?|(\d+) passed)", out)
    cases = int(m.group(1)) if m else 0
    failures = int(m.group(3)) if m and m.group(3) else 0
    errors = len(re.findall(r"^\s*🚫 ", out, flags=re.M))
    return {"cases": cases, "failures": failures, "errors": errors, "exit_code": proc.returncode,
            "seconds": round(seconds, 1), "ok": proc.returncode == 0 and cases > 0, "output": out,
            "command": " ".join(cmd[3:])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-examples", type=int, default=400, help="cases per operation and phase")
    ap.add_argument("--seed", type=int, default=19)
    ap.add_argument("--workers", type=int, default=1, help="above 1, schemathesis 4.32 reports spurious flaky-generation errors")
    ap.add_argument("--phases", default=None, help="e.g. examples,coverage,fuzzing,stateful (default: all)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "fuzz.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Server(make_model(Path(tmp) / "tiny.tinyloop")) as srv:
        res = run_schemathesis(srv.url, max_examples=args.max_examples, seed=args.seed, workers=args.workers,
                               phases=args.phases)
        tail = srv.output()
    print(res["output"][-6000:])
    server_errors = tail.count("Traceback")
    if server_errors:
        (args.out.parent / "fuzz-server.log").write_text(tail)
    summary = {k: v for k, v in res.items() if k != "output"}
    summary.update(server_tracebacks=server_errors, when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   schemathesis=schemathesis.__version__ if hasattr(schemathesis, "__version__") else None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0 if res["ok"] and not server_errors else 1


if __name__ == "__main__":
    sys.exit(main())
