"""POST /v1/embeddings (server/openai/embeddings.py) through the official `openai` SDK against a local server:
embeddings.create with a string, strings, token ids and token-id lists; float and base64 (the SDK's default)
equal; dimensions; values equal to the PyTorch model's own forward at that loop count pooled the same way;
a batch equal to its inputs one by one; `loops` (and `model@loops=K`) changes the vector; `pooling`; usage
and model echoed; auth; every bad input a 400 in OpenAI's shape naming the field, with the server serving on.

Tolerance: the server runs the file's fp32 tiny model on the native executor where it builds (else PyTorch's
fast path); the reference is PyTorch's eager fp32 forward of the same file. Both round every dot product at
u = 6e-8; a state component (RMS 1 after each norm) carries ~sqrt(128) u ~ 7e-7 per layer over at most ~20
layer applications (loops 8), and the final L2 normalization divides by sqrt(dim) = 8: ~2e-6, so 1e-5
(observed 3e-7; tests/engine/test_embeddings.py derives the same). Float and base64 are the same float32
values, so those compare exactly.
"""

from __future__ import annotations

import base64
import struct
import threading

import httpx
import pytest
import torch

from tinyloop.engine import Engine
from tinyloop.server.settings import Settings

from .conftest import ServerThread

openai = pytest.importorskip("openai")

KEY = "embeddings-key"
MODEL = "tinyloop"
TOL32 = 1e-5
TEXTS = ["The king said", "Once upon a time there was a little girl who lived in a village.", "x"]


