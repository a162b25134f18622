"""OpenAI's Responses API (server/responses/routes.py) through the official `openai` SDK against a local server:
responses.create (a string, items, instructions: the chat route's answer to the same conversation), responses.stream
(the same answer as create at temperature 0, typed events in order with consecutive sequence numbers), a tool-call
round trip (function_call items held to the tool's parameters, parsed as the chat route parses its calls, their
results sent back as function_call_output items), text.format json_schema / json_object, previous_response_id,
retrieve / delete / input_items, store false, the bounded store, max_output_tokens (status incomplete), TinyLoop's
knobs, and bad input as OpenAI-shaped 400s naming the field."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from conftest import varied_model
from tinyloop.config import preset
from tinyloop.modelfile.loader import write_model
from tinyloop.server.errors import APIError
from tinyloop.server.responses.routes import ResponsesFramer, ResponseStore, Stored
from tinyloop.server.settings import Settings

from .conftest import ServerThread

openai = pytest.importorskip("openai")

KEY = "responses-key"
MODEL = "tinyloop"
HELLO = "Hello, who are you?"
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                           "unit": {"type": "string", "enum": ["c", "f"]}},
          "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": PARAMS,
           "strict": True}
CLOCK = {"type": "function", "name": "now", "description": "The time", "parameters": {"type": "object", "properties": {}}}
PET = {"type": "object", "properties": {"kind": {"type": "string", "enum": ["cat", "dog"]},
                                        "age": {"type": "integer", "minimum": 0, "maximum": 30}},
       "required": ["kind", "age"], "additionalProperties": False}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
               "response.output_text.delta", "response.output_text.done", "response.content_part.done",
               "response.output_item.done"]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, tokenizer):
    """A random tiny model with a 512-token context (the generic tool prompt takes ~200)."""
    path = tmp_path_factory.mktemp("responses") / "tiny512.tinyloop"
    write_model(path, varied_model(preset("tiny").replace(max_seq_len=512), seed=0), tokenizer=tokenizer)
    return path


@pytest.fixture(scope="module")
def server(model_path):
    with ServerThread(Settings(model_path=model_path, api_key=KEY)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def chat(server, **body):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, **body},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def answer(server, messages, **kw) -> tuple[str, dict]:
    out = chat(server, messages=messages, temperature=0, **kw)
    return out["choices"][0]["message"]["content"], out


def status_for(finish_reason: str) -> str:
    return {"stop": "completed", "length": "incomplete"}[finish_reason]


def test_create_string_input(client, server):
    r = client.responses.create(model=MODEL, input=HELLO, max_output_tokens=12, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r._request_id and r._request_id.startswith("req-")
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [p.type for p in item.content] == ["output_text"] and r.output_text == item.content[0].text
    # the chat route's answer to the same conversation: one path, one answer
    text, same = answer(server, [{"role": "user", "content": HELLO}], max_tokens=12)
    assert r.output_text == text
    assert r.status == item.status == status_for(same["choices"][0]["finish_reason"])
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    u = r.usage
    assert (u.input_tokens, u.output_tokens) == (same["usage"]["prompt_tokens"], same["usage"]["completion_tokens"])
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    assert u.input_tokens_details.cached_tokens <= u.input_tokens
    # the request echoed back
    assert r.temperature == 0 and r.max_output_tokens == 12 and r.store is True and r.tools == []
    assert r.tool_choice == "auto" and r.text.format.type == "text" and r.previous_response_id is None
    assert r.parallel_tool_calls is True and r.error is None


def test_items_and_instructions(client, server):
    items = [{"role": "developer", "content": "Answer in English."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello,"},
                                                              {"type": "input_text", "text": " who are you?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A model.",
                                                                   "annotations": []}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},   # an earlier turn's reasoning: not shown
             {"role": "user", "content": "And?"}]
    r = client.responses.create(model=MODEL, instructions="Be brief.", input=items, max_output_tokens=10,
                                temperature=0, top_p=0.9, extra_body={"top_k": 5})
    text, _ = answer(server, [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Answer in English."},
                              {"role": "user", "content": "Hello, who are you?"},
                              {"role": "assistant", "content": "A model."}, {"role": "user", "content": "And?"}],
                     max_tokens=10, top_p=0.9, top_k=5)
    assert r.output_text == text and r.instructions == "Be brief." and r.top_p == 0.9


def test_stream_equals_create(client, server):
    """At temperature 0 the streamed answer is the created one; ended by a stop string (the chat route's `stop`,
    an extra field), the stream ends with response.completed and get_final_response has it."""
    kw = dict(model=MODEL, input=HELLO, max_output_tokens=16, temperature=0)
    full = client.responses.create(**kw)
    stop = full.output_text[4:6]
    kw["extra_body"] = {"stop": [stop]}
    stopped = client.responses.create(**kw)
    assert stopped.status == "completed" and stopped.output_text == full.output_text[:full.output_text.find(stop)]
    with client.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [k for k in kinds if k == "response.output_text.delta"]
    assert kinds == TEXT_EVENTS[:4] + deltas + TEXT_EVENTS[5:] + ["response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == stopped.output_text
    assert final.output_text == stopped.output_text and final.status == "completed"
    assert final.usage.output_tokens == stopped.usage.output_tokens and final.id.startswith("resp_")
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert client.responses.retrieve(final.id).output_text == stopped.output_text   # the streamed one is stored
    # cut short by max_output_tokens: status incomplete, the stream's last event response.incomplete
    with client.responses.stream(**{**kw, "extra_body": None}) as s:
        events = list(s)
    last = events[-1]
    if full.status == "incomplete":
        assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
        assert last.response.output[0].status == "incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == full.output_text


def test_max_output_tokens(client, server):
    r = client.responses.create(model=MODEL, input=HELLO, max_output_tokens=5, extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"
    # no max_output_tokens: up to the end of the context
    long = client.responses.create(model=MODEL, input=HELLO, temperature=0, extra_body={"ignore_eos": True})
    assert long.status == "incomplete" and long.usage.input_tokens + long.usage.output_tokens == 512
    assert long.max_output_tokens is None


def test_tool_call_round_trip(client, server):
    ask = "What is the weather in Paris?"
    kw = dict(model=MODEL, max_output_tokens=64, temperature=0, tools=[WEATHER, CLOCK])
    r = client.responses.create(**kw, input=ask, tool_choice="required")
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r
    call = calls[0]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    args = json.loads(call.arguments)
    if call.name == "get_weather":   # held to the parameters token by token
        jsonschema.validate(args, PARAMS)
    else:
        assert call.name == "now" and args == {}
    assert [t.name for t in r.tools] == ["get_weather", "now"] and r.tools[0].strict is True
    # the chat route's call for the same request: the same constraint, the same parse
    same = chat(server, messages=[{"role": "user", "content": ask}], max_tokens=64, temperature=0, tool_choice="required",
                tools=[{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
                       for t in (WEATHER, CLOCK)])
    (openai_call,) = same["choices"][0]["message"]["tool_calls"]
    assert openai_call["function"]["name"] == call.name and json.loads(openai_call["function"]["arguments"]) == args
    # streamed: the same call, its arguments as function_call_arguments.delta fragments
    with client.responses.stream(**kw, input=ask, tool_choice="required") as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert (done.name, json.loads(done.arguments)) == (call.name, args)
    (streamed,) = final.output
    assert (streamed.name, json.loads(streamed.arguments)) == (call.name, args)
    # a named tool; allowed_tools
    named = client.responses.create(**kw, input=ask, tool_choice={"type": "function", "name": "get_weather"})
    assert [o.name for o in named.output if o.type == "function_call"] == ["get_weather"]
    allowed = client.responses.create(**kw, input=ask, tool_choice={"type": "allowed_tools", "mode": "required",
                                                                    "tools": [{"type": "function", "name": "now"}]})
    assert [o.name for o in allowed.output if o.type == "function_call"] == ["now"]
    # the result goes back as a function_call_output item; the model answers (tool_choice none: text only)
    back = [{"role": "user", "content": ask}, *[o.model_dump(exclude_none=True) for o in r.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]
    result = client.responses.create(**kw, input=back, tool_choice="none")
    assert [o.type for o in result.output] == ["message"]
    want, _ = answer(server, [{"role": "user", "content": ask},
                              {"role": "assistant", "content": "", "tool_calls": [
                                  {"id": call.call_id, "type": "function",
                                   "function": {"name": call.name, "arguments": call.arguments}}]},
                              {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}],
                     max_tokens=64, tool_choice="none", tools=same_tools())
    assert result.output_text == want
    # the same through previous_response_id: only the output goes in
    chained = client.responses.create(**kw, previous_response_id=r.id, tool_choice="none", input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}])
    assert chained.output_text == want and chained.previous_response_id == r.id


def test_namespaces_and_hosted_tools(client):
    """What Codex sends: function tools in a namespace (offered as function tools; a call names its namespace)
    and hosted tools (web_search: accepted, not offered to the model), with client_metadata."""
    agents = {"type": "namespace", "name": "agents", "description": "sub-agents", "tools": [CLOCK]}
    kw = dict(model=MODEL, input="What time is it?", max_output_tokens=48, temperature=0,
              tools=[WEATHER, agents, {"type": "web_search", "external_web_access": False}],
              extra_body={"client_metadata": {"turn_id": "t1"}})
    r = client.responses.create(**kw, tool_choice={"type": "function", "name": "now"})
    (call,) = r.output
    assert (call.type, call.name, call.namespace, call.arguments) == ("function_call", "now", "agents", "{}")
    assert [t.type for t in r.tools] == ["function", "namespace", "web_search"]
    with client.responses.stream(**kw, tool_choice={"type": "function", "name": "now"}) as s:
        final = s.get_final_response()
    assert final.output[0].namespace == "agents"
    # the call (with its namespace) and its output go back
    back = client.responses.create(**{**kw, "input": [*[o.model_dump(exclude_none=True) for o in r.output],
                                                      {"type": "function_call_output", "call_id": call.call_id,
                                                       "output": "noon"}]}, tool_choice="none")
    assert [o.type for o in back.output] == ["message"]
    only_hosted = client.responses.create(**{**kw, "tools": [{"type": "web_search"}]}, tool_choice="auto")
    assert [o.type for o in only_hosted.output] == ["message"]
    no_tools = client.responses.create(**{**kw, "tools": []}, tool_choice="auto", parallel_tool_calls=False)
    assert [o.type for o in no_tools.output] == ["message"]   # Codex's compaction turn: tools [] and "auto"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{**kw, "tools": [WEATHER, {"type": "namespace", "name": "x", "tools": [WEATHER]}]})
    openai_error(e.value, "invalid_value", "tools[1].tools[0].name", "unique")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{**kw, "tools": [{"type": "custom", "name": "apply_patch"}]})
    openai_error(e.value, "invalid_value", "tools[0].type", "custom")


def same_tools():
    return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
            for t in (WEATHER, CLOCK)]


def test_text_format(client):
    done = 0
    for seed in range(3):
        r = client.responses.create(model=MODEL, input="A pet, as JSON", max_output_tokens=48, temperature=0.8,
                                    extra_body={"seed": seed},
                                    text={"format": {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}})
        assert r.text.format.type == "json_schema" and r.text.format.name == "pet"
        if r.status == "completed":
            jsonschema.validate(json.loads(r.output_text), PET)
            done += 1
    assert done >= 1
    obj = client.responses.create(model=MODEL, input="JSON:", max_output_tokens=48, text={"format": {"type": "json_object"}},
                                  extra_body={"seed": 1})
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)
    parsed = [client.responses.parse(model=MODEL, input="A pet", text_format=Pet, max_output_tokens=64, temperature=0.8,
                                     extra_body={"seed": seed}) for seed in range(3)]
    ok = [p for p in parsed if p.status == "completed"]
    assert ok and all(isinstance(p.output_parsed, Pet) for p in ok)


def test_previous_response_id(client, server):
    first = client.responses.create(model=MODEL, instructions="Be brief.", input=HELLO, max_output_tokens=8, temperature=0)
    second = client.responses.create(previous_response_id=first.id, input="And?", max_output_tokens=8, temperature=0)
    assert second.model == MODEL and second.previous_response_id == first.id
    # the earlier turns, without the earlier instructions (as OpenAI's API does not carry them over)
    want, _ = answer(server, [{"role": "user", "content": HELLO}, {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "And?"}], max_tokens=8)
    assert second.output_text == want
    third = client.responses.create(model=MODEL, previous_response_id=second.id, instructions="Be brief.",
                                    input=[{"role": "user", "content": "Go on."}], max_output_tokens=8, temperature=0)
    want, _ = answer(server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": HELLO},
                              {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And?"},
                              {"role": "assistant", "content": second.output_text},
                              {"role": "user", "content": "Go on."}], max_tokens=8)
    assert third.output_text == want
    # an item of a stored response by reference
    ref = client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": first.output[0].id},
                                                      {"role": "user", "content": "And?"}], max_output_tokens=8,
                                  temperature=0)
    want, _ = answer(server, [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And?"}],
                     max_tokens=8)
    assert ref.output_text == want


def test_retrieve_delete_and_store_false(client):
    r = client.responses.create(model=MODEL, input=HELLO, max_output_tokens=6, temperature=0, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"k": "v"}
    items = client.responses.input_items.list(r.id)
    (item,) = items.data
    assert item.type == "message" and item.role == "user" and item.content[0].text == HELLO and not items.has_more
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    openai_error(e.value, "not_found", "response_id", r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    # store false: answered, never kept
    gone = client.responses.create(model=MODEL, input=HELLO, max_output_tokens=6, store=False)
    assert gone.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, previous_response_id=gone.id, input="And?", max_output_tokens=4)
    openai_error(e.value, "previous_response_not_found", "previous_response_id", gone.id)
    # input_items paging
    many = client.responses.create(model=MODEL, input=[{"role": "user", "content": w} for w in "abcde"],
                                   max_output_tokens=2)
    page = client.responses.input_items.list(many.id, limit=2, order="asc")
    assert [i.content[0].text for i in page.data] == ["a", "b"] and page.has_more
    rest = client.responses.input_items.list(many.id, order="asc", after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["c", "d", "e"] and not rest.has_more
    assert [i.content[0].text for i in client.responses.input_items.list(many.id).data] == list("edcba")


def test_store_is_bounded(model_path):
    with ServerThread(Settings(model_path=model_path, responses_store_size=2)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        ids = [c.responses.create(model=MODEL, input=HELLO, max_output_tokens=2).id for _ in range(3)]
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(ids[0])
        assert [c.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


def test_tinyloop_knobs(client, server):
    kw = dict(model=MODEL, input=HELLO, max_output_tokens=8, temperature=0)
    r = client.responses.create(**kw, extra_body={"loops": 2})
    want, _ = answer(server, [{"role": "user", "content": HELLO}], max_tokens=8, loops=2)
    assert r.output_text == want
    spec = client.responses.create(**kw, extra_body={"loops": 2, "mode": "speculative", "draft_loops": 1})
    assert spec.output_text == r.output_text   # greedy speculation is exact
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**kw, extra_body={"loops": 0})
    openai_error(e.value, "invalid_value", "loops")


def openai_error(exc, code: str | None, param: str | None, *words: str) -> dict:
    body = exc.body
    assert set(body) == {"message", "type", "param", "code", "request_id"}, body   # the SDK hands over body["error"]
    assert body["code"] == code and body["param"] == param, body
    assert body["type"] == "invalid_request_error" and body["request_id"] == exc.response.headers["x-request-id"]
    for w in words:
        assert w in body["message"], body
    return body


def test_bad_input_is_a_400_naming_the_field(client, server):
    ok = dict(model=MODEL, input=HELLO, max_output_tokens=4)
    cases = [
        (dict(input=[{"type": "web_search_call", "id": "ws_1"}]), "invalid_value", "input[0].type", "web_search_call"),
        (dict(input=[{"role": "user", "content": [{"type": "input_text", "text": "?"},
                                                  {"type": "input_image", "image_url": "http://x/y.png"}]}]),
         "invalid_value", "input[0].content[1].type", "input_image", "text only"),
        (dict(input=[{"role": "user", "content": 5}]), "invalid_type", "input[0].content"),
        (dict(input=[{"role": "robot", "content": "hi"}]), "invalid_value", "input[0].role"),
        (dict(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), "missing_required_parameter",
         "input[0].call_id"),
        (dict(input=[{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]), "invalid_value",
         "input[0].call_id", "call_nope"),
        (dict(input=[{"type": "item_reference", "id": "msg_nope"}]), "invalid_value", "input[0].id", "msg_nope"),
        (dict(input=[]), "missing_required_parameter", "input"),
        (dict(tools=[{"type": "local_shell"}]), "invalid_value", "tools[0].type", "function tools only"),
        (dict(tools=[{**WEATHER, "parameters": {"type": "string"}}]), "invalid_value", "tools"),
        (dict(tool_choice="always", tools=[WEATHER]), "invalid_value", "tool_choice", "always"),
        (dict(tool_choice={"type": "function", "name": "nope"}, tools=[WEATHER]), "invalid_value", "tool_choice", "nope"),
        (dict(tool_choice={"type": "file_search"}, tools=[WEATHER]), "invalid_value", "tool_choice.type"),
        (dict(tool_choice="required"), "invalid_value", "tool_choice", "tools"),
        (dict(text={"format": {"type": "json_schema", "schema": PET}}), "missing_required_parameter", "text.format.name"),
        (dict(text={"format": {"type": "yaml"}}), "invalid_value", "text.format"),
        (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "$dynamicRef": "#x"}}}),
         "unsupported_schema", "text.format", "$dynamicRef"),
        (dict(text={"format": {"type": "json_object"}}, tools=[WEATHER], tool_choice="required"), "invalid_value",
         "text.format", "not both"),
        (dict(temperature=3), "invalid_value", "temperature"),
        (dict(max_output_tokens=0), "invalid_value", "max_output_tokens"),
        (dict(max_output_tokens=9000), "invalid_value", "max_output_tokens", "TINYLOOP_MAX_TOKENS"),
        (dict(background=True), "unsupported_parameter", "background"),
        (dict(include=["message.output_text.logprobs"]), "unsupported_parameter", "include[0]"),
        (dict(input="word " * 600), "context_length_exceeded", "input", "context length", "shorten the input"),
    ]
    for fields, code, param, *words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**{**ok, **fields})
        openai_error(e.value, code, param, *words)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**ok, extra_body={"frobnicate": True})
    openai_error(e.value, "unknown_parameter", "frobnicate", "unknown parameter")
    # one model served: any name is taken and echoed (404 model_not_found only under --strict-model-names)
    assert client.responses.create(**{**ok, "model": "gpt-no-such-model"}).model == "gpt-no-such-model"
    with pytest.raises(openai.BadRequestError) as e:   # streamed: refused before the stream starts
        with client.responses.stream(**ok, temperature=-1) as s:
            list(s)
    openai_error(e.value, "invalid_value", "temperature")
    # not JSON at all; an unknown path under /v1/responses
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/responses", content=b"{nope", headers={**auth, "content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/responses/x/nope", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(server.url + "/v1/responses/resp_x/input_items", params={"limit": 500}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


def test_bodies_and_events_validate_against_the_sdk_types(server):
    """Every body and stream event, validated (strictly: required fields, types, enums) against the openai SDK's
    own models, which OpenAI generates from its OpenAPI document."""
    from pydantic import TypeAdapter
    from openai.types.responses import Response, ResponseItem, ResponseStreamEvent

    auth = {"Authorization": f"Bearer {KEY}"}
    events = TypeAdapter(ResponseStreamEvent)
    bodies = [{"input": HELLO, "max_output_tokens": 6},
              {"input": HELLO, "max_output_tokens": 64, "tools": [WEATHER, CLOCK], "tool_choice": "required"},
              {"input": [{"role": "user", "content": HELLO}], "instructions": "Be brief.", "max_output_tokens": 8,
               "text": {"format": {"type": "json_schema", "name": "pet", "schema": PET}}, "metadata": {"a": "b"},
               "reasoning": {"effort": "low"}}]
    for body in bodies:
        r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body}, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        Response.model_validate(r.json())
        got = httpx.get(server.url + f"/v1/responses/{r.json()['id']}/input_items", headers=auth).json()
        assert got["object"] == "list"
        for item in got["data"]:
            TypeAdapter(ResponseItem).validate_python(item)
        r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body, "stream": True}, headers=auth,
                       timeout=60)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for raw in r.text.split("\n\n")[:-1]:
            name, data = raw.split("\n")
            obj = json.loads(data.removeprefix("data: "))
            assert name == f"event: {obj['type']}"
            events.validate_python(obj)
    created = json.loads(r.text.split("\n\n")[0].split("\n")[1].removeprefix("data: "))["response"]
    framer = ResponsesFramer(response=created, tools=None, on_done=lambda r: None)
    for frame in framer.fail(APIError(500, "the engine failed", code="engine_error")):
        events.validate_python(json.loads(frame.decode().split("\n")[1][6:]))


def test_api_keys(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.responses.create(model=MODEL, input=HELLO, max_output_tokens=2)
    assert e.value.body["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/v1/responses/resp_x")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_async_client(server):
    import asyncio

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        kw = dict(model=MODEL, input=HELLO, max_output_tokens=6, temperature=0)
        full = await client.responses.create(**kw)
        streamed = []
        async with client.responses.stream(**kw) as s:
            async for e in s:
                if e.type == "response.output_text.delta":
                    streamed.append(e.delta)
        await client.close()
        return full.output_text, "".join(streamed)

    full, streamed = asyncio.run(main())
    assert full == streamed


# -- without a server ---------------------------------------------------------------------------------------------
def test_stream_error_events():
    response = {"id": "resp_x", "created_at": 1, "model": "m", "output": [], "status": "in_progress"}
    framer = ResponsesFramer(response=response, tools=None, on_done=lambda r: None)
    frames = framer.open() + framer.fail(APIError(503, "the server is shutting down", code="shutting_down"))
    events = []
    for f in frames:
        event, data = f.decode().rstrip("\n").split("\n")
        events.append((event[7:], json.loads(data[6:])))
    assert [e for e, _ in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert [d["sequence_number"] for _, d in events] == [0, 1, 2, 3]
    assert events[2][1] == {"type": "error", "code": "shutting_down", "message": "the server is shutting down",
                            "param": None, "sequence_number": 2}
    failed = events[3][1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error",
                                                                "message": "the server is shutting down"}


def test_store_lru():
    store = ResponseStore(2)
    for rid in ("a", "b"):
        store.put(Stored({"id": rid, "output": [{"id": f"msg_{rid}"}]}, [], ()))
    assert store.get("a") is not None   # a is now the most recently used: b goes first
    store.put(Stored({"id": "c", "output": []}, [], ()))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert store.item("msg_a") == {"id": "msg_a"} and store.item("msg_b") is None
    assert store.delete("a") and not store.delete("a")
    none = ResponseStore(0)
    none.put(Stored({"id": "a", "output": []}, [], ()))
    assert none.get("a") is None


def test_store_size_setting():
    assert Settings.from_env({}).responses_store_size == 1000
    assert Settings.from_env({"TINYLOOP_RESPONSES_STORE_SIZE": "0"}).responses_store_size == 0
    with pytest.raises(SystemExit, match="TINYLOOP_RESPONSES_STORE_SIZE"):
        Settings.from_env({"TINYLOOP_RESPONSES_STORE_SIZE": "-1"})


def test_the_response_reports_the_temperature_it_was_sampled_at(model_path):
    """A request with no temperature is sampled at the server's default (`serve --temperature`): the response
    object says that one, not OpenAI's 1.0; a request's own wins."""
    with ServerThread(Settings(model_path=model_path, api_key=KEY, temperature=0.3)) as srv:
        headers = {"Authorization": f"Bearer {KEY}"}
        for body, want in (({}, 0.3), ({"temperature": 0.7}, 0.7)):
            r = httpx.post(srv.url + "/v1/responses", headers=headers, timeout=60,
                           json={"model": MODEL, "input": HELLO, "max_output_tokens": 4, **body})
            assert r.status_code == 200, r.text
            assert r.json()["temperature"] == want, body
