"""The continuous-batching scheduler on its own: fake runner outputs, no model."""

from __future__ import annotations

import pytest

from tinyloop.engine.scheduler import (FINISHED, RUNNING, WAITING, PagePool, Scheduler, SchedulerError,
                                       SchedulerOutput, Sequence)


def seq(s: Scheduler, prompt_len: int, max_tokens: int = 8, slots: int = 2, **kw) -> Sequence:
    return Sequence(s.new_seq_id(), list(range(100, 100 + prompt_len)), max_tokens, slots, **kw)


def run_step(s: Scheduler, token: int = 7):
    """One step with a fake runner: every chunk that needs logits 'samples' `token`."""
    out = s.schedule()
    for c in out.chunks:
        for q in s.complete(c):
            s.append_token(q, token)
    return out


def finish_done(s: Scheduler) -> list[Sequence]:
    done = [q for q in list(s.running) if not q.external and q.n_generated >= q.max_tokens]
    for q in done:
        s.finish(q, "length")
    return done


def test_pool_refcounts_and_double_free():
    pool = PagePool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1
    pool.share(a[:1])
    pool.free(a)
    assert pool.num_free == 3 and pool.refcount(a[0]) == 1
    pool.free(a[:1])
    assert pool.num_free == 4
    with pytest.raises(SchedulerError):
        pool.free(a[:1])
    with pytest.raises(SchedulerError):
        pool.allocate(5)


def test_fifo_admission_and_max_num_seqs():
    s = Scheduler(n_pages=1000, page_size=4, max_num_seqs=2, max_batched_tokens=100)
    seqs = [seq(s, 3) for _ in range(4)]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    assert [c.seq for c in out.chunks] == seqs[:2] and all(c.needs_logits for c in out.chunks)
    assert [q.status for q in seqs] == [RUNNING, RUNNING, WAITING, WAITING]
    s.finish(seqs[0], "stop")
    out = s.schedule()
    assert seqs[2].status == RUNNING and seqs[3].status == WAITING  # oldest waiting goes first


def test_chunked_prefill_within_token_budget_and_decode_first():
    s = Scheduler(n_pages=1000, page_size=4, max_num_seqs=8, max_batched_tokens=10)
    a, b = seq(s, 25), seq(s, 3)
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert [(c.seq, c.start, c.n, c.needs_logits) for c in out.chunks] == [(a, 0, 10, False)]
    out = run_step(s)
    assert [(c.seq, c.start, c.n) for c in out.chunks] == [(a, 10, 10)]  # b waits: FIFO, budget spent
    out = run_step(s)
    assert [(c.seq, c.start, c.n, c.needs_logits) for c in out.chunks] == [(a, 20, 5, True), (b, 0, 3, True)]
    out = run_step(s)  # both decode now, one token each, oldest first
    assert [(c.seq, c.start, c.n) for c in out.chunks] == [(a, 25, 1), (b, 3, 1)]
    assert out.num_tokens == 2


def test_pages_per_slot_and_loops_cost_memory():
    s = Scheduler(n_pages=1000, page_size=4)
    shallow, deep = seq(s, 9, slots=4), seq(s, 9, slots=18)
    s.add(shallow)
    s.add(deep)
    run_step(s)
    # 9 positions -> 3 blocks of 4; one page per slot per block
    assert len(shallow.block_table) == 3 and all(len(b) == 4 for b in shallow.block_table)
    assert len(deep.block_table) == 3 and all(len(b) == 18 for b in deep.block_table)
    assert s.pool.num_free == 1000 - 3 * 4 - 3 * 18


def test_refuses_a_request_that_can_never_fit():
    s = Scheduler(n_pages=10, page_size=4)
    with pytest.raises(SchedulerError, match="KV pages"):
        s.add(seq(s, 20, max_tokens=20, slots=2))  # 40 positions = 10 blocks x 2 slots = 20 pages


def test_admission_waits_for_free_memory():
    s = Scheduler(n_pages=9, page_size=4, max_batched_tokens=100)
    a, b = seq(s, 8, max_tokens=4), seq(s, 8, max_tokens=4)
    s.add(a)
    s.add(b)
    run_step(s)
    # a holds 2 blocks x 2 slots; b needs its prompt's 4 pages plus one block of headroom (6) > 5 free
    assert a.status == RUNNING and b.status == WAITING and s.pool.num_free == 5
    while a.status == RUNNING:
        run_step(s)
        assert b.status == WAITING
        finish_done(s)
    out = run_step(s)
    assert b.status == RUNNING and [c.seq for c in out.chunks] == [b]


