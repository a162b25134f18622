"""The prompt cache on disk over HTTP (issue 56, item 3): a server restarted on the same `--prompt-cache-dir`
answers a long prompt from the blocks the last one wrote (the same greedy text as cold, `cached_tokens` in
usage), saved conversations round-trip through `/v1/cache/save` and `/v1/cache/restore` across a restart, a
name cannot leave the directory, and `/metrics` says what the disk cache did."""

from __future__ import annotations

import time

import httpx
import pytest

from conftest import varied_model
from tinyloop.config import preset
from tinyloop.modelfile.loader import write_model
from tinyloop.server.settings import Settings

from .conftest import ServerThread, metric

SYSTEM = "You are a careful assistant who answers in plain words and checks each step twice. " * 12
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who are you?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("pc") / "tiny512.tinyloop"
    write_model(path, varied_model(preset("tiny").replace(max_seq_len=512), seed=0), tokenizer=tokenizer)
    return path


def server(model, cache_dir, **kw):
    return ServerThread(Settings(model_path=model, prompt_cache_dir=cache_dir, **kw))


def eventually(check, timeout: float = 30.0) -> None:
    """The writer works off the engine thread: its files land shortly after the answer."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def complete(srv, prompt=SYSTEM):
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tinyloop", "prompt": prompt, "max_tokens": 8,
                                                       "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"], body["usage"]


def chat(srv, messages=MESSAGES):
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "tinyloop", "messages": messages,
                                                            "max_tokens": 6, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_restart_answers_from_the_disk_cache(model, tmp_path):
    with server(model, tmp_path) as first:
        cold_text, cached, usage = complete(first)
        assert cached == 0 and usage["prompt_tokens"] > 180
        blocks = usage["prompt_tokens"] // 16
        eventually(lambda: metric(first.url, "tinyloop_prompt_cache_files_written_total") >= blocks)
    with server(model, tmp_path) as second:   # a new process's engine: an empty pool, the same directory
        text, cached, usage = complete(second)
        assert text == cold_text
        assert cached == usage["prompt_tokens"] // 16 * 16 or cached == (usage["prompt_tokens"] - 1) // 16 * 16
        assert metric(second.url, "tinyloop_prompt_cache_disk_bytes") > 0
        read = metric(second.url, "tinyloop_prompt_cache_disk_hits_total") + \
            metric(second.url, "tinyloop_prompt_cache_blocks_preloaded_total")
        assert read >= cached // 16 and metric(second.url, "tinyloop_prompt_cache_files_ignored_total") == 0


def test_a_corrupted_file_is_never_served(model, tmp_path, caplog):
    import logging

    with server(model, tmp_path) as first:
        cold_text, _, usage = complete(first)
        blocks = usage["prompt_tokens"] // 16
        eventually(lambda: metric(first.url, "tinyloop_prompt_cache_files_written_total") >= blocks)
    (ns,) = [d for d in tmp_path.iterdir() if d.is_dir() and d.name != "saved"]
    victim = max(ns.glob("*.kvb"), key=lambda f: f.stat().st_mtime_ns)   # the newest: the chain's head
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0x55
    victim.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="tinyloop.engine"), server(model, tmp_path) as second:
        text, cached, _ = complete(second)
        assert text == cold_text and cached == 0     # the head was bad: the whole prompt computed again
        assert metric(second.url, "tinyloop_prompt_cache_files_ignored_total") == 1
    lines = [r.getMessage() for r in caplog.records if "prompt cache" in r.getMessage()]
    assert len(lines) == 1 and "checksum mismatch" in lines[0] and str(victim) in lines[0], lines


def test_without_the_directory_the_routes_say_it_is_off(model):
    with ServerThread(Settings(model_path=model)) as srv:
        r = httpx.post(srv.url + "/v1/cache/save", json={"name": "x", "prompt": "hello"})
        assert r.status_code == 501 and r.json()["error"]["code"] == "prompt_cache_off"


def test_save_and_restore_round_trip_across_a_restart(model, tmp_path):
    with server(model, tmp_path) as first:
        answer, _ = chat(first)
        r = httpx.post(first.url + "/v1/cache/save", json={"name": "agent-7", "messages": MESSAGES}, timeout=120)
        assert r.status_code == 200, r.text
        saved = r.json()
        assert saved["name"] == "agent-7" and saved["saved_tokens"] >= 176 and saved["bytes"] > 0
        assert saved["saved_tokens"] == saved["prompt_tokens"] // 16 * 16 or \
            saved["saved_tokens"] == (saved["prompt_tokens"] - 1) // 16 * 16
        listed = httpx.get(first.url + "/v1/cache").json()["data"]
        assert [e["name"] for e in listed] == ["agent-7"] and listed[0]["saved_tokens"] == saved["saved_tokens"]
    with server(model, tmp_path) as second:
        r = httpx.post(second.url + "/v1/cache/restore", json={"name": "agent-7"}, timeout=120)
        assert r.status_code == 200, r.text
        restored = r.json()
        assert restored["restored_tokens"] == saved["saved_tokens"] and restored["complete"] is True
        text, cached = chat(second)
        assert text == answer and cached >= saved["saved_tokens"]
        r = httpx.post(second.url + "/v1/cache/restore", json={"name": "nobody"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "cache_not_found"
        assert httpx.delete(second.url + "/v1/cache/agent-7").status_code == 200
        assert httpx.delete(second.url + "/v1/cache/agent-7").status_code == 404
        assert httpx.get(second.url + "/v1/cache").json()["data"] == []


BAD_NAMES = ["../escape", "..", "/tmp/abs", "a/b", ".hidden", "a\\b", "x" * 129, "", "ok\n"]


def test_a_name_cannot_leave_the_cache_directory(model, tmp_path):
    victim = tmp_path / "victim.json"
    victim.write_text("{}")
    with server(model, tmp_path / "cache") as srv:
        for name in BAD_NAMES:
            r = httpx.post(srv.url + "/v1/cache/save", json={"name": name, "prompt": "hello there"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_cache_name", (name, r.text)
            assert r.json()["error"]["param"] == "name"
            r = httpx.post(srv.url + "/v1/cache/restore", json={"name": name})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_cache_name", (name, r.text)
        for path in ("/v1/cache/..%2Fvictim", "/v1/cache/..", "/v1/cache/%2E%2E%2Fvictim", "/v1/cache/.hidden"):
            r = httpx.delete(srv.url + path)
            assert r.status_code in (400, 404), (path, r.text)
    assert victim.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["cache", "victim.json"]
