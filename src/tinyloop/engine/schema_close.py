"""JSON that closes within its budget (issue 57, item 3): the closing rule of a constrained JSON output.

A small model under a JSON grammar can write a string, or open structure, for as long as it likes: the grammar
allows it, so the answer runs into `max_tokens` unterminated (the shipped model under `json_object`: one key string
of prose, or of spaces, until `length`). The rule here keeps every answer that *can* close within its budget
closing, and never makes an answer the grammar allows invalid: it only removes tokens from the grammar's mask, and
never the last one. It applies to `json_object`, `json_schema` and tool calls (engine/constraint.py), with the
request's `max_tokens` as the budget (a thinking block's tokens count in it).

- **The closing path.** From the grammar's state (llguidance's matcher), a walk to a state where the grammar may
  end. At each step: the text the grammar forces (its forced bytes, as the tokenizer splits them); else the first
  of a fixed list of closing tokens the grammar takes in the current lexical state (inside a string `"}`, `"]`,
  `"`; outside `}}`, `}`, `]`, then the shortest values `""`, `0`, `{}`, `[]`, `null`, then `, `, ...); else, in a
  string that cannot end yet (a `pattern`, a `format`, an `enum`, `minLength`), the rest of one of the schema's own
  strings (`examples`: its enum values, the shortest match of its patterns, an example of each format; those the
  string has begun first); else a filler character (until the string ends with FILLER_RUN of them), else a
  character after which the string can end (a uri's `@`), else the lowest-numbered token the grammar allows. The
  first step takes only tokens the position's mask allows (llguidance's mask allows only the canonical tokens of
  forced text); the others are checked with llguidance's `validate_tokens`. The path's length `U` bounds the tokens
  needed to close from above (the fewest is not something llguidance computes; on JSONSchemaBench's sample, the
  path from the start is what the schema's required members need, written with empty values).
- **The zones.** With `left` tokens left, `slack = left - 1 - U` (the 1: end-of-text). `slack <= K`: only the
  path's first token (or EOS, where the grammar may end already), so the answer closes with up to K tokens to
  spare. `K < slack <= K + NEAR` (JSON): no token may open structure (`{`, `[`, or a `,` outside a string) unless the
  path itself does, nor a string where the path writes another value, so what the model still writes (string
  content, numbers, closers) cannot lengthen the path by more than a few tokens (an escape, a number's sign or
  exponent: K covers them). Elsewhere the grammar's mask
  stands. Where no path fits in the tokens left (`slack < 0`), nothing is restricted: the answer cannot close, is
  cut, and says `length`, as before.
- **A function of the tokens written.** The zone and the path at a position depend on the grammar's state there and
  the tokens left, nothing else: every route to the same tokens (one step at a time, jump-forward, the lone steps'
  native call, speculation's drafts and rollback, n choices) gets the same masks. Paths are reused only where
  provably the same walk (the model took the path's first token, and this position's first step is the path's
  next: the rest is then the same walk from the same state).
- **Where it is computed.** Every FAR-th position (a far checkpoint); from there on, only once the tokens left are
  within EXTRA of that path's end plus the zones (the window); in the window, at every CHECKPOINT-th position, and
  between them only where the last checkpoint's path leaves less than MARGIN tokens to spare past the closing zone.
  The rule is off for a grammar whose path from its start (`U0`, once per compiled grammar) does not fit the
  budget. A walk costs ~10 us a token of path on the dev machine (forced bytes 0.1 us, a token check ~1 us, a token
  consumed ~5 us, the Python around them).
- **Whitespace inside strings** is bounded too (WHITESPACE_RUN, below), where a string's text ends in whitespace.

The lexical state (outside a string, inside one, after a backslash; a string's last TAIL bytes) is followed from
the accepted tokens' bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

OUT, STR, ESC = 0, 1, 2
# the zones' widths (tokens): K covers how much one token written in the closing zone can lengthen the path (a
# `\u` escape's four hex digits, a number's `-`, `.` or exponent: at most ~4 tokens in GPT-2's vocabulary); NEAR is
# how much one token written before it may (an object or array item opened with its required members; a larger
# one, opened where fewer tokens are left, can still cut the answer: docs/structured.md); EXTRA how far the path
# may grow past its length at the last far checkpoint before the window opens (what ~FAR tokens can open). K and
# NEAR shrink with small budgets (`Rule.margins`).
K, NEAR, EXTRA = 4, 16, 48
# between checkpoints (every CHECKPOINT-th position) a position is free without a walk where the last checkpoint's
# path left MARGIN tokens to spare past the closing zone: the tokens written since (at most CHECKPOINT - 1) are taken
# to lengthen the path by no more than that
CHECKPOINT, MARGIN = 8, 16
# far from the end, a path every FAR-th position: the window (EXTRA tokens past its path's end) opens from it, so an
# answer whose path grew (an array item with many required members opened early) is caught in time
FAR = 32
WALK_LIMIT = 512    # the start's walk (U0): past this the rule is off for the grammar

# closing tokens by lexical state, in order (those that are one token in the vocabulary)
_STR_CLOSERS = ['"}', '"]', '"']
_OUT_CLOSERS = ['}}', '}]', ']}', ']]', '}', ']', '""', '0', '{}', '[]', 'null', 'false', 'true', ', ', ',', ': ',
                '"', '{', '[', '1', '-']
_ESC_CLOSERS = ['n', '"', '\\']
_FILLERS = ['0', 'a', 'A', '1', '-', ' ', '.']
# the shortest string llguidance's formats take (tried inside a string that cannot end: validated before use)
FORMAT_EXAMPLES = {
    "date-time": "2000-01-01T00:00:00Z", "date": "2000-01-01", "time": "00:00:00Z", "duration": "P1D",
    "email": "a@a.aa", "idn-email": "a@a.aa", "hostname": "a", "idn-hostname": "a", "ipv4": "0.0.0.0", "ipv6": "::",
    "uuid": "00000000-0000-0000-0000-000000000000", "uri": "a:", "iri": "a:", "uri-reference": "a",
    "iri-reference": "a", "uri-template": "a", "json-pointer": "", "relative-json-pointer": "0", "regex": "a",
    "unknown": "a",
}
MAX_EXAMPLES = 32
# Whitespace inside a string: the grammar writes none between JSON's tokens (constraint.JSON_OPTIONS), but inside a
# string it is content, and a small model stuck on spaces writes them until its budget ends (issue 57: a string of
# spaces to `length`). A run is bounded at 32 characters (code nested eight levels deep at four spaces, after its
# newline, still fits): past it, a token that would lengthen the run is refused, unless nothing else is allowed (a
# pattern that asks for the spaces). Held here, on the mask, and not as a `pattern` in the schema: llguidance's masks
# cost 4-5x as much inside strings that carry a pattern (35 -> 135 us a token on benchmarks/structured.py's schema,
# 10-14 -> 70 on json_object, measured); this is one vectorised AND, where a string's text ends in whitespace.
WHITESPACE_RUN = 32
FILLER_RUN = 8      # a string ending with this many of one filler takes no more: a character it can end after, else any


TAIL = 64   # bytes of a string's text kept in the lexical state (the examples' overlap is looked for in them)
START = (OUT, b"")


def leading_whitespace(data: bytes) -> int:
    """Whitespace characters `data` begins with, read as a JSON string's text (a space, or an escaped newline, tab
    or carriage return)."""
    n = i = 0
    while i < len(data):
        if data[i] == 0x20:
            i += 1
        elif data[i] == 0x5C and i + 1 < len(data) and data[i + 1] in b"ntr":
            i += 2
        else:
            break
        n += 1
    return n


def trailing_whitespace(tail: bytes) -> int:
    """Whitespace characters a string's text (`tail`, its last bytes) ends with."""
    run, i = 0, 0
    while i < len(tail):
        if tail[i] == 0x5C and i + 1 < len(tail):
            run = run + 1 if tail[i + 1] in b"ntr" else 0
            i += 2
        else:
            run = run + 1 if tail[i] == 0x20 else 0
            i += 1
    return run


