"""Tool calls read from a choice's output as it is generated (docs/structured.md, "Streaming").

`ToolCallParser.feed(text)` takes the next text delta of one choice and returns the chat deltas it makes
(OpenAI's and vLLM's shapes): `{"content": ...}` for text that is the answer, then per call one delta with
`index`, `id`, `type` and `function.name` (`arguments: ""`), and then `function.arguments` fragments as the
model writes them. `finish()` flushes what was held back. The non-streamed answer is these same deltas put
together (`assemble`), so a streamed answer concatenates to the non-streamed one by construction.

What is held back: a name until its string is complete; text that may be the start of a `<tool_call>` tag;
whitespace that may turn out to lead up to a call (Hermes content is stripped); a JSON string escape that is
not complete yet (the generic format's `response`).

A `<tool_call>` block holds JSON (`{"name": ..., "arguments": {...}}`, Hermes) or XML, the format of some templates' and
Qwen3-Coder's templates (`<function=NAME>` then `<parameter=P>\nvalue\n</parameter>` per argument, then
`</function>`): each block is read as what its first character says, whatever the template's style. An XML
call's arguments go out as JSON, one parameter at a time once its `</parameter>` is read: a value is the raw
text for a parameter whose schema type is "string", else JSON if it parses as JSON, else the text.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Callable

OPEN, CLOSE = "<tool_call>", "</tool_call>"
Path = tuple  # keys and array indices from the scanned value's root
Delta = dict[str, Any]


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class JsonScanner:
    """An incremental JSON scanner: `feed` text, and `on_start(path, offset)` / `on_end(path, offset)` are
    called where each value starts and ends (offsets into the text fed so far, the end exclusive). Not a
    validator: text that is not JSON sets `broken` and is ignored from there on."""

    def __init__(self, on_start: Callable[[Path, int], None], on_end: Callable[[Path, int], None]):
        self.on_start, self.on_end = on_start, on_end
        self.text = ""
        self.stack: list[list] = []     # per open container: [kind "o"/"a", state, key or index]
        self.scalar: tuple | None = None  # (kind "s" value string / "k" key / "n" number or literal, start)
        self.escaped = False
        self.started = self.done = self.broken = False

    def path(self) -> Path:
        return tuple(f[2] for f in self.stack)

    def feed(self, text: str) -> None:
        base = len(self.text)
        self.text += text
        for p in range(base, len(self.text)):
            if self.done or self.broken:
                return
            self._char(self.text[p], p)

    def _char(self, c: str, p: int) -> None:
        if self.scalar is not None:
            kind, start = self.scalar
            if kind in "sk":
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.scalar = None
                    if kind == "k":
                        try:
                            self.stack[-1][1:] = ["colon", json.loads(self.text[start:p + 1])]
                        except ValueError:   # a bad escape in a key (free text)
                            self.broken = True
                    else:
                        self._ended(p + 1)
                return
            if c not in " \t\r\n,]}":   # a number or literal goes on
                return
            self.scalar = None
            self._ended(p)
        if c in " \t\r\n":
            return
        top = self.stack[-1] if self.stack else None
        state = top[1] if top else ("value" if not self.started else "after")
        if state in ("key", "key_or_end") and c == '"':
            self.scalar = ("k", p)
        elif state == "key_or_end" and c == "}" or state == "next_o" and c == "}" \
                or state in ("value_or_end", "next_a") and c == "]":
            self.stack.pop()
            self._ended(p + 1)
        elif state == "colon" and c == ":":
            top[1] = "value"
        elif state == "next_o" and c == ",":
            top[1] = "key"
        elif state == "next_a" and c == ",":
            top[1:] = ["value", top[2] + 1]
        elif state in ("value", "value_or_end") and c in '{["-0123456789tfn':
            self.started = True
            self.on_start(self.path(), p)
            if c == "{":
                self.stack.append(["o", "key_or_end", None])
            elif c == "[":
                self.stack.append(["a", "value_or_end", 0])
            else:
                self.scalar = ("s" if c == '"' else "n", p)
        else:
            self.broken = True

    def _ended(self, end: int) -> None:
        self.on_end(self.path(), end)
        if not self.stack:
            self.done = True
        else:
            self.stack[-1][1] = "next_o" if self.stack[-1][0] == "o" else "next_a"


class _Call:
    """One call object being read, `{"name": ..., "arguments": {...}}` (keys in either order), from the text
    of its scanner."""

    def __init__(self, scanner: JsonScanner):
        self.scanner = scanner
        self.index: int | None = None     # set when the name is known and the call's first delta goes out
        self.name: str | None = None
        self.name_at = 0
        self.args: list[int | None] | None = None   # [start, end] of the arguments' text (end: once complete)
        self.sent = 0                     # arguments' characters sent
        self.closed = False               # the call's object is complete

    def start(self, rel: Path, at: int) -> None:
        if rel == ("name",):
            self.name_at = at
        elif rel == ("arguments",):
            self.args = [at, None]

    def end(self, rel: Path, at: int) -> None:
        if rel == ("name",):
            try:
                name = json.loads(self.scanner.text[self.name_at:at])
            except ValueError:
                name = None
            self.name = name if isinstance(name, str) else None
        elif rel == ("arguments",) and self.args is not None:
            self.args[1] = at
        elif rel == ():
            self.closed = True

    def deltas(self, next_index: Callable[[], int]) -> list[Delta]:
        out = _opening(self, next_index)
        if out is None:
            return []
        if self.args is None:
            if self.closed:   # a complete call that gave no arguments: an empty object, as OpenAI has it
                self.args = [0, 0]
                out.append(_args(self.index, "{}"))
            return out
        start, end = self.args
        stop = end if end is not None else len(self.scanner.text)
        if stop - start > self.sent:
            out.append(_args(self.index, self.scanner.text[start + self.sent:stop]))
            self.sent = stop - start
        return out


def _opening(call, next_index: Callable[[], int]) -> list[Delta] | None:
    """A streamed call's opening delta (its index, id and name) the first time its name is known, [] after;
    None while the name is still unknown."""
    if call.index is not None:
        return []
    if call.name is None:
        return None
    call.index = next_index()
    return [{"tool_calls": [{"index": call.index, "id": new_call_id(), "type": "function",
                             "function": {"name": call.name, "arguments": ""}}]}]


def _args(index: int, fragment: str) -> Delta:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


def _json_string_prefix(raw: str, complete: bool) -> tuple[str, int]:
    """(text, n): the decoded text of the first n characters of a JSON string's body (`raw`, without its
    quotes), as many as can be decoded: an escape cut in the middle, or a high surrogate whose low half has
    not come yet, waits."""
    for cut in range(len(raw), max(len(raw) - 12, -1), -1):
        try:
            said = json.loads('"' + raw[:cut] + '"')
        except ValueError:
            continue
        if complete or not said or not 0xD800 <= ord(said[-1]) < 0xDC00:
            return said, cut
    return "", 0


def _held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag` (and so wait for the next delta)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


XML_FUNCTION, XML_PARAM, XML_PARAM_END, XML_FUNCTION_END = "<function=", "<parameter=", "</parameter>", "</function>"


class _XmlCall:
    """One `<tool_call>` block in the XML format, read from its text as it comes; the arguments as JSON.
    `types`: function name -> {parameter: its schema's "type"} (a string parameter's value is its raw text)."""

    def __init__(self, types: dict[str, dict[str, Any]]):
        self.types = types
        self.text = ""
        self.at = 0                       # how far the text is read
        self.index: int | None = None
        self.name: str | None = None
        self.param: str | None = None     # the parameter whose value is being read
        self.value_at = 0
        self.pending: list[str] = []      # argument fragments not sent yet
        self.n_params = 0
        self.closed = self.broken = False

    def feed(self, text: str) -> None:
        self.text += text
        self._read(final=False)

    def end(self) -> None:
        """The block closed (`</tool_call>`): a value or the function left open ends here."""
        self._read(final=True)
        if self.param is not None:
            self._value(self.text[self.value_at:])
        if self.name is not None and not self.closed:
            self._close()

    def _value(self, raw: str) -> None:
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        kind = self.types.get(self.name or "", {}).get(self.param)
        value: Any = raw
        if kind != "string":
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw
        key = json.dumps(self.param, ensure_ascii=False)
        self.pending.append(("{" if not self.n_params else ", ") + key + ": " + json.dumps(value, ensure_ascii=False))
        self.n_params += 1
        self.param = None

    def _close(self) -> None:
        self.pending.append("}" if self.n_params else "{}")
        self.closed = True

    def _read(self, final: bool) -> None:
        while not (self.closed or self.broken):
            rest = self.text[self.at:]
            if self.name is None:
                head = rest.lstrip()
                if not head.startswith(XML_FUNCTION):
                    if not XML_FUNCTION.startswith(head) or final:
                        self.broken = bool(head) or final
                    return
                end = head.find(">")
                if end == -1:
                    return
                self.name = head[len(XML_FUNCTION):end].strip()
                self.at += len(rest) - len(head) + end + 1
                continue
            if self.param is not None:   # a value: up to </parameter> (or a next parameter / the function's end)
                stops = [i for i in (rest.find(XML_PARAM_END), rest.find(XML_PARAM), rest.find(XML_FUNCTION_END))
                         if i != -1]
                if not stops:
                    return
                cut = min(stops)
                self._value(rest[:cut])
                self.value_at = 0
                self.at += cut + (len(XML_PARAM_END) if rest.startswith(XML_PARAM_END, cut) else 0)
                continue
            head = rest.lstrip()
            skipped = len(rest) - len(head)
            if head.startswith(XML_PARAM):
                end = head.find(">")
                if end == -1:
                    return
                self.param = head[len(XML_PARAM):end].strip()
                self.at += skipped + end + 1
                self.value_at = self.at
                continue
            if head.startswith(XML_FUNCTION_END):
                self.at += skipped + len(XML_FUNCTION_END)
                self._close()
                return
            if not head or any(t.startswith(head) for t in (XML_PARAM, XML_FUNCTION_END)):
                return   # may be a tag still coming
            nxt = head.find("<", 1)   # stray text between parameters: skipped
            if nxt == -1:
                self.at = len(self.text)
                return
            self.at += skipped + nxt

    def deltas(self, next_index: Callable[[], int]) -> list[Delta]:
        out = _opening(self, next_index)
        if out is None:
            return []
        if self.pending:
            out.append(_args(self.index, "".join(self.pending)))
            self.pending = []
        return out


class _Block:
    """A `<tool_call>` block whose format (JSON or XML) its first character has not told yet."""

    def __init__(self, parser: "ToolCallParser"):
        self.parser, self.held, self.reader = parser, "", None

    def feed(self, text: str) -> None:
        if self.reader is not None:
            self.reader.feed(text)
            return
        self.held += text
        head = self.held.lstrip()
        if not head:
            return
        if head[0] == "<":
            self.reader = _XmlCall(self.parser.types)
            self.parser.calls.append(self.reader)
        else:
            self.reader = JsonScanner(lambda p, a: self.parser.calls[-1].start(p, a),
                                      lambda p, a: self.parser.calls[-1].end(p, a))
            self.parser.calls.append(_Call(self.reader))
        self.reader.feed(self.held)

    def end(self) -> None:
        if isinstance(self.reader, _XmlCall):
            self.reader.end()


class ToolCallParser:
    """One choice's output under tools, read delta by delta. `style`: "hermes" or "xml" (free text, then
    `<tool_call>` blocks of JSON or XML calls) or "generic" (one JSON object: `{"tool_calls": [...]}` or
    `{"response": "..."}`). `tools`: the functions' definitions (their parameters' types read XML values)."""

    def __init__(self, style: str, tools: list | None = None):
        self.style = style
        self.types = {}
        for f in tools or []:
            params = (f.get("parameters") if isinstance(f, dict) else getattr(f, "parameters", None)) or {}
            name = f.get("name") if isinstance(f, dict) else f.name
            self.types[name] = {k: (v or {}).get("type") for k, v in (params.get("properties") or {}).items()
                                if isinstance(v, dict)}
        self.calls: list[_Call] = []
        self.named = 0
        if style == "generic":
            self.scanner = JsonScanner(self._start, self._end)
            self.response: list[int | None] | None = None   # [start, end] of the response string
            self.said = 0                  # how much of its body (JSON text) was sent, decoded
        else:
            self.buf, self.read = "", 0    # the text not handled yet, and how far it has been read
            self.block: _Block | None = None   # the open <tool_call> block
            self.content_sent = self.seen_call = False
            self.ws = ""                   # whitespace held back: it may lead up to a call

    def feed(self, text: str) -> list[Delta]:
        if self.style == "generic":
            self.scanner.feed(text)
            return self._generic()
        self.buf += text
        return self._hermes(final=False)

    def finish(self) -> list[Delta]:
        """The output ended: what was held back that is still due."""
        return self._generic() if self.style == "generic" else self._hermes(final=True)

    # -- generic: one scanner over the whole output ----------------------------------------------------------
    def _start(self, path: Path, at: int) -> None:
        if path == ("response",):
            self.response = [at, None]
        elif len(path) == 2 and path[0] == "tool_calls":
            self.calls.append(_Call(self.scanner))
        elif len(path) > 2 and path[0] == "tool_calls" and self.calls:
            self.calls[-1].start(path[2:], at)

    def _end(self, path: Path, at: int) -> None:
        if path == ("response",) and self.response is not None:
            self.response[1] = at
        elif len(path) >= 2 and path[0] == "tool_calls" and self.calls:
            self.calls[-1].end(path[2:], at)

    def _generic(self) -> list[Delta]:
        out: list[Delta] = []
        if self.response is not None:
            start, end = self.response
            raw = self.scanner.text[start + 1 + self.said:end - 1 if end is not None else None]
            text, n = _json_string_prefix(raw, end is not None)
            self.said += n
            if text:
                out.append({"content": text})
        return out + self._calls()

    def _calls(self) -> list[Delta]:
        out: list[Delta] = []
        for call in self.calls:
            out += call.deltas(self._next_index)
        return _merged(out)

    def _next_index(self) -> int:
        self.named += 1
        return self.named - 1

    # -- hermes: text, and a scanner per <tool_call> block ----------------------------------------------------
    def _hermes(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            rest = self.buf[self.read:]
            tag = CLOSE if self.block is not None else OPEN
            at = rest.find(tag)
            upto = at if at != -1 else len(rest) - (0 if final else _held_prefix(rest, tag))
            if self.block is not None:
                self.block.feed(rest[:upto])
            else:
                out += self._content(rest[:upto])
            self.read += upto
            if at == -1:
                break
            self.read += len(tag)
            if self.block is None:      # a call opens
                self.seen_call, self.ws = True, ""
                self.block = _Block(self)
            else:                       # it closes
                self.block.end()
                out += self._calls()
                self.block = None
        self.buf, self.read = self.buf[self.read:], 0   # only what is not read yet is kept
        return out + self._calls()

    def _content(self, text: str) -> list[Delta]:
        """Text outside the calls: before the first call it is the answer's content, with the whitespace around
        it dropped; after a call it is not part of the answer."""
        if self.seen_call or not text:
            return []
        if not self.content_sent:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self.ws += text
            return []
        out = [{"content": self.ws + body}]
        self.content_sent, self.ws = True, text[len(body):]
        return out


def _merged(deltas: list[Delta]) -> list[Delta]:
    """Consecutive argument fragments of one call as one delta."""
    out: list[Delta] = []
    for d in deltas:
        prev = out[-1]["tool_calls"][0] if out and "tool_calls" in out[-1] else None
        cur = d.get("tool_calls", [None])[0]
        if prev is not None and cur is not None and "id" not in cur and prev["index"] == cur["index"] \
                and "id" not in prev:
            prev["function"]["arguments"] += cur["function"]["arguments"]
        else:
            out.append(d)
    return out


def assemble(deltas: list[Delta]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) that a list of deltas adds up to: what a streaming client puts together."""
    content = "".join(d.get("content") or "" for d in deltas) or None
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            if "id" in c:
                calls[c["index"]] = {"id": c["id"], "type": "function",
                                     "function": {"name": c["function"]["name"], "arguments": ""}}
            calls[c["index"]]["function"]["arguments"] += c["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def parse(style: str, text: str, tools: list | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output at once: the deltas of one feed and the flush, put together."""
    parser = ToolCallParser(style, tools)
    return assemble(parser.feed(text) + parser.finish())
