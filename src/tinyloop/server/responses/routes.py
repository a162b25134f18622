"""OpenAI's Responses API: `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}` and
`GET /v1/responses/{id}/input_items` (docs/server.md, "OpenAI Responses API").

A thin translation onto the chat route, as server/anthropic/routes.py translates Anthropic's Messages: a request
becomes the `ChatCompletionRequest` it means (`instructions` a first system message; the conversation of
`previous_response_id` and the `input` items as the chat route's messages: messages, an earlier answer's
`function_call` items as an assistant's `tool_calls`, `function_call_output` items as `tool` messages; `tools`,
`tool_choice`, `parallel_tool_calls`, `text.format`, `max_output_tokens` as `tools`, `tool_choice`,
`parallel_tool_calls`, `response_format`, `max_tokens`), and goes through the same request plan, chat template,
tool prompt, constraint and engine core (openai.chat_inputs, ServerState.submit). What comes back is read by the
same tool-call parser as the chat route's answers (server/tool_stream.py), and its deltas become Responses'
output items: a `message` with one `output_text` part, and `function_call` items whose arguments are held to
the tool's parameters token by token. A streamed answer is the same items as typed events, each with its
`sequence_number` (`response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta` / `.done`, `response.content_part.done`,
`response.function_call_arguments.delta` / `.done`, `response.output_item.done`, then `response.completed`,
or `response.incomplete` when max_output_tokens cut it short), so it adds up to the non-streamed answer by
construction.

Responses are stored (`store`, default true as OpenAI's) in a bounded in-memory LRU (`ResponseStore`,
TINYLOOP_RESPONSES_STORE_SIZE): what `GET /v1/responses/{id}` returns and what `previous_response_id`
continues (its input and output items; its `instructions` are not carried over, as OpenAI's are not).

Errors take OpenAI's shape, and a malformed body is a 400 naming the field (no 422 here), as OpenAI answers.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
from fastapi import APIRouter, Query, Request

from ...errors import ValidationError
from ..errors import APIError, OpenAIFieldErrors, register_shape
from ..generation import collect, stream as sse_stream
from ..generation import state_of
from ..openai.routes import chat_inputs, messages_error
from ..reasoning import Answer
from .schemas import (TEXT_PARTS, FormatJSONObject, FormatJSONSchema, FunctionCallItem,
                                       FunctionCallOutputItem, FunctionTool, ItemReference, MessageItem,
                                       NamespaceTool, ReasoningItem, ResponsesRequest)
from ..openai.schemas import ChatCompletionRequest
from .output import (ResponsesFramer, ResponseStore, Stored, finished, new_id, output_of,  # noqa: F401
                                      response_object, store_of)

router = APIRouter()
PREFIX = "/v1/responses"


# -- errors: OpenAI's shape, a malformed body a 400 ------------------------------------------------------------
_FORMAT_TAGS = {"text", "json_object", "json_schema"}   # text.format's tagged union puts its tag after "format"


def _untagged(loc) -> tuple:
    return tuple(p for k, p in enumerate(loc) if not (k and loc[k - 1] == "format" and p in _FORMAT_TAGS))


class ResponsesErrors(OpenAIFieldErrors):
    """errors.ErrorShape of the Responses API: OpenAI's error body; a malformed body is a 400 naming the field."""

    TAKES = "OpenAI's Responses fields and TinyLoop's knobs (docs/server.md)"

    @staticmethod
    def locations(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**e, "loc": _untagged(e.get("loc", ()))} for e in errors]


register_shape(PREFIX, ResponsesErrors)

# the chat route's names for what the Responses API calls otherwise
PARAM_NAMES = {"response_format": "text.format", "max_tokens": "max_output_tokens",
               "max_completion_tokens": "max_output_tokens", "messages": "input"}


def renamed(exc: ValidationError) -> ValidationError:
    """An error of the chat route's checks, naming the Responses API's field."""
    exc = messages_error(exc)
    param = exc.param or ""
    name = PARAM_NAMES.get(param) or ("input" if param.startswith("messages[") else None)
    if name is None:
        return exc
    message = name + exc.message.removeprefix(param) if exc.message.startswith(param) else exc.message
    if name == "input":
        message = message.replace("the messages", "the input")
    return ValidationError(message, param=name, code=exc.code)


def _invalid(param: str, message: str, code: str | None = None) -> ValidationError:
    return ValidationError(f"{param}: {message}", param=param, code=code)


