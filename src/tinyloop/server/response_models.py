"""Response bodies, as the OpenAPI document describes them (documentation only: routes build plain dicts).

The schema fuzzer checks every response the server sends against these (tests/server/test_fuzz.py), so
they say exactly what comes back: required keys, and no others where the shape is fixed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

FinishReason = Literal["stop", "length", "tool_calls"]  # tool_calls: chat with tools only


class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(Closed):
    message: str
    type: str
    param: str | None
    code: str | None
    request_id: str | None = None


class ErrorResponse(Closed):
    """Every error: OpenAI's shape, plus the request id."""
    error: ErrorDetail


class PromptTokensDetails(Closed):
    cached_tokens: int               # prompt tokens whose KV came from the prefix cache


class CompletionTokensDetails(Closed):
    reasoning_tokens: int            # a thinking model's thinking block, its tags included (0 without one)


class Usage(Closed):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class Stats(Open):
    """What the engine measured; the speculative modes add their own counters."""
    wall_ms: float
    tokens_per_second: float
    prompt_tokens: int
    prompt_tokens_cached: int        # of prompt_tokens, served from the prefix cache
    completion_tokens: int
    mode: Literal["generate", "speculative", "tree_speculative"]
    loops_used: int | float          # the mean over generated tokens (adaptive depth: loops "auto")
    loops_histogram: dict[str, int]  # core loops -> generated tokens that ran that many
    schema_check: str | None = None  # "passed" / "failed: why": an answer checked against its schema (structured.md)


class Runtime(Closed):
    name: Literal["tinyloop"]
    version: str
    commit: str | None


class ModelInfo(Open):
    arch: str
    dim: int
    n_heads: int
    vocab_size: int
    default_loops: int
    quant: str
    kv_cache_mode: str
    trained_loops: list[int] | None = None   # the depths the model was trained at (ModelCard's)


class FunctionCall(Closed):
    name: str
    arguments: str                       # a JSON string


class ToolCallOut(Closed):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(Closed):
    role: Literal["assistant"]
    content: str | None                  # null when the answer is tool calls
    refusal: None                        # OpenAI's schema requires it: always null here
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # a model that thinks: its thinking block (docs/server.md, "Reasoning")
    reasoning: str | None = None          # the same, under vLLM's newer name


class FunctionCallDelta(Closed):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Closed):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class TopLogprob(Closed):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Closed):
    content: list[TokenLogprob]
    refusal: None                        # OpenAI's schema requires it: always null here


