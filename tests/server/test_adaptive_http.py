"""loops "auto" over HTTP (issue 16): accepted on every generate route, refused with speculative modes."""

from __future__ import annotations

import httpx


def test_auto_loops_on_the_routes(tiny_server):
    url = tiny_server.url
    r = httpx.post(f"{url}/api/v0/completions", json={"model": "tinyloop", "prompt": "The king", "max_tokens": 6,
                                                       "temperature": 0, "loops": "auto", "exit_threshold": 10,
                                                       "min_loops": 1, "max_loops": 3})
    assert r.status_code == 200, r.text
    stats = r.json()["stats"]
    # threshold 10 exits every generated token at min_loops; the first token comes from the prompt (max_loops)
    assert stats["loops_histogram"] == {"1": 5, "3": 1} and stats["loops_used"] == round(8 / 6, 3)
    r = httpx.post(f"{url}/generate", json={"prompt": "The king", "max_tokens": 4, "loops": "auto"})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tinyloop", "messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 4, "loops": "auto"})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/api/v0/completions", json={"model": "tinyloop", "prompt": "The king", "max_tokens": 4,
                                                      "loops": "auto", "mode": "speculative"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "loops", r.text
    r = httpx.post(f"{url}/generate", json={"prompt": "The king", "loops": "auto", "min_loops": 5, "max_loops": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_loops", r.text
    r = httpx.post(f"{url}/generate", json={"prompt": "The king", "loops": "deep"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "loops", r.text   # a clean 400, not a 422


def test_loops_per_token_histogram_metric(tiny_server):
    from .conftest import metric

    before = metric(tiny_server.url, 'tinyloop_loops_per_token_bucket{le="1.0"}')
    r = httpx.post(f"{tiny_server.url}/generate", json={"prompt": "The king", "max_tokens": 5, "loops": "auto",
                                                        "exit_threshold": 10, "min_loops": 1, "max_loops": 3})
    assert r.status_code == 200, r.text
    assert metric(tiny_server.url, 'tinyloop_loops_per_token_bucket{le="1.0"}') == before + 4


def test_kv_loops_over_http(tiny_server):
    url = tiny_server.url
    r = httpx.post(f"{url}/generate", json={"prompt": "The king", "max_tokens": 4, "loops": 3, "kv_loops": "last"})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/v1/completions", json={"model": "tinyloop", "prompt": "The king", "max_tokens": 4, "kv_loops": 2})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/generate/speculative", json={"prompt": "The king", "kv_loops": "last"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_loops", r.text
    r = httpx.post(f"{url}/generate", json={"prompt": "The king", "kv_loops": "half"})
    assert r.status_code == 422, r.text
    info = httpx.get(f"{url}/api/v0/models").json()["data"][0]
    assert "kv_loops" in str(info)


def test_tokenize_takes_the_names_other_servers_use(tiny_server):
    url = tiny_server.url
    want = httpx.post(f"{url}/tokenize", json={"text": "The king"}).json()["tokens"]
    for name in ("prompt", "content"):
        r = httpx.post(f"{url}/tokenize", json={name: "The king"})
        assert r.status_code == 200 and r.json()["tokens"] == want, r.text
    r = httpx.post(f"{url}/tokenize", json={"text": "a", "prompt": "b"})
    assert r.status_code in (400, 422) and r.json()["error"]["param"] == "text", r.text


def test_response_format_types(tiny_server):
    """text and json_object run (issue 27: structured output, tests/server/test_structured.py); json_schema
    without its schema is a 400 naming response_format; another type, or a key OpenAI's response_format does not
    have, is a 400 naming it (as OpenAI answers: no 422 on its routes)."""
    body = {"model": "tinyloop", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for fmt in ({"type": "json_object"}, {"type": "text"}):
        r = httpx.post(f"{tiny_server.url}/v1/chat/completions", json={**body, "response_format": fmt})
        assert r.status_code == 200, r.text
    r = httpx.post(f"{tiny_server.url}/v1/chat/completions", json={**body, "response_format": {"type": "json_schema"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    for fmt, param, code in (({"type": "xml"}, "response_format.type", "invalid_value"),
                             ({"type": "json_object", "schema": {"type": "object"}}, "response_format.schema",
                              "unknown_parameter"),
                             ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "foo": 1}},
                              "response_format.json_schema.foo", "unknown_parameter"),
                             ({"type": "text", "json_schema": {"name": "x", "schema": {}}},
                              "response_format.json_schema", "invalid_value")):
        r = httpx.post(f"{tiny_server.url}/v1/chat/completions", json={**body, "response_format": fmt})
        err = r.json()["error"]
        assert r.status_code == 400 and (err["param"], err["code"]) == (param, code), (fmt, r.text)


def test_max_seq_len_setting_is_checked(tiny_model_path):
    import pytest as _pytest

    from tinyloop.server.settings import Settings
    from tinyloop.server.worker import load_engine

    with _pytest.raises(SystemExit, match="must be a positive number"):
        Settings.from_env({"TINYLOOP_MAX_SEQ_LEN": "0"})
    engine, warnings = load_engine(Settings.from_env({"TINYLOOP_MAX_SEQ_LEN": "100000"}, model_path=tiny_model_path))
    assert any("above the model's context" in w for w in warnings)
    engine, _ = load_engine(Settings.from_env({"TINYLOOP_MAX_SEQ_LEN": "64"}, model_path=tiny_model_path))
    assert engine.model_info()["max_seq_len"] == engine.max_seq_len == 64


def test_undecodable_and_too_deep_bodies_get_the_malformed_json_error(tiny_server):
    for body in (b"\xff\xfe{", ("[" * 5000 + "]" * 5000).encode()):
        r = httpx.post(f"{tiny_server.url}/v1/chat/completions", content=body,
                       headers={"content-type": "application/json"})
        err = r.json()["error"]   # OpenAI's routes: a 400 (as OpenAI answers), the native ones a 422
        assert r.status_code == 400 and err["code"] == "invalid_json" and "not valid JSON" in err["message"], r.text
        r = httpx.post(f"{tiny_server.url}/generate", content=body, headers={"content-type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 422 and err["code"] == "invalid_type" and "not valid JSON" in err["message"], r.text
