"""A sequence decoding alone makes several tokens per native call (engine/fast_steps.py `_lone_plain_steps`,
`tl_generate`): the output is exactly the one-step-per-call output for every kind of plain request it takes
(greedy at any depth, `loops: "auto"`, sampled with top-k / top-p), and every way an output ends (max_tokens
between two calls' worth, EOS, a stop string) ends it at the same token with the same finish reason. Requests
it must not take (a second sequence running, logprobs, penalties) run the per-step path. Under a grammar the
call picks each token under the grammar's bitmask and hands it back through a callback: the same tokens, the
grammar's end (EOS) at the same place, and a grammar that fails inside the call fails that request alone.

Why equal, not close: a call's steps are the engine's own rows (tl_decode of one row, then tl_head of one
row, the draw under the key of the token's output index, over the allowed tokens where a grammar is), run back
to back; nothing in a row's arithmetic depends on how the calls are grouped. The per-step path under a grammar
picks in the same head call under the same bitmask (`Sampler.head_pick`), so the two runs compare the
grouping alone; tests/engine/test_constraint.py holds the masked pick to the PyTorch sampler's.
"""

from __future__ import annotations

import json
import os

import pytest

from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine import fast_steps
from tinyloop.engine.constraint import Constraint
from tinyloop.engine.serving import BatchEngine, run_to_completion

kernels = pytest.importorskip("tinyloop.kernels.lib")


@pytest.fixture(scope="module")
def engine(shipped_model_path):
    if os.environ.get("TINYLOOP_EXECUTOR") == "torch":
        pytest.skip("the one-call steps are the native executor's")
    try:
        kernels.load()
    except kernels.NativeBuildError as exc:
        pytest.skip(f"native library unavailable: {exc}")
    eng = Engine.load(shipped_model_path)
    assert eng.model.executor is not None
    return eng


def _run(engine, prompt, params, monkeypatch, steps: int):
    """(tokens, final event, the native generate calls' step counts) of the request alone on a core, with
    MULTI_STEPS = steps (1: one step per call)."""
    monkeypatch.setattr(fast_steps, "MULTI_STEPS", steps)
    ex = engine.model.executor
    calls = []
    orig = type(ex).generate
    monkeypatch.setattr(ex, "generate", lambda *a, **kw: (calls.append(a[7]), orig(ex, *a, **kw))[1])
    events = run_to_completion(BatchEngine(engine, max_num_seqs=1), [(prompt, params)])[0]
    return [t for e in events for t in e.token_ids], events[-1], calls


PROMPT = "And the LORD spake unto Moses, saying,"


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=21, temperature=0, loops=8, ignore_eos=True),
    SamplingParams(max_tokens=19, temperature=0, loops=3, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0, loops="auto", ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.8, seed=3, top_p=0.9, loops=4, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=1.0, seed=11, top_k=40, loops=8, ignore_eos=True),
], ids=["greedy-8", "greedy-3", "auto", "top-p", "top-k"])
def test_several_steps_a_call_give_the_per_step_output(engine, monkeypatch, params):
    prompt = engine.tokenizer.encode(PROMPT)
    want, last_want, none = _run(engine, prompt, params, monkeypatch, 1)
    got, last, calls = _run(engine, prompt, params, monkeypatch, 8)
    assert not none and calls and max(calls) == 8            # (19-21 tokens: calls of 8, then the rest)
    assert got == want and len(got) == params.max_tokens
    assert last.finish_reason == last_want.finish_reason == "length"
    assert last.text == last_want.text
    for key in ("loops_used", "loops_histogram", "completion_tokens"):
        assert last.stats.get(key) == last_want.stats.get(key), key


def test_an_output_ends_at_the_same_token(engine, monkeypatch):
    """EOS and a stop string inside a call's tokens end the output there, with the per-step path's reason."""
    prompt = engine.tokenizer.encode(PROMPT)
    free, _, _ = _run(engine, prompt, SamplingParams(max_tokens=40, temperature=0, loops=8, ignore_eos=True),
                      monkeypatch, 1)
    # a stop id in the middle of the second call, and a stop string made of a later token's text
    stop_id = free[11]
    text = engine.tokenizer.decode([free[17]]).strip()
    for params in (SamplingParams(max_tokens=40, temperature=0, loops=8, stop_token_ids=[stop_id]),
                   SamplingParams(max_tokens=40, temperature=0, loops=8, stop=[text], ignore_eos=True)):
        want, last_want, _ = _run(engine, prompt, params, monkeypatch, 1)
        got, last, calls = _run(engine, prompt, params, monkeypatch, 8)
        assert calls and got == want and len(got) < 17
        assert last.finish_reason == last_want.finish_reason == "stop"


