"""Schema coverage (docs/structured.md, "Schema coverage"): every schema of the corpus (tests/fixtures/
schema_corpus.json: schemas that use the keywords llguidance does not implement, written after common
real-world ones: CI workflow steps, package manifests, OpenAPI fragments, API payloads; `loose` names the
keywords left to the check after generation) compiles; its known-valid answers pass the grammar and its known-invalid ones are refused by
the grammar, or, for the parts left loose, by the check after generation; answers generated on the shipped
model validate against the original schema, or their check says they do not."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.constraint import CIRCULAR, JSON_OPTIONS, JSON_OVERRIDES, Constraint, Grammars
from tinyloop.engine.schema_rewrite import negate, prepare
from tinyloop.engine.serving import BatchEngine, run_to_completion
from tinyloop.errors import ValidationError
from tinyloop.tokenizer import Tokenizer

CORPUS = json.loads((Path(__file__).parents[1] / "fixtures" / "schema_corpus.json").read_text())

IDS = [c["name"] for c in CORPUS]


@pytest.fixture(scope="module")
def grammars():
    tok = Tokenizer.gpt2()
    return Grammars(tok, tok.vocab_size)


def written(doc) -> str:
    return json.dumps(doc)   # ", " and ": ": as the grammar writes JSON


def grammar_accepts(grammars, constraint, doc) -> bool:
    m = grammars.compiled(constraint).deep_copy()
    ids = grammars.tokenizer.encode(written(doc))
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


@pytest.mark.parametrize("case", CORPUS, ids=IDS)
def test_the_corpus_says_what_it_means(case):
    for doc in case["valid"]:
        jsonschema.validate(doc, case["schema"])
    for doc in case["invalid"]:
        assert not jsonschema.Draft202012Validator(case["schema"]).is_valid(doc) or "$schema" in case["schema"], doc
        cls = jsonschema.validators.validator_for(case["schema"], default=jsonschema.Draft202012Validator)
        assert not cls(case["schema"]).is_valid(doc), doc


@pytest.mark.parametrize("case", CORPUS, ids=IDS)
def test_accepted_and_loose_only_where_it_must_be(grammars, case):
    c = Constraint.json_schema(case["schema"])
    warnings = grammars.check(c)
    check = grammars.schema_check(c)
    loose = sorted({w.split(" at ")[0] for w in (check.loose if check else ())})
    assert loose == sorted(case["loose"])
    for word in case.get("warns", []):
        assert any(word in w for w in warnings), warnings
    assert len(warnings) >= len(loose) + len(case.get("warns", []))


@pytest.mark.parametrize("case", CORPUS, ids=IDS)
def test_grammar_takes_the_valid_and_refuses_the_invalid(grammars, case):
    c = Constraint.json_schema(case["schema"])
    check = grammars.schema_check(c)
    for doc in case["valid"]:
        assert grammar_accepts(grammars, c, doc), doc
        assert check is None or check.validate(written(doc)) is None
    caught_after = 0
    for doc in case["invalid"]:
        if grammar_accepts(grammars, c, doc):
            assert check is not None, f"the grammar let {doc} through and nothing checks it"
            assert check.validate(written(doc)) is not None
            caught_after += 1
    assert caught_after == 0 or case["loose"]


def test_negate_is_exact_on_the_forms_it_takes():
    """Each negation against jsonschema on a spread of values: exactly one of s and negate(s) holds."""
    values = [None, True, False, 0, 1, 2.5, -3, "", "a", "ab", "abc", "main", [], [1], {}, {"a": 1}, {"a": "x"},
              {"b": 2}, {"a": 1, "b": 2}]
    forms = [{"type": "string"}, {"type": ["null", "number"]}, {"required": ["a"]}, {"required": ["a", "b"]},
             {"const": "ab"}, {"enum": ["a", "main", 1, True, None]}, {"const": 1},
             {"properties": {"a": {"const": 1}}}, {"properties": {"a": {"type": "string"}}, "required": ["a"]},
             {"anyOf": [{"type": "array"}, {"const": "a"}]}, {"allOf": [{"type": "object"}, {"required": ["b"]}]},
             {"not": {"type": "boolean"}}, {"const": ""}]
    for s in forms:
        n = negate(s)
        assert n is not None, s
        for v in values:
            assert jsonschema.Draft202012Validator(s).is_valid(v) != jsonschema.Draft202012Validator(n).is_valid(v), \
                (s, n, v)
    assert negate({"multipleOf": 3}) is None and negate({"type": "integer"}) is None


def test_rewrites_leave_the_schema_alone_where_llguidance_has_it():
    plain = {"type": "object", "properties": {"a": {"type": "string", "format": "date-time"}}, "required": ["a"]}
    assert prepare(plain).schema == plain and not prepare(plain).warnings
    record = {"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {"type": "integer"},
              "uniqueItems": False}   # what a record of strings writes: nothing to hold, nothing loose
    assert prepare(record) == prepare({"type": "object", "additionalProperties": {"type": "integer"}})


@pytest.fixture(scope="module")
def shipped(shipped_model_path):
    return Engine.load(shipped_model_path)


def test_generated_answers_validate_or_say_they_do_not(shipped):
    """Every schema of the corpus, sampled on the shipped model (two seeds each, one batch): an answer that
    ends by itself validates against the original schema (where the grammar is exact), or its check says
    whether it does (where something was left loose), and says so truly."""
    reqs = []
    for case in CORPUS:
        c = Constraint.json_schema(case["schema"])
        for seed in range(2):
            reqs.append((case, (shipped.encode_prompt("JSON:"), SamplingParams(
                max_tokens=96, temperature=0.8, seed=seed, constraint=c))))
    events = run_to_completion(BatchEngine(shipped, max_num_seqs=len(reqs)), [r for _, r in reqs])
    stopped = 0
    for (case, _), evs in zip(reqs, events):
        text, last = "".join(e.text for e in evs), evs[-1]
        if last.finish_reason != "stop":
            continue
        stopped += 1
        valid = jsonschema.validators.validator_for(case["schema"], default=jsonschema.Draft202012Validator)(
            case["schema"]).is_valid(json.loads(text))
        if case["loose"]:
            assert last.stats["schema_check"] == "passed" if valid else last.stats["schema_check"].startswith("failed")
        else:
            assert valid, (case["name"], text)
            assert "schema_check" not in last.stats
    print(f"{stopped} of {len(reqs)} answers ended by themselves")
    # enough answers checked for the test to mean something: about half end within 96 tokens (23 of 48 with
    # session 20's kernels, at least 24 before: sampled text moves with the last bits of attention's sums); a
    # quarter is more than three binomial standard deviations (3.5 at p = 0.5) below half
    assert stopped >= len(reqs) // 4


def test_many_dependencies_compile_quickly_the_rest_checked(grammars):
    """llguidance multiplies out the alternatives rewrites add: past BRANCH_BUDGET the rest are loose (named
    in a warning, checked after), so twelve dependencies still compile (they were "schema too large")."""
    props = {f"p{i}": {"type": "string"} for i in range(12)}
    schema = {"type": "object", "properties": props, "dependentRequired": {f"p{i}": [f"p{(i + 1) % 12}"] for i in range(12)}}
    c = Constraint.json_schema(schema)
    warnings = grammars.check(c)
    assert grammars.schema_check(c).loose == ("dependentRequired at #",)
    assert any("more alternatives" in w for w in warnings)
    assert grammar_accepts(grammars, c, {"p0": "a", "p1": "b", "p2": "c", "p3": "d", "p4": "e", "p5": "f"})
    assert not grammar_accepts(grammars, c, {"p0": "a"})   # the first dependencies are held by the grammar
    past = {f"p{i}": "v" for i in range(7)}                # p6 without p7: past the budget, the check's
    assert grammar_accepts(grammars, c, past)
    assert "p7" in grammars.schema_check(c).validate(written(past))


def test_a_one_of_too_large_to_write_out_goes_back_to_llguidance():
    """Four object branches, each turned round into several alternatives, multiply past the budget: the oneOf
    is left as it was (llguidance's: coerced to anyOf and checked), not dropped."""
    branches = [{"type": "object", "properties": {f"k{i}": {"const": i}, "x": {"enum": ["a", "b", "c"]}},
                 "required": [f"k{i}", "x"]} for i in range(4)]
    prepared = prepare({"oneOf": branches})
    assert prepared.schema == {"oneOf": branches} and not prepared.loose
    assert prepare({"oneOf": branches[:2]}).schema != {"oneOf": branches[:2]}   # two fit: written out


def test_conditions_on_listed_values_filter_the_list():
    """`not` and `if` that negate cannot turn round, on a node that lists its values: the list filtered."""
    assert prepare({"enum": ["a1", "b2", "c3"], "not": {"pattern": "^b"}}).schema == {"enum": ["a1", "c3"]}
    got = prepare({"type": "integer", "enum": [1, 2, 3, 4], "if": {"minimum": 3}, "then": {"multipleOf": 2}})
    assert got.schema == {"type": "integer", "enum": [1, 2, 4]} and not got.loose
    assert prepare({"type": "string", "not": {"format": "email"}}).loose == ("not at #",)   # not made false


def test_an_unknown_meta_schema_is_read_as_json_schema(grammars):
    """A registry's own `$schema` (Snowplow's Iglu): llguidance would try to fetch it and refuse; read as
    JSON Schema, with a warning, and the known drafts left alone."""
    iglu = "http://iglucentral.com/schemas/com.snowplowanalytics.self-desc/schema/jsonschema/1-0-0#"
    schema = {"$schema": iglu, "self": {"vendor": "com.acme", "name": "click", "format": "jsonschema",
                                        "version": "1-0-0"},
              "type": "object", "properties": {"target": {"type": "string", "maxLength": 8}}, "required": ["target"],
              "additionalProperties": False}
    c = Constraint.json_schema(schema)
    assert any("iglucentral" in w for w in grammars.check(c))
    assert grammar_accepts(grammars, c, {"target": "button"}) and not grammar_accepts(grammars, c, {})
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "string"}
    assert prepare(draft7).schema == draft7 and not prepare(draft7).warnings


