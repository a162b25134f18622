"""Streaming text on the forced model (whose greedy continuation is known): multi-byte characters split
across tokens, stop strings across token boundaries, and clients that go away mid-generation."""

from __future__ import annotations

import json
import threading
import time

import httpx

from .conftest import FORCED_TEXT, metric, sse_events


def stream_frames(srv, path, body) -> list[dict]:
    r = httpx.post(srv.url + path, json={**body, "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    frames = sse_events(r.content)
    assert frames[-1] == b"data: [DONE]"
    return [json.loads(f[len(b"data: "):]) for f in frames[:-1]]


def test_forced_model_is_what_the_tests_assume(forced_server, forced_chain, tokenizer):
    r = httpx.post(forced_server.url + "/generate", json={"prompt": forced_chain[:1], "max_tokens": 2 * len(forced_chain)},
                   timeout=60).json()
    assert r["tokens"] == (forced_chain[1:] + forced_chain) + forced_chain[:1]
    pieces = [tokenizer.token_bytes(t) for t in forced_chain]
    assert b"\xf0\x9f" in pieces and b"\x99\x82" in pieces  # the emoji is split over two tokens
    assert b" world" in pieces and b" STOP" in pieces


def test_emoji_split_across_tokens_streams_whole_characters(forced_server, forced_chain):
    n = len(forced_chain) - 1
    expect = FORCED_TEXT[len(" Hi"):]
    body = {"model": "tinyloop", "prompt": forced_chain[:1], "max_tokens": n, "temperature": 0}
    chunks = stream_frames(forced_server, "/v1/completions", body)
    deltas = [c["choices"][0]["text"] for c in chunks if c["choices"][0]["finish_reason"] is None]
    assert all(deltas) and not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == expect
    assert deltas[0] == "🙂"  # two tokens, one delta: never half a character
    assert len(deltas) < n  # the tokens holding partial characters produced no delta of their own
    assert any("日本" in d or "日" in d for d in deltas)
    # chat-style chunks over the same route family, and the native stream: empty text until whole
    events = stream_frames(forced_server, "/generate", {"prompt": forced_chain[:1], "max_tokens": n})
    assert [e["token_id"] for e in events[:-1]] == forced_chain[1:]
    assert events[0]["text"] == "" and events[1]["text"] == "🙂"
    assert "".join(e["text"] for e in events) == expect
    assert events[-1]["token_id"] == -1 and events[-1]["text"] == ""


def test_native_tail_event_flushes_incomplete_bytes(forced_server, forced_chain):
    events = stream_frames(forced_server, "/generate", {"prompt": forced_chain[:1], "max_tokens": 1})
    assert events[0] == {"token_id": forced_chain[1], "text": ""}  # first half of the emoji
    tail = events[-1]
    assert tail["token_id"] == -1 and tail["text"] and set(tail["text"]) == {"\ufffd"}
    assert tail["finish_reason"] == "length"


def test_stop_string_across_token_boundary(forced_server, forced_chain):
    stop = "rld ST"  # end of " world" + start of " STOP"
    expect = FORCED_TEXT[len(" Hi"):FORCED_TEXT.index(stop)]
    body = {"model": "tinyloop", "prompt": forced_chain[:1], "max_tokens": 40, "temperature": 0, "stop": stop}
    r = httpx.post(forced_server.url + "/v1/completions", json=body, timeout=60).json()
    assert r["choices"][0]["text"] == expect and r["choices"][0]["finish_reason"] == "stop"
    chunks = stream_frames(forced_server, "/v1/completions", body)
    deltas = [c["choices"][0]["text"] for c in chunks]
    assert "".join(deltas) == expect and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any("rld" in d or "STOP" in d for d in deltas)  # the partial match was held back, then dropped
    # native: stop strings (held back), and the same through /api/v0 with a list of stops
    native = httpx.post(forced_server.url + "/generate", json={"prompt": forced_chain[:1], "max_tokens": 40,
                                                               "stop": ["zzz", stop]}, timeout=60).json()
    assert native["text"] == expect and native["finish_reason"] == "stop"
    events = stream_frames(forced_server, "/generate", {"prompt": forced_chain[:1], "max_tokens": 40, "stop": stop})
    assert "".join(e["text"] for e in events) == expect and events[-1]["finish_reason"] == "stop"
    v0 = stream_frames(forced_server, "/api/v0/completions", {**body, "stop": ["zzz", stop]})
    assert "".join(c["choices"][0]["text"] for c in v0) == expect


def wait_idle(url: str, limit: float) -> float:
    t0 = time.monotonic()
    while metric(url, "tinyloop_active_generations") != 0:
        assert time.monotonic() - t0 < limit, "the engine kept generating for a client that left"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_disconnect_mid_stream_aborts_and_frees(forced_server, forced_chain):
    url = forced_server.url
    aborted0 = metric(url, "tinyloop_aborted_requests_total")
    tokens0 = metric(url, "tinyloop_generated_tokens_total")
    body = {"prompt": forced_chain[:1], "max_tokens": 8000, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", url + "/generate", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few token events, then hang up
            assert all(g.startswith("data: ") or g == "" for g in got)
            assert metric(url, "tinyloop_active_generations") == 1
    elapsed = wait_idle(url, 1.0)  # the request's generation stopped (its KV cache freed) within a second
    assert metric(url, "tinyloop_aborted_requests_total") == aborted0 + 1
    assert metric(url, "tinyloop_generated_tokens_total") - tokens0 < 8000
    # the engine is free for the next request at once
    r = httpx.post(url + "/generate", json={"prompt": forced_chain[:1], "max_tokens": 3}, timeout=30)
    assert r.json()["tokens"] == forced_chain[1:4], elapsed


def test_disconnect_while_waiting_for_non_stream_result(forced_server, forced_chain):
    url = forced_server.url
    aborted0 = metric(url, "tinyloop_aborted_requests_total")
    try:
        httpx.post(url + "/v1/completions", json={"model": "tinyloop", "prompt": forced_chain[:1], "max_tokens": 8000},
                   timeout=httpx.Timeout(30, read=1.0))
        raise AssertionError("an 8000-token generation should outlast a 1 s read timeout")
    except httpx.ReadTimeout:
        pass
    wait_idle(url, 1.5)  # 0.25 s disconnect poll + one token
    assert metric(url, "tinyloop_aborted_requests_total") == aborted0 + 1


def test_concurrent_streams_queue_and_all_complete(forced_server, forced_chain):
    results: dict[int, str] = {}

    def run(i: int) -> None:
        events = stream_frames(forced_server, "/generate", {"prompt": forced_chain[i:i + 1], "max_tokens": 6})
        results[i] = [e["token_id"] for e in events[:-1]]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    cyc = forced_chain * 2
    assert results == {i: cyc[i + 1:i + 7] for i in range(4)}
