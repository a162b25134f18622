"""What speculation's rounds cost on this host, and what the policy does with it: the head's cost by rows a chain
round's verification is chunked by, the check of whether drafting pays at all (`PlainCheck`), and the costs kept
between processes (engine/draft_policy.py, kernels/calls.py). On the shipped model as a user runs it (each test
that needs the native executor skips where it does not run the model); test_every_build.py runs them on every
build."""

from __future__ import annotations

import json
import os

import pytest


def test_head_chunk_follows_the_cost_by_rows():
    """Small chunks where head rows cost their own arithmetic (at acceptance 0.9 and five rows: two rows a call
    1.52 ms expected, three 1.51, one call 1.67), one call where extra rows are nearly free, one row at a time
    when drafts are rarely accepted and rows cost their own time."""
    from tinyloop.engine.draft_policy import head_chunk

    linear = [0.39, 0.70, 1.00, 1.30, 1.67]     # the shipped int8 head on AVX2 (ms by rows)
    flat = [0.46, 0.47, 0.56, 0.59, 0.61]       # the same with AMX tiles
    assert head_chunk(linear, 0.9, 5) == 3
    assert head_chunk(flat, 0.9, 5) == 5
    assert head_chunk(flat, 0.5, 5) == 5
    assert head_chunk([0.4, 0.8, 1.2, 1.6, 2.0], 0.2, 5) == 1
    assert head_chunk(flat, 0.9, 1) == 1


@pytest.mark.skipif(os.environ.get("TINYLOOP_NATIVE_ISA", "native") != "native",
                    reason="the draft policy's switching is Python's, the same on every build: run on the host's build; "
                           "on the scalar build its ~100 timed requests pass the 300 s limit (test_every_build)")
def test_speculation_decodes_plain_where_drafting_calls_lose_and_drafts_again_after(monkeypatch):
    """Where drafting calls realize fewer tokens a ms than plain ones in a way the round costs' medians do not show
    (two in five of them stalled three times as long as they ran, as a busy host's preemption would: drafting then at
    ~0.7x plain), the draft
    policy's check (`PlainCheck`: drafting and plain calls measured over their whole cycles, side by side) brings a
    lone request's rounds to plain calls within a bounded number of requests; when the stalls move to the plain
    calls, its probes of drafting see it and the requests draft again. Every output is plain decoding's.

    The return is steered by the stalls too, not left to the host: unstalled, how much drafting beats plain calls by
    depends on the machine and its load (on a loaded two-core host, the AVX2 build's drafting still measured 1.14x
    plain's ms a token after the stalls stopped), and the test is of the check's switching, not of the host."""
    import time

    from tinyloop.engine import Engine, SamplingParams
    from tinyloop.engine import native_rounds
    from tinyloop.engine.batch import BatchRunner
    from tinyloop.engine.draft_policy import _ROUND_COSTS
    from tinyloop.engine.plain_check import PlainCheck
    from tinyloop.engine.serving import BatchEngine, run_to_completion

    eng = Engine.load()
    if getattr(eng.model, "executor", None) is None:
        pytest.skip("the shipped model runs without the native executor here")
    _ROUND_COSTS.pop(eng.model, None)
    monkeypatch.setattr(PlainCheck, "MAX_GAP", 4 * PlainCheck.GAP)   # (the longest gap shorter: a quicker test)
    bound = 4 * PlainCheck.MAX_GAP // 48   # requests: a gap, then a few at GAP (~48 timed tokens a request)
    core = BatchEngine(eng, max_num_seqs=4, prefix_caching=False)
    ids = eng.tokenizer.encode("The king said to his people that")
    plain = [t for e in run_to_completion(core, [(ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))])[0]
             for t in e.token_ids]
    spec = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, mode="speculative")
    stall = {"on": None, "calls": 0}   # whose calls stall: "draft", "plain" or none
    run = BatchRunner.run_round

    def stalled(self, r):   # (the batch runner runs every whole round: BatchRunner.run_round)
        t0 = time.perf_counter()
        run(self, r)
        drafting = type(r) is native_rounds.NativeRound and r.k > 0   # (NativeSteps: k plain steps)
        if stall["on"] == ("draft" if drafting else "plain"):
            stall["calls"] += 1
            if stall["calls"] % 5 in (0, 2):
                time.sleep(3 * (time.perf_counter() - t0))

    def request():
        events = run_to_completion(core, [(ids, spec)])[0]
        assert [t for e in events for t in e.token_ids] == plain
        return events[-1].stats["plain_rounds"] / 64   # (the share of its tokens made by plain rounds)

    monkeypatch.setattr(BatchRunner, "run_round", stalled)
    try:
        for _ in range(4):
            request()
        check = next(c.check for c in _ROUND_COSTS[eng.model].values() if c.check.probes or c.verify_ms)
        assert check.drafting and min(request() for _ in range(3)) < 0.5   # drafting pays here (a request whose
        #                                                            tail probes plain calls makes half of it plain)
        stall["on"] = "draft"
        for n in range(bound):
            request()
            if not check.drafting:
                break
        assert not check.drafting, (check.ratio, check.probes, check.shifts)
        assert max(request() for _ in range(3)) > 0.8             # plain calls, a probe of drafting now and then
        stall["on"] = "plain"
        for n in range(bound):
            request()
            if check.drafting:
                break
        assert check.drafting, (check.ratio, check.probes, check.shifts)
        assert min(request() for _ in range(3)) < 0.5
    finally:
        monkeypatch.undo()


