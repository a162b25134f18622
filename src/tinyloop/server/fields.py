"""pydantic's validation errors read as an API's field names: what a malformed body's 400 names. The
Messages API's shape uses it whole (`field_error`), OpenAI's translated routes (Responses, embeddings) its
field names (`param_of`): errors.OpenAIFieldErrors.

A location such as ("body", "messages", 0, "content", "list[union[...]]", 1, "text") becomes
`messages[0].content[1].text`: union members' tags and the type tag a tagged union puts after its field
(or a list index) are left out; where every member of a union failed, the message says what would do.
"""

from __future__ import annotations

from typing import Any

# pydantic's names for the members of a union in an error's location (`str`, `list[int]`, ...)
UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}
_TYPE_WORDS = {"string_type": "a string", "list_type": "a list", "dict_type": "an object", "model_type": "an object",
               "model_attributes_type": "an object", "int_type": "an integer", "float_type": "a number",
               "bool_type": "a boolean", "none_required": "null"}


def field_error(errors: list[dict[str, Any]]) -> tuple[str | None, str]:
    """pydantic's errors for a malformed body as (the first bad field by its API name, e.g.
    `messages[0].content[1].text`, and the message, with how many more fields are wrong); the field is None
    where the body is not JSON at all."""
    if not errors:
        return None, "invalid request body"
    bad_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if bad_json is not None:
        why = bad_json.get("ctx", {}).get("error", bad_json.get("msg"))
        return None, f"request body is not valid JSON: {why}"
    kept = _without_union_noise(errors)
    first = kept[0]
    param = param_of(first["loc"])
    msg = f"{param}: {_message(first, kept)}"
    others = len({param_of(e["loc"]) for e in kept}) - 1
    if others > 0:
        msg += f" (and {others} more problem{'s' if others > 1 else ''})"
    return param, msg


def _is_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in UNION_TAGS or "[" in part or "(" in part)


TAGGED = {"tool_choice", "thinking"}   # fields holding a tagged union (not in a list): pydantic's tag follows them


def param_of(loc: tuple[Any, ...] | list[Any]) -> str:
    """pydantic's location as Anthropic's field name (`messages[0].content[1].text`): union members' tags and
    the type tag that a tagged union puts after its field (or after a list index) are left out."""
    out, skip_next, tagged = "", False, False
    for part in loc:
        if part in ("body", "query", "path") and not out:
            continue
        if skip_next:
            skip_next = False
            continue
        if _is_tag(part):
            tagged = "tagged-union[" in part
            continue
        if isinstance(part, int):
            out += f"[{part}]"
            skip_next, tagged = tagged, False
            continue
        skip_next = not out and part in TAGGED
        out += f".{part}" if out else str(part)
    return out or "body"


def _union_point(loc) -> int | None:
    return next((k for k, p in enumerate(loc) if _is_tag(p)), None)


def _without_union_noise(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where a value may be of several types (a string or a list of blocks), every member's mismatch is
    reported: keep the one that got furthest (the list's bad block, not "not a string")."""
    out = []
    for e in errors:
        k = _union_point(e["loc"])
        if k is not None and any(f is not e and len(f["loc"]) > len(e["loc"]) and tuple(f["loc"][:k]) == tuple(e["loc"][:k])
                                 and _union_point(f["loc"]) == k for f in errors):
            continue
        out.append(e)
    return sorted(out, key=lambda e: -len(e["loc"])) if len(out) > 1 else out


def _message(first: dict[str, Any], kept: list[dict[str, Any]]) -> str:
    kind = first.get("type")
    ctx = first.get("ctx") or {}
    if kind == "union_tag_invalid":
        return f"type {ctx.get('tag')!r} is not one this server takes (expected one of {ctx.get('expected_tags')})"
    if kind == "union_tag_not_found":
        return "needs a type"
    if kind == "missing":
        return "Field required"
    if kind == "extra_forbidden":
        return "Extra inputs are not permitted"
    k = _union_point(first["loc"])
    if k is not None:   # every member of a union failed at the same depth: say what would do
        same = [e for e in kept if len(e["loc"]) == len(first["loc"]) and tuple(e["loc"][:k]) == tuple(first["loc"][:k])]
        words = [_TYPE_WORDS.get(e.get("type"), e.get("msg", "")) for e in same]
        if len(same) > 1:
            return f"Input should be {' or '.join(dict.fromkeys(words))}"
    return first.get("msg", "invalid")
