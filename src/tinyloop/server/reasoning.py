"""Reasoning output: a thinking model's `<think>...</think>` block apart from its answer (docs/server.md, "Reasoning").

The engine resolves, per request, whether the output has a block and whether it starts inside one (the prompt
left `<think>` open: `engine/thinking.py`, `RequestPlan.thinking`). `ReasoningParser` reads one choice's text as
it comes and cuts it into `{"reasoning_content": ...}` and `{"content": ...}` deltas; `AnswerParser` sends the
content on through the tool-call parser when the request has tools. The non-streamed message is the same
deltas put together, so a streamed answer concatenates to the non-streamed one by construction.

The rule: inside the block, everything up to the closing tag is reasoning (whitespace at its start and end
dropped); after it, the answer (its leading whitespace dropped). An output that never closes the block (cut by
max_tokens) is all reasoning. When the prompt did not open a block, the output has one only if its first text
is the opening tag; otherwise it is all answer, as given.
"""

from __future__ import annotations

from typing import Any

from ..engine.thinking import EFFORT_BUDGETS, ThinkTags
from ..errors import ValidationError
from .tool_stream import Delta, _held_prefix, assemble

REASONING_FIELDS = ("reasoning_content", "reasoning")   # vLLM's older and newer names; both are sent


class ReasoningParser:
    def __init__(self, tags: ThinkTags, inside: bool):
        self.open, self.close = tags.open, tags.close
        self.phase = "think" if inside else "start"
        self.buf = ""
        self.started = False    # reasoning text went out
        self.ws = ""            # whitespace held back inside the block (it may be the block's end)
        self.after = False      # right after the block: the answer's leading whitespace is dropped

    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> list[Delta]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            if self.phase == "start":
                head = self.buf.lstrip()
                if head.startswith(self.open):
                    self.phase, self.buf = "think", head[len(self.open):]
                    continue
                if not final and self.open.startswith(head):   # the tag may still come
                    return out
                self.phase = "answer"
                continue
            if self.phase == "think":
                at = self.buf.find(self.close)
                if at == -1:
                    keep = 0 if final else _held_prefix(self.buf, self.close)
                    cut = len(self.buf) - keep
                    out += self._reason(self.buf[:cut], end=final)
                    self.buf = self.buf[cut:]
                    return out
                out += self._reason(self.buf[:at], end=True)
                self.buf = self.buf[at + len(self.close):]
                self.phase, self.after = "answer", True
                continue
            text, self.buf = self.buf, ""
            if self.after:
                text = text.lstrip()
                if not text:
                    return out
                self.after = False
            if text:
                out.append({"content": text})
            return out

    def _reason(self, chunk: str, end: bool) -> list[Delta]:
        if not self.started:
            chunk = chunk.lstrip()
        body = chunk.rstrip()
        if not body:
            self.ws = "" if end else self.ws + chunk
            return []
        out = [{"reasoning_content": self.ws + body}]
        self.started = True
        self.ws = "" if end else chunk[len(body):]
        return out


class AnswerParser:
    """One choice's text -> chat deltas: reasoning (when the request's output has a block), then the answer
    through the tool-call parser (under tools) or as content."""

    def __init__(self, tools=None, thinking=None):
        self.tools = tools.parser() if tools is not None else None
        self.reasoning = ReasoningParser(thinking.tags, thinking.inside) if thinking is not None else None

    def feed(self, text: str) -> list[Delta]:
        return self._route(self.reasoning.feed(text) if self.reasoning is not None else
                           [{"content": text}] if text else [], final=False)

    def finish(self) -> list[Delta]:
        return self._route(self.reasoning.finish() if self.reasoning is not None else [], final=True)

    def _route(self, deltas: list[Delta], final: bool) -> list[Delta]:
        out: list[Delta] = []
        for d in deltas:
            if "content" in d and self.tools is not None:
                out += self.tools.feed(d["content"])
            else:
                out.append(d)
        if final and self.tools is not None:
            out += self.tools.finish()
        return out


class Answer:
    """How one chat request's output is read: its tool plan (or None) and its thinking block (the plan's, or
    None). `parser()` makes one `AnswerParser` per choice, as `ToolPlan.parser` does."""

    def __init__(self, tools=None, thinking=None):
        self.tools, self.thinking = tools, thinking

    def parser(self) -> AnswerParser:
        return AnswerParser(self.tools, self.thinking)

    def message(self, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
        """A chat choice's `message` and `finish_reason` (the parser's deltas put together)."""
        p = self.parser()
        deltas = p.feed(text) + p.finish()
        content, calls = assemble(deltas)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.thinking is not None:
            reasoning = "".join(d.get("reasoning_content", "") for d in deltas) or None
            message.update(dict.fromkeys(REASONING_FIELDS, reasoning))
        elif self.tools is None:
            message["content"] = text    # no parsing at all: the text as generated
        if calls:
            message["tool_calls"] = calls
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return message, finish_reason


def chunk_delta(d: Delta) -> Delta:
    """A parser delta as a chat chunk's delta: reasoning under both of vLLM's names."""
    if "reasoning_content" in d:
        return dict.fromkeys(REASONING_FIELDS, d["reasoning_content"])
    return d


def thinking_budget(max_thinking_tokens: int | None, effort: str | None, param: str = "reasoning_effort") -> int | None:
    """max_thinking_tokens, else the budget `reasoning_effort` stands for (EFFORT_BUDGETS); an unknown effort
    is a 400 naming `param`."""
    if effort is not None and effort not in EFFORT_BUDGETS:
        raise ValidationError(f"{param}: must be one of {', '.join(EFFORT_BUDGETS)}, got {effort!r}", param=param)
    if max_thinking_tokens is not None:
        return max_thinking_tokens
    return EFFORT_BUDGETS[effort] if effort is not None else None
