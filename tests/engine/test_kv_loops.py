"""The loop-shared KV budget (kv_loops, issue 16): k core slots per layer instead of one per loop; a
position's slot holds its keys from the latest loop of that residue. Exact against the contiguous cache
with the same layout; the same alone and in a batch; memory per token measured."""

from __future__ import annotations

import pytest
import torch

from conftest import core_ids, reference_ids, varied_model
from tinyloop.config import preset
from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.serving import BatchEngine, run_to_completion, sequence_layout
from tinyloop.errors import ValidationError
from tinyloop.model.cache import SlotLayout
from tinyloop.modelfile.loader import LoadedModel

CFG = preset("tiny").replace(vocab_size=512, eos_token_id=511, default_loops=6)
PROMPT = [5, 17, 300, 42, 7]


@pytest.fixture(scope="module")
def model():
    return varied_model(CFG, seed=0, dtype=torch.float64)


def test_layout_and_bytes_per_token():
    shipped = preset("tinyloop-16m")
    full, last = SlotLayout(shipped, 8), SlotLayout(shipped, 8, kv_loops=1)
    assert (full.n_slots, last.n_slots) == (18, 4) and last.n_slots / full.n_slots <= 0.25
    two = SlotLayout(shipped, 8, kv_loops=2)
    assert two.n_slots == 6 and two.core(5, 1) == two.core(1, 1) != two.core(2, 1)
    assert two.columns()[full.core(5, 1)] == two.core(5, 1) and SlotLayout(shipped, 8, kv_loops=8).columns() is None


@pytest.mark.parametrize("kv", ["last", 2])
def test_shared_slots_match_the_contiguous_cache_with_the_same_layout(model, kv):
    k = 1 if kv == "last" else kv
    got = core_ids(model, PROMPT, SamplingParams(max_tokens=16, loops=6, kv_loops=kv))
    want = reference_ids(model, PROMPT, SamplingParams(max_tokens=16, loops=6), kv_loops=k)
    assert got == want
    assert got != core_ids(model, PROMPT, SamplingParams(max_tokens=16, loops=6))  # the budget is real
    engine = Engine(LoadedModel(model, None, {}, None))
    plan = engine.plan(PROMPT, SamplingParams(max_tokens=16, loops=6, kv_loops=kv))
    assert sequence_layout(model, plan).n_slots == 2 + 2 * k


def test_same_alone_and_in_a_batch(model):
    engine = Engine(LoadedModel(model, None, {}, None))
    last = SamplingParams(max_tokens=12, loops=6, kv_loops="last", ignore_eos=True)
    alone = core_ids(model, PROMPT, last)
    items = [([9, 9], SamplingParams(max_tokens=12, loops=3, ignore_eos=True)), (PROMPT, last),
             ([4, 1, 7], SamplingParams(max_tokens=12, loops="auto", kv_loops="last", ignore_eos=True))]
    events = run_to_completion(BatchEngine(engine, page_size=4), items)
    assert [t for e in events[1] for t in e.token_ids] == alone


@pytest.mark.parametrize("kw", [dict(kv_loops=0), dict(kv_loops="some"), dict(kv_loops="last", mode="speculative")])
def test_bad_budgets_name_the_field(model, kw):
    engine = Engine(LoadedModel(model, None, {}, None))
    with pytest.raises(ValidationError) as err:
        engine.plan(PROMPT, SamplingParams(loops=6, **kw))
    assert err.value.param == "kv_loops"
