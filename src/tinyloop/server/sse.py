"""Server-sent-event framing: OpenAI chunks (chat and text completion) and the native per-token events.

A framer turns the engine's `StreamEvent`s into SSE frames (bytes). It never emits an empty content
delta; text arrives from the engine already cut at whole UTF-8 characters with stop text held back.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from ..engine import StreamEvent
from .reasoning import chunk_delta
from .logprobs import chat_content, chat_logprobs, completion_logprobs, completion_tail, join, native_logprob


def usage(prompt: int, completion: int, cached: int, reasoning: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens whose KV came from the prefix cache;
    `reasoning_tokens`: completion tokens of a thinking model's thinking block (its tags included)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": reasoning}}

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keepalive\n\n"


def frame(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def named_frame(event: str, obj: Any) -> bytes:
    """`event: <name>` and `data: <json>`: a frame of the streams whose events are named (Anthropic's
    Messages, OpenAI's Responses)."""
    return f"event: {event}\ndata: ".encode() + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


def deltas_of(tools, parser, text: str, final: bool) -> list[dict[str, Any]]:
    """One event's text as the chat route's deltas: through the tool-call parser under tools."""
    if tools is None:
        return [{"content": text}] if text else []
    return parser.feed(text) + (parser.finish() if final else [])


class Framer:
    """Base: subclasses say how the opening, a text delta and the end look."""

    keepalive = KEEPALIVE   # sent while the engine is busy (queue wait, a long prefill)

    def __init__(self, *, id: str, created: int, model: str, include_usage: bool = False,
                 extras: Callable[[dict[str, Any]], dict[str, Any]] | None = None, n: int = 1, tokenizer=None,
                 per_prompt: int | None = None):
        self.id, self.created, self.model = id, created, model
        self.tokenizer = tokenizer  # set when the request asked for logprobs: each chunk carries its tokens'
        self.offsets: dict[int, int] = {}  # completions: characters streamed so far per choice (text_offset)
        self.include_usage = include_usage
        self.extras = extras  # /api/v0: stats, model_info, runtime on the final chunk
        self.n = n            # choices; the stream ends after the last one's final event
        self.per_prompt = per_prompt or n  # choices per prompt (a batch of prompts: n = prompts x per_prompt)
        self.closed: dict[int, dict[str, Any]] = {}  # index -> stats of each finished choice
        self._held: dict[int, list[int]] = {}         # loops "auto": per choice, depths not yet sent

    @property
    def done(self) -> bool:
        return len(self.closed) >= self.n

    def usage(self) -> dict[str, Any]:
        """Prompt tokens once per prompt (its n choices share the prefill), completion tokens summed."""
        firsts = [st for i, st in self.closed.items() if i % self.per_prompt == 0]
        c = sum(st.get("completion_tokens", 0) for st in self.closed.values())
        return usage(sum(st.get("prompt_tokens", 0) for st in firsts), c,
                     sum(st.get("prompt_tokens_cached", 0) for st in firsts),
                     sum(st.get("reasoning_tokens", 0) for st in self.closed.values()))

    def open(self) -> list[bytes]:
        return []

    def event(self, ev: StreamEvent) -> list[bytes]:
        raise NotImplementedError

    def close(self, ev: StreamEvent) -> list[bytes]:
        raise NotImplementedError

    def error(self, body: dict[str, Any]) -> list[bytes]:
        return [frame(body), DONE]

    def fail(self, err) -> list[bytes]:
        """The frames that end a stream the engine failed (`err`: an errors.APIError) after it started."""
        return self.error(err.body())


class NamedEventFramer(Framer):
    """A stream of named events built from the chat route's deltas (Messages, Responses): each event's text
    through the tool-call parser (`deltas_of`), each delta fed to the API's own builder (`feed`: its
    (event, data) pairs), each pair written by the API's `sse`."""

    tools = parser = None

    def feed(self, delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        raise NotImplementedError

    def sse(self, event: str, data: dict[str, Any]) -> bytes:
        return named_frame(event, data)

    def _frames(self, ev, final: bool) -> list[bytes]:
        out = []
        for d in deltas_of(self.tools, self.parser, ev.text, final):
            out += [self.sse(name, data) for name, data in self.feed(d)]
        return out

    def event(self, ev) -> list[bytes]:
        return self._frames(ev, final=False)


class ChatFramer(Framer):
    """Chat chunks, as OpenAI sends them: every choice with `logprobs` (null unless asked for) and, under
    `stream_options.include_usage`, `"usage": null` on every chunk before the usage chunk (the chat chunk's
    schema has it nullable; the text completion's does not: CompletionFramer leaves it out)."""
    object = "chat.completion.chunk"
    usage_null = True

    def _chunk(self, choice: dict[str, Any], **more: Any) -> dict[str, Any]:
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
               "choices": [choice] if choice is not None else []}
        if self.include_usage and self.usage_null:
            out["usage"] = None
        out.update(more)
        return out

    def _delta(self, delta: dict[str, Any], finish: str | None = None, index: int = 0) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}

    def open(self) -> list[bytes]:
        return [frame(self._chunk(self._delta({"role": "assistant"}, index=i))) for i in range(self.n)]

    def event(self, ev: StreamEvent) -> list[bytes]:
        depths = self._depths(ev)
        if self.tokenizer is not None and ev.logprobs:
            choice = self._delta({"content": ev.text}, index=ev.index)
            choice["logprobs"] = self._logprobs(ev)
        elif ev.text:
            choice = self._delta({"content": ev.text}, index=ev.index)
        else:
            return []
        if depths:
            choice["loops"] = self._held.pop(ev.index)
        return [frame(self._chunk(choice))]

    def _depths(self, ev: StreamEvent) -> list[int]:
        """Loops "auto": the depths of the tokens not yet reported for this choice, this event's included
        (a token whose text is held back reports its depth with the next chunk that goes out)."""
        if ev.loops:
            self._held.setdefault(ev.index, []).extend(ev.loops)
        return self._held.get(ev.index) or []

    def _logprobs(self, ev: StreamEvent) -> dict[str, Any]:
        return chat_logprobs(chat_content(self.tokenizer, ev.token_ids, ev.logprobs))

    def close(self, ev: StreamEvent) -> list[bytes]:
        """The final chunk of one choice; after the last choice, the usage chunk (if asked) and [DONE]."""
        self.closed[ev.index] = ev.stats or {}
        out = self.event(ev)  # the flushed tail, if any
        return self._last(ev, out, self._delta({}, ev.finish_reason, index=ev.index))

    def _last(self, ev: StreamEvent, out: list[bytes], choice: dict[str, Any]) -> list[bytes]:
        """`out`, then the chunk with the choice's finish_reason (`choice`); after the last choice, the usage
        chunk (if asked) and [DONE]."""
        extra = self.extras(ev.stats or {}) if self.extras else {}
        if (ev.stats or {}).get("schema_check"):   # a schema checked after generation (docs/structured.md)
            choice["schema_check"] = ev.stats["schema_check"]
        out.append(frame(self._chunk(choice, **extra)))
        if not self.done:
            return out
        if self.include_usage:
            out.append(frame(self._chunk(None, usage=self.usage())))
        out.append(DONE)
        return out


