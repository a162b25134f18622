"""`reasoning_effort` chooses the depth over HTTP (issue 55, item 4), on every generating route: OpenAI chat and
completions, /api/v0, native /generate, Responses' `reasoning.effort`, Messages' `output_config.effort`. The
depth used comes back in `x-tinyloop-loops` (streams too) and, where the answer has them, `loops_used` /
`stats`; the trained range in /v1/models and model_info (item 3)."""

from __future__ import annotations

import httpx
import pytest

from .conftest import ServerThread

HI = [{"role": "user", "content": "Hi"}]
DEPTHS = {"low": 1, "medium": 2, "high": 4}


@pytest.fixture(scope="module")
def dory_server(tmp_path_factory, tokenizer):
    """A tiny random Dory model (the family's own config mapping: trained at 1..4, default 4)."""
    from conftest import varied_model
    from tinyloop.model.families import dory
    from tinyloop.modelfile.loader import write_model
    from tinyloop.server.settings import Settings

    hf = {"architectures": ["DoryForCausalLM"], "model_type": "dory", "vocab_size": 50257, "hidden_size": 32,
          "num_hidden_layers": 7, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "attention_head_dim": 16, "max_position_embeddings": 256, "hybrid_layer_pattern": "S-*S-*-",
          "swa_window_size": 3, "init_method_std": 0.02, "n_input_layers": 2, "n_recurrent_layers": 3,
          "n_output_layers": 2, "n_recurrent_loops": 4}
    cfg = dory.config(hf, tmp_path_factory.getbasetemp(), [50256])
    path = tmp_path_factory.mktemp("dory-http") / "dory.tinyloop"
    write_model(path, varied_model(cfg, seed=3), tokenizer=tokenizer)
    with ServerThread(Settings(model_path=path)) as srv:
        yield srv


def post(srv, path: str, **body) -> httpx.Response:
    r = httpx.post(srv.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_models_report_the_trained_range(dory_server, tiny_server):
    card = httpx.get(dory_server.url + "/v1/models").json()["data"][0]
    assert (card["trained_loops"], card["default_loops"], card["max_loops"]) == ([1, 4], 4, 64)
    assert httpx.get(f"{dory_server.url}/v1/models/{card['id']}").json()["trained_loops"] == [1, 4]
    assert httpx.get(dory_server.url + "/api/v0/models").json()["data"][0]["model_info"]["trained_loops"] == [1, 4]
    assert httpx.get(tiny_server.url + "/v1/models").json()["data"][0]["trained_loops"] is None


def test_openai_routes_and_native_generate(dory_server):
    for effort, depth in DEPTHS.items():
        r = post(dory_server, "/v1/chat/completions", model="m", messages=HI, max_tokens=3, temperature=0,
                 reasoning_effort=effort)
        assert r.json()["loops_used"] == depth and r.headers["x-tinyloop-loops"] == str(depth), effort
        r = post(dory_server, "/v1/completions", model="m", prompt="The king", max_tokens=3, reasoning_effort=effort)
        assert r.json()["loops_used"] == depth and r.json()["loops_histogram"] == {str(depth): 3}
        r = post(dory_server, "/api/v0/completions", model="m", prompt="The king", max_tokens=3, reasoning_effort=effort)
        assert r.json()["stats"]["loops_used"] == depth
        r = post(dory_server, "/generate", prompt="The king", max_tokens=3, reasoning_effort=effort)
        assert r.json()["stats"]["loops_used"] == depth and r.headers["x-tinyloop-loops"] == str(depth)
    # the same tokens as asking for the depth itself
    want = post(dory_server, "/generate", prompt="The king", max_tokens=5, loops=1).json()["tokens"]
    assert post(dory_server, "/generate", prompt="The king", max_tokens=5, reasoning_effort="low").json()["tokens"] == want


def test_an_explicit_depth_wins(dory_server):
    r = post(dory_server, "/v1/chat/completions", model="m", messages=HI, max_tokens=2, loops=3, reasoning_effort="low")
    assert r.json()["loops_used"] == 3
    r = post(dory_server, "/v1/completions", model="m@loops=6", prompt="The king", max_tokens=2, reasoning_effort="high")
    assert r.json()["loops_used"] == 6 and r.headers["x-tinyloop-loops"] == "6"     # beyond the range: allowed
    r = post(dory_server, "/generate", prompt="The king", max_tokens=2, loops="auto", reasoning_effort="low")
    assert r.headers["x-tinyloop-loops"] == "auto (max 4)"
    r = post(dory_server, "/generate/speculative", prompt="The king", max_tokens=2, reasoning_effort="high")
    assert r.headers["x-tinyloop-loops"] == "4"                                   # verified at the effort's depth
    r = httpx.post(dory_server.url + "/generate", json={"prompt": "x", "reasoning_effort": "extreme"})
    assert r.status_code == 422 and "reasoning_effort" in r.text


def test_streams_say_the_depth_before_the_answer(dory_server):
    with httpx.stream("POST", dory_server.url + "/v1/chat/completions", timeout=120,
                      json={"model": "m", "messages": HI, "max_tokens": 3, "stream": True,
                            "reasoning_effort": "medium"}) as r:
        assert r.status_code == 200 and r.headers["x-tinyloop-loops"] == "2"
        assert r.read().endswith(b"data: [DONE]\n\n")


def test_responses_reasoning_effort_works_the_same(dory_server):
    for effort, depth in DEPTHS.items():
        r = post(dory_server, "/v1/responses", model="dory", input="Hi", max_output_tokens=3,
                 reasoning={"effort": effort})
        assert r.headers["x-tinyloop-loops"] == str(depth), effort
    r = post(dory_server, "/v1/responses", model="dory", input="Hi", max_output_tokens=3, loops=3,
             reasoning={"effort": "low"})
    assert r.headers["x-tinyloop-loops"] == "3"
    with httpx.stream("POST", dory_server.url + "/v1/responses", timeout=120,
                      json={"model": "dory", "input": "Hi", "max_output_tokens": 3, "stream": True,
                            "reasoning": {"effort": "low"}}) as r:
        assert r.status_code == 200 and r.headers["x-tinyloop-loops"] == "1"
        r.read()


def test_messages_output_config_effort(dory_server):
    for effort, depth in (("low", 1), ("medium", 2), ("high", 4), ("max", 4)):
        r = post(dory_server, "/v1/messages", model="dory", max_tokens=3, messages=HI,
                 output_config={"effort": effort})
        assert r.headers["x-tinyloop-loops"] == str(depth), effort


def test_a_model_without_a_range_ignores_the_effort(tiny_server):
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh"):
        r = post(tiny_server, "/v1/chat/completions", model="m", messages=HI, max_tokens=2, reasoning_effort=effort)
        assert r.json()["loops_used"] == 3 and r.headers["x-tinyloop-loops"] == "3", effort   # tiny's default
    r = post(tiny_server, "/v1/responses", model="tiny", input="Hi", max_output_tokens=2, reasoning={"effort": "high"})
    assert r.headers["x-tinyloop-loops"] == "3"
