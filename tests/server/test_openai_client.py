"""The official `openai` client (sync and async) against `tinyloop serve` in a subprocess on loopback."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from .conftest import ServeProcess

KEY = "test-key-123"


@pytest.fixture(scope="module")
def served(tiny_model_path):
    with ServeProcess(tiny_model_path, env={"TINYLOOP_API_KEY": KEY, "TINYLOOP_COMMIT": "abc123"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def model_id(client):
    models = client.models.list()
    assert len(models.data) == 1
    return models.data[0].id


def test_models(client, model_id):
    m = client.models.retrieve(model_id.rsplit("/", 1)[-1].removesuffix(".tinyloop"))
    assert m.id == model_id and m.owned_by == "tinyloop" and isinstance(m.created, int)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_non_stream_and_seed(client, model_id):
    kw = dict(model=model_id, messages=[{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Say something."}],
              max_tokens=12, seed=7, temperature=1.0)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.object == "chat.completion" and a.model == model_id
    assert a.choices[0].message.role == "assistant"
    assert a.choices[0].finish_reason in ("stop", "length")
    assert a.usage.completion_tokens <= 12 and a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens
    assert a.choices[0].message.content == b.choices[0].message.content  # same seed, same text
    assert a.id != b.id
    c = client.chat.completions.create(**{**kw, "seed": 8})
    d = client.chat.completions.create(**{**kw, "seed": 9})
    texts = {a.choices[0].message.content, c.choices[0].message.content, d.choices[0].message.content}
    assert len(texts) > 1, "different seeds should (almost surely) sample different text at temperature 1"


def test_chat_stream_concatenates_to_non_stream(client, model_id):
    kw = dict(model=model_id, messages=[{"role": "user", "content": "Hello"}], max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert len({c.id for c in chunks}) == 1


def test_completions_and_stop(client, model_id, tokenizer):
    base = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert base.object == "text_completion"
    text = base.choices[0].text
    ids = tokenizer.encode(text)
    # a stop string that straddles the boundary between the 2nd and 3rd generated token pieces
    pieces = [tokenizer.decode([i]) for i in ids]
    cut = len(pieces[0]) + len(pieces[1])
    stop = text[cut - 1:cut + 1]
    expect = text[:text.find(stop)]
    got = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=12, temperature=0,
                                    stop=[stop, "never-appears"])
    assert got.choices[0].text == expect and got.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=12,
                                              temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expect
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_async_client(served, model_id):
    async def main():
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        chat = await client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=6, temperature=0)
        parts = []
        async for chunk in await client.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0, stream=True):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
        comp = await client.completions.create(model=model_id, prompt="Hi", max_tokens=5, seed=3)
        streamed = [c async for c in await client.completions.create(model=model_id, prompt="Hi", max_tokens=5,
                                                                       seed=3, stream=True)]
        await client.close()
        return chat, "".join(parts), comp, "".join(c.choices[0].text for c in streamed)

    chat, chat_streamed, comp, comp_streamed = asyncio.run(main())
    assert chat.choices[0].message.content == chat_streamed
    assert comp.choices[0].text == comp_streamed  # same seed: same sample, streamed or not


def test_error_classes(client, served, model_id):
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=msgs, temperature=3.5)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=msgs, n=9)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_id, prompt="Hi", max_tokens=8192)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:   # a malformed body: 400, as OpenAI answers (no 422)
        client.chat.completions.create(model=model_id, messages=[{"role": "robot", "content": "Hi"}])
    assert e.value.status_code == 400 and e.value.body["param"] == "messages[0].role"
    bad = openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=model_id, messages=msgs)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"


def test_auth_everywhere_but_health(served):
    assert httpx.get(served.url + "/health").status_code == 200
    for path in ("/v1/models", "/api/v0/models", "/metrics"):
        r = httpx.get(served.url + path)
        assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code", "request_id"}
        assert r.json()["error"]["request_id"] == r.headers["x-request-id"]
        assert httpx.get(served.url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    r = httpx.post(served.url + "/generate", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401


def test_runtime_commit_from_env(served):
    r = httpx.post(served.url + "/api/v0/completions", json={"model": "tinyloop", "prompt": "Hi", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["runtime"]["commit"] == "abc123"


def test_corrupt_model_answers_503_in_process(tmp_path):
    """The app run in-process (`create_app`) stays up and says why on every route; `tinyloop serve` instead stops at
    once with one line (tests/server/test_serve_startup.py)."""
    from tinyloop.server.settings import Settings

    from .conftest import ServerThread

    bad = tmp_path / "corrupt.tinyloop"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + b"\x00" * 100)
    with ServerThread(Settings(model_path=bad)) as srv:
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503
        body = h.json()
        assert body["status"] == "failed" and "corrupt.tinyloop" in body["reason"] and "not a .tinyloop" in body["reason"]
        for method, path, payload in [("get", "/v1/models", None), ("post", "/generate", {"prompt": "Hi"}),
                                      ("post", "/v1/completions", {"model": "tinyloop", "prompt": "Hi"}),
                                      ("post", "/tokenize", {"text": "Hi"})]:
            r = getattr(httpx, method)(srv.url + path, **({"json": payload} if payload else {}))
            assert r.status_code == 503, path
            err = r.json()["error"]
            assert err["code"] == "model_not_loaded" and "not a .tinyloop" in err["message"]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model="tinyloop", messages=[{"role": "user", "content": "Hi"}])
        assert e.value.status_code == 503
