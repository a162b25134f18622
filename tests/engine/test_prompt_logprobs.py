"""Prompt scoring (issue 17): each prompt token's log-probability, computed inside the batched core, equals
the log_softmax of one full forward pass (`Engine.logits`) at the request's loops."""

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
PROMPT = [5, 17, 300, 42, 7, 99, 1, 250, 8, 8, 64, 3, 200]


@pytest.fixture(scope="module")
def engine():
    return Engine(LoadedModel(varied_model(CFG, seed=0, dtype=torch.float64), None, {}, None))


def reference(engine, ids, loops):
    """log_softmax of the full forward's logits: row i - 1 scores token i."""
    return torch.log_softmax(engine.logits(ids, loops=loops).double(), -1)


def check(scores, engine, ids, loops, top):
    want = reference(engine, ids, loops)
    assert len(scores) == len(ids) and scores[0] is None
    for i in range(1, len(ids)):
        lp, alts = scores[i]
        assert lp == pytest.approx(float(want[i - 1, ids[i]]), abs=1e-4)
        assert len(alts) == top
        if top:
            assert [a for a, _ in alts] == torch.topk(want[i - 1], top).indices.tolist()
            assert [v for _, v in alts] == pytest.approx(torch.topk(want[i - 1], top).values.tolist(), abs=1e-4)


def scores_of(events):
    got = [e.prompt_logprobs for e in events if e.prompt_logprobs is not None]
    assert len(got) == 1, "the scores come once per choice, on its first event"
    assert events[0].prompt_logprobs is not None
    return got[0]


@pytest.mark.parametrize("loops", [1, 2, 3, 5])
def test_prompt_logprobs_are_the_log_softmax_of_the_full_forward(engine, loops):
    out = engine.generate(PROMPT, SamplingParams(max_tokens=2, loops=loops, prompt_logprobs=2, ignore_eos=True))
    check(out.prompt_logprobs, engine, PROMPT, loops, 2)
    assert len(out.token_ids) == 2 and out.logprobs is None


def test_chunked_prefill_and_a_batch_give_the_same_scores(engine):
    """A prompt longer than max_batched_tokens arrives in several chunks, next to other requests."""
    params = SamplingParams(max_tokens=3, loops=2, prompt_logprobs=1, ignore_eos=True)
    core = BatchEngine(engine, page_size=4, max_batched_tokens=5)
    events = run_to_completion(core, [([3, 3, 9], SamplingParams(max_tokens=6, loops=3)), (PROMPT, params),
                                      (PROMPT[:7], params.replace(loops=1, prompt_logprobs=0)),
                                      (PROMPT[::-1], SamplingParams(max_tokens=4, loops=1))])
    assert core.steps > 3
    check(scores_of(events[1]), engine, PROMPT, 2, 1)
    check(scores_of(events[2]), engine, PROMPT[:7], 1, 0)
    assert all(e.prompt_logprobs is None for e in events[0] + events[3])
    # the generated tokens are what they are without scoring
    plain = engine.generate(PROMPT, params.replace(prompt_logprobs=None)).token_ids
    assert [t for e in events[1] for t in e.token_ids] == plain


def test_max_tokens_zero_scores_the_prompt_only(engine):
    out = engine.generate(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
    assert out.completion_tokens == 0 and out.prompt_tokens == len(PROMPT)
    check(out.prompt_logprobs, engine, PROMPT, 3, 0)
    assert engine.generate([7], SamplingParams(max_tokens=0, prompt_logprobs=0)).prompt_logprobs == [None]


def test_choices_share_the_prompt_scores(engine):
    events = list(engine.stream(PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=1, prompt_logprobs=1,
                                                        ignore_eos=True), n=3))
    per_choice = {}
    for e in events:
        if e.prompt_logprobs is not None:
            assert e.index not in per_choice
            per_choice[e.index] = e.prompt_logprobs
    assert sorted(per_choice) == [0, 1, 2]
    check(per_choice[0], engine, PROMPT, 3, 1)
    assert per_choice[1] == per_choice[0] == per_choice[2]
    events = list(engine.stream(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=0), n=2))
    assert [e.index for e in events] == [0, 1] and all(e.finish_reason == "length" for e in events)


def test_the_stop_token_s_logprob_comes_on_the_final_event(engine):
    first = engine.generate(PROMPT, SamplingParams(max_tokens=1)).token_ids[0]
    events = list(engine.stream(PROMPT, SamplingParams(max_tokens=4, logprobs=1, stop_token_ids=[first])))
    assert [t for e in events for t in e.token_ids] == []
    tok, (lp, alts) = events[-1].stop_logprob
    assert tok == first == alts[0][0]
    assert lp == pytest.approx(float(reference(engine, PROMPT, 3)[-1, first]), abs=1e-6)


@pytest.mark.parametrize("kw, param", [(dict(prompt_logprobs=21), "prompt_logprobs"),
                                       (dict(prompt_logprobs=-1), "prompt_logprobs"),
                                       (dict(prompt_logprobs=True), "prompt_logprobs"),
                                       (dict(prompt_logprobs=1, mode="speculative"), "prompt_logprobs"),
                                       (dict(max_tokens=0), "max_tokens"),
                                       (dict(max_tokens=-1, prompt_logprobs=0), "max_tokens")])
def test_bad_prompt_logprobs_requests(engine, kw, param):
    with pytest.raises(ValidationError) as err:
        engine.plan(PROMPT, SamplingParams(**kw))
    assert err.value.param == param


def test_scores_survive_preemption_and_recompute(engine):
    import random

    rnd = random.Random(5)
    items = [([rnd.randrange(500) for _ in range(rnd.randrange(6, 24))],
              SamplingParams(max_tokens=10, loops=rnd.choice([1, 3]), prompt_logprobs=1, ignore_eos=True))
             for _ in range(10)]
    probe = BatchEngine(engine, page_size=4)
    core = BatchEngine(engine, page_size=4, max_batched_tokens=16, kv_pool_bytes=probe.page_bytes * 160)
    events = run_to_completion(core, items)
    assert core.preemptions > 0
    for (ids, p), evs in zip(items, events):
        check(scores_of(evs), engine, ids, p.loops, 1)
