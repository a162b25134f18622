"""Anthropic's Messages API (server/anthropic/routes.py) through the official `anthropic` SDK against a local server:
messages.create, messages.stream (the same answer as create at temperature 0, events in Anthropic's order),
stop sequences, a tool-use round trip (held to the tool's input_schema, parsed as the chat route parses its
calls), count_tokens (the prompt create prefills), TinyLoop's knobs, and bad input as Anthropic-shaped
errors raised as the SDK's own exception classes."""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest

from conftest import varied_model
from tinyloop.config import preset
from tinyloop.errors import ValidationError
from tinyloop.modelfile.loader import write_model
from tinyloop.server.anthropic.routes import MessagesFramer, partial_object
from tinyloop.server.fields import param_of
from tinyloop.server.errors import APIError
from tinyloop.server.settings import Settings

from .conftest import ServerThread, agent_bin

anthropic = pytest.importorskip("anthropic")

KEY = "messages-key"
MODEL = "tinyloop"
HELLO = [{"role": "user", "content": "Hello, who are you?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                              "unit": {"type": "string", "enum": ["c", "f"]}},
                            "required": ["city", "unit"]}}
GREEDY = {"temperature": 0}   # the sampling fields as extra_body: newer SDKs have no keyword for them
CLOCK = {"name": "now", "description": "The time", "input_schema": {"type": "object", "properties": {}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    """A random tiny model with a 512-token context (the generic tool prompt takes ~200), behind an API key."""
    path = tmp_path_factory.mktemp("messages") / "tiny512.tinyloop"
    write_model(path, varied_model(preset("tiny").replace(max_seq_len=512), seed=0), tokenizer=tokenizer)
    with ServerThread(Settings(model_path=path, api_key=KEY)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def chat(server, **body):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, **body},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_create(client, server):
    m = client.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, system="Be brief.", messages=HELLO)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 1 <= m.usage.output_tokens <= 12 and m.usage.input_tokens + m.usage.cache_read_input_tokens > 5
    assert m._request_id and m._request_id.startswith("req-")
    # the chat route's answer to the same conversation: one path, one answer
    same = chat(server, messages=[{"role": "system", "content": "Be brief."}, *HELLO], max_tokens=12, temperature=0)
    assert same["message"]["content"] == m.content[0].text
    assert {"length": "max_tokens", "stop": "end_turn"}[same["finish_reason"]] == m.stop_reason
    # system as text blocks, a turn as text blocks, consecutive user turns: all one turn's text, blocks joined
    blocks = client.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY,
                                    system=[{"type": "text", "text": "Be"}, {"type": "text", "text": "brief.",
                                                                             "cache_control": {"type": "ephemeral"}}],
                                    messages=[{"role": "user", "content": [{"type": "text", "text": "Hello,"}]},
                                              {"role": "user", "content": "who are you?"}])
    joined = chat(server, messages=[{"role": "system", "content": "Be\n\nbrief."},
                                    {"role": "user", "content": "Hello,\n\nwho are you?"}], max_tokens=12, temperature=0)
    assert text_of(blocks) == joined["message"]["content"]
    # a conversation with an earlier assistant turn (its thinking is not shown to the model)
    turns = [*HELLO, {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                       {"type": "text", "text": "A model."}]},
             {"role": "user", "content": "And?"}]
    later = client.messages.create(model=MODEL, max_tokens=8, messages=turns, metadata={"user_id": "u1"},
                                   thinking={"type": "disabled"}, extra_body={**GREEDY, "top_k": 5, "top_p": 0.9})
    want = chat(server, messages=[*HELLO, {"role": "assistant", "content": "A model."}, {"role": "user", "content": "And?"}],
                max_tokens=8, temperature=0, top_k=5, top_p=0.9)
    assert text_of(later) == want["message"]["content"]


def test_stream_equals_create(client):
    kw = dict(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=HELLO)
    full = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text_of(full) and [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in full.content]
    assert final.stop_reason == full.stop_reason and final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        full.usage.input_tokens + full.usage.cache_read_input_tokens
    assert final.id.startswith("msg_") and final.model == MODEL


