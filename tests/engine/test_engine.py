import pytest

from tinyloop.engine import Engine, SamplingParams
from tinyloop.errors import ValidationError


def test_generate_and_stream_agree(tiny_engine):
    params = SamplingParams(max_tokens=12, loops=3)
    res = tiny_engine.generate("The king said", params)
    assert res.finish_reason in ("length", "stop") and len(res.token_ids) <= 12
    events = list(tiny_engine.stream("The king said", params))
    assert "".join(e.text for e in events) == res.text
    assert [t for e in events for t in e.token_ids] == res.token_ids
    assert events[-1].finish_reason == res.finish_reason
    st = res.stats
    assert st["mode"] == "generate" and st["loops_used"] == 3 and st["completion_tokens"] == 12
    assert st["prompt_tokens"] == 3 and st["wall_ms"] > 0 and st["time_to_first_token_ms"] > 0


def test_loops_change_output(tiny_engine):
    a = tiny_engine.generate([1, 2, 3], SamplingParams(max_tokens=8, loops=1)).token_ids
    b = tiny_engine.generate([1, 2, 3], SamplingParams(max_tokens=8, loops=6)).token_ids
    assert a != b


def test_seed_repeats_and_differs(tiny_engine):
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=123)
    a = tiny_engine.generate("Once", p).token_ids
    assert a == tiny_engine.generate("Once", p).token_ids
    assert a != tiny_engine.generate("Once", p.replace(seed=124)).token_ids


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_spanning_three_tokens(tiny_engine, stream):
    tok = tiny_engine.tokenizer
    full = tiny_engine.generate("Once upon", SamplingParams(max_tokens=16)).token_ids
    # a stop string made of the text of generated tokens 4, 5 and 6 (and not earlier in the text)
    stop = tok.decode(full[4:7])
    before = tok.decode(full[:4])
    assert stop not in before + stop[:-1]
    params = SamplingParams(max_tokens=16, stop=[stop])
    if stream:
        events = list(tiny_engine.stream("Once upon", params))
        text = "".join(e.text for e in events)
        finish = events[-1].finish_reason
        assert all(stop not in e.text for e in events)
    else:
        res = tiny_engine.generate("Once upon", params)
        text, finish = res.text, res.finish_reason
    assert text == before and finish == "stop"


def test_stop_token_ids_and_eos(tiny_engine):
    full = tiny_engine.generate([5, 6], SamplingParams(max_tokens=10)).token_ids
    res = tiny_engine.generate([5, 6], SamplingParams(max_tokens=10, stop_token_ids=[full[3]]))
    first = full.index(full[3])
    assert res.token_ids == full[:first] and res.finish_reason == "stop"
    assert res.completion_tokens == first == len(res.token_ids)  # the stop token ends the output, uncounted


def test_validation_errors(tiny_engine):
    with pytest.raises(ValidationError, match="context length") as exc:
        tiny_engine.generate("hi", SamplingParams(max_tokens=tiny_engine.max_seq_len))
    assert exc.value.param == "max_tokens"
    with pytest.raises(ValidationError, match="outside the vocabulary"):
        tiny_engine.generate([1, 99999], SamplingParams(max_tokens=2))
    with pytest.raises(ValidationError, match="empty"):
        tiny_engine.generate("", SamplingParams(max_tokens=2))
    with pytest.raises(ValidationError, match="loops"):
        tiny_engine.generate("hi", SamplingParams(loops=0))


def test_cache_window_generation_runs(tiny_engine):
    res = tiny_engine.generate("a b c d e f g h", SamplingParams(max_tokens=20, cache_window=4))
    assert res.completion_tokens == 20 or res.finish_reason == "stop"


def test_max_seq_len_override(tiny_model_path):
    e = Engine.load(tiny_model_path, max_seq_len=16)
    assert e.max_seq_len == 16
    with pytest.raises(ValidationError, match="exceeds the context length 16"):
        e.generate("hello there", SamplingParams(max_tokens=15))
