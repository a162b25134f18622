"""The Responses API's answer and store (server/responses/routes.py translates the request): the chat route's
deltas as Responses' output items and their typed events (`Items`, `ResponsesFramer`), the response object and
its usage, and the bounded in-memory store of responses (`ResponseStore`) that `GET /v1/responses/{id}` and
`previous_response_id` read."""

from __future__ import annotations

import copy
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Literal

from fastapi import Request

from ..errors import APIError
from ..generation import state_of
from .schemas import ResponsesRequest
from ..sse import NamedEventFramer, deltas_of, named_frame

DEFAULT_STORE_SIZE = 1000

# -- the store -------------------------------------------------------------------------------------------------
@dataclass
class Stored:
    response: dict[str, Any]              # the response object, as POST returned it (or the stream's last event)
    input_items: list[dict[str, Any]]     # this request's input items, with ids (GET .../input_items)
    context: tuple[dict[str, Any], ...]   # the conversation a follow-up continues: earlier items, input, output


class ResponseStore:
    """The last `size` stored responses, in memory (least recently used first out; 0 keeps none). Touched
    only from the event loop."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: Stored) -> None:
        if self.size <= 0:
            return
        self._entries[entry.response["id"]] = entry
        self._entries.move_to_end(entry.response["id"])
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def item(self, item_id: str) -> dict[str, Any] | None:
        """An input or output item of a stored response, by its id (an `item_reference`)."""
        for entry in reversed(self._entries.values()):
            for item in (*entry.input_items, *entry.response["output"]):
                if item.get("id") == item_id:
                    return item
        return None


def store_of(request: Request) -> ResponseStore:
    app_state = request.app.state
    store = getattr(app_state, "responses_store", None)
    if store is None:
        size = getattr(state_of(request).settings, "responses_store_size", DEFAULT_STORE_SIZE)
        store = app_state.responses_store = ResponseStore(size)
    return store


# -- ids -------------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


# -- the answer, as output items -------------------------------------------------------------------------------
class Items:
    """The chat route's deltas (`{"content": ...}`, tool call deltas: server/tool_stream.py) -> Responses'
    output items and their events, `(type, data)` without `sequence_number`; `output` is the items as they
    stand (the non-streamed answer: the same events, put together)."""

    def __init__(self, namespaces: dict[str, str] | None = None):
        self.namespaces = namespaces or {}    # a namespaced function's name -> its namespace
        self.output: list[dict[str, Any]] = []
        self.open: int | None = None          # the output index of the item being written
        self.calls: dict[int, int] = {}       # the chat route's call index -> output index

    def _start(self, item: dict[str, Any]) -> list[tuple[str, dict]]:
        out = self.close("completed")
        self.output.append(item)
        self.open = len(self.output) - 1
        return out + [("response.output_item.added", {"output_index": self.open, "item": copy.deepcopy(item)})]

    def feed(self, delta: dict[str, Any]) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        thought = delta.get("reasoning_content")
        if thought:   # a model that thinks: its block as a reasoning item (its text as reasoning_text)
            if self.open is None or self.output[self.open]["type"] != "reasoning":
                item = {"id": new_id("rs"), "type": "reasoning", "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
                out += self._start(item)
            item = self.output[self.open]
            item["content"][0]["text"] += thought
            out.append(("response.reasoning_text.delta", {"item_id": item["id"], "output_index": self.open,
                                                          "content_index": 0, "delta": thought}))
        text = delta.get("content")
        if text:
            if self.open is None or self.output[self.open]["type"] != "message":
                item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                        "content": []}
                out += self._start(item)
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                item["content"].append(part)
                out.append(("response.content_part.added", {"item_id": item["id"], "output_index": self.open,
                                                            "content_index": 0, "part": copy.deepcopy(part)}))
            item = self.output[self.open]
            item["content"][0]["text"] += text
            out.append(("response.output_text.delta", {"item_id": item["id"], "output_index": self.open,
                                                       "content_index": 0, "delta": text, "logprobs": []}))
        for call in delta.get("tool_calls") or []:
            if "id" in call:
                name = call["function"]["name"]
                ns = {"namespace": self.namespaces[name]} if name in self.namespaces else {}
                out += self._start({"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                                    "call_id": call["id"], "name": name, **ns, "arguments": ""})
                self.calls[call["index"]] = self.open
            fragment = call["function"].get("arguments")
            if fragment:
                at = self.calls[call["index"]]
                self.output[at]["arguments"] += fragment
                out.append(("response.function_call_arguments.delta", {"item_id": self.output[at]["id"],
                                                                       "output_index": at, "delta": fragment}))
        return out

    def close(self, status: Literal["completed", "incomplete"]) -> list[tuple[str, dict]]:
        """The open item's end (`status`: "incomplete" when max_output_tokens cut it short), if one is open."""
        if self.open is None:
            return []
        at, self.open = self.open, None
        item = self.output[at]
        item["status"] = status
        out = []
        if item["type"] == "reasoning":
            out.append(("response.reasoning_text.done", {"item_id": item["id"], "output_index": at, "content_index": 0,
                                                         "text": item["content"][0]["text"]}))
        elif item["type"] == "message":
            part = item["content"][0]
            out += [("response.output_text.done", {"item_id": item["id"], "output_index": at, "content_index": 0,
                                                   "text": part["text"], "logprobs": []}),
                    ("response.content_part.done", {"item_id": item["id"], "output_index": at, "content_index": 0,
                                                    "part": copy.deepcopy(part)})]
        else:
            out.append(("response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": at, "name": item["name"], "arguments": item["arguments"]}))
        return out + [("response.output_item.done", {"output_index": at, "item": copy.deepcopy(item)})]


