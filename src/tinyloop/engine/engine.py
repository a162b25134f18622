"""The engine's public face: load a model file, then `generate` (blocking) or `stream` (text deltas).

Layers, lowest first: `generate_ids` (token ids) -> `Engine.stream` (detokenizer + stop strings ->
`StreamEvent`s) -> `Engine.generate` (one `GenerationResult`). The HTTP server, the CLI and the tests
all use these same pieces.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from ..errors import ValidationError
from ..modelfile import LoadedModel, load_model, model_info
from ..stops import StopMatcher
from . import speculative
from .generate import generate_ids
from .params import SamplingParams
from .sampling import Sampler


@dataclass
class StreamEvent:
    token_ids: list[int]           # tokens this event accounts for (empty on the final event)
    text: str                      # whole UTF-8 characters, stop text removed, may be ""
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None  # on the final event only
    index: int = 0                 # which of the request's `n` choices this event belongs to


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return self.stats["prompt_tokens"]

    @property
    def completion_tokens(self) -> int:
        return self.stats["completion_tokens"]


class TextStream:
    """Token ids -> text events for one output: streaming detokenizer, stop ids and stop strings, stats.

    `feed(tok)` returns the event for one token (None when the token is a stop id: it is not shown) and
    sets `stopped` once a stop id or stop string ended the output; `close()` gives the final event."""

    def __init__(self, tokenizer, params: SamplingParams, n_prompt: int, eos_token_id: int, loops_used: int,
                 t0: float, index: int = 0):
        self.params, self.n_prompt, self.loops_used, self.t0, self.index = params, n_prompt, loops_used, t0, index
        self.detok = tokenizer.detokenizer()
        self.stops = StopMatcher(params.stop)
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids.add(eos_token_id)
        self.n = 0
        self.ttft: float | None = None
        self.stopped = False

    def feed(self, tok: int) -> StreamEvent | None:
        self.n += 1
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.t0
        if tok in self.stop_ids:
            self.stopped = True
            return None
        text = self.stops.feed(self.detok.add(tok))
        self.stopped = self.stops.stopped
        return StreamEvent([tok], text, index=self.index)

    def close(self, run_stats: dict[str, Any] | None = None, finish_reason: str | None = None) -> StreamEvent:
        """The final event: the held-back text, finish_reason ("stop" or "length" unless given) and stats."""
        tail = "" if self.stops.stopped else self.stops.feed(self.detok.flush()) + self.stops.flush()
        wall = time.perf_counter() - self.t0
        stats = {
            "wall_ms": round(wall * 1000, 2),
            "tokens_per_second": round(self.n / wall, 2) if wall > 0 else 0.0,
            "time_to_first_token_ms": round((self.ttft or wall) * 1000, 2),
            "prompt_tokens": self.n_prompt,
            "completion_tokens": self.n,
            "mode": self.params.mode,
            "loops_used": self.loops_used,
            **(run_stats or {}),
        }
        reason = finish_reason or ("stop" if self.stopped else "length")
        return StreamEvent([], tail, reason, stats, index=self.index)


def attach_draft_exit_file(loaded: LoadedModel, draft_exit: str | Path | bool = True) -> Path | None:
    """Attach draft exits to a loaded (and, if wanted, decode-prepared) model: True - the model's own
    `<model>.draft.safetensors` if there is one; a path - that file; False - none. Returns the file used;
    a file that does not fit raises ModelFileError (DraftExitError)."""
    from ..model.draft_exit import attach_draft_exits, draft_exit_path, read_draft_exits

    exit_path = None
    if draft_exit is True:
        exit_path = draft_exit_path(loaded.path, loaded.header)
    elif draft_exit:
        exit_path = Path(draft_exit)
    loaded.draft_exit_path = exit_path
    if exit_path is not None:
        exits, _ = read_draft_exits(exit_path, loaded.model.cfg)
        attach_draft_exits(loaded.model, exits)
    return exit_path


class Engine:
    def __init__(self, loaded: LoadedModel, *, max_seq_len: int | None = None, kv_format: str = "fp16"):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.config = loaded.config
        self.header = loaded.header
        self.path = loaded.path
        from ..model.cache import CacheError, check_kv_format
        try:
            check_kv_format(self.config, kv_format)
        except CacheError as exc:
            raise ValidationError(f"kv_format: {exc}", param="kv_format") from None
        self.kv_format = kv_format
        limit = self.config.max_seq_len
        if max_seq_len is not None and max_seq_len > 0:
            limit = min(limit, max_seq_len)
        self.max_seq_len = limit

    @classmethod
    def load(cls, path: str | Path | None = None, *, device: str = "cpu", dtype: torch.dtype | None = None,
             max_seq_len: int | None = None, kv_format: str = "fp16", fast: bool = True,
             draft_exit: str | Path | bool = True) -> "Engine":
        """`fast=True` (the default) applies model.fast.prepare_for_decode (fused projections, fp16 FBGEMM
        weights for 16-bit models on CPU, thread policy): see docs/decode.md. `fast=False` keeps the
        plain eager modules (the reference the tests compare against).

        draft_exit: True - attach the model's draft-exit file if it has one (`<model>.draft.safetensors`,
        see model/draft_exit.py; self-speculation then drafts through it); a path - that file (an error
        if it does not fit the model); False - none."""
        loaded = load_model(path, device=device, dtype=dtype)
        if fast:
            from ..model.fast import prepare_for_decode
            prepare_for_decode(loaded.model)
        attach_draft_exit_file(loaded, draft_exit)
        return cls(loaded, max_seq_len=max_seq_len, kv_format=kv_format)

    def model_info(self) -> dict[str, Any]:
        exits = getattr(self.model, "draft_exits", None) or {}
        exit_path = self.loaded.draft_exit_path
        return {**model_info(self.header), "kv_cache_mode": self.kv_format,
                "draft_exit": {"file": exit_path.name, "draft_loops": sorted(exits)} if exits and exit_path else None}

    # -- validation -------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValidationError(f"prompt: token ids {bad[:5]} are outside the vocabulary "
                                      f"0..{self.config.vocab_size - 1}", param="prompt")
        if not ids:
            raise ValidationError("prompt: is empty; give at least one token", param="prompt")
        return ids

    def check(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Every check, model-dependent ones included, before any work starts."""
        params.validate(max_loops=self.config.max_loops, vocab_size=self.config.vocab_size)
        need = len(prompt_ids) + params.max_tokens
        if need > self.max_seq_len:
            raise ValidationError(
                f"prompt_tokens ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) = {need} exceeds the "
                f"context length {self.max_seq_len}; shorten the prompt or lower max_tokens",
                param="max_tokens", code="context_length_exceeded")
        return params

    # -- generation -------------------------------------------------------------------------
    def token_ids(self, prompt_ids: list[int], params: SamplingParams, run_stats: dict[str, Any],
                  sampler: Sampler | None = None) -> Iterator[int]:
        """Dispatch on params.mode to an id generator. `run_stats` collects mode-specific figures."""
        sampler = sampler or Sampler(params, prompt_ids, self.config.vocab_size)
        if params.mode == "generate":
            return generate_ids(self.model, prompt_ids, params, sampler, kv_format=self.kv_format)
        return speculative.speculative_ids(self.model, prompt_ids, params, sampler, run_stats,
                                           kv_format=self.kv_format)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[StreamEvent]:
        t0 = time.perf_counter()
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt)
        self.check(ids, params)
        return self._stream(ids, params, t0)

    def _stream(self, ids: list[int], params: SamplingParams, t0: float) -> Iterator[StreamEvent]:
        run_stats: dict[str, Any] = {}
        gen = self.token_ids(ids, params, run_stats)
        text = self.text_stream(ids, params, t0)
        try:
            for tok in gen:
                ev = text.feed(tok)
                if ev is not None:
                    yield ev
                if text.stopped:
                    break
        finally:
            gen.close()
        yield text.close(run_stats)

    def text_stream(self, ids: list[int], params: SamplingParams, t0: float, index: int = 0) -> "TextStream":
        return TextStream(self.tokenizer, params, len(ids), self.config.eos_token_id,
                          params.effective_loops(self.config.default_loops), t0, index)

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> GenerationResult:
        toks: list[int] = []
        parts: list[str] = []
        for ev in self.stream(prompt, params):
            toks += ev.token_ids
            parts.append(ev.text)
            if ev.finish_reason is not None:
                return GenerationResult(toks, "".join(parts), ev.finish_reason, ev.stats or {})
        raise RuntimeError("stream ended without a final event")  # unreachable by construction
