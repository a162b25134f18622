"""Operations on JSON schemas that `schema_rewrite` builds its rewrites from: local `$ref`s and JSON pointers,
type sets, what a schema says or leaves open, negation (`negate`), unions and intersections of schemas, and
regexes over property names and strings (docs/structured.md, "Schema coverage")."""

from __future__ import annotations

import json
from typing import Any

ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
               "$id", "$schema", "$anchor", "markdownDescription", "format"}
TYPES = ("null", "boolean", "object", "array", "number", "string")
_ANY = r"[\s\S]"
_NOWHERE = object()


def _local_refs(s: Any) -> list[str]:
    """Every `$ref` in `s` that points into the document below its root ("#/...")."""
    out: list[str] = []
    stack = [s]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if isinstance(x.get("$ref"), str) and x["$ref"].startswith("#/"):
                out.append(x["$ref"])
            stack += [v for k, v in x.items() if k not in ("enum", "const", "default", "examples")]
        elif isinstance(x, list):
            stack += x
    return out


def _at(s: Any, parts: list[str]) -> Any:
    """The value at a JSON pointer's (decoded) parts, or None."""
    for part in parts:
        if isinstance(s, dict) and part in s:
            s = s[part]
        elif isinstance(s, list) and part.isdigit() and int(part) < len(s):
            s = s[int(part)]
        else:
            return None
    return s
_SAYS_NOTHING = {"additionalProperties": ({}, True), "additionalItems": ({}, True), "items": ({}, True),
                 "properties": ({},), "patternProperties": ({},), "required": ([],)}
_PLAIN_ANNOTATIONS = {"title", "description", "$comment", "examples", "default", "deprecated", "readOnly",
                      "writeOnly", "markdownDescription"}


def _bare(schema: Any) -> Any:
    """`schema` without its top-level annotations (which constrain nothing), for comparing two schemas."""
    return {k: v for k, v in schema.items() if k not in _PLAIN_ANNOTATIONS | {"$schema"}} \
        if isinstance(schema, dict) else schema


def _type_set(t: Any) -> set[str] | None:
    if isinstance(t, str):
        return {t}
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return set(t)
    return None


def _type_within(t: str, declared: set[str]) -> bool:
    """Every value of JSON type `t` (as `type` spells it) has one of the `declared` types."""
    return t in declared or (t == "integer" and "number" in declared)


def _finds_id(s: Any, top: bool = False) -> bool:
    """Whether a schema below the root sets `$id` (or draft 4's `id`) (conservative: a keyword's value that
    happens to be an object with a string `id`, such as a hyper-schema link, counts too)."""
    if isinstance(s, list):
        return any(_finds_id(x) for x in s)
    if not isinstance(s, dict):
        return False
    if not top and (isinstance(s.get("$id"), str) or isinstance(s.get("id"), str)):
        return True
    return any(_finds_id(v) for k, v in s.items() if k not in ("enum", "const", "default", "examples"))


def _filter_values(s: dict, keep) -> bool:
    """On a node that lists its values (`enum`, `const`), keep only those `keep` says (exact whatever the
    condition is: each value is tried with jsonschema). False where the node lists none."""
    values = [s["const"]] if "const" in s else s.get("enum")
    if not isinstance(values, list):
        return False
    try:
        kept = [v for v in values if keep(v)]
    except Exception:  # noqa: BLE001 - a $ref it cannot resolve on its own, jsonschema missing: not this way
        return False
    s.pop("const", None)
    s["enum"] = kept
    return True


def _holds(schema: Any, value: Any) -> bool:
    import jsonschema

    if "$ref" in json.dumps(schema):
        raise ValueError("a $ref is resolved against the whole schema")
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def negate(s: Any) -> Any:
    """A schema that holds exactly where `s` does not, or None where this cannot say so (then the caller
    checks the answer instead). A schema is a conjunction of its keywords: the negation is an `anyOf` of
    each keyword's negation."""
    if isinstance(s, bool):
        return not s
    if not isinstance(s, dict) or "$ref" in s or "format" in s:
        return None   # (a format: "not an email" has no schema)
    parts = []
    for k in sorted(set(s) - ANNOTATIONS):
        v = s[k]
        if k == "type":
            n = _not_type(v)
        elif k == "required" and isinstance(v, list):
            n = _any([{"type": "object", "properties": {r: False}} for r in v])
        elif k in ("const", "enum"):
            n = _not_values([v] if k == "const" else v) if k == "const" or isinstance(v, list) else None
        elif k == "properties" and isinstance(v, dict):
            each = [(p, negate(ps)) for p, ps in v.items()]
            n = None if any(x is None for _, x in each) else \
                _any([{"type": "object", "required": [p], "properties": {p: x}} for p, x in each if x is not False])
        elif k == "anyOf" and isinstance(v, list):
            each = [negate(x) for x in v]
            n = None if None in each else _all(each)
        elif k == "allOf" and isinstance(v, list):
            each = [negate(x) for x in v]
            n = None if None in each else _any(each)
        elif k == "not":
            n = v
        else:
            return None
        if n is None:
            return None
        parts.append(n)
    return _any(parts)


