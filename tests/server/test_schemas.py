"""Request bodies take their defaults from SamplingParams (one place), except where an API's spec differs."""

from tinyloop.engine import SamplingParams
from tinyloop.server.native.schemas import GenerateRequest, SpeculativeRequest, TreeSpeculativeRequest
from tinyloop.server.openai.schemas import CompletionRequest, LMStudioCompletionRequest

KNOBS = ("max_tokens", "draft_loops", "verify_loops", "draft_ahead", "k_branches", "cache_window",
         "repetition_penalty", "presence_penalty", "frequency_penalty", "loops")


def test_bodies_default_to_sampling_params():
    want = SamplingParams()
    bodies = [CompletionRequest(model="tinyloop", prompt="hi"), LMStudioCompletionRequest(model="tinyloop", prompt="hi"),
              GenerateRequest(prompt="hi"), SpeculativeRequest(prompt="hi"), TreeSpeculativeRequest(prompt="hi")]
    for body in bodies:
        got = body.sampling_params()
        for name in KNOBS:
            assert getattr(got, name) == getattr(want, name), (type(body).__name__, name)
    assert LMStudioCompletionRequest(model="tinyloop", prompt="hi").sampling_params().mode == want.mode
    # OpenAI's own spec samples at temperature 1; the native API, the CLI and Engine share SamplingParams'
    assert CompletionRequest(model="tinyloop", prompt="hi").sampling_params().temperature == 1.0
    native = GenerateRequest(prompt="hi").sampling_params()
    assert (native.temperature, native.top_k, native.top_p) == (want.temperature, want.top_k, want.top_p)
