"""Schema fuzzing in CI (issue 19): a short seeded schemathesis run against the server's own /openapi.json
(benchmarks/fuzz.py runs the long one), the document's promises, and one regression test per finding."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
import pytest

from tinyloop.server.settings import Settings

from .conftest import ServerThread

ROOT = Path(__file__).resolve().parents[2]


def load_fuzz():
    spec = importlib.util.spec_from_file_location("fuzz", ROOT / "benchmarks" / "fuzz.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fuzz():
    pytest.importorskip("schemathesis")
    return load_fuzz()


@pytest.fixture(scope="module")
def limited_server(tiny_model_path):
    """The fuzzing set-up: max_tokens capped at 16 so that generating cases stay short."""
    with ServerThread(Settings(model_path=tiny_model_path, max_tokens=16)) as srv:
        yield srv


def post(srv, path, body, **kw):
    return httpx.post(srv.url + path, json=body, timeout=60, **kw)


def test_schemathesis_short_run(fuzz, limited_server):
    """Every phase, positive and negative cases, all checks (ours for server errors and positive data):
    no failure, no error, every operation reached."""
    res = fuzz.run_schemathesis(limited_server.url, max_examples=4, seed=19)
    out = res["output"]
    assert res["ok"] and res["failures"] == 0 and res["errors"] == 0, out[-4000:]
    assert res["cases"] >= 300, out[-2000:]
    assert "Selected: 16/16" in out and "Tested: 16" in out, out[-2000:]  # no operation skipped
    for phase in ("Examples", "Coverage", "Fuzzing", "Stateful"):  # none skipped (examples: the document's own)
        assert f"✅ {phase}" in out, out[-2000:]


def test_document_limits_and_reachable_model_ids(limited_server):
    doc = httpx.get(limited_server.url + "/openapi.json").json()
    props = doc["components"]["schemas"]["GenerateRequest"]["properties"]
    assert props["max_tokens"]["maximum"] == 16 and props["max_tokens"]["default"] == 16
    assert props["loops"]["maximum"] == 64 and props["loops"]["minimum"] == 1
    assert props["top_p"]["exclusiveMinimum"] == 0
    ops = doc["paths"]
    assert set(ops["/generate"]["post"]["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "text/plain" in ops["/metrics"]["get"]["responses"]["200"]["content"]
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path in ("/v1/models/{model_id}", "/api/v0/models/{model_id}"):  # once unreachable: 404 to every case
        (param,) = ops[path]["get"]["parameters"]
        for model_id in param["schema"]["enum"]:
            r = httpx.get(limited_server.url + path.replace("{model_id}", model_id))
            assert r.status_code == 200, (model_id, r.text)


def test_oracle_refuses_unexplained_rejections(fuzz):
    """The fuzzer's checks can fail: a 400 no documented rule explains is not excused."""
    err = {"code": "invalid_value", "param": "draft_loops"}
    assert fuzz.explained_rejection("/generate/speculative", {"draft_loops": 3, "verify_loops": 3}, err, 3)
    assert not fuzz.explained_rejection("/generate/speculative", {"draft_loops": 2, "verify_loops": 3}, err, 3)
    assert not fuzz.explained_rejection("/generate", {"draft_loops": 3, "verify_loops": 3}, err, 3)
    assert not fuzz.explained_rejection("/generate/speculative", {"draft_loops": 3, "verify_loops": 3},
                                        {"code": "invalid_value", "param": "temperature"}, 3)
    assert fuzz.explained_rejection("/v1/completions", {}, {"code": "context_length_exceeded", "param": "max_tokens"}, 3)
    zero = {"code": "invalid_value", "param": "max_tokens"}   # echo and prompt scoring (issue 17)
    assert fuzz.explained_rejection("/v1/completions", {"max_tokens": 0}, zero, 3)
    assert not fuzz.explained_rejection("/v1/completions", {"max_tokens": 0, "echo": True}, zero, 3)
    assert fuzz.explained_rejection("/generate", {"max_tokens": 0}, zero, 3)
    assert not fuzz.explained_rejection("/generate", {"max_tokens": 0, "prompt_logprobs": 0}, zero, 3)
    echo = {"code": "invalid_value", "param": "echo"}
    assert fuzz.explained_rejection("/api/v0/completions", {"echo": True, "mode": "speculative", "logprobs": 0}, echo, 3)
    assert not fuzz.explained_rejection("/api/v0/completions", {"echo": True, "mode": "speculative"}, echo, 3)
    assert not fuzz.explained_rejection("/api/v0/completions", {"echo": True, "logprobs": 0}, echo, 3)
    loops = {"code": "invalid_value", "param": "loops"}
    assert fuzz.explained_rejection("/v1/completions", {"model": "tinyloop@loops=0"}, loops, 3)
    assert not fuzz.explained_rejection("/v1/completions", {"model": "tinyloop@loops"}, loops, 3)
    assert fuzz.sse_problems("/generate", b'data: {"token_id":1,"text":"a"}\n\ndata: [DONE]\n\n', 1)  # no final
    assert fuzz.sse_problems("/generate", b'data: {"token_id":-1,"text":""}\n\n', 1)                # no [DONE]
    good = b'data: {"token_id":1,"text":"a"}\n\n: keepalive\n\ndata: {"token_id":-1,"text":""}\n\ndata: [DONE]\n\n'
    assert fuzz.sse_problems("/generate", good, 1) is None