def test_requests_it_must_not_take_run_step_by_step(engine, monkeypatch):
    prompt = engine.tokenizer.encode(PROMPT)
    for params in (SamplingParams(max_tokens=12, temperature=0, loops=4, logprobs=2),
                   SamplingParams(max_tokens=12, temperature=0, loops=4, repetition_penalty=1.3),
                   SamplingParams(max_tokens=12, temperature=0, loops=4, repetition_penalty=1.3,
                                  constraint=Constraint("json_object"))):
        _, _, calls = _run(engine, prompt, params, monkeypatch, 8)
        assert not calls, params
    # two sequences at once: the shared step, and each output is what it is alone
    a = SamplingParams(max_tokens=16, temperature=0, loops=8, ignore_eos=True)
    b = SamplingParams(max_tokens=6, temperature=0, loops=3, ignore_eos=True)
    alone = [_run(engine, prompt, p, monkeypatch, 8)[0] for p in (a, b)]
    monkeypatch.setattr(fast_steps, "MULTI_STEPS", 8)
    ex = engine.model.executor
    calls = []
    orig = type(ex).generate
    monkeypatch.setattr(ex, "generate", lambda *a, **kw: (calls.append(a[7]), orig(ex, *a, **kw))[1])
    res = run_to_completion(BatchEngine(engine, max_num_seqs=4), [(prompt, a), (prompt, b)])
    together = [[t for e in ev for t in e.token_ids] for ev in res]
    assert together == alone
    # while both run, no call takes several steps; after the short one ends, the long one runs alone:
    # 16 - 6 - 1 tokens left, in calls of up to 8
    assert calls and sum(calls) <= 16 - 6


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_speculative_request_holding_plain_rounds_runs_them_in_one_call(engine, monkeypatch, temperature):
    """Where the draft policy holds k = 0 (drafts that do not pay), a speculative request running alone makes
    its plain rounds up to the policy's next probe in one call (native_rounds.NativeSteps): the output is
    plain decoding's, greedy or sampled."""
    from tinyloop.engine.draft_policy import DraftPolicy

    def hold_plain(self, cap, pipeline_cap=None, run_cap=0):   # the policy's choice when plain rounds are faster: k = 0, counted idle
        self.idle += 1
        self._chose(0)
        return 0
    monkeypatch.setattr(DraftPolicy, "choose", hold_plain)
    prompt = engine.tokenizer.encode(PROMPT)
    plain = SamplingParams(max_tokens=30, temperature=temperature, seed=4, loops=8, ignore_eos=True)
    want, _, _ = _run(engine, prompt, plain, monkeypatch, 1)
    steps = []
    ex = engine.model.executor
    orig = type(ex).generate
    monkeypatch.setattr(ex, "generate", lambda *a, **kw: (steps.append(a[7]), orig(ex, *a, **kw))[1])
    events = run_to_completion(BatchEngine(engine, max_num_seqs=1),
                               [(prompt, plain.replace(mode="speculative"))])[0]
    assert [t for e in events for t in e.token_ids] == want
    assert steps and max(steps) > 1 and events[-1].stats["plain_rounds"] >= sum(steps)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, temperature=0, loops=8, constraint=Constraint("json_object")),
    SamplingParams(max_tokens=40, temperature=0, loops="auto", constraint=Constraint.json_schema(SCHEMA)),
    SamplingParams(max_tokens=60, temperature=0.9, seed=5, loops=4, constraint=Constraint.json_schema(SCHEMA)),
    SamplingParams(max_tokens=60, temperature=1.0, seed=2, top_k=20, top_p=0.9, loops=8,
                   constraint=Constraint("regex", "[A-Z][a-z]{2,8}( [a-z]{1,8}){2,5}\\.")),
    # cut short: a schema whose shortest answer needs more than 7 tokens (the closing rule cannot close it,
    # engine/schema_close.py; a json_object of 13 tokens now closes)
    SamplingParams(max_tokens=7, temperature=0.7, seed=9, loops=8, constraint=Constraint.json_schema(SCHEMA)),
], ids=["greedy-json", "auto-schema", "sampled-schema", "top-k-p-regex", "cut-short"])
def test_constrained_steps_a_call_give_the_per_step_output(engine, monkeypatch, params):
    """Each token picked inside the call under the grammar's bitmask is the per-step path's; an output the
    grammar completes ends with EOS at the same token (finish reason stop), one cut short by max_tokens too.
    The tokens the grammar forces (jump-forward: taken without a head row, their rows in one pass with the
    pick before them) are the per-step path's picks too: the per-step run (one step a call) forces none."""
    from tinyloop.engine.constraint import Matcher

    forced, orig = [], Matcher.forced
    monkeypatch.setattr(Matcher, "forced", lambda self, *a: [])
    prompt = engine.tokenizer.encode(PROMPT)
    want, last_want, none = _run(engine, prompt, params, monkeypatch, 1)
    monkeypatch.setattr(Matcher, "forced", lambda self, *a: (lambda f: (forced.append(len(f)), f)[1])(orig(self, *a)))
    got, last, calls = _run(engine, prompt, params, monkeypatch, 8)
    assert not none and calls and max(calls) > 1
    if params.constraint.kind == "json_schema":   # (a schema's keys and punctuation are forced)
        assert sum(forced) > 0
    assert got == want and last.finish_reason == last_want.finish_reason
    text = engine.tokenizer.decode(got)
    if last.finish_reason == "stop" and params.constraint.kind != "regex":
        json.loads(text)   # (the grammar's end: a whole value)
    if params.max_tokens == 7:
        assert last.finish_reason == "length" and len(got) == 7


