"""Constrained decoding: a request's output held to a JSON schema, a regex or a grammar, token by token.

The grammar library is llguidance (docs/structured.md says why: compiling a schema takes ~1 ms, so a new
schema never stalls the batch; unsupported schema keywords are errors that name the keyword; its mask costs
well under a millisecond per token on the GPT-2 vocabulary, measured). The engine stays on token ids:

- `Constraint` is what a request asks for (kind + source text): plain data on `SamplingParams`, so plans
  stay picklable (scale-out ships them to replicas).
- `Grammars` (one per engine) holds llguidance's view of the tokenizer (built once, ~0.5 s) and the
  compiled grammars, cached by content: each request gets a copy of a compiled matcher, never a recompile.
- `Matcher` is one output's state: the allowed-token mask for the next position (computed off the engine
  thread's critical path: llguidance drops the GIL, so the mask for step t+1 is computed in a worker thread
  while step t+1's forward pass runs), `accept` after each token, `rollback` for speculation's drafts. EOS
  is in the mask only where the grammar may end. Under JSON (`json_object`, `json_schema`, tool calls) and a
  budget (the request's `max_tokens`), the mask also follows the closing rule (engine/schema_close.py): near the
  budget's end, only tokens that keep the answer able to close within it.

`Sampler` applies the mask to the row's logits before anything else, so greedy takes the argmax over allowed
tokens, sampling draws from the masked distribution, and logprobs are those of that distribution.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ValidationError
from . import schema_close
from .schema_check import SchemaCheck, keyword_paths

KINDS = ("json_schema", "json_object", "regex", "grammar")
# JSON output without free whitespace: ", " and ": " as Python's json.dumps writes them (a small model given
# free whitespace can spend its whole budget on spaces and newlines)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# over whatever the schema's own "x-guidance" says: a oneOf whose branches may overlap is compiled as anyOf
# (the answer then checked, as vLLM and SGLang compile it unchecked); never ignore a keyword silently
JSON_OVERRIDES = {"coerce_one_of": True, "lenient": False}
CIRCULAR = "circular references with sibling keys"   # llguidance's refusal of a recursive $ref it must intersect
ANY_JSON_OBJECT = {"type": "object"}
CACHE_SIZE = 256          # compiled grammars kept per engine (least recently used dropped first)
# the masks' fills while the engine thread and the native executor's threads run: one worker, which takes at most
# one core from them at a time (two took both mid-step: 16 constrained rows 0.79 of free text's speed against
# 0.87 with one, in-process, docs/structured.md "Cost per token")
log = logging.getLogger(__name__)
_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyloop-mask")


@dataclass(frozen=True)
class Constraint:
    """What an output must match. `kind`: json_schema (source: the schema as JSON text), json_object (any
    JSON object), regex, or grammar (llama.cpp's GBNF, or Lark as llguidance reads it). `param`: the request
    field to name in errors (`response_format`, `json_schema`, ...)."""
    kind: str
    source: str = ""
    param: str = "response_format"
    warnings: tuple[str, ...] = ()   # what building `source` left unenforced (a tool grammar's schemas)

    @classmethod
    def json_schema(cls, schema: Any, param: str = "response_format") -> "Constraint":
        if not isinstance(schema, dict):
            raise ValidationError(f"{param}: the JSON schema must be an object, got {type(schema).__name__}",
                                  param=param)
        # as given (no key sorting: the order of `properties` is the order the output writes them in)
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), param)

    def prepared(self, recursive_refs: bool = False):
        """A json_schema's `schema_rewrite.Prepared`: the schema llguidance compiles, warnings, loose parts
        (`recursive_refs`: the second try, `schema_rewrite.prepare`)."""
        from .schema_rewrite import prepare

        return prepare(json.loads(self.source), recursive_refs)

    def grammar_text(self, recursive_refs: bool = False) -> str:
        """llguidance's grammar for this constraint (raises ValidationError naming `param`)."""
        import llguidance

        try:
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.prepared(recursive_refs).schema,
                                                                     defaults=JSON_OPTIONS,
                                                                     overrides=JSON_OVERRIDES)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.source)
            if self.kind == "grammar":
                from llguidance.gbnf_to_lark import any_to_lark

                return llguidance.LLMatcher.grammar_from_lark(any_to_lark(self.source))
        except Exception as exc:  # noqa: BLE001 - whatever the converters raise, the client's text is at fault
            raise ValidationError(f"{self.param}: {type(exc).__name__}: {exc}" if not isinstance(exc, ValueError)
                                  else f"{self.param}: {exc}", param=self.param) from None
        raise ValidationError(f"{self.param}: unknown constraint kind {self.kind!r}", param=self.param)


