"""Thinking blocks: a reasoning model writes `<think> ... </think>` before its answer (docs/server.md, "Reasoning").

The engine core knows three things about them, all resolved once in the request plan (`Engine.plan`):

- **whether a request's output has one**: the model thinks when its chat template writes a `</think>` tag, or its
  tokenizer has `<think>` and `</think>` as tokens of their own (`model_tags`); `SamplingParams.thinking` forces
  the tags on (a `ThinkTags`) or off (False). The output starts *inside* the block when the prompt left a
  `<think>` open (a generation prompt that ends in it, Qwen3-2507's); otherwise a block is the output's own, when its
  first text is `<think>` (Qwen3's first templates, and models whose template knows no switch).
- **a budget** (`SamplingParams.max_thinking_tokens`): once the block holds that many tokens, the closing tag's
  tokens are forced, one a step, so the answer starts.
- **constraints** (`response_format`, `tools`) hold the answer only: inside the block the output is free.

Both are one `ThinkingMatcher`, in the place a constraint's matcher takes in the `Sampler`: every path that
honours a grammar (greedy, sampling, logprobs, the speculative drafts and verification) honours it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .constraint import mask_paths

# reasoning_effort (OpenAI's values) -> max_thinking_tokens
EFFORT_BUDGETS = {"none": 0, "minimal": 0, "low": 256, "medium": 1024, "high": 4096, "xhigh": 8192}
MAX_THINKING_TOKENS = 8192   # as max_tokens (SamplingParams.validate)


@dataclass(frozen=True)
class ThinkTags:
    open: str = "<think>"
    close: str = "</think>"


THINK = ThinkTags()


def model_tags(tokenizer) -> ThinkTags | None:
    """The model's thinking tags: `<think>`/`</think>` when its chat template writes `</think>` or its tokenizer
    has both tags as single tokens; else None (the model does not think)."""
    if tokenizer is None:
        return None
    if "</think>" in (getattr(tokenizer, "chat_template", None) or ""):
        return THINK
    encode = getattr(tokenizer, "encode", None)
    try:
        ids = [_encode(tokenizer, t) for t in (THINK.open, THINK.close)] if encode is not None else []
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode the tags has none
        return None
    return THINK if ids and all(len(i) == 1 for i in ids) else None


def _encode(tokenizer, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # TinyLoop's GPT-2 tokenizer adds nothing
        return list(tokenizer.encode(text))


@dataclass(frozen=True)
class ThinkPlan:
    """A request's thinking block, resolved (plain data: plans are pickled to scale-out replicas)."""
    tags: ThinkTags
    close_ids: tuple[int, ...]   # the closing tag's tokens, forced when the budget is spent
    budget: int | None           # max_thinking_tokens; None: no limit
    inside: bool                 # the prompt left the block open: the output starts in it


def resolve(thinking: Any, tokenizer) -> ThinkTags | None:
    """SamplingParams.thinking -> the tags in force: None (auto) the model's own, False none, ThinkTags those."""
    if thinking is False:
        return None
    if isinstance(thinking, ThinkTags):
        return thinking
    return model_tags(tokenizer)


def plan_thinking(tags: ThinkTags, tokenizer, prompt_ids: list[int], budget: int | None) -> ThinkPlan:
    tail = tokenizer.decode(list(prompt_ids[-512:]))
    inside = tail.rfind(tags.open) > tail.rfind(tags.close) if tags.open in tail else False
    return ThinkPlan(tags, tuple(_encode(tokenizer, tags.close)), budget, inside)


