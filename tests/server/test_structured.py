"""Structured output over HTTP (issue 27): `response_format` (the openai SDK's `chat.completions.parse`), the
native `json_schema` / `regex` / `grammar`, `tools` with every `tool_choice`, streamed and not, tool messages
in the conversation, and the 400s. The tiny random model writes nonsense, but always inside the grammar."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from .test_http_shapes import assert_error, data_frames, post

openai = pytest.importorskip("openai")

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
          "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": PARAMS}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"]}}}]
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA_OF = {"get_weather": PARAMS, "add": TOOLS[1]["function"]["parameters"]}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    name: str = Field(max_length=6)


@pytest.fixture(scope="module")
def client(tiny512_server):
    return openai.OpenAI(base_url=tiny512_server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_completions_parse_with_a_pydantic_model(client):
    done = 0
    for seed in range(4):
        r = client.chat.completions.parse(model="tinyloop", messages=[{"role": "user", "content": "A pet, as JSON"}],
                                          response_format=Pet, temperature=0.8, seed=seed, max_tokens=64)
        choice = r.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet)
        done += 1
    assert done == 4


def test_response_format_on_completions_and_native_constraints(tiny512_server):
    r = post(tiny512_server, "/v1/completions", {"model": "tinyloop", "prompt": "JSON:", "max_tokens": 48, "seed": 1,
                                              "response_format": {"type": "json_object"}})
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)
    else:
        assert choice["text"].startswith("{")
    assert post(tiny512_server, "/generate", {"prompt": "Year:", "regex": "(19|20)[0-9]{2}", "max_tokens": 8}
                ).json()["text"][:2] in ("19", "20")
    out = post(tiny512_server, "/generate", {"prompt": "Answer", "grammar": 'root ::= "yes" | "no"', "max_tokens": 4}).json()
    assert out["text"] in ("yes", "no") and out["finish_reason"] == "stop"
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    out = post(tiny512_server, "/generate", {"prompt": "x", "json_schema": schema, "max_tokens": 16}).json()
    jsonschema.validate(json.loads(out["text"]), schema)
    stream = data_frames(post(tiny512_server, "/generate", {"prompt": "x", "json_schema": schema, "max_tokens": 16,
                                                         "stream": True}).content)
    assert "".join(json.loads(f)["text"] for f in stream[:-1]) == out["text"]


def test_a_schema_cut_short_ends_with_length(tiny512_server):
    schema = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string"},
                                                         "minItems": 30}}, "required": ["words"]}
    r = post(tiny512_server, "/v1/chat/completions", {"model": "tinyloop", "messages": MSGS, "max_tokens": 6,
                                                   "response_format": {"type": "json_schema", "json_schema": {
                                                       "name": "w", "schema": schema}}}).json()
    assert r["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"next": {"$dynamicRef": "#node"}}}}}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
])
def test_structured_400s_name_the_field(tiny512_server, body, param):
    err = assert_error(post(tiny512_server, "/v1/chat/completions", {"model": "tinyloop", "messages": MSGS, **body}),
                       400, param)
    if "$dynamicRef" in json.dumps(body):   # the keyword and where it is
        assert "$dynamicRef" in err["message"] and "#/properties/next" in err["message"]
        assert err["code"] == "unsupported_schema"


LOOSE = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "uniqueItems": True, "maxItems": 3},
    "color": {"type": "string", "format": "color", "maxLength": 8}}, "required": ["tags", "color"],
    "additionalProperties": False}


def test_a_schema_held_in_part_says_so(tiny512_server):
    """uniqueItems over strings is not held by the grammar (checked after), an unknown format is a plain
    string: both named in x-tinyloop-warning before the answer; each complete answer's check (the header, and
    `schema_check` on the choice, streamed or not) says truly whether it validates."""
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": LOOSE}}
    checked = 0
    for seed in range(3):
        r = post(tiny512_server, "/v1/chat/completions", {"model": "tinyloop", "messages": MSGS, "max_tokens": 64,
                                                       "temperature": 0.8, "seed": seed, "response_format": rf})
        warning = r.headers["x-tinyloop-warning"]
        assert "uniqueItems at #/properties/tags" in warning and "'color'" in warning
        choice = r.json()["choices"][0]
        if choice["finish_reason"] != "stop":
            assert "schema_check" not in choice and "x-tinyloop-schema-check" not in r.headers
            continue
        valid = jsonschema.Draft202012Validator(LOOSE).is_valid(json.loads(choice["message"]["content"]))
        assert choice["schema_check"] == r.headers["x-tinyloop-schema-check"]
        assert choice["schema_check"] == "passed" if valid else choice["schema_check"].startswith("failed: ")
        checked += 1
    assert checked >= 1
    r = post(tiny512_server, "/v1/chat/completions", {"model": "tinyloop", "messages": MSGS, "max_tokens": 64,
                                                   "seed": 1, "stream": True, "response_format": rf})
    assert "uniqueItems" in r.headers["x-tinyloop-warning"]
    chunks = [json.loads(f) for f in data_frames(r.content) if f != b"[DONE]"]
    last = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][0]["choices"][0]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    if last["finish_reason"] == "stop":
        valid = jsonschema.Draft202012Validator(LOOSE).is_valid(json.loads(text))
        assert last["schema_check"] == "passed" if valid else last["schema_check"].startswith("failed: ")
    plain = post(tiny512_server, "/v1/chat/completions", {"model": "tinyloop", "messages": MSGS, "max_tokens": 4,
                                                       "response_format": {"type": "json_object"}})
    assert "x-tinyloop-warning" not in plain.headers and "schema_check" not in plain.json()["choices"][0]


def _named_events(raw: bytes) -> list[tuple[str, dict]]:
    """(event name, data) of each frame of an `event:`/`data:` stream (Anthropic's, Responses')."""
    out = []
    for frame in raw.decode().strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines() if ": " in line)
        if "event" in lines and "data" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_streamed_messages_and_responses_carry_the_schema_check(tiny512_server):
    """Streamed /v1/messages and /v1/responses under a schema held in part: the warning header before the
    answer, and the check's outcome on the final event (`message_delta.schema_check`,
    `response.completed`'s `schema_check`), true of the streamed answer; an answer cut short carries none."""
    checked = {"messages": 0, "responses": 0}
    for seed in range(3):
        r = post(tiny512_server, "/v1/messages", {"model": "tinyloop", "messages": MSGS, "max_tokens": 64,
                                                  "temperature": 0.8, "seed": seed, "stream": True,
                                                  "output_config": {"format": {"type": "json_schema", "schema": LOOSE}}})
        assert r.status_code == 200 and "uniqueItems at #/properties/tags" in r.headers["x-tinyloop-warning"]
        events = _named_events(r.content)
        text = "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
        last = [d for n, d in events if n == "message_delta"][-1]
        if last["delta"]["stop_reason"] != "end_turn":
            assert "schema_check" not in last
        else:
            valid = jsonschema.Draft202012Validator(LOOSE).is_valid(json.loads(text))
            assert last["schema_check"] == "passed" if valid else last["schema_check"].startswith("failed: ")
            checked["messages"] += 1
        r = post(tiny512_server, "/v1/responses", {"model": "tinyloop", "input": "What is the weather in Paris?",
                                                   "max_output_tokens": 64, "temperature": 0.8, "seed": seed,
                                                   "stream": True, "store": False, "text": {"format": {
                                                       "type": "json_schema", "name": "t", "schema": LOOSE}}})
        assert r.status_code == 200 and "uniqueItems at #/properties/tags" in r.headers["x-tinyloop-warning"]
        events = _named_events(r.content)
        text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
        name, last = events[-1]
        if name != "response.completed":
            assert name == "response.incomplete" and "schema_check" not in last
        else:
            valid = jsonschema.Draft202012Validator(LOOSE).is_valid(json.loads(text))
            assert last["schema_check"] == "passed" if valid else last["schema_check"].startswith("failed: ")
            assert "schema_check" not in last["response"]   # beside the response object, as the header is
            checked["responses"] += 1
    assert checked["messages"] >= 1 and checked["responses"] >= 1, checked


