"""Echo and prompt scoring over HTTP (issue 17): /v1/completions `echo` (with `logprobs`, and `max_tokens` 0)
as OpenAI's legacy completions did, batches of prompts, the native `prompt_logprobs`, the tokenizer
routes lm-eval reads, and the `model@loops=K` depth. Scores equal the engine's log_softmax (1e-4)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from tinyloop.engine import Engine, SamplingParams
from tinyloop.server.settings import Settings

from .conftest import ServerThread, write_forced_model

TEXT = "The king said to his people"


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return Engine.load(tiny_model_path)


def post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(url + path, json={"model": "tinyloop", **body}, timeout=60)


def scores(engine, ids: list[int], loops: int) -> torch.Tensor:
    """log_softmax of one full forward: row i - 1 scores token i."""
    return torch.log_softmax(engine.logits(ids, loops=loops).double(), -1)


def stream_chunks(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": "tinyloop", "stream": True, **body}, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("loops", [1, 3])
def test_echo_scores_the_prompt_as_openai_did(tiny_server, engine, loops):
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="x")
    r = client.completions.create(model="tinyloop", prompt=TEXT, max_tokens=0, echo=True, logprobs=2,
                                  extra_body={"loops": loops})
    ids = engine.tokenizer.encode(TEXT)
    choice = r.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [engine.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [len(engine.tokenizer.decode(ids[:i])) for i in range(len(ids))]
    want = scores(engine, ids, loops)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(want[i - 1, ids[i]]), abs=1e-4)
        best = torch.topk(want[i - 1], 2)
        assert list(lp.top_logprobs[i].values()) == pytest.approx(best.values.tolist(), abs=1e-4)


def test_echo_then_the_completion(tiny_server, engine):
    ids = engine.tokenizer.encode(TEXT)
    body = dict(prompt=ids, max_tokens=3, echo=True, logprobs=1, temperature=0, loops=2)
    r = post(tiny_server.url, "/v1/completions", **body).json()
    out = engine.generate(ids, SamplingParams(max_tokens=3, loops=2, ignore_eos=True))
    choice = r["choices"][0]
    assert choice["text"] == TEXT + out.text
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3 and lp["token_logprobs"][0] is None
    want = scores(engine, ids + out.token_ids, 2)
    full = ids + out.token_ids
    assert lp["token_logprobs"][1:] == pytest.approx([float(want[i - 1, full[i]]) for i in range(1, len(full))],
                                                     abs=1e-4)
    assert lp["text_offset"][len(ids)] == len(TEXT)
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 3, "total_tokens": len(ids) + 3,
                          **{k: v for k, v in r["usage"].items() if k.endswith("_tokens_details")}}
    # streamed: the prompt comes in each choice's first chunk, and the pieces add up to the same
    chunks = stream_chunks(tiny_server.url, body)
    assert chunks[0]["choices"][0]["text"].startswith(TEXT)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    pieces = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0].get("logprobs")]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [x for p in pieces for x in p[key]] == pytest.approx(lp[key], abs=1e-9) if key != "tokens" \
            else [x for p in pieces for x in p[key]] == lp[key]


def test_a_batch_of_prompts_and_n_choices(tiny_server, engine):
    prompts = [TEXT, "Once upon a time", "Hi"]
    body = dict(prompt=prompts, max_tokens=2, echo=True, logprobs=0, temperature=0.8, seed=5, n=2, loops=2)
    r = post(tiny_server.url, "/v1/completions", **body).json()
    assert [c["index"] for c in r["choices"]] == list(range(6))
    n_prompt = [len(engine.tokenizer.encode(p)) for p in prompts]
    assert r["usage"]["prompt_tokens"] == sum(n_prompt) and r["usage"]["completion_tokens"] == 12
    for p, text in enumerate(prompts):
        single = post(tiny_server.url, "/v1/completions", **{**body, "prompt": text}).json()
        for j in range(2):
            got, alone = r["choices"][2 * p + j], single["choices"][j]
            assert got["text"] == alone["text"] and got["text"].startswith(text)
            assert got["logprobs"]["token_logprobs"] == pytest.approx(alone["logprobs"]["token_logprobs"], abs=1e-5)
            assert got["logprobs"]["token_logprobs"][0] is None
    # streamed: every choice of every prompt, then the summed usage
    chunks = stream_chunks(tiny_server.url, {**body, "stream_options": {"include_usage": True}})
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    assert texts == {c["index"]: c["text"] for c in r["choices"]}
    assert chunks[-1]["usage"]["prompt_tokens"] == sum(n_prompt)
    # token-id prompts, several of them (what lm-eval sends)
    ids = [engine.tokenizer.encode(p) for p in prompts]
    r2 = post(tiny_server.url, "/v1/completions", prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert [len(c["logprobs"]["tokens"]) for c in r2.json()["choices"]] == [k + 1 for k in n_prompt]


def test_a_stop_token_is_listed_with_its_logprob(tmp_path, tokenizer):
    """OpenAI (and vLLM) list the end-of-text token in completions logprobs: lm-eval drops the last entry of
    an echo + max_tokens 1 answer, so without it a prompt token would be lost."""
    chain = tokenizer.encode(" one two three") + [tokenizer.eos_id]
    path = write_forced_model(tmp_path / "eos.tinyloop", chain, tokenizer)
    with ServerThread(Settings(model_path=path)) as srv:
        r = post(srv.url, "/v1/completions", prompt=chain[:3], max_tokens=1, echo=True, logprobs=1, temperature=0)
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["text"] == " one two three"
        lp = choice["logprobs"]
        assert lp["tokens"] == [" one", " two", " three", "<|endoftext|>"]
        assert lp["text_offset"] == [0, 4, 8, 14] and lp["token_logprobs"][-1] > -1e-3
        assert r.json()["usage"]["completion_tokens"] == 0   # the stop token is listed, not counted


def test_native_prompt_logprobs(tiny_server, engine):
    ids = engine.tokenizer.encode(TEXT)
    want = scores(engine, ids, 2)
    r = httpx.post(f"{tiny_server.url}/generate", json={"prompt": ids, "max_tokens": 0, "loops": 2,
                                                       "prompt_logprobs": 1}).json()
    assert r["tokens"] == [] and r["finish_reason"] == "length" and r["prompt_logprobs"][0] is None
    got = [x["logprob"] for x in r["prompt_logprobs"][1:]]
    assert got == pytest.approx([float(want[i - 1, ids[i]]) for i in range(1, len(ids))], abs=1e-4)
    with httpx.stream("POST", f"{tiny_server.url}/generate", json={"prompt": ids, "max_tokens": 2, "loops": 2,
                                                                   "prompt_logprobs": 0, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert [x and x["logprob"] for x in events[0]["prompt_logprobs"]][1:] == pytest.approx(got, abs=1e-9)
    assert all("prompt_logprobs" not in e for e in events[1:])


def test_echo_without_scores_in_a_speculative_mode(tiny_server):
    body = dict(prompt=TEXT, max_tokens=3, temperature=0, echo=True, loops=3)
    spec = post(tiny_server.url, "/api/v0/completions", **body, mode="speculative", draft_loops=1).json()
    plain = post(tiny_server.url, "/v1/completions", **body).json()
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"] and spec["choices"][0]["text"].startswith(TEXT)


def test_the_tokenizer_routes_lm_eval_reads(tiny_server, engine):
    info = httpx.get(f"{tiny_server.url}/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == engine.max_seq_len
    r = httpx.post(f"{tiny_server.url}/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()
    assert r["tokens"] == engine.tokenizer.encode(TEXT)
    r = httpx.post(f"{tiny_server.url}/detokenize", json={"tokens": engine.tokenizer.encode(TEXT)}).json()
    assert r == {"text": TEXT, "prompt": TEXT}


def test_the_model_name_can_carry_the_depth(tiny_server):
    body = dict(prompt=TEXT, max_tokens=0, echo=True, logprobs=0)
    named = post(tiny_server.url, "/v1/completions", **{**body, "model": "tiny@loops=2"}).json()
    given = post(tiny_server.url, "/v1/completions", **{**body, "loops": 2}).json()
    default = post(tiny_server.url, "/v1/completions", **body).json()
    assert named["model"] == "tiny@loops=2"
    assert named["choices"][0]["logprobs"] == given["choices"][0]["logprobs"] != default["choices"][0]["logprobs"]
    r = post(tiny_server.url, "/v1/completions", **{**body, "model": "tiny@loops=2", "loops": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "loops", r.text
    r = post(tiny_server.url, "/v1/completions", **{**body, "model": "tiny@loops=0"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "loops", r.text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", dict(prompt="Hi", max_tokens=0), "max_tokens"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}], echo=True), "echo"),
    ("/api/v0/completions", dict(prompt="Hi", echo=True, logprobs=1, mode="speculative", draft_loops=1), "echo"),
    ("/generate", dict(prompt="Hi", max_tokens=0), "max_tokens"),
    ("/generate", dict(prompt="Hi", prompt_logprobs=21), "prompt_logprobs"),
    ("/generate/speculative", dict(prompt="Hi", prompt_logprobs=1, draft_loops=1), "prompt_logprobs"),
])
def test_requests_that_cannot_be_served(tiny_server, path, body, param):
    r = post(tiny_server.url, path, **body) if path.startswith("/v1") or path.startswith("/api") else \
        httpx.post(tiny_server.url + path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
