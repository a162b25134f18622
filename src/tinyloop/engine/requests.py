"""A request inside the engine core (`serving.BatchEngine`): its plan, where its events go, and one output
per choice (or per embedding input), each with its sampler, stream, sequence and, in speculative modes, its
speculator. Shared by the core (`serving.py`) and its lone-sequence fast paths (`fast_steps.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generator

from ..model.paged import Rows
from .plan import RequestPlan
from .sampling import Sampler
from .scheduler import Sequence
from .speculative import Speculator

Emit = Callable[[Any], None]


@dataclass(eq=False)
class Output:
    index: int
    sampler: Sampler
    stream: Any                                  # engine.text.TokenStream or TextStream
    seq: Sequence | None = None
    spec: Speculator | None = None               # speculative modes
    passes: Generator | None = None              # the speculator's pass generator
    pending: Rows | None = None                  # the pass it waits on (runs in the next step)
    run_stats: dict[str, Any] = field(default_factory=dict)
    done: bool = False
    thought: Any = None   # a thinking model's block (engine/thinking.py ThinkingMatcher): its reasoning_tokens


@dataclass(eq=False)
class Request:
    req_id: int
    plan: RequestPlan
    emit: Emit
    outputs: list[Output]
    t0: float
    embedding: bool = False                       # an embedding request (engine/embedding.py): one output per input
    deadline: float | None = None
    on_admit: Callable[[], None] | None = None    # called once, when the request first gets to run
    admitted: float | None = None                 # when it did (perf_counter)
    started: bool = False                         # a token has gone out
    scores: list | None = None                    # prompt_logprobs: one entry per prompt token (the first None)

    @property
    def params(self):
        return self.plan.params

    @property
    def done(self) -> bool:
        return all(o.done for o in self.outputs)