def test_preemption_when_memory_runs_out_then_recompute():
    s = Scheduler(n_pages=10, page_size=2, max_batched_tokens=100)
    a, b = seq(s, 3, max_tokens=9, slots=1), seq(s, 3, max_tokens=9, slots=1)
    s.add(a)
    s.add(b)
    run_step(s)
    assert a.status == b.status == RUNNING and s.pool.num_free == 6
    preempted, steps = [], 0
    while s.has_work:
        out = run_step(s)
        preempted += out.preempted
        finish_done(s)
        steps += 1
        assert steps < 50
    # each feeds 11 positions at its longest (6 pages of 2): 6 + 6 > 10 pages, so the newer one (b)
    # had to give way while a grew, and was recomputed after a finished
    assert preempted and all(q is b for q in preempted) and b.preemptions >= 1
    assert a.status == b.status == FINISHED
    assert a.n_generated == b.n_generated == 9
    assert s.pool.num_free == 10


def test_recompute_prefills_prompt_and_generated_tokens():
    s = Scheduler(n_pages=100, page_size=2, max_batched_tokens=100)
    a = seq(s, 3, slots=1)
    s.add(a)
    run_step(s)
    run_step(s)
    assert a.tokens[3:] == [7, 7] and a.n_cached == 4
    s._preempt(a, SchedulerOutput())
    out = s.schedule()
    # everything but the last sampled token is prefilled, without logits; then it decodes normally
    assert [(c.start, c.n, c.needs_logits) for c in out.chunks] == [(0, 4, False)]
    for c in out.chunks:
        assert s.complete(c) == []
    out = s.schedule()
    assert [(c.start, c.n, c.needs_logits) for c in out.chunks] == [(4, 1, True)]


def test_cancellation_frees_pages_at_once():
    s = Scheduler(n_pages=100, page_size=4)
    a, b = seq(s, 10), seq(s, 10)
    s.add(a)
    s.add(b)
    run_step(s)
    assert s.pool.num_free < 100
    s.finish(a, "abort")
    s.finish(b, "abort")
    s.finish(b, "abort")  # idempotent
    assert s.pool.num_free == 100 and not s.has_work
    c = seq(s, 4)
    s.add(c)
    s.finish(c, "abort")  # cancelled while still waiting
    assert not s.waiting and s.pool.num_free == 100


def test_fork_shares_full_blocks_and_copies_the_last_on_write():
    s = Scheduler(n_pages=100, page_size=4)
    p = seq(s, 6, n=3, slots=2)  # 6 positions: one full block and one partial
    s.add(p)
    out = s.schedule()
    group = s.complete(out.chunks[0])
    assert len(group) == 3 and group[0] is p
    kids = group[1:]
    assert all(k.block_table == p.block_table for k in kids)
    assert s.pool.num_free == 100 - 4  # 2 blocks x 2 slots, shared three ways
    for q in group:
        s.append_token(q, 9)
    out = s.schedule()
    # each writer of the shared partial block gets its own copy first (the last one keeps the original)
    assert len(out.copies) == 2 * 2
    assert len({k.block_table[1][0] for k in group}) == 3
    assert len({k.block_table[0][0] for k in group}) == 1  # the full block stays shared
    for q in group:
        s.finish(q, "stop")
    assert s.pool.num_free == 100


def test_external_sequences_reserve_pages_in_fifo_order():
    s = Scheduler(n_pages=20, page_size=4, max_num_seqs=4)
    ext = Sequence(s.new_seq_id(), [1, 2, 3], 4, 3, reserve_positions=18)  # 5 blocks x 3 slots = 15 pages
    a = seq(s, 4)
    s.add(ext)
    s.add(a)
    out = s.schedule()
    assert out.admitted_external == [ext] and ext.status == RUNNING
    assert s.pool.num_free == 20 - 15 - 2 and a.status == RUNNING
    assert len(ext.block_table) == 5 and all(len(b) == 3 for b in ext.block_table)
    s.finish(ext, "length")
    assert s.pool.num_free == 20 - len(a.block_table) * 2


