"""JSON Schema keywords llguidance does not implement, turned into ones it does (docs/structured.md, "Schema
coverage").

`prepare(schema)` gives the schema llguidance compiles, the warnings a response carries, and the keywords
whose answers are checked against the original schema once complete (`jsonschema`, server-side):

- rewritten exactly (the rewritten schema allows the same answers): `dependentRequired`, `dependentSchemas`,
  `dependencies`; `propertyNames` given as `enum`/`const`, `pattern`, `minLength`/`maxLength`; `not` and
  `if`/`then`/`else` whose condition `negate` can turn round (`type`, `required`, `const`, `enum`,
  `properties` of those, `anyOf`/`allOf`/`not` of those), or on a node that lists its values (the list
  filtered); `uniqueItems` over items of at most 4 values (every duplicate-free array written out);
- loose, then checked (dropped from the grammar, named in a warning, the complete answer validated against
  the original schema): the other forms of those keywords, `contains`, `unevaluated*`, a `pattern` with
  look-around or backreferences;
- an unknown `format`: a plain string, with a warning (validators treat `format` as an annotation too).

`oneOf` whose branches `negate` turns round becomes an `anyOf` of each branch with the others' negations
(exact); any other is llguidance's (exact where it proves the branches disjoint, else coerced to `anyOf`:
compiled with `coerce_one_of`, and the answer checked; `constraint.Grammars` and `schema_check` do both).

Schemas a local `$ref` reaches outside the keywords (`#/$file`, a folder of schemas in `definitions`) are
rewritten too. A recursive schema llguidance refuses ("circular references with sibling keys") is prepared a
second time with `recursive_refs=True`, which rewrites away what makes llguidance intersect (`_Walk.
without_intersections`: exact where the intersection says nothing new, else loose).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .schema_ops import (ANNOTATIONS, _NOWHERE, _SAYS_NOTHING, _all, _alternatives, _any, _at, _bare, _filter_values,
                         _finds_id, _finite, _holds, _json_type, _local_refs, _name_ok, _name_regex, _type_set,
                         _type_within, negate)

UNIQUE_MAX_VALUES = 4     # uniqueItems written out as every duplicate-free array up to this many item values
BRANCH_BUDGET = 32        # per schema node, the product of the alternatives that rewrites add (llguidance
                          # multiplies them out: 5 two-way dependencies compile in ~6 ms, 7 in ~40 ms, 12 are
                          # "too large"); past it, the rest are loose
LOOSE = ("contains", "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems")
ONE_SCHEMA = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
              "propertyNames", "unevaluatedProperties", "unevaluatedItems")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


@dataclass(frozen=True)
class Prepared:
    schema: Any                       # what llguidance compiles
    warnings: tuple[str, ...] = ()    # for the response's x-tinyloop-warning header
    loose: tuple[str, ...] = ()       # "keyword at #/path" not enforced while generating: checked after


def prepare(schema: Any, recursive_refs: bool = False) -> Prepared:
    """`recursive_refs`: the second try, for a schema llguidance refused with "circular references with sibling
    keys" (it compiles each `$ref` once, and cannot intersect one it is still compiling with other keywords):
    the keywords that make it intersect are rewritten away (`_Walk.without_intersections`)."""
    walk = _Walk(schema, recursive_refs)
    out = walk.node(schema, "#")
    out = walk.ref_targets(out)
    return Prepared(out, tuple(walk.warnings), tuple(walk.loose))


@lru_cache(maxsize=256)
def known_format(name: str) -> bool:
    """Whether llguidance knows string format `name` (asked, not listed here: its list grows by version)."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "format": name})
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return not is_error and not any("format" in m.lower() for m in messages)


@lru_cache(maxsize=1024)
def regex_problem(pattern: str) -> str | None:
    """Why llguidance cannot compile `pattern` as a string's `pattern` (its regex engine has no look-around
    and no backreferences), or None where it can."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "pattern": pattern})
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if not is_error:
        return None
    said = " ".join(messages)
    return said.rsplit("error:", 1)[1].strip().splitlines()[0] if "error:" in said else said.strip()[:120]


@lru_cache(maxsize=64)
def known_dialect(uri: str) -> bool:
    """Whether llguidance knows the meta-schema `uri` ($schema): it would try to fetch any other, and fail."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema({"$schema": uri, "type": "string"})
    return not llguidance.LLMatcher.validate_grammar_with_warnings(grammar)[0]


