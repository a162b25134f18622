"""Prefix caching (issue 17): full KV blocks shared across requests by content, never changing outputs.

The scheduler tests use a fake runner (no model); the engine tests run tiny float64 models, where a
request's greedy tokens and log-probabilities must be the same with and without the cache."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import varied_model
from tinyloop.config import preset
from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.prefix_cache import block_name
from tinyloop.engine.scheduler import PagePool, Scheduler, Sequence
from tinyloop.engine.serving import BatchEngine, run_to_completion
from tinyloop.modelfile.loader import LoadedModel

SALT = ("loops", 2, "window", 0)


def make_seq(s: Scheduler, prompt: list[int], max_tokens: int = 4, slots: int = 2, **kw) -> Sequence:
    kw.setdefault("prefix_salt", SALT)
    return Sequence(s.new_seq_id(), list(prompt), max_tokens, slots, **kw)


def run_until_done(s: Scheduler, seqs: list[Sequence], token: int = 7) -> None:
    while any(q.status != "finished" for q in seqs):
        out = s.schedule()
        for c in out.chunks:
            for q in s.complete(c):
                s.append_token(q, token)
        for q in list(s.running):
            if q.n_generated >= q.max_tokens:
                s.finish(q, "length")


def test_a_repeated_prompt_takes_the_cached_full_blocks():
    s = Scheduler(n_pages=64, page_size=4, prefix_caching=True)
    prompt = list(range(100, 114))                 # 14 tokens: 3 full blocks + 2
    a = make_seq(s, prompt)
    s.add(a)
    s.schedule()
    a_blocks = [list(b) for b in a.block_table[:3]]
    run_until_done(s, [a])
    assert s.pool.num_free == 64                   # cached pages count as free
    b = make_seq(s, prompt + [1, 2])
    s.add(b)
    out = s.schedule()
    assert b.block_table[:3] == a_blocks and b.prompt_cached == 12
    assert [(c.start, c.n) for c in out.chunks] == [(12, 4)]   # only the rest is prefilled
    assert s.prefix.hit_tokens == 12


def test_a_running_sequences_blocks_are_shared_not_copied():
    s = Scheduler(n_pages=64, page_size=4, prefix_caching=True)
    prompt = list(range(9))                        # 2 full blocks + 1
    a = make_seq(s, prompt, max_tokens=8)
    s.add(a)
    for c in s.schedule().chunks:                  # a's prompt: its 2 full blocks are named
        for q in s.complete(c):
            s.append_token(q, 7)
    b = make_seq(s, prompt)
    s.add(b)
    s.schedule()
    assert b.block_table[:2] == a.block_table[:2]
    assert all(s.pool.refcount(p) == 2 for blk in a.block_table[:2] for p in blk)
    s.finish(a, "stop")
    s.finish(b, "stop")
    assert s.pool.num_free == 64


def test_whole_prompt_cached_still_computes_its_last_token():
    s = Scheduler(n_pages=64, page_size=4, prefix_caching=True)
    prompt = list(range(8))                        # exactly 2 blocks
    a = make_seq(s, prompt)
    s.add(a)
    run_until_done(s, [a])
    b = make_seq(s, prompt)
    s.add(b)
    out = s.schedule()
    assert b.prompt_cached == 4 and [(c.start, c.n, c.needs_logits) for c in out.chunks] == [(4, 4, True)]


@pytest.mark.parametrize("kw", [dict(prefix_salt=("loops", 3, "window", 0)), dict(prefix_salt=None),
                                dict(prefix_reads=False)])
def test_no_hit_across_depths_or_when_reads_are_off(kw):
    s = Scheduler(n_pages=64, page_size=4, prefix_caching=True)
    prompt = list(range(13))
    a = make_seq(s, prompt)
    s.add(a)
    run_until_done(s, [a])
    b = make_seq(s, prompt, **kw)
    s.add(b)
    out = s.schedule()
    assert b.prompt_cached == 0 and [(c.start, c.n) for c in out.chunks] == [(0, 13)]


def test_adaptive_sequences_share_only_prompt_blocks():
    s = Scheduler(n_pages=64, page_size=4, prefix_caching=True)
    a = make_seq(s, list(range(6)), max_tokens=10, prefix_upto=6)
    s.add(a)
    run_until_done(s, [a])
    assert len(s.prefix) == 1                       # 16 positions computed, one block of prompt


def test_cached_pages_are_evicted_least_recent_first_under_pressure():
    s = Scheduler(n_pages=12, page_size=4, prefix_caching=True)    # 6 blocks of 2 slots
    first = make_seq(s, list(range(9)), max_tokens=1)              # 3 blocks
    s.add(first)
    run_until_done(s, [first])
    assert len(s.prefix) == 2 and s.pool.num_free == 12
    hog = make_seq(s, list(range(500, 517)), max_tokens=3)         # 5 blocks: must evict
    s.add(hog)
    run_until_done(s, [hog])
    again = make_seq(s, list(range(9)), max_tokens=1)
    s.add(again)
    s.schedule()
    # never-used pages went first, then the old prefix's tail (released first); its head survived
    assert again.prompt_cached == 4
    assert all(len(pages) == 2 for pages in s.prefix._blocks.values())
    s.finish(again, "stop")
    assert s.pool.num_free == 12


def test_pool_take_gets_a_free_page_back_and_reuse_is_reported():
    pool = PagePool(4)
    reused = []
    pool.on_reuse = reused.append
    a = pool.allocate(2)
    pool.free(a)
    pool.take(a[:1])
    assert pool.refcount(a[0]) == 1 and pool.num_free == 3
    assert reused == a                             # both were handed out once
    rest = pool.allocate(3)                        # never-used pages first, then the oldest released
    assert rest == [2, 3, a[1]] and reused[2:] == rest


def test_block_names_chain_and_salt():
    a = block_name(None, [1, 2], SALT)
    assert a != block_name(None, [1, 2], ("loops", 3, "window", 0))
    assert block_name(a, [3, 4], SALT) != block_name(block_name(None, [9, 9], SALT), [3, 4], SALT)


# -- the engine: cached and uncached runs are equal (float64) -----------------------------------------
CFG = preset("tiny").replace(vocab_size=512, eos_token_id=511, default_loops=3)


@pytest.fixture(scope="module")
def engine():
    return Engine(LoadedModel(varied_model(CFG, seed=1, dtype=torch.float64), None, {}, None))


def shared_prefix_requests(seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    rnd = random.Random(seed)
    system = [rnd.randrange(500) for _ in range(23)]
    out = []
    for i in range(8):
        tail = [rnd.randrange(500) for _ in range(rnd.randrange(1, 9))]
        out.append((system + tail, SamplingParams(max_tokens=rnd.randrange(3, 12), loops=rnd.choice([2, 3]),
                                                   ignore_eos=True, logprobs=2,
                                                   cache_window=rnd.choice([0, 0, 0, 5]))))
    return out


def summary(events):
    toks = [t for e in events for t in e.token_ids]
    lps = [lp for e in events for lp, _ in (e.logprobs or [])]
    return toks, lps


@pytest.mark.parametrize("kw", [dict(page_size=4), dict(page_size=4, max_batched_tokens=10),
                                dict(page_size=3, max_num_seqs=2)])
def test_cached_and_uncached_runs_are_equal(engine, kw):
    items = shared_prefix_requests()
    plain = [summary(ev) for ev in run_to_completion(BatchEngine(engine, prefix_caching=False, **kw), items)]
    core = BatchEngine(engine, **kw)
    # one at a time (every later request finds the prefix), then all together (hits on running sequences)
    one_by_one = [summary(run_to_completion(core, [it])[0]) for it in items]
    together = run_to_completion(core, items)
    assert core.sched.prefix.hit_tokens > 0
    for want, got in zip(plain, one_by_one + [summary(ev) for ev in together]):
        assert got[0] == want[0]
        assert got[1] == pytest.approx(want[1], abs=1e-9)
    for want, got in zip(plain, [summary(ev) for ev in together]):
        assert got[0] == want[0]
    assert core.sched.pool.num_free == core.sched.pool.n_pages


def test_cached_tokens_are_reported_and_preemption_keeps_outputs(engine):
    items = shared_prefix_requests(seed=3)
    plain = [summary(ev)[0] for ev in run_to_completion(BatchEngine(engine, prefix_caching=False, page_size=4), items)]
    probe = BatchEngine(engine, page_size=4)
    small = BatchEngine(engine, page_size=4, max_batched_tokens=12, kv_pool_bytes=probe.page_bytes * 150)
    events = run_to_completion(small, items)
    assert [summary(ev)[0] for ev in events] == plain
    cached = [ev[-1].stats["prompt_tokens_cached"] for ev in events]
    assert cached[0] == 0 and max(cached) >= 20 and all(c % 4 == 0 for c in cached)


def test_n_choices_and_adaptive_depth_with_the_cache(engine):
    prompt = list(range(40, 70))
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True)
    auto = SamplingParams(max_tokens=6, loops="auto", max_loops=3, ignore_eos=True)
    plain = BatchEngine(engine, page_size=4, prefix_caching=False)
    core = BatchEngine(engine, page_size=4)
    run_to_completion(core, [(prompt, SamplingParams(max_tokens=2, loops=3))])   # warms the prefix
    want, got = {}, {}
    for out, core_ in ((want, plain), (got, core)):
        for e in run_to_completion(core_, [(prompt, params)], n=3)[0]:
            out.setdefault(e.index, []).extend(e.token_ids)
    assert got == want and len(got) == 3
    a = run_to_completion(plain, [(prompt, auto)])[0]
    b = run_to_completion(core, [(prompt, auto)])[0]
    assert summary(b)[0] == summary(a)[0] and b[-1].stats["prompt_tokens_cached"] == 28


@pytest.mark.parametrize("exit_", [False, True])
def test_speculative_sequences_share_prompt_blocks_and_keep_their_outputs(exit_):
    from tinyloop.model.draft_exit import DraftExit, attach_draft_exits

    model = varied_model(CFG.replace(default_loops=4), seed=2, dtype=torch.float64)
    if exit_:   # a draft exit for depth 1 with its own cache slots (perturbed: it drafts differently)
        ex = DraftExit.from_model(model)
        with torch.no_grad():
            for p in ex.parameters():
                p.add_(0.2 * p.abs().mean() * torch.randn(p.shape, generator=torch.Generator().manual_seed(3),
                                                            dtype=torch.float64))
        attach_draft_exits(model, {1: ex.eval()})
    eng = Engine(LoadedModel(model, None, {}, None))
    items = [(it[0], SamplingParams(max_tokens=8, ignore_eos=True, mode=mode, draft_loops=1, draft_ahead=3,
                                    logprobs=1))
             for it, mode in zip(shared_prefix_requests(seed=5)[:4], ["speculative", "tree_speculative"] * 2)]
    plain = [summary(ev) for ev in run_to_completion(BatchEngine(eng, page_size=4, prefix_caching=False), items)]
    core = BatchEngine(eng, page_size=4, speculation={"draft_vocab": None})
    got = [run_to_completion(core, [it])[0] for it in items]
    for want, ev in zip(plain, got):
        assert summary(ev)[0] == want[0]
        assert summary(ev)[1] == pytest.approx(want[1], abs=1e-9)
    cached = [ev[-1].stats["prompt_tokens_cached"] for ev in got]
    assert cached[0] == 0 and all(c >= 20 for c in cached[1:])
    assert core.sched.pool.num_free == core.sched.pool.n_pages
