"""Embeddings on the engine core: a request kind that prefills its inputs and returns a pooled state.

An embedding request is planned once (`plan_embedding` -> `EmbeddingPlan`) and queued on the same core
as generation (`serving.BatchEngine.add`): one output per input, each a sequence of the continuous batch
(chunked prefill over the paged KV pool, in the same batched steps as everyone else's rows), at the
request's `loops`. The batch runner hands each of its chunks' states back (`BatchRunner.last_hidden`:
the coda's output through the final norm, i.e. what the LM head reads, at every position) instead of
computing logits; `Pooler` pools them as they come, and once the input's last chunk has run the output
ends with its vector (`StreamEvent.embedding`) and its pages are freed. Nothing is sampled.

Pooling (docs/embeddings.md): "mean" (the default) - the mean over the input's positions of that state,
then L2-normalized; "last" - the last position's state, L2-normalized. `dimensions` keeps the first d
components and re-normalizes (`truncate`), as OpenAI's matryoshka models do.

Embedding sequences do not read the prefix cache (every position is computed: mean pooling needs each
position's state, and a vector should not depend on what ran before it); their full blocks are still
named for later generation requests, as a scored prompt's are.
"""

from __future__ import annotations

import sys
from array import array
from base64 import b64encode
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import ValidationError
from .knobs import SamplingParams

POOLINGS = ("mean", "last")
DEFAULT_POOLING = "mean"
MAX_INPUTS = 2048          # inputs per request (OpenAI's limit)


