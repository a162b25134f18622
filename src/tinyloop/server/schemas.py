"""Request bodies (pydantic: shapes and types -> 422) and their mapping onto SamplingParams.

Ranges are not checked here: `SamplingParams.validate` and `Engine.check` do that in one place and
raise `ValidationError` (-> 400), as the spec asks (out-of-range values are 400, wrong types 422).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine import SamplingParams, param_default
from ..chat import Chat
from ..errors import ValidationError

# Request defaults are SamplingParams' (one place); only where an API's own spec says otherwise (OpenAI's
# temperature 1.0, the native API's top_k 50 / top_p 0.9) is a default written here.
DEFAULT_MAX_TOKENS = param_default("max_tokens")
OPENAI_TEMPERATURE = 1.0
ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}
ASSISTANT_CUE = "Assistant:"

# OpenAI request fields TinyLoop does not implement: refused (400) when set to anything but their default,
# rather than silently ignored.
UNSUPPORTED: dict[str, Any] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none"), "function_call": (None, "none"), "logit_bias": (None, {}),
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise ValidationError(f"messages[{index}].content[{j}]: only text content parts are supported, "
                                      f"got type {part.type!r}", param=f"messages[{index}].content")
            parts.append(part.text)
        return "".join(parts)


def render_chat(messages: list[ChatMessage]) -> Chat:
    """The conversation, checked, for the engine to render with the model's chat template (an imported
    checkpoint's own Jinja template, or "Role: content" lines for TinyLoop's GPT-2 models: `tinyloop.chat`)."""
    if not messages:
        raise ValidationError("messages: must contain at least one message", param="messages")
    return Chat(tuple({"role": m.role, "content": m.text(i)} for i, m in enumerate(messages)))


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _seed(value: int | None, param: str) -> int | None:
    """Seeds go to torch.Generator.manual_seed, which takes [-2**63, 2**64)."""
    if value is not None and not -(2**63) <= value < 2**64:
        raise ValidationError(f"{param}: must fit in 64 bits, got {value}", param=param)
    return value


def check_timeout(value: float | None) -> None:
    if value is not None and not 0 < value <= 86400:
        raise ValidationError(f"timeout_s: must be in (0, 86400] seconds, got {value}", param="timeout_s")


class OpenAIRequest(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI's names and defaults)."""

    model_config = ConfigDict(extra="allow")  # strict OpenAI clients send fields we do not use

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None             # extension: off unless given
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    loops: int | None = None             # TinyLoop extension, 1..max_loops
    timeout_s: float | None = None       # TinyLoop extension: time limit for this request
    user: str | None = None

    def check_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
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

    def sampling_params(self) -> SamplingParams:
        self.check_unsupported()
        check_timeout(self.timeout_s)
        if self.stream_options is not None and not self.stream:
            raise ValidationError("stream_options: only allowed when stream is true", param="stream_options")
        return SamplingParams(
            max_tokens=self.requested_max_tokens(), loops=self.loops,
            temperature=_or(self.temperature, OPENAI_TEMPERATURE), top_p=_or(self.top_p, param_default("top_p")),
            top_k=_or(self.top_k, param_default("top_k")),
            presence_penalty=_or(self.presence_penalty, param_default("presence_penalty")),
            frequency_penalty=_or(self.frequency_penalty, param_default("frequency_penalty")),
            seed=_seed(self.seed, "seed"), stop=self.stop_list(), **self.extension_params())

    def extension_params(self) -> dict[str, Any]:
        return {}

    def choices(self) -> int:
        """`n` as asked (default 1); the request plan checks its range with every other knob."""
        return _or(self.n, 1)


