"""TinyLoop's request knobs, declared once: the depth (`loops`, adaptive depth's exit criteria, `kv_loops`), the
speculative knobs, and each request's own limits, with their types, ranges and documentation. Every route reads
them from here: each HTTP API's request body inherits the groups it takes (server/*/schemas.py: OpenAI's
/v1 and /api/v0, Messages and Responses take `LoopKnobs`, native /generate* the groups of its mode), and the
command line's `tinyloop generate` flags are made from the same fields (`add_flags`). `knob_params` maps any of
them onto `SamplingParams` (engine/params.py: the defaults and the range checks).

Adding a knob: a field in its group here, its `SamplingParams` field and check (params.py), and the engine code
that uses it. Torch-free (the command line imports it to build its parser).

Types are strict on HTTP (no "5" for 5, no `true` for 1): the OpenAPI document says what is accepted, and the
schema fuzzer (tests/server/test_fuzz.py) holds the server to it. Ranges are not checked by pydantic:
`SamplingParams.validate` and `Engine.plan` do that in one place and raise `ValidationError` (-> 400), as
the spec asks (out-of-range values are 400, wrong types 422). The ranges are still written into the JSON
schema (`rng`), so the document is exactly as tight as the validation; limits that depend on the model or
the settings (`x-limit`) are filled in when the document is served (server/openapi.py).
"""

from __future__ import annotations

import argparse
import json
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, TypeAdapter, ValidationError as PydanticError
from pydantic.json_schema import WithJsonSchema

from ..errors import ValidationError
from .params import MODES, param_default

MAX_WINDOW = 2**31 - 1  # cache_window: any window past the context is the full context; past this, a 400
MIN_TIMEOUT_S = 0.001   # a limit shorter than this cannot cover one engine step: refused rather than sure to expire
DECIMAL = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
# a keep_alive string: seconds, or a Go duration ("5m", "1h30m", "300ms"), signed (server/settings.py reads it)
KEEP_ALIVE_PATTERN = f"^[+-]?(?:{DECIMAL}|(?:{DECIMAL}(?:ns|us|µs|ms|s|m|h))+)$"


def doc(**schema: Any) -> Any:
    """JSON-schema-only constraints (checked by the engine, so a violation is a 400 naming the field)."""
    return Field(json_schema_extra=schema)


def rng(default: Any = None, *, lo: float | None = None, hi: float | None = None, gt: float | None = None,
        hi_limit: str | None = None, **schema: Any) -> Any:
    """A field whose range is documented in the JSON schema but checked by the engine (400, not 422).
    `hi_limit` names a limit filled in when the document is served (server/openapi.py)."""
    extra: dict[str, Any] = dict(schema)
    if lo is not None:
        extra["minimum"] = lo
    if gt is not None:
        extra["exclusiveMinimum"] = gt
    if hi is not None:
        extra["maximum"] = hi
    if hi_limit is not None:
        extra["x-limit"] = hi_limit
    return Field(default, json_schema_extra=extra)


def knob(param: str | None = None, **kw: Any) -> Any:
    """A knob: None when not given, its range documented as `rng` documents it; `param` names the SamplingParams
    field whose default applies then (shown in the document)."""
    field = rng(None, **kw)
    if param is not None:   # the document's default (the field's own stays None: "not given")
        field.json_schema_extra["default"] = param_default(param)
    return field