@pytest.mark.parametrize("pattern,good,bad", [
    ("^(?![iI][oO][bB]roker)", "netatmo", "ioBroker-x"),   # look-ahead (JSONSchemaBench's io-package)
    (r"^(\w)\1$", "aa", "ab"),                             # a backreference
])
def test_a_pattern_the_grammar_cannot_compile_is_checked_after(grammars, pattern, good, bad):
    """llguidance's regexes have no look-around and no backreferences: such a `pattern` is left out of the
    grammar (the string is free), named in a warning, and the complete answer checked with Python's `re`
    (jsonschema's), which has both: the answer the pattern refuses is flagged, the one it takes passes."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": pattern, "maxLength": 12}},
              "required": ["name"], "additionalProperties": False}
    prepared = prepare(schema)
    assert prepared.loose == ("pattern at #/properties/name",)
    assert "pattern" not in prepared.schema["properties"]["name"]
    assert prepared.schema["properties"]["name"]["maxLength"] == 12   # the rest of the node still held
    c = Constraint.json_schema(schema)
    assert any("look-around" in w or "backreference" in w for w in grammars.check(c))
    check = grammars.schema_check(c)
    for doc, ok in (({"name": good}, True), ({"name": bad}, False)):
        assert grammar_accepts(grammars, c, doc)
        assert jsonschema.Draft202012Validator(schema).is_valid(doc) == ok
        assert (check.validate(written(doc)) is None) == ok
    assert not grammar_accepts(grammars, c, {"name": "x" * 13})
    plain = {"type": "string", "pattern": "^[a-z]+$"}
    assert prepare(plain).schema == plain and not prepare(plain).loose


VALUES = [None, True, 0, 1.5, "", "a", [], [1], ["x"], {}, {"a": 1}, {"a": "x"}, {"b": {}}, {"b": {"b": {}}},
          {"b": {"a": 1}}, {"b": None}, {"a": "x", "b": {"a": "y"}}, {"c": 1}, {"redirect": [1]}, {"redirect": ["x"]},
          {"redirect": {}}, {"items": [{}, {"a": "x"}]}, {"items": [1]}]


def llguidance_refusal(schema) -> str:
    """What llguidance says of compiling `schema` as it is ("" where it compiles)."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS, overrides=JSON_OVERRIDES)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return " ".join(messages) if is_error else ""


