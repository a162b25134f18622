"""Per-request generation settings and their range checks (one validation path)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..config import EFFORT_DEPTHS, ModelConfig
from ..errors import ValidationError

MODES = ("generate", "speculative", "tree_speculative")
DEFAULT_LOOPS = next(f.default for f in dataclasses.fields(ModelConfig) if f.name == "default_loops")


@dataclass
class SamplingParams:
    max_tokens: int = 128
    loops: int | str | None = None       # None -> the model's default_loops; "auto": adaptive depth
    temperature: float = 0.0             # 0 -> greedy
    top_k: int = 0                       # 0 -> off
    top_p: float = 1.0                   # 1 -> off
    repetition_penalty: float = 1.0      # CTRL-style, over prompt + output
    presence_penalty: float = 0.0        # OpenAI definition, over generated tokens
    frequency_penalty: float = 0.0       # OpenAI definition, over generated tokens
    seed: int | None = None              # None -> fresh entropy
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    cache_window: int = 0                # 0 -> full context; W -> each query sees the W most recent keys
    mode: str = "generate"
    draft_loops: int | None = None       # None -> a quarter of the verifier's loops, at least 1 (2 at 8)
    verify_loops: int | None = None      # None -> loops, else the model's default_loops
    draft_ahead: int = 4
    k_branches: int = 1
    # adaptive depth (loops="auto"): each generated token exits when its criterion holds (model/exits.py)
    exit_criterion: str = "latent"
    exit_threshold: float | None = None  # None -> the criterion's default (exits.DEFAULT_THRESHOLDS)
    min_loops: int = 1
    max_loops: int | None = None         # the ceiling; None -> the model's default_loops
    # the loop-shared KV budget: "all" (a slot per loop), "last" (= 1) or k core slots per layer (model/cache.py)
    kv_loops: int | str = "all"
    # log-probabilities of each generated token, and of the `logprobs` most likely alternatives (0..20),
    # under the distribution it was drawn from (Sampler.logprobs); None: not reported
    logprobs: int | None = None
    # prompt scoring (vLLM's name): each prompt token's log-probability given the tokens before it, and the
    # `prompt_logprobs` most likely alternatives (0..20), under the model's raw distribution at the request's
    # loops (no temperature, top-k/top-p or penalties); the first token's entry is None. With it,
    # max_tokens may be 0 (score the prompt, generate nothing)
    prompt_logprobs: int | None = None
    # constrained decoding (engine/constraint.py): a `Constraint` (JSON schema, JSON object, regex or grammar)
    # the output must match; each step's row is masked to the tokens it allows. None: free text
    constraint: Any = None
    # thinking blocks (engine/thinking.py): `thinking` None (the model's own tags, if its chat template or
    # tokenizer has them), False (none: the output is all answer) or a `ThinkTags` (these tags); and a budget:
    # after `max_thinking_tokens` tokens inside the block its closing tag is forced, so the answer starts
    thinking: Any = None
    max_thinking_tokens: int | None = None
    # OpenAI's logit_bias: {token id: bias in -100..100}, added to the row's logits before the penalties and
    # whatever picks the token (greedy or sampling); -100 bans a token, +100 all but forces it. None: none
    logit_bias: dict[int, float] | None = None
    # OpenAI's reasoning_effort (Responses' reasoning.effort, Anthropic's output_config.effort): on a model that
    # declares the depths it was trained at (`ModelConfig.trained_loops`) it picks one of them when the request
    # names no depth (`loops`, or `verify_loops` in the speculative modes): "low" the shallowest, "medium" the
    # middle, "high" the deepest (`ModelConfig.effort_loops`; resolved by `plan.plan_request`). A model without
    # a range keeps its default depth. (The server turns it into a thinking budget too: server/reasoning.py)
    reasoning_effort: str | None = None

    def replace(self, **kw) -> "SamplingParams":
        return dataclasses.replace(self, **kw)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adaptive(self) -> bool:
        return self.loops == "auto"

    def depth_given(self) -> bool:
        """Whether the request names its depth itself (`loops`, or `verify_loops` in a speculative mode): then
        reasoning_effort does not choose it."""
        return self.loops is not None or (self.mode != "generate" and self.verify_loops is not None)

    def with_effort(self, cfg: ModelConfig) -> "SamplingParams":
        """The request with the depth its reasoning_effort picks on this model (`cfg.effort_loops`) as its
        `loops`; unchanged when it names a depth itself, gives no effort, or the model declares no trained
        range."""
        if not isinstance(self.reasoning_effort, str) or self.reasoning_effort not in EFFORT_DEPTHS \
                or self.depth_given():
            return self   # (an unknown effort is refused by `validate`)
        depth = cfg.effort_loops(self.reasoning_effort)
        return self if depth is None else self.replace(loops=depth)

    def effective_loops(self, default_loops: int) -> int:
        """Loops of the output distribution: verify_loops for speculative modes, else loops (for "auto":
        the ceiling, max_loops)."""
        if self.adaptive:
            return default_loops if self.max_loops is None else self.max_loops
        if self.mode == "generate":
            return default_loops if self.loops is None else self.loops
        if self.verify_loops is not None:
            return self.verify_loops
        return default_loops if self.loops is None else self.loops

    def effective_draft_loops(self, default_loops: int) -> int:
        """The draft's loops: draft_loops, else a quarter of the verifier's (at least 1): 2 at 8 loops, 1 at
        4 (Ouro) or 2 (Nanbeige), 8 at 32 (Huginn)."""
        if self.draft_loops is not None:
            return self.draft_loops
        return max(1, self.effective_loops(default_loops) // 4)

    def kv_ring(self, default_loops: int) -> int | None:
        """Core KV slots per layer of a validated request: None for one per loop."""
        k = 1 if self.kv_loops == "last" else self.kv_loops
        return None if k == "all" or k >= self.effective_loops(default_loops) else k

    def exit_rule(self, default_loops: int):
        """The adaptive-depth rule of a validated "auto" request (None otherwise)."""
        if not self.adaptive:
            return None
        from ..model.exits import DEFAULT_THRESHOLDS, ExitRule

        t = DEFAULT_THRESHOLDS[self.exit_criterion] if self.exit_threshold is None else float(self.exit_threshold)
        return ExitRule(self.exit_criterion, t, self.min_loops, self.effective_loops(default_loops))

    def validate(self, *, max_loops: int = 64, vocab_size: int | None = None,
                 default_loops: int = DEFAULT_LOOPS) -> "SamplingParams":
        """Range checks against the model's limits (`max_loops`, `vocab_size`, and `default_loops`, the
        depth used when a request names none). Raises ValidationError naming the field."""
        def need(ok: bool, param: str, msg: str) -> None:
            if not ok:
                raise ValidationError(f"{param}: {msg}", param=param)

        lo = 0 if self.prompt_logprobs is not None else 1   # 0: score the prompt only
        need(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
             and lo <= self.max_tokens <= 8192, "max_tokens",
             f"must be an integer in {lo}..8192{' (0 only with prompt_logprobs)' if lo else ''}, got {self.max_tokens!r}")
        if self.adaptive:
            from ..model.exits import CRITERIA, DEFAULT_THRESHOLDS

            ceiling = self.effective_loops(default_loops)
            need(self.mode == "generate", "loops", f'"auto" works with mode "generate" only, got mode {self.mode!r}')
            need(self.exit_criterion in CRITERIA, "exit_criterion",
                 f"must be one of {list(CRITERIA)}, got {self.exit_criterion!r}")
            need(isinstance(ceiling, int) and 1 <= ceiling <= max_loops, "max_loops",
                 f"must be in 1..{max_loops}, got {ceiling}")
            need(isinstance(self.min_loops, int) and 1 <= self.min_loops <= ceiling, "min_loops",
                 f"must be in 1..max_loops ({ceiling}), got {self.min_loops}")
            t = DEFAULT_THRESHOLDS.get(self.exit_criterion) if self.exit_threshold is None else self.exit_threshold
            hi = 1 if self.exit_criterion == "gate" else 10  # gate: a cumulative probability
            need(isinstance(t, (int, float)) and 0 < t <= hi, "exit_threshold",
                 f"must be in (0, {hi}] for exit_criterion {self.exit_criterion!r}, got {t}")
        else:  # the adaptive knobs are checked whenever given: a value the document refuses is never taken
            if self.max_loops is not None:
                need(isinstance(self.max_loops, int) and 1 <= self.max_loops <= max_loops, "max_loops",
                     f"must be in 1..{max_loops}, got {self.max_loops}")
            need(isinstance(self.min_loops, int) and 1 <= self.min_loops <= max_loops, "min_loops",
                 f"must be in 1..{max_loops}, got {self.min_loops}")
            if self.exit_threshold is not None:
                need(isinstance(self.exit_threshold, (int, float)) and 0 < self.exit_threshold <= 10, "exit_threshold",
                     f"must be in (0, 10], got {self.exit_threshold}")
        if self.verify_loops is not None:  # checked whenever given, as the other knobs are (server/knobs.py)
            need(isinstance(self.verify_loops, int) and 1 <= self.verify_loops <= max_loops, "verify_loops",
                 f"must be in 1..{max_loops}, got {self.verify_loops}")
        fixed = " (this model's depth is fixed: it runs its layers once)" if max_loops == 1 else ""
        if not self.adaptive and self.loops is not None:
            need(isinstance(self.loops, int) and not isinstance(self.loops, bool) and 1 <= self.loops <= max_loops,
                 "loops", f'must be an integer in 1..{max_loops} or "auto", got {self.loops!r}{fixed}')
        need(0.0 <= self.temperature <= 2.0, "temperature", f"must be in 0.0..2.0, got {self.temperature}")
        need(0 <= self.top_k <= 1000, "top_k", f"must be in 0..1000, got {self.top_k}")
        need(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        need(0.5 <= self.repetition_penalty <= 2.0, "repetition_penalty",
             f"must be in 0.5..2.0, got {self.repetition_penalty}")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"must be in -2.0..2.0, got {self.presence_penalty}")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"must be in -2.0..2.0, got {self.frequency_penalty}")
        need(self.cache_window >= 0, "cache_window", f"must be >= 0, got {self.cache_window}")
        need(len(self.stop) <= 16, "stop", "at most 16 stop strings")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            need(not bad, "stop", f"stop token ids {bad} are outside the vocabulary 0..{vocab_size - 1}")
        need(self.mode in MODES, "mode", f"must be one of {MODES}, got {self.mode!r}")
        need(self.reasoning_effort is None or self.reasoning_effort in EFFORT_DEPTHS, "reasoning_effort",
             f"must be one of {', '.join(EFFORT_DEPTHS)}, got {self.reasoning_effort!r}")
        if self.logprobs is not None:
            need(isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool) and 0 <= self.logprobs <= 20,
                 "logprobs", f"must be an integer in 0..20 (alternatives per token), got {self.logprobs!r}")
        if self.prompt_logprobs is not None:
            k = self.prompt_logprobs
            need(isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= 20, "prompt_logprobs",
                 f"must be an integer in 0..20 (alternatives per prompt token), got {k!r}")
            need(self.mode == "generate", "prompt_logprobs",
                 f"is not reported in mode {self.mode!r} yet; use mode generate")
        if self.max_thinking_tokens is not None:
            b = self.max_thinking_tokens
            need(isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= 8192, "max_thinking_tokens",
                 f"must be an integer in 0..8192 (tokens inside the thinking block), got {b!r}")
        if self.logit_bias:
            bias = self.logit_bias
            need(isinstance(bias, dict), "logit_bias", "must map token ids to biases")
            bad = [t for t in bias if not isinstance(t, int) or isinstance(t, bool) or t < 0
                   or (vocab_size is not None and t >= vocab_size)]
            top = f"0..{vocab_size - 1}" if vocab_size is not None else "0 or more"
            need(not bad, "logit_bias", f"token ids {bad[:5]} are outside the vocabulary {top}")
            off = [v for v in bias.values() if isinstance(v, bool) or not isinstance(v, (int, float))
                   or not -100 <= v <= 100]
            need(not off, "logit_bias", f"biases must be numbers in -100..100, got {off[:5]}")
        k = self.kv_loops
        need(k in ("all", "last") or (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= max_loops),
             "kv_loops", f'must be "all", "last" or an integer in 1..{max_loops}, got {k!r}')
        need(k == "all" or self.mode == "generate", "kv_loops",
             f'"all" is the only budget the speculative modes take, got {k!r} with mode {self.mode!r}')
        if self.mode != "generate":
            need(max_loops > 1, "mode", f"{self.mode!r} drafts with fewer loops than it verifies at; this model's "
                 f"depth is fixed at 1 (it runs its layers once): use mode generate")
            verify = self.effective_loops(default_loops)
            d = self.effective_draft_loops(default_loops)
            need(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= 32, "draft_loops",
                 f"must be in 1..32, got {d!r}")
            need(1 <= verify <= max_loops, "verify_loops", f"must be in 1..{max_loops}, got {verify}")
            need(d < verify, "draft_loops", f"draft_loops ({d}) must be smaller than verify_loops ({verify})")
            need(1 <= self.draft_ahead <= 16, "draft_ahead", f"must be in 1..16, got {self.draft_ahead}")
        if self.mode == "tree_speculative":
            need(1 <= self.k_branches <= 16, "K_branches", f"must be in 1..16, got {self.k_branches}")
            need(self.k_branches * self.draft_ahead <= 64, "K_branches",
                 f"K_branches x draft_ahead must be <= 64, got {self.k_branches * self.draft_ahead}")
            need(self.cache_window == 0 or self.k_branches == 1, "cache_window",
                 "tree speculation with K_branches > 1 needs the full cache: set cache_window to 0")
        return self


def param_default(name: str) -> Any:
    """The default of SamplingParams field `name`: the one place request defaults are written (the HTTP
    schemas and the CLI read theirs from here)."""
    f = {f.name: f for f in dataclasses.fields(SamplingParams)}[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default
