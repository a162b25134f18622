"""What a vLLM user tripped on (issue 27, item 5): TinyLoop's knobs on /v1, unknown fields refused by name,
clean 400s for bad `loops` and for a prompt that alone fills the context, model names (any name echoed; under
--strict-model-names 404 `model_not_found`; `--served-model-name`, `@loops=K`), /docs without a CDN, route labels, the access line
of a batch, tiny and expired `timeout_s`, /health while no replica serves, and per-token depth under
`loops: "auto"`."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest

from tinyloop.server.app import create_app
from tinyloop.server.settings import Settings
from tinyloop.server.worker import EngineWorker

from .conftest import ServerThread
from .test_http_shapes import assert_error, data_frames, post

TEXT = {"model": "tinyloop", "prompt": "The king said", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "tinyloop", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}


def test_v1_takes_tinyloop_knobs(tiny_server):
    plain = post(tiny_server, "/v1/completions", {**TEXT, "loops": 3}).json()["choices"][0]["text"]
    spec = post(tiny_server, "/v1/completions", {**TEXT, "mode": "speculative", "draft_loops": 1, "verify_loops": 3})
    assert spec.status_code == 200 and spec.json()["choices"][0]["text"] == plain  # greedy speculative = plain
    assert post(tiny_server, "/v1/chat/completions", {**CHAT, "repetition_penalty": 1.3, "cache_window": 5}
                ).status_code == 200
    for body, param in (({"mode": "bogus"}, "mode"), ({"draft_loops": 99}, "draft_loops"),
                        ({"repetition_penalty": 50}, "repetition_penalty"), ({"cache_window": -1}, "cache_window")):
        assert_error(post(tiny_server, "/v1/completions", {**TEXT, **body}), 400, param)


@pytest.mark.parametrize("path,base", [("/v1/completions", TEXT), ("/v1/chat/completions", CHAT),
                                       ("/api/v0/completions", TEXT)])
def test_unknown_fields_are_400_naming_them(tiny_server, path, base):
    err = assert_error(post(tiny_server, path, {**base, "draft_loop": 1}), 400, "draft_loop")
    assert err["code"] == "unknown_parameter" and "unknown field" in err["message"]
    assert post(tiny_server, path, {**base, "user": "u", "metadata": {"k": "v"}, "store": False}).status_code == 200
    doc = httpx.get(tiny_server.url + "/openapi.json").json()["components"]["schemas"]
    assert doc["CompletionRequest"]["additionalProperties"] is False and "mode" in doc["CompletionRequest"]["properties"]


@pytest.mark.parametrize("loops", ["fast", 2.5, True, 0, [2]])
def test_loops_of_any_wrong_value_is_a_clean_400(tiny_server, loops):
    err = assert_error(post(tiny_server, "/v1/completions", {**TEXT, "loops": loops}), 400, "loops")
    assert "more problem" not in err["message"] and '"auto"' in err["message"]
    assert_error(post(tiny_server, "/generate", {"prompt": "x", "loops": loops}), 400, "loops")


def test_context_errors_name_the_prompt_and_chat_max_tokens_0(tiny_server):
    long = "hi " * 300   # the tiny model's context is 256 tokens
    err = assert_error(post(tiny_server, "/v1/completions", {**TEXT, "prompt": long}), 400, "prompt")
    assert err["code"] == "context_length_exceeded" and "shorten the prompt" in err["message"]
    err = assert_error(post(tiny_server, "/v1/chat/completions",
                            {**CHAT, "messages": [{"role": "user", "content": long}]}), 400, "messages")
    assert err["code"] == "context_length_exceeded" and err["message"].startswith("messages:")
    err = assert_error(post(tiny_server, "/v1/completions", {**TEXT, "prompt": "hi " * 200, "max_tokens": 100}),
                       400, "max_tokens")   # fits alone, not with max_tokens
    for field in ("max_tokens", "max_completion_tokens"):
        body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
        err = assert_error(post(tiny_server, "/v1/chat/completions", {**body, field: 0}), 400, field)
        assert "prompt_logprobs" not in err["message"] and "at least 1" in err["message"]
    err = assert_error(post(tiny_server, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 3}), 400,
                       "max_tokens")   # both given and different
    assert "disagree" in err["message"]


def test_model_names(tiny_server, tiny_model_path):
    models = httpx.get(tiny_server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny"]   # the file's stem, not its absolute path
    for name in ("tiny", "tinyloop", str(tiny_model_path), "tinyloop@loops=2", "tiny@loops=auto"):
        r = post(tiny_server, "/v1/completions", {**TEXT, "model": name})
        assert r.status_code == 200 and r.json()["model"] == name, (name, r.text)
    # one model served: any name is accepted and echoed (the seed API: clients hard-code model names), a
    # depth suffix still read; /v1/models/{id} answers for the listed names only
    for name in ("gpt-4o", "tiny2", "tiny@loops=2x", "gpt-4o@loops=2"):
        r = post(tiny_server, "/v1/chat/completions", {**CHAT, "model": name})
        assert r.status_code == 200 and r.json()["model"] == name, (name, r.text)
    assert_error(post(tiny_server, "/v1/chat/completions", {**CHAT, "model": "gpt-4o@loops=99"}), 400, "loops")
    assert_error(httpx.get(tiny_server.url + "/v1/models/gpt-4o"), 404, "model")
    same = {**CHAT, "temperature": 0, "max_tokens": 6}
    assert post(tiny_server, "/v1/chat/completions", {**same, "model": "gpt-4o@loops=2"}).json()["choices"] == \
        post(tiny_server, "/v1/chat/completions", {**same, "loops": 2}).json()["choices"]
    # --strict-model-names: one of the served names (--served-model-name), else 404 model_not_found
    settings = Settings(model_path=tiny_model_path, served_model_names=["org/llm", "llm"], strict_model_names=True)
    with ServerThread(settings) as srv:
        assert [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]] == ["org/llm"]
        assert httpx.get(srv.url + "/v1/models/llm").status_code == 200
        assert post(srv, "/v1/completions", {**TEXT, "model": "llm@loops=2"}).status_code == 200
        for name in ("tinyloop", "gpt-4o", "llm2", "llm@loops=2x"):
            err = assert_error(post(srv, "/v1/chat/completions", {**CHAT, "model": name}), 404, "model")
            assert err["code"] == "model_not_found" and "'org/llm'" in err["message"]
        assert httpx.get(srv.url + "/health").json()["model_id"] == "org/llm"
        doc = httpx.get(srv.url + "/openapi.json").json()["components"]["schemas"]
        assert doc["ChatCompletionRequest"]["properties"]["model"]["pattern"].startswith("^(org/llm|llm)")
    assert "pattern" not in httpx.get(tiny_server.url + "/openapi.json").json()["components"]["schemas"][
        "ChatCompletionRequest"]["properties"]["model"]
    assert Settings.from_env({"TINYLOOP_STRICT_MODEL_NAMES": "1"}).strict_model_names
    assert not Settings.from_env({}).strict_model_names
    with pytest.raises(SystemExit, match="@loops="):
        Settings.from_env({"TINYLOOP_SERVED_MODEL_NAME": "a@loops=2"})


def test_docs_page_is_served_locally_and_routes_are_labelled(tiny_model_path):
    with ServerThread(Settings(model_path=tiny_model_path, api_key="k")) as srv:
        auth = {"Authorization": "Bearer k"}
        page = httpx.get(srv.url + "/docs", headers=auth)
        assert page.status_code == 200 and "/docs/assets/swagger-ui-bundle.js" in page.text
        assert "cdn" not in page.text.lower() and "http://" not in page.text and "https://" not in page.text
        for name in ("swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png"):  # no key needed
            assert httpx.get(f"{srv.url}/docs/assets/{name}").status_code == 200
        assert httpx.get(srv.url + "/openapi.json", headers=auth).status_code == 200
        httpx.get(srv.url + "/no/such/path", headers=auth)
        text = httpx.get(srv.url + "/metrics", headers=auth).text
        for route in ("/docs", "/openapi.json", "/docs/assets/swagger-ui.css"):
            assert f'route="{route}"' in text, route
        assert 'route="unmatched"' in text and 'route="/no/such/path"' not in text


def test_access_line_counts_a_batch(tiny_server):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("tinyloop.access")
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    try:
        r = post(tiny_server, "/v1/completions", {**TEXT, "prompt": ["a b", "c d e"], "n": 2})
        assert r.status_code == 200
        time.sleep(0.2)
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    (line,) = [rec.access for rec in records if rec.access.get("route") == "/v1/completions"]
    usage = r.json()["usage"]
    assert line["completion_tokens"] == usage["completion_tokens"] == 16
    assert line["prompt_tokens"] == usage["prompt_tokens"] and line["n"] == 4


def test_timeouts(tiny_model_path):
    with ServerThread(Settings(model_path=tiny_model_path, max_num_seqs=1)) as srv:
        for route, base in (("/v1/completions", TEXT), ("/generate", {"prompt": "x"})):
            err = assert_error(post(srv, route, {**base, "timeout_s": 5e-324}), 400, "timeout_s")
            assert "0.001" in err["message"]
        batch = srv.app.state.tl.worker.batch
        step = batch.step
        batch.step = lambda: (time.sleep(0.01), step())   # 200 steps outlast the wait below on any host
        done = []
        busy = threading.Thread(target=lambda: done.append(post(srv, "/v1/completions",
                                                                {**TEXT, "max_tokens": 200, "ignore_eos": True})))
        busy.start()   # holds the only place in the batch
        time.sleep(0.3)
        err = assert_error(post(srv, "/v1/completions", {**TEXT, "timeout_s": 0.05}), 408, "timeout_s")
        assert err["code"] == "timeout" and err["type"] == "invalid_request_error"
        busy.join()
        assert done[0].status_code == 200 and done[0].json()["usage"]["completion_tokens"] == 200


class _NoReplicaYet(EngineWorker):
    """A loaded worker whose engines are not serving yet (what `--replicas` reports before a replica is up)."""

    def health(self):
        return {**super().health(), "status": "starting", "reason": "no engine replica is ready yet (0 of 2)"}


def test_health_is_503_until_a_replica_serves(tiny_model_path):
    from fastapi.testclient import TestClient

    app = create_app(Settings(model_path=tiny_model_path), worker_factory=lambda s, m: _NoReplicaYet(s, m))
    with TestClient(app) as client:
        deadline = time.monotonic() + 30
        while app.state.tl.worker.state != "ready":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "starting"
        assert r.json()["error"]["code"] == "not_ready" and "0 of 2" in r.json()["reason"]


def test_per_token_depth_under_auto(tiny_server):
    body = {"prompt": "The king said", "max_tokens": 6, "loops": "auto", "max_loops": 4, "exit_threshold": 5,
            "stream": True}
    events = [json.loads(f) for f in data_frames(httpx.post(tiny_server.url + "/generate", json=body).content)[:-1]]
    depths = [e["loops"] for e in events if e["token_id"] >= 0]
    hist = events[-1]["stats"]["loops_histogram"]
    assert len(depths) == 6 and all(1 <= d <= 4 for d in depths)
    assert {str(d): depths.count(d) for d in set(depths)} == hist
    chunks = [json.loads(f) for f in data_frames(post(tiny_server, "/api/v0/completions", {
        **TEXT, "model": "tinyloop@loops=auto", "max_tokens": 6, "max_loops": 4, "exit_threshold": 5,
        "stream": True}).content)[:-1]]
    streamed = [d for c in chunks for ch in c["choices"] for d in ch.get("loops", [])]
    assert streamed == depths   # the same greedy request: the same exits
    fixed = httpx.post(tiny_server.url + "/generate", json={**body, "loops": 3}).content
    assert b'"loops"' not in fixed   # fixed depth: no per-token field


def test_timeout_statuses():
    """The client's own limit is a 408, the server's default a 504; scale-out replicas answer 504 and the
    ingress, which knows whose limit it was, makes it a 408."""
    from tinyloop.errors import RequestTimeout
    from tinyloop.server.errors import APIError, from_engine_failure

    class Handle:
        client_timeout = True

    assert from_engine_failure(RequestTimeout("late"), Handle()).status == 408
    assert from_engine_failure(APIError(504, "late", code="timeout"), Handle()).status == 408
    assert from_engine_failure(RequestTimeout("late"), None).status == 504
    assert from_engine_failure(APIError(504, "late", code="timeout"), None).status == 504
