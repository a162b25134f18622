"""OpenAI's schema, exactly (issue 34, item 5): every body and stream chunk of /v1/chat/completions and
/v1/completions (plain, streamed, logprobs, tools, n > 1, echo, include_usage, a batch of prompts, and their
/api/v0 mirrors), the model list and the errors, validated two ways:

- against OpenAI's published OpenAPI document (tests/fixtures/openai_openapi_subset.json: the schemas these bodies
  use, copied from openai/openai-openapi, version 2.3.0), strictly: required keys (`choices[].logprobs`,
  `message.refusal`, `logprobs.refusal` are required, nullable), types, enums, no null where none is allowed;
- against the openai SDK's pydantic models, which OpenAI generates from that document (types and enums).

Two deviations are OpenAI's own and kept, both on the legacy text completions, whose chunks the document gives
the body's schema: with `echo` and `logprobs` the prompt's first token has `null` for its log-probability and
alternatives, and a chunk before a choice's last has `finish_reason: null` (OpenAI's API and vLLM send both; the
document types them as numbers, objects and a string). `openai_nulls_only` checks that those are the only nulls
and fills them in before validating.

Then logit_bias through the official SDK and over HTTP (honoured, 400s naming it), the accepted OpenAI fields, and
malformed bodies (400 with OpenAI's error shape naming the field)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx
import pytest

from conftest import varied_model
from tinyloop.config import preset
from tinyloop.modelfile.loader import write_model
from tinyloop.server.settings import Settings

from .conftest import ServerThread

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

DOC = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "openai_openapi_subset.json").read_text())
MODEL = "gpt-4o-mini"   # any name: one model served (the seed API)
HI = [{"role": "user", "content": "Hello, who are you?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
          "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": PARAMS}}]


def _nullable(node):
    """The document mixes OpenAPI 3.0's `nullable: true` into its 3.1 schemas (the chat chunk's `usage`,
    `logprobs`, `finish_reason`): read it as 3.0 defines it, the schema or null."""
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


COMPONENTS = _nullable(DOC["components"])


def validator(name: str):
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": COMPONENTS})


SCHEMAS = {name: validator(name) for name in ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
                                              "CreateCompletionResponse", "ListModelsResponse", "ErrorResponse")}


def check(name: str, body: dict) -> None:
    errors = sorted(SCHEMAS[name].iter_errors(body), key=lambda e: list(e.path))
    assert not errors, f"{name}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5]) + f"\n{body}"


def openai_nulls_only(body: dict, chunk: bool = False) -> dict:
    """`body` with the first prompt token's null logprob and alternatives (echo + logprobs) filled in, after
    checking they are the only nulls in the logprobs lists; a chunk's null finish_reason too."""
    body = copy.deepcopy(body)
    for c in body["choices"]:
        if chunk and c["finish_reason"] is None:
            c["finish_reason"] = "length"
        lp = c.get("logprobs")
        if not lp:
            continue
        for key, filler in (("token_logprobs", 0.0), ("top_logprobs", {})):
            nulls = [i for i, v in enumerate(lp[key]) if v is None]
            assert nulls in ([], [0]), (key, nulls)
            if nulls:
                lp[key][0] = filler
    return body


def validate_chat(body: dict) -> None:
    from openai.types.chat import ChatCompletion

    check("CreateChatCompletionResponse", body)
    ChatCompletion.model_validate(body)


def validate_completion(body: dict) -> None:
    from openai.types import Completion

    body = openai_nulls_only(body)
    check("CreateCompletionResponse", body)
    Completion.model_validate(body)


def validate_chunk(path: str, chunk: dict) -> None:
    from openai.types import Completion
    from openai.types.chat import ChatCompletionChunk

    if "chat" in path:
        check("CreateChatCompletionStreamResponse", chunk)
        ChatCompletionChunk.model_validate(chunk)
    else:
        chunk = openai_nulls_only(chunk, chunk=True)
        check("CreateCompletionResponse", chunk)   # OpenAI's text completion chunks share the body's schema
        Completion.model_validate(chunk)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    """A random tiny model with a 512-token context (the generic tool prompt takes ~200)."""
    path = tmp_path_factory.mktemp("schema") / "tiny512.tinyloop"
    write_model(path, varied_model(preset("tiny").replace(max_seq_len=512), seed=0), tokenizer=tokenizer)
    with ServerThread(Settings(model_path=path)) as srv:
        yield srv


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def counts(usage: dict) -> tuple:
    """The token counts of a usage object (cached_tokens differ: the second request hits the prefix cache)."""
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def chunks_of(r: httpx.Response) -> list[dict]:
    frames = [f for f in r.text.split("\n\n") if f and not f.startswith(":")]
    assert frames[-1] == "data: [DONE]", frames[-3:]
    return [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]


