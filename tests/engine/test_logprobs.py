"""Log-probabilities of generated tokens (issue 17): of the distribution each token was drawn from."""

from __future__ import annotations

import pytest
import torch

from conftest import varied_model
from tinyloop.config import preset
from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.serving import BatchEngine, run_to_completion
from tinyloop.errors import ValidationError
from tinyloop.modelfile.loader import LoadedModel

CFG = preset("tiny").replace(vocab_size=512, eos_token_id=511, default_loops=3)
PROMPT = [5, 17, 300, 42, 7]


@pytest.fixture(scope="module")
def engine():
    return Engine(LoadedModel(varied_model(CFG, seed=0, dtype=torch.float64), None, {}, None))


def test_greedy_logprobs_are_the_log_softmax_of_the_models_logits(engine):
    out = engine.generate(PROMPT, SamplingParams(max_tokens=8, logprobs=3, ignore_eos=True))
    assert len(out.logprobs) == 8
    ids = PROMPT + out.token_ids
    logits = engine.logits(ids, loops=3)                      # full forward: position i predicts i + 1
    for i, (lp, alts) in enumerate(out.logprobs):
        want = torch.log_softmax(logits[len(PROMPT) - 1 + i].double(), -1)
        assert lp == pytest.approx(float(want[out.token_ids[i]]), abs=1e-6)
        assert [a for a, _ in alts] == torch.topk(want, 3).indices.tolist()
        assert alts[0][0] == out.token_ids[i] and alts[0][1] == pytest.approx(lp, abs=1e-12)


def test_sampled_logprobs_follow_temperature_and_truncation(engine):
    params = SamplingParams(max_tokens=6, temperature=0.7, top_k=5, seed=3, logprobs=5, ignore_eos=True)
    out = engine.generate(PROMPT, params)
    for lp, alts in out.logprobs:
        assert len(alts) == 5 and lp > float("-inf")          # the drawn token is one of the top 5
        probs = torch.tensor([v for _, v in alts], dtype=torch.float64).exp()
        assert float(probs.sum()) == pytest.approx(1.0, abs=1e-9)   # top-k 5: all the mass is in 5 tokens
    assert engine.generate(PROMPT, params.replace(logprobs=None)).logprobs is None


def test_logprobs_are_the_same_in_a_batch(engine):
    params = SamplingParams(max_tokens=6, logprobs=2, ignore_eos=True)
    alone = engine.generate(PROMPT, params).logprobs
    events = run_to_completion(BatchEngine(engine, page_size=4),
                               [([3, 3], SamplingParams(max_tokens=6, loops=2)), (PROMPT, params)])
    got = [lp for e in events[1] for lp in (e.logprobs or [])]
    assert [g[0] for g in got] == pytest.approx([a[0] for a in alone], abs=1e-9)


@pytest.mark.parametrize("kw", [dict(logprobs=21), dict(logprobs=-1), dict(logprobs=True)])
def test_bad_logprobs_requests(engine, kw):
    with pytest.raises(ValidationError) as err:
        engine.plan(PROMPT, SamplingParams(**kw))
    assert err.value.param == "logprobs"


@pytest.mark.parametrize("mode,kw", [("speculative", {}), ("tree_speculative", dict(k_branches=2)),
                                     ("tree_speculative", {})])
def test_speculative_logprobs_equal_plain_decodings_under_greedy(engine, mode, kw):
    plain = engine.generate(PROMPT, SamplingParams(max_tokens=10, logprobs=3, ignore_eos=True))
    spec = engine.generate(PROMPT, SamplingParams(max_tokens=10, logprobs=3, ignore_eos=True, mode=mode,
                                                  draft_loops=1, draft_ahead=3, **kw))
    assert spec.token_ids == plain.token_ids and len(spec.logprobs) == 10
    for (a, alts_a), (b, alts_b) in zip(plain.logprobs, spec.logprobs):
        assert b == pytest.approx(a, abs=1e-9)
        assert [t for t, _ in alts_b] == [t for t, _ in alts_a]
        assert [v for _, v in alts_b] == pytest.approx([v for _, v in alts_a], abs=1e-9)


def test_speculative_sampled_logprobs_follow_the_target_distribution(engine):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=4, seed=11, logprobs=4, ignore_eos=True,
                            mode="speculative", draft_loops=1, draft_ahead=3)
    out = engine.generate(PROMPT, params)
    assert len(out.logprobs) == 8
    for tok, (lp, alts) in zip(out.token_ids, out.logprobs):
        assert lp > float("-inf") and tok in [a for a, _ in alts]     # top-k 4: the drawn token is in it
        probs = torch.tensor([v for _, v in alts], dtype=torch.float64).exp()
        assert float(probs.sum()) == pytest.approx(1.0, abs=1e-9)
