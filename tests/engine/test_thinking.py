"""Thinking blocks in the engine core (engine/thinking.py): the budget forces the closing tag, a constraint holds
the answer only, and every mode honours both. Nanbeige4.2's tiny converted fixture: its template opens `<think>`
on the generation prompt, and its tokenizer has `<think>` (506) and `</think>` (507) as tokens of their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tinyloop import Engine, SamplingParams, ValidationError
from tinyloop.chat import Chat
from tinyloop.engine.constraint import Constraint
from tinyloop.engine.thinking import THINK, ThinkingMatcher, ThinkPlan, ThinkTags, model_tags

FIXTURE = Path(__file__).parents[1] / "fixtures" / "reference" / "nanbeige-tiny"
CLOSE = 507


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tinyloop.tools.convert import convert

    path = convert(FIXTURE, tmp_path_factory.mktemp("nb") / "nb.tinyloop", dtype="float32", progress=False)
    return Engine.load(path)


def prompt(engine, **kw):
    return engine.encode_prompt(Chat([{"role": "user", "content": "Hi"}], template_kwargs=kw))


def test_the_plan_says_whether_the_prompt_opened_the_block(engine):
    assert model_tags(engine.tokenizer) == THINK
    on = engine.plan(prompt(engine), SamplingParams(max_tokens=4))
    off = engine.plan(prompt(engine, enable_thinking=False), SamplingParams(max_tokens=4))
    assert on.thinking.inside and not off.thinking.inside and on.thinking.close_ids == (CLOSE,)
    assert engine.plan(prompt(engine), SamplingParams(max_tokens=4, thinking=False)).thinking is None
    with pytest.raises(ValidationError, match="max_thinking_tokens"):
        engine.plan(prompt(engine), SamplingParams(max_tokens=4, max_thinking_tokens=-1))


@pytest.mark.parametrize("budget", [0, 1, 3, 5])
def test_the_budget_forces_the_closing_tag_after_exactly_that_many_tokens(engine, budget):
    ids = prompt(engine)
    free = engine.generate(ids, SamplingParams(max_tokens=12)).token_ids
    assert CLOSE not in free[:budget + 1]   # the tiny model would not close the block itself
    got = engine.generate(ids, SamplingParams(max_tokens=12, max_thinking_tokens=budget)).token_ids
    assert got[:budget] == free[:budget] and got[budget] == CLOSE and got.count(CLOSE) == 1
    sampled = engine.generate(ids, SamplingParams(max_tokens=12, max_thinking_tokens=budget, temperature=1.0,
                                                  seed=3)).token_ids
    assert sampled[budget] == CLOSE and CLOSE not in sampled[:budget]


@pytest.mark.parametrize("mode", ["speculative", "tree_speculative"])
def test_speculative_modes_force_it_as_plain_decoding_does(engine, mode):
    ids = prompt(engine)
    want = engine.generate(ids, SamplingParams(max_tokens=12, max_thinking_tokens=3)).token_ids
    got = engine.generate(ids, SamplingParams(max_tokens=12, max_thinking_tokens=3, mode=mode, draft_ahead=3,
                                              verify_loops=2, draft_loops=1)).token_ids
    assert got == want


def test_a_constraint_holds_the_answer_only(engine):
    ids = prompt(engine)
    r = engine.generate(ids, SamplingParams(max_tokens=40, max_thinking_tokens=2,
                                            constraint=Constraint("json_object")))
    assert r.token_ids[2] == CLOSE
    answer = r.text.split("</think>", 1)[1]
    assert answer.startswith("{")
    if r.finish_reason == "stop":
        assert isinstance(json.loads(answer), dict)
    # thinking off in the prompt: the constraint starts at once
    r = engine.generate(prompt(engine, enable_thinking=False),
                        SamplingParams(max_tokens=40, constraint=Constraint("json_object")))
    assert r.text.startswith("{")


class Bytes:
    """token id -> bytes for a toy vocabulary"""
    pieces = [b"<", b"think", b">", b"</think>", b" a", b" b", b"\n", b"x</think>y"]

    def __call__(self, i: int) -> bytes:
        return self.pieces[i]


def matcher(inside: bool, budget: int | None) -> ThinkingMatcher:
    return ThinkingMatcher(ThinkPlan(ThinkTags(), (3,), budget, inside), None, Bytes(), len(Bytes.pieces), 6)


def test_a_block_the_output_opens_itself_counts_from_after_its_tag():
    m = matcher(inside=False, budget=2)
    for t in (6, 0, 1, 2):          # "\n<think>" over three tokens: not counted
        assert m.free
        m.accept(t)
    assert m.phase == "think" and m.count == 0
    m.accept(4), m.accept(5)
    assert m.phase == "force" and m.allows(3) and not m.allows(4) and m.allowed_ids().tolist() == [3]
    m.accept(3)
    assert m.phase == "answer" and m.free
    m.rollback(3)                   # speculation's rejected drafts
    assert m.phase == "think" and m.count == 0


def test_the_models_own_closing_tag_ends_the_block_and_answers_do_not_open_one():
    m = matcher(inside=True, budget=None)
    m.accept(4), m.accept(7)        # a token holding "</think>" inside its text
    assert m.phase == "answer"
    m = matcher(inside=False, budget=5)
    m.accept(4)                     # the answer's first text is not "<think>": no block
    assert m.phase == "answer" and m.free