def test_the_newest_sequence_gives_way_even_when_it_is_the_one_asking():
    s = Scheduler(n_pages=6, page_size=2, max_batched_tokens=100)
    a, b = seq(s, 3, max_tokens=8, slots=1), seq(s, 1, max_tokens=8, slots=1)
    s.add(a)
    s.add(b)
    preempted = []
    for _ in range(5):
        preempted += run_step(s).preempted
    # b (newer) needed a block when the pool was empty: it is preempted, not the older a
    assert preempted == [b] and a.status == RUNNING and a.preemptions == 0


# -- sliding-window rings ---------------------------------------------------------------------------
def ring_columns(q: Sequence) -> list[set[int]]:
    return [{blk[c] for blk in q.block_table} for c in range(q.n_slots)]


def test_a_sliding_window_column_keeps_its_ring_of_pages():
    """Column 1 is a sliding-window layer's: past R blocks, each block takes the pages of the block R back
    (one reference each), so the column holds R pages while the full column holds one a block; everything
    goes back to the pool at the end, and the budget counts the pages the ring saves."""
    s = Scheduler(n_pages=100, page_size=4, max_batched_tokens=64)
    q = seq(s, 40, max_tokens=30, slots=2, ring_cols=(1,), ring_blocks=3)
    assert s.max_pages(q) == 18 + 3     # 18 blocks in the full column, 3 in the ring
    s.add(q)
    while q.n_generated < 30:
        run_step(s)
    full, ring = ring_columns(q)
    assert len(q.block_table) == 18 and len(full) == 18 and len(ring) == 3
    assert all(q.block_table[b][1] == q.block_table[b - 3][1] for b in range(3, 18))
    assert all(s.pool.refcount(p) == 6 for p in ring)   # 18 blocks / 3
    assert s.pool.num_free == 100 - 21
    s.finish(q, "length")
    assert s.pool.num_free == 100


def test_a_ring_never_takes_over_a_page_another_holds():
    """Siblings share their prompt's pages: neither may write a shared page's positions, so each takes fresh
    pages for its ring (and copies the last block on write, as without one); a named block whose pages the
    ring takes over leaves the prefix cache."""
    s = Scheduler(n_pages=200, page_size=4, max_batched_tokens=64, prefix_caching=True)
    p = seq(s, 8, max_tokens=20, slots=2, n=2, ring_cols=(1,), ring_blocks=2, prefix_salt="x")
    s.add(p)
    out = s.schedule()
    group = s.complete(out.chunks[0])
    assert len(s.prefix) == 2
    for q in group:
        s.append_token(q, 9)
    for _ in range(12):
        run_step(s)
    a, b = group
    shared = {blk[1] for blk in a.block_table[:2]}
    assert shared == {blk[1] for blk in b.block_table[:2]}
    for q in group:   # the shared prompt pages were never taken over
        assert all(blk[1] not in shared for blk in q.block_table[2:])
        assert len(ring_columns(q)[1] - shared) == 2
    for q in group:
        s.finish(q, "stop")
    assert s.pool.num_free == 200

    s = Scheduler(n_pages=200, page_size=4, max_batched_tokens=64, prefix_caching=True)
    q = seq(s, 8, max_tokens=20, slots=2, ring_cols=(1,), ring_blocks=2, prefix_salt="x")
    s.add(q)
    run_step(s)
    assert len(s.prefix) == 2      # the prompt's two blocks, named
    for _ in range(4):
        run_step(s)                # positions 8..11: block 2 takes block 0's ring page, and is named
    assert len(q.block_table) == 3 and q.block_table[2][1] == q.block_table[0][1]
    assert s.prefix.peek(q.prefix_names[:1]) == [] and len(s.prefix) == 2   # block 0 is gone from the cache
    s.finish(q, "stop")
    assert s.pool.num_free == 200


def test_reserved_blocks_of_an_external_sequence_ring_too():
    s = Scheduler(n_pages=30, page_size=4, max_num_seqs=4)
    ext = Sequence(s.new_seq_id(), [1, 2, 3], 4, 3, reserve_positions=40, ring_cols=(0, 2), ring_blocks=2)
    s.add(ext)
    out = s.schedule()
    assert out.admitted_external == [ext]
    assert s.pool.num_free == 30 - (10 + 2 + 2) and [len(c) for c in ring_columns(ext)] == [2, 10, 2]
    s.finish(ext, "length")
    assert s.pool.num_free == 30
