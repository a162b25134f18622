"""Prefix caching over HTTP (issue 17): a repeated system prompt is reported as cached, in OpenAI's usage
shape, streamed and not, and the text does not change."""

from __future__ import annotations

import openai
import pytest

from .conftest import metric

SYSTEM = "You are a careful assistant who answers in plain words. " * 6   # ~70 tokens: several full blocks


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def chat(client, question: str, **kw):
    return client.chat.completions.create(
        model="tinyloop", max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], **kw)


def test_a_repeated_system_prompt_is_served_from_the_cache(client, tiny_server):
    before = metric(tiny_server.url, "tinyloop_prompt_tokens_cached_total")
    first = chat(client, "Who are you?")
    again = chat(client, "Who are you?")
    other = chat(client, "Where is it?")
    hit = again.usage.prompt_tokens_details.cached_tokens
    assert hit >= 64 and hit % 16 == 0 and hit < again.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content
    assert other.usage.prompt_tokens_details.cached_tokens >= 64          # the shared system prompt
    assert metric(tiny_server.url, "tinyloop_prompt_tokens_cached_total") >= before + 2 * 64


def test_streamed_usage_reports_cached_tokens(client):
    chat(client, "Tell me more.")
    stream = chat(client, "Tell me more.", stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens >= 64


def test_completions_and_native_report_cached_tokens(client, tiny_server):
    import httpx

    prompt = SYSTEM + "Once upon a time"
    client.completions.create(model="tinyloop", prompt=prompt, max_tokens=3, temperature=0)
    c = client.completions.create(model="tinyloop", prompt=prompt, max_tokens=3, temperature=0)
    assert c.usage.prompt_tokens_details.cached_tokens >= 64
    r = httpx.post(tiny_server.url + "/generate", json={"prompt": prompt, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["stats"]["prompt_tokens_cached"] >= 64
