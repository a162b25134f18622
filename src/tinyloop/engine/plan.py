"""One request plan: every knob of a request resolved once, before it is queued.

`plan_request` runs every check (SamplingParams' ranges against the model's limits, `n`, the context
length) and resolves the defaults that depend on the model (`loops` -> its `default_loops`, or the depth a
`reasoning_effort` picks inside its trained range: `SamplingParams.with_effort`). Everything
downstream (the engine, the scheduler's page count) reads the plan instead of re-deriving it. Pure: no
torch, no model, only the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import ModelConfig
from ..errors import ValidationError
from .knobs import SamplingParams

MAX_N = 8  # choices per request


@dataclass(frozen=True)
class RequestPlan:
    prompt_ids: tuple[int, ...]
    params: SamplingParams        # validated
    n: int                        # choices, 1..MAX_N
    loops: int                    # depth of the output distribution: loops, or verify_loops when speculative
    draft_loops: int | None       # speculative modes only
    draft_ahead: int              # tokens drafted per round (0 for plain generation)
    draft_run: int                # the longest a greedy chain round may draft (SamplingParams.draft_run; >= draft_ahead)
    k_branches: int               # draft tree branching; 1 unless tree_speculative
    window: int                   # params.cache_window (0: full context)
    max_positions: int            # positions the sequence can reach (see plan_request)
    exit_rule: Any = None         # model.exits.ExitRule for loops="auto" (loops is then the ceiling)
    kv_loops: int | None = None   # core KV slots per layer (the loop-shared budget); None: one per loop
    thinking: Any = None          # engine.thinking.ThinkPlan when the output has a thinking block (Engine.plan)
    warnings: tuple[str, ...] = ()  # schema parts not enforced exactly (Engine.plan; x-tinyloop-warning)
    cache_save: str | None = None   # a saved conversation's name (POST /v1/cache/save): its prompt's KV kept on disk

    @property
    def mode(self) -> str:
        return self.params.mode

    @property
    def speculative(self) -> bool:
        return self.params.mode != "generate"

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)

    def blocks(self, page_size: int) -> int:
        """KV pages (of `page_size` positions) one sequence of this request needs at its longest."""
        return -(-self.max_positions // page_size)


def plan_request(prompt_ids: list[int], params: SamplingParams, cfg: ModelConfig, *, max_seq_len: int,
                 n: int = 1, exit_gate: bool | None = None) -> RequestPlan:
    """Check a request against the model and resolve its defaults. Raises ValidationError naming the field.

    `max_seq_len` is the context limit the engine serves (the model's, or lower). `max_positions` is
    prompt + max_tokens, plus for the speculative modes room for one draft tree or chain run past the last
    accepted token (k_branches * draft_ahead, or draft_run, + 1 positions)."""
    params = params.with_effort(cfg)   # the depth reasoning_effort picks (every route's requests pass here)
    params.validate(max_loops=cfg.max_loops, vocab_size=cfg.vocab_size, default_loops=cfg.default_loops)
    if params.adaptive and params.exit_criterion == "gate" and not (cfg.exit_gate if exit_gate is None else exit_gate):
        raise ValidationError('exit_criterion: "gate" needs a model with an exit gate (its checkpoint\'s, or one trained by '
                              '`tinyloop train-gate`); this one has none: use "latent"', param="exit_criterion")
    if not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise ValidationError(f"n: must be in 1..{MAX_N}, got {n}", param="n")
    need = len(prompt_ids) + params.max_tokens
    if len(prompt_ids) + min(params.max_tokens, 1) > max_seq_len:  # the prompt alone leaves no room
        raise ValidationError(
            f"prompt: {len(prompt_ids)} tokens; the context length is {max_seq_len}, which leaves no room for "
            f"{'a generated token' if params.max_tokens else 'the prompt'}; shorten the prompt",
            param="prompt", code="context_length_exceeded")
    if need > max_seq_len:
        raise ValidationError(
            f"prompt_tokens ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) = {need} exceeds the "
            f"context length {max_seq_len}; shorten the prompt or lower max_tokens",
            param="max_tokens", code="context_length_exceeded")
    speculative = params.mode != "generate"
    ring = params.kv_ring(cfg.default_loops)
    if cfg.kv_mode == "last_loop":   # one core slot per layer, whatever asked
        if speculative:
            raise ValidationError(
                f"mode: {params.mode!r} needs a model that keeps each loop's keys; this one keeps one cache per "
                "recurrent layer that every loop overwrites (kv_mode last_loop), so a verification pass would "
                "see its drafted tokens at each loop instead of at their last, unlike plain decoding: use mode "
                '"generate"', param="mode")
        ring = 1 if params.effective_loops(cfg.default_loops) > 1 else None
    k_branches = params.k_branches if params.mode == "tree_speculative" else 1
    draft_ahead = params.effective_draft_ahead() if speculative else 0
    draft_run = params.draft_run() if speculative else 0
    max_positions = need + (max(k_branches * draft_ahead, draft_run) + 1 if speculative else 0)
    return RequestPlan(
        prompt_ids=tuple(prompt_ids), params=params, n=n, loops=params.effective_loops(cfg.default_loops),
        draft_loops=params.effective_draft_loops(cfg.default_loops) if speculative else None,
        draft_ahead=draft_ahead, draft_run=draft_run, k_branches=k_branches,
        window=params.cache_window, max_positions=max_positions, exit_rule=params.exit_rule(cfg.default_loops),
        kv_loops=ring)