def _pointer(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


class _Walk:
    def __init__(self, root: Any = None, recursive_refs: bool = False):
        self.root = root                      # the schema as sent: local `$ref`s ("#/...") are read in it
        self.recursive_refs = recursive_refs  # rewrite away what makes llguidance intersect (prepare's second try)
        self.nested_ids: bool | None = None   # whether the schema sets `$id`/`id` below its root (refs not read)
        self.warnings: list[str] = []
        self.loose: list[str] = []
        self.visited: set[str] = set()        # the paths walked as schemas

    def let_loose(self, s: dict, keyword: str, path: str, why: str = "") -> None:
        """`keyword` (and `then`/`else` with `if`) out of the grammar's schema, into the check's list."""
        for k in (keyword, "then", "else") if keyword == "if" else (keyword,):
            s.pop(k, None)
        where = f"{keyword} at {path}"
        self.loose.append(where)
        self.warnings.append(f"{where}: not enforced while generating{why}; the complete answer is checked "
                             f"against the schema")

    def node(self, s: Any, path: str) -> Any:
        if not isinstance(s, dict):
            return s
        self.visited.add(path)
        s = dict(s)
        for k in SCHEMA_MAPS:
            if isinstance(s.get(k), dict):
                s[k] = {n: self.node(v, f"{path}/{k}/{_pointer(n)}") for n, v in s[k].items()}
        for k in ONE_SCHEMA:
            if isinstance(s.get(k), dict):
                s[k] = self.node(s[k], f"{path}/{k}")
        for k in SCHEMA_LISTS:
            if isinstance(s.get(k), list):
                s[k] = [self.node(v, f"{path}/{k}/{i}") for i, v in enumerate(s[k])]
        if isinstance(s.get("dependencies"), dict):
            s["dependencies"] = {n: v if isinstance(v, list) else self.node(v, f"{path}/dependencies/{_pointer(n)}")
                                 for n, v in s["dependencies"].items()}
        extra: list[tuple[str, Any]] = []   # (keyword, a schema the node must also satisfy): an allOf around it
        if self.recursive_refs:
            self.without_intersections(s, path)
        self.format(s, path)
        self.pattern(s, path)
        for k in LOOSE:
            if k in s:
                self.let_loose(s, k, path)
        self.dependencies(s, extra)
        self.property_names(s, path)
        self.unique_items(s, path)
        self.negation(s, path, extra)
        self.conditional(s, path, extra)
        self.one_of(s, extra)
        extra = self.within_budget(s, extra, path)
        if not extra:
            return s
        outer = {k: s.pop(k) for k in ("$defs", "definitions", "$schema", "$id") if k in s}
        return {**outer, "allOf": [s, *extra]}

    def within_budget(self, s: dict, extra: list[tuple[str, Any]], path: str) -> list[Any]:
        """The added schemas, as many as llguidance compiles quickly; the rest loose (checked after), but a
        `oneOf`, which goes back to llguidance as it was."""
        kept, product = [], 1
        for keyword, schema in extra:
            n = _alternatives(schema)
            if product * n > BRANCH_BUDGET:
                if keyword == "oneOf":
                    s["oneOf"] = self.one_of_given
                elif f"{keyword} at {path}" not in self.loose:
                    self.let_loose({}, keyword, path, " (more alternatives than the grammar compiles quickly)")
                continue
            product *= n
            kept.append(schema)
        return kept

    def ref_targets(self, out: Any) -> Any:
        """The schemas a local `$ref` points to that the walk did not reach through keywords (a folder of
        schemas inside `definitions`, a container of its own such as `#/$file`: validators and llguidance
        read them as schemas when referred to), walked and put in their place in `out`, until every local
        `$ref` lands on a walked schema. One whose place moved in `out` (inside a node a rewrite wrapped in an
        `allOf`) is left as it is (llguidance then names what it lacks)."""
        from urllib.parse import unquote

        while True:
            todo = []
            for ref in _local_refs(out):
                path = "#" + unquote(ref[1:])
                if path not in self.visited and path not in todo:
                    todo.append(path)
            walked = False
            for path in todo:
                self.visited.add(path)
                parts = [p.replace("~1", "/").replace("~0", "~") for p in path[2:].split("/")]
                target, parent = _at(self.root, parts), _at(out, parts[:-1])
                if isinstance(target, dict) and isinstance(parent, dict) and parts[-1] in parent:
                    parent[parts[-1]] = self.node(target, path)
                    walked = True
            if not walked:
                return out

    def without_intersections(self, s: dict, path: str) -> None:
        """llguidance intersects the schemas that apply to one value: a node's keywords with each `anyOf`/
        `oneOf` branch and with a `$ref` beside them, a declared property's schema with that of each
        `patternProperties` pattern its name matches. Where one of those reaches a `$ref` it is still compiling
        (a recursive schema), it refuses the schema. Rewritten so that nothing is intersected: exactly where the
        intersection says nothing new, else loose (checked after)."""
        for k, nothing in _SAYS_NOTHING.items():   # exact: these values constrain nothing
            if k in s and s[k] in nothing:
                s.pop(k)
        self.redundant_type(s)
        self.pattern_overlap(s, path)

    def redundant_type(self, s: dict) -> None:
        """`type` beside `anyOf`/`oneOf`/`allOf`/`$ref` whose every value already has one of those types (each
        branch's `type` or `enum`, a local `$ref`'s target's): left out. Exact: the node is `type` and the rest,
        and the rest implies `type`."""
        declared = _type_set(s.get("type"))
        if declared is None or not set(s) & {"anyOf", "oneOf", "allOf", "$ref"}:
            return
        rest = self.types({k: v for k, v in s.items() if k != "type"}, 0)
        if rest is not None and all(_type_within(t, declared) for t in rest):
            s.pop("type")

    def pattern_overlap(self, s: dict, path: str) -> None:
        """A declared property whose name a `patternProperties` pattern matches (Python's `re.search`, as
        jsonschema reads patterns) is held to both schemas. Where every matching pattern's schema is the
        property's own (annotations aside), the declaration is left out: exact (the pattern holds the name to
        the same schema, and a matched name is not an additional property). Otherwise the declaration is left
        out and loose: the grammar holds the name to the patterns' schemas, the answer is checked against the
        declared one after. (A pattern whose schema says nothing adds nothing: the declaration stays.)"""
        props, patterns = s.get("properties"), s.get("patternProperties")
        if not isinstance(props, dict) or not isinstance(patterns, dict) or not patterns:
            return
        import re

        kept = {}
        for name, schema in props.items():
            try:
                matching = [sub for p, sub in patterns.items() if re.search(p, name) and _bare(sub) not in ({}, True)]
            except re.error:
                matching = []
            if not matching:
                kept[name] = schema
            elif any(_bare(sub) != _bare(schema) for sub in matching):
                self.let_loose({}, "properties", f"{path}/properties/{_pointer(name)}",
                               " (its name also matches a patternProperties pattern, whose schema the grammar holds; "
                               "the two cannot be intersected in this recursive schema)")
        s["properties"] = kept

    def types(self, s: Any, depth: int) -> set[str] | None:
        """The JSON types `s` may match (as `type` spells them), or None where this cannot say (any)."""
        if s is False:
            return set()
        if not isinstance(s, dict) or depth > 16:
            return None
        out = _type_set(s.get("type"))

        def meet(other: set[str] | None) -> None:
            nonlocal out
            if other is not None:
                out = other if out is None else ({t for t in out if any(_type_within(t, {o}) for o in other)} |
                                                 {o for o in other if any(_type_within(o, {t}) for t in out)})
        if "const" in s or isinstance(s.get("enum"), list):
            values = [s["const"]] if "const" in s else s["enum"]
            meet({"integer" if isinstance(v, int) and not isinstance(v, bool) else _json_type(v) for v in values})
        if isinstance(s.get("$ref"), str):
            target = self.resolve(s["$ref"])
            if target is _NOWHERE:
                return None
            meet(self.types(target, depth + 1))
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list):
                each = [self.types(b, depth + 1) for b in s[key]]
                if None not in each:
                    meet(set().union(*each))
        for b in s["allOf"] if isinstance(s.get("allOf"), list) else []:
            meet(self.types(b, depth + 1))
        return out

    def resolve(self, ref: str) -> Any:
        """A local `$ref` ("#", "#/definitions/x") read in the schema as sent; _NOWHERE for any other (another
        document, an anchor), and where the schema sets `$id`/`id` below its root (a `$ref` below one resolves
        against it, not the root: not guessed)."""
        if self.nested_ids is None:
            self.nested_ids = _finds_id(self.root, top=True)
        if self.nested_ids or not (ref == "#" or ref.startswith("#/")):
            return _NOWHERE
        from urllib.parse import unquote

        node = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return _NOWHERE
        return node

    def format(self, s: dict, path: str) -> None:
        """An unknown `format`: a plain string. (And an unknown `$schema`, such as a registry's own
        meta-schema, read as JSON Schema: llguidance would try to fetch it.)"""
        uri = s.get("$schema")
        if isinstance(uri, str) and not known_dialect(uri):
            s.pop("$schema")
            self.warnings.append(f"$schema at {path}: {uri!r} is not a dialect this server knows; read as JSON "
                                 f"Schema (2020-12)")
        f = s.get("format")
        if isinstance(f, str) and not known_format(f):
            s.pop("format")
            self.warnings.append(f"format at {path}: {f!r} is not a format this server knows; written as a "
                                 f"plain string")

    def pattern(self, s: dict, path: str) -> None:
        """A string `pattern` llguidance's regex engine cannot compile (look-around such as `^(?!ioBroker)`,
        backreferences): loose, the complete answer checked with Python's `re`, which has both (jsonschema's
        `pattern` is `re.search`). Only `pattern` itself: a `patternProperties` key cannot be left out (it
        decides which keys `additionalProperties` covers), so such a key stays llguidance's 400."""
        p = s.get("pattern")
        if isinstance(p, str) and (why := regex_problem(p)) is not None:
            self.let_loose(s, "pattern", path, f" ({why})")

    def dependencies(self, s: dict, extra: list) -> None:
        """`dependentRequired` / `dependentSchemas` / `dependencies`: "if NAME is present, then ...", as an
        `anyOf` of NAME absent (`properties: {NAME: false}`) and NAME present with what it brings; a NAME the
        node already requires brings it unconditionally."""
        for key in ("dependentRequired", "dependentSchemas", "dependencies"):
            deps = s.pop(key, None)
            if not isinstance(deps, dict):
                continue
            for name, dep in deps.items():
                if name in (s.get("required") or []):
                    if isinstance(dep, list):
                        s["required"] = list(dict.fromkeys([*s["required"], *dep]))
                    else:
                        extra.append((key, dep))
                    continue
                present = {"required": [name, *dep]} if isinstance(dep, list) else _all([{"required": [name]}, dep])
                extra.append((key, _any([{"properties": {name: False}}, present])))

    def property_names(self, s: dict, path: str) -> None:
        """`propertyNames`: the object's keys held to a set (`enum`, `const`) or a pattern (`pattern`, or
        `minLength`/`maxLength` as one): declared properties that cannot match become `false`, the others
        allowed only as matching names (`additionalProperties: false` around `patternProperties`)."""
        names = s.pop("propertyNames", None)
        if names is None or names is True or names == {}:
            return
        if names is False:
            s["maxProperties"] = 0
            return
        if not isinstance(names, dict):
            self.let_loose(s, "propertyNames", path)   # not a schema: jsonschema's check of the schema says so
            return
        keys = set(names) - ANNOTATIONS - {"type"}
        if not keys and names.get("type", "string") == "string":
            return   # every key is a string: nothing to hold (what a record of strings writes)
        regex = _name_regex(names) if keys and keys <= {"pattern", "minLength", "maxLength"} else None
        values = None
        if keys in ({"enum"}, {"const"}):
            values = [v for v in (names["enum"] if "enum" in names else [names["const"]]) if isinstance(v, str)]
        if names.get("type", "string") != "string" or "patternProperties" in s or (values is None and regex is None):
            self.let_loose(s, "propertyNames", path)
            return
        props = dict(s.get("properties") or {})
        more = s.get("additionalProperties", True)
        ok = (lambda p: p in values) if values is not None else (lambda p: _name_ok(names, p))
        if regex is not None and more not in (True, False) and any(ok(p) for p in props):
            # patternProperties would also hold declared names to `more`, which the original does not
            self.let_loose(s, "propertyNames", path)
            return
        for p in props:
            if not ok(p):
                props[p] = False
        if more is not False:
            if values is not None:
                props.update({v: more for v in values if v not in props})
            else:
                s["patternProperties"] = {regex: more}
        s["properties"], s["additionalProperties"] = props, False

    def unique_items(self, s: dict, path: str) -> None:
        """`uniqueItems: true` over items of a few values (an enum, a const, booleans): every duplicate-free
        array written out (`prefixItems` of consts); otherwise loose."""
        if s.get("uniqueItems") is not True:
            s.pop("uniqueItems", None)
            return
        s.pop("uniqueItems")
        items = s.get("items")
        values = _finite(items) if isinstance(items, dict) else None
        rest = set(s) - ANNOTATIONS - {"type", "items", "minItems", "maxItems", "$defs", "definitions"}
        if values is None or len(values) > UNIQUE_MAX_VALUES or rest or s.get("type", "array") != "array":
            self.let_loose(s, "uniqueItems", path, "" if values is None or len(values) <= UNIQUE_MAX_VALUES else
                           f" (more than {UNIQUE_MAX_VALUES} item values)")
            return
        lo, hi = s.pop("minItems", 0), min(s.pop("maxItems", len(values)), len(values))
        s.pop("items")
        s["type"] = "array"
        s["anyOf"] = [{"prefixItems": [{"const": v} for v in perm], "items": False, "minItems": n}
                      for n in range(lo, hi + 1) for perm in itertools.permutations(values, n)] or [False]

    def negation(self, s: dict, path: str, extra: list) -> None:
        if "not" not in s:
            return
        n = negate(s["not"])
        if n is None and _filter_values(s, lambda v: not _holds(s["not"], v)):
            s.pop("not")
        elif n is None:
            self.let_loose(s, "not", path)
        else:
            s.pop("not")
            extra.append(("not", n))

    def one_of(self, s: dict, extra: list) -> None:
        """`oneOf` whose branches `negate` can turn round: `anyOf` of each branch with the others' negations
        (exactly one holds), which llguidance compiles exactly. Others are left to llguidance (exact where it
        can tell the branches apart, else generated as anyOf and checked: `constraint.Grammars`)."""
        branches = s.get("oneOf")
        if not isinstance(branches, list) or not 2 <= len(branches) <= 4:
            return
        negs = [negate(b) for b in branches]
        if None in negs:
            return
        self.one_of_given = s.pop("oneOf")   # put back by within_budget if the rewrite does not fit
        extra.append(("oneOf", _any([_all([b, *(n for j, n in enumerate(negs) if j != i)])
                                     for i, b in enumerate(branches)])))

    def conditional(self, s: dict, path: str, extra: list) -> None:
        """`if`/`then`/`else` as `anyOf: [allOf[if, then], allOf[not if, else]]` (without `if`, the other
        two mean nothing, as the spec has it)."""
        if "if" not in s:
            s.pop("then", None)
            s.pop("else", None)
            return
        n = negate(s["if"])
        cond, then, other = s["if"], s.get("then", True), s.get("else", True)
        if n is None and _filter_values(s, lambda v: _holds(then if _holds(cond, v) else other, v)):
            s.pop("if"), s.pop("then", None), s.pop("else", None)
            return
        if n is None:
            self.let_loose(s, "if", path)
            return
        s.pop("if"), s.pop("then", None), s.pop("else", None)
        extra.append(("if", _any([_all([cond, then]), _all([n, other])])))
