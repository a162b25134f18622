"""The layer above the engine core: token ids -> text events (detokenizer, stop strings, stats).

The core (`engine.serving.BatchEngine`) works on token ids only. For each output it feeds every new token
to an output stream and asks it whether the output is over; the stream decides what the caller sees.
`TokenStream` is the ids-only stream (stop token ids and EOS); `TextStream` adds the streaming
detokenizer and stop strings, for the Python API, the CLI and the server.
"""

from __future__ import annotations

from typing import Iterable

import time
from dataclasses import dataclass, field
from typing import Any

from ..stops import StopMatcher


@dataclass
class StreamEvent:
    token_ids: list[int]           # tokens this event accounts for (empty on the final event)
    text: str                      # whole UTF-8 characters, stop text removed, may be ""
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None  # on the final event only
    index: int = 0                 # which of the request's `n` choices this event belongs to
    # with SamplingParams.logprobs: per token in token_ids, (logprob, [(alternative id, logprob), ...])
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # with SamplingParams.prompt_logprobs, on each choice's first event: per prompt token, (logprob,
    # alternatives) given the tokens before it; None for the first token (the same list for every choice)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    # on the final event, with SamplingParams.logprobs, when a stop token id (or end-of-text) ended the
    # output: (its id, its (logprob, alternatives)); the token itself is not part of the output
    stop_logprob: tuple[int, tuple[float, list[tuple[int, float]]]] | None = None
    # under loops "auto": per token in token_ids, the core loops its row ran (its own exit depth)
    loops: list[int] | None = None
    # on the final event, when a stop string (SamplingParams.stop) ended the output: which one
    stop_sequence: str | None = None
    # an embedding request's output (engine/embedding.py), on its final event: the pooled, L2-normalized
    # state, float32 (dim,)
    embedding: Any = None


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # per token, with SamplingParams.logprobs
    prompt_logprobs: list | None = None  # per prompt token (the first None), with SamplingParams.prompt_logprobs

    @property
    def prompt_tokens(self) -> int:
        return self.stats["prompt_tokens"]

    @property
    def completion_tokens(self) -> int:
        return self.stats["completion_tokens"]


class TokenStream:
    """Token ids -> events for one output, without text: stop ids (and EOS unless ignored), counts, stats.

    `feed(tok)` returns the event for one token (None when the token is a stop id: it is not shown) and
    sets `stopped` once the output is over; `close()` gives the final event."""

    def __init__(self, plan, eos_ids: Iterable[int], t0: float, index: int = 0):
        params = plan.params
        self.params, self.n_prompt, self.loops_used, self.t0, self.index = params, plan.n_prompt, plan.loops, t0, index
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids.update(eos_ids)
        self.n = 0
        self.ttft: float | None = None
        self.stopped = False
        self.loops_per_token: dict[int, int] = {}  # core loops -> generated tokens that ran that many
        self.prompt_logprobs: list | None = None   # set by the core once the prompt is scored: goes on the next event
        self.stop_logprob = None                    # (stop id, its logprob entry) when one ended the output

    def _text(self, tok: int) -> str:
        return ""

    def _tail(self) -> str:
        return ""

    def feed(self, tok: int, loops: int | None = None, logprob=None) -> StreamEvent | None:
        """One sampled token; `loops`: the core loops its row ran (None: the plan's depth); `logprob`: its
        (logprob, alternatives) when the request asked for them."""
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.t0
        if tok in self.stop_ids:  # ends the output; not part of it, so not counted in completion_tokens
            self.stopped = True
            if logprob is not None:
                self.stop_logprob = (tok, logprob)
            return None
        self.n += 1
        depth = self.loops_used if loops is None else loops
        self.loops_per_token[depth] = self.loops_per_token.get(depth, 0) + 1
        return self._with_prompt(StreamEvent([tok], self._text(tok), index=self.index,
                                             logprobs=[logprob] if logprob is not None else None,
                                             loops=[depth] if self.params.adaptive else None))

    def _with_prompt(self, ev: StreamEvent) -> StreamEvent:
        """The prompt's scores ride on the first event that goes out after they are known."""
        ev.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        return ev

    def _mean_loops(self) -> float | int:
        """Mean core loops over generated tokens (the plan's depth when it never varied)."""
        if not self.loops_per_token or set(self.loops_per_token) == {self.loops_used}:
            return self.loops_used
        n = sum(self.loops_per_token.values())
        return round(sum(k * v for k, v in self.loops_per_token.items()) / n, 3)

    def close(self, run_stats: dict[str, Any] | None = None, finish_reason: str | None = None) -> StreamEvent:
        """The final event: the held-back text, finish_reason ("stop" or "length" unless given) and stats."""
        tail = self._tail()
        wall = time.perf_counter() - self.t0
        stats = {
            "wall_ms": round(wall * 1000, 2),
            "tokens_per_second": round(self.n / wall, 2) if wall > 0 else 0.0,
            "time_to_first_token_ms": round((self.ttft or wall) * 1000, 2),
            "prompt_tokens": self.n_prompt,
            "prompt_tokens_cached": 0,   # prompt tokens whose KV came from the prefix cache (run_stats)
            "completion_tokens": self.n,
            "mode": self.params.mode,
            "loops_used": self._mean_loops(),
            "loops_histogram": {str(k): v for k, v in sorted(self.loops_per_token.items())},
            **(run_stats or {}),
        }
        reason = finish_reason or ("stop" if self.stopped else "length")
        return self._with_prompt(StreamEvent([], tail, reason, stats, index=self.index, stop_logprob=self.stop_logprob,
                                             stop_sequence=self._stop_sequence()))

    def _stop_sequence(self) -> str | None:
        return None


class TextStream(TokenStream):
    """`TokenStream` plus text: a streaming detokenizer (whole UTF-8 characters) and stop strings, matched
    on decoded text across token boundaries and never returned."""

    def __init__(self, tokenizer, plan, eos_ids: Iterable[int], t0: float, index: int = 0, check=None):
        super().__init__(plan, eos_ids, t0, index)
        self.detok = tokenizer.detokenizer()
        self.stops = StopMatcher(plan.params.stop)
        # a schema the grammar could not hold exactly (engine/schema_check.py): the answer is checked at the end
        self.check, self.thinking = check, plan.thinking
        self.shown: list[str] = []

    def _text(self, tok: int) -> str:
        text = self.stops.feed(self.detok.add(tok))
        self.stopped = self.stops.stopped
        if self.check is not None:
            self.shown.append(text)
        return text

    def _tail(self) -> str:
        text = "" if self.stops.stopped else self.stops.feed(self.detok.flush()) + self.stops.flush()
        if self.check is not None:
            self.shown.append(text)
        return text

    def close(self, run_stats: dict[str, Any] | None = None, finish_reason: str | None = None) -> StreamEvent:
        """The final event; under a schema check, its stats say `schema_check`: "passed" or "failed: why"
        (an answer cut short by max_tokens is not checked: nothing is claimed about it)."""
        ev = super().close(run_stats, finish_reason)
        if self.check is not None and ev.finish_reason == "stop":
            answer = "".join(self.shown)
            if self.thinking is not None:   # the schema holds after the thinking block
                answer = answer.rsplit(self.thinking.tags.close, 1)[-1]
            error = self.check.validate(answer)
            ev.stats["schema_check"] = "passed" if error is None else f"failed: {error}"
        return ev

    def _stop_sequence(self) -> str | None:
        return self.stops.matched