@pytest.fixture(scope="module")
def server(tiny_model_path):
    with ServerThread(Settings(model_path=tiny_model_path, api_key=KEY)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def eager(tiny_model_path):
    return Engine.load(tiny_model_path, fast=False)


@torch.inference_mode()
def reference(model, ids, loops, pooling="mean"):
    """The PyTorch model's forward at `loops` without its LM head: the final-normed states, pooled, normalized."""
    ctx = model.context(len(ids))
    e = model.embed_prelude(torch.tensor([ids]), ctx)
    h = model.init_state(e, ctx.positions)
    for r in range(loops):
        h = model.core_loop(h, e, r, ctx)
    x = model.final_norm(model.run_coda(h, ctx))[0].double()
    v = x.mean(0) if pooling == "mean" else x[-1]
    return v / v.norm()


def post(server, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/v1/embeddings", json=body, headers=headers, timeout=60)


def vec(data) -> torch.Tensor:
    """An embedding as float64: the SDK's list of floats, or (encoding_format "base64" asked for explicitly:
    the SDK hands the string over as it came) decoded."""
    e = data.embedding
    if isinstance(e, str):
        raw = base64.b64decode(e)
        e = struct.unpack(f"<{len(raw) // 4}f", raw)
    return torch.tensor(e, dtype=torch.float64)


def test_sdk_float_equals_the_model_forward(client, eager):
    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert r.object == "list" and r.model == MODEL and len(r.data) == 3
    ids = [eager.tokenizer.encode(t) for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(x) for x in ids)
    for i, d in enumerate(r.data):
        assert d.object == "embedding" and d.index == i and len(d.embedding) == eager.config.dim
        v = vec(d)
        assert abs(float(v.norm()) - 1) < 1e-6
        assert (v - reference(eager.model, ids[i], eager.config.default_loops)).abs().max() < TOL32
    assert r.model_extra["pooling"] == "mean" and r.model_extra["loops"] == eager.config.default_loops


def test_base64_equals_float(client, server):
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    default = client.embeddings.create(model=MODEL, input=TEXTS)   # the SDK asks for base64 and decodes it
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]
    raw = post(server, {"model": MODEL, "input": TEXTS, "encoding_format": "base64"}).json()
    for d, f in zip(raw["data"], floats.data):
        data = base64.b64decode(d["embedding"])
        assert list(struct.unpack(f"<{len(data) // 4}f", data)) == f.embedding


def test_dimensions_truncate_then_renormalize(client):
    full = vec(client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float").data[0])
    for d in (1, 7, 32, 64):
        for fmt in ("float", "base64"):
            r = client.embeddings.create(model=MODEL, input=TEXTS[1], dimensions=d, encoding_format=fmt)
            short = vec(r.data[0])
            assert short.shape == (d,) and abs(float(short.norm()) - 1) < 1e-6
            assert (short - full[:d] / full[:d].norm()).abs().max() < 1e-6


def test_batch_equals_one_by_one_and_ids_equal_text(client, eager):
    batch = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float").data
    ids = [eager.tokenizer.encode(t) for t in TEXTS]
    for i, t in enumerate(TEXTS):
        alone = client.embeddings.create(model=MODEL, input=t, encoding_format="float").data[0]
        assert (vec(alone) - vec(batch[i])).abs().max() < TOL32
        by_ids = client.embeddings.create(model=MODEL, input=ids[i], encoding_format="float").data[0]
        assert by_ids.embedding == alone.embedding
    lists = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert lists.usage.prompt_tokens == sum(len(x) for x in ids)
    for a, b in zip(lists.data, batch):
        assert (vec(a) - vec(b)).abs().max() < TOL32


def test_loops_and_pooling(client, server, eager):
    ids = eager.tokenizer.encode(TEXTS[1])
    vs = {}
    for loops in (1, 2, 4, 8):
        r = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float", extra_body={"loops": loops})
        assert r.model_extra["loops"] == loops
        vs[loops] = vec(r.data[0])
        assert (vs[loops] - reference(eager.model, ids, loops)).abs().max() < TOL32
    for a in vs:
        for b in vs:
            if a < b:
                assert float(vs[a] @ vs[b]) < 0.999, (a, b)
    suffixed = client.embeddings.create(model=MODEL + "@loops=4", input=TEXTS[1], encoding_format="float")
    assert suffixed.model == MODEL + "@loops=4" and suffixed.model_extra["loops"] == 4
    assert (vec(suffixed.data[0]) - vs[4]).abs().max() < TOL32
    last = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float",
                                    extra_body={"pooling": "last", "loops": 2})
    assert last.model_extra["pooling"] == "last"
    assert (vec(last.data[0]) - reference(eager.model, ids, 2, "last")).abs().max() < TOL32
    assert (vec(last.data[0]) - reference(eager.model, ids, 2, "mean")).abs().max() > 1e-2


def test_auth_like_other_v1_routes(server):
    for key in (None, "wrong"):
        r = post(server, {"model": MODEL, "input": "x"}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": "x"}, headers={"x-api-key": KEY})
    assert r.status_code == 200


BAD = [
    ({"input": ""}, "input", "invalid_value"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": ["a", ""]}, "input", "invalid_value"),
    ({"input": [[1, 2], []]}, "input", "invalid_value"),
    ({"input": [50257]}, "input", "invalid_value"),
    ({"input": [[1], [-1]]}, "input", "invalid_value"),
    ({"input": "word " * 300}, "input", "context_length_exceeded"),
    ({"input": [[7] * 257]}, "input", "context_length_exceeded"),
    ({"input": 5}, "input", "invalid_type"),
    ({"input": None}, "input", "invalid_type"),
    ({"input": {"text": "x"}}, "input", "invalid_type"),
    ({"input": ["a", 3]}, "input", "invalid_type"),
    ({"input": [[1, 2.5]]}, "input", "invalid_type"),
    ({"input": [[1], "a", [True]]}, "input", "invalid_type"),
    ({"input": ["a"] * 2049}, "input", "invalid_value"),
    ({}, "input", "missing_required_parameter"),
    ({"input": "x", "model": None}, "model", "invalid_type"),
    ({"input": "x", "model": 3}, "model", "invalid_type"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", "invalid_value"),
    ({"input": "x", "encoding_format": 1}, "encoding_format", "invalid_value"),
    ({"input": "x", "dimensions": 0}, "dimensions", "invalid_value"),
    ({"input": "x", "dimensions": 65}, "dimensions", "invalid_value"),
    ({"input": "x", "dimensions": "8"}, "dimensions", "invalid_type"),
    ({"input": "x", "dimensions": 2.5}, "dimensions", "invalid_type"),
    ({"input": "x", "loops": 0}, "loops", "invalid_value"),
    ({"input": "x", "loops": 65}, "loops", "invalid_value"),
    ({"input": "x", "loops": "auto"}, "loops", "invalid_value"),
    ({"input": "x", "loops": True}, "loops", "invalid_value"),
    ({"input": "x", "loops": 2, "model": MODEL + "@loops=3"}, "loops", "invalid_value"),
    ({"input": "x", "pooling": "max"}, "pooling", "invalid_value"),
    ({"input": "x", "pooling": ["mean"]}, "pooling", "invalid_value"),
    ({"input": "x", "timeout_s": 0}, "timeout_s", "invalid_value"),
    ({"input": "x", "user": 5}, "user", "invalid_type"),
    ({"input": "x", "temperature": 0}, "temperature", "unknown_parameter"),
    ({"input": "x", "foo": 1}, "foo", "unknown_parameter"),
]


@pytest.mark.parametrize("body, param, code", BAD)
def test_bad_input_is_a_400_naming_the_field(server, body, param, code):
    r = post(server, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code, err
    assert err["type"] == "invalid_request_error" and err["message"].startswith(param) and err["request_id"]


def test_bad_json_and_the_sdk_s_exception(server, client):
    r = httpx.post(server.url + "/v1/embeddings", content=b"{not json", timeout=10,
                   headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MODEL, input="")
    assert err.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MODEL, input="x", dimensions=1000)
    assert err.value.body["param"] == "dimensions"


def test_nothing_lost_the_server_keeps_serving(server, client):
    """Bad requests, and embeddings side by side with completions from several threads: every good one
    answers, and as it would alone."""
    for body, _, _ in BAD:
        post(server, {"model": MODEL, **body})
    alone = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    text = client.completions.create(model=MODEL, prompt="The king said", max_tokens=12, temperature=0).choices[0].text
    out, errors = {}, []

    def embed(i):
        try:
            out[("e", i)] = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    def complete(i):
        try:
            out[("c", i)] = client.completions.create(model=MODEL, prompt="The king said", max_tokens=12,
                                                      temperature=0).choices[0].text
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=f, args=(i,)) for i in range(4) for f in (embed, complete)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for i in range(4):
        assert out[("c", i)] == text
        for a, b in zip(out[("e", i)].data, alone.data):
            assert (vec(a) - vec(b)).abs().max() < TOL32
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
