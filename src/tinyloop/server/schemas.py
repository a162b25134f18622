"""Request bodies (pydantic: shapes and types -> 422) and their mapping onto SamplingParams.

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

from ..engine import SamplingParams, param_default
from ..engine.constraint import Constraint
from ..engine.params import MODES
from ..engine.plan import MAX_N
from ..chat import Chat
from ..errors import ValidationError
from .structured import (ResponseFormat, Tool, ToolCall, ToolChoice, ToolPlan, generic_conversation,
                         message_for_template)

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


def _closed_schema(schema: dict[str, Any]) -> None:
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


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _seed(value: int | None, param: str) -> int | None:
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

    def extension_params(self) -> dict[str, Any]:
        check_knobs(self.draft_loops, self.verify_loops, self.draft_ahead, self.K_branches, self.cache_window)
        given = {"mode": self.mode, "draft_loops": self.draft_loops, "verify_loops": self.verify_loops,
                 "draft_ahead": self.draft_ahead, "k_branches": self.K_branches, "cache_window": self.cache_window,
                 "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos}
        return {name: _or(value, param_default(name)) for name, value in given.items()}


class OpenAIRequest(LoopKnobs):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI's names and defaults), plus
    TinyLoop's knobs (LoopKnobs). A field that is neither is a 400 naming it (`unknown_parameter`), never
    silently ignored: a typo'd knob would otherwise run as plain generation. Extra fields are let through
    pydantic (so that this is a 400 naming the field, not a 422) and refused in `check_unsupported`; the
    document says `additionalProperties: false`."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_closed_schema)

    model: str = Field(description='any name, echoed into the response (under --strict-model-names one of the '
                                   'server\'s names, GET /v1/models, else 404 model_not_found); a name ending in '
                                   '"@loops=K" (K a depth or "auto") '
                                   'asks for that depth when the body names no loops (harnesses that fix the '
                                   'rest of the body: docs/evaluation.md)', json_schema_extra={"x-model-names": True})
    max_tokens: Int | None = rng(lo=1, hi_limit="max_tokens")
    temperature: float | None = rng(lo=0, hi=2)
    top_p: float | None = rng(gt=0, hi=1)
    top_k: Int | None = rng(lo=0, hi=1000)   # extension: off unless given
    n: Int | None = rng(lo=1, hi=MAX_N)
    stop: NonEmptyStr | StopStrings | None = Field(None, description=f"up to {MAX_STOP} non-empty strings")
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    seed: Int | None = Field(None, description="any integer; outside [-2**63, 2**64) taken modulo 2**64")
    presence_penalty: float | None = rng(lo=-2, hi=2)
    frequency_penalty: float | None = rng(lo=-2, hi=2)
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = logit_bias_field()
    # OpenAI's bookkeeping fields: accepted, no effect here (docs/server.md)
    user: str | None = Field(None, description=NO_EFFECT)
    metadata: dict[str, str] | None = Field(None, description=NO_EFFECT)
    store: bool | None = Field(None, description="false (or null) only: chat completions are not stored here "
                                                 "(true is a 400; /v1/responses stores)",
                               json_schema_extra={"enum": [False, None]})
    service_tier: str | None = Field(None, description=NO_EFFECT)
    safety_identifier: str | None = Field(None, description=NO_EFFECT)
    prompt_cache_key: str | None = Field(None, description="accepted; no effect (the prefix cache is automatic)")
    # OpenAI's (chat; taken by text completions too): the depth on a model with a trained range (engine/params.py
    # SamplingParams.with_effort), and chat's thinking budget (server/reasoning.py)
    reasoning_effort: ReasoningEffort | None = Field(None, description=EFFORT_DOC)

    def check_unsupported(self) -> None:
        if self.store:
            raise ValidationError("store: chat completions are not stored by this server (leave store false; "
                                  "/v1/responses stores responses)", param="store", code="unsupported_parameter")
        for name, value in (self.model_extra or {}).items():
            if name not in UNSUPPORTED:
                raise ValidationError(f"{name}: unknown field; this route takes OpenAI's fields and TinyLoop's "
                                      "knobs (the list: /docs or /openapi.json)", param=name,
                                      code="unknown_parameter")
            if not is_default(value, UNSUPPORTED[name]):
                raise ValidationError(f"{name}: is not supported by TinyLoop", param=name, code="unsupported_parameter")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def wants_stream(self) -> bool:
        return bool(self.stream)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int:
        return _or(self.max_tokens, DEFAULT_MAX_TOKENS)

    def max_tokens_given(self) -> bool:
        return self.max_tokens is not None

    def sampling_params(self, temperature: float | None = None) -> SamplingParams:
        """`temperature`: the server's for a request that gives none (`serve --temperature`; None: OpenAI's 1.0)."""
        self.check_unsupported()
        check_timeout(self.timeout_s)
        if self.stream_options is not None and not self.stream:
            raise ValidationError("stream_options: only allowed when stream is true", param="stream_options")
        return SamplingParams(
            max_tokens=self.requested_max_tokens(), loops=self.requested_loops(),
            temperature=_or(self.temperature, _or(temperature, OPENAI_TEMPERATURE)),
            top_p=_or(self.top_p, param_default("top_p")),
            top_k=_or(self.top_k, param_default("top_k")),
            presence_penalty=_or(self.presence_penalty, param_default("presence_penalty")),
            frequency_penalty=_or(self.frequency_penalty, param_default("frequency_penalty")),
            seed=_seed(self.seed, "seed"), stop=self.stop_list(),
            exit_criterion=_or(self.exit_criterion, param_default("exit_criterion")),
            exit_threshold=self.exit_threshold, min_loops=_or(self.min_loops, param_default("min_loops")),
            max_loops=self.max_loops, kv_loops=_or(self.kv_loops, param_default("kv_loops")),
            logprobs=self.logprobs_param(), constraint=self.constraint(), logit_bias=logit_bias_of(self.logit_bias),
            reasoning_effort=self.reasoning_effort, **self.extension_params())

    def constraint(self) -> Constraint | None:
        """What the output must match (`response_format`; chat's `tools` add theirs: server/tools.py)."""
        return self.response_format.constraint() if self.response_format is not None else None

    def requested_loops(self) -> int | str | None:
        return requested_loops(self.loops, self.model)

    def logprobs_param(self) -> int | None:
        """Alternatives per token to report (SamplingParams.logprobs), or None."""
        return None

    def choices(self) -> int:
        """`n` as asked (default 1); the request plan checks its range with every other knob."""
        return _or(self.n, 1)


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: Int | None = rng(lo=1, hi_limit="max_tokens")  # newer clients' name for max_tokens
    logprobs: bool | None = Field(None, description="return each output token's log-probability (docs/server.md)")
    top_logprobs: Int | None = rng(lo=0, hi=20, description="alternatives per token, 0..20; needs logprobs: true")

    # accepted OpenAI fields (docs/server.md): text output only; the rest have no effect on this server
    modalities: list[Literal["text"]] | None = Field(None, description='["text"] only (the models write text)')
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description=NO_EFFECT)
    prediction: Prediction | None = Field(None, description="accepted (type content); it does not change the output")

    def logprobs_param(self) -> int | None:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ValidationError(f"top_logprobs: must be in 0..20 (alternatives per token), got {self.top_logprobs}",
                                  param="top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise ValidationError("top_logprobs: needs logprobs: true", param="top_logprobs")
        return _or(self.top_logprobs, 0) if self.logprobs else None

    def requested_max_tokens(self) -> int:
        if self.max_completion_tokens is not None and self.max_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValidationError(f"max_tokens: {self.max_tokens} and max_completion_tokens "
                                  f"{self.max_completion_tokens} disagree; give one (max_tokens is OpenAI's older name)",
                                  param="max_tokens")
        value = _or(self.max_completion_tokens, _or(self.max_tokens, DEFAULT_MAX_TOKENS))
        if value < 1:  # chat has no prompt scoring: the engine's "0 only with prompt_logprobs" does not apply
            name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
            raise ValidationError(f"{name}: must be at least 1, got {value}", param=name)
        return value

    def max_tokens_given(self) -> bool:
        return self.max_tokens is not None or self.max_completion_tokens is not None

    tools: list[Tool] | None = Field(None, description="functions the model may call (docs/structured.md)")
    tool_choice: ToolChoice | None = Field(None, description='"none", "auto" (default with tools), "required", '
                                           'or {"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: bool | None = Field(None, description="allow more than one call per answer (default true)")
    # reasoning (docs/server.md, "Reasoning"); reasoning_effort is OpenAI's (OpenAIRequest)
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="more variables for the model's chat "
                                                        "template (enable_thinking: false turns thinking off)")
    max_thinking_tokens: Int | None = rng(lo=0, hi=8192, description="tokens the thinking block may hold; then "
                                          "its closing tag is forced and the answer starts (no effect on a model "
                                          "that does not think)")

    def tool_plan(self, template: str | None) -> ToolPlan | None:
        plan = ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls, template, self.chat_template_kwargs)
        if plan is not None and self.response_format is not None and self.response_format.type != "text":
            raise ValidationError("response_format: give tools or a response_format, not both (or tool_choice "
                                  '"none")', param="response_format")
        return plan

    def prompt(self, template: str | None = None, tools: ToolPlan | None = None) -> Chat:
        chat = render_chat(self.messages, template)
        if self.chat_template_kwargs:
            chat = Chat(chat.messages, template_kwargs=self.chat_template_kwargs)
        return tools.chat(chat) if tools is not None else chat


