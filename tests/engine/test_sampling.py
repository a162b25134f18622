import pytest
import torch

from tinyloop.engine.knobs import SamplingParams
from tinyloop.engine.sampling import (Sampler, apply_presence_frequency, apply_repetition_penalty,
                                      distribution, gumbel, noise_key, top_k_filter, top_p_filter)
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


def chi2_critical(df: int) -> float:
    """The chi-square critical value at p = 0.001 (Wilson-Hilferty; within 1% for df >= 3)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_noise_is_standard_gumbel():
    """g = -ln(-ln u): mean Euler's gamma (0.5772), variance pi^2 / 6 (1.645). 200,000 values: the means'
    standard errors are 0.0029 and 0.0066 (the fourth central moment of a Gumbel is 14.6), bounds at ~4 of them."""
    g = torch.cat([gumbel(noise_key(11, n), torch.arange(50_000)) for n in range(4)]).double()
    assert abs(g.mean().item() - 0.5772) < 0.012
    assert abs(g.var().item() - 1.6449) < 0.03
    assert g.max() < 16.7 and torch.isfinite(g).all()


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.5), dict(temperature=1.5, top_k=3),
                                dict(temperature=1.0, top_p=0.8)])
def test_draws_repeat_and_follow_the_distribution(kw):
    """A draw depends on (seed, output index, row) only, and over output indices it follows the distribution:
    chi-square at p = 0.001 over 3,000 draws; tokens that top-k / top-p drop are never drawn."""
    params = SamplingParams(seed=7, **kw)
    p = distribution(LOGITS, params, NONE, ZERO)

    def run(seed, n):
        s = Sampler(params.replace(seed=seed), [], 5)
        out = []
        for _ in range(n):
            out.append(s.sample(LOGITS))
            s.accept(out[-1])
        return out

    draws = run(7, 3000)
    assert draws[:100] == run(7, 100) and draws[:100] != run(8, 100)
    counts = torch.bincount(torch.tensor(draws), minlength=5).double()
    assert counts[p == 0].sum() == 0
    kept = p > 0
    chi2 = float(((counts[kept] - 3000 * p[kept]) ** 2 / (3000 * p[kept])).sum())
    assert chi2 < chi2_critical(max(int(kept.sum()) - 1, 3))   # (df 1-2 judged at df 3's value: looser)


@pytest.mark.parametrize("field,value", [("temperature", 2.5), ("top_p", 0.0), ("top_k", -1), ("max_tokens", 0),
                                         ("repetition_penalty", 3.0), ("presence_penalty", -3.0),
                                         ("frequency_penalty", 2.5), ("loops", 65), ("cache_window", -1),
                                         ("mode", "beam")])
def test_validation_names_the_field(field, value):
    with pytest.raises(ValidationError) as exc:
        SamplingParams(**{field: value}).validate()
    assert exc.value.param == field and field in exc.value.message
