"""The serving engine (continuous batch over a paged KV pool) against single-request runs.

In float64 (tiny64: ties impossible) a request's greedy tokens must not depend on what else is in the
batch, how its prompt was chunked, or whether it was preempted and recomputed."""

from __future__ import annotations

import random

import pytest
import torch

from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.serving import BatchEngine, run_to_completion
from tinyloop.errors import RequestTimeout, ValidationError
from tinyloop.modelfile.loader import LoadedModel
from tinyloop.tokenizer import Tokenizer


@pytest.fixture
def engine64(tiny64):
    return Engine(LoadedModel(tiny64, Tokenizer.gpt2(), {}, None))


def mixed_requests(n: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rnd.randrange(500) for _ in range(rnd.randrange(1, 40))]
        out.append((ids, SamplingParams(max_tokens=rnd.randrange(1, 24), loops=rnd.choice([1, 2, 3, 5]),
                                        ignore_eos=True, cache_window=rnd.choice([0, 0, 6]))))
    return out


def tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


@pytest.mark.parametrize("kw", [{}, {"page_size": 4, "max_batched_tokens": 16},
                                {"page_size": 3, "max_num_seqs": 3, "max_batched_tokens": 7}])
def test_greedy_batch_equals_single_runs(engine64, kw):
    items = mixed_requests(10)
    want = [engine64.generate(ids, p).token_ids for ids, p in items]
    batch = BatchEngine(engine64, **kw)
    got = [tokens(ev) for ev in run_to_completion(batch, items)]
    assert got == want
    assert batch.sched.pool.num_free == batch.sched.pool.n_pages  # every page back in the pool


def test_preempted_and_recomputed_requests_are_unchanged(engine64):
    items = mixed_requests(10, seed=1)
    want = [engine64.generate(ids, p).token_ids for ids, p in items]
    probe = BatchEngine(engine64, page_size=4)
    batch = BatchEngine(engine64, page_size=4, max_batched_tokens=16, kv_pool_bytes=probe.page_bytes * 220)
    got = [tokens(ev) for ev in run_to_completion(batch, items)]
    assert batch.preemptions > 0
    assert got == want


def test_seeded_sampling_is_independent_of_the_batch(engine64):
    rnd = random.Random(3)
    items = []
    for i in range(6):
        ids = [rnd.randrange(500) for _ in range(rnd.randrange(2, 20))]
        items.append((ids, SamplingParams(max_tokens=12, loops=rnd.choice([1, 3]), temperature=0.9, top_k=40,
                                          top_p=0.95, presence_penalty=0.5, repetition_penalty=1.2,
                                          seed=100 + i, ignore_eos=True)))
    want = [engine64.generate(ids, p).token_ids for ids, p in items]
    together = [tokens(ev) for ev in run_to_completion(BatchEngine(engine64, page_size=4), items)]
    alone = [tokens(run_to_completion(BatchEngine(engine64), [it])[0]) for it in items]
    assert together == alone == want


def test_n_choices_share_the_prompt_and_use_seed_plus_index(engine64):
    ids = list(range(30, 47))
    p = SamplingParams(max_tokens=10, loops=3, temperature=1.0, seed=7, ignore_eos=True)
    batch = BatchEngine(engine64, page_size=4)
    events = run_to_completion(batch, [(ids, p)], n=3)[0]
    by_index: dict[int, list[int]] = {}
    for e in events:
        by_index.setdefault(e.index, []).extend(e.token_ids)
    want = [engine64.generate(ids, p.replace(seed=7 + i)).token_ids for i in range(3)]
    assert [by_index[i] for i in range(3)] == want
    assert len({tuple(w) for w in want}) > 1
    finals = [e for e in events if e.finish_reason]
    assert sorted(e.index for e in finals) == [0, 1, 2]
    assert all(e.stats["prompt_tokens"] == len(ids) for e in finals)


def test_prefill_is_shared_between_choices(engine64):
    model = engine64.model
    ids = list(range(40))
    p = SamplingParams(max_tokens=1, loops=2, ignore_eos=True)
    model.core_loop_tokens = 0
    run_to_completion(BatchEngine(engine64), [(ids, p)], n=4)
    assert model.core_loop_tokens == len(ids) * 2  # one prefill of 40 tokens at 2 loops, for 4 choices


def test_a_sequence_leaves_the_loop_after_its_last_loop(engine64):
    model = engine64.model
    items = [([1, 2, 3], SamplingParams(max_tokens=4, loops=1, ignore_eos=True)),
             ([4, 5, 6], SamplingParams(max_tokens=4, loops=5, ignore_eos=True))]
    model.core_loop_tokens = 0
    run_to_completion(BatchEngine(engine64), items)
    # 3 prompt + 3 decode tokens each: 6 rows x 1 loop + 6 rows x 5 loops
    assert model.core_loop_tokens == 6 * 1 + 6 * 5


@pytest.mark.parametrize("kv", ["int8", "int4", "int4-h"])
def test_quantized_kv_in_the_batch_equals_single_runs(tiny64, kv):
    engine = Engine(LoadedModel(tiny64, Tokenizer.gpt2(), {}, None), kv_format=kv)
    items = mixed_requests(5, seed=2)
    want = [engine.generate(ids, p).token_ids for ids, p in items]
    assert [tokens(ev) for ev in run_to_completion(BatchEngine(engine, page_size=4), items)] == want