def not_found(response_id: str, param: str = "response_id", what: str = "Response") -> APIError:
    code = "previous_response_not_found" if param == "previous_response_id" else "not_found"
    return APIError(404, f"{what} with id {response_id!r} not found (never stored, stored with store: false, or "
                         "evicted: the store keeps the last TINYLOOP_RESPONSES_STORE_SIZE responses)",
                    param=param, code=code)


# -- the input, as items ---------------------------------------------------------------------------------------
def _part_text(part, where: str) -> str:
    if part.type not in TEXT_PARTS:
        raise _invalid(f"{where}.type", f"{part.type!r} parts are not supported: the models this server serves read "
                                        "text only (input_text, output_text)")
    return part.refusal if part.type == "refusal" else part.text


def _parts(content, where: str, kind: str) -> list[dict[str, Any]]:
    """A message's content as parts of `kind` (input_text, or output_text for an assistant's)."""
    if isinstance(content, str):
        texts = [content]
    else:
        texts = [_part_text(p, f"{where}[{k}]") for k, p in enumerate(content)]
    if kind == "output_text":
        return [{"type": "output_text", "text": t, "annotations": [], "logprobs": []} for t in texts]
    return [{"type": "input_text", "text": t} for t in texts]


def input_items(body: ResponsesRequest, store: ResponseStore) -> list[tuple[str, dict[str, Any]]]:
    """The request's `input` as items in OpenAI's full shape (ids given, strings as parts), each with its
    place in the request (`input[3]`) for the errors about it."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [("input", {"type": "message", "id": new_id("msg"), "role": "user", "status": "completed",
                           "content": [{"type": "input_text", "text": body.input}]})]
    out = []
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if isinstance(item, MessageItem):
            kind = "output_text" if item.role == "assistant" else "input_text"
            out.append((where, {"type": "message", "id": item.id or new_id("msg"), "role": item.role,
                                "status": item.status or "completed",
                                "content": _parts(item.content, f"{where}.content", kind)}))
        elif isinstance(item, FunctionCallItem):
            out.append((where, {"type": "function_call", "id": item.id or new_id("fc"), "call_id": item.call_id,
                                "name": item.name, "arguments": item.arguments, "status": item.status or "completed",
                                **({"namespace": item.namespace} if item.namespace is not None else {})}))
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else \
                "".join(_part_text(p, f"{where}.output[{k}]") for k, p in enumerate(item.output))
            out.append((where, {"type": "function_call_output", "id": item.id or new_id("fco"),
                                "call_id": item.call_id, "output": output, "status": item.status or "completed"}))
        elif isinstance(item, ReasoningItem):
            out.append((where, item.model_dump()))
        elif isinstance(item, ItemReference):
            found = store.item(item.id)
            if found is None:
                raise _invalid(f"{where}.id", f"no stored response has an item with the id {item.id!r}")
            out.append((where, found))
        else:
            raise _invalid(f"{where}.type", f"{item.type!r} items are not supported: this server takes message, "
                                            "function_call, function_call_output, reasoning and item_reference items")
    return out


# -- the request, as the chat route's --------------------------------------------------------------------------
def chat_messages(instructions: str | None, items: list[tuple[str | None, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Instructions and items as the chat route's messages: developer messages are system messages, an
    earlier answer's function_call items its `tool_calls` (with the text before them, if any), function_call
    outputs `tool` messages answering their calls; reasoning items are left out. `where` is None for items of
    the previous response's conversation (checked when they were stored)."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    calls: set[str] = set()
    for where, item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": "".join(p["text"] for p in item["content"])})
        elif kind == "function_call":
            if item["call_id"] in calls and where is not None:
                raise _invalid(f"{where}.call_id", f"call ids must be unique; {item['call_id']!r} was used before")
            calls.add(item["call_id"])
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if item["call_id"] not in calls:
                raise _invalid(f"{where}.call_id", f"no earlier function_call item has the call_id {item['call_id']!r}")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    if not out or all(m["role"] == "system" for m in out):
        raise _invalid("input", "give at least one message (or a previous_response_id to continue)",
                       code="missing_required_parameter")
    return out


# tools OpenAI's servers run: not offered to the model (no server-side tool runs here), accepted so that clients
# that send them by default (Codex: web_search) work
HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
                "file_search", "code_interpreter", "image_generation", "mcp", "computer_use_preview", "computer",
                "tool_search")


def function_tools(body: ResponsesRequest) -> list[tuple[FunctionTool, str | None]]:
    """The function tools the model is offered, each with its namespace (None at the top level)."""
    out: list[tuple[FunctionTool, str | None]] = []
    where: dict[str, str] = {}
    for i, t in enumerate(body.tools or []):
        if isinstance(t, FunctionTool):
            found = [(f"tools[{i}]", t, None)]
        elif isinstance(t, NamespaceTool):
            found = [(f"tools[{i}].tools[{j}]", f, t.name) for j, f in enumerate(t.tools)]
        elif t.type in HOSTED_TOOLS:
            continue
        else:
            raise _invalid(f"tools[{i}].type", f"{t.type!r} tools are not served here: this server offers function "
                                               "tools only (and namespaces of them); hosted tools "
                                               f"({', '.join(HOSTED_TOOLS[:2])}, ...) are accepted and not offered")
        for place, f, ns in found:
            if f.name in where:
                raise _invalid(f"{place}.name", f"tool names must be unique; {f.name!r} is {where[f.name]}'s too")
            where[f.name] = place
            out.append((f, ns))
    return out


def chat_tools(body: ResponsesRequest) -> dict[str, Any]:
    """`tools`, `tool_choice` and `parallel_tool_calls` as the chat route's."""
    out: dict[str, Any] = {}
    tools = [f for f, _ in function_tools(body)]
    choice = body.tool_choice
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _invalid("tool_choice", f'must be "auto", "none", "required" or an object, got {choice!r}')
        out["tool_choice"] = choice
    elif isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            extra = set(choice) - {"type", "name"}
            if not isinstance(choice.get("name"), str) or extra:
                raise _invalid("tool_choice", '{"type": "function"} takes "name" (a string) and nothing else')
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif kind == "allowed_tools":
            mode, allowed = choice.get("mode"), choice.get("tools")
            if mode not in ("auto", "required") or not isinstance(allowed, list) \
                    or set(choice) - {"type", "mode", "tools"}:
                raise _invalid("tool_choice", '{"type": "allowed_tools"} takes "mode" ("auto" or "required") and '
                                              '"tools" (a list of {"type": "function", "name": ...})')
            names = {t.name for t in tools}
            keep = set()
            for k, a in enumerate(allowed):
                if not isinstance(a, dict) or a.get("type") != "function" or a.get("name") not in names:
                    raise _invalid(f"tool_choice.tools[{k}]", 'must be {"type": "function", "name": <one of tools>}')
                keep.add(a["name"])
            tools = [t for t in tools if t.name in keep]
            out["tool_choice"] = mode
        else:
            raise _invalid("tool_choice.type", f"{kind!r} is not supported: this server runs function tools only "
                                               '("auto", "none", "required", {"type": "function", "name": ...} or '
                                               '{"type": "allowed_tools", ...})')
    if tools:
        out["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                        for t in tools]
    elif out.get("tool_choice") == "auto":   # no function tools (only hosted ones, or `tools: []` as Codex's
        del out["tool_choice"]                # compaction turn sends): nothing to choose from
    if body.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = body.parallel_tool_calls
    return out


def check_unsupported(body: ResponsesRequest) -> None:
    """Fields OpenAI's API takes that this server does not act on, refused unless at their default."""
    if body.background:
        raise _invalid("background", "background responses are not supported: leave it false",
                       code="unsupported_parameter")
    if body.top_logprobs:
        raise _invalid("top_logprobs", "logprobs are not returned by /v1/responses (use /v1/chat/completions)",
                       code="unsupported_parameter")
    if body.max_tool_calls is not None and body.max_tool_calls < 1:
        raise _invalid("max_tool_calls", f"must be at least 1, got {body.max_tool_calls}")
    for k, value in enumerate(body.include or []):
        if value == "message.output_text.logprobs":
            raise _invalid(f"include[{k}]", "logprobs are not returned by /v1/responses (use /v1/chat/completions)",
                           code="unsupported_parameter")


def to_chat(body: ResponsesRequest, model: str, items: list[tuple[str | None, dict[str, Any]]],
            max_tokens: int) -> ChatCompletionRequest:
    """The chat completion request a Responses request means."""
    fields: dict[str, Any] = {"model": model, "messages": chat_messages(body.instructions, items), **chat_tools(body),
                              "max_tokens": max_tokens if body.max_output_tokens is None else body.max_output_tokens,
                              "temperature": body.temperature, "top_p": body.top_p, **body.knobs(),
                              # reasoning.effort is chat's reasoning_effort: the depth on a model with a trained
                              # range, and the thinking budget (docs/server.md)
                              "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None}
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, FormatJSONObject):
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, FormatJSONSchema):
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_,
            **{k: v for k, v in (("description", fmt.description), ("strict", fmt.strict)) if v is not None}}}
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