class CompletionFramer(ChatFramer):
    """Text completion chunks. `echo`: per prompt, (its text, its ids): each choice's first chunk starts with
    the prompt's text (and, with logprobs, the prompt tokens' logprobs, from the engine's prompt scores).
    Every choice has `logprobs` (null unless asked for); no `usage` key until the usage chunk (OpenAI's
    schema has no null there)."""
    object = "text_completion"
    usage_null = False

    def __init__(self, *, echo: list[tuple[str, list[int]]] | None = None, **kw: Any):
        super().__init__(**kw)
        self.echo = echo
        self.echoed: set[int] = set()

    def _delta(self, delta: dict[str, Any], finish: str | None = None, index: int = 0) -> dict[str, Any]:
        return {"text": delta.get("content", ""), "index": index, "logprobs": None, "finish_reason": finish}

    def event(self, ev: StreamEvent) -> list[bytes]:
        i, text, lp = ev.index, ev.text, None
        if self.echo is not None and i not in self.echoed:
            self.echoed.add(i)
            head, ids = self.echo[i // self.per_prompt]
            text = head + text
            self.offsets[i] = len(head)
            if self.tokenizer is not None:
                lp = completion_logprobs(self.tokenizer, ids, ev.prompt_logprobs or [None] * len(ids))
        if self.tokenizer is not None and (ev.logprobs or ev.stop_logprob is not None):
            start = self.offsets.get(i, 0)
            tail = completion_tail(self.tokenizer, ev.token_ids, ev.logprobs or [], ev.stop_logprob, start,
                                   start + len(ev.text))
            lp = tail if lp is None else join(lp, tail)
        self.offsets[i] = self.offsets.get(i, 0) + len(ev.text)
        depths = self._depths(ev)
        if lp is None and not text:
            return []
        choice = self._delta({"content": text}, index=i)
        if lp is not None:
            choice["logprobs"] = lp
        if depths:
            choice["loops"] = self._held.pop(i)
        return [frame(self._chunk(choice))]

    def open(self) -> list[bytes]:
        return []


class NativeFramer(Framer):
    """One event per token: {"token_id", "text"}; then {"token_id": -1, "text": tail, ...}; [DONE]."""

    def event(self, ev: StreamEvent) -> list[bytes]:
        ids = ev.token_ids
        # one event per token; when an event accounts for several tokens its text goes with the last
        out = []
        for i, t in enumerate(ids):
            e = {"token_id": t, "text": ev.text if i == len(ids) - 1 else ""}
            if ev.logprobs:
                e.update(native_logprob(ev.logprobs[i]))
            if i == 0 and ev.prompt_logprobs is not None:
                e["prompt_logprobs"] = [native_logprob(x) for x in ev.prompt_logprobs]
            if ev.loops:
                e["loops"] = ev.loops[i]
            out.append(frame(e))
        return out

    def close(self, ev: StreamEvent) -> list[bytes]:
        self.closed[ev.index] = ev.stats or {}
        e = {"token_id": -1, "text": ev.text, "finish_reason": ev.finish_reason, "stats": ev.stats or {}}
        if ev.prompt_logprobs is not None:  # nothing was generated (max_tokens 0, or a stop token at once)
            e["prompt_logprobs"] = [native_logprob(x) for x in ev.prompt_logprobs]
        return [frame(e), DONE]



class ToolChatFramer(ChatFramer):
    """Chat chunks under tools: each choice's text goes through its own `ToolCallParser` as it comes
    (server/tool_stream.py), and what that makes (content, a call's id and name, its arguments' fragments)
    goes out at once; finish_reason "tool_calls" when a choice called. With logprobs a chunk carries the
    logprobs of the tokens it accounts for: those whose text is still held back (a name not yet complete,
    a possible `<tool_call>` tag) go with the next chunk that goes out, at the latest the finish chunk."""

    def __init__(self, *, plan, **kw: Any):
        super().__init__(**kw)
        self.plan = plan
        self.parsers: dict[int, Any] = {}
        self.called: set[int] = set()
        self._unsent: dict[int, tuple[list[int], list]] = {}   # per choice: (ids, logprobs) not yet sent

    def _choices(self, ev: StreamEvent, final: bool) -> list[dict[str, Any]]:
        i = ev.index
        if i not in self.parsers:
            self.parsers[i] = self.plan.parser()
        deltas = self.parsers[i].feed(ev.text) + (self.parsers[i].finish() if final else [])
        if self.tokenizer is not None and ev.logprobs:
            ids, lps = self._unsent.setdefault(i, ([], []))
            ids += ev.token_ids
            lps += ev.logprobs
        self._depths(ev)
        out = []
        for d in deltas:
            if "tool_calls" in d:
                self.called.add(i)
            out.append(self._with_held(self._delta(chunk_delta(d), index=i), i))
        return out

    def _with_held(self, choice: dict[str, Any], i: int) -> dict[str, Any]:
        """`choice` with the logprobs and depths of the tokens not yet accounted for."""
        unsent = self._unsent.pop(i, None)
        if unsent:
            choice["logprobs"] = chat_logprobs(chat_content(self.tokenizer, *unsent))
        if self._held.get(i):
            choice["loops"] = self._held.pop(i)
        return choice

    def event(self, ev: StreamEvent) -> list[bytes]:
        return [frame(self._chunk(c)) for c in self._choices(ev, final=False)]

    def close(self, ev: StreamEvent) -> list[bytes]:
        self.closed[ev.index] = ev.stats or {}
        out = [frame(self._chunk(c)) for c in self._choices(ev, final=True)]
        finish = "tool_calls" if ev.finish_reason == "stop" and ev.index in self.called else ev.finish_reason
        self.parsers.pop(ev.index, None)
        return self._last(ev, out, self._with_held(self._delta({}, finish, index=ev.index), ev.index))
