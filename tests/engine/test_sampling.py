import pytest
import torch

from tinyloop.engine.params import SamplingParams
from tinyloop.engine.sampling import (Sampler, apply_presence_frequency, apply_repetition_penalty, distribution,
                                      draw, make_generator, top_k_filter, top_p_filter)
from tinyloop.errors import ValidationError

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0], dtype=torch.float64)
NONE = torch.tensor([], dtype=torch.long)
ZERO = torch.zeros(5, dtype=torch.long)


def dist(**kw):
    return distribution(LOGITS, SamplingParams(**kw), NONE, ZERO)


def test_greedy_is_one_hot_argmax():
    p = dist(temperature=0.0)
    assert p.tolist() == [1.0, 0, 0, 0, 0]


def test_temperature_sharpens_and_flattens():
    cold, base, hot = dist(temperature=0.5), dist(temperature=1.0), dist(temperature=2.0)
    assert cold[0] > base[0] > hot[0]
    torch.testing.assert_close(base, torch.softmax(LOGITS, -1))


def test_top_k_keeps_k_largest():
    assert (top_k_filter(LOGITS, 2) > -float("inf")).tolist() == [True, True, False, False, False]
    p = dist(temperature=1.0, top_k=2)
    assert p[2:].sum() == 0 and abs(p.sum() - 1) < 1e-12


def test_top_p_smallest_nucleus():
    probs = torch.softmax(LOGITS, -1)  # ~[.61, .22, .14, .03, .004]
    kept = top_p_filter(LOGITS, 0.7) > -float("inf")
    assert kept.tolist() == [True, True, False, False, False]
    assert (top_p_filter(LOGITS, 0.5) > -float("inf")).tolist() == [True, False, False, False, False]
    assert probs[:2].sum() >= 0.7


def test_repetition_penalty_divides_positive_multiplies_negative():
    out = apply_repetition_penalty(LOGITS, torch.tensor([0, 3]), 2.0)
    assert out.tolist() == [1.0, 1.0, 0.5, -2.0, -3.0]


def test_presence_and_frequency_openai_definition():
    counts = torch.tensor([3, 1, 0, 0, 0])
    out = apply_presence_frequency(LOGITS, counts, presence=0.5, frequency=0.25)
    assert out.tolist() == [2.0 - 0.75 - 0.5, 1.0 - 0.25 - 0.5, 0.5, -1.0, -3.0]
    # negative values encourage repetition
    assert apply_presence_frequency(LOGITS, counts, -1.0, 0.0)[0] == 3.0


def test_sampler_penalties_apply_to_history():
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    s = Sampler(params, prompt_ids=[], vocab_size=5)
    assert s.sample(LOGITS) == 0
    s.accept(0)
    assert s.sample(LOGITS) == 1  # 2.0 - 2.0 = 0 < 1.0
    rp = Sampler(SamplingParams(repetition_penalty=2.5), prompt_ids=[0], vocab_size=5)
    assert rp.sample(LOGITS) == 1  # 2.0 / 2.5 = 0.8 < 1.0;  # prompt tokens count for the repetition penalty


def test_seeded_draws_repeat_and_follow_distribution():
    p = torch.softmax(LOGITS, -1)
    a = [draw(p, g) for g in [make_generator(7)] for _ in range(50)]
    g = make_generator(7)
    b = [draw(p, g) for _ in range(50)]
    assert a == b
    g = make_generator(0)
    counts = torch.bincount(torch.tensor([draw(p, g) for _ in range(4000)]), minlength=5).double() / 4000
    assert (counts - p).abs().max() < 0.03
    zero = torch.tensor([0.0, 1.0, 0.0])
    assert all(draw(zero, g) == 1 for _ in range(100))


@pytest.mark.parametrize("field,value", [("temperature", 2.5), ("top_p", 0.0), ("top_k", -1), ("max_tokens", 0),
                                         ("repetition_penalty", 3.0), ("presence_penalty", -3.0),
                                         ("frequency_penalty", 2.5), ("loops", 65), ("cache_window", -1),
                                         ("mode", "beam")])
def test_validation_names_the_field(field, value):
    with pytest.raises(ValidationError) as exc:
        SamplingParams(**{field: value}).validate()
    assert exc.value.param == field and field in exc.value.message
