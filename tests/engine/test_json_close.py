"""JSON that closes within its budget (issue 57, item 3; engine/schema_close.py): on the shipped model, constrained
JSON answers close (parse, finish_reason stop) where their budget allows one, and only there; whitespace runs inside
strings are bounded; the rule only ever narrows the grammar's mask; its masks are a function of the tokens written
(the same after a rollback, in speculation's drafts, in the lone steps' call and the shared step)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from tinyloop.chat import Chat
from tinyloop.engine import Engine, SamplingParams, schema_close
from tinyloop.engine.constraint import Constraint
from tinyloop.engine.serving import BatchEngine, run_to_completion

PROMPTS = ["Give me a JSON object describing a cat.", "Who are you?", "List three fruits as JSON.",
           "A person with a name and an age."]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def shipped(shipped_model_path):
    return Engine.load(shipped_model_path)


def _answers(engine, constraint, max_tokens, prompts=PROMPTS, sampled=True):
    reqs = []
    for p in prompts:
        ids = engine.encode_prompt(Chat(({"role": "user", "content": p},)))
        reqs.append((ids, SamplingParams(max_tokens=max_tokens, temperature=0, constraint=constraint)))
        if sampled:
            reqs.append((ids, SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=len(reqs),
                                             constraint=constraint)))
    events = run_to_completion(BatchEngine(engine, max_num_seqs=len(reqs)), reqs)
    return [("".join(e.text for e in evs), evs[-1].finish_reason, sum(len(e.token_ids) for e in evs))
            for evs in events]


@pytest.mark.parametrize("max_tokens", [12, 48])
def test_json_object_answers_close_within_a_small_budget(shipped, max_tokens):
    """The issue's failure: under json_object the shipped model writes one string until max_tokens (before this
    rule, 0 of these 8 answers at 12 or at 48 tokens ended by themselves: each ran into `length` mid-string). Now every
    answer is a JSON object that ends by itself within the budget. (12 tokens: an object's shortest answer `{}`
    is 1 token, so even the smallest budget here leaves room: the margins scale down with it.)"""
    for text, reason, n in _answers(shipped, Constraint("json_object"), max_tokens):
        assert reason == "stop", (text, reason)
        assert isinstance(json.loads(text), dict) and n <= max_tokens


def test_json_schema_answers_close_and_validate(shipped):
    """The issue's json_schema case (an unterminated string at 60 tokens): the answers close, validate."""
    for text, reason, _ in _answers(shipped, Constraint.json_schema(PERSON), 40):
        assert reason == "stop", (text, reason)
        jsonschema.validate(json.loads(text), PERSON)


def test_an_answer_that_cannot_close_in_its_budget_says_length(shipped):
    """A schema whose shortest answer needs more tokens than max_tokens allows: nothing is restricted (no
    closing path fits), the answer is cut, and says so."""
    long = {"type": "object", "properties": {f"field_number_{i}": {"type": "string"} for i in range(8)},
            "required": [f"field_number_{i}" for i in range(8)], "additionalProperties": False}
    rule = shipped.grammars._entry(Constraint.json_schema(long))[2]
    assert rule.u0 is not None and rule.u0 + 1 > 20   # (its shortest answer: more than 20 tokens)
    for text, reason, n in _answers(shipped, Constraint.json_schema(long), 20, prompts=PROMPTS[:2]):
        assert reason == "length" and n == 20
        with pytest.raises(ValueError):
            json.loads(text)


def test_whitespace_runs_inside_strings_are_bounded(shipped):
    """Inside a string, a run of whitespace ends at WHITESPACE_RUN characters (the issue's answer: a string of
    spaces until `length`), for json_object and for a schema's free string, whatever the tokens that make it up
    (spaces, escaped newlines); the schema's own maxLength still holds; the budget is far."""
    tok = shipped.tokenizer
    run = schema_close.WHITESPACE_RUN
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 60}}, "required": ["a"]}
    space, backslash, n, y = (tok.encode(x)[0] for x in (" ", "\\", "n", "y"))
    for c in (Constraint("json_object"), Constraint.json_schema(schema)):
        m = shipped.grammars.matcher(c, 1000)
        for t in tok.encode('{"a": "x'):
            m.accept(t)
        for t in [backslash, n] * 4 + [space] * (run - 4):   # 4 escaped newlines and 28 spaces: 32 characters
            assert m.allows(t)
            m.accept(t)
        assert not m.allows(space) and m.allows(y)           # a 33rd is refused, anything else goes on
        m.accept(y)
        assert m.allows(space)                               # and then a run may begin again
    bounded = shipped.grammars.matcher(Constraint.json_schema(schema), 1000)
    for t in tok.encode('{"a": "' + "y" * 60):
        bounded.accept(t)
    assert not bounded.allows(tok.encode("y")[0]) and bounded.allows(tok.encode('"}')[0])   # maxLength


@pytest.mark.parametrize("pattern,matches", [
    (r"^\d{4}-\d{2}-\d{2}$", "0000-00-00"), (r"data:image/png;base64,", "data:image/png;base64,"),
    (r"^[A-Z][a-z]+(foo|ba)\d?$", "Aaba"), (r"^[^<>]*$", ""), (r"(\w)\1", None)])
