"""The request knobs every API shares, declared once (pydantic: shapes and types -> 422): the depth and
speculation knobs (`LoopKnobs`), their types, ranges and docs, `logit_bias`, seeds, time limits, chat messages.
Each API's request bodies (openai/, anthropic/, responses/, native/ `schemas.py`) build on these and map them onto
SamplingParams.

Types are strict (no "5" for 5, no `true` for 1): the OpenAPI document says what is accepted, and the
schema fuzzer (tests/server/test_fuzz.py) holds the server to it. Ranges are not checked by pydantic:
`SamplingParams.validate` and `Engine.plan` do that in one place and raise `ValidationError` (-> 400), as
the spec asks (out-of-range values are 400, wrong types 422). The ranges are still written into the JSON
schema (`rng`), so the document is exactly as tight as the validation; limits that depend on the model or
the settings (`x-limit`) are filled in when the document is served (server/openapi.py).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.json_schema import WithJsonSchema

from ..engine import param_default
from ..engine.params import MODES
from ..chat import Chat
from ..errors import ValidationError
from .structured import ToolCall, generic_conversation, message_for_template
from .settings import KEEP_ALIVE_PATTERN

# Request defaults are SamplingParams' (one place: the CLI, Engine and native /generate share them); only
# OpenAI's temperature 1.0, where its own spec says otherwise, is a default written here.
DEFAULT_MAX_TOKENS = param_default("max_tokens")
OPENAI_TEMPERATURE = 1.0

# OpenAI request fields TinyLoop does not implement: refused (400) when set to anything but their default,
# rather than silently ignored.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "functions": (None, []),   # tools: chat only (a text completion has no tool calls)
    "tool_choice": (None, "none"), "parallel_tool_calls": (None, True), "function_call": (None, "none"),
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),  # echo: /v1/completions takes it
}
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1   # torch.Generator.manual_seed's range
MAX_STOP = 16  # SamplingParams.validate's limit
MAX_WINDOW = 2**31 - 1  # cache_window: any window past the context is the full context; past this, a 400
STRICT = ConfigDict(strict=True)


def doc(**schema: Any) -> Any:
    """JSON-schema-only constraints (checked by the engine, so a violation is a 400 naming the field)."""
    return Field(json_schema_extra=schema)


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
KV_LOOPS_DOC = ('core KV slots kept per layer: "all" (one per loop, the default), "last" (1: every loop reads earlier '
                'tokens at their last loop) or k (loop r uses slot r mod k); memory per token drops accordingly '
                '(docs/adaptive.md). Mode generate only: the speculative modes take "all"')
LOOPS_DOC = ('core loops per token, 1..max_loops (default: the model\'s default_loops), or "auto": each generated '
             'token exits by exit_criterion between min_loops and max_loops (mode generate only; min_loops must '
             'not exceed max_loops, whose default is the model\'s default_loops; exit_criterion "gate" needs a '
             'model with an exit gate and an exit_threshold of at most 1)')
NonEmptyStr = Annotated[str, doc(minLength=1)]
TokenId = Annotated[Int, doc(minimum=0, **{"x-limit": "vocab_max"})]  # 0..vocab_size-1
TokenIds = list[TokenId]
PromptIds = Annotated[list[TokenId], doc(minItems=1)]
StopStrings = Annotated[list[NonEmptyStr], doc(maxItems=16)]


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


def _json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON sees it: `false` is not `0` (Python says it is)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b and (a is None) == (b is None)


def is_default(value: Any, allowed: tuple[Any, ...]) -> bool:
    return any(_json_equal(value, d) for d in allowed)


def closed_schema(schema: dict[str, Any]) -> None:
    """The document of an OpenAI body: the refused fields with the only values accepted, and no others."""
    schema["properties"].update({k: v for k, v in _unsupported_schema().items() if k not in schema["properties"]})
    schema["additionalProperties"] = False


def _unsupported_schema() -> dict[str, Any]:
    """The OpenAI fields TinyLoop refuses unless they hold their default: documented with the only values
    accepted, so a client (or the fuzzer) can see what is refused."""
    return {name: {"enum": list(allowed), "description": "not supported: only its default is accepted"}
            for name, allowed in UNSUPPORTED.items()}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool | None = Field(None, description="accepted; no effect (no obfuscation padding is sent)")


TOKEN_ID_KEY = re.compile(r"(0|[1-9][0-9]{0,9})")
MAX_BIAS = 100


def logit_bias_of(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` ({"50256": -100}: token id strings -> bias in -100..100) as the engine takes it
    ({50256: -100.0}); a key that is not a token id, or a bias out of range, is a 400 naming `logit_bias` (ids
    outside the vocabulary are checked by the engine, SamplingParams.validate)."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not TOKEN_ID_KEY.fullmatch(key):
            raise ValidationError(f"logit_bias: keys are token ids as decimal strings (\"50256\"), got {key!r}",
                                  param="logit_bias")
        if not -MAX_BIAS <= value <= MAX_BIAS:
            raise ValidationError(f"logit_bias: biases must be in -{MAX_BIAS}..{MAX_BIAS}, got {value} for token {key}",
                                  param="logit_bias")
        out[int(key)] = float(value)
    return out


def logit_bias_field() -> Any:
    return Field(None, description='token id (a decimal string) -> bias in -100..100, added to that token\'s logit '
                                   'before sampling or greedy (-100 bans a token, 100 all but forces it)',
                 json_schema_extra={"propertyNames": {"pattern": f"^{TOKEN_ID_KEY.pattern}$"},
                                    "additionalProperties": {"type": "number", "minimum": -MAX_BIAS, "maximum": MAX_BIAS}})


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the answer is expected to resemble. Accepted and checked; it does not
    change the output (it only ever makes OpenAI's answer faster) and is not used to draft here."""
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["content"]
    content: str | Annotated[list[TextPart], doc(minItems=1)]


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]   # OpenAI's values
NO_EFFECT = "accepted; no effect"
EFFORT_DEPTH_DOC = ('on a model that declares the depths it was trained at (GET /v1/models: trained_loops), the '
                    'depth when the body names no loops: "low" (and "none", "minimal") the shallowest, "medium" the '
                    'middle, "high" (and "xhigh") the deepest; a model without that range keeps its default depth '
                    '(docs/server.md)')