# -- the routes ------------------------------------------------------------------------------------------------
@router.post(PREFIX, include_in_schema=False)
async def create_response(body: ResponsesRequest, request: Request):
    """max_output_tokens is a ceiling: past TINYLOOP_MAX_TOKENS it is refused; past the room the prompt leaves
    in the context (and when it is not given) it is that room, at most TINYLOOP_MAX_TOKENS; an answer that
    fills it is `incomplete` (reason max_output_tokens)."""
    pool = state_of(request)
    store = store_of(request)
    previous = None
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise not_found(body.previous_response_id, "previous_response_id", "Previous response")
    model = body.model or (previous.response["model"] if previous is not None else pool.model_id)
    state = await pool.model(model, body.timeout_s, body.keep_alive)
    engine = state.worker.require_engine()
    limit = state.settings.max_tokens
    try:
        check_unsupported(body)
        given = input_items(body, store)
        items = [(None, item) for item in (previous.context if previous is not None else ())] + given
        chat = to_chat(body, model, items, limit)
        params = chat.sampling_params(state.settings.temperature)
        prompt, params, tools = chat_inputs(engine, chat, params, reasoning=state.settings.reasoning_parser)
        if params.max_tokens > limit:
            raise ValidationError(f"max_output_tokens: {params.max_tokens} > {limit}, the most this server "
                                  "generates (TINYLOOP_MAX_TOKENS)", param="max_output_tokens")
        ids = await anyio.to_thread.run_sync(engine.encode_prompt, prompt)
        room = engine.max_seq_len - len(ids)
        if 0 < room < params.max_tokens:
            params = params.replace(max_tokens=room)
        handle = await state.submit(ids, params, n=1, timeout_s=body.timeout_s, max_tokens_given=True)
    except ValidationError as exc:
        raise renamed(exc) from None
    # the answer as the chat route reads it: reasoning apart, tool calls (server/reasoning.py)
    tools = Answer(tools, handle.plan.thinking) if tools is not None or handle.plan.thinking is not None else None
    namespaces = {f.name: ns for f, ns in function_tools(body) if ns is not None}
    tools_shown = [{**t.model_dump(), "strict": True if t.strict is None else t.strict}
                   if isinstance(t, FunctionTool) else t.model_dump() for t in body.tools or []]
    response = response_object(body, id=new_id("resp"), model=model, created_at=int(time.time()),
                               tools_shown=tools_shown, temperature=params.temperature)
    context = tuple(item for _, item in items)

    def keep(final: dict[str, Any]) -> None:
        if body.store is not False:
            store.put(Stored(final, [item for _, item in given], context + tuple(final["output"])))

    if body.stream:
        return await sse_stream(handle, ResponsesFramer(response=response, tools=tools, on_done=keep,
                                                               namespaces=namespaces),
                            state.settings.keepalive_s)
    (result,) = await collect(handle, request)
    final = finished(response, output_of(tools, result, namespaces), result.finish_reason, result.stats)
    keep(final)
    return final