def test_shortest_match(pattern, matches):
    got = schema_close.shortest_match(pattern)
    assert got == matches
    if got is not None:
        import re
        assert re.search(pattern, got)


def _feed(engine, constraint, budget, tokens):
    """The masks (as bits) at each position of `tokens` under a fresh matcher with `budget`."""
    m = engine.grammars.matcher(constraint, budget)
    masks = []
    for t in tokens:
        masks.append(np.array(m._current(), copy=True))
        m.accept(t)
    return m, masks


def test_the_rule_only_narrows_and_its_masks_depend_on_the_tokens_alone(shipped):
    """At every position of a real answer: the mask under the rule is a subset of the grammar's (never empty: the
    closing path's first token, or EOS, stays), the zones come up; and the masks are the same after a rollback and
    re-acceptance (speculation's drafts) as on the first pass, whatever was walked in between."""
    c = Constraint.json_schema(PERSON)
    text, reason, _ = _answers(shipped, c, 40, prompts=PROMPTS[1:2], sampled=False)[0]
    toks = shipped.tokenizer.encode(text)
    m, ruled = _feed(shipped, c, 40, toks)
    _, plain = _feed(shipped, c, None, toks)
    zones = []
    again = shipped.grammars.matcher(c, 40)
    for i, t in enumerate(toks):
        assert not np.any(ruled[i] & ~plain[i]) and ruled[i].any()
        assert np.array_equal(np.array(again._current()), ruled[i])
        zones.append(again.zone)
        other = next(x for x in toks if x != t)   # a draft walked and rolled back
        if again.allows(other):
            again.accept(other)
            again._current()
            again.rollback(1)
        again.accept(t)
    assert {"closing", "forced"} <= set(zones), (text, zones)


@pytest.mark.parametrize("budget", [40, 96])
def test_masks_are_the_same_whichever_positions_were_filled(shipped, budget):
    """A position's mask does not depend on which earlier positions had theirs computed (jump-forward and the lone
    steps' call skip the forced tokens' fills; a checkpoint's path is then walked from there when needed): masks
    read at every third position equal those read at every position."""
    c = Constraint.json_schema(PERSON)
    text, _, _ = _answers(shipped, c, budget, prompts=PROMPTS[1:2], sampled=False)[0]
    toks = shipped.tokenizer.encode(text)
    _, every = _feed(shipped, c, budget, toks)
    some = shipped.grammars.matcher(c, budget)
    zones = set()
    with some.lazily():
        for i, t in enumerate(toks):
            if i % 3 == 2:
                assert np.array_equal(np.array(some._current()), every[i]), i
                zones.add(some.zone)
            some.accept(t)
    assert zones - {"free"}, zones   # (the rule acted at some of them)


def test_speculative_and_plain_greedy_agree_under_the_rule(shipped):
    """Greedy speculation under a closing constraint gives plain greedy's tokens (the drafts' masks walk the rule
    forward and roll it back), and the rule acted (the answer closed well before 48 tokens' worth of string)."""
    c = Constraint("json_object")
    ids = shipped.encode_prompt(Chat(({"role": "user", "content": PROMPTS[1]},)))
    base = dict(max_tokens=32, temperature=0, constraint=c)
    plain = run_to_completion(BatchEngine(shipped, max_num_seqs=2), [(ids, SamplingParams(**base))])[0]
    spec = run_to_completion(BatchEngine(shipped, max_num_seqs=2),
                             [(ids, SamplingParams(mode="speculative", draft_ahead=3, **base))])[0]
    toks = [t for e in plain for t in e.token_ids]
    assert [t for e in spec for t in e.token_ids] == toks
    assert plain[-1].finish_reason == "stop" and json.loads("".join(e.text for e in plain)) is not None


def test_tool_call_arguments_close(shipped):
    """Tool calls in the generic format (the shipped model's): the call's arguments close within a small budget."""
    from tinyloop.server.structured import Tool, ToolPlan

    tools = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}})]
    plan = ToolPlan.of(tools, "required", None, None)
    c = plan.constraint(shipped.tokenizer)
    for text, reason, _ in _answers(shipped, c, 40, prompts=["Weather in Paris?", "Who are you?"]):
        assert reason == "stop", (text, reason)
        content, calls = plan.parse(text)
        assert calls and json.loads(calls[0]["function"]["arguments"])["city"] is not None


def test_a_thinking_block_counts_in_the_answers_budget(shipped):
    """The closing rule's budget is the whole output's: the tokens of a thinking block before the answer (`outside`,
    set by the engine) leave fewer to it, so the same answer prefix is nearer its end."""
    c = Constraint("json_object")
    toks = shipped.tokenizer.encode('{"a": "some text here')
    alone, _ = _feed(shipped, c, 24, toks)
    after = shipped.grammars.matcher(c, 24)
    after.outside = lambda: 12   # (a 12-token block before the answer)
    for t in toks:
        after.accept(t)
    alone._current(), after._current()
    assert alone._used == len(toks) and after._used == len(toks) + 12
    assert alone.zone == "free" and after.zone in ("closing", "forced")
