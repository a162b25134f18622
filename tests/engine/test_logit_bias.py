"""OpenAI's logit_bias in the engine's sampler (engine/sampling.py): added to the row before the penalties and
whatever picks the token, on every path: greedy (the raw-argmax shortcuts step aside), sampling, constrained
rows, logprobs, and both speculative modes (their drafts biased too, their output equal to plain decoding's)."""

from __future__ import annotations

import pytest
import torch

from conftest import core_ids, reference_ids
from tinyloop.engine import SamplingParams
from tinyloop.engine.sampling import Sampler, apply_logit_bias, processed_logits
from tinyloop.errors import ValidationError

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0], dtype=torch.float64)
PROMPT = [400, 3, 3, 3, 9, 250, 77, 12, 100, 5, 6]


def test_bias_is_added_to_the_named_tokens():
    out = apply_logit_bias(LOGITS, {1: 5.0, 4: -100})
    assert out.tolist() == [2.0, 6.0, 0.5, -1.0, -103.0] and LOGITS[1] == 1.0   # the input is left alone
    assert apply_logit_bias(LOGITS, None) is LOGITS and apply_logit_bias(LOGITS, {}) is LOGITS
    # over a draft head's columns (token ids 7, 1, 4, 30, 2): only the columns of biased tokens move
    cols = torch.tensor([7, 1, 4, 30, 2])
    assert apply_logit_bias(LOGITS, {1: 5.0, 2: 1.0, 9: 50.0}, cols).tolist() == [2.0, 6.0, 0.5, -1.0, -2.0]
    masked = torch.tensor([float("-inf"), 0.0])   # a token the grammar forbids stays forbidden
    assert apply_logit_bias(masked, {0: 100})[0] == float("-inf")
    # before the penalties: a forced token that was seen is still penalized (as vLLM orders them)
    p = SamplingParams(logit_bias={3: 4.0}, repetition_penalty=2.0)
    assert processed_logits(LOGITS, p, torch.tensor([3]), torch.zeros(5, dtype=torch.long))[3] == 1.5


def test_sampler_greedy_sampling_and_logprobs_take_the_bias():
    ban = Sampler(SamplingParams(temperature=0.0, logit_bias={0: -100}), [], 5)
    assert ban.penalized and not ban.plain_greedy and ban.sample(LOGITS) == 1
    force = Sampler(SamplingParams(temperature=1.0, seed=1, logit_bias={4: 100}), [], 5)
    assert {force.sample(LOGITS) for _ in range(50)} == {4}
    lp, alts = force.logprobs(LOGITS, 4, 2)
    assert lp > -1e-9 and alts[0][0] == 4
    banned = Sampler(SamplingParams(temperature=1.0, seed=2, logit_bias={0: -100, 1: -100}), [], 5)
    assert 0 not in {banned.sample(LOGITS) for _ in range(200)} and banned.logprobs(LOGITS, 2, 0)[0] > -1.5


@pytest.mark.parametrize("bias,message", [({512: 1.0}, "outside the vocabulary 0..511"), ({-1: 1.0}, "outside"),
                                          ({3: 101.0}, "-100..100"), ({3: -100.5}, "-100..100"),
                                          ({3: True}, "-100..100")])
def test_validation_names_logit_bias(bias, message):
    with pytest.raises(ValidationError) as e:
        SamplingParams(logit_bias=bias).validate(vocab_size=512)
    assert e.value.param == "logit_bias" and message in e.value.message
    SamplingParams(logit_bias={511: -100, 0: 100.0}).validate(vocab_size=512)


def test_generate_honours_the_bias(tiny64):
    plain = reference_ids(tiny64, PROMPT, SamplingParams(max_tokens=12, loops=6))
    ban = {t: -100 for t in set(plain)}
    core = core_ids(tiny64, PROMPT, SamplingParams(max_tokens=12, loops=6, logit_bias=ban))
    assert not set(core) & set(plain)
    assert core == reference_ids(tiny64, PROMPT, SamplingParams(max_tokens=12, loops=6, logit_bias=ban))
    forced = core_ids(tiny64, PROMPT, SamplingParams(max_tokens=6, loops=6, logit_bias={77: 100}))
    assert forced == [77] * 6


@pytest.mark.parametrize("mode,K", [("speculative", 1), ("tree_speculative", 3)])
@pytest.mark.parametrize("extra", [{}, dict(presence_penalty=0.5)])
def test_greedy_speculation_with_bias_equals_generate(tiny64, mode, K, extra):
    plain = reference_ids(tiny64, PROMPT, SamplingParams(max_tokens=24, loops=6))
    bias = {plain[0]: -100, plain[3]: -5.0, 300: 3.0}
    ref = reference_ids(tiny64, PROMPT, SamplingParams(max_tokens=24, loops=6, logit_bias=bias, **extra))
    assert ref != plain
    for vocab in (64, None):   # a draft head over a subset of the vocabulary, and the full head
        out = core_ids(tiny64, PROMPT, SamplingParams(max_tokens=24, mode=mode, verify_loops=6, draft_loops=2,
                                                      draft_ahead=4, k_branches=K, logit_bias=bias, **extra),
                       draft_vocab=vocab, draft_stop=0.0)
        assert out == ref


def test_shipped_engine_greedy_paths_honour_the_bias(tiny_engine):
    """Through Engine.load (the native executor where it is built: its fused head argmax is not taken)."""
    from tinyloop.engine.serving import run_ids

    prompt = tiny_engine.encode_prompt("The capital of France is")
    plain = run_ids(tiny_engine, prompt, SamplingParams(max_tokens=8))
    for mode in ("generate", "speculative"):
        out = run_ids(tiny_engine, prompt, SamplingParams(max_tokens=8, mode=mode, logit_bias={plain[0]: -100}))
        assert out and out[0] != plain[0]
        forced = run_ids(tiny_engine, prompt, SamplingParams(max_tokens=4, mode=mode, logit_bias={262: 100}))
        assert forced == [262] * 4