# -- regression tests: one per finding of the fuzzer ------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    # lax coercion accepted what the document refuses: "5" for 5, true for 1, [[false]] as token ids
    ("/v1/completions", {"model": "tinyloop", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"model": "tinyloop", "prompt": [[False]]}, "prompt"),
    ("/generate", {"prompt": "x", "stream": 1}, "stream"),
    ("/generate", {"prompt": "x", "temperature": "0.5"}, "temperature"),
    ("/detokenize", {"tokens": [True]}, "tokens[0]"),
    # non-text content parts (images) and null where the document says string
    ("/v1/chat/completions", {"model": "tinyloop", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     None),
    ("/tokenize", {"text": None, "messages": [{"role": "user", "content": "x"}]}, None),
])
def test_wrong_types_are_422(limited_server, path, body, param):
    """422 on the native routes; OpenAI's routes answer a malformed body with a 400 naming the field, as OpenAI
    does (errors.OpenAIErrors)."""
    r = post(limited_server, path, body)
    assert r.status_code in (400, 422), r.text
    assert r.status_code == (400 if path.startswith("/v1/") else 422) or path == "/tokenize"
    if param:
        assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path,body,param", [
    # knobs the engine checks only in the modes that use them were accepted silently in the others
    ("/api/v0/completions", {"model": "tinyloop", "prompt": "x", "draft_loops": 100}, "draft_loops"),
    ("/api/v0/completions", {"model": "tinyloop", "prompt": "x", "mode": "speculative", "K_branches": 0}, "K_branches"),
    ("/api/v0/chat/completions", {"model": "tinyloop", "messages": [{"role": "user", "content": "x"}], "verify_loops": 0},
     "verify_loops"),
    # only the first of several prompts was checked
    ("/v1/completions", {"model": "tinyloop", "prompt": ["x", ""]}, "prompt"),
    ("/v1/completions", {"model": "tinyloop", "prompt": [[1], [99999999]]}, "prompt"),
    # max_tokens over the server's limit
    ("/generate", {"prompt": "x", "max_tokens": 17}, "max_tokens"),
    # a window too large for the engine's int64 tensors was a 500 (OverflowError)
    ("/generate/speculative", {"prompt": "x", "cache_window": 207347578219663933732720476160}, "cache_window"),
    ("/api/v0/completions", {"model": "tinyloop", "prompt": "x", "cache_window": 2**31}, "cache_window"),
    # an unknown mode is a bad value (400), not a bad type
    ("/api/v0/completions", {"model": "tinyloop", "prompt": "x", "mode": "beam"}, "mode"),
])
def test_out_of_range_is_400(limited_server, path, body, param):
    r = post(limited_server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_accepted_forms_the_document_allows(limited_server):
    # JSON Schema counts 1.0 as an integer: so does the server
    r = post(limited_server, "/generate", {"prompt": [464.0, 3139], "max_tokens": 3.0})
    assert r.status_code == 200 and r.json()["stats"]["prompt_tokens"] == 2
    # a request without max_tokens gets the default lowered to the server's limit, not a 400
    r = post(limited_server, "/generate", {"prompt": "x"})
    assert r.status_code == 200 and r.json()["stats"]["completion_tokens"] <= 16
    # unsupported OpenAI fields at their defaults pass; JSON's false is not 0 (Python thinks it is)
    chat = {"model": "tinyloop", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert post(limited_server, "/v1/chat/completions", {**chat, "logprobs": False, "top_logprobs": 0}).status_code == 200
    r = post(limited_server, "/v1/chat/completions", {**chat, "top_logprobs": False})   # a type error now
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_window_past_the_context_is_the_full_context(limited_server):
    full = post(limited_server, "/generate", {"prompt": "x", "max_tokens": 8}).json()["tokens"]
    wide = post(limited_server, "/generate", {"prompt": "x", "max_tokens": 8, "cache_window": 2**31 - 1})
    assert wide.status_code == 200 and wide.json()["tokens"] == full


def test_long_multi_choice_stream_is_framed(fuzz, limited_server):
    """n=8 x 16 tokens: a few hundred events, every choice's final chunk, then [DONE] (the fuzzer once read
    only its first 100 events and reported a missing [DONE]; it now reads them all: fuzz.toml)."""
    r = post(limited_server, "/v1/completions", {"model": "tinyloop", "prompt": ["a", "b"], "n": 8, "max_tokens": 16,
                                                 "stream": True, "stream_options": {"include_usage": True}})
    assert fuzz.choices("/v1/completions", {"prompt": ["a", "b"], "n": 8}) == 16   # two prompts: a batch
    assert r.status_code == 200 and fuzz.sse_problems("/v1/completions", r.content, 16) is None


def test_stop_token_counts(limited_server):
    """completion_tokens counts the tokens returned; a stop token id ends the output without being shown or
    counted (found by the fuzzer's count check: the rule is now stated and checked)."""
    first = post(limited_server, "/generate", {"prompt": "x", "max_tokens": 4}).json()["tokens"]
    k = first.index(first[1])  # where the stop id first comes
    r = post(limited_server, "/generate", {"prompt": "x", "max_tokens": 4, "stop": [first[1]]}).json()
    assert r["finish_reason"] == "stop" and r["tokens"] == first[:k] and r["stats"]["completion_tokens"] == k


def test_sse_events_match_the_document(limited_server):
    doc = httpx.get(limited_server.url + "/openapi.json").json()
    event = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    assert event["properties"]["data"]["else"]["contentMediaType"] == "application/json"
    r = post(limited_server, "/v1/chat/completions", {"model": "tinyloop", "messages": [{"role": "user", "content": "x"}],
                                                      "max_tokens": 3, "stream": True, "n": 2})
    frames = [f for f in r.content.split(b"\n\n") if f.startswith(b"data: {")]
    chunk_keys = set(doc["components"]["schemas"]["ChatChunk"]["properties"])
    for f in frames:
        assert set(json.loads(f[6:])) <= chunk_keys
