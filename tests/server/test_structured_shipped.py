"""Structured output on the shipped model (slow; issue 27's bars): answers to a set of JSON schemas sampled at
temperature 0.8 parse and validate unless they end by length; `required` and named tool calls validate and
stream as they answer; greedy speculative and tree output equal greedy plain output under the same schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tinyloop.server.settings import Settings

from .conftest import ServerThread
from .test_http_shapes import post
from .test_structured import MSGS, SCHEMA_OF, TOOLS, _streamed

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer",
     "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
     "population": {"type": "integer", "minimum": 0}}, "required": ["name", "population"], "additionalProperties": False},
     "tags": {"type": "array", "items": {"enum": ["old", "new", "big", "small"]}, "minItems": 1, "maxItems": 3}},
     "required": ["city", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10},
     "verdict": {"enum": ["good", "bad", "unsure"]}, "ok": {"type": "boolean"}}, "required": ["score", "verdict", "ok"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 12},
     "count": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["word", "count"],
     "additionalProperties": False}, "minItems": 2, "maxItems": 3},
]


@pytest.fixture(scope="module")
def server(shipped_model_path):
    with ServerThread(Settings(model_path=shipped_model_path)) as srv:
        yield srv


def test_sampled_answers_validate(server):
    stopped = 0
    for i, schema in enumerate(SCHEMAS):
        for seed in range(3):
            r = post(server, "/v1/chat/completions", {
                "model": "tinyloop", "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 96,
                "temperature": 0.8, "seed": seed, "response_format": {"type": "json_schema", "json_schema": {
                    "name": f"s{i}", "schema": schema, "strict": True}}}).json()
            choice = r["choices"][0]
            if choice["finish_reason"] == "length":
                continue
            assert choice["finish_reason"] == "stop"
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            stopped += 1
    assert stopped >= 8   # most end on their own


def test_required_and_named_tool_calls_validate_and_stream_equal(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw = dict(model="tinyloop", messages=MSGS, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=80)
        c = client.chat.completions.create(**kw).choices[0]
        assert c.finish_reason == "tool_calls", c
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
        content, calls, finish = _streamed(client, **kw)
        assert (content, finish) == (c.message.content, c.finish_reason)
        assert calls == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]


def test_greedy_speculative_and_tree_equal_plain_under_a_schema(server):
    body = {"model": "tinyloop", "prompt": "The record:", "max_tokens": 64, "temperature": 0, "loops": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[1]}}}
    plain = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    for mode in ("speculative", "tree_speculative"):
        got = post(server, "/api/v0/completions", {**body, "mode": mode, "draft_loops": 2, "verify_loops": 8}).json()
        assert got["choices"][0]["text"] == plain, mode
