"""The one engine core: every path (Engine, batch, speculation) runs `LoopedTransformer.run` over the
pool; speculative passes are rows of the same batched steps; no KV memory outside the pool."""

from __future__ import annotations

import pytest
import torch

from conftest import reference_ids, varied_model
from tinyloop.config import preset
from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.serving import BatchEngine, run_to_completion
from tinyloop.errors import ValidationError
from tinyloop.model.paged import PagedStep
from tinyloop.modelfile.loader import LoadedModel
from tinyloop.quant import kv as kv_mod


def engine_for(model, **kw) -> Engine:
    return Engine(LoadedModel(model, None, {}, None), **kw)


def tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


SPEC = [dict(mode="speculative", verify_loops=5, draft_loops=2, draft_ahead=3),
        dict(mode="speculative", verify_loops=4, draft_loops=1, draft_ahead=6, cache_window=7),
        dict(mode="tree_speculative", verify_loops=5, draft_loops=2, draft_ahead=3, k_branches=3)]


def test_speculation_runs_inside_the_batch_on_pool_pages(tiny64, monkeypatch):
    """Chain and tree requests among plain ones: each output equals its single reference run; their draft
    and verify rows share forward passes with plain rows; nothing allocates KV outside the pool."""
    engine = engine_for(tiny64)
    prompts = [[5, 17, 300, 42, 7], [1, 2], list(range(40, 60)), [400, 3, 3, 9]]
    items = []
    for i, prompt in enumerate(prompts * 2):
        if i % 2:
            kw = SPEC[i % len(SPEC)]
        else:
            kw = dict(loops=[2, 5, 3][i % 3], cache_window=[0, 6][i % 2])
        items.append((prompt, SamplingParams(max_tokens=20, ignore_eos=True, **kw)))
    want = []
    for prompt, p in items:
        depth = p.verify_loops if p.mode != "generate" else p.loops
        want.append(reference_ids(tiny64, prompt, SamplingParams(max_tokens=20, loops=depth,
                                                                  cache_window=p.cache_window)))
    batch = BatchEngine(engine, page_size=4)
    # from here on, KV storage may only be the pool's: count every KV store made
    made = []
    real_init = kv_mod.KVTensor.__init__
    monkeypatch.setattr(kv_mod.KVTensor, "__init__", lambda self, *a, **k: (made.append(a), real_init(self, *a, **k))[1])
    mixed_steps = []
    real_run = tiny64.run

    def run(step: PagedStep):
        kinds = {"spec" if r.tag.__class__.__name__ == "Speculator" else "plain" for r in step.rows}
        mixed_steps.append(kinds == {"spec", "plain"})
        spec_pages = [r for r in step.rows if r.tag.__class__.__name__ == "Speculator"]
        for r in spec_pages:  # a speculative pass reads and writes this sequence's pool pages
            assert r.table.max() < batch.kv.n_pages
        return real_run(step)

    monkeypatch.setattr(tiny64, "run", run)
    events = run_to_completion(batch, items)
    assert [tokens(ev) for ev in events] == want
    assert made == []
    assert sum(mixed_steps) >= 10  # draft and verify passes rode along with plain decode steps
    for ev, (_, p) in zip(events, items):
        if p.mode != "generate":
            assert ev[-1].stats["mode"] == p.mode and ev[-1].stats["rounds"] >= 1
    assert batch.sched.pool.num_free == batch.sched.pool.n_pages


def test_speculative_pages_are_held_while_running_and_counted(tiny64):
    engine = engine_for(tiny64)
    batch = BatchEngine(engine, page_size=4)
    plan = engine.plan([1, 2, 3], SamplingParams(max_tokens=10, mode="speculative", verify_loops=4,
                                                 draft_loops=1, ignore_eos=True))
    batch.add(plan, lambda ev: None)
    batch.step()
    used = batch.sched.pool.n_pages - batch.sched.pool.num_free
    cfg = tiny64.cfg
    assert used == batch.pages_needed(plan) == plan.blocks(4) * (cfg.n_prelude + cfg.n_coda + 4 * cfg.n_core)
    while batch.has_work:
        batch.step()
    assert batch.sched.pool.num_free == batch.sched.pool.n_pages


@pytest.mark.parametrize("default_loops", [3, 12])
def test_the_models_default_depth_is_used_everywhere(default_loops):
    """A model whose default_loops is not 8: requests without loops/verify_loops run at its depth (plain
    and speculative), and a draft deeper than that depth is a 400 before any work, never a mid-stream
    failure."""
    cfg = preset("tiny").replace(vocab_size=512, eos_token_id=511, default_loops=default_loops, max_loops=16)
    model = varied_model(cfg, seed=2, dtype=torch.float64)
    engine = engine_for(model)
    prompt = [5, 6, 7, 8]
    ref = reference_ids(model, prompt, SamplingParams(max_tokens=12, loops=default_loops))
    plain = engine.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    assert plain.token_ids == ref and plain.stats["loops_used"] == default_loops
    spec = engine.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True, mode="speculative",
                                                  draft_loops=default_loops - 1))
    assert spec.token_ids == ref and spec.stats["verify_loops"] == default_loops
    with pytest.raises(ValidationError) as err:
        engine.plan(prompt, SamplingParams(mode="speculative", draft_loops=4 if default_loops == 3 else 13))
    assert err.value.param == "draft_loops"


def test_engine_stream_closed_early_frees_its_pages(tiny64):
    engine = engine_for(tiny64)
    for kw in ({"loops": 3}, SPEC[0], SPEC[2]):
        gen = engine.stream([1, 2, 3, 4], SamplingParams(max_tokens=30, ignore_eos=True, **kw))
        assert next(gen).token_ids
        gen.close()
        core = engine.core()
        assert core.sched.pool.num_free == core.sched.pool.n_pages and not core.has_work


def test_engine_stream_gives_n_choices_sharing_one_prefill(tiny64):
    engine = engine_for(tiny64)
    params = SamplingParams(max_tokens=8, loops=3, temperature=1.0, seed=11, ignore_eos=True)
    events = list(engine.stream([7, 8, 9], params, n=3))
    finals = [e for e in events if e.finish_reason is not None]
    assert sorted(e.index for e in finals) == [0, 1, 2]
    outs = [[t for e in events if e.index == i for t in e.token_ids] for i in range(3)]
    assert all(len(o) == 8 for o in outs) and len({tuple(o) for o in outs}) == 3  # seeds seed + index
    alone = engine.generate([7, 8, 9], params.replace(seed=12))  # choice 1 = the same request at seed + 1
    assert alone.token_ids == outs[1]


def test_engine_generate_from_several_threads(tiny64):
    """Each calling thread runs its own core: concurrent generate calls do not share a batch's state."""
    from concurrent.futures import ThreadPoolExecutor

    engine = engine_for(tiny64)
    jobs = [([3, 4, 5 + i], SamplingParams(max_tokens=12, loops=1 + i % 4, ignore_eos=True)) for i in range(8)]
    want = [reference_ids(tiny64, p, sp) for p, sp in jobs]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda job: engine.generate(*job).token_ids, jobs))
    assert got == want
