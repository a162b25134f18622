"""The check a complete answer goes through when its schema had parts the grammar could not enforce exactly
(`schema_rewrite`'s loose keywords, a `oneOf` compiled as `anyOf`): the answer validated against the schema
as the client sent it, with the `jsonschema` package (docs/structured.md, "Schema coverage").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import ValidationError

ONE_OF_COERCED = "oneOf not fully supported"   # llguidance's warning when it compiled a oneOf as anyOf


@dataclass(frozen=True)
class SchemaCheck:
    source: str                        # the schema as the client sent it (JSON text)
    warnings: tuple[str, ...] = ()     # for the response (x-tinyloop-warning)
    loose: tuple[str, ...] = ()        # "keyword at #/path" not enforced while generating

    @classmethod
    def of(cls, constraint, grammar_warnings: list[str], recursive_refs: bool = False) -> "SchemaCheck":
        """A json_schema constraint's check, once compiled (`grammar_warnings`: llguidance's; `recursive_refs`:
        compiled on the second try, `schema_rewrite.prepare`). Loose parts need `jsonschema` to be checked:
        without it they are a 400 naming the keyword and its path."""
        prepared = constraint.prepared(recursive_refs)
        warnings, loose = list(prepared.warnings), list(prepared.loose)
        if any(ONE_OF_COERCED in w for w in grammar_warnings):
            paths = keyword_paths(json.loads(constraint.source), "oneOf")
            where = f"oneOf at {', '.join(paths) or '#'}"
            loose.append(where)
            warnings.append(f"{where}: branches that may overlap, generated as anyOf (an answer may match more "
                            f"than one branch); the complete answer is checked against the schema")
        if loose:
            try:
                import jsonschema  # noqa: F401
            except ImportError:
                raise ValidationError(f"{constraint.param}: {loose[0]}: cannot be enforced while generating, and "
                                      "this server cannot check answers against it (the jsonschema package is not "
                                      "installed); remove it from the schema", param=constraint.param,
                                      code="unsupported_schema") from None
            try:
                _validator(constraint.source)
            except Exception as exc:  # noqa: BLE001 - jsonschema's SchemaError and friends
                raise ValidationError(f"{constraint.param}: the schema is not a valid JSON Schema: "
                                      f"{getattr(exc, 'message', exc)}", param=constraint.param,
                                      code="invalid_schema") from None
        return cls(constraint.source, tuple(warnings), tuple(loose))

    def validate(self, text: str) -> str | None:
        """None when `text` is JSON valid against the schema, else why not (one line)."""
        try:
            value = json.loads(text)
        except ValueError as exc:
            return f"not JSON: {exc}"
        error = next(iter(_validator(self.source).iter_errors(value)), None)
        if error is None:
            return None
        where = "#" + "".join(f"/{p}" for p in error.absolute_path)
        return f"at {where}: {error.message}"[:300]


_VALIDATORS: dict[str, Any] = {}


def _validator(source: str):
    """jsonschema's validator for the schema's own draft ($schema; 2020-12 when it names none), kept per
    schema text (the check runs at the end of every answer under it)."""
    hit = _VALIDATORS.get(source)
    if hit is None:
        import jsonschema

        schema = json.loads(source)
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        hit = _VALIDATORS[source] = cls(schema)
        while len(_VALIDATORS) > 256:
            _VALIDATORS.pop(next(iter(_VALIDATORS)))
    return hit


def keyword_paths(schema: Any, keyword: str, path: str = "#") -> list[str]:
    """The JSON pointers (`#/properties/a`) of the schemas in `schema` that use `keyword`."""
    out: list[str] = []
    if not isinstance(schema, dict):
        return out
    if keyword in schema:
        out.append(path)
    for k, v in schema.items():
        if k in NAMED and isinstance(v, dict):   # names -> schemas (a property may be called "not")
            for name, sub in v.items():
                out += keyword_paths(sub, keyword, f"{path}/{k}/{name.replace('~', '~0').replace('/', '~1')}")
        elif isinstance(v, dict) and k not in VALUES:
            out += keyword_paths(v, keyword, f"{path}/{k}")
        elif isinstance(v, list) and k not in VALUES:
            for i, x in enumerate(v):
                out += keyword_paths(x, keyword, f"{path}/{k}/{i}")
    return out


NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
VALUES = ("enum", "const", "default", "examples", "required")