def test_speculative_requests_run_alongside_the_batch(engine64):
    ids = [5, 6, 7, 8, 9]
    items = [(ids, SamplingParams(max_tokens=16, mode="speculative", verify_loops=4, draft_loops=1, ignore_eos=True)),
             (ids, SamplingParams(max_tokens=16, mode="tree_speculative", verify_loops=4, draft_loops=2,
                                  k_branches=2, draft_ahead=3, ignore_eos=True)),
             (ids, SamplingParams(max_tokens=16, loops=4, ignore_eos=True))]
    want = engine64.generate(ids, SamplingParams(max_tokens=16, loops=4, ignore_eos=True)).token_ids
    batch = BatchEngine(engine64)
    events = run_to_completion(batch, items)
    assert [tokens(ev) for ev in events] == [want] * 3
    assert events[0][-1].stats["mode"] == "speculative" and "acceptance_rate" in events[0][-1].stats
    assert batch.sched.pool.num_free == batch.sched.pool.n_pages


def test_stop_strings_and_eos_inside_the_batch(engine64):
    ids = [11, 12, 13]
    full = engine64.generate(ids, SamplingParams(max_tokens=20, loops=2, ignore_eos=True))
    stop_id = full.token_ids[5]
    items = [(ids, SamplingParams(max_tokens=20, loops=2, stop_token_ids=[stop_id], ignore_eos=True)),
             (ids, SamplingParams(max_tokens=20, loops=2, ignore_eos=True))]
    events = run_to_completion(BatchEngine(engine64), items)
    first = events[0]
    cut = full.token_ids.index(stop_id)  # its first occurrence (<= 5)
    assert first[-1].finish_reason == "stop" and tokens(first) == full.token_ids[:cut]
    assert events[1][-1].finish_reason == "length" and tokens(events[1]) == full.token_ids


def test_abort_frees_pages_and_other_requests_go_on(engine64):
    batch = BatchEngine(engine64, page_size=4)
    seen: list = []
    a = batch.add(engine64.plan(list(range(20)), SamplingParams(max_tokens=50, loops=3, ignore_eos=True)), seen.append)
    b_events: list = []
    batch.add(engine64.plan(list(range(9)), SamplingParams(max_tokens=5, loops=3, ignore_eos=True)), b_events.append)
    for _ in range(3):
        batch.step()
    held = batch.sched.pool.n_pages - batch.sched.pool.num_free
    batch.abort(a)
    assert batch.sched.pool.n_pages - batch.sched.pool.num_free < held
    n_before = len(seen)
    while batch.has_work:
        batch.step()
    assert len(seen) == n_before  # nothing more for the aborted request
    assert b_events[-1] is None and b_events[-2].finish_reason == "length"
    assert batch.sched.pool.num_free == batch.sched.pool.n_pages


def test_timeouts(engine64):
    probe = BatchEngine(engine64)
    batch = BatchEngine(engine64, max_num_seqs=1, kv_pool_bytes=probe.page_bytes * 1000)
    first: list = []  # 16 loops: far slower than the 0.3 s limit allows for 200 tokens
    batch.add(engine64.plan([1, 2, 3], SamplingParams(max_tokens=200, loops=16, ignore_eos=True)), first.append, timeout_s=0.3)
    queued: list = []
    batch.add(engine64.plan([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)), queued.append, timeout_s=0.2)
    while batch.has_work:
        batch.step()
    # the running one ends like max_tokens, with what it made; the queued one never started: an error
    assert first[-2].finish_reason == "length" and first[-2].stats["timed_out"] is True
    assert 0 < first[-2].stats["completion_tokens"] < 200
    assert isinstance(queued[0], RequestTimeout) and queued[-1] is None


def test_a_request_that_never_fits_the_pool_is_refused(engine64):
    probe = BatchEngine(engine64, page_size=4)
    batch = BatchEngine(engine64, page_size=4, kv_pool_bytes=probe.page_bytes * 20)
    with pytest.raises(ValidationError, match="KV pages"):
        batch.add(engine64.plan(list(range(30)), SamplingParams(max_tokens=50, ignore_eos=True)), lambda ev: None)
    assert not batch.has_work


def test_float32_batched_logits_match_single_forward(tiny_engine):
    """float32: GEMM results depend on the batch's row count, so bit-equality with a single run is not
    promised (docs/serving.md); the logits must agree to float32 rounding."""
    from tinyloop.model.cache import SlotLayout
    from tinyloop.engine.scheduler import Sequence

    model = tiny_engine.model
    batch = BatchEngine(tiny_engine)
    prompts = [(tiny_engine.encode_prompt(t), loops) for t, loops in
               [("The king said", 2), ("Once upon a time there was", 3), ("Hello", 1)]]
    seqs = []
    for ids, loops in prompts:
        seqs.append(Sequence(batch.sched.new_seq_id(), ids, 4, SlotLayout(model.cfg, loops).n_slots, loops=loops))
        batch.sched.add(seqs[-1])
    out = batch.sched.schedule()
    logits = batch.runner.execute(out.chunks)
    with torch.inference_mode():
        for seq, (ids, loops) in zip(seqs, prompts):
            ref = model(torch.tensor([ids]), loops)[0, -1]
            torch.testing.assert_close(logits[seq.seq_id], ref, rtol=1e-4, atol=1e-4)
