"""Logprobs over HTTP (issue 17): OpenAI's shapes, parsed by the openai SDK, equal to the engine's log_softmax."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from tinyloop.engine import Engine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return Engine.load(tiny_model_path)


def test_chat_and_completion_logprobs_match_the_engine(tiny_server, engine):
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="x")
    r = client.chat.completions.create(model="tinyloop", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    ids = httpx.post(f"{tiny_server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
    out = engine.generate(ids, SamplingParams(max_tokens=5, logprobs=3))
    logits = engine.logits(ids + out.token_ids)
    for i, c in enumerate(content):
        want = torch.log_softmax(logits[len(ids) - 1 + i].double(), -1)[out.token_ids[i]]
        assert c.logprob == pytest.approx(float(want), abs=1e-4)
        assert bytes(c.bytes) == engine.tokenizer.token_bytes(out.token_ids[i])
    r = client.completions.create(model="tinyloop", prompt="The king", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)   # 2 alternatives (fewer if their text collides)
    assert all(v >= lp.token_logprobs[i] for i, top in enumerate(lp.top_logprobs) for v in list(top.values())[:1])


def test_streamed_logprobs_come_with_each_chunk(tiny_server):
    body = {"model": "tinyloop", "prompt": "The king", "max_tokens": 4, "temperature": 0, "logprobs": 1, "stream": True}
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    n = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"] and c["choices"][0].get("logprobs"))
    assert n == 4


def test_logprobs_requests_that_cannot_be_served(tiny_server):
    url = tiny_server.url
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tinyloop", "messages": [{"role": "user", "content": "Hi"}],
                                                       "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    r = httpx.post(f"{url}/v1/completions", json={"model": "tinyloop", "prompt": "Hi", "logprobs": 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text


def test_speculative_modes_report_plain_decodings_logprobs(tiny_server):
    body = {"model": "tinyloop", "prompt": "The king said", "max_tokens": 6, "temperature": 0, "logprobs": 2,
            "ignore_eos": True}
    plain = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    for mode in ("speculative", "tree_speculative"):
        r = httpx.post(f"{tiny_server.url}/api/v0/completions", json={**body, "mode": mode, "draft_loops": 1},
                       timeout=60)
        got = r.json()["choices"][0]["logprobs"]
        assert r.status_code == 200 and got["tokens"] == plain["tokens"], r.text
        assert got["token_logprobs"] == pytest.approx(plain["token_logprobs"], abs=1e-4)


def test_native_generate_logprobs(tiny_server, engine):
    r = httpx.post(f"{tiny_server.url}/generate", json={"prompt": [5, 17, 42], "max_tokens": 4, "temperature": 0,
                                                        "logprobs": 2})
    body = r.json()
    assert r.status_code == 200 and len(body["logprobs"]) == len(body["tokens"]), r.text
    logits = engine.logits([5, 17, 42] + body["tokens"])
    for i, (tok, lp) in enumerate(zip(body["tokens"], body["logprobs"])):
        assert lp["logprob"] == pytest.approx(float(torch.log_softmax(logits[2 + i].double(), -1)[tok]), abs=1e-4)
        assert len(lp["top_logprobs"]) == 2 and lp["top_logprobs"][0]["token_id"] == tok
    with httpx.stream("POST", f"{tiny_server.url}/generate", json={"prompt": [5, 17, 42], "max_tokens": 4,
                                                                   "temperature": 0, "logprobs": 1, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert [e["logprob"] for e in events if e["token_id"] >= 0] == pytest.approx([x["logprob"] for x in body["logprobs"]])