def scan(state: int, data: bytes) -> tuple[int, bool, bool]:
    """The lexical state after `data` from `state`, whether `data` opened structure (`{`, `[` or `,` outside a
    string), and whether it opened a string."""
    grew = opened = False
    for b in data:
        if state == STR:
            if b == 0x22:
                state = OUT
            elif b == 0x5C:
                state = ESC
        elif state == ESC:
            state = STR
        elif b == 0x22:
            state, opened = STR, True
        elif b in (0x7B, 0x5B, 0x2C):
            grew = True
    return state, grew, opened


class Tables:
    """Per tokenizer (one per `Grammars`): each token's bytes, the closing tokens by lexical state, and the tokens
    that open structure read from outside a string and from inside one (bitmasks, as llguidance's)."""

    def __init__(self, lltok, vocab_size: int):
        self.lltok = lltok
        self.vocab_size = vocab_size
        self.eos = lltok.eos_token
        n = min(vocab_size, lltok.vocab_size)
        self.bytes = [b"" if lltok.is_special_token(t) else lltok.decode_bytes([t]) for t in range(n)]
        self.words = (vocab_size + 31) // 32
        # by the lexical state a token is read from: the tokens that open structure (`grow`), a string (`opens`)
        self.grow = np.zeros((3, self.words), dtype=np.uint32)
        self.opens = np.zeros((3, self.words), dtype=np.uint32)
        for t, data in enumerate(self.bytes):
            if any(c in data for c in b'{[,"'):
                for state in (OUT, STR):
                    _, grew, opened = scan(state, data)
                    if grew:
                        self.grow[state, t >> 5] |= np.uint32(1 << (t & 31))
                    if opened:
                        self.opens[state, t >> 5] |= np.uint32(1 << (t & 31))
        self.closers = {STR: self._ids(_STR_CLOSERS), OUT: self._ids(_OUT_CLOSERS), ESC: self._ids(_ESC_CLOSERS)}
        self.fillers = self._ids(_FILLERS)
        self.quote = self._ids(['"'])
        # the printable one-byte tokens (a string stuck on its fillers tries each before its closing quote)
        self.singles = [t for t, data in enumerate(self.bytes) if len(data) == 1 and 0x20 <= data[0] < 0x7F]
        # whitespace inside strings: `ws_over[k]`, the tokens that begin with more than k whitespace characters
        # (read as a string's text: a space, or the escapes for a newline, a tab, a carriage return)
        lead = np.array([leading_whitespace(data) for data in self.bytes] + [0] * (self.words * 32 - len(self.bytes)))
        bits = np.uint32(1) << (np.arange(32, dtype=np.uint32))
        self.ws_over = np.stack([((lead > k).reshape(-1, 32).astype(np.uint32) * bits).sum(axis=1, dtype=np.uint32)
                                 for k in range(WHITESPACE_RUN + 1)])

    def _ids(self, texts: list[str]) -> list[int]:
        out = []
        for text in texts:
            ids = self.lltok.tokenize_str(text)
            if len(ids) == 1 and ids[0] not in out:
                out.append(ids[0])
        return out

    def state_after(self, lex: tuple[int, bytes], token: int) -> tuple[int, bytes]:
        """The lexical state (mode, the current string's last TAIL bytes of text) after `token`."""
        if not 0 <= token < len(self.bytes):
            return lex
        mode, tail = lex
        data = self.bytes[token]
        new = scan(mode, data)[0]
        if new == OUT:
            return START
        if mode == OUT or (b'"' in data and mode != ESC):   # a string opened within the token: its text after it
            return new, data[data.rindex(b'"') + 1:][-TAIL:]
        return new, (tail + data)[-TAIL:]

    def tokens(self, data: bytes) -> list[int]:
        return self.lltok.tokenize_bytes(data)