EFFORT_DOC = EFFORT_DEPTH_DOC + ('. On chat, also a thinking budget (max_thinking_tokens wins; no effect on models '
                                 'that do not think)')


class ContentPart(BaseModel):
    """OpenAI's text content part; other part types (images, audio) are refused (422)."""
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={  # a tool result names its call
        "if": {"properties": {"role": {"const": "tool"}}}, "then": {"required": ["tool_call_id"]}})
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's earlier tool calls")
    tool_call_id: str | None = Field(None, description="role tool: the call this message answers")

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def render_chat(messages: list[ChatMessage], template: str | None = None) -> Chat:
    """The conversation, checked, for the engine to render with the model's chat template (an imported
    checkpoint's own Jinja template, or "Role: content" lines for TinyLoop's GPT-2 models: `tinyloop.chat`).
    Earlier tool calls and tool results are written as the model's tool format has them (server/structured.py)."""
    if not messages:
        raise ValidationError("messages: must contain at least one message", param="messages")
    style = "hermes" if template and "<tool_call>" in template else "generic"
    out = []
    for i, m in enumerate(messages):
        if m.role == "tool" and not m.tool_call_id:
            raise ValidationError(f"messages[{i}].tool_call_id: a tool message answers a call: give its id",
                                  param=f"messages[{i}].tool_call_id")
        msg = {"role": m.role, "content": m.text(i)}
        if m.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg if style == "generic" else message_for_template(msg, style))
    return Chat(tuple(generic_conversation(out) if style == "generic" else out))


def or_default(value: Any, default: Any) -> Any:
    return default if value is None else value


def seed_of(value: int | None, param: str) -> int | None:
    """Seeds go to torch.Generator.manual_seed, which takes [-2**63, 2**64); any other integer is taken
    modulo 2**64 (JSON numbers that large are not exact in most clients anyway)."""
    if value is not None and not SEED_MIN <= value <= SEED_MAX:
        return value % 2**64
    return value


