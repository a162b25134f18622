"""Request ids, structured access logs, several API keys, CORS (issue 19)."""

from __future__ import annotations

import io
import json
import logging

import httpx
import pytest

from tinyloop.server.access import setup_logging
from tinyloop.server.settings import Settings

from .conftest import ServerThread

KEYS = ("key-one-0123456789", "key-two-abcdefghij")


@pytest.fixture(scope="module")
def keyed(tiny_model_path):
    with ServerThread(Settings(model_path=tiny_model_path, api_key=",".join(KEYS),
                               cors_origins=["https://app.example"])) as srv:
        yield srv


@pytest.fixture
def json_log():
    root = logging.getLogger("tinyloop")
    saved = root.level, root.propagate
    buf = io.StringIO()
    handler = setup_logging("json", "info", stream=buf)
    yield buf
    root.removeHandler(handler)
    root.setLevel(saved[0])
    root.propagate = saved[1]


def auth(i=0):
    return {"Authorization": f"Bearer {KEYS[i]}"}


def access_lines(buf) -> list[dict]:
    return [rec for rec in map(json.loads, buf.getvalue().splitlines()) if rec["logger"] == "tinyloop.access"]


def test_request_id_accepted_or_generated_everywhere(keyed):
    r = httpx.get(keyed.url + "/health", headers={"X-Request-Id": "client-id-42"})
    assert r.headers["x-request-id"] == "client-id-42"
    generated = {httpx.get(keyed.url + "/health").headers["x-request-id"] for _ in range(3)}
    assert len(generated) == 3 and all(g.startswith("req-") for g in generated)
    # an unusable id (too long, odd characters) is replaced, not echoed
    r = httpx.get(keyed.url + "/health", headers={"X-Request-Id": "bad id\twith spaces" + "x" * 200})
    assert r.headers["x-request-id"].startswith("req-")
    # on every kind of response: 401, 404, 405, 413, 422, SSE
    for r in (httpx.get(keyed.url + "/v1/models"), httpx.get(keyed.url + "/nope", headers=auth()),
              httpx.get(keyed.url + "/generate", headers=auth()),
              httpx.post(keyed.url + "/generate", headers=auth(), json={"prompt": 5})):
        assert r.headers["x-request-id"].startswith("req-") and r.json()["error"]["request_id"] == r.headers["x-request-id"]
    with httpx.stream("POST", keyed.url + "/generate", headers={**auth(), "X-Request-Id": "stream-1"},
                      json={"prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
        assert r.headers["x-request-id"] == "stream-1" and r.read().endswith(b"data: [DONE]\n\n")


def test_access_log_lines_are_structured(keyed, json_log):
    httpx.post(keyed.url + "/v1/completions", headers={**auth(1), "X-Request-Id": "log-me-1"},
               json={"model": "tinyloop", "prompt": "Hello there", "max_tokens": 5, "loops": 2, "n": 2, "temperature": 0})
    httpx.post(keyed.url + "/generate", headers={**auth(), "X-Request-Id": "log-me-2"},
               json={"prompt": "Hi", "max_tokens": 4, "stream": True})
    httpx.post(keyed.url + "/generate", headers={**auth(), "X-Request-Id": "log-me-3"}, json={"prompt": ""})
    lines = {rec["request_id"]: rec for rec in access_lines(json_log)}
    a = lines["log-me-1"]
    assert a["route"] == "/v1/completions" and a["method"] == "POST" and a["status"] == 200
    assert a["loops"] == 2 and a["n"] == 2 and a["completion_tokens"] == 10 and a["prompt_tokens"] > 0
    assert a["duration_ms"] > 0 and a["mode"] == "generate"
    b = lines["log-me-2"]
    assert b["stream"] is True and b["completion_tokens"] == 4 and b["status"] == 200
    assert lines["log-me-3"]["status"] == 400


def test_engine_log_lines_carry_the_request_id(keyed, json_log, monkeypatch):
    from tinyloop.engine.sampling import Sampler

    def broken(self, token):   # (every token passes `accept`; a plain sampled draw skips `sample`)
        raise RuntimeError("boom")

    monkeypatch.setattr(Sampler, "accept", broken)
    r = httpx.post(keyed.url + "/generate", headers={**auth(), "X-Request-Id": "engine-log-1"},
                   json={"prompt": "Hi", "max_tokens": 3, "temperature": 1.0})
    assert r.status_code == 500
    recs = [json.loads(line) for line in json_log.getvalue().splitlines()]
    worker = [rec for rec in recs if rec["logger"] == "tinyloop.server" and "boom" in rec["message"]]
    assert worker and all(rec["request_id"] == "engine-log-1" for rec in worker)


def test_several_keys_and_keys_never_logged(keyed, json_log):
    for i in range(2):
        assert httpx.get(keyed.url + "/v1/models", headers=auth(i)).status_code == 200
    for bad in ("", "Bearer", "Bearer key-one", f"Bearer {KEYS[0]}x", f"Basic {KEYS[0]}", f"Bearer {','.join(KEYS)}"):
        r = httpx.get(keyed.url + "/v1/models", headers={"Authorization": bad} if bad else {})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(keyed.url + "/health").status_code == 200  # open
    text = json_log.getvalue()
    assert text and not any(k in text for k in KEYS)


def test_cors_is_off_by_default_and_configurable(keyed, tiny_server):
    origin = {"Origin": "https://app.example"}
    r = httpx.get(tiny_server.url + "/health", headers=origin)
    assert "access-control-allow-origin" not in r.headers  # default server: no CORS at all
    r = httpx.options(tiny_server.url + "/v1/completions",
                      headers={**origin, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers
    # configured: the allowed origin gets the headers (a preflight needs no key), another origin does not
    pre = httpx.options(keyed.url + "/v1/completions", headers={**origin, "Access-Control-Request-Method": "POST",
                                                                 "Access-Control-Request-Headers": "authorization"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-request-id" in pre.headers
    r = httpx.get(keyed.url + "/v1/models", headers={**origin, **auth()})
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    other = httpx.get(keyed.url + "/v1/models", headers={"Origin": "https://evil.example", **auth()})
    assert "access-control-allow-origin" not in other.headers


def test_settings_from_env():
    s = Settings.from_env({"TINYLOOP_API_KEY": " a , b ,", "TINYLOOP_CORS_ORIGINS": "https://x, https://y",
                           "TINYLOOP_LOG_FORMAT": "JSON", "TINYLOOP_MAX_TOKENS": "64"})
    assert s.api_keys == ["a", "b"] and s.cors_origins == ["https://x", "https://y"]
    assert s.log_format == "json" and s.max_tokens == 64 and s.prefix_caching
    assert not Settings.from_env({"TINYLOOP_PREFIX_CACHING": "off"}).prefix_caching
    for bad in ({"TINYLOOP_MAX_TOKENS": "0"}, {"TINYLOOP_MAX_TOKENS": "9000"}, {"TINYLOOP_LOG_FORMAT": "xml"},
                {"TINYLOOP_PREFIX_CACHING": "maybe"}):
        with pytest.raises(SystemExit):
            Settings.from_env(bad)