@dataclass(frozen=True)
class EmbeddingPlan:
    """One embedding request, checked: the inputs' token ids, the depth and the pooling. It reads like a
    `RequestPlan` where the core and the server read one (n outputs, their prompt tokens, the loops)."""

    inputs: tuple[tuple[int, ...], ...]
    loops: int
    pooling: str
    params: SamplingParams            # max_tokens 0 at `loops`: what the core reads of any request's params

    # what a RequestPlan also says, fixed for embeddings
    window = 0
    kv_loops = None
    exit_rule = None
    draft_loops = None
    draft_ahead = draft_run = 0
    k_branches = 1
    speculative = False
    mode = "embedding"
    max_tokens = 0

    @property
    def n(self) -> int:
        """Outputs: one per input."""
        return len(self.inputs)

    @property
    def n_prompt(self) -> int:
        """Prompt tokens of every input together (usage.prompt_tokens)."""
        return sum(len(x) for x in self.inputs)

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.inputs[0]

    @property
    def max_positions(self) -> int:
        """The longest input: what one sequence of this request needs at its longest."""
        return max(len(x) for x in self.inputs)

    def blocks(self, page_size: int) -> int:
        return -(-self.max_positions // page_size)


def input_list(value: Any, param: str = "input") -> list[str | list[int]]:
    """OpenAI's `input`: a string, a list of strings, a list of token ids or a list of token-id lists ->
    the list of inputs (each a string or ids). ValidationError naming `param` for anything else."""
    def bad(why: str) -> ValidationError:
        return ValidationError(f"{param}: {why}", param=param, code="invalid_value")

    def is_id(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ValidationError(f"{param}: must be a string, a list of strings, a list of token ids or a list of "
                              f"token-id lists, got {type(value).__name__}", param=param, code="invalid_type")
    if not value:
        raise bad("is empty; give at least one input")
    if len(value) > MAX_INPUTS:
        raise bad(f"at most {MAX_INPUTS} inputs per request, got {len(value)}")
    if all(is_id(x) for x in value):
        return [list(value)]
    out: list[str | list[int]] = []
    for i, x in enumerate(value):
        if isinstance(x, str):
            out.append(x)
        elif isinstance(x, list) and all(is_id(t) for t in x):
            out.append(list(x))
        else:
            raise ValidationError(f"{param}[{i}]: must be a string or a list of token ids (integers), got "
                                  f"{type(x).__name__ if not isinstance(x, list) else 'a list holding other values'}; "
                                  "a list of token ids must hold integers only", param=param, code="invalid_type")
    return out


def plan_embedding(inputs: list[list[int]], cfg: ModelConfig, *, max_seq_len: int, loops: Any = None,
                   pooling: Any = None, param: str = "input") -> EmbeddingPlan:
    """Check tokenized inputs, the depth and the pooling against the model. Pure (no torch, no model).
    Raises ValidationError naming the field (`param` for the inputs)."""
    if pooling is None:
        pooling = DEFAULT_POOLING
    if pooling not in POOLINGS:
        raise ValidationError(f"pooling: must be one of {', '.join(repr(p) for p in POOLINGS)}, got {pooling!r}",
                              param="pooling")
    if loops is None:
        loops = cfg.default_loops
    if not isinstance(loops, int) or isinstance(loops, bool) or not 1 <= loops <= cfg.max_loops:
        raise ValidationError(f"loops: an embedding's depth must be an integer in 1..{cfg.max_loops} (the state after "
                              f"that many loops; default {cfg.default_loops}), got {loops!r}", param="loops")
    if not inputs:
        raise ValidationError(f"{param}: is empty; give at least one input", param=param)
    if len(inputs) > MAX_INPUTS:
        raise ValidationError(f"{param}: at most {MAX_INPUTS} inputs per request, got {len(inputs)}", param=param)
    which = (lambda i: param) if len(inputs) == 1 else (lambda i: f"{param}[{i}]")
    for i, ids in enumerate(inputs):
        if not ids:
            raise ValidationError(f"{which(i)}: is empty; give at least one token", param=param)
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValidationError(f"{which(i)}: token ids {bad[:5]} are outside the vocabulary "
                                  f"0..{cfg.vocab_size - 1}", param=param)
        if len(ids) > max_seq_len:
            raise ValidationError(f"{which(i)}: {len(ids)} tokens; the context length is {max_seq_len}; shorten it",
                                  param=param, code="context_length_exceeded")
    return EmbeddingPlan(inputs=tuple(tuple(x) for x in inputs), loops=loops, pooling=pooling,
                         params=SamplingParams(max_tokens=0, loops=loops))


class Pooler:
    """One input's pooled state, fed chunk by chunk (`add`): the states of positions start..start+n-1."""

    def __init__(self, pooling: str, n_prompt: int):
        self.pooling, self.n_prompt = pooling, n_prompt
        self.total: torch.Tensor | None = None    # float64: the sum (mean) or the last state (last)
        self.seen = 0                             # positions pooled

    def add(self, start: int, states: torch.Tensor) -> None:
        if start == 0:   # the first chunk (again, after a preemption: the prompt is recomputed from 0)
            self.total, self.seen = None, 0
        if start != self.seen:
            raise RuntimeError(f"embedding: a chunk at {start} after {self.seen} positions")
        states = states.double()
        if self.pooling == "mean":
            part = states.sum(0)
            self.total = part if self.total is None else self.total + part
        elif start + states.shape[0] == self.n_prompt:
            self.total = states[-1]
        self.seen += states.shape[0]

    def vector(self) -> torch.Tensor:
        """The L2-normalized pooled state (float32, (dim,))."""
        if self.total is None or self.seen != self.n_prompt:
            raise RuntimeError(f"embedding: {self.seen} of {self.n_prompt} positions pooled")
        v = self.total / self.seen if self.pooling == "mean" else self.total
        return normalize(v).float()


def normalize(v: torch.Tensor) -> torch.Tensor:
    """v / ||v|| over the last axis (a zero vector stays zero)."""
    return torch.nn.functional.normalize(v.double(), dim=-1)


def truncate(v: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """The first `dimensions` components, re-normalized (float32); None: v as it is."""
    if dimensions is None or dimensions == v.shape[-1]:
        return v.float()
    return normalize(v[..., :dimensions]).float()


def check_dimensions(dimensions: Any, width: int) -> int | None:
    if dimensions is None:
        return None
    if not isinstance(dimensions, int) or isinstance(dimensions, bool) or not 1 <= dimensions <= width:
        raise ValidationError(f"dimensions: must be an integer in 1..{width} (the model's width), got {dimensions!r}",
                              param="dimensions")
    return dimensions


def to_base64(v: torch.Tensor) -> str:
    """OpenAI's base64 encoding: the float32 values, little-endian, base64."""
    a = array("f", v.float().tolist())
    if sys.byteorder != "little":
        a.byteswap()
    return b64encode(a.tobytes()).decode("ascii")


class EmbeddingStream:
    """The output stream of one input (what `Engine.open_stream` is for generation): pools the states the
    core hands it and closes with the vector."""

    def __init__(self, plan: EmbeddingPlan, index: int, t0: float):
        self.plan, self.index, self.t0 = plan, index, t0
        self.pooler = Pooler(plan.pooling, len(plan.inputs[index]))
        self.n = 0
        self.stopped = False
        self.prompt_logprobs = None

    def close(self, run_stats: dict[str, Any] | None = None, finish_reason: str | None = None):
        import time

        from .text import StreamEvent
        stats = {"wall_ms": round((time.perf_counter() - self.t0) * 1000, 2), "prompt_tokens": self.pooler.n_prompt,
                 "completion_tokens": 0, "mode": "embedding", "loops_used": self.plan.loops,
                 "pooling": self.plan.pooling, **(run_stats or {})}
        return StreamEvent([], "", finish_reason or "stop", stats, index=self.index, embedding=self.pooler.vector())
