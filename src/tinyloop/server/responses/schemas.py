"""Request bodies of OpenAI's Responses API (`POST /v1/responses`): OpenAI's field names, item and part
shapes, plus TinyLoop's knobs as extra fields (server/responses/routes.py translates a request onto the chat
route's; docs/server.md, "OpenAI Responses API").

Not to be confused with server/response_models.py, the response bodies of the other routes as the OpenAPI document
describes them.

Types are strict, as on the other routes; unknown fields are refused (OpenAI's API refuses them too) with a
400 naming the field (`unknown_parameter`), and so is a malformed body (no 422 here). Input items and tools of
a type this server does not serve parse (`OtherItem`, `OtherTool`) so that the refusal names the item and its
type. Ranges are the engine's, checked where the chat route checks them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from ...engine.knobs import Int, LoopKnobs, rng

CLOSED = ConfigDict(strict=True, extra="forbid")
OPEN = ConfigDict(strict=True, extra="allow")
Status = Literal["in_progress", "completed", "incomplete"]


class Closed(BaseModel):
    model_config = CLOSED


def _tagged(default: str | None, known: tuple[str, ...]):
    """A discriminator on `type` (`default` when it is left out), `other` for a type not in `known`."""
    def tag(value: Any) -> str:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)
        return kind if kind in known else "other"
    return Discriminator(tag)


# -- content parts ---------------------------------------------------------------------------------------------
class InputText(Closed):
    type: Literal["input_text"]
    text: str


class OutputText(Closed):
    """An earlier answer's text (as a response's output gave it)."""
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class Refusal(Closed):
    type: Literal["refusal"]
    refusal: str


class OtherPart(BaseModel):
    """input_image, input_file, input_audio, ...: parsed so that the refusal names the part."""
    model_config = OPEN
    type: str


TEXT_PARTS = ("input_text", "output_text", "refusal")
Part = Annotated[Union[Annotated[InputText, Tag("input_text")], Annotated[OutputText, Tag("output_text")],
                       Annotated[Refusal, Tag("refusal")], Annotated[OtherPart, Tag("other")]],
                 _tagged(None, TEXT_PARTS)]


# -- input items -----------------------------------------------------------------------------------------------
class MessageItem(Closed):
    """A message: `{"role", "content"}` (OpenAI's easy input message; `type` may be left out), or an earlier
    output message (`id`, `status`)."""
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: str | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Closed):
    """An earlier answer's tool call."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="the arguments as a JSON string, as the output gave them")
    namespace: str | None = None
    id: str | None = None
    status: Status | None = None


class FunctionCallOutputItem(Closed):
    """A tool call's result: `call_id` names the call (an earlier function_call item)."""
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]
    id: str | None = None
    status: Status | None = None


class ReasoningItem(BaseModel):
    """An earlier turn's reasoning: accepted, not shown to the model (this server produces none)."""
    model_config = OPEN
    type: Literal["reasoning"]


class ItemReference(Closed):
    """An item of a stored response (its input or output), by id."""
    type: Literal["item_reference"]
    id: str


class OtherItem(BaseModel):
    """web_search_call, computer_call, ...: parsed so that the refusal names the item and its type."""
    model_config = OPEN
    type: str


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning", "item_reference")
InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")], Annotated[ItemReference, Tag("item_reference")],
                            Annotated[OtherItem, Tag("other")]],
                      _tagged("message", ITEM_TYPES)]


# -- tools -----------------------------------------------------------------------------------------------------
class FunctionTool(Closed):
    """Responses' flat shape: name, description, parameters and strict at the top level."""
    type: Literal["function"]
    name: str = Field(pattern="^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments (an object)")
    strict: bool | None = Field(None, description="accepted: the arguments are always held to parameters")


class NamespaceTool(Closed):
    """A group of function tools (Codex's sub-agent tools): offered to the model as function tools; a call of one
    names its namespace (`function_call.namespace`)."""
    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[FunctionTool]


