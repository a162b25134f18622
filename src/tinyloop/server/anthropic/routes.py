"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens` (docs/server.md,
"Anthropic Messages API").

A thin translation onto the chat route: a request becomes the `ChatCompletionRequest` it means (system
prompt, turns, tool calls and tool results as the chat route's messages; `tools`, `tool_choice`,
`stop_sequences`, `output_config.format` as its `tools`, `tool_choice`, `stop`, `response_format`), and goes
through the same request plan, chat template, tool prompt, constraint and engine core (openai.chat_inputs,
ServerState.submit). What comes back is read by the same tool-call parser as the chat route's answers
(server/tool_stream.py), and its deltas become Anthropic's content blocks: text, and `tool_use` blocks whose
input is held to the tool's `input_schema` token by token. A streamed answer is the same blocks as events
(`message_start`, `content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`; `ping` while
the engine is busy), so it adds up to the non-streamed answer by construction.

Errors under /v1/messages take Anthropic's shape, `{"type": "error", "error": {"type", "message"},
"request_id"}`, a malformed body included (400, naming the field: errors.register_shape).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import anyio
from fastapi import APIRouter, Request

from ...engine.thinking import MAX_THINKING_TOKENS, resolve
from ...errors import ValidationError
from ..errors import APIError, register_shape, request_id_var
from ..fields import field_error
from ..generation import collect, now, stream
from .schemas import (CountTokensRequest, DocumentBlock, ImageBlock, MessagesRequest,
                                RedactedThinkingBlock, TextBlock, ThinkingBlock, ToolChoiceAny, ToolChoiceAuto,
                                ToolChoiceNone, ToolChoiceTool, ToolResultBlock, ToolUseBlock)
from .schemas import ThinkingAdaptive, ThinkingDisabled
from ..generation import state_of
from ..openai.routes import chat_inputs, messages_error
from ..reasoning import Answer
from ..openai.schemas import ChatCompletionRequest
from ..sse import NamedEventFramer, deltas_of

router = APIRouter()
PREFIX = "/v1/messages"
TEXT_JOIN = "\n\n"   # between the text blocks of one turn (and of `system`)


# -- errors in Anthropic's shape ---------------------------------------------------------------------------------
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 409: "conflict_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 504: "timeout_error",
               529: "overloaded_error"}
# the chat route's names for what Anthropic's request calls otherwise
PARAM_NAMES = {"stop": "stop_sequences", "response_format": "output_config.format", "max_completion_tokens": "max_tokens",
               "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}
def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


class AnthropicErrors:
    """errors.ErrorShape of the Messages API: a malformed body is a 400 there (Anthropic answers no 422)."""

    @staticmethod
    def status(err: APIError) -> int:
        return 400 if err.status == 422 else err.status

    @staticmethod
    def body(err: APIError) -> dict[str, Any]:
        return {"type": "error", "error": {"type": error_type(AnthropicErrors.status(err)), "message": err.message},
                "request_id": request_id_var.get()}

    @staticmethod
    def from_pydantic(errors: list[dict[str, Any]]) -> APIError:
        param, message = field_error(errors)
        return APIError(400, message, param=param, code=None if param is None else "invalid_request_error")


register_shape(PREFIX, AnthropicErrors)


def renamed(exc: ValidationError) -> ValidationError:
    """An error of the chat route's checks, naming Anthropic's field."""
    exc = messages_error(exc)
    name = PARAM_NAMES.get(exc.param or "")
    if name is None:
        return exc
    message = name + exc.message.removeprefix(exc.param) if exc.message.startswith(exc.param) else exc.message
    return ValidationError(message, param=name, code=exc.code)


# -- the request, as the chat route's -------------------------------------------------------------------------------
def _invalid(param: str, message: str) -> ValidationError:
    return ValidationError(f"{param}: {message}", param=param)


def _text_of(content: str | list | None, where: str) -> str:
    """The text of `system` or a tool result: a string, or text blocks (images refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for k, block in enumerate(content):
        if isinstance(block, (ImageBlock, DocumentBlock)):
            raise _invalid(f"{where}[{k}]", f"{block.type} blocks are not supported: the models this server "
                                            "serves read text only")
        parts.append(block.text)
    return TEXT_JOIN.join(parts)


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic's `system` and turns as the chat route's messages: consecutive turns of one role are one turn
    (as Anthropic's API combines them), tool results become `tool` messages answering their calls, an
    assistant's tool_use blocks its `tool_calls`; earlier turns' thinking is left out."""
    if not body.messages:
        raise _invalid("messages", "at least one message is required")
    last = len(body.messages) - 1
    if body.messages[last].role == "assistant":
        raise _invalid(f"messages[{last}]", "the last message is an assistant turn (a prefill), which this server "
                                            "does not continue: end with a user turn")
    out: list[dict[str, Any]] = []
    system = _text_of(body.system, "system")
    if system:
        out.append({"role": "system", "content": system})
    calls: set[str] = set()   # tool_use ids of earlier assistant turns
    turn_role, texts = None, []

    def flush() -> None:
        nonlocal texts
        if turn_role == "user" and texts:
            out.append({"role": "user", "content": TEXT_JOIN.join(texts)})
        texts = []

    for i, m in enumerate(body.messages):
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role != turn_role:
            flush()
            turn_role = m.role
            if m.role == "assistant":
                out.append({"role": "assistant", "content": "", "tool_calls": []})
        if m.role == "system":   # an instruction between turns: a system message where it stands
            bad = next((j for j, b in enumerate(blocks) if not isinstance(b, TextBlock)), None)
            if bad is not None:
                raise _invalid(f"messages[{i}].content[{bad}].type", "a system message holds text blocks only")
            out.append({"role": "system", "content": TEXT_JOIN.join(b.text for b in blocks)})
            continue
        for j, b in enumerate(blocks):
            where = f"messages[{i}].content[{j}]"
            if isinstance(b, (ImageBlock, DocumentBlock)):
                raise _invalid(where, f"{b.type} blocks are not supported: the models this server serves read "
                                      "text only")
            if m.role == "user":
                if isinstance(b, ToolResultBlock):
                    if b.tool_use_id not in calls:
                        raise _invalid(f"{where}.tool_use_id", f"no earlier tool_use block has the id {b.tool_use_id!r}")
                    flush()
                    text = _text_of(b.content, f"{where}.content")
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": f"Error: {text}" if b.is_error else text})
                elif isinstance(b, TextBlock):
                    texts.append(b.text)
                else:
                    raise _invalid(f"{where}.type", f"{b.type} blocks belong to assistant turns")
                continue
            turn = out[-1]
            if isinstance(b, TextBlock):
                turn["content"] = TEXT_JOIN.join(t for t in (turn["content"], b.text) if t)
            elif isinstance(b, ToolUseBlock):
                if b.id in calls:
                    raise _invalid(f"{where}.id", f"tool_use ids must be unique; {b.id!r} was used before")
                calls.add(b.id)
                turn["tool_calls"].append({"id": b.id, "type": "function", "function": {
                    "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
            elif not isinstance(b, (ThinkingBlock, RedactedThinkingBlock)):
                raise _invalid(f"{where}.type", f"{b.type} blocks belong to user turns")
    flush()
    for m in out:
        if m.get("tool_calls") == []:
            del m["tool_calls"]
    return out


def chat_tools(body: CountTokensRequest) -> dict[str, Any]:
    """`tools` and `tool_choice` as the chat route's."""
    out: dict[str, Any] = {}
    if body.tools is not None:
        for i, t in enumerate(body.tools):
            if t.input_schema.get("type") != "object":
                raise _invalid(f"tools[{i}].input_schema.type", 'must be "object" (the schema of the tool\'s input)')
        out["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description is not None else {}),
            "parameters": t.input_schema}} for t in body.tools]
    choice = body.tool_choice
    if choice is None:
        return out
    if isinstance(choice, ToolChoiceNone):
        out["tool_choice"] = "none"
    elif isinstance(choice, ToolChoiceAuto):
        out["tool_choice"] = "auto"
    elif isinstance(choice, ToolChoiceAny):
        out["tool_choice"] = "required"
    elif isinstance(choice, ToolChoiceTool):
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    if getattr(choice, "disable_parallel_tool_use", None):
        out["parallel_tool_calls"] = False
    return out


CLEARS_THINKING = "clear_thinking_"   # context edits that change nothing here: earlier thinking is never shown


def check_context_edits(body: CountTokensRequest) -> None:
    edits = body.context_management.edits if body.context_management is not None else None
    for i, edit in enumerate(edits or []):
        if not edit.type.startswith(CLEARS_THINKING):
            raise _invalid(f"context_management.edits[{i}].type", f"{edit.type!r} is not supported: this server "
                           f"edits no context (earlier turns' thinking, which {CLEARS_THINKING}* edits clear, is "
                           "never shown to the model)")


def to_chat(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request an Anthropic request means (count_tokens: the same prompt, max_tokens 1)."""
    check_context_edits(body)
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body), **chat_tools(body)}
    if body.output_config is not None and body.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": body.output_config.format.schema_}}
    effort = body.output_config.effort if body.output_config is not None else None
    if effort is not None:   # chat's reasoning_effort (its deepest value, "xhigh", for Anthropic's "max")
        fields["reasoning_effort"] = "xhigh" if effort == "max" else effort
    if isinstance(body.thinking, ThinkingDisabled):   # the template's switch (enable_thinking)
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                      stop=body.stop_sequences, stream=body.stream, **body.knobs())
    else:
        fields["max_tokens"] = 1
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


async def plan(request: Request, body: CountTokensRequest):
    """(state, the chat request, its prompt, sampling params and tool plan), every check made, in Anthropic's
    names."""
    state = await state_of(request).model(body.model, getattr(body, "timeout_s", None), getattr(body, "keep_alive", None))
    try:
        chat = to_chat(body)
        params = chat.sampling_params(state.settings.temperature)
        engine = state.worker.require_engine()
        prompt, params, tools = chat_inputs(engine, chat, params, reasoning=state.settings.reasoning_parser)
        params = thinking_of(body, engine, params)
    except ValidationError as exc:
        raise renamed(exc) from None
    return state, chat, prompt, params, tools


def thinking_of(body: CountTokensRequest, engine, params):
    """`thinking`: enabled -> its budget_tokens as the thinking budget, disabled -> no thinking (the template's
    enable_thinking false, and a budget of 0 in case the template has no such switch); no effect on a model
    that does not think."""
    th = body.thinking
    if th is None or isinstance(th, ThinkingAdaptive) or resolve(params.thinking, engine.tokenizer) is None:
        return params
    if isinstance(th, ThinkingDisabled):
        return params.replace(max_thinking_tokens=0)
    if not 0 <= th.budget_tokens <= MAX_THINKING_TOKENS:
        raise _invalid("thinking.budget_tokens", f"must be in 0..{MAX_THINKING_TOKENS}, got {th.budget_tokens}")
    return params.replace(max_thinking_tokens=th.budget_tokens)


# -- the answer as content blocks ----------------------------------------------------------------------------------
def new_message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class Blocks:
    """The chat route's deltas (`{"content": ...}`, tool call deltas: server/tool_stream.py) -> Anthropic's
    content block events, `(event name, data)`; `content` puts the events together (the non-streamed answer)."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None   # the type of the block being written
        self.calls: dict[int, int] = {}   # the chat route's call index -> block index
        self.content: list[dict[str, Any]] = []
        self._json: dict[int, str] = {}   # tool_use block index -> its input's JSON text so far

    def _start(self, block: dict[str, Any]) -> list[tuple[str, dict]]:
        out = self.close()
        self.index += 1
        self.open = block["type"]
        self.content.append(json.loads(json.dumps(block)))
        return out + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block})]

    def close(self) -> list[tuple[str, dict]]:
        """The open block's end, if one is open."""
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def feed(self, delta: dict[str, Any]) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        thought = delta.get("reasoning_content")
        if thought:   # a model that thinks: its block (server/reasoning.py) as a thinking block
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            self.content[self.index]["thinking"] += thought
            out.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                "delta": {"type": "thinking_delta", "thinking": thought}}))
        text = delta.get("content")
        if text:
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            self.content[self.index]["text"] += text
            out.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                "delta": {"type": "text_delta", "text": text}}))
        for call in delta.get("tool_calls") or []:
            if "id" in call:
                out += self._start({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                                    "input": {}})
                self.calls[call["index"]] = self.index
                self._json[self.index] = ""
            fragment = call["function"].get("arguments")
            if fragment:
                at = self.calls[call["index"]]
                self._json[at] += fragment
                out.append(("content_block_delta", {"type": "content_block_delta", "index": at,
                                                    "delta": {"type": "input_json_delta", "partial_json": fragment}}))
        return out

    def blocks(self) -> list[dict[str, Any]]:
        """The content: tool_use inputs parsed (as far as they got, when max_tokens cut one short)."""
        for at, text in self._json.items():
            self.content[at]["input"] = partial_object(text)
        return self.content

    @property
    def called(self) -> bool:
        return bool(self.calls)


def partial_object(text: str) -> dict[str, Any]:
    """A tool's input from its JSON text; text cut short (max_tokens) is read as far as it is complete, as
    Anthropic's SDKs read a streamed input (a string cut short keeps what it has)."""
    try:
        value = json.loads(text) if text else {}
        return value if isinstance(value, dict) else {}
    except ValueError:
        pass
    stack, in_string, escaped, cuts = [], False, False, []
    for p, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
            continue
        if c == '"':
            in_string = True
        elif c in "{[":
            stack.append("}" if c == "{" else "]")
            cuts.append((p + 1, list(stack), False))
        elif c in "}]" and stack:
            stack.pop()
        elif c == ",":
            cuts.append((p, list(stack), False))
    candidates = [(len(text), stack, in_string)] + cuts[::-1]
    for cut, open_, quoted in candidates:
        head = text[:cut]
        if quoted and escaped:
            head = head[:-1]
        try:
            value = json.loads(head + ('"' if quoted else "") + "".join(reversed(open_)))
        except ValueError:
            continue
        return value if isinstance(value, dict) else {}
    return {}


def stop_reason(finish_reason: str, stop_sequence: str | None, called: bool, context_bound: bool = False) -> str:
    """`context_bound`: max_tokens was lowered to the room the context leaves, so running out of it is
    running out of context."""
    if finish_reason == "length":
        return "model_context_window_exceeded" if context_bound else "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def usage(stats: dict[str, Any]) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt tokens not read from the (prefix) cache."""
    cached = stats.get("prompt_tokens_cached", 0)
    return {"input_tokens": stats.get("prompt_tokens", 0) - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": stats.get("completion_tokens", 0)}


class MessagesFramer(NamedEventFramer):
    """Anthropic's stream: `event: <type>` and `data: <json>` per event; `ping` while the engine is busy."""

    keepalive = b'event: ping\ndata: {"type": "ping"}\n\n'

    def __init__(self, *, id: str, model: str, tools, n_prompt: int, context_bound: bool = False):
        super().__init__(id=id, created=now(), model=model)
        self.tools, self.n_prompt, self.context_bound = tools, n_prompt, context_bound
        self.parser = tools.parser() if tools is not None else None
        self.blocks = Blocks()

    def open(self) -> list[bytes]:
        message = {"id": self.id, "type": "message", "role": "assistant", "content": [], "model": self.model,
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.n_prompt, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 0, "output_tokens": 0}}
        return [self.sse("message_start", {"type": "message_start", "message": message})]

    def feed(self, delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        return self.blocks.feed(delta)

    def close(self, ev) -> list[bytes]:
        self.closed[ev.index] = ev.stats or {}
        out = self._frames(ev, final=True) + [self.sse(n, d) for n, d in self.blocks.close()]
        delta = {"stop_reason": stop_reason(ev.finish_reason, ev.stop_sequence, self.blocks.called, self.context_bound),
                 "stop_sequence": ev.stop_sequence}
        last = {"type": "message_delta", "delta": delta, "usage": usage(ev.stats or {})}
        if (ev.stats or {}).get("schema_check"):   # a schema checked after generation (docs/structured.md)
            last["schema_check"] = ev.stats["schema_check"]
        out.append(self.sse("message_delta", last))
        out.append(self.sse("message_stop", {"type": "message_stop"}))
        return out

    def fail(self, err: APIError) -> list[bytes]:
        return [self.sse("error", AnthropicErrors.body(err))]


def message_of(body: MessagesRequest, tools, result, context_bound: bool = False) -> dict[str, Any]:
    """The non-streamed answer: the same deltas, the same blocks, as a stream of it would carry."""
    blocks = Blocks()
    parser = tools.parser() if tools is not None else None
    for d in deltas_of(tools, parser, result.text, final=True):
        blocks.feed(d)
    return {"id": new_message_id(), "type": "message", "role": "assistant", "content": blocks.blocks(),
            "model": body.model,
            "stop_reason": stop_reason(result.finish_reason, result.stop_sequence, blocks.called, context_bound),
            "stop_sequence": result.stop_sequence, "usage": usage(result.stats)}


# -- the routes ------------------------------------------------------------------------------------------------------
@router.post(PREFIX, include_in_schema=False)
async def create_message(body: MessagesRequest, request: Request):
    """max_tokens is a ceiling: past the server's TINYLOOP_MAX_TOKENS it is refused (as Anthropic refuses one
    past a model's output limit); past the room the prompt leaves in the context it is lowered to that room,
    and an answer that fills it ends with stop_reason "model_context_window_exceeded" (as Anthropic's API
    answers for its newer models)."""
    state, chat, prompt, params, tools = await plan(request, body)
    engine = state.worker.require_engine()
    limit = state.settings.max_tokens
    try:
        if params.max_tokens > limit:
            raise ValidationError(f"max_tokens: {params.max_tokens} > {limit}, the most this server generates "
                                  "(TINYLOOP_MAX_TOKENS)", param="max_tokens")
        ids = await anyio.to_thread.run_sync(engine.encode_prompt, prompt)
        room = engine.max_seq_len - len(ids)
        context_bound = 0 < room < params.max_tokens
        if context_bound:
            params = params.replace(max_tokens=room)
        handle = await state.submit(ids, params, n=1, timeout_s=body.timeout_s, max_tokens_given=True)
    except ValidationError as exc:
        raise renamed(exc) from None
    # the answer as the chat route reads it: thinking apart, tool calls (server/reasoning.py)
    answer = Answer(tools, handle.plan.thinking) if tools is not None or handle.plan.thinking is not None else None
    if body.stream:
        framer = MessagesFramer(id=new_message_id(), model=body.model, tools=answer, n_prompt=handle.plan.n_prompt,
                                context_bound=context_bound)
        return await stream(handle, framer, state.settings.keepalive_s)
    (result,) = await collect(handle, request)
    return message_of(body, answer, result, context_bound)


@router.post(PREFIX + "/count_tokens", include_in_schema=False)
async def count_tokens(body: CountTokensRequest, request: Request):
    """The prompt tokens /v1/messages would prefill for this request (chat template and tool prompt included)."""
    state, _, prompt, _, _ = await plan(request, body)
    engine = state.worker.require_engine()
    try:
        ids = await anyio.to_thread.run_sync(engine.encode_prompt, prompt)
    except ValidationError as exc:
        raise renamed(exc) from None
    return {"input_tokens": len(ids)}