LOOPS_SUFFIX = re.compile(r"@loops=(auto|-?[0-9]+)$")


def model_loops(model: str) -> int | str | None:
    """The depth a model name asks for: "tinyloop@loops=4" -> 4, "x@loops=auto" -> "auto", else None.
    (Evaluation harnesses send a fixed body but let the user name the model: docs/evaluation.md.)"""
    m = LOOPS_SUFFIX.search(model)
    if m is None:
        return None
    return "auto" if m.group(1) == "auto" else int(m.group(1))


MIN_TIMEOUT_S = 0.001  # a limit shorter than this cannot cover one engine step: refused rather than sure to expire


def check_timeout(value: float | None) -> None:
    if value is not None and not MIN_TIMEOUT_S <= value <= 86400:
        raise ValidationError(f"timeout_s: must be in {MIN_TIMEOUT_S}..86400 seconds (a shorter limit cannot cover "
                              f"one engine step), got {value}", param="timeout_s")


def requested_loops(loops: Any, model: str) -> Any:
    """`loops`, else the depth the model name asks for (`name@loops=K`); both given must agree."""
    suffix = model_loops(model)
    if suffix is None:
        return loops
    if loops is not None and loops != suffix:
        raise ValidationError(f"loops: the body asks for {loops!r}, the model name {model!r} for "
                              f"{suffix!r}; give one", param="loops")
    return suffix


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


KeepAlive = float | Annotated[str, doc(pattern=KEEP_ALIVE_PATTERN)]   # checked by server/models.py: a 400 naming it
KEEP_ALIVE_DOC = ("Ollama's: how long the model stays loaded after this request (seconds, or a duration such as "
                  '"5m"; negative: pinned; 0: unloaded once answered); default the model\'s (server/models.py)')


class LoopKnobs(BaseModel):
    """TinyLoop's own knobs, declared once and taken by every generating route (/v1 chat and completions,
    /api/v0, Messages, Responses; as vLLM takes its sampling extras on /v1): the depth (`loops`, adaptive
    depth's exit criteria, `kv_loops`), the request's time limit, the generation mode, the speculative knobs,
    the cache window and the repetition penalty."""

    loops: Loops | None = rng(lo=1, hi_limit="max_loops", description=LOOPS_DOC)  # extension: 1..max_loops or "auto"
    exit_criterion: ExitCriterion | None = None                 # loops "auto" (adaptive depth, docs/adaptive.md)
    exit_threshold: float | None = rng(gt=0, hi=10)
    min_loops: Int | None = rng(lo=1, hi_limit="max_loops")
    max_loops: Int | None = rng(lo=1, hi_limit="max_loops")    # the ceiling; default the model's default_loops
    kv_loops: KVLoops | None = rng(lo=1, hi_limit="max_loops", description=KV_LOOPS_DOC)
    timeout_s: float | None = rng(lo=MIN_TIMEOUT_S, hi=86400)  # TinyLoop extension: this request's time limit
    mode: str | None = rng(enum=[*MODES, None])  # checked by the engine: an unknown mode is a 400
    draft_loops: Int | None = rng(lo=1, hi=32)
    verify_loops: Int | None = rng(lo=1, hi_limit="max_loops")
    draft_ahead: Int | None = rng(lo=1, hi=16)
    K_branches: Int | None = rng(lo=1, hi=16)
    cache_window: Int | None = rng(lo=0, hi=MAX_WINDOW)
    repetition_penalty: float | None = rng(lo=0.5, hi=2)
    ignore_eos: bool | None = Field(None, description="vLLM's: keep generating past end-of-text (benchmarks)")
    keep_alive: KeepAlive | None = Field(None, description=KEEP_ALIVE_DOC)   # server/models.py

    def extension_params(self) -> dict[str, Any]:
        check_knobs(self.draft_loops, self.verify_loops, self.draft_ahead, self.K_branches, self.cache_window)
        given = {"mode": self.mode, "draft_loops": self.draft_loops, "verify_loops": self.verify_loops,
                 "draft_ahead": self.draft_ahead, "k_branches": self.K_branches, "cache_window": self.cache_window,
                 "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos}
        return {name: or_default(value, param_default(name)) for name, value in given.items()}