def usage(stats: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's Responses usage: input_tokens count the prompt (cached_tokens: of them, read from the prefix
    cache; cache_write_tokens 0, as the Messages API's cache_creation_input_tokens: the prefix cache is automatic
    and free); reasoning_tokens: of the output, a thinking model's thinking block (its tags included)."""
    p, c = stats.get("prompt_tokens", 0), stats.get("completion_tokens", 0)
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": stats.get("prompt_tokens_cached", 0),
                                                        "cache_write_tokens": 0},
            "output_tokens": c, "output_tokens_details": {"reasoning_tokens": stats.get("reasoning_tokens", 0)},
            "total_tokens": p + c}


def response_object(body: ResponsesRequest, *, id: str, model: str, created_at: int, tools_shown: list[dict],
                    status: str = "in_progress", temperature: float | None = None) -> dict[str, Any]:
    """The response object as it starts (no output yet): every field OpenAI's has, the request's echoed;
    `temperature` the one the answer is sampled at (the request's, else the server's default, else 1.0)."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    text = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"},
            "verbosity": (body.text.verbosity if body.text is not None else None) or "medium"}
    reasoning = body.reasoning.model_dump(exclude={"generate_summary"}) if body.reasoning is not None else \
        {"effort": None, "summary": None}
    return {"id": id, "object": "response", "created_at": created_at, "status": status, "background": False,
            "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "max_tool_calls": body.max_tool_calls, "model": model,
            "output": [], "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "prompt_cache_key": body.prompt_cache_key,
            "reasoning": reasoning, "safety_identifier": body.safety_identifier, "service_tier": "default",
            "store": body.store is not False, "temperature": temperature if temperature is not None else
            1.0 if body.temperature is None else body.temperature,
            "text": text, "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": tools_shown, "top_logprobs": 0, "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": body.truncation or "disabled", "usage": None, "user": body.user,
            "metadata": body.metadata or {}}


def finished(response: dict[str, Any], items: Items, finish_reason: str, stats: dict[str, Any]) -> dict[str, Any]:
    """The response once its answer ended: status, incomplete_details, output and usage."""
    cut = finish_reason == "length"
    out = dict(response, status="incomplete" if cut else "completed", output=copy.deepcopy(items.output),
               usage=usage(stats), incomplete_details={"reason": "max_output_tokens"} if cut else None)
    if not cut:
        out["completed_at"] = int(time.time())
    return out


class ResponsesFramer(NamedEventFramer):
    """Responses' stream: `event: <type>` and `data: <json>` per event, every event with its sequence_number;
    `on_done(response)` is called with the final response (to store it)."""

    def __init__(self, *, response: dict[str, Any], tools, on_done: Callable[[dict[str, Any]], None],
                 namespaces: dict[str, str] | None = None):
        super().__init__(id=response["id"], created=response["created_at"], model=response["model"])
        self.response, self.tools, self.on_done = response, tools, on_done
        self.parser = tools.parser() if tools is not None else None
        self.items = Items(namespaces)
        self.sequence = 0

    def sse(self, kind: str, data: dict[str, Any]) -> bytes:
        obj = {"type": kind, **data, "sequence_number": self.sequence}
        self.sequence += 1
        return named_frame(kind, obj)

    def open(self) -> list[bytes]:
        return [self.sse("response.created", {"response": self.response}),
                self.sse("response.in_progress", {"response": self.response})]

    def feed(self, delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        return self.items.feed(delta)

    def close(self, ev) -> list[bytes]:
        self.closed[ev.index] = ev.stats or {}
        cut = ev.finish_reason == "length"
        out = self._frames(ev, final=True)
        out += [self.sse(kind, data) for kind, data in self.items.close("incomplete" if cut else "completed")]
        final = finished(self.response, self.items, ev.finish_reason, ev.stats or {})
        self.on_done(final)
        last = {"response": final}
        if (ev.stats or {}).get("schema_check"):   # a schema checked after generation (docs/structured.md)
            last["schema_check"] = ev.stats["schema_check"]
        return out + [self.sse("response.incomplete" if cut else "response.completed", last)]

    def fail(self, err: APIError) -> list[bytes]:
        """An `error` event (OpenAI's stream error: code, message, param), then `response.failed`."""
        code = err.code or err.type
        failed = dict(self.response, status="failed", output=copy.deepcopy(self.items.output),
                      error={"code": "server_error" if err.status >= 500 else code, "message": err.message})
        return [self.sse("error", {"code": code, "message": err.message, "param": err.param}),
                self.sse("response.failed", {"response": failed})]


def output_of(tools, result, namespaces: dict[str, str] | None = None) -> Items:
    """The non-streamed answer: the same deltas, the same items, as a stream of it would carry."""
    items = Items(namespaces)
    parser = tools.parser() if tools is not None else None
    for d in deltas_of(tools, parser, result.text, final=True):
        items.feed(d)
    items.close("incomplete" if result.finish_reason == "length" else "completed")
    return items
