"""The request fields the HTTP APIs share beyond TinyLoop's knobs (those are engine/knobs.py's, declared once
for every route and the command line): OpenAI's refused fields, `logit_bias`, seeds, stop lists, chat
messages, a model name's `@loops=K`. Each API's request bodies (openai/, anthropic/, responses/, native/
`schemas.py`) build on these and on the knob groups, and map them onto SamplingParams.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..chat import Chat
from ..engine import param_default
from ..engine.knobs import Int, doc
from ..errors import ValidationError
from .structured import ToolCall, generic_conversation, message_for_template

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


NonEmptyStr = Annotated[str, doc(minLength=1)]
TokenId = Annotated[Int, doc(minimum=0, **{"x-limit": "vocab_max"})]  # 0..vocab_size-1
TokenIds = list[TokenId]
PromptIds = Annotated[list[TokenId], doc(minItems=1)]
StopStrings = Annotated[list[NonEmptyStr], doc(maxItems=16)]


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


def requested_loops(loops: Any, model: str) -> Any:
    """`loops`, else the depth the model name asks for (`name@loops=K`); both given must agree."""
    suffix = model_loops(model)
    if suffix is None:
        return loops
    if loops is not None and loops != suffix:
        raise ValidationError(f"loops: the body asks for {loops!r}, the model name {model!r} for "
                              f"{suffix!r}; give one", param="loops")
    return suffix