def test_stream_events_in_order(server):
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                   json={"model": MODEL, "max_tokens": 6, "temperature": 0, "messages": HELLO, "stream": True},
                   timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = []
    for raw in r.content.decode().split("\n\n")[:-1]:
        event, data = raw.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        name, obj = event[7:], json.loads(data[6:])
        assert obj["type"] == name
        names.append(name)
        if name == "message_start":
            assert obj["message"]["content"] == [] and obj["message"]["stop_reason"] is None
        if name == "message_delta":
            assert obj["delta"]["stop_reason"] == "max_tokens" and obj["usage"]["output_tokens"] == 6
    names = [n for n in names if n != "ping"]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}


def test_stop_sequences(client):
    kw = dict(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=HELLO)
    text = text_of(client.messages.create(**kw))
    stop = text[3:5]
    m = client.messages.create(**kw, stop_sequences=["never there", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop and text_of(m) == text[:text.find(stop)]
    with client.messages.stream(**kw, stop_sequences=[stop]) as s:
        assert "".join(s.text_stream) == text_of(m)
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_tool_use_round_trip(client, server):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=MODEL, max_tokens=64, extra_body=GREEDY, tools=[WEATHER, CLOCK])
    m = client.messages.create(**kw, messages=ask, tool_choice={"type": "any"})
    calls = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(calls) == 1, m
    call = calls[0]
    assert call.id.startswith("toolu_") and call.name in ("get_weather", "now")
    if call.name == "get_weather":   # held to input_schema token by token
        assert call.input["city"] in ("Paris", "Rome") and call.input["unit"] in ("c", "f")
    # the chat route's call for the same request: the same constraint, the same parse
    same = chat(server, messages=ask, max_tokens=64, temperature=0, tool_choice="required",
                tools=[{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                         "parameters": t["input_schema"]}} for t in (WEATHER, CLOCK)])
    (openai_call,) = same["message"]["tool_calls"]
    assert openai_call["function"]["name"] == call.name and json.loads(openai_call["function"]["arguments"]) == call.input
    # streamed: the same call, its input as input_json_delta fragments
    with client.messages.stream(**kw, messages=ask, tool_choice={"type": "any"}) as s:
        events = list(s)
        final = s.get_final_message()
    assert any(e.type == "input_json" for e in events)
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (call.name, call.input) and final.stop_reason == "tool_use"
    # a named tool
    named = client.messages.create(**kw, messages=ask, tool_choice={"type": "tool", "name": "get_weather"})
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_weather"]
    # the result goes back as a tool_result block; the model answers (tool_choice none: text only)
    result = client.messages.create(**kw, tool_choice={"type": "none"}, messages=[
        *ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"},
                                     {"type": "text", "text": "Thanks."}]}])
    assert result.stop_reason in ("end_turn", "max_tokens") and [b.type for b in result.content] == ["text"]
    err = client.messages.create(**kw, tool_choice={"type": "auto", "disable_parallel_tool_use": True}, messages=[
        *ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                                      "content": [{"type": "text", "text": "no network"}]}]}])
    assert err.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_what_claude_code_sends(client, server):
    """Claude Code's requests: system messages between turns, context edits that clear thinking, adaptive
    thinking and an effort, cache_control on blocks, a JSON user id in metadata."""
    kw = dict(model=MODEL, max_tokens=8, system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
              metadata={"user_id": json.dumps({"session_id": "s"})})
    turns = [*HELLO, {"role": "system", "content": "Answer in English."}]
    m = client.messages.create(**kw, messages=turns, thinking={"type": "adaptive"}, output_config={"effort": "high"},
                               extra_body={**GREEDY, "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                                                                       "keep": "all"}]}})
    want = chat(server, messages=[{"role": "system", "content": "Be brief."}, *HELLO,
                                  {"role": "system", "content": "Answer in English."}], max_tokens=8, temperature=0)
    assert text_of(m) == want["message"]["content"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**kw, messages=turns, extra_body={"context_management": {"edits": [
            {"type": "clear_tool_uses_20250919"}]}})
    anthropic_error(e.value, "invalid_request_error", "context_management.edits[0].type", "clear_tool_uses_20250919")


def test_max_tokens_past_the_context(client, server):
    """max_tokens is a ceiling: past the room the prompt leaves it is lowered to that room, and an answer that
    fills it ends with model_context_window_exceeded; past the server's TINYLOOP_MAX_TOKENS it is refused."""
    kw = dict(model=MODEL, max_tokens=4000, messages=HELLO, extra_body={**GREEDY, "ignore_eos": True})
    n_prompt = client.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens
    m = client.messages.create(**kw)
    assert m.stop_reason == "model_context_window_exceeded" and m.usage.output_tokens == 512 - n_prompt
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "model_context_window_exceeded" and text_of(final) == text_of(m)
    fits = client.messages.create(**{**kw, "max_tokens": 512 - n_prompt})
    assert fits.stop_reason == "max_tokens" and text_of(fits) == text_of(m)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**{**kw, "max_tokens": 8193})
    anthropic_error(e.value, "invalid_request_error", "max_tokens", "8192", "TINYLOOP_MAX_TOKENS")


def test_count_tokens(client):
    kw = dict(model=MODEL, system="Be brief.", messages=HELLO)
    counted = client.messages.count_tokens(**kw)
    m = client.messages.create(**kw, max_tokens=2)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 5
    with_tools = client.messages.count_tokens(**kw, tools=[WEATHER], tool_choice={"type": "any"})
    t = client.messages.create(**kw, max_tokens=2, tools=[WEATHER], tool_choice={"type": "any"})
    assert with_tools.input_tokens == t.usage.input_tokens + t.usage.cache_read_input_tokens > counted.input_tokens + 50


def test_tinyloop_knobs(client, server):
    kw = dict(model=MODEL, max_tokens=8, messages=HELLO)
    m = client.messages.create(**kw, extra_body={**GREEDY, "loops": 2})
    assert text_of(m) == chat(server, messages=HELLO, max_tokens=8, temperature=0, loops=2)["message"]["content"]
    spec = client.messages.create(**kw, extra_body={**GREEDY, "loops": 2, "mode": "speculative", "draft_loops": 1})
    assert text_of(spec) == text_of(m)   # greedy speculation is exact
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**kw, extra_body={"loops": 0})
    assert e.value.body["error"]["message"].startswith("loops:")