CHAT_CASES = [
    {},
    {"logprobs": True, "top_logprobs": 3},
    {"logprobs": True},
    {"n": 2, "temperature": 0.8, "seed": 3},
    {"n": 2, "logprobs": True, "top_logprobs": 1, "temperature": 0.7, "seed": 4},
    {"tools": TOOLS, "tool_choice": "required", "max_tokens": 40},
    {"tools": TOOLS, "tool_choice": "required", "max_tokens": 40, "logprobs": True, "top_logprobs": 2},
    {"tools": TOOLS, "tool_choice": "auto", "max_tokens": 24},
    {"response_format": {"type": "json_object"}},
    {"logit_bias": {"13": -100, "198": 5}, "max_tokens": None, "max_completion_tokens": 6},
    {"max_tokens": 1, "loops": "auto"},
    {"mode": "speculative", "logprobs": True, "top_logprobs": 2},
]
TEXT_CASES = [
    {},
    {"logprobs": 2},
    {"logprobs": 0},
    {"echo": True},
    {"echo": True, "logprobs": 1},
    {"echo": True, "max_tokens": 0, "logprobs": 2},
    {"n": 2, "temperature": 0.8, "seed": 5},
    {"prompt": ["Hello", "The cat sat"], "n": 2, "logprobs": 1, "temperature": 0.9, "seed": 6},
    {"prompt": [[464, 3797], [50256]], "max_tokens": 3},
    {"logit_bias": {"13": -100}},
    {"max_tokens": 2, "loops": "auto"},
]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/api/v0/chat/completions"])
@pytest.mark.parametrize("case", CHAT_CASES, ids=lambda c: ",".join(c) or "plain")
def test_chat_bodies_and_chunks_match_openais_schema(server, route, case):
    body = {k: v for k, v in {"model": MODEL, "messages": HI, "max_tokens": 8, "temperature": 0, **case}.items()
            if v is not None}
    r = post(server, route, body)
    assert r.status_code == 200, r.text
    full = r.json()
    validate_chat(full)
    assert full["model"] == MODEL
    for choice in full["choices"]:
        assert choice["message"]["refusal"] is None
        assert (choice["logprobs"] is None) == (not case.get("logprobs"))
        if choice["logprobs"] is not None:
            assert choice["logprobs"]["refusal"] is None and isinstance(choice["logprobs"]["content"], list)
    for usage in (False, True):
        streamed = {**body, "stream": True, **({"stream_options": {"include_usage": True}} if usage else {})}
        r = post(server, route, streamed)
        assert r.status_code == 200, r.text
        chunks = chunks_of(r)
        for chunk in chunks:
            validate_chunk(route, chunk)
            for c in chunk["choices"]:
                assert "logprobs" in c
                if c["logprobs"] is not None:
                    assert c["logprobs"]["refusal"] is None
        if usage:   # chat chunks: "usage": null (the schema has it nullable) until the usage chunk
            assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
            assert chunks[-1]["choices"] == [] and counts(chunks[-1]["usage"]) == counts(full["usage"])
        else:
            assert all("usage" not in c for c in chunks)


@pytest.mark.parametrize("route", ["/v1/completions", "/api/v0/completions"])
@pytest.mark.parametrize("case", TEXT_CASES, ids=lambda c: ",".join(c) or "plain")
def test_text_bodies_and_chunks_match_openais_schema(server, route, case):
    body = {"model": MODEL, "prompt": "The capital of France", "max_tokens": 6, "temperature": 0, **case}
    r = post(server, route, body)
    assert r.status_code == 200, r.text
    full = r.json()
    validate_completion(full)
    for choice in full["choices"]:
        assert "logprobs" in choice and (choice["logprobs"] is None) == (case.get("logprobs") is None)
    for usage in (False, True):
        streamed = {**body, "stream": True, **({"stream_options": {"include_usage": True}} if usage else {})}
        r = post(server, route, streamed)
        assert r.status_code == 200, r.text
        chunks = chunks_of(r)
        for chunk in chunks:
            validate_chunk(route, chunk)
            assert all("logprobs" in c for c in chunk["choices"])
        # text completion chunks: no usage key at all (the schema has no null) but on the usage chunk
        assert all("usage" not in c for c in chunks[:-1])
        if usage:
            assert chunks[-1]["choices"] == [] and counts(chunks[-1]["usage"]) == counts(full["usage"])
        else:
            assert "usage" not in chunks[-1]


def test_models_and_errors_match_openais_schema(server):
    check("ListModelsResponse", httpx.get(server.url + "/v1/models").json())
    bad = [("/v1/chat/completions", {"model": MODEL, "messages": HI, "temperature": 5}),
           ("/v1/chat/completions", {"model": MODEL, "messages": None}),
           ("/v1/completions", {"prompt": "x"}),
           ("/v1/completions", {"model": MODEL, "prompt": "x", "frobnicate": 1})]
    for path, body in bad:
        r = post(server, path, body)
        assert r.status_code == 400, r.text
        check("ErrorResponse", r.json())


