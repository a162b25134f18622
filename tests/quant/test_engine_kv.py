import pytest

from tinyloop.engine import Engine, SamplingParams
from tinyloop.errors import ValidationError
from tinyloop.modelfile.loader import load_model


@pytest.fixture(scope="module")
def loaded(tiny_model_path):
    return load_model(tiny_model_path)


@pytest.mark.parametrize("kv", ["int8", "int4", "int4-h"])
@pytest.mark.parametrize("mode,window", [("generate", 0), ("generate", 6), ("speculative", 0)])
def test_engine_generates_with_quantized_kv(loaded, kv, mode, window):
    engine = Engine(loaded, kv_format=kv)
    assert engine.model_info()["kv_cache_mode"] == kv
    params = SamplingParams(max_tokens=12, mode=mode, cache_window=window, ignore_eos=True)
    res = engine.generate("The cat sat on the", params)
    assert res.completion_tokens == 12
    if kv == "int8" and mode == "generate" and window == 0:
        ref = Engine(loaded).generate("The cat sat on the", params)
        assert res.token_ids[:4] == ref.token_ids[:4]  # int8 rounding rarely flips a greedy token early


def test_quantized_kv_speculative_greedy_equals_plain(loaded):
    engine = Engine(loaded, kv_format="int4-h")
    plain = engine.generate("Once upon a time", SamplingParams(max_tokens=16, ignore_eos=True))
    spec = engine.generate("Once upon a time", SamplingParams(max_tokens=16, ignore_eos=True,
                                                              mode="speculative", draft_loops=1))
    assert spec.token_ids == plain.token_ids


def test_unknown_kv_format_is_a_validation_error(loaded):
    with pytest.raises(ValidationError, match="unknown KV cache format 'int3'"):
        Engine(loaded, kv_format="int3")