class LMStudioKnobs(BaseModel):
    """The /api/v0 superset: generation mode and the looped model's knobs."""

    mode: str | None = None
    draft_loops: int | None = None
    verify_loops: int | None = None
    draft_ahead: int | None = None
    K_branches: int | None = None
    cache_window: int | None = None
    repetition_penalty: float | None = None

    def extension_params(self) -> dict[str, Any]:
        given = {"mode": self.mode, "draft_loops": self.draft_loops, "verify_loops": self.verify_loops,
                 "draft_ahead": self.draft_ahead, "k_branches": self.K_branches, "cache_window": self.cache_window,
                 "repetition_penalty": self.repetition_penalty}
        return {name: _or(value, param_default(name)) for name, value in given.items()}


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # newer OpenAI clients' name for max_tokens

    def requested_max_tokens(self) -> int:
        return _or(self.max_completion_tokens, _or(self.max_tokens, DEFAULT_MAX_TOKENS))

    def prompt(self) -> Chat:
        return render_chat(self.messages)


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]]

    def prompt_input(self) -> str | list[int]:
        """A string, or token ids. A list of prompts uses its first (n > 1 is not implemented)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise ValidationError("prompt: is empty", param="prompt")
        first = p[0]
        if isinstance(first, int):
            return list(p)  # token ids
        return first if isinstance(first, str) else list(first)


class LMStudioChatRequest(LMStudioKnobs, ChatCompletionRequest):
    pass


class LMStudioCompletionRequest(LMStudioKnobs, CompletionRequest):
    pass


# -- native -----------------------------------------------------------------------------------
class GenerateRequest(BaseModel):
    """POST /generate: every looped-model knob, no OpenAI wrapping. Unknown fields are refused (422)."""

    model_config = ConfigDict(extra="forbid")
    MODE: ClassVar[str] = "generate"

    prompt: str | list[int]
    max_tokens: int = DEFAULT_MAX_TOKENS
    loops: int | None = None                # None -> the model's default_loops (8 for the shipped model)
    temperature: float = param_default("temperature")
    top_k: int = 50                         # the native API's own defaults (spec)
    top_p: float = 0.9
    repetition_penalty: float = param_default("repetition_penalty")
    presence_penalty: float = param_default("presence_penalty")
    frequency_penalty: float = param_default("frequency_penalty")
    sample_seed: int = 0
    stream: bool = False
    stop: str | list[str] | list[int] | None = None
    cache_window: int = param_default("cache_window")
    timeout_s: float | None = None          # time limit for this request (default: the server's)

    def sampling_params(self) -> SamplingParams:
        check_timeout(self.timeout_s)
        stop: list[str] = []
        stop_ids: list[int] = []
        if isinstance(self.stop, str):
            stop = [self.stop]
        elif self.stop:
            if isinstance(self.stop[0], int):
                stop_ids = list(self.stop)
            else:
                stop = list(self.stop)
        return SamplingParams(
            max_tokens=self.max_tokens, loops=self.loops, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=_seed(self.sample_seed, "sample_seed"), stop=stop,
            stop_token_ids=stop_ids, cache_window=self.cache_window, mode=self.MODE, **self.speculative_params())

    def speculative_params(self) -> dict[str, Any]:
        return {}


class SpeculativeRequest(GenerateRequest):
    MODE: ClassVar[str] = "speculative"
    draft_loops: int = param_default("draft_loops")
    verify_loops: int | None = None          # None -> loops, else the model's default_loops
    draft_ahead: int = param_default("draft_ahead")

    def speculative_params(self) -> dict[str, Any]:
        return {"draft_loops": self.draft_loops, "verify_loops": self.verify_loops,
                "draft_ahead": self.draft_ahead}


class TreeSpeculativeRequest(SpeculativeRequest):
    MODE: ClassVar[str] = "tree_speculative"
    K_branches: int = param_default("k_branches")

    def speculative_params(self) -> dict[str, Any]:
        return {**super().speculative_params(), "k_branches": self.K_branches}


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    messages: list[ChatMessage] | None = None
    model: str | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: list[int] = Field(...)
    model: str | None = None