class OtherTool(BaseModel):
    """OpenAI's hosted tools (web_search, file_search, ...: not offered to the model, as no server-side tool runs
    here) and client tools without a function's shape (custom, shell, ...: refused naming the tool)."""
    model_config = OPEN
    type: str


ToolDef = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[NamespaceTool, Tag("namespace")],
                          Annotated[OtherTool, Tag("other")]],
                    _tagged(None, ("function", "namespace"))]


# -- text.format, reasoning ------------------------------------------------------------------------------------
class FormatText(Closed):
    type: Literal["text"]


class FormatJSONObject(Closed):
    type: Literal["json_object"]


class FormatJSONSchema(Closed):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    name: str = Field(pattern="^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] = Field(alias="schema", description="a JSON schema (docs/structured.md: what is "
                                                                "supported; other keywords are a 400 naming them)")
    description: str | None = None
    strict: bool | None = Field(None, description="accepted: the answer is always held to schema")


TextFormat = Annotated[Union[FormatText, FormatJSONObject, FormatJSONSchema], Field(discriminator="type")]


class TextConfig(Closed):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="accepted; no effect")


class Reasoning(Closed):
    """`effort` is chat's reasoning_effort: the depth on a model with a trained range, and a thinking model's
    budget (docs/server.md); the summary fields are accepted, no effect."""
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(Closed):
    include_obfuscation: bool | None = Field(None, description="accepted; no effect (no obfuscation is added)")


# -- the request -----------------------------------------------------------------------------------------------
class ResponsesRequest(LoopKnobs, Closed):
    """`POST /v1/responses`: OpenAI's fields, and TinyLoop's knobs (the chat route's extensions) as extras."""
    model_config = CLOSED

    model: str | None = Field(None, description="one of the server's names (else 404 model_not_found); default "
                                                "the previous response's model, else the server's model id")
    input: str | list[InputItem] | None = None
    instructions: str | None = Field(None, description="a first system message; not carried over by "
                                                       "previous_response_id")
    previous_response_id: str | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = Field(None, description='"auto" (default), "none", "required", '
                                                     '{"type": "function", "name": ...} or {"type": "allowed_tools", '
                                                     '"mode": "auto"|"required", "tools": [{"type": "function", '
                                                     '"name": ...}]}')
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Int | None = rng(lo=1, hi_limit="max_tokens")
    temperature: float | None = rng(lo=0, hi=2)
    top_p: float | None = rng(gt=0, hi=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = Field(None, description="keep the response for GET and previous_response_id (default "
                                                 "true; in memory, the last TINYLOOP_RESPONSES_STORE_SIZE)")
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    top_logprobs: Int | None = rng(lo=0, hi=0, description="0 only: logprobs are not returned here")
    truncation: Literal["auto", "disabled"] | None = Field(None, description="accepted; the input is never "
                                                                             "truncated (over the context: a 400)")
    background: bool | None = Field(None, description="false only")
    max_tool_calls: Int | None = rng(lo=1, description="accepted; no effect (no built-in tools run here)")
    metadata: dict[str, str] | None = Field(None, description="echoed; no effect")
    client_metadata: dict[str, Any] | None = Field(None, description="accepted; no effect (Codex sends it)")
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = Field(None, description="accepted; the prefix cache is automatic")
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: str | None = Field(None, description="accepted; no effect")
    # TinyLoop's knobs and the chat route's extra sampling fields, as the chat route takes them
    top_k: Int | None = rng(lo=0, hi=1000)
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: float | None = rng(lo=-2, hi=2)
    frequency_penalty: float | None = rng(lo=-2, hi=2)

    def knobs(self) -> dict[str, Any]:
        """TinyLoop's fields (and the chat route's sampling extras) that were given, by their chat-route names."""
        names = [*LoopKnobs.model_fields, "top_k", "stop", "seed", "presence_penalty", "frequency_penalty"]
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}