@dataclass
class Rule:
    """One compiled grammar's closing rule: the tables, the schema's example strings (`examples`), the closing path's
    length from the grammar's start (`u0`; None: none found within WALK_LIMIT, the rule is off), and whether the
    output is JSON throughout (the closing zone's filter reads JSON's lexical structure)."""
    tables: Tables
    examples: list[tuple[bytes, list[int]]] = field(default_factory=list)
    u0: int | None = None
    json: bool = True

    def margins(self, budget: int) -> tuple[int, int]:
        """(K, NEAR) for an output of `budget` tokens: the defaults, narrower for small budgets (a sixteenth of the
        budget at most for K, an eighth for NEAR), so a short answer is not all closing."""
        return min(K, budget // 16), min(NEAR, budget // 8)

    def applies(self, budget: int) -> bool:
        """Whether the rule can help an output of `budget` tokens: a path from the start was found, and fits."""
        return self.u0 is not None and self.u0 + 1 <= budget


Path = tuple[list[list[int]], bool]   # a closing path: its steps (each a list of tokens), whether it closes


class Closer:
    """One output's closing rule (a `Matcher` holds it): the lexical state and token at each position, and the
    closing paths computed so far by position (reused where they still hold: `restrict`)."""

    def __init__(self, rule: Rule, budget: int):
        self.rule, self.budget = rule, budget
        self.lex: list[tuple[int, bytes]] = [START]
        self.toks: list[int] = []
        self.paths: dict[int, Path] = {}

    def accept(self, token: int) -> None:
        self.lex.append(self.rule.tables.state_after(self.lex[-1], token))
        self.toks.append(token)

    def rollback(self, n: int) -> None:
        del self.lex[-n:], self.toks[-n:]
        pos = len(self.toks)
        for p in [p for p in self.paths if p > pos]:
            del self.paths[p]

    def restrict(self, ll, words: np.ndarray, used: int, scratch: np.ndarray) -> str:
        """Apply the rule to this position's bitmask `words` (uint32: llguidance's mask just computed for `ll`'s
        state), `used` tokens of the output written. Returns the zone: "free", "closing" or "forced". Writes `words`
        only after its walks (which are what may fail)."""
        rule, budget = self.rule, self.budget
        c = len(self.toks)
        self._bound_whitespace(words, c)
        left = budget - used
        if not rule.applies(budget) or left <= 0:
            return "free"
        k, near = rule.margins(budget)
        # far from the end: free where the last far checkpoint's path (every FAR-th position) leaves more than
        # the window's worth of tokens; a path that could not close there (the answer had outgrown its budget)
        # leaves it free too
        far = c - c % FAR
        steps, done = self._path(ll, c, left, words, scratch) if far == c else \
            self._path_at(ll, far, left + c - far, scratch)
        if not done or left > sum(map(len, steps)) + 1 + k + near + EXTRA:
            return "free"
        if c % CHECKPOINT:
            # between checkpoints: free without a walk where the checkpoint's path left room to spare past what
            # the tokens written since may add (MARGIN); the checkpoint's path is computed here if nobody did
            c0 = c - c % CHECKPOINT
            steps, done = self._path_at(ll, c0, left + c - c0, scratch)
            u = sum(map(len, steps))
            if done and left - 1 - k - near - MARGIN > u:
                return "free"
        steps, done = self._path(ll, c, left, words, scratch)
        path = [t for step in steps for t in step]
        if not done or (path and not _has(words, path[0])):
            return "free"   # no way to close in the tokens left: the answer is cut whatever it writes
        slack = left - 1 - len(path)
        if slack <= k:
            keep = path[0] if path else rule.tables.eos
            if not _has(words, keep):
                return "free"
            words[:] = 0
            words[keep >> 5] = np.uint32(1 << (keep & 31))
            return "forced"
        mode = self.lex[c][0]
        if slack <= k + near and rule.json and mode != ESC:
            # no structure opened, and no string where the path writes another value (a string in place of the
            # path's `null` or `0`: its pattern's text, or the model's, can cost many tokens more)
            t = rule.tables
            strings = t.opens[mode] if not (path and _has(t.opens[mode], path[0])) else np.uint32(0)
            words &= ~(t.grow[mode] | strings)
            if path:   # (else the grammar may end here: EOS, which opens nothing, stays allowed)
                words[path[0] >> 5] |= np.uint32(1 << (path[0] & 31))
            return "closing"
        return "free"

    def _bound_whitespace(self, words: np.ndarray, c: int) -> None:
        """Inside a string whose text ends in whitespace: refuse the tokens that would make the run longer than
        WHITESPACE_RUN, unless they are all the mask allows."""
        mode, tail = self.lex[c]
        if mode == STR and tail and (tail[-1] == 0x20 or tail[-2:] in (b"\\n", b"\\t", b"\\r")):
            run = trailing_whitespace(tail)
            if run:
                narrowed = words & ~self.rule.tables.ws_over[max(0, WHITESPACE_RUN - run)]
                if narrowed.any():
                    words[:] = narrowed

    def _path(self, ll, c: int, left: int, words: np.ndarray, scratch: np.ndarray) -> Path:
        """The closing path at position `c` (the current one), at most `left - 1` tokens: the previous position's
        without its first token where the model took that token and this position's first step is the same as
        that path's next (the rest is then the same walk from the same state), else walked."""
        if c in self.paths:
            return self.paths[c]
        lex = self.lex[c]
        first = None if ll.is_accepting() else _step(ll, self.rule, lex, words, scratch)
        prev = self.paths.get(c - 1)
        path = None
        if first and prev is not None and prev[0] and prev[0][0][0] == self.toks[c - 1]:
            head = prev[0][0]
            rest = ([head[1:]] if len(head) > 1 else []) + prev[0][1:]
            if rest and rest[0] == first:
                path = (rest, prev[1])
        if path is None:
            path = walk(ll, self.rule, lex, left - 1, words, scratch, first=first)
        self.paths[c] = path
        for p in [p for p in self.paths if p < c - 2 * FAR or (p < c - 2 and p % CHECKPOINT)]:
            del self.paths[p]   # (kept: the last two positions', and the checkpoints' within 2 FAR)
        return path

    def _path_at(self, ll, c0: int, left: int, scratch: np.ndarray) -> Path:
        """The closing path at an earlier position `c0` (a checkpoint; `left` tokens left there), computed from
        there if it was not: the tokens since rolled back, the mask there computed, the walk made, the tokens taken
        again."""
        if c0 in self.paths:
            return self.paths[c0]
        back = self.toks[c0:]
        ll.rollback(len(back))
        try:   # (the mask there as its fill gives it to `_path`: whitespace bounded)
            ll.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
            words = scratch.copy()
            self._bound_whitespace(words, c0)
            return self._path(ll, c0, left, words, scratch)
        finally:
            if not ll.consume_tokens(back):   # (they were taken before, from this state)
                raise RuntimeError("the grammar refused tokens it took before")


def _has(words: np.ndarray, t: int) -> bool:
    return 0 <= t < words.shape[0] * 32 and bool((int(words[t >> 5]) >> (t & 31)) & 1)


def _lowest(words: np.ndarray, eos: int) -> int | None:
    """The lowest-numbered token `words` allows, end-of-text aside."""
    for i in np.flatnonzero(words):
        w = int(words[i])
        if i == eos >> 5:
            w &= ~(1 << (eos & 31))
        if w:
            return int(i) * 32 + ((w & -w).bit_length() - 1)
    return None


def walk(ll, rule: Rule, lex: tuple[int, bytes], limit: int, words: np.ndarray | None = None,
         scratch: np.ndarray | None = None, first: list[int] | None = None) -> Path:
    """The closing path from `ll`'s state (lexical state `lex`; `START` at the grammar's start): its steps (at most
    `limit` tokens in all) and whether it ends where the grammar may end. `words`: this position's mask (the first
    step's first token is then one the mask allows: the mask takes only the canonical tokens of forced text);
    `scratch`: room for a mask where nothing else helps; `first`: the first step, if already chosen. `ll` is left
    in the state it was in."""
    t = rule.tables
    steps: list[list[int]] = []
    n_out = 0
    try:
        while n_out < limit:
            if ll.is_accepting():
                return steps, True
            step = first if (first is not None and not steps) else \
                _step(ll, rule, lex, words if not steps else None, scratch)
            if not step:
                break
            step = step[: limit - n_out]
            n = ll.try_consume_tokens(step)
            if n:
                steps.append(step[:n])
                n_out += n
                for tok in step[:n]:
                    lex = t.state_after(lex, tok)
            if n < len(step):
                break
        return steps, ll.is_accepting()
    finally:
        if n_out:
            ll.rollback(n_out)


def _step(ll, rule: Rule, lex: tuple[int, bytes], words: np.ndarray | None, scratch: np.ndarray | None) -> list[int]:
    """The closing path's next tokens (see the module's docstring)."""
    t = rule.tables
    if words is not None:
        def ok(toks: list[int]) -> bool:
            return _has(words, toks[0]) and (len(toks) == 1 or ll.validate_tokens(toks) == len(toks))
    else:
        def ok(toks: list[int]) -> bool:
            return ll.validate_tokens(toks) == len(toks)
    forced = ll.compute_ff_bytes()
    if forced:
        toks = t.tokens(forced)
        if toks and ok(toks):
            return toks
    mode, tail = lex
    for c in t.closers[mode]:
        if ok([c]):
            return [c]
    if mode == STR and rule.examples:   # a string that cannot end yet: the rest of one of the schema's strings,
        started = []                    # those it has begun first
        if tail:
            for text, _ in rule.examples:
                k = _overlap(tail, text)
                if k:
                    started.append(text[k:])
        for toks in [t.tokens(rest) for rest in sorted(started, key=len)] + [toks for _, toks in rule.examples]:
            if toks and ok(toks):
                return toks
    # (a string that already ends with FILLER_RUN of one filler is not going where it can end: the fillers stop)
    stuck = mode == STR and any(tail.endswith(t.bytes[c] * FILLER_RUN) for c in t.fillers)
    for c in t.fillers if not stuck else ():
        if ok([c]):
            return [c]
    if mode == STR and t.quote:   # one character after which the string can end (a uri's `@`)
        for c in t.singles:
            if ll.validate_tokens([c, t.quote[0]]) == 2 and (words is None or _has(words, c)):
                return [c]
    if words is None:
        if scratch is None:
            scratch = np.zeros(t.words, dtype=np.uint32)
        ll.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        words = scratch
    low = _lowest(words, t.eos)
    return [] if low is None else [low]


def _overlap(tail: bytes, ex: bytes) -> int:
    """The longest end of `tail` that begins `ex` (short of its closing quote): how much of `ex` is written."""
    last = tail[-1]
    for k in range(min(len(tail), len(ex) - 1), 0, -1):
        if ex[k - 1] == last and tail.endswith(ex[:k]):
            return k
    return 0


# -- the schema's example strings ----------------------------------------------------------------------------------
def examples(schema: Any, tables: Tables) -> list[tuple[bytes, list[int]]]:
    """The JSON text, and its tokens, (after the opening quote, the closing one included) of strings the schema names or
    implies: `enum` / `const` strings, the shortest match of each `pattern` (and `patternProperties` key), an
    example of each `format`; shortest first, at most MAX_EXAMPLES."""
    found: set[str] = set()

    def visit(node: Any) -> None:
        if len(found) > 4 * MAX_EXAMPLES:
            return
        if isinstance(node, list):
            for x in node:
                visit(x)
            return
        if not isinstance(node, dict):
            return
        for key, value in node.items():
            if key in ("enum", "const"):
                for v in (value if key == "enum" and isinstance(value, list) else [value]):
                    if isinstance(v, str):
                        found.add(v)
            elif key == "pattern" and isinstance(value, str):
                s = shortest_match(value)
                if s is not None:
                    found.add(s)
            elif key == "format" and isinstance(value, str):
                found.add(FORMAT_EXAMPLES.get(value, "a"))
            elif key == "patternProperties" and isinstance(value, dict):
                for pattern in value:
                    s = shortest_match(pattern)
                    if s is not None:
                        found.add(s)
            if isinstance(value, (dict, list)):
                visit(value)

    visit(schema)
    texts = [json.dumps(s, ensure_ascii=False)[1:].encode() for s in sorted(found, key=lambda s: (len(s), s))]
    return [(text, tables.tokens(text)) for text in texts[:MAX_EXAMPLES]]


def shortest_match(pattern: str) -> str | None:
    """A short string `pattern` matches (JSON Schema's `pattern` searches: the match alone is such a string), or
    None where it cannot tell (back-references, an unparsable pattern). Look-arounds are ignored (the string is then
    only a candidate: the walk validates it against the grammar before use)."""
    try:
        import re._parser as sre   # Python 3.11+
    except ImportError:  # pragma: no cover - older Pythons
        import sre_parse as sre    # type: ignore[no-redef]
    try:
        parsed = sre.parse(pattern)
    except Exception:  # noqa: BLE001 - a pattern Python cannot read: no example
        return None
    return _gen(parsed, sre, 0)


def _gen(items, sre, depth: int) -> str | None:
    c = sre   # the opcode constants (re._constants through the parser module)
    if depth > 50:
        return None
    out = []
    for op, av in items:
        if op is c.LITERAL:
            out.append(chr(av))
        elif op is c.NOT_LITERAL:
            out.append("a" if av != ord("a") else "b")
        elif op is c.ANY:
            out.append("a")
        elif op is c.IN:
            ch = _class_char(av, c)
            if ch is None:
                return None
            out.append(ch)
        elif op in (c.MAX_REPEAT, c.MIN_REPEAT) or getattr(c, "POSSESSIVE_REPEAT", None) is op:
            lo, _, sub = av
            s = _gen(sub, sre, depth + 1)
            if s is None:
                return None
            out.append(s * min(lo, 256))
        elif op is c.SUBPATTERN:
            s = _gen(av[-1], sre, depth + 1)
            if s is None:
                return None
            out.append(s)
        elif op is c.BRANCH:
            options = [s for s in (_gen(b, sre, depth + 1) for b in av[1]) if s is not None]
            if not options:
                return None
            out.append(min(options, key=len))
        elif op in (c.AT, c.ASSERT, c.ASSERT_NOT):
            continue
        elif getattr(c, "ATOMIC_GROUP", None) is op:
            s = _gen(av, sre, depth + 1)
            if s is None:
                return None
            out.append(s)
        else:
            return None
    return "".join(out)


def _class_char(items, c) -> str | None:
    """A character of a character class (`[...]`): a letter or digit where it has one."""
    negate = any(op is c.NEGATE for op, _ in items)
    allowed: list[int] = []
    banned: set[int] = set()
    for op, av in items:
        if op is c.LITERAL:
            (banned.add if negate else allowed.append)(av)
        elif op is c.RANGE:
            if negate:
                banned.update(range(av[0], min(av[1], 0x2FFF) + 1))
            else:
                allowed.append(av[0])
        elif op is c.CATEGORY:
            name = str(av)
            pick = {"CATEGORY_DIGIT": "0", "CATEGORY_NOT_DIGIT": "a", "CATEGORY_WORD": "a", "CATEGORY_NOT_WORD": "-",
                    "CATEGORY_SPACE": " ", "CATEGORY_NOT_SPACE": "a"}.get(name)
            if pick is None:
                return None
            if negate:
                banned.update(ord(x) for x in {"CATEGORY_DIGIT": "0123456789", "CATEGORY_WORD": "aA0_",
                                               "CATEGORY_SPACE": " "}.get(name, ""))
            else:
                allowed.append(ord(pick))
    if negate:
        for ch in "a0A-_ .b1":
            if ord(ch) not in banned:
                return ch
        return None
    if not allowed:
        return None
    best = sorted(allowed, key=lambda x: (not chr(x).isalnum(), x))[0]
    return chr(best)