def test_logit_bias_through_the_sdk_and_over_http(server, tokenizer):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    plain = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0, logprobs=True)
    first = plain.choices[0].logprobs.content[0]
    first_id = tokenizer.encode(first.token)[0] if first.token.strip() else None
    # +100 all but forces a token, greedy or sampled, streamed or not; the SDK sends logit_bias as OpenAI's
    forced = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0,
                                            logit_bias={"262": 100})
    assert forced.choices[0].message.content == tokenizer.decode([262] * 4)
    sampled = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=1.0, seed=1,
                                             logit_bias={"262": 100})
    assert sampled.choices[0].message.content == tokenizer.decode([262] * 4)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=4, temperature=0, logit_bias={"262": 100}, stream=True) if c.choices)
    assert text == tokenizer.decode([262] * 4)
    # -100 bans: the greedy first token is not taken, in mode generate and speculative
    if first_id is not None:
        for mode in ("generate", "speculative"):
            r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0, logprobs=True,
                                               logit_bias={str(first_id): -100}, extra_body={"mode": mode})
            assert r.choices[0].logprobs.content[0].token != first.token
    comp = client.completions.create(model=MODEL, prompt="The cat", max_tokens=3, temperature=0,
                                     logit_bias={"262": 100})
    assert comp.choices[0].text == tokenizer.decode([262] * 3)
    native = post(server, "/generate", {"prompt": "The cat", "max_tokens": 3, "logit_bias": {"262": 100}})
    assert native.status_code == 200 and native.json()["tokens"] == [262] * 3, native.text
    # bad ids and values: 400 naming logit_bias, on every route
    for bias, words in (({"abc": 1}, "decimal"), ({"262": 101}, "-100..100"), ({"262": -100.5}, "-100..100"),
                        ({"99999999": 1}, "outside the vocabulary"), ({"01": 1}, "decimal")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, logit_bias=bias)
        assert e.value.body["param"] == "logit_bias" and words in e.value.body["message"], e.value.body
        for path, body in (("/v1/completions", {"model": MODEL, "prompt": "x"}), ("/generate", {"prompt": "x"})):
            r = post(server, path, {**body, "max_tokens": 2, "logit_bias": bias})
            assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "logit_bias": {"262": "high"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias[262]", r.text


def test_openai_fields_accepted_refused_and_malformed_bodies(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    base = dict(model=MODEL, messages=HI, max_tokens=3, temperature=0)
    want = client.chat.completions.create(**base).choices[0].message.content
    accepted = dict(modalities=["text"], reasoning_effort="low", user="u-1", metadata={"k": "v"}, store=False,
                    prediction={"type": "content", "content": "I am a model"}, verbosity="low",
                    prompt_cache_key="conv-1", safety_identifier="hash-1", service_tier="auto", top_logprobs=0,
                    stream_options=None, parallel_tool_calls=True)
    r = client.chat.completions.create(**base, **accepted)
    assert r.choices[0].message.content == want and r.model == MODEL
    r = client.chat.completions.create(**base, prediction={"type": "content", "content": [{"type": "text",
                                                                                          "text": "I am"}]})
    assert r.choices[0].message.content == want
    refused = [(dict(store=True), "store", "unsupported_parameter"),
               (dict(modalities=["text", "audio"]), "modalities[1]", "invalid_value"),
               (dict(prediction={"type": "diff", "content": "x"}), "prediction.type", "invalid_value"),
               (dict(reasoning_effort="extreme"), "reasoning_effort", "invalid_value"),
               (dict(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
               (dict(logprobs=True, top_logprobs=-1), "top_logprobs", "invalid_value"),
               (dict(response_format={"type": "xml"}), "response_format.type", "invalid_value"),
               (dict(response_format={"type": "json_object", "schema": {}}), "response_format.schema",
                "unknown_parameter"),
               (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "foo": 1}}),
                "response_format.json_schema.foo", "unknown_parameter"),
               (dict(stream_options={"include_usage": True, "chunked": 1}), "stream_options.chunked",
                "unknown_parameter")]
    for fields, param, code in refused:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{**base, **fields}, stream=bool(fields.get("stream_options")))
        assert (e.value.body["param"], e.value.body["code"]) == (param, code), (fields, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**base, extra_body={"audio": {"voice": "alloy", "format": "wav"}})
    assert (e.value.body["param"], e.value.body["code"]) == ("audio", "unknown_parameter")
    # malformed bodies: 400 (not 422) in OpenAI's error shape, naming the field
    malformed = [({"model": MODEL, "messages": None}, "messages", "invalid_type"),
                 ({"model": MODEL, "messages": "Hello"}, "messages", "invalid_type"),
                 ({"messages": HI}, "model", "missing_required_parameter"),
                 ({"model": MODEL}, "messages", "missing_required_parameter"),
                 ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
                  "invalid_value"),
                 ({"model": 5, "messages": HI}, "model", "invalid_type")]
    for body, param, code in malformed:
        r = post(server, "/v1/chat/completions", body)
        err = r.json()["error"]
        assert r.status_code == 400 and (err["param"], err["code"]) == (param, code), (body, r.text)
        assert set(err) == {"message", "type", "param", "code", "request_id"} and err["type"] == "invalid_request_error"
        assert err["message"].startswith(param)
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    with pytest.raises(openai.BadRequestError):   # the SDK's class for it (a 422 was UnprocessableEntityError)
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    # the native routes keep their 422 for a malformed body
    assert post(server, "/generate", {"prompt": None}).status_code == 422