def anthropic_error(exc, kind: str, *words: str) -> dict:
    body = exc.body
    assert set(body) == {"type", "error", "request_id"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert body["request_id"] == exc.response.headers["request-id"] == exc.request_id
    for w in words:
        assert w in body["error"]["message"], body
    return body


def test_bad_input_is_anthropic_shaped(client, server):
    ok = dict(model=MODEL, max_tokens=4, messages=HELLO)
    with pytest.raises(anthropic.BadRequestError) as e:    # max_tokens is required (the SDK insists too)
        client.post("/v1/messages", body={"model": MODEL, "messages": HELLO}, cast_to=anthropic.types.Message)
    anthropic_error(e.value, "invalid_request_error", "max_tokens", "required")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**{**ok, "messages": [{"role": "user", "content": [{"type": "text", "text": "?"}, image]}]})
    anthropic_error(e.value, "invalid_request_error", "messages[0].content[1]", "image", "text only")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**{**ok, "messages": [{"role": "user", "content": [{"type": "video", "x": 1}]}]})
    anthropic_error(e.value, "invalid_request_error", "messages[0].content[0]", "'video'")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**{**ok, "messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]})
    anthropic_error(e.value, "invalid_request_error", "messages[0].content[0].text")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**{**ok, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]})
    anthropic_error(e.value, "invalid_request_error", "messages[0].content[0].tool_use_id", "toolu_nope")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**{**ok, "messages": [*HELLO, {"role": "assistant", "content": "I am"}]})
    anthropic_error(e.value, "invalid_request_error", "messages[1]", "prefill")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**ok, extra_body={"temperature": 3})
    anthropic_error(e.value, "invalid_request_error", "temperature")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**ok, stop_sequences=[""])
    anthropic_error(e.value, "invalid_request_error", "stop_sequences")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**ok, extra_body={"frobnicate": True})
    anthropic_error(e.value, "invalid_request_error", "frobnicate", "not permitted")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**ok, tool_choice={"type": "tool", "name": "get_weather"})
    anthropic_error(e.value, "invalid_request_error", "tool_choice", "tools")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**ok, tools=[{**WEATHER, "input_schema": {"type": "string"}}])
    anthropic_error(e.value, "invalid_request_error", "tools[0].input_schema.type")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**ok, tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"})
    anthropic_error(e.value, "invalid_request_error", "tool_choice", "nope")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**{**ok, "max_tokens": 0})
    anthropic_error(e.value, "invalid_request_error", "max_tokens")
    with pytest.raises(anthropic.BadRequestError) as e:   # the prompt alone fills the context
        client.messages.create(**{**ok, "messages": [{"role": "user", "content": "word " * 600}]})
    anthropic_error(e.value, "invalid_request_error", "messages", "context")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model=MODEL, messages=[])
    anthropic_error(e.value, "invalid_request_error", "messages")
    # one model served: any name is taken and echoed (404 not_found_error only under --strict-model-names)
    assert client.messages.create(**{**ok, "model": "claude-no-such-model"}).model == "claude-no-such-model"
    with pytest.raises(anthropic.BadRequestError) as e:    # streamed: refused before the stream starts
        with client.messages.stream(**ok, extra_body={"temperature": -1}) as s:
            list(s)
    anthropic_error(e.value, "invalid_request_error", "temperature")
    # not JSON at all; an unknown path under /v1/messages; a GET
    r = httpx.post(server.url + "/v1/messages", content=b"{nope", headers={"x-api-key": KEY,
                                                                        "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/messages/nope", headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.url + "/v1/messages", headers={"x-api-key": KEY})
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_api_keys(server):
    kw = dict(model=MODEL, max_tokens=2, messages=HELLO)
    for bad in (anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0),
                anthropic.Anthropic(base_url=server.url, auth_token="wrong", max_retries=0)):
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(**kw)
        anthropic_error(e.value, "authentication_error", "invalid API key", "x-api-key")
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.count_tokens(model=MODEL, messages=HELLO)
    # x-api-key (api_key) and a bearer token (auth_token, as Claude Code's ANTHROPIC_AUTH_TOKEN sends it)
    assert anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0).messages.create(**kw).content
    assert anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0).messages.create(**kw).content
    r = httpx.post(server.url + "/v1/messages", json=kw)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert "missing API key" in r.json()["error"]["message"]
    # the other routes keep OpenAI's shape, and take x-api-key too
    r = httpx.get(server.url + "/v1/models", headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200


def test_async_client(server):
    import asyncio

    async def main():
        client = anthropic.AsyncAnthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)
        kw = dict(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=HELLO)
        full = await client.messages.create(**kw)
        async with client.messages.stream(**kw) as s:
            streamed = "".join([t async for t in s.text_stream])
        await client.close()
        return text_of(full), streamed

    full, streamed = asyncio.run(main())
    assert full == streamed


