"""Constrained decoding in the engine core (engine/constraint.py): outputs parse and validate, EOS only where
the grammar may end, compiled once per content, masked logprobs, and the speculative modes and adaptive
depth equal plain greedy under the same constraint (float64 tiny model: exact arithmetic)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.constraint import Constraint
from tinyloop.engine.serving import BatchEngine, run_to_completion
from tinyloop.errors import ValidationError

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1},
                                      "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                "required": ["ok"], "additionalProperties": False}},
     "required": ["tags", "score", "inner"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return Engine.load(tiny_model_path, dtype=torch.float64)


def run(engine, params, prompt="The king said", n=1):
    events = run_to_completion(BatchEngine(engine, max_num_seqs=8), [(engine.encode_prompt(prompt), params)], n=n)[0]
    out: dict[int, list] = {}
    for e in events:
        out.setdefault(e.index, []).append(e)
    return [("".join(e.text for e in evs), evs[-1].finish_reason, [t for e in evs for t in e.token_ids],
             [lp for e in evs for lp in (e.logprobs or [])]) for _, evs in sorted(out.items())]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_sampled_outputs_validate_unless_cut_short(engine, schema):
    c = Constraint.json_schema(schema)
    done = 0
    for seed in range(6):
        text, reason, _, _ = run(engine, SamplingParams(max_tokens=64, temperature=0.8, seed=seed, constraint=c))[0]
        if reason == "length":
            continue
        assert reason == "stop"
        jsonschema.validate(json.loads(text), schema)
        done += 1
    assert done >= 3


def test_speculative_tree_and_auto_equal_plain_greedy(engine):
    c = Constraint.json_schema(SCHEMAS[0])
    base = dict(max_tokens=40, temperature=0, constraint=c)
    plain = run(engine, SamplingParams(loops=3, **base))[0][2]
    for mode, extra in (("speculative", {}), ("tree_speculative", {"k_branches": 2})):
        got = run(engine, SamplingParams(mode=mode, draft_loops=1, verify_loops=3, draft_ahead=3, **extra, **base))[0][2]
        assert got == plain, mode
    auto = run(engine, SamplingParams(loops="auto", max_loops=3, exit_threshold=1e-9, **base))[0][2]
    assert auto == plain   # a threshold nothing meets: every token runs the ceiling, as plain does


def test_eos_only_where_the_grammar_may_end_and_length_makes_no_claim(engine):
    c = Constraint("regex", "(ab){2,3}")
    text, reason, toks, _ = run(engine, SamplingParams(max_tokens=20, temperature=0, constraint=c))[0]
    assert text in ("abab", "ababab") and reason == "stop"
    m = engine.grammars.matcher(c)
    eos = engine.tokenizer.eos_id
    assert not m.allows(eos)
    for t in engine.tokenizer.encode("abab"):
        m.accept(t)
    assert m.allows(eos) and m.accepting
    text, reason, _, _ = run(engine, SamplingParams(max_tokens=3, temperature=0,
                                                     constraint=Constraint.json_schema(SCHEMAS[1])))[0]
    assert reason == "length" and text.startswith("{")


def test_compiled_once_per_content_and_bad_constraints_name_the_field(engine):
    before = engine.grammars.compiles
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    for _ in range(3):
        engine.plan(engine.encode_prompt("x"), SamplingParams(constraint=Constraint.json_schema(schema)))
    assert engine.grammars.compiles == before + 1
    refused = {"type": "object", "properties": {"a": {"type": "object", "$dynamicRef": "#node"}}}
    with pytest.raises(ValidationError, match=r"\$dynamicRef.*at #/properties/a\)") as err:
        engine.plan([1], SamplingParams(constraint=Constraint.json_schema(refused)))
    assert err.value.param == "response_format" and err.value.code == "unsupported_schema"
    with pytest.raises(ValidationError) as err:
        engine.plan([1], SamplingParams(constraint=Constraint("regex", "[0-9", param="regex")))
    assert err.value.param == "regex"


def test_logprobs_are_the_masked_distributions(engine):
    c = Constraint("regex", "(yes|no)")
    (text, _, toks, lps), = run(engine, SamplingParams(max_tokens=4, temperature=0, logprobs=3, constraint=c))
    assert text in ("yes", "no")
    for lp, alts in lps:
        assert lp > -1e9 and all(a > -1e9 or a == float("-inf") for _, a in alts)
        total = sum(torch.tensor([a for _, a in alts]).exp().tolist())
        assert total <= 1 + 1e-9
    # the first token's distribution covers only the allowed first tokens: their probabilities sum to 1
    first_alts = lps[0][1]
    allowed = {t for t, a in first_alts if a > float("-inf")}
    assert all(engine.tokenizer.decode([t]) in ("y", "ye", "yes", "n", "no") for t in allowed)


def test_n_choices_keep_their_own_grammar_state(engine):
    c = Constraint.json_schema(SCHEMAS[0])
    outs = run(engine, SamplingParams(max_tokens=64, temperature=0.9, seed=5, constraint=c), n=3)
    for text, reason, _, _ in outs:
        if reason == "stop":
            jsonschema.validate(json.loads(text), SCHEMAS[0])


def test_sampled_speculative_outputs_validate(engine):
    """Drafts follow the grammar (and are rolled back before verification): sampled chain speculation's
    outputs still validate."""
    schema = SCHEMAS[0]
    c = Constraint.json_schema(schema)
    done = 0
    for seed in range(5):
        text, reason, _, _ = run(engine, SamplingParams(max_tokens=64, temperature=0.8, seed=seed, constraint=c,
                                                        mode="speculative", draft_loops=1, verify_loops=3))[0]
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)
            done += 1
    assert done >= 2


def test_the_sampler_skips_the_mask_only_where_it_changes_nothing(engine):
    """Greedy under a constraint reads one bit when the raw argmax is allowed, else masks; sampling draws over
    the allowed tokens only, whether few or most are allowed. Both pick exactly what the fully masked row
    gives."""
    from tinyloop.engine.sampling import Sampler, draw_row

    c = Constraint.json_schema(SCHEMAS[0])
    V = engine.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    greedy = Sampler(SamplingParams(temperature=0), [], V, engine.grammars.matcher(c))
    sampled = Sampler(SamplingParams(temperature=0.8, seed=3), [], V, engine.grammars.matcher(c))
    applied = []
    for s in (greedy, sampled):
        s.matcher.apply = (lambda f: lambda row: applied.append(1) or f(row))(s.matcher.apply)
    subset = 0
    for step in range(30):
        logits = torch.randn(V, generator=gen, dtype=torch.float64) * 4
        m = greedy.matcher
        masked = logits.masked_fill(~m.mask(), float("-inf"))
        assert greedy.sample(logits) == int(torch.argmax(masked))
        logits[int(m.allowed_ids()[-1])] = 100.0          # the raw argmax is now allowed: no mask applied
        n = len(applied)
        assert greedy.sample(logits) == int(m.allowed_ids()[-1]) and len(applied) == n
        greedy.accept(greedy.sample(logits))
        s = sampled.matcher
        small = 4 * s.allowed_ids().numel() <= V
        # the draw over the fully masked row, under the same noise
        want = draw_row(logits.masked_fill(~s.mask(), float("-inf")), sampled.key(), 1 / 0.8)
        n = len(applied)
        tok = sampled.sample(logits)
        assert tok == want and s.allows(tok) and len(applied) == n   # never the full row
        subset += small
        sampled.accept(tok)
        if m.accepting and s.accepting:
            break
    assert 0 < subset < step + 1 and applied   # few and most tokens allowed both came up; greedy masked


@pytest.mark.parametrize("native", [False, True])
def test_forced_tokens_in_the_shared_step_give_the_per_step_outputs(engine, tiny_model_path, monkeypatch, native):
    """Jump-forward in the shared step: the tokens a schema forces after a pick (its keys, quotes, braces) are
    outputs at once and their rows go in with the next decode chunk (several rows, the logits of the last);
    every output, greedy and sampled, batched together, equals the one made a token a step (forcing off),
    on the PyTorch path (this float64 engine) and the native one. Decode chunks of several rows must occur."""
    from tinyloop.engine.constraint import Matcher
    from tinyloop.engine.scheduler import Scheduler

    eng = Engine.load(tiny_model_path) if native else engine
    if native and eng.model.executor is None:
        pytest.skip("no native executor on this host")
    reqs = [(eng.encode_prompt(p), SamplingParams(max_tokens=40, temperature=0.9 if i % 2 else 0, seed=i,
                                                  constraint=Constraint.json_schema(SCHEMAS[i % 2])))
            for i, p in enumerate(["The king said", "A list:", "Here is the record:", "Once upon a time"])]
    chunks = []
    orig_schedule = Scheduler.schedule

    def schedule(self):
        out = orig_schedule(self)
        chunks.extend((c.n, c.start >= len(c.seq.prompt)) for c in out.chunks)
        return out
    monkeypatch.setattr(Scheduler, "schedule", schedule)

    def outputs():
        res = run_to_completion(BatchEngine(eng, max_num_seqs=8), reqs)
        return [([t for e in evs for t in e.token_ids], evs[-1].finish_reason) for evs in res]
    got = outputs()
    assert any(n > 1 and decoding for n, decoding in chunks)
    monkeypatch.setattr(Matcher, "forced", lambda self, *a: [])
    chunks.clear()
    want = outputs()
    assert not any(n > 1 and decoding for n, decoding in chunks)
    assert got == want