class ThinkingMatcher:
    """One output's thinking state, with the interface of a constraint's `Matcher` (engine/constraint.py):
    `allows`, `mask`, `forbidden`, `allowed_ids`, `apply`, `accept`, `rollback`, `mask_after`. Phases:

    - "start": the prompt did not open a block; the output's first text may (then "think"), else "answer";
    - "think": inside the block, free; each token counts against the budget; the closing tag ends it;
    - "force": the budget is spent: only the closing tag's next token is allowed;
    - "answer": after the block: the constraint's matcher (`inner`) holds the output, if there is one.

    `free` says the current position allows every token (the sampler then skips masking altogether)."""

    def __init__(self, plan: ThinkPlan, inner, token_bytes: Callable[[int], bytes], vocab_size: int, eos: int):
        self.plan, self.inner, self.token_bytes = plan, inner, token_bytes
        self.vocab_size = vocab_size
        self.eos = inner.eos if inner is not None else eos
        self.open_b, self.close_b = plan.tags.open.encode(), plan.tags.close.encode()
        # under a constraint a block is only the prompt's: the answer's grammar starts at once otherwise
        self.phase = "think" if plan.inside else ("answer" if inner is not None else "start")
        self.count = 0            # tokens inside the block
        self.text = b""           # "start": the output's text so far; "think": the block's last bytes
        self.forced = 0           # closing-tag tokens forced so far
        self.fed = 0              # tokens the inner matcher has accepted
        self.history: list[tuple] = []
        self.consumed = 0
        self.opened = plan.inside   # a block is the output's (its reasoning tokens count in usage)
        self.closed_at = 0          # tokens of the output up to its block's closing tag, the tag's included
        self._budget_check()

    # -- state ---------------------------------------------------------------------------------------------
    def _state(self) -> tuple:
        return self.phase, self.count, self.text, self.forced, self.fed, self.opened, self.closed_at

    @property
    def reasoning_tokens(self) -> int:
        """The output's tokens that belong to its thinking block (its tags included): all of them while the
        block is open, none when the output has no block (`usage.completion_tokens_details.reasoning_tokens`)."""
        if not self.opened:
            return 0
        return self.consumed if self.thinking or self.phase == "start" else self.closed_at

    def _budget_check(self) -> None:
        if self.phase == "think" and self.plan.budget is not None and self.count >= self.plan.budget:
            self.phase, self.forced = "force", 0
            if not self.plan.close_ids:
                self.phase = "answer"

    @property
    def free(self) -> bool:
        return self.phase in ("start", "think") or (self.phase == "answer" and self.inner is None)

    @property
    def thinking(self) -> bool:
        return self.phase in ("think", "force")

    def accept(self, token: int) -> None:
        self.history.append(self._state())
        self.consumed += 1
        if self.phase == "answer":
            if self.inner is not None:
                self.inner.accept(token)
                self.fed += 1
            return
        if self.phase == "force":
            self.forced += 1
            if self.forced >= len(self.plan.close_ids):
                self.phase, self.closed_at = "answer", self.consumed
            return
        piece = self.token_bytes(token) if 0 <= token < self.vocab_size else b""
        if self.phase == "start":
            self.text += piece
            head = self.text.lstrip()
            if head.startswith(self.open_b):
                self.phase, self.text, self.opened = "think", b"", True
                rest = head[len(self.open_b):]
                if self.close_b in rest:
                    self.phase, self.closed_at = "answer", self.consumed
                else:
                    self.text = rest[-len(self.close_b):]
                self._budget_check()
            elif not self.open_b.startswith(head):
                self.phase, self.text = "answer", b""
            return
        self.count += 1             # "think"
        seen = self.text + piece
        if self.close_b in seen:
            self.phase, self.text, self.closed_at = "answer", b"", self.consumed
            return
        self.text = seen[-len(self.close_b):]
        self._budget_check()

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        state = self.history[-n]
        del self.history[-n:]
        self.consumed -= n
        fed = self.fed
        self.phase, self.count, self.text, self.forced, self.fed, self.opened, self.closed_at = state
        if self.inner is not None and fed > self.fed:
            self.inner.rollback(fed - self.fed)

    # -- masks ----------------------------------------------------------------------------------------------
    def _forced_id(self) -> int:
        return self.plan.close_ids[self.forced]

    def allows(self, token: int) -> bool:
        if not 0 <= token < self.vocab_size:
            return False
        if self.free:
            return True
        if self.phase == "force":
            return token == self._forced_id()
        return self.inner.allows(token)

    def mask(self) -> torch.Tensor:
        if self.free:
            return torch.ones(self.vocab_size, dtype=torch.bool)
        if self.phase == "force":
            m = torch.zeros(self.vocab_size, dtype=torch.bool)
            m[self._forced_id()] = True
            return m
        return self.inner.mask()

    def forbidden(self) -> torch.Tensor:
        if self.phase == "answer" and self.inner is not None:
            return self.inner.forbidden()
        return ~self.mask()

    def allowed_ids(self) -> torch.Tensor:
        if self.phase == "answer" and self.inner is not None:
            return self.inner.allowed_ids()
        if self.phase == "force":
            return torch.tensor([self._forced_id()], dtype=torch.int64)
        return torch.arange(self.vocab_size, dtype=torch.int64)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.free:
            return logits
        if self.phase == "force":
            out = torch.full_like(logits, float("-inf"))
            out[self._forced_id()] = logits[self._forced_id()]
            return out
        return self.inner.apply(logits)

    def mask_after(self, paths: list[list[int]], scores: torch.Tensor, cols: torch.Tensor | None) -> torch.Tensor:
        """As `Matcher.mask_after`: each path walked from the current state, the row masked, rolled back."""
        if self.phase == "answer" and self.inner is not None:
            return self.inner.mask_after(paths, scores, cols)
        return mask_paths(self, paths, scores, cols)

    @property
    def accepting(self) -> bool:
        return self.inner.accepting if self.phase == "answer" and self.inner is not None else True

    @property
    def error(self):
        return getattr(self.inner, "error", None) if self.inner is not None else None