CLAUDE = agent_bin("claude", "TINYLOOP_CLAUDE_BIN")
NEEDS_CLAUDE = pytest.mark.skipif(not CLAUDE, reason="Claude Code is not installed (make agents, npm install "
                                                      "@anthropic-ai/claude-code, or TINYLOOP_CLAUDE_BIN=path/to/claude)")


def claude_p(srv: ServerThread, tmp_path, prompt: str, *flags: str) -> subprocess.CompletedProcess:
    """`claude -p` unchanged, in tmp_path, against the server (ANTHROPIC_BASE_URL)."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "ANTHROPIC_BASE_URL": srv.url,
           "ANTHROPIC_API_KEY": KEY, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64", "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    return subprocess.run([CLAUDE, "-p", prompt, "--model", MODEL, *flags], env=env, cwd=tmp_path,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)


@NEEDS_CLAUDE
def test_claude_code_runs_a_turn(tmp_path, tokenizer):
    """`claude -p` unchanged against the server (ANTHROPIC_BASE_URL), on a forced model whose answer under the
    generic tool format is known: `{"response": "Hi there."}` then end-of-text, after the prompt's last ":"."""
    from .conftest import write_forced_model

    chain = tokenizer.encode(":") + tokenizer.encode('{"response": "Hi there."}') + [tokenizer.eos_id]
    model = write_forced_model(tmp_path / "forced32k.tinyloop", chain, tokenizer, max_seq_len=32768)
    with ServerThread(Settings(model_path=model, api_key=KEY)) as srv:
        run = claude_p(srv, tmp_path, "Say hi", "--tools", "Read,Glob,Grep")
    assert run.returncode == 0 and run.stdout.strip() == "Hi there.", (run.stdout[-2000:], run.stderr[-2000:])