def _lltokenizer(tokenizer, vocab_size: int):
    """llguidance's tokenizer for ours: GPT-2 BPE through tiktoken, imported checkpoints through their
    tokenizer.json. `vocab_size`: the model's (a padded vocabulary has ids no text encodes to)."""
    import llguidance
    from llguidance.tiktoken import lltokenizer_from_encoding

    from ..tokenizer import HFTokenizer

    if isinstance(tokenizer, HFTokenizer):
        return llguidance.LLTokenizer(tokenizer.json_text, n_vocab=vocab_size, eos_token=list(tokenizer.eos_ids))
    return lltokenizer_from_encoding(tokenizer._enc, n_vocab=vocab_size, eos_token=tokenizer.eos_id)


class Grammars:
    """One engine's grammar compiler: llguidance's tokenizer (made on first use) and compiled matchers by
    content. Thread-safe: requests are planned in worker threads, matchers made on the engine thread."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll = None
        self._tables = None           # the closing rule's tables (engine/schema_close.py), made on first use
        self._lock = threading.Lock()
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self.compiles = 0           # grammars compiled (cache misses), for tests and /metrics

    def lltokenizer(self):
        with self._lock:
            if self._ll is None:
                if self.tokenizer is None:
                    raise ValidationError("response_format: this model has no tokenizer to constrain",
                                          param="response_format")
                self._ll = _lltokenizer(self.tokenizer, self.vocab_size)
            return self._ll

    def tables(self) -> schema_close.Tables:
        ll = self.lltokenizer()
        with self._lock:
            if self._tables is None:
                self._tables = schema_close.Tables(ll, self.vocab_size)
            return self._tables

    def compiled(self, constraint: Constraint):
        """The compiled matcher of `constraint` in its initial state (shared: copy before use)."""
        return self._entry(constraint)[0]

    def _entry(self, constraint: Constraint) -> tuple[Any, SchemaCheck | None, schema_close.Rule | None]:
        import llguidance

        with self._lock:
            hit = self._compiled.get(constraint)
            if hit is not None:
                self._compiled.move_to_end(constraint)
                return hit
        text = constraint.grammar_text()
        matcher = llguidance.LLMatcher(self.lltokenizer(), text)
        second = False
        if matcher.is_error() and constraint.kind == "json_schema" and CIRCULAR in matcher.get_error():
            # a recursive $ref llguidance would have to intersect: once more with those intersections
            # rewritten away (schema_rewrite.prepare's recursive_refs), if that compiles
            again = llguidance.LLMatcher(self.lltokenizer(), constraint.grammar_text(recursive_refs=True))
            if not again.is_error():
                matcher, second = again, True
        if matcher.is_error():
            error = matcher.get_error()
            schema_feature = constraint.kind == "json_schema" or "coerce_one_of" in error or "nimplemented" in error
            raise ValidationError(f"{constraint.param}: {_reason(error, constraint)}", param=constraint.param,
                                  code="unsupported_schema" if schema_feature else None)
        check = SchemaCheck.of(constraint, matcher.get_grammar_warnings(), second) \
            if constraint.kind == "json_schema" else None
        rule = self._closing_rule(constraint, matcher)
        with self._lock:
            self.compiles += 1
            self._compiled[constraint] = (matcher, check, rule)
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher, check, rule

    def _closing_rule(self, constraint: Constraint, matcher) -> schema_close.Rule | None:
        """The closing rule of a JSON output (json_object, json_schema, tool calls: engine/schema_close.py), with
        the schema's example strings and the closing path's length from the grammar's start; None for other
        constraints (a regex or grammar of the client's: what closing means there is the client's)."""
        if constraint.kind not in ("json_object", "json_schema") and constraint.param != "tools":
            return None
        tables = self.tables()
        schemas: list[Any] = []
        if constraint.kind == "json_schema":
            schemas.append(json.loads(constraint.source))
        elif constraint.kind == "grammar":   # a tool grammar: the JSON schemas after each %json
            dec, at = json.JSONDecoder(), constraint.source.find("%json ")
            while at >= 0:
                try:
                    schemas.append(dec.raw_decode(constraint.source, at + 6)[0])
                except ValueError:
                    pass
                at = constraint.source.find("%json ", at + 6)
        rule = schema_close.Rule(tables, schema_close.examples(schemas, tables),
                                 json="<function=" not in constraint.source)
        steps, done = schema_close.walk(matcher.deep_copy(), rule, schema_close.START, schema_close.WALK_LIMIT)
        rule.u0 = sum(map(len, steps)) if done else None
        return rule

    def check(self, constraint: Constraint) -> tuple[str, ...]:
        """Compile now (at planning, before the request is queued): a bad constraint is a 400 naming it.
        Returns the warnings the response carries (schema parts not enforced exactly: docs/structured.md)."""
        check = self._entry(constraint)[1]
        return constraint.warnings + (check.warnings if check is not None else ())

    def schema_check(self, constraint: Constraint | None) -> "SchemaCheck | None":
        """The check a complete answer goes through (a json_schema with loose parts), else None."""
        if constraint is None or constraint.kind != "json_schema":
            return None
        check = self._entry(constraint)[1]
        return check if check is not None and check.loose else None

    def matcher(self, constraint: Constraint, budget: int | None = None) -> "Matcher":
        """A fresh matcher for one output; `budget`: the output's max_tokens (the closing rule's, where the
        constraint has one: engine/schema_close.py)."""
        compiled, _, rule = self._entry(constraint)
        return Matcher(compiled.deep_copy(), self.vocab_size, self.lltokenizer().eos_token,
                       rule=rule if budget is not None else None, budget=budget)


def _reason(message: str, constraint: Constraint) -> str:
    """llguidance's error, made to say what to fix (its messages name the keyword: "Unimplemented keys:
    [\"contains\"]"; the schema's paths to it are added)."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    message = "; ".join(lines[:3]) if lines else "invalid grammar"
    if "coerce_one_of" in message:   # llguidance's option, not the API's: say what it means here
        return ("a oneOf whose branches may overlap cannot be held in this model's tool-call format (its calls are "
                "not checked afterwards); use anyOf, or response_format, which takes it")
    if constraint.kind == "json_schema" and CIRCULAR in message:
        target = message.rsplit("#", 1)[-1].strip() if "#" in message else ""
        paths = [p for p in keyword_paths(json.loads(constraint.source), "$ref")
                 if _ref_at(json.loads(constraint.source), p) == f"#{target}"][:5]
        return (f"a schema feature this server does not support: a recursive $ref (#{target}, referred to at "
                f"{', '.join(paths) or '#'}) that would have to be intersected with other keywords (beside it, in "
                f"an allOf, or a patternProperties schema that a declared property also matches); remove the "
                f"recursion or the overlap ({message})")
    if constraint.kind == "json_schema" and ("not present in a registry" in message
                                             or (message.startswith("Pointer ") and "does not exist" in message)):
        return (f"$ref: a reference that does not resolve within the schema (a pointer to nothing, another "
                f"document, or an `id`/`$id` that changed the base URI it is resolved against): {message}; refer "
                f"within the schema")
    if "Unimplemented" in message or "unimplemented" in message:
        where = ""
        if constraint.kind == "json_schema":
            keys = re.findall(r'"([^"]+)"', message.split("Unimplemented keys:", 1)[-1].split("]", 1)[0])
            paths = list(dict.fromkeys(p for k in keys for p in keyword_paths(json.loads(constraint.source), k)))[:5]
            where = f" (at {', '.join(paths)})" if paths else ""
        return f"a schema feature this server does not support: {message}{where}; remove it from the schema"
    return message


def _ref_at(schema: Any, pointer: str) -> Any:
    """The `$ref` of the subschema at `pointer` ("#/a/b", as keyword_paths writes it)."""
    node = schema
    for part in pointer[2:].split("/") if pointer != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node.get(part) if isinstance(node, dict) else None
    return node.get("$ref") if isinstance(node, dict) else None


class Matcher:
    """One output's grammar state. The next position's allowed tokens are computed once per position, as
    llguidance's bitmask (in a worker thread right after the previous token was accepted); `allows` reads a
    bit of it, `mask`, `forbidden` and `allowed_ids` unpack it when asked (once per position)."""

    def __init__(self, ll, vocab_size: int, eos: int, rule: schema_close.Rule | None = None,
                 budget: int | None = None):
        self.ll = ll
        self.vocab_size, self.eos = vocab_size, eos
        # the closing rule (engine/schema_close.py): the output's max_tokens, the tokens of the output this matcher
        # is not fed (`outside`: a thinking block's, set by the engine), the lexical state at each position
        self.budget = budget
        self.closer = schema_close.Closer(rule, budget) if rule is not None and budget is not None else None
        self.outside = None
        self._used = 0                        # the output's tokens before this position (read by the fill)
        self._scratch: np.ndarray | None = None
        self.zone = "free"                    # the closing rule's zone at this position (tests, benchmarks)
        self.error: str | None = None   # set if a token the grammar refuses was forced in: then only EOS
        self._bits = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)   # (1, V/32) bitmask
        self._words = self._bits[0].numpy()   # the same memory: bit j of word i = token 32 i + j
        self._ready = False                   # the bitmask holds this position's mask
        self._unpacked: dict[str, Any] = {}   # this position's mask in other forms, made when asked
        self._pending: Future | None = None
        self._filled = False                  # the bitmask holds this position's mask as llguidance gave it
        self.lazy = False                     # a position's fill waits until its mask is read (`lazily`)
        self.consumed = 0
        self._prefetch()

    def _fill(self) -> None:
        v = self._bits[0]
        self.ll.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())  # drops the GIL
        self.zone = "free"
        if self.closer is not None and self.error is None:
            if self._scratch is None:
                self._scratch = np.zeros_like(self._words, dtype=np.uint32)
            try:   # (the rule writes the mask only after its walks, which are what may fail)
                self.zone = self.closer.restrict(self.ll, self._words.view(np.uint32), self._used, self._scratch)
            except Exception:  # noqa: BLE001 - the rule only narrows the mask: if it fails, the grammar's stands
                log.exception("the JSON closing rule failed; this position keeps the grammar's mask")

    def _prefetch(self) -> None:
        if self.closer is not None:   # (here, on the engine thread: what the fill reads stays as it was)
            self._used = self.consumed + (self.outside() if self.outside is not None else 0)
        self._ready = self._filled = False
        self._unpacked = {}
        self._pending = None if self.lazy else _POOL.submit(self._fill)

    @contextmanager
    def lazily(self):
        """Within: a position's mask is computed when something reads it, on the reading thread (the native
        lone steps, engine/fast_steps.py: the fill right after the token is taken, inside the call; a worker
        thread would take a core from the executor's threads mid-step and stall them at their next barrier,
        measured slower: docs/structured.md "Cost per token"); after: in the worker as soon as the position
        begins again."""
        self.lazy = True
        try:
            yield self
        finally:
            self.lazy = False
            if not self._filled and self._pending is None:
                self._pending = _POOL.submit(self._fill)

    def _current(self) -> np.ndarray:
        """This position's bitmask words (waiting for the worker if it is not done yet)."""
        if not self._ready:
            self._wait()   # every position's fill was started when the position began (_prefetch)
            if not self._filled:   # (lazy: nobody started it)
                self._fill()
                self._filled = True
            if self.error is not None or not self._words.any():  # nothing can follow: end the output
                self._words[:] = 0
                self._words.view(np.uint32)[self.eos >> 5] = 1 << (self.eos & 31)
            self._ready = True
        return self._words

    def bitmask(self) -> int:
        """The address of this position's bitmask words, once they hold it (waiting for the worker's fill): what
        the native head reads to pick the token itself (`tl_sampling.mask`). The words stay at this address for
        the matcher's life."""
        self._current()
        return self._bits.data_ptr()

    def _bools(self, invert: bool) -> np.ndarray:
        u8 = self._current().view(np.uint8)
        return np.unpackbits(~u8 if invert else u8, bitorder="little")[: self.vocab_size].view(np.bool_)

    def mask(self) -> torch.Tensor:
        """(V,) bool: the tokens the grammar allows next (EOS only where it may end)."""
        if "mask" not in self._unpacked:
            self._unpacked["mask"] = torch.from_numpy(self._bools(invert=False))
        return self._unpacked["mask"]

    def forbidden(self) -> torch.Tensor:
        """(V,) bool: the tokens the grammar refuses next."""
        if "forbidden" not in self._unpacked:
            self._unpacked["forbidden"] = torch.from_numpy(self._bools(invert=True))
        return self._unpacked["forbidden"]

    def allowed_ids(self) -> torch.Tensor:
        """(n,) int64: the ids of the tokens the grammar allows next, ascending."""
        if "ids" not in self._unpacked:
            self._unpacked["ids"] = torch.from_numpy(np.flatnonzero(self._bools(invert=False)))
        return self._unpacked["ids"]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (V,) with the disallowed tokens at -inf (a new tensor)."""
        forbidden = self.forbidden()
        if logits.shape[-1] == forbidden.shape[0]:
            return logits.masked_fill(forbidden.to(logits.device), float("-inf"))
        n = min(logits.shape[-1], forbidden.shape[0])
        out = torch.full_like(logits, float("-inf"))
        out[:n] = logits[:n].masked_fill(forbidden[:n].to(logits.device), float("-inf"))
        return out

    def allows(self, token: int) -> bool:
        if not 0 <= token < self.vocab_size:
            return False
        return bool((int(self._current()[token >> 5]) >> (token & 31)) & 1)

    def accept(self, token: int) -> None:
        """Advance past `token` (sampled under the mask, so allowed); the next mask starts computing now."""
        self._wait()
        if self.error is None and not self.ll.consume_token(token):
            self.error = self.ll.get_error() or f"token {token} refused"
        self.consumed += 1
        if self.closer is not None:
            self.closer.accept(token)
        self._prefetch()

    def forced(self, limit: int, stop=()) -> list[int]:
        """The tokens the grammar forces next, at most `limit`, up to the first in `stop` or EOS (those stay the
        head's to pick): llguidance's fast-forward tokens, the canonical tokens of the text the grammar's lexer
        forces, each the only token its position's bitmask allows (the pick a step would make there, whatever
        its draw; tests/engine/test_constraint.py compares the two paths). Not taken: `accept` each."""
        if limit <= 0:
            return []
        self._wait()
        if self.error is not None:
            return []
        out: list[int] = []
        for t in self.ll.compute_ff_tokens():
            if len(out) >= limit or t == self.eos or t in stop:
                break
            out.append(t)
        return out

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (speculation's rejected drafts)."""
        if n <= 0:
            return
        self._wait()
        self.ll.rollback(n)
        self.consumed -= n
        if self.closer is not None:
            self.closer.rollback(n)
        self._prefetch()

    def mask_after(self, paths: list[list[int]], scores: torch.Tensor, cols: torch.Tensor | None) -> torch.Tensor:
        """Speculation's drafts under the grammar: `scores` (len(paths), n) over the draft columns `cols`
        (token ids; None: the whole vocabulary) with -inf where the grammar, after each path of tokens from
        the current state, refuses the token (a path the grammar refuses itself: its whole row). The state is
        walked down each path and rolled back. A row with nothing allowed is left as it is (the verifier
        refuses whatever it proposes)."""
        return mask_paths(self, paths, scores, cols)

    def _wait(self) -> None:
        """Wait for the worker's fill of this position's mask, if one runs."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
            self._filled = True

    @property
    def accepting(self) -> bool:
        self._wait()
        return self.ll.is_accepting()


def mask_paths(m, paths: list[list[int]], scores: torch.Tensor, cols: torch.Tensor | None) -> torch.Tensor:
    """`Matcher.mask_after` for any matcher with its interface (`accept`, `allows`, `mask`, `rollback`, `eos`;
    a ThinkingMatcher's too): each path walked from the current state, its row masked by what the state then
    allows (a path the matcher refuses itself: its whole row; a state that is `free`, nothing), rolled back."""
    out = scores.clone()
    for r, path in enumerate(paths):
        walked = 0
        for tok in path:
            if tok == m.eos or not m.allows(tok):
                break
            m.accept(tok)
            walked += 1
        if walked < len(path):
            allowed = torch.zeros(out.shape[-1], dtype=torch.bool)
        else:
            allowed = None if getattr(m, "free", False) else m.mask() if cols is None else m.mask()[cols]
        m.rollback(walked)
        if allowed is not None and bool(allowed.any()):
            out[r] = out[r].masked_fill(~allowed.to(out.device), float("-inf"))
    return out