def same_answers(original, rewritten, values=VALUES) -> None:
    for v in values:
        assert original_validator(original).is_valid(v) == original_validator(rewritten).is_valid(v), (v, rewritten)


@pytest.mark.parametrize("name,schema", [
    # a type beside anyOf whose branches all have it (a local $ref's target read): the type says nothing new
    ("redundant type", {"type": "object", "properties": {"a": {"type": "string"}, "b": {
        "anyOf": [{"$ref": "#"}, {"type": "null"}], "type": ["object", "null"]}}}),
    ("redundant type beside $ref", {"type": "object", "properties": {"a": {"type": "string"},
                                                                     "b": {"type": "object", "$ref": "#"}}}),
    # keywords whose values say nothing, dropped
    ("says nothing", {"type": "object", "additionalProperties": {}, "required": [],
                      "anyOf": [{"$ref": "#/$defs/n"}, {"type": "object", "properties": {"c": {"type": "integer"}}}],
                      "$defs": {"n": {"type": "object", "properties": {"b": {"$ref": "#"}, "a": {"type": "string"}}}}}),
    # a declared property whose schema is the one of the pattern its name matches: the declaration dropped
    ("same pattern", {"type": "object", "properties": {"b": {"items": {"$ref": "#"}, "type": "array"}},
                      "patternProperties": {"^[a-z]+$": {"items": {"$ref": "#"}, "type": "array",
                                                         "description": "the same"}},
                      "additionalProperties": False}),
])
def test_a_recursive_schema_llguidance_would_intersect_is_rewritten_exactly(grammars, name, schema):
    """llguidance compiles each `$ref` once and cannot intersect one it is still compiling with other keywords
    ("circular references with sibling keys": 23 of JSONSchemaBench's 125 WashingtonPost schemas). On that
    refusal the schema is prepared once more with those intersections rewritten away
    (`prepare(..., recursive_refs=True)`); each rewrite here is exact: the same answers as the original."""
    first = prepare(schema)
    assert CIRCULAR in llguidance_refusal(first.schema)   # the first try is refused: the second takes it
    assert llguidance_refusal(prepare(schema, recursive_refs=True).schema) == ""
    second = prepare(schema, recursive_refs=True)
    assert not second.loose and second.schema != first.schema
    same_answers(schema, second.schema)
    c = Constraint.json_schema(schema)
    grammars.check(c)
    assert grammars.schema_check(c) is None   # held exactly: nothing checked after
    for v in VALUES:
        if isinstance(v, dict):
            assert grammar_accepts(grammars, c, v) == original_validator(schema).is_valid(v), v