@NEEDS_CLAUDE
def test_claude_code_runs_a_tool(tmp_path, tokenizer):
    """A tool use round trip through `claude -p` unchanged: the model (conftest.write_agent_tool_model) calls
    Claude Code's Bash tool (a tool_use block) to cat a file only the tool can bring back; Claude Code runs it
    (allowed by --allowedTools, as -p asks no one) and sends its output as a tool_result block in its next
    request, whereupon the model answers in text and Claude Code exits 0 with that answer."""
    from .conftest import ANSWER, MARKER, write_agent_tool_model

    model = write_agent_tool_model(tmp_path / "tools32k.tinyloop", tokenizer, "Bash", {"command": "cat marker.txt"})
    (tmp_path / "marker.txt").write_text(MARKER + "\n")
    with ServerThread(Settings(model_path=model, api_key=KEY), record=True) as srv:
        run = claude_p(srv, tmp_path, "Show marker.txt", "--tools", "Bash", "--allowedTools", "Bash(cat:*)")
    assert run.returncode == 0 and run.stdout.strip() == ANSWER, (run.stdout[-2000:], run.stderr[-2000:])
    turns = [body for path, body in srv.requests if path == "/v1/messages"]
    assert len(turns) == 2 and all(t["stream"] for t in turns), turns
    assert [t["name"] for t in turns[0]["tools"]] == ["Bash"]
    asked, answered = turns[1]["messages"][-2:]
    (use,) = asked["content"]
    assert asked["role"] == "assistant" and (use["type"], use["name"], use["input"]) == (
        "tool_use", "Bash", {"command": "cat marker.txt"})
    (result,) = answered["content"]
    assert answered["role"] == "user" and result["type"] == "tool_result" and result["tool_use_id"] == use["id"]
    assert not result.get("is_error") and MARKER in json.dumps(result["content"]), result


# -- without a server ---------------------------------------------------------------------------------------------
def test_partial_tool_input():
    assert partial_object('{"city": "Paris", "unit": "c"}') == {"city": "Paris", "unit": "c"}
    assert partial_object('{"city": "Par') == {"city": "Par"}            # a string cut short keeps what it has
    assert partial_object('{"city": "Paris", "un') == {"city": "Paris"}
    assert partial_object('{"a": [1, 2, {"b": tr') == {"a": [1, 2, {}]}
    assert partial_object('{"a": "x\\') == {"a": "x"}
    assert partial_object("") == {} and partial_object("[1]") == {} and partial_object("{") == {}


def test_error_locations():
    assert param_of(("body", "messages", 0, "content", "list[tagged-union[TextBlock,ToolUseBlock]]", 1, "tool_use",
                     "input")) == "messages[0].content[1].input"
    assert param_of(("body", "tool_choice", "tool", "name")) == "tool_choice.name"
    assert param_of(("body", "system", "str")) == "system"


def test_stream_error_event():
    framer = MessagesFramer(id="msg_x", model="m", tools=None, n_prompt=3)
    (frame,) = framer.fail(APIError(503, "the server is shutting down", code="shutting_down"))
    event, data = frame.decode().rstrip("\n").split("\n")
    assert event == "event: error"
    body = json.loads(data[6:])
    assert body["type"] == "error" and body["error"] == {"type": "overloaded_error",
                                                         "message": "the server is shutting down"}
    assert framer.keepalive.startswith(b"event: ping\n")
    with pytest.raises(ValidationError):   # (the tiny guard: the module's own errors are ValidationErrors)
        from tinyloop.server.anthropic.routes import chat_messages
        from tinyloop.server.anthropic.schemas import CountTokensRequest
        chat_messages(CountTokensRequest.model_validate({"model": "m", "messages": []}))
