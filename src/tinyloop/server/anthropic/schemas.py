"""Request bodies of Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): Anthropic's
field names, types and block shapes, plus TinyLoop's knobs as extra fields (server/anthropic/routes.py translates a
request onto the chat route's; docs/server.md, "Anthropic Messages API").

Types are strict, as on the OpenAI routes; unknown fields are refused (Anthropic's API refuses them too),
and a malformed body is a 400 `invalid_request_error` naming the field. Ranges are the engine's, checked
where the chat route checks them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ...engine.knobs import Int, LoopKnobs, rng

CLOSED = ConfigDict(strict=True, extra="forbid")
CacheControl = dict[str, Any] | None   # {"type": "ephemeral", "ttl": ...}: accepted; the prefix cache is automatic


class Closed(BaseModel):
    model_config = CLOSED


# -- content blocks --------------------------------------------------------------------------------------------
class TextBlock(Closed):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: list[dict[str, Any]] | None = Field(None, description="accepted on earlier turns; not shown to the "
                                                                     "model")


class ImageBlock(BaseModel):
    """Parsed so that the refusal names the block (the models served read text only)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["image"]


class DocumentBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["document"]


class ToolUseBlock(Closed):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


ToolResultPart = Annotated[Union[TextBlock, ImageBlock, DocumentBlock], Field(discriminator="type")]


class ToolResultBlock(Closed):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ToolResultPart] | None = None
    is_error: bool | None = None
    cache_control: CacheControl = None
    toolset_name: str | None = None


class ThinkingBlock(Closed):
    """An earlier turn's thinking: accepted in assistant messages; not shown to the model (as Anthropic's
    API drops earlier turns' thinking from the context)."""
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Closed):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[Union[TextBlock, ImageBlock, DocumentBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                        RedactedThinkingBlock], Field(discriminator="type")]


class Message(Closed):
    role: Literal["user", "assistant", "system"] = Field(description='"system": an instruction between turns '
                                                                     "(Claude Code's mid-conversation system messages)")
    content: str | list[Block]


class ContextEdit(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str


class ContextManagement(Closed):
    """Server-side context edits: only clearing earlier turns' thinking, which the model never sees here."""
    edits: list[ContextEdit] | None = None


# -- tools ----------------------------------------------------------------------------------------------------
class ToolDef(Closed):
    """A client tool (Anthropic's server tools, with their own `type`, are not served)."""
    type: Literal["custom"] | None = None
    name: str = Field(pattern="^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="a JSON schema of the tool's input (an object)")
    cache_control: CacheControl = None
    strict: bool | None = Field(None, description="accepted: the input is always held to input_schema")


class ToolChoiceAuto(Closed):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(Closed):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(Closed):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Closed):
    type: Literal["none"]


ToolChoice = Annotated[Union[ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone],
                       Field(discriminator="type")]


# -- the rest -------------------------------------------------------------------------------------------------
class ThinkingEnabled(Closed):
    type: Literal["enabled"]
    budget_tokens: Int
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(Closed):
    type: Literal["disabled"]


class ThinkingAdaptive(Closed):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


Thinking = Annotated[Union[ThinkingEnabled, ThinkingDisabled, ThinkingAdaptive], Field(discriminator="type")]


class JSONOutputFormat(Closed):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class OutputConfig(Closed):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="chat's reasoning_effort (max: its xhigh): the depth on a model that declares the depths it "
                          "was trained at, and a thinking budget where `thinking` sets none (docs/server.md)")
    format: JSONOutputFormat | None = Field(None, description="the answer is JSON held to this schema token by "
                                                              "token (docs/structured.md)")


class Metadata(Closed):
    user_id: str | None = None


class CountTokensRequest(Closed):
    """`POST /v1/messages/count_tokens`: the prompt of the same request to /v1/messages, counted."""
    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl = None
    context_management: ContextManagement | None = None


class MessagesRequest(LoopKnobs, CountTokensRequest):
    """`POST /v1/messages`: Anthropic's fields, and TinyLoop's knobs (the chat route's extensions) as extras."""
    model_config = CLOSED

    max_tokens: Int = rng(..., lo=1, hi_limit="max_tokens")   # required, as in Anthropic's API
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = rng(lo=0, hi=2)
    top_p: float | None = rng(gt=0, hi=1)
    top_k: Int | None = rng(lo=0, hi=1000)
    metadata: Metadata | None = Field(None, description="accepted; no effect")
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="accepted; no effect")
    # sampling fields the chat route takes too (TinyLoop's depth and speculative knobs: LoopKnobs)
    seed: Int | None = None
    presence_penalty: float | None = rng(lo=-2, hi=2)
    frequency_penalty: float | None = rng(lo=-2, hi=2)

    def knobs(self) -> dict[str, Any]:
        """TinyLoop's fields that were given (LoopKnobs, and the sampling extras the chat route takes too), by
        their chat-route names."""
        names = [*LoopKnobs.model_fields, "seed", "presence_penalty", "frequency_penalty"]
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}