class TextLogprobs(Closed):
    """With echo the prompt's tokens come first; the first prompt token has null for both."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class _Choice(Closed):
    """What a choice of either route carries besides its text."""
    index: int
    finish_reason: FinishReason
    schema_check: str | None = None     # "passed" / "failed: why": a schema held in part (structured.md)


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None        # null unless logprobs: true


class TextChoice(_Choice):
    text: str
    logprobs: TextLogprobs | None        # null unless logprobs: k


class ChatCompletion(Closed):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    loops_used: int | float              # TinyLoop: mean core loops over the generated tokens (loops "auto": each its own)
    loops_histogram: dict[str, int]      # TinyLoop: core loops -> generated tokens that ran that many


class Completion(Closed):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage
    loops_used: int | float              # TinyLoop: mean core loops over the generated tokens (loops "auto": each its own)
    loops_histogram: dict[str, int]      # TinyLoop: core loops -> generated tokens that ran that many


class LMStudioExtras(BaseModel):
    stats: Stats
    model_info: ModelInfo
    runtime: Runtime


class LMStudioChatCompletion(LMStudioExtras, ChatCompletion):
    pass


class LMStudioCompletion(LMStudioExtras, Completion):
    pass


class IdLogprob(Closed):
    token_id: int
    logprob: float


class NativeLogprob(Closed):
    logprob: float
    top_logprobs: list[IdLogprob]


class GenerateResponse(Closed):
    tokens: list[int]
    text: str
    finish_reason: FinishReason
    stats: Stats
    logprobs: list[NativeLogprob] | None = None   # with logprobs: k, one per token in `tokens`
    prompt_logprobs: list[NativeLogprob | None] | None = None  # with prompt_logprobs: k, per prompt token (first null)


class ModelCard(Closed):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    default_loops: int                   # TinyLoop: the depth of a request that names none
    max_loops: int                       # TinyLoop: loops may be any of 1..max_loops
    trained_loops: list[int] | None      # TinyLoop: [shallowest, deepest] trained depth (reasoning_effort's range)


class ModelList(Closed):
    object: Literal["list"]
    data: list[ModelCard]


class LMStudioModel(Closed):
    id: str
    object: Literal["model"]
    type: Literal["llm"]
    publisher: str
    arch: str
    compatibility_type: str
    quantization: str
    state: Literal["loaded"]
    max_context_length: int
    model_info: ModelInfo
    runtime: Runtime


class LMStudioModelList(Closed):
    object: Literal["list"]
    data: list[LMStudioModel]


class TokenizeResponse(Closed):
    tokens: list[int]
    count: int
    max_seq_len: int


class DetokenizeResponse(Closed):
    text: str
    prompt: str                          # the same text under vLLM's name (lm-eval's remote tokenizer reads it)


class TokenizerInfo(Closed):
    """vLLM's /tokenizer_info: what lm-eval's remote tokenizer backend asks for (docs/evaluation.md)."""
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None            # the model's own Jinja template (imported checkpoints), else null
    model_max_length: int
    vocab_size: int


class HealthOK(Closed):
    status: Literal["ok"]
    model: str                           # the model file's path
    model_id: str                        # its id in the API (the first served name)
    version: str
    commit: str | None
    kv_cache_mode: str
    kv_cache_mode_requested: str
    warnings: list[str]
    max_seq_len: int
    executor: str                        # who runs decode steps: "native (isa, threads)" or "torch"
    queue_depth: int


class HealthDown(Closed):
    status: Literal["loading", "failed"]
    reason: str | None
    model: str
    model_id: str
    version: str
    commit: str | None
    kv_cache_mode: str
    warnings: list[str]
    error: ErrorDetail


class ChatDelta(Closed):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None   # with tools: id and name first, then the arguments in fragments
    reasoning_content: str | None = None   # a model that thinks: its thinking block's text, as it comes
    reasoning: str | None = None           # the same, under vLLM's newer name


class _ChunkChoice(_Choice):
    """What a streamed choice of either route carries besides its text."""
    finish_reason: FinishReason | None   # null until the choice's last chunk
    loops: list[int] | None = None      # loops "auto": the depth of each token this chunk accounts for


class ChatChunkChoice(_ChunkChoice):
    delta: ChatDelta
    logprobs: ChatLogprobs | None        # null unless logprobs: true


class TextChunkChoice(_ChunkChoice):
    text: str
    logprobs: TextLogprobs | None        # null unless logprobs: k


class _Chunk(Closed):
    id: str
    created: int
    model: str
    usage: Usage | None = None          # include_usage: chat chunks null, then the usage chunk; text: only that one
    stats: Stats | None = None          # /api/v0: on the chunk that carries finish_reason
    model_info: ModelInfo | None = None
    runtime: Runtime | None = None


class ChatChunk(_Chunk):
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]


class TextChunk(_Chunk):
    object: Literal["text_completion"]
    choices: list[TextChunkChoice]


class NativeEvent(Closed):
    token_id: int                        # -1 on the final event
    text: str
    finish_reason: FinishReason | None = None
    stats: Stats | None = None
    logprob: float | None = None         # with logprobs: k
    top_logprobs: list[IdLogprob] | None = None
    prompt_logprobs: list[NativeLogprob | None] | None = None  # with prompt_logprobs: on the first event
    loops: int | None = None             # loops "auto": the core loops this token ran


def sse_event_schema(ref: str, what: str) -> dict[str, Any]:
    """One SSE event: `data` is `[DONE]` or JSON, either an event of the route (`ref`) or an error."""
    return {"type": "object", "required": ["data"], "description": f"{what}. {SSE_DOC}",
            "properties": {"event": {"const": "message"}, "data": {
                "type": "string", "if": {"const": "[DONE]"},
                "else": {"contentMediaType": "application/json", "contentSchema": {"anyOf": [
                    {"$ref": f"#/components/schemas/{ref}"}, {"$ref": "#/components/schemas/ErrorResponse"}]}}}}}


SSE_DOC = ("Server-sent events (with `stream: true`): one `data: <json>` line and a blank line per event, "
           "`: keepalive` comments while the engine is busy, `data: [DONE]` last; an error after the stream "
           "started is a `data: {\"error\": {...}}` event before `[DONE]`.")