def _stored(request: Request, response_id: str) -> Stored:
    entry = store_of(request).get(response_id)
    if entry is None:
        raise not_found(response_id)
    return entry


@router.get(PREFIX + "/{response_id}", include_in_schema=False)
async def get_response(response_id: str, request: Request, stream: bool = False,
                       include: list[str] | None = Query(None)):
    if stream:
        raise APIError(400, "stream: replaying a stored response's events is not supported (background responses "
                            "only, which this server does not run)", param="stream", code="unsupported_parameter")
    return _stored(request, response_id).response


@router.delete(PREFIX + "/{response_id}", include_in_schema=False)
async def delete_response(response_id: str, request: Request):
    if not store_of(request).delete(response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get(PREFIX + "/{response_id}/input_items", include_in_schema=False)
async def list_input_items(response_id: str, request: Request, limit: int = 20, order: str = "desc",
                           after: str | None = None, include: list[str] | None = Query(None)):
    """The input items of a stored response (this request's `input`, not those of previous_response_id's)."""
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit: must be in 1..100, got {limit}", param="limit", code="invalid_value")
    if order not in ("asc", "desc"):
        raise APIError(400, f'order: must be "asc" or "desc", got {order!r}', param="order", code="invalid_value")
    items = list(_stored(request, response_id).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        at = next((k for k, item in enumerate(items) if item.get("id") == after), None)
        if at is None:
            raise APIError(400, f"after: no input item of this response has the id {after!r}", param="after",
                           code="invalid_value")
        items = items[at + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0].get("id") if page else None,
            "last_id": page[-1].get("id") if page else None, "has_more": len(items) > limit}
