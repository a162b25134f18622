"""Exact response shapes and SSE bytes via httpx against an in-process server on the tiny model."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from tinyloop.server.settings import Settings

from .conftest import ServerThread, metric, sse_events

ERROR_KEYS = {"message", "type", "param", "code", "request_id"}


def post(srv, path, body, **kw):
    return httpx.post(srv.url + path, json=body, timeout=30, **kw)


def data_frames(raw: bytes) -> list[bytes]:
    frames = sse_events(raw)
    for f in frames:
        assert f.startswith(b"data: ") and b"\n" not in f, f  # one data line per event, nothing else
    return [f[len(b"data: "):] for f in frames]


def assert_error(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS
    assert body["error"]["request_id"] == r.headers["x-request-id"]  # the id of the response it is in
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


def test_chat_shape(tiny_server):
    r = post(tiny_server, "/v1/chat/completions", {"model": "tinyloop", "messages": [{"role": "user", "content": "Hi"}],
                                                   "max_tokens": 5, "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and set(body) == {"id", "object", "created", "model", "choices", "usage",
                                                  "loops_used", "loops_histogram"}   # (TinyLoop's: the depth)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{24}", body["id"]) and body["object"] == "chat.completion"
    assert body["model"] == "tinyloop" and abs(body["created"] - time.time()) < 60 and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason"} and choice["index"] == 0
    assert choice["logprobs"] is None   # OpenAI's schema: required, null when not asked for (refusal too)
    assert set(choice["message"]) == {"role", "content", "refusal"} and choice["message"]["role"] == "assistant"
    assert choice["message"]["refusal"] is None
    assert body["usage"]["completion_tokens"] == 5 and choice["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5
    # prompt rendering: "User: Hi\nAssistant:"
    tok = post(tiny_server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert tok["count"] == body["usage"]["prompt_tokens"]
    assert httpx.post(tiny_server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["text"] == "User: Hi\nAssistant:"


def test_completion_shape_and_prompt_forms(tiny_server, tokenizer):
    base = {"model": "tinyloop", "max_tokens": 4, "temperature": 0}
    a = post(tiny_server, "/v1/completions", {**base, "prompt": "The cat"}).json()
    assert set(a) == {"id", "object", "created", "model", "choices", "usage", "loops_used", "loops_histogram"}
    assert a["object"] == "text_completion"
    assert a["id"].startswith("cmpl-") and set(a["choices"][0]) == {"text", "index", "logprobs", "finish_reason"}
    assert a["choices"][0]["logprobs"] is None
    ids = tokenizer.encode("The cat")
    b = post(tiny_server, "/v1/completions", {**base, "prompt": ids}).json()
    c = post(tiny_server, "/v1/completions", {**base, "prompt": ["The cat", "ignored"]}).json()
    d = post(tiny_server, "/v1/completions", {**base, "prompt": [ids]}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"] == c["choices"][0]["text"] == d["choices"][0]["text"]
    assert a["id"] != b["id"]


def test_lmstudio_extras(tiny_server):
    body = {"model": "tinyloop", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "loops": 2,
            "repetition_penalty": 1.3, "cache_window": 16}
    r = post(tiny_server, "/api/v0/chat/completions", body).json()
    assert {"stats", "model_info", "runtime"} <= set(r)
    s = r["stats"]
    assert {"wall_ms", "tokens_per_second", "prompt_tokens", "completion_tokens", "mode", "loops_used"} <= set(s)
    assert s["mode"] == "generate" and s["loops_used"] == 2 and s["completion_tokens"] == 3
    mi = r["model_info"]
    assert mi["quant"] == "fp32" and mi["kv_cache_mode"] == "fp16" and mi["dim"] == 64 and mi["default_loops"] == 3
    assert mi["executor"] == "torch" or mi["executor"].startswith("native (")
    assert r["runtime"]["name"] == "tinyloop" and "version" in r["runtime"]
    models = httpx.get(tiny_server.url + "/api/v0/models").json()["data"]
    assert models[0]["state"] == "loaded" and models[0]["quantization"] == "fp32"


def test_chat_sse_bytes(tiny_server):
    body = {"model": "tinyloop", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0,
            "stream": True}
    r = post(tiny_server, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = data_frames(r.content)
    assert frames[-1] == b"[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert chunks[0]["choices"][0] == {"index": 0, "delta": {"role": "assistant"}, "logprobs": None,
                                       "finish_reason": None}
    for c in chunks:
        assert set(c) == {"id", "object", "created", "model", "choices"} and c["object"] == "chat.completion.chunk"
        assert c["id"] == chunks[0]["id"] and c["model"] == "tinyloop"
    middle = chunks[1:-1]
    assert middle and all(set(c["choices"][0]["delta"]) == {"content"} and c["choices"][0]["delta"]["content"]
                          for c in middle)  # no empty deltas
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    full = post(tiny_server, "/v1/chat/completions", {**body, "stream": False}).json()
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == full["choices"][0]["message"]["content"]
    # include_usage: every chunk has "usage": null, then one usage chunk with no choices before [DONE]
    r = post(tiny_server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    chunks = [json.loads(f) for f in data_frames(r.content)[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]


def test_completion_and_lmstudio_sse(tiny_server):
    r = post(tiny_server, "/api/v0/completions", {"model": "tinyloop", "prompt": "Hi", "max_tokens": 4, "temperature": 0,
                                                  "stream": True})
    frames = data_frames(r.content)
    chunks = [json.loads(f) for f in frames[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "role" not in json.dumps(chunks[0])  # completions have no role chunk
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length" and final["choices"][0]["text"] == ""
    assert final["stats"]["completion_tokens"] == 4 and final["model_info"]["arch"] and final["runtime"]


def test_native_generate_and_sse(tiny_server):
    body = {"prompt": "Hello", "max_tokens": 5}
    r = post(tiny_server, "/generate", body).json()
    assert set(r) == {"tokens", "text", "finish_reason", "stats"} and len(r["tokens"]) == 5
    assert r["stats"]["mode"] == "generate" and r["stats"]["loops_used"] == 3
    s = post(tiny_server, "/generate", {**body, "stream": True})
    frames = data_frames(s.content)
    assert frames[-1] == b"[DONE]"
    events = [json.loads(f) for f in frames[:-1]]
    assert [e["token_id"] for e in events[:-1]] == r["tokens"]
    assert all(set(e) == {"token_id", "text"} for e in events[:-1])
    tail = events[-1]
    assert tail["token_id"] == -1 and tail["finish_reason"] == "length" and tail["stats"]["completion_tokens"] == 5
    assert "".join(e["text"] for e in events) == r["text"]
    # stop as token ids on /generate
    stop_id = r["tokens"][2]
    t = post(tiny_server, "/generate", {**body, "stop": [stop_id]}).json()
    assert t["finish_reason"] == "stop" and stop_id not in t["tokens"]
    assert t["stats"]["completion_tokens"] == len(t["tokens"])  # the stop token is neither returned nor counted


def test_speculative_routes(tiny_server):
    for path, extra in [("/generate/speculative", {"draft_loops": 1, "verify_loops": 3}),
                        ("/generate/tree_speculative", {"draft_loops": 1, "verify_loops": 3, "K_branches": 2})]:
        r = post(tiny_server, path, {"prompt": "Hello", "max_tokens": 4, **extra})
        assert r.status_code == 200 and r.json()["stats"]["mode"] == path.rsplit("/", 1)[-1]
        plain = post(tiny_server, "/generate", {"prompt": "Hello", "max_tokens": 4, "loops": 3}).json()
        assert r.json()["tokens"] == plain["tokens"]
    r = post(tiny_server, "/api/v0/completions", {"model": "tinyloop", "prompt": "Hi", "mode": "speculative", "stream": True})
    assert r.status_code == 200
    assert_error(post(tiny_server, "/api/v0/completions", {"model": "tinyloop", "prompt": "Hi", "mode": "beam"}), 400, "mode")


def test_errors(tiny_server):
    chat = {"model": "tinyloop", "messages": [{"role": "user", "content": "Hi"}]}
    assert_error(post(tiny_server, "/v1/chat/completions", {**chat, "temperature": 2.5}), 400, "temperature")
    assert_error(post(tiny_server, "/v1/chat/completions", {**chat, "n": 9}), 400, "n")
    assert_error(post(tiny_server, "/v1/chat/completions", {**chat, "timeout_s": 0}), 400, "timeout_s")
    assert_error(post(tiny_server, "/v1/chat/completions", {**chat, "max_tokens": 0}), 400, "max_tokens")
    assert_error(post(tiny_server, "/v1/chat/completions", {**chat, "top_p": 0}), 400, "top_p")
    assert_error(post(tiny_server, "/v1/chat/completions", {**chat, "presence_penalty": -3}), 400, "presence_penalty")
    assert_error(post(tiny_server, "/v1/chat/completions", {**chat, "loops": 65}), 400, "loops")
    assert_error(post(tiny_server, "/v1/chat/completions", {**chat, "stop": [""]}), 400, "stop")
    assert_error(post(tiny_server, "/v1/chat/completions", {**chat, "top_logprobs": 2}), 400, "top_logprobs")
    assert_error(post(tiny_server, "/v1/chat/completions", {**chat, "messages": []}), 400, "messages")
    # seeds past 64 bits are taken modulo 2**64 (no range a JSON schema validator could misjudge in floats)
    sampled = {"prompt": "Hi", "max_tokens": 4, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    wide = post(tiny_server, "/generate", {**sampled, "sample_seed": 2**70 + 5})
    assert wide.status_code == 200, wide.text
    assert wide.json()["tokens"] == post(tiny_server, "/generate", {**sampled, "sample_seed": 5}).json()["tokens"]
    assert post(tiny_server, "/v1/chat/completions", {**chat, "seed": -(2**70), "max_tokens": 2}).status_code == 200
    e = assert_error(post(tiny_server, "/v1/completions", {"model": "tinyloop", "prompt": "Hi", "max_tokens": 300}), 400)
    assert e["code"] == "context_length_exceeded"
    assert_error(post(tiny_server, "/v1/completions", {"model": "tinyloop", "prompt": [70000]}), 400, "prompt")
    # a malformed body: 400 on OpenAI's routes (as OpenAI and vLLM answer), 422 on the native ones
    assert_error(post(tiny_server, "/v1/chat/completions", {"model": "tinyloop"}), 400, "messages")
    assert_error(post(tiny_server, "/v1/chat/completions", {**chat, "max_tokens": "lots"}), 400, "max_tokens")
    assert_error(post(tiny_server, "/generate", {"prompt": "Hi", "temprature": 0.5}), 422, "temprature")
    r = httpx.post(tiny_server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert assert_error(r, 400)["code"] == "invalid_json"
    r = httpx.post(tiny_server.url + "/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 422)
    assert_error(httpx.get(tiny_server.url + "/v1/nothing-here"), 404)
    assert_error(httpx.get(tiny_server.url + "/v1/models/other-model"), 404, "model")
    assert_error(httpx.get(tiny_server.url + "/v1/chat/completions"), 405)
    assert_error(post(tiny_server, "/detokenize", {"tokens": [-1]}), 400, "tokens")
    big = {"model": "tinyloop", "prompt": "x" * (1 << 20)}
    assert_error(post(tiny_server, "/v1/completions", big), 413)

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "tinyloop", "prompt": "'
        for _ in range(70):
            yield b"y" * 16384
        yield b'"}'

    assert_error(httpx.post(tiny_server.url + "/v1/completions", content=chunked(),
                            headers={"content-type": "application/json"}), 413)


def test_health_and_metrics(tiny_server):
    h = httpx.get(tiny_server.url + "/health").json()
    assert h["status"] == "ok" and h["kv_cache_mode"] == "fp16" and h["model"].endswith("tiny.tinyloop")
    assert h["executor"] == "torch" or h["executor"].startswith("native (")      # docs/decode.md
    before = metric(tiny_server.url, "tinyloop_generated_tokens_total")
    post(tiny_server, "/generate", {"prompt": "Hi", "max_tokens": 3})
    assert metric(tiny_server.url, "tinyloop_generated_tokens_total") == before + 3
    text = httpx.get(tiny_server.url + "/metrics").text
    for name in ("tinyloop_http_requests_total{", "tinyloop_time_to_first_token_seconds_bucket",
                 "tinyloop_queue_depth ", "tinyloop_active_generations ", "tinyloop_engine_loaded 1.0"):
        assert name in text, name
    assert 'route="/generate"' in text


def test_keepalive_while_engine_busy(tiny_server, monkeypatch):
    """A stream that waits (queued behind another request, or prefilling) gets `: keepalive` comments."""
    monkeypatch.setattr(tiny_server.app.state.tl.settings, "keepalive_s", 0.02)  # read per request
    # one running sequence at a time, so the second request really waits behind the first (a long one: the
    # native executor decodes the tiny model in well under a millisecond a token)
    monkeypatch.setattr(tiny_server.app.state.tl.worker.batch.sched, "max_num_seqs", 1)
    srv = tiny_server
    long = threading.Thread(target=httpx.post, args=(srv.url + "/generate",),
                            kwargs={"json": {"prompt": "Hi", "max_tokens": 200, "loops": 48}, "timeout": 300})
    long.start()
    deadline = time.monotonic() + 30
    while metric(srv.url, "tinyloop_active_generations") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r = post(srv, "/v1/completions", {"model": "tinyloop", "prompt": "Hi", "max_tokens": 2, "stream": True})
    long.join()
    frames = sse_events(r.content)
    assert frames[0] == b": keepalive"
    data = [f for f in frames if not f.startswith(b":")]
    assert data[-1] == b"data: [DONE]" and all(f.startswith(b"data: ") for f in data)


def test_kv_mode_from_env_is_reported(tiny_model_path):
    from tinyloop.model import KVCache
    from tinyloop.config import preset

    try:
        KVCache(preset("tiny"), max_positions=1, loops=1, kv_format="int8")
        supported = True
    except Exception:  # noqa: BLE001
        supported = False
    settings = Settings.from_env({"TINYLOOP_KV_INT8": "1"}, model_path=tiny_model_path)
    with ServerThread(settings) as srv:
        h = httpx.get(srv.url + "/health").json()
        r = post(srv, "/api/v0/completions", {"model": "tinyloop", "prompt": "Hi", "max_tokens": 2})
    assert h["kv_cache_mode_requested"] == "int8"
    if supported:
        assert h["kv_cache_mode"] == "int8" and r.json()["model_info"]["kv_cache_mode"] == "int8"
    else:  # the engine cannot build an int8 cache yet: served in fp16, and /health says why
        assert h["kv_cache_mode"] == "fp16" and any("int8" in w for w in h["warnings"])
        assert r.status_code == 200 and r.json()["model_info"]["kv_cache_mode"] == "fp16"
        assert r.json()["model_info"]["kv_cache_mode_requested"] == "int8"


@pytest.mark.parametrize("env,mode", [({}, "fp16"), ({"TINYLOOP_KV_INT8": "1"}, "int8"),
                                      ({"TINYLOOP_KV_INT4": "1"}, "int4"),
                                      ({"TINYLOOP_KV_INT4": "1", "TINYLOOP_KV_H_MODE": "1"}, "int4-h"),
                                      ({"TINYLOOP_KV_INT4": "true", "TINYLOOP_KV_INT8": "1"}, "int4"),
                                      ({"TINYLOOP_KV_H_MODE": "1"}, "fp16"), ({"TINYLOOP_KV_INT8": "0"}, "fp16")])
def test_kv_env_mapping(env, mode):
    assert Settings.from_env(env).kv_cache_mode == mode


def test_engine_failure_is_500_or_stream_error_event(tiny_server, monkeypatch):
    from tinyloop.engine import fast_steps

    monkeypatch.setattr(fast_steps, "MULTI_STEPS", 1)   # every token a step of its own (the lone steps: below)
    runner = tiny_server.app.state.tl.worker.batch.runner
    real = runner.execute
    calls = {"n": 0}

    def failing(chunks, copies=(), extra=(), **kw):  # the batched step fails after two good steps
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("simulated kernel failure")
        return real(chunks, copies, extra, **kw)

    monkeypatch.setattr(runner, "execute", failing)
    e = assert_error(post(tiny_server, "/v1/completions", {"model": "tinyloop", "prompt": "Hi", "max_tokens": 5}), 500)
    assert e["type"] == "server_error" and "simulated kernel failure" in e["message"]
    calls["n"] = 0
    r = post(tiny_server, "/v1/chat/completions", {"model": "tinyloop", "messages": [{"role": "user", "content": "Hi"}],
                                                   "max_tokens": 5, "stream": True, "temperature": 0})
    assert r.status_code == 200  # the stream had started: the error arrives as an event, then [DONE]
    frames = data_frames(r.content)
    assert frames[-1] == b"[DONE]"
    err = json.loads(frames[-2])
    assert set(err) == {"error"} and "simulated kernel failure" in err["error"]["message"]
    monkeypatch.undo()
    assert post(tiny_server, "/generate", {"prompt": "Hi", "max_tokens": 2}).status_code == 200
    # a lone request's tokens in one native call (engine/fast_steps.py _lone_plain_steps): a failure there too
    ex = tiny_server.app.state.tl.worker.engine.model.executor
    if ex is not None:
        def failing_steps(*a, **kw):
            raise RuntimeError("simulated kernel failure in the lone steps")
        monkeypatch.setattr(ex, "generate", failing_steps)
        e = assert_error(post(tiny_server, "/v1/completions", {"model": "tinyloop", "prompt": "Hi", "max_tokens": 5,
                                                              "temperature": 0}), 500)
        assert "lone steps" in e["message"]
        monkeypatch.undo()
        assert post(tiny_server, "/generate", {"prompt": "Hi", "max_tokens": 9}).status_code == 200


def test_queue_full_is_429(tiny_server, monkeypatch):
    monkeypatch.setattr(tiny_server.app.state.tl.settings, "max_queue", 0)
    r = post(tiny_server, "/generate", {"prompt": "Hi", "max_tokens": 2})
    assert_error(r, 429)
    assert r.headers["retry-after"] == "1"


@pytest.mark.parametrize("raw,want", [("", True), ("auto", True), ("none", False), ("off", False),
                                      ("/x/y.draft.safetensors", "/x/y.draft.safetensors")])
def test_draft_exit_env(raw, want):
    from pathlib import Path

    got = Settings.from_env({"TINYLOOP_DRAFT_EXIT": raw} if raw else {}).draft_exit
    assert got == (Path(want) if isinstance(want, str) else want)


def test_server_drafts_through_the_models_draft_exit(tmp_path, tokenizer):
    """A model with a companion draft-exit file: the server attaches it, reports it in model_info, and a
    speculative request's stats say it drafted through it; TINYLOOP_DRAFT_EXIT=none serves without."""
    from conftest import varied_model
    from tinyloop.config import preset
    from tinyloop.model.draft_exit import DraftExit, write_draft_exits
    from tinyloop.modelfile.loader import write_model

    model = varied_model(preset("tiny"), seed=3)
    path = write_model(tmp_path / "t.tinyloop", model, tokenizer=tokenizer, provenance={"tool": "tests"})
    write_draft_exits(tmp_path / "t.draft.safetensors", {1: DraftExit.from_model(model)}, model.cfg, {})
    body = {"model": "tinyloop", "prompt": "Hello", "max_tokens": 6, "mode": "speculative", "draft_loops": 1,
            "verify_loops": 3, "draft_ahead": 2}
    for env, attached in (({}, True), ({"TINYLOOP_DRAFT_EXIT": "none"}, False)):
        with ServerThread(Settings.from_env(env, model_path=path)) as srv:
            r = post(srv, "/api/v0/completions", body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["stats"]["draft_exit"] is attached
        want = {"file": "t.draft.safetensors", "draft_loops": [1]} if attached else None
        assert out["model_info"]["draft_exit"] == want


def test_events_go_out_as_the_next_steps_gil_free_op_starts(tiny_server, monkeypatch):
    """The engine thread hands a step's events to the event loop as the next step's first long GIL-free op
    starts: the forward when the native executor runs it, else the LM head; every event still arrives, in
    order, and the last ones when the engine goes idle."""
    from tinyloop.engine import fast_steps

    monkeypatch.setattr(fast_steps, "MULTI_STEPS", 1)   # a step a token (a lone request's calls of several: the same hook)
    worker = tiny_server.app.state.tl.worker
    runner = worker.batch.runner
    native = worker.engine.model.executor is not None
    assert runner.before_head == worker._flush_early
    assert runner.before_forward == (worker._flush_early if native else None)
    hook = "before_forward" if native else "before_head"
    calls = []
    monkeypatch.setattr(runner, hook, lambda: (calls.append(len(worker._outbox)), worker._flush_early()))
    r = post(tiny_server, "/generate", {"prompt": "Hello", "max_tokens": 12, "stream": True})
    frames = [json.loads(f[6:]) for f in sse_events(r.content) if f.startswith(b"data: {")]
    assert frames[-1]["token_id"] == -1 and frames[-1]["finish_reason"] in ("stop", "length")
    n = len(frames) - 1  # one event per token, then the final one
    assert [f["token_id"] for f in frames[:-1]] == [f["token_id"] for f in frames[:-1] if f["token_id"] >= 0]
    assert n >= 2 and len(calls) >= n - 1 and sum(calls) >= n - 1  # each later head carried earlier events