def test_the_head_costs_are_measured_once_a_host_and_kept(tmp_path, monkeypatch):
    """The head's cost by rows (what a chain round's lazy verification chunks by) is measured once and kept in
    the library's cache directory: a later executor (another `tinyloop generate` process) reads it instead of
    timing the head again; more rows than kept, or a damaged file, measure again."""
    from tinyloop.engine import Engine
    from tinyloop.kernels import calls

    eng = Engine.load()
    ex = getattr(eng.model, "executor", None)
    if ex is None or ex.streamed:
        pytest.skip("the shipped model runs without the native executor here")
    monkeypatch.setattr(calls, "cache_dir", lambda: tmp_path)
    timed = []
    real = calls._forward
    monkeypatch.setattr(calls, "_forward", lambda *a: timed.append(a[1].shape[0]) or real(*a))
    ex._head_costs = []
    first = ex.head_costs(5)
    assert len(first) == 5 and all(c > 0 for c in first) and timed
    assert sorted(set(timed)) == [1, 2, 3, 4, 5, 9]   # 1..5 and the most rows; the rest interpolated
    kept = (tmp_path / "head_costs.json").read_text()
    assert ex._head_key() in kept
    timed.clear()
    ex._head_costs = []
    assert ex.head_costs(5) == pytest.approx(first, abs=1e-4) and not timed   # read back, nothing timed
    ex._head_costs = []
    assert len(ex.head_costs(12)) == 12 and 12 in timed   # more rows than kept: measured again
    (tmp_path / "head_costs.json").write_text("{not json")
    timed.clear()
    ex._head_costs = []
    assert len(ex.head_costs(5)) == 5 and timed   # a damaged file: measured, and written whole again
    assert ex._head_key() in (tmp_path / "head_costs.json").read_text()