def test_a_property_two_schemas_hold_in_a_recursive_schema_is_checked_after(grammars):
    """A declared property whose name a pattern matches with another schema (WashingtonPost's `redirect`
    under `.*`): the grammar holds it to the pattern's schema, the declared one is checked after."""
    schema = {"type": "object", "properties": {"redirect": {"type": "array", "items": {"type": "string"},
                                                             "maxItems": 1}},
              "patternProperties": {".*": {"type": "array", "items": {"anyOf": [{"$ref": "#"}, {"type": "string"}],
                                                                        "type": ["object", "string"]}}}}
    second = prepare(schema, recursive_refs=True)
    assert second.loose == ("properties at #/properties/redirect",)
    for v in VALUES:   # looser than the original, never stricter
        assert original_validator(second.schema).is_valid(v) or not original_validator(schema).is_valid(v), v
    c = Constraint.json_schema(schema)
    assert any("properties at #/properties/redirect" in w for w in grammars.check(c))
    check = grammars.schema_check(c)
    assert grammar_accepts(grammars, c, {"redirect": [{}, "x"]})
    assert check.validate(written({"redirect": [{}, "x"]})) is not None   # two items, one an object: flagged
    assert check.validate(written({"redirect": ["x"]})) is None


def test_a_recursive_ref_llguidance_must_intersect_is_a_400_naming_it(grammars):
    """Where the intersection is real (a keyword beside a recursive `$ref` that its target does not imply):
    refused, naming `$ref`, its target and where it is referred to."""
    schema = {"type": "object", "properties": {"child": {"$ref": "#", "minProperties": 1}}}
    with pytest.raises(ValidationError) as exc:
        grammars.check(Constraint.json_schema(schema))
    assert exc.value.code == "unsupported_schema"
    assert "recursive $ref (#, referred to at #/properties/child)" in str(exc.value)


def test_a_ref_that_resolves_nowhere_is_a_400_naming_it(grammars):
    schema = {"type": "object", "properties": {"b": {"$ref": "#/$defs/x"}},
              "$defs": {"x": {"$id": "other.json", "properties": {"c": {"$ref": "#/$defs/y"}}}}}
    with pytest.raises(ValidationError) as exc:
        grammars.check(Constraint.json_schema(schema))
    assert exc.value.code == "unsupported_schema" and str(exc.value).startswith("response_format: $ref: ")