def _alternatives(schema: Any) -> int:
    """About how many alternatives llguidance makes of `schema` at its top: anyOfs add, allOfs multiply."""
    if not isinstance(schema, dict):
        return 1
    n = sum(_alternatives(x) for x in schema["anyOf"]) if isinstance(schema.get("anyOf"), list) else 1
    for x in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
        n *= _alternatives(x)
    return n


def _any(schemas: list) -> Any:
    schemas = [x for x in schemas if x is not False]
    if any(x is True or x == {} for x in schemas):
        return True
    return False if not schemas else schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _all(schemas: list) -> Any:
    schemas = [x for x in schemas if x is not True and x != {}]
    if any(x is False for x in schemas):
        return False
    return True if not schemas else schemas[0] if len(schemas) == 1 else {"allOf": schemas}


def _json_type(v: Any) -> str | None:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(v))


def _not_type(t: Any) -> Any:
    given = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None
    if given is None or ("integer" in given and "number" not in given):
        return None   # "a number that is not an integer" has no schema llguidance compiles
    rest = [x for x in TYPES if x not in given]
    return {"type": rest} if rest else False


def _not_values(values: list) -> Any:
    """Anything but these values: the other types whole, and per type the values' complement (booleans, the
    number line between them, strings by a pattern for each); None for an object or array value."""
    by_type: dict[str, list] = {}
    for v in values:
        by_type.setdefault(_json_type(v), []).append(v)
    if "array" in by_type or "object" in by_type or None in by_type:
        return None
    branches: list[Any] = []
    others = [t for t in TYPES if t not in by_type]
    if others:
        branches.append({"type": others})
    if "boolean" in by_type:
        rest = [b for b in (True, False) if b not in by_type["boolean"]]
        if rest:
            branches.append({"enum": rest})
    if "number" in by_type:
        cuts = sorted(set(by_type["number"]))
        branches.append({"type": "number", "exclusiveMaximum": cuts[0]})
        branches += [{"type": "number", "exclusiveMinimum": a, "exclusiveMaximum": b} for a, b in zip(cuts, cuts[1:])]
        branches.append({"type": "number", "exclusiveMinimum": cuts[-1]})
    if "string" in by_type:
        patterns = [{"pattern": _not_string(x)} for x in sorted(set(by_type["string"]))]
        branches.append({"type": "string", **(patterns[0] if len(patterns) == 1 else {"allOf": patterns})})
    return _any(branches)


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$-#&~/" else c for c in text)


def _not_string(text: str) -> str:
    """A regex matching every string but `text`: its proper prefixes, the strings that leave it at some
    character, and the strings that go on past it."""
    alts = [_regex_escape(text[:i]) for i in range(len(text))]
    alts += [f"{_regex_escape(text[:i])}[^{_regex_escape(text[i])}]{_ANY}*" for i in range(len(text))]
    alts.append(f"{_regex_escape(text)}{_ANY}+")
    return "^(" + "|".join(alts) + ")$"


def _name_regex(names: dict) -> str | None:
    if "pattern" in names and ("minLength" in names or "maxLength" in names):
        return None   # two regexes would have to be intersected
    if "pattern" in names:
        return names["pattern"] if isinstance(names["pattern"], str) else None
    lo, hi = names.get("minLength", 0), names.get("maxLength")
    return f"^{_ANY}{{{lo},{'' if hi is None else hi}}}$"


def _name_ok(names: dict, name: str) -> bool:
    import re

    if "pattern" in names:
        try:
            return re.search(names["pattern"], name) is not None
        except re.error:
            return False
    return names.get("minLength", 0) <= len(name) <= names.get("maxLength", len(name))


def _finite(items: dict) -> list | None:
    """The values an item schema allows when it lists them (enum, const, booleans), in order, else None."""
    keys = set(items) - ANNOTATIONS
    if keys in ({"enum"}, {"enum", "type"}) and isinstance(items["enum"], list):
        vals = items["enum"]
        if "type" in keys:
            t = items["type"]
            vals = [v for v in vals if _json_type(v) == t or (t == "integer" and isinstance(v, int)
                                                             and not isinstance(v, bool))]
    elif keys in ({"const"}, {"const", "type"}):
        vals = [items["const"]]
    elif keys == {"type"} and items["type"] == "boolean":
        vals = [True, False]
    else:
        return None
    out: list = []
    for v in vals:   # JSON equality (1 == 1.0; True is not 1)
        if not any(json.dumps(v, sort_keys=True) == json.dumps(w, sort_keys=True) for w in out):
            out.append(v)
    return out
