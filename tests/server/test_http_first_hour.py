"""What a first hour with the server ran into (issue 57, item 6): a JSON body sent the way `curl -d` sends it (a form
content type) is read as JSON, and a body that is not JSON gets an error naming its content type in the route's
own error shape; non-streamed completions say how deep the answer went beside `usage`; `/favicon.ico` is served."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest

FORM = {"content-type": "application/x-www-form-urlencoded"}   # what curl -d sends
AUTO = {"loops": "auto", "exit_threshold": 10, "min_loops": 1, "max_loops": 3}   # every token after the first at 1


def raw(srv, path: str, body: bytes, headers: dict | None = None) -> httpx.Response:
    return httpx.post(srv.url + path, content=body, headers=headers or {}, timeout=60)


@pytest.mark.parametrize("headers", [FORM, {"content-type": "text/plain;charset=UTF-8"}, {}],
                         ids=["form", "text", "none"])
def test_a_json_body_with_curl_s_content_type_is_read_as_json(tiny_server, headers):
    body = {"model": "tinyloop", "prompt": "The king", "max_tokens": 3, "temperature": 0}
    r = raw(tiny_server, "/v1/completions", json.dumps(body).encode(), headers)
    assert r.status_code == 200, r.text
    want = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=60).json()
    assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
    msg = {"model": "tinyloop", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    r = raw(tiny_server, "/v1/messages", json.dumps(msg).encode(), headers)
    assert r.status_code == 200 and r.json()["type"] == "message", r.text
    r = raw(tiny_server, "/generate", b'{"prompt": "Hi", "max_tokens": 2}', headers)
    assert r.status_code == 200 and len(r.json()["tokens"]) == 2, r.text


def test_curl_d_as_a_user_types_it(tiny_server):
    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    out = subprocess.run(["curl", "-s", tiny_server.url + "/v1/chat/completions", "-d",
                          '{"model": "tinyloop", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}'],
                         capture_output=True, text=True, timeout=60).stdout
    assert json.loads(out)["object"] == "chat.completion", out


def test_a_body_that_is_not_json_names_its_content_type_in_each_api_s_shape(tiny_server):
    # form-typed, not JSON: OpenAI's routes 400, Anthropic's shape under /v1/messages, the native routes 422
    r = raw(tiny_server, "/v1/completions", b"prompt=hi", FORM)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_json" and err["type"] == "invalid_request_error"
    assert "application/x-www-form-urlencoded" in err["message"] and "content-type: application/json" in err["message"]
    r = raw(tiny_server, "/v1/messages", b"prompt=hi", FORM)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "application/x-www-form-urlencoded" in r.json()["error"]["message"]
    r = raw(tiny_server, "/generate", b"prompt=hi", FORM)
    assert r.status_code == 422 and "application/x-www-form-urlencoded" in r.json()["error"]["message"]
    r = raw(tiny_server, "/v1/chat/completions", b"", {})
    assert r.status_code == 400 and "content-type is missing" in r.json()["error"]["message"], r.text
    # a content type that is not JSON's at all (curl -F, XML): refused naming it, before the body is read
    r = raw(tiny_server, "/v1/responses", b"--x\r\n", {"content-type": "multipart/form-data; boundary=x"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_content_type" and "'multipart/form-data'" in err["message"]
    r = raw(tiny_server, "/v1/embeddings", b"<x/>", {"content-type": "application/xml"})
    assert r.status_code == 400 and "'application/xml'" in r.json()["error"]["message"]
    # a web page on another origin may send text/plain without a CORS preflight: not read as JSON from a page
    r = raw(tiny_server, "/generate", b'{"prompt": "Hi", "max_tokens": 2}',
            {"content-type": "text/plain", "origin": "http://elsewhere.example"})
    assert r.status_code == 422 and "Origin" in r.json()["error"]["message"], r.text
    # JSON's own types are untouched; unknown paths and wrong methods keep their 404 and 405
    r = raw(tiny_server, "/v1/completions", b"{nope", {"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert raw(tiny_server, "/nope", b"x", FORM).status_code == 404
    assert raw(tiny_server, "/v1/models", b"x", FORM).status_code == 405


def test_non_streamed_answers_say_how_deep_they_went(tiny_server):
    url = tiny_server.url
    body = {"model": "tinyloop", "prompt": "The king", "max_tokens": 6, "temperature": 0, **AUTO}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    # the first token comes from the prompt's pass (max_loops), the rest exit at min_loops
    assert r["loops_histogram"] == {"1": 5, "3": 1} and r["loops_used"] == round(8 / 6, 3), r
    assert list(r)[list(r).index("usage") + 1:] == ["loops_used", "loops_histogram"]   # beside usage
    # the stream says the same token by token (choices[].loops)
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        depths = [d for line in s.iter_lines() if line.startswith("data: {")
                  for c in json.loads(line[6:])["choices"] for d in c.get("loops") or []]
    assert sorted(depths) == [1, 1, 1, 1, 1, 3]
    chat = {"model": "tinyloop", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json={**chat, **AUTO}, timeout=60).json()
    assert sum(r["loops_histogram"].values()) == r["usage"]["completion_tokens"] and r["loops_used"] < 3, r
    # any depth: a fixed one, n choices and a batch of prompts counted together
    r = httpx.post(url + "/v1/chat/completions", json={**chat, "loops": 2, "n": 2}, timeout=60).json()
    assert r["loops_used"] == 2 and r["loops_histogram"] == {"2": r["usage"]["completion_tokens"]}, r
    r = httpx.post(url + "/v1/completions", json={**body, "loops": 4, "prompt": ["a", "b"]}, timeout=60).json()
    assert r["loops_used"] == 4 and r["loops_histogram"] == {"4": r["usage"]["completion_tokens"]}, r
    r = httpx.post(url + "/api/v0/completions", json={**body, "loops": 3}, timeout=60).json()
    assert r["loops_used"] == r["stats"]["loops_used"] == 3


def test_favicon(tiny_server):
    r = httpx.get(tiny_server.url + "/favicon.ico")
    assert r.status_code == 200 and r.headers["content-type"] == "image/x-icon"
    assert r.content[:4] == b"\x00\x00\x01\x00" and b"PNG" in r.content[:40]   # an ICO holding a PNG