def test_a_grammar_failing_inside_the_call_fails_that_request_alone(engine, monkeypatch):
    """An exception in the grammar's callback (here the matcher's accept, on the fifth token) ends the native
    call at once and fails the request with that error, as the per-step path would; the engine goes on."""
    from tinyloop.engine.constraint import Matcher

    orig = Matcher.accept
    seen = []

    def accept(self, tok):
        seen.append(tok)
        if len(seen) == 5:
            raise RuntimeError("simulated grammar failure")
        return orig(self, tok)
    monkeypatch.setattr(Matcher, "accept", accept)
    prompt = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=30, temperature=0, loops=4, constraint=Constraint.json_schema(SCHEMA))
    monkeypatch.setattr(fast_steps, "MULTI_STEPS", 8)
    events = run_to_completion(BatchEngine(engine, max_num_seqs=1), [(prompt, params)])[0]
    assert isinstance(events[-1], RuntimeError) and "simulated grammar failure" in str(events[-1])
    assert sum(len(e.token_ids) for e in events[:-1]) < 5   # (nothing of the failed call's tokens went out)
    monkeypatch.setattr(Matcher, "accept", orig)
    got, last, _ = _run(engine, prompt, params, monkeypatch, 8)
    assert last.finish_reason in ("stop", "length") and len(got) > 5


def test_a_constrained_request_joined_mid_way_keeps_its_tokens(engine, monkeypatch):
    """A constrained request runs alone (its steps in native calls, the grammar lazily filled inside them), then
    a second request joins (shared steps: the grammar's mask filled in the worker and read by the head), then it
    runs alone again: its tokens are those of one step a call throughout."""
    prompt = engine.tokenizer.encode(PROMPT)
    long = {"type": "object", "properties": {"story": {"type": "string", "minLength": 60, "maxLength": 80}},
            "required": ["story"], "additionalProperties": False}   # (longer than the first three steps make)
    a = SamplingParams(max_tokens=48, temperature=0.9, seed=7, loops=4, constraint=Constraint.json_schema(long))
    b = SamplingParams(max_tokens=6, temperature=0, loops=3, ignore_eos=True)
    want = _run(engine, prompt, a, monkeypatch, 1)[0]
    alone_b = _run(engine, prompt, b, monkeypatch, 1)[0]
    monkeypatch.setattr(fast_steps, "MULTI_STEPS", 8)
    core = BatchEngine(engine, max_num_seqs=4)
    got: dict[str, list] = {"a": [], "b": []}
    core.add(engine.plan(prompt, a), lambda ev: ev is not None and got["a"].append(ev))
    for _ in range(3):   # the prompt's step, then calls of up to 8 tokens alone
        core.step()
    assert 8 < sum(len(e.token_ids) for e in got["a"]) < len(want)
    core.add(engine.plan(prompt, b), lambda ev: ev is not None and got["b"].append(ev))
    while core.has_work:
        core.step()
    assert [t for e in got["a"] for t in e.token_ids] == want
    assert [t for e in got["b"] for t in e.token_ids] == alone_b