def test_native_400s(tiny512_server):
    assert_error(post(tiny512_server, "/generate", {"prompt": "x", "regex": "[0-9"}), 400, "regex")
    assert_error(post(tiny512_server, "/generate", {"prompt": "x", "regex": "a", "grammar": 'root ::= "a"'}), 400, "grammar")
    assert_error(post(tiny512_server, "/v1/completions", {"model": "tinyloop", "prompt": "x", "tools": TOOLS}),
                 400, "tools")   # a text completion makes no tool calls


def _check_calls(calls, names):
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def _streamed(client, **kw):
    """A streamed answer put back together: (content, [(name, arguments)], finish_reason)."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", ""])
                entry[0] += (d.function.name or "") if d.function else ""
                entry[1] += (d.function.arguments or "") if d.function else ""
            finish = ch.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("choice,names", [
    ("required", {"get_weather", "add"}),
    ({"type": "function", "function": {"name": "add"}}, {"add"}),
    ("auto", {"get_weather", "add"}),
])
def test_tools_calls_validate_and_stream_as_they_answer(client, choice, names):
    kw = dict(model="tinyloop", messages=MSGS, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=50,
              parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    if c.finish_reason == "tool_calls":
        assert c.message.content is None and len(c.message.tool_calls) == 1
        _check_calls(c.message.tool_calls, names)
    else:   # auto may answer in words; anything else was cut short by max_tokens
        assert choice == "auto" and c.finish_reason == "stop" or c.finish_reason == "length"
    content, calls, finish = _streamed(client, **kw)
    assert finish == c.finish_reason
    assert calls == [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    assert content == c.message.content


def test_required_tools_sampled_always_validate(client):
    for seed in range(3):
        r = client.chat.completions.create(model="tinyloop", messages=MSGS, tools=TOOLS, tool_choice="required",
                                           temperature=0.8, seed=seed, max_tokens=50)
        c = r.choices[0]
        assert c.finish_reason in ("tool_calls", "length")
        if c.finish_reason == "tool_calls":
            assert c.message.tool_calls
            _check_calls(c.message.tool_calls, {"get_weather", "add"})


def test_tool_none_and_tool_messages(client, tiny512_server):
    r = client.chat.completions.create(model="tinyloop", messages=MSGS, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=5)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    convo = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    r = client.chat.completions.create(model="tinyloop", messages=convo, tools=TOOLS, temperature=0, max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "tool_calls", "length")
    shown = httpx.post(tiny512_server.url + "/tokenize", json={"messages": convo}).json()["tokens"]
    text = httpx.post(tiny512_server.url + "/detokenize", json={"tokens": shown}).json()["text"]
    # the generic format shows the round trip on the user's side (structured.generic_conversation), not as a
    # reply of the model's own that it would copy
    assert 'User: What is the weather in Paris?\n\nFunction results:\nadd {"a": 1, "b": 2} returned:\n3\n\nAnswer with these ' \
           'results, or call another function if you still need one.\nAssistant:' in text
    assert "tool_calls" not in text and "Tool:" not in text
    assert_error(post(tiny512_server, "/v1/chat/completions", {"model": "tinyloop", "messages": MSGS + [
        {"role": "tool", "content": "3"}]}), 400, "messages[1].tool_call_id")


class Weather(BaseModel):
    """The weather in a city."""
    city: str = Field(max_length=8)
    unit: Literal["c", "f"]


def test_langchain_with_structured_output_and_bind_tools(tiny512_server):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=tiny512_server.url + "/v1", api_key="unused", model="tinyloop", temperature=0,
                        max_tokens=64, max_retries=0)
    pet = llm.with_structured_output(Pet).invoke("A pet, as JSON")
    assert isinstance(pet, Pet)
    msg = llm.bind_tools([Weather], tool_choice="required").invoke("What is the weather in Paris?")
    if msg.response_metadata.get("finish_reason") == "tool_calls":
        (call,) = msg.tool_calls[:1]
        assert call["name"] == "Weather" and Weather(**call["args"])
    else:
        assert msg.response_metadata.get("finish_reason") == "length"