BENCH = json.loads((Path(__file__).parents[1] / "fixtures" / "jsonschemabench_sample.json").read_text())["schemas"]
NAMES_A_KEYWORD = ("$ref", "$dynamicRef", "$recursiveRef", "Unimplemented keys: [")


def original_validator(schema):
    """jsonschema's validator for the schema as sent, in its own draft (2020-12 where it names none)."""
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)


def test_jsonschemabench_sample_is_taken_or_refused_by_name(grammars):
    """JSONSchemaBench's sample (tests/fixtures/jsonschemabench_sample.json, 200 schemas, 20 of each subset):
    at least 95% compile; every refusal is an `unsupported_schema` 400 that names the keyword."""
    refused = {}
    for row in BENCH:
        try:
            grammars.check(Constraint.json_schema(row["schema"]))
        except ValidationError as exc:
            assert exc.code == "unsupported_schema", (row["name"], str(exc))
            assert any(k in str(exc) for k in NAMES_A_KEYWORD), (row["name"], str(exc))
            refused[row["name"]] = str(exc)
    assert len(BENCH) - len(refused) >= 0.95 * len(BENCH), refused


def test_jsonschemabench_answers_validate_or_say_they_do_not(shipped):
    """Every fifth schema of the sample (40, every subset), one answer each on the shipped model in one
    batch: no answer that ends by itself is invalid against the schema as sent unless its check says so."""
    reqs = []
    for row in BENCH[::5]:
        try:
            c = Constraint.json_schema(row["schema"])
            shipped.plan(shipped.encode_prompt("JSON:"), SamplingParams(constraint=c))
        except ValidationError:
            continue   # (the test above: a 400 naming the keyword)
        reqs.append((row, (shipped.encode_prompt("JSON:"), SamplingParams(max_tokens=128, temperature=0.8, seed=0,
                                                                         constraint=c))))
    events = run_to_completion(BatchEngine(shipped, max_num_seqs=len(reqs)), [r for _, r in reqs])
    stopped, invalid = 0, []
    for (row, _), evs in zip(reqs, events):
        text, last = "".join(e.text for e in evs), evs[-1]
        if last.finish_reason != "stop":
            continue
        stopped += 1
        valid = original_validator(row["schema"]).is_valid(json.loads(text))
        said = last.stats.get("schema_check")
        if valid:
            assert said in (None, "passed"), (row["name"], text, said)
        elif not (said or "").startswith("failed: "):
            invalid.append((row["name"], text))
    print(f"{len(reqs)} schemas, {stopped} answers ended by themselves")
    assert not invalid
    assert len(reqs) >= 35 and stopped >= 10   # (the rest cut short by max_tokens: nothing claimed of them)


def test_schemas_a_ref_reaches_outside_the_keywords_are_rewritten_too(grammars):
    """A `$ref` into a container that is no keyword (JSONSchemaBench's `#/$file`, a folder of schemas inside
    `definitions`): the schema there is rewritten as any other (it was llguidance's "Unimplemented keys")."""
    schema = {"type": "object", "properties": {"file": {"$ref": "#/$file"}, "color": {"$ref": "#/definitions/ui/color"}},
              "required": ["file", "color"], "additionalProperties": False,
              "$file": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                        "dependentRequired": {"a": ["b"]}, "additionalProperties": False},
              "definitions": {"ui": {"color": {"type": "string", "format": "color-hex", "maxLength": 7}}}}
    prepared = prepare(schema)
    assert "dependentRequired" not in json.dumps(prepared.schema) and '"color-hex"' not in json.dumps(prepared.schema)
    assert not prepared.loose and any("color-hex" in w for w in prepared.warnings)
    c = Constraint.json_schema(schema)
    grammars.check(c)
    for doc in ({"file": {"a": 1, "b": 2}, "color": "#fff"}, {"file": {"a": 1}, "color": "#fff"},
                {"file": {"b": 2}, "color": "#fff"}, {"file": {}, "color": "#ffffff00"}):
        assert grammar_accepts(grammars, c, doc) == original_validator(schema).is_valid(doc), doc