def _integral(value: Any) -> Any:
    """JSON Schema counts 1.0 as an integer, so the server does too (not "1", not true)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]
# a depth, or "auto": adaptive depth per token. Any JSON value is taken here and checked by the engine
# (SamplingParams.validate), so `"fast"`, 2.5 or true get the same clean 400 naming `loops` as 0 does,
# not a union type error
Loops = Annotated[Any, BeforeValidator(_integral),
                  WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string", "enum": ["auto"]}]})]
ExitCriterion = Literal["latent", "kl", "gate"]  # model/exits.py CRITERIA
KVLoops = Int | Literal["all", "last"]  # the loop-shared KV budget
KeepAlive = float | Annotated[str, doc(pattern=KEEP_ALIVE_PATTERN)]   # checked by server/models.py: a 400 naming it
KV_LOOPS_DOC = ('core KV slots kept per layer: "all" (one per loop, the default), "last" (1: every loop reads earlier '
                'tokens at their last loop) or k (loop r uses slot r mod k); memory per token drops accordingly '
                '(docs/adaptive.md). Mode generate only: the speculative modes take "all"')
LOOPS_DOC = ('core loops per token, 1..max_loops (default: the model\'s default_loops), or "auto": each generated '
             'token exits by exit_criterion between min_loops and max_loops (mode generate only; min_loops must '
             'not exceed max_loops, whose default is the model\'s default_loops; exit_criterion "gate" needs a '
             'model with an exit gate and an exit_threshold of at most 1)')
KEEP_ALIVE_DOC = ("Ollama's: how long the model stays loaded after this request (seconds, or a duration such as "
                  '"5m"; negative: pinned; 0: unloaded once answered); default the model\'s (server/models.py)')


# -- the knobs, by group ----------------------------------------------------------------------------
class DepthKnobs(BaseModel):
    """The depth: `loops`, adaptive depth's exit criteria (docs/adaptive.md) and the loop-shared KV budget."""

    loops: Loops | None = rng(lo=1, hi_limit="max_loops", description=LOOPS_DOC)
    exit_criterion: ExitCriterion | None = knob("exit_criterion", description='loops "auto": when a token exits')
    exit_threshold: float | None = rng(gt=0, hi=10, description="loops \"auto\": the criterion's threshold "
                                       "(default: its own)")
    min_loops: Int | None = knob("min_loops", lo=1, hi_limit="max_loops", description='loops "auto": the floor')
    max_loops: Int | None = rng(lo=1, hi_limit="max_loops", description='loops "auto": the ceiling (default: the '
                                "model's default_loops)")
    kv_loops: KVLoops | None = knob("kv_loops", lo=1, hi_limit="max_loops", description=KV_LOOPS_DOC)


class RequestKnobs(BaseModel):
    """Every generating request's own limits: its time, its cache window, its repetition penalty, how long its
    model stays loaded."""

    timeout_s: float | None = rng(lo=MIN_TIMEOUT_S, hi=86400, description="this request's time limit in seconds "
                                  "(default: the server's)")
    cache_window: Int | None = knob("cache_window", lo=0, hi=MAX_WINDOW, description="each query sees this many "
                                    "most recent keys (0: the whole context)")
    repetition_penalty: float | None = knob("repetition_penalty", lo=0.5, hi=2, description="CTRL's, over prompt "
                                            "and output")
    keep_alive: KeepAlive | None = Field(None, description=KEEP_ALIVE_DOC)


class SpeculationKnobs(BaseModel):
    """Self-speculation: draft with few loops, verify with many (docs/speculative.md)."""

    draft_loops: Int | None = rng(lo=1, hi=32, description="must be smaller than verify_loops; default: a quarter "
                                  "of verify_loops, at least 1 (2 at 8 loops)")
    verify_loops: Int | None = rng(lo=1, hi_limit="max_loops", description="default: loops, else the model's "
                                   "default_loops")
    draft_ahead: Int | None = knob("draft_ahead", lo=1, hi=16, description="tokens drafted a round (a tree: its "
                                   "depth)")


class TreeKnobs(BaseModel):
    """Tree speculation's width."""

    K_branches: Int | None = knob("k_branches", lo=1, hi=16, description="K_branches x draft_ahead <= 64; above 1: "
                                  "cache_window 0")


class LoopKnobs(DepthKnobs, RequestKnobs, SpeculationKnobs, TreeKnobs):
    """Every knob, for the routes that take them all (/v1 chat and completions, /api/v0, Messages, Responses;
    as vLLM takes its sampling extras on /v1), with the generation mode (the native routes have a route a mode)."""

    mode: str | None = rng(enum=[*MODES, None])  # checked by the engine: an unknown mode is a 400
    ignore_eos: bool | None = Field(None, description="vLLM's: keep generating past end-of-text (benchmarks)")