MAX_PROMPTS = 16  # prompts in one /v1/completions request (each is a request of the batch)


class CompletionRequest(OpenAIRequest):
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], doc(minItems=1, maxItems=MAX_PROMPTS)] | PromptIds | \
        Annotated[list[PromptIds], doc(minItems=1, maxItems=MAX_PROMPTS)] = Field(
            description=f"text, token ids, or a list of up to {MAX_PROMPTS} of either (a batch: prompt i's choices are "
                        "indices i*n .. i*n+n-1); none empty")
    max_tokens: Int | None = rng(lo=0, hi_limit="max_tokens", description="0 only with echo: score the prompt")
    echo: bool | None = Field(False, description="return the prompt before the completion; with logprobs, the "
                                                 "prompt tokens' log-probabilities first (the first one null)")
    logprobs: Int | None = rng(lo=0, hi=5, description="return each output token's log-probability and this many "
                                                         "alternatives, 0..5 (docs/server.md)")

    def logprobs_param(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise ValidationError(f"logprobs: must be in 0..5 (alternatives per token), got {self.logprobs}",
                                  param="logprobs")
        return self.logprobs

    def sampling_params(self, temperature: float | None = None) -> SamplingParams:
        """As OpenAI's legacy completions: max_tokens 0 only with echo; echo with logprobs scores the prompt
        (SamplingParams.prompt_logprobs, so does echo with max_tokens 0)."""
        params = super().sampling_params(temperature)
        if not self.echo:
            if params.max_tokens == 0:
                raise ValidationError("max_tokens: must be at least 1; 0 only with echo: true (score the prompt)",
                                      param="max_tokens")
            return params
        if params.logprobs is None and params.max_tokens > 0:
            return params  # the prompt's text only: nothing to score
        if params.mode != "generate":
            raise ValidationError(f"echo: the prompt is not scored in mode {params.mode!r} yet (echo with logprobs "
                                  "or max_tokens 0); use mode generate", param="echo")
        return params.replace(prompt_logprobs=params.logprobs or 0)

    def prompt_inputs(self, vocab_size: int | None = None) -> list[str | list[int]]:
        """Each prompt: a string or token ids (a list of strings or of id lists is a batch)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValidationError("prompt: is empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]  # token ids
        if len(p) > MAX_PROMPTS:
            raise ValidationError(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(p)}", param="prompt")
        out = []
        for i, each in enumerate(p):
            if not each:
                raise ValidationError(f"prompt[{i}]: is empty", param="prompt")
            if vocab_size is not None and not isinstance(each, str):
                bad = [t for t in each if not 0 <= t < vocab_size]
                if bad:
                    raise ValidationError(f"prompt[{i}]: token ids {bad[:5]} are outside the vocabulary "
                                          f"0..{vocab_size - 1}", param="prompt")
            out.append(each if isinstance(each, str) else list(each))
        return out


class LMStudioChatRequest(ChatCompletionRequest):
    """/api/v0/chat/completions: the /v1 body (its own name in the document)."""


class LMStudioCompletionRequest(CompletionRequest):
    """/api/v0/completions: the /v1 body (its own name in the document)."""
