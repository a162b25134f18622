"""End to end on the shipped model: `tinyloop serve` with no model configured, the openai client, and the
HTTP result equal to the direct engine's (greedy)."""

from __future__ import annotations

import openai
import pytest

from .conftest import ServeProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shipped_server(shipped_model_path):
    with ServeProcess(None) as srv:  # no --model, no TINYLOOP_MODEL_PATH: the packaged model
        yield srv


def test_shipped_model_through_openai_client(shipped_server, shipped_model_path):
    from tinyloop.engine import Engine, SamplingParams

    client = openai.OpenAI(base_url=shipped_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    (model,) = client.models.list().data
    assert model.id == shipped_model_path.stem   # the file's stem (issue 27: not its absolute path)
    import httpx

    (info,) = httpx.get(f"{shipped_server.url}/api/v0/models", timeout=30).json()["data"]
    # the package's default model is the GPTQ int4 one (issue 6)
    assert info["quantization"] == "int4" and info["model_info"]["quant_method"] == "gptq"
    got = client.completions.create(model=model.id, prompt="The king said", max_tokens=24, temperature=0)
    direct = Engine.load(shipped_model_path).generate("The king said", SamplingParams(max_tokens=24))
    assert got.choices[0].text == direct.text
    words = [w for w in got.choices[0].text.split() if w.isalpha()]
    assert len(words) >= 5  # a trained model writes words
    chat = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "Tell me a story."}],
                                          max_tokens=16, seed=1)
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 16
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=16, seed=1, stream=True))
    assert streamed == chat.choices[0].message.content