PARAM = {name: {"K_branches": "k_branches"}.get(name, name) for name in LoopKnobs.model_fields}   # -> SamplingParams
SERVER_ONLY = {"timeout_s", "keep_alive"}   # read by the server (the worker's time limit, the model pool)


# -- reading them -------------------------------------------------------------------------------------
def or_default(value: Any, default: Any) -> Any:
    return default if value is None else value


def check_timeout(value: float | None) -> None:
    if value is not None and not MIN_TIMEOUT_S <= value <= 86400:
        raise ValidationError(f"timeout_s: must be in {MIN_TIMEOUT_S}..86400 seconds (a shorter limit cannot cover "
                              f"one engine step), got {value}", param="timeout_s")


def check_knobs(draft_loops: int | None, verify_loops: int | None, draft_ahead: int | None,
                k_branches: int | None, cache_window: int | None, max_loops: int | None = None) -> None:
    """The speculative knobs' own ranges, checked whenever they are given (the engine checks them only
    in the modes that use them; a value the document calls invalid is never accepted silently), and
    cache_window's upper bound (a number too large for the engine's int64 tensors was a 500)."""
    for name, value, lo, hi in (("draft_loops", draft_loops, 1, 32), ("verify_loops", verify_loops, 1, max_loops),
                                ("draft_ahead", draft_ahead, 1, 16), ("K_branches", k_branches, 1, 16),
                                ("cache_window", cache_window, 0, MAX_WINDOW)):
        if value is not None and not (lo <= value and (hi is None or value <= hi)):
            raise ValidationError(f"{name}: must be in {lo}..{hi if hi is not None else 'max_loops'}, got {value}",
                                  param=name)


def knob_params(body: BaseModel, **given: Any) -> dict[str, Any]:
    """The SamplingParams keywords of every knob `body` declares: its value, else SamplingParams' default;
    `given` overrides (a route's own reading of one, such as `loops` with a model name's `@loops=K`). The one
    mapping from a request's knobs onto the engine's; the checks a knob needs before the engine's are here."""
    fields = [name for name in type(body).model_fields if name in PARAM]
    value = {name: getattr(body, name) for name in fields}
    check_knobs(*(value.get(n) for n in ("draft_loops", "verify_loops", "draft_ahead", "K_branches", "cache_window")))
    check_timeout(value.get("timeout_s"))
    out = {PARAM[n]: or_default(value[n], param_default(PARAM[n])) for n in fields if n not in SERVER_ONLY}
    out.update(given)
    return out


def add_flags(parser: argparse.ArgumentParser, *groups: type[BaseModel], skip: tuple[str, ...] = ()) -> None:
    """The command line's flags for the knobs of `groups` (`--kv-loops`, `--k-branches`, ...): each parsed
    as its field's type (a value the field refuses is argparse's error naming the flag), its default
    SamplingParams', its help the field's description; `args.<SamplingParams name>` holds it."""
    for group in groups:
        for name, field in group.model_fields.items():
            if name in skip or name in SERVER_ONLY:
                continue
            param = PARAM[name]
            default = param_default(param)
            about = field.description or (field.json_schema_extra or {}).get("description", "")
            about += f" (default: {default})" if default is not None else ""
            parser.add_argument("--" + name.lower().replace("_", "-"), dest=param, default=default,
                                type=_flag_type(name, field.annotation), metavar=_metavar(field.annotation),
                                help=about.replace("%", "%%"))


def _flag_type(name: str, annotation: Any):
    adapter = TypeAdapter(annotation)

    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        if value is None or isinstance(value, (bool, list, dict)):
            value = text
        try:
            return adapter.validate_python(value, strict=True)
        except PydanticError:
            raise argparse.ArgumentTypeError(f"not a value of {name}: {text!r}") from None
    parse.__name__ = name
    return parse


def _metavar(annotation: Any) -> str | None:
    """{latent,kl,gate} for a choice among words, else argparse's default (the flag's name)."""
    words = [a for a in typing.get_args(annotation) if typing.get_origin(a) is Literal]
    if len(words) == 1 and len(typing.get_args(annotation)) == 2:   # Literal[...] | None
        return "{" + ",".join(typing.get_args(words[0])) + "}"
    return None