def test_round_costs_are_kept_for_the_next_process(tmp_path, monkeypatch):
    """A speculative request's end keeps the model's round costs beside the library (at most once per KEEP_EVERY
    seconds a table); a new table (the next `tinyloop generate` process) starts from them: the measured costs as
    estimates without samples (so each is measured again soon), its acceptance a bounded prior. Not the plain check's
    verdict; a damaged file, or a malformed entry, starts empty. The output is plain decoding's either way."""
    from types import SimpleNamespace

    from tinyloop.engine import Engine, SamplingParams, draft_policy, native as door
    from tinyloop.engine.batch import BatchRunner
    from tinyloop.engine.draft_policy import _ROUND_COSTS, DraftPolicy, RoundCosts, round_costs
    from tinyloop.kernels import calls

    def next_process(key):   # a new table, started by the runner as before a speculator's first round
        table = round_costs(eng.model, *key)
        policy = DraftPolicy(4, costs=table)
        BatchRunner(eng.model, None).prepare(SimpleNamespace(native=True, plan=SimpleNamespace(draft_ahead=0),
                                                             policy=policy))
        return table, policy

    eng = Engine.load()
    ex = getattr(eng.model, "executor", None)
    if ex is None:
        pytest.skip("the shipped model runs without the native executor here")
    monkeypatch.setattr(calls, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(draft_policy, "KEEP", True)
    _ROUND_COSTS.pop(eng.model, None)
    plain = eng.generate("The king said", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)).text
    spec = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, mode="speculative")
    assert eng.generate("The king said", spec).text == plain
    kept = json.loads((tmp_path / "round_costs.json").read_text())
    keys = [k for k, v in kept.items() if v["verify"]]
    assert keys and all(k.startswith(f"{ex.isa}|") and "sampled 0" in k for k in keys)
    first = _ROUND_COSTS.pop(eng.model)
    old = next(c for c in first.values() if c.verify_ms)
    old.check.drafting = False   # (a verdict the next process must not inherit)
    # the next process: a new table starts from the kept costs
    new, policy = next_process(next(k for k, c in first.items() if c is old))
    assert not new.to_restore and policy.prop > 0   # (restored once; the request's prior primed from it)
    assert new.verify_ms == pytest.approx({k: v for k, v in old.verify_ms.items() if old.samples(k)})
    assert new.draft_ms == pytest.approx(old.draft_ms) and new.call_ms == pytest.approx(old.call_ms)
    assert all(new.samples(k) == 0 for k in new.verify_ms)   # (estimates only: the policy measures each soon)
    assert new.check.drafting and new.proposed <= RoundCosts.PRIOR_DRAFTS
    assert new.prior() == pytest.approx(old.prior(), abs=1e-9)
    # kept again only after KEEP_EVERY seconds (a table first measured in a later request is kept then). The clock
    # stands still here: whether a later request drafts at all is the policy's choice on this host's costs (a CI host
    # decoded three requests plain, measuring no round), so the requests only show no table written twice, and the
    # schedule itself is driven by rounds measured by hand
    clock = [1000.0]
    monkeypatch.setattr(draft_policy, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    writes, real = [], door.keep_round_costs
    monkeypatch.setattr(door, "keep_round_costs", lambda m, k, v: writes.append(k) or real(m, k, v))
    for _ in range(3):
        assert eng.generate("The king said", spec).text == plain
    assert len(writes) == len(set(writes)), writes

    def due_now():
        return [s for s, _ in draft_policy.due(eng.model) if s == new.setting]

    clock[0] += draft_policy.KEEP_EVERY
    new.update(1, 1.0, 2.0)
    assert due_now() == [new.setting] and not due_now()   # (kept, if at all, KEEP_EVERY ago; then kept once)
    new.update(1, 1.0, 2.0)
    assert not due_now()   # (measured, but kept less than KEEP_EVERY seconds ago)
    clock[0] += draft_policy.KEEP_EVERY
    assert due_now() == [new.setting]
    clock[0] += draft_policy.KEEP_EVERY
    assert not due_now()   # (nothing measured since)
    # damaged, or malformed entries: an empty table
    (tmp_path / "round_costs.json").write_text("{not json")
    _ROUND_COSTS.pop(eng.model)
    assert not next_process((1, 8, False))[0].verify_ms
    bad = RoundCosts()
    bad.restore({"draft": 1.0, "verify": {"1": -2.0}, "call": None, "accepted": 1, "proposed": 2, "yields": {}})
    bad.restore({"draft": 1.0, "verify": {"1": 2.0}, "call": None, "accepted": 3, "proposed": 2, "yields": {}})
    bad.restore({"draft": "x"})
    assert not bad.verify_ms and bad.draft_ms is None and bad.prior() is None
