"""TinyLoop's request knobs, declared once: the depth (`loops`, adaptive depth's exit criteria, `kv_loops`), the
speculative knobs, and each request's own limits, with their types, ranges and documentation. Every route reads
them from here: each HTTP API's request body inherits the groups it takes (server/*/schemas.py: OpenAI's
/v1 and /api/v0, Messages and Responses take `LoopKnobs`, native /generate* the groups of its mode), and the
command line's `tinyloop generate` flags are made from the same fields (`add_flags`). `knob_params` maps any of
them onto `SamplingParams` (below: the engine's per-request settings, their defaults and their range checks, the
one validation path).

Adding a knob: a field in its group here, its `SamplingParams` field and check (here too), and the engine code
that uses it (and the native struct, kernels/csrc/tinyloop.h, where it reaches native code). Torch-free (the
command line imports it to build its parser).

Types are strict on HTTP (no "5" for 5, no `true` for 1): the OpenAPI document says what is accepted, and the
schema fuzzer (tests/server/test_fuzz.py) holds the server to it. Ranges are not checked by pydantic:
`SamplingParams.validate` and `Engine.plan` do that in one place and raise `ValidationError` (-> 400), as
the spec asks (out-of-range values are 400, wrong types 422). The ranges are still written into the JSON
schema (`rng`), so the document is exactly as tight as the validation; limits that depend on the model or
the settings (`x-limit`) are filled in when the document is served (server/openapi.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, TypeAdapter, ValidationError as PydanticError
from pydantic.json_schema import WithJsonSchema

from ..config import EFFORT_DEPTHS, ModelConfig
from ..errors import ValidationError


# -- the engine's per-request settings ------------------------------------------------------------
MODES = ("generate", "speculative", "tree_speculative")
DRAFT_AHEAD = 4   # draft_ahead when a request names none: a chain round's drafts, a tree's depth
# and then, in mode speculative, the longest run a greedy chain round may draft where its drafts are nearly always
# accepted (engine/draft_policy.py `DraftPolicy.choose`, RUN_ACCEPT: weighed beside 1..DRAFT_AHEAD, not every
# length between): rounds of at most 4 held a depth-agreeing 4B nGPT shape to 1.19x plain at loops 4 over 128
# tokens, with the run 1.40-1.48x (1.6x once the policy settled; docs/speculative.md)
DRAFT_RUN = 8
DEFAULT_LOOPS = next(f.default for f in dataclasses.fields(ModelConfig) if f.name == "default_loops")


@dataclass
class SamplingParams:
    """One request's generation settings as the engine takes them (every route's knobs map onto these:
    `knob_params`), their defaults, and their range checks (`validate`: the one validation path)."""

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
    draft_ahead: int | None = None       # None -> DRAFT_AHEAD (and a chain's long run, DRAFT_RUN)
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

    def effective_draft_ahead(self) -> int:
        """A round's drafts (a tree: its depth): draft_ahead, else DRAFT_AHEAD."""
        return self.draft_ahead if self.draft_ahead is not None else DRAFT_AHEAD

    def draft_run(self) -> int:
        """The longest draft a chain round may make: DRAFT_RUN in mode speculative when the request names no
        draft_ahead (the policy weighs it where drafts are mostly accepted), else the round's drafts."""
        if self.mode == "speculative" and self.draft_ahead is None:
            return max(DRAFT_RUN, DRAFT_AHEAD)
        return self.effective_draft_ahead()

    def effective_draft_loops(self, default_loops: int) -> int:
        """The draft's loops: draft_loops, else a quarter of the verifier's (at least 1): 2 at 8 loops, 1 at
        4 or 2, 8 at 32."""
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
            ahead = self.effective_draft_ahead()
            need(isinstance(ahead, int) and not isinstance(ahead, bool) and 1 <= ahead <= 16, "draft_ahead",
                 f"must be in 1..16, got {ahead!r}")
        if self.mode == "tree_speculative":
            need(1 <= self.k_branches <= 16, "K_branches", f"must be in 1..16, got {self.k_branches}")
            need(self.k_branches * self.effective_draft_ahead() <= 64, "K_branches",
                 f"K_branches x draft_ahead must be <= 64, got {self.k_branches * self.effective_draft_ahead()}")
            need(self.cache_window == 0 or self.k_branches == 1, "cache_window",
                 "tree speculation with K_branches > 1 needs the full cache: set cache_window to 0")
        return self


def param_default(name: str) -> Any:
    """The default of SamplingParams field `name`: the one place request defaults are written (the HTTP
    schemas and the CLI read theirs from here)."""
    f = {f.name: f for f in dataclasses.fields(SamplingParams)}[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


# -- the HTTP and command-line knobs ----------------------------------------------------------------
MAX_WINDOW = 2**31 - 1  # cache_window: any window past the context is the full context; past this, a 400
MIN_TIMEOUT_S = 0.001   # a limit shorter than this cannot cover one engine step: refused rather than sure to expire
DECIMAL = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
# a keep_alive string: seconds, or a Go duration ("5m", "1h30m", "300ms"), signed (server/settings.py reads it)
KEEP_ALIVE_PATTERN = f"^[+-]?(?:{DECIMAL}|(?:{DECIMAL}(?:ns|us|µs|ms|s|m|h))+)$"


def doc(**schema: Any) -> Any:
    """JSON-schema-only constraints (checked by the engine, so a violation is a 400 naming the field)."""
    return Field(json_schema_extra=schema)


def rng(default: Any = None, *, lo: float | None = None, hi: float | None = None, gt: float | None = None,
        hi_limit: str | None = None, **schema: Any) -> Any:
    """A field whose range is documented in the JSON schema but checked by the engine (400, not 422).
    `hi_limit` names a limit filled in when the document is served (server/openapi.py)."""
    extra: dict[str, Any] = dict(schema)
    if lo is not None:
        extra["minimum"] = lo
    if gt is not None:
        extra["exclusiveMinimum"] = gt
    if hi is not None:
        extra["maximum"] = hi
    if hi_limit is not None:
        extra["x-limit"] = hi_limit
    return Field(default, json_schema_extra=extra)


def knob(param: str | None = None, **kw: Any) -> Any:
    """A knob: None when not given, its range documented as `rng` documents it; `param` names the SamplingParams
    field whose default applies then (shown in the document)."""
    field = rng(None, **kw)
    if param is not None:   # the document's default (the field's own stays None: "not given")
        field.json_schema_extra["default"] = param_default(param)
    return field


def _integral(value: Any) -> Any:
    """JSON Schema counts 1.0 as an integer, so the server does too (not "1", not true)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]
# a depth, or "auto": adaptive depth per token. Any JSON value is taken here and checked by the engine
# (SamplingParams.validate), so `"fast"`, 2.5 or true get the same clean 400 naming `loops` as 0 does,
# not a union type error
Loops = Annotated[Any, BeforeValidator(_integral),
                  WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string", "enum": ["auto"]}]})]
ExitCriterion = Literal["latent", "kl", "gate"]  # model/exits.py CRITERIA
KVLoops = Int | Literal["all", "last"]  # the loop-shared KV budget
KeepAlive = float | Annotated[str, doc(pattern=KEEP_ALIVE_PATTERN)]   # checked by server/models.py: a 400 naming it
KV_LOOPS_DOC = ('core KV slots kept per layer: "all" (one per loop, the default), "last" (1: every loop reads earlier '
                'tokens at their last loop) or k (loop r uses slot r mod k); memory per token drops accordingly '
                '(docs/adaptive.md). Mode generate only: the speculative modes take "all"')
LOOPS_DOC = ('core loops per token, 1..max_loops (default: the model\'s default_loops), or "auto": each generated '
             'token exits by exit_criterion between min_loops and max_loops (mode generate only; min_loops must '
             'not exceed max_loops, whose default is the model\'s default_loops; exit_criterion "gate" needs a '
             'model with an exit gate and an exit_threshold of at most 1)')
KEEP_ALIVE_DOC = ("Ollama's: how long the model stays loaded after this request (seconds, or a duration such as "
                  '"5m"; negative: pinned; 0: unloaded once answered); default the model\'s (server/models.py)')


# -- the knobs, by group ----------------------------------------------------------------------------
class DepthKnobs(BaseModel):
    """The depth: `loops`, adaptive depth's exit criteria (docs/adaptive.md) and the loop-shared KV budget."""

    loops: Loops | None = rng(lo=1, hi_limit="max_loops", description=LOOPS_DOC)
    exit_criterion: ExitCriterion | None = knob("exit_criterion", description='loops "auto": when a token exits')
    exit_threshold: float | None = rng(gt=0, hi=10, description="loops \"auto\": the criterion's threshold "
                                       "(default: its own)")
    min_loops: Int | None = knob("min_loops", lo=1, hi_limit="max_loops", description='loops "auto": the floor')
    max_loops: Int | None = rng(lo=1, hi_limit="max_loops", description='loops "auto": the ceiling (default: the '
                                "model's default_loops)")
    kv_loops: KVLoops | None = knob("kv_loops", lo=1, hi_limit="max_loops", description=KV_LOOPS_DOC)


class RequestKnobs(BaseModel):
    """Every generating request's own limits: its time, its cache window, its repetition penalty, how long its
    model stays loaded."""

    timeout_s: float | None = rng(lo=MIN_TIMEOUT_S, hi=86400, description="this request's time limit in seconds "
                                  "(default: the server's)")
    cache_window: Int | None = knob("cache_window", lo=0, hi=MAX_WINDOW, description="each query sees this many "
                                    "most recent keys (0: the whole context)")
    repetition_penalty: float | None = knob("repetition_penalty", lo=0.5, hi=2, description="CTRL's, over prompt "
                                            "and output")
    keep_alive: KeepAlive | None = Field(None, description=KEEP_ALIVE_DOC)


class SpeculationKnobs(BaseModel):
    """Self-speculation: draft with few loops, verify with many (docs/speculative.md)."""

    draft_loops: Int | None = rng(lo=1, hi=32, description="must be smaller than verify_loops; default: a quarter "
                                  "of verify_loops, at least 1 (2 at 8 loops)")
    verify_loops: Int | None = rng(lo=1, hi_limit="max_loops", description="default: loops, else the model's "
                                   "default_loops")
    draft_ahead: Int | None = rng(lo=1, hi=16, description="tokens drafted a round at most (a tree: its depth); "
                                  "default: 4, and in mode speculative greedy rounds whose drafts are mostly "
                                  "accepted may draft 8")


class TreeKnobs(BaseModel):
    """Tree speculation's width."""

    K_branches: Int | None = knob("k_branches", lo=1, hi=16, description="K_branches x draft_ahead <= 64; above 1: "
                                  "cache_window 0")


class LoopKnobs(DepthKnobs, RequestKnobs, SpeculationKnobs, TreeKnobs):
    """Every knob, for the routes that take them all (/v1 chat and completions, /api/v0, Messages, Responses;
    as vLLM takes its sampling extras on /v1), with the generation mode (the native routes have a route a mode)."""

    mode: str | None = rng(enum=[*MODES, None])  # checked by the engine: an unknown mode is a 400
    ignore_eos: bool | None = Field(None, description="vLLM's: keep generating past end-of-text (benchmarks)")


PARAM = {name: {"K_branches": "k_branches"}.get(name, name) for name in LoopKnobs.model_fields}   # -> SamplingParams
SERVER_ONLY = {"timeout_s", "keep_alive"}   # read by the server (the worker's time limit, the model pool)


# -- reading them -------------------------------------------------------------------------------------
def or_default(value: Any, default: Any) -> Any:
    return default if value is None else value


def check_timeout(value: float | None) -> None:
    if value is not None and not MIN_TIMEOUT_S <= value <= 86400:
        raise ValidationError(f"timeout_s: must be in {MIN_TIMEOUT_S}..86400 seconds (a shorter limit cannot cover "
                              f"one engine step), got {value}", param="timeout_s")


def check_knobs(draft_loops: int | None, verify_loops: int | None, draft_ahead: int | None,
                k_branches: int | None, cache_window: int | None, max_loops: int | None = None) -> None:
    """The speculative knobs' own ranges, checked whenever they are given (the engine checks them only
    in the modes that use them; a value the document calls invalid is never accepted silently), and
    cache_window's upper bound (a number too large for the engine's int64 tensors was a 500)."""
    for name, value, lo, hi in (("draft_loops", draft_loops, 1, 32), ("verify_loops", verify_loops, 1, max_loops),
                                ("draft_ahead", draft_ahead, 1, 16), ("K_branches", k_branches, 1, 16),
                                ("cache_window", cache_window, 0, MAX_WINDOW)):
        if value is not None and not (lo <= value and (hi is None or value <= hi)):
            raise ValidationError(f"{name}: must be in {lo}..{hi if hi is not None else 'max_loops'}, got {value}",
                                  param=name)


def knob_params(body: BaseModel, **given: Any) -> dict[str, Any]:
    """The SamplingParams keywords of every knob `body` declares: its value, else SamplingParams' default;
    `given` overrides (a route's own reading of one, such as `loops` with a model name's `@loops=K`). The one
    mapping from a request's knobs onto the engine's; the checks a knob needs before the engine's are here."""
    fields = [name for name in type(body).model_fields if name in PARAM]
    value = {name: getattr(body, name) for name in fields}
    check_knobs(*(value.get(n) for n in ("draft_loops", "verify_loops", "draft_ahead", "K_branches", "cache_window")))
    check_timeout(value.get("timeout_s"))
    out = {PARAM[n]: or_default(value[n], param_default(PARAM[n])) for n in fields if n not in SERVER_ONLY}
    out.update(given)
    return out


def add_flags(parser: argparse.ArgumentParser, *groups: type[BaseModel], skip: tuple[str, ...] = ()) -> None:
    """The command line's flags for the knobs of `groups` (`--kv-loops`, `--k-branches`, ...): each parsed
    as its field's type (a value the field refuses is argparse's error naming the flag), its default
    SamplingParams', its help the field's description; `args.<SamplingParams name>` holds it."""
    for group in groups:
        for name, field in group.model_fields.items():
            if name in skip or name in SERVER_ONLY:
                continue
            param = PARAM[name]
            default = param_default(param)
            about = field.description or (field.json_schema_extra or {}).get("description", "")
            about += f" (default: {default})" if default is not None else ""
            parser.add_argument("--" + name.lower().replace("_", "-"), dest=param, default=default,
                                type=_flag_type(name, field.annotation), metavar=_metavar(field.annotation),
                                help=about.replace("%", "%%"))


def _flag_type(name: str, annotation: Any):
    adapter = TypeAdapter(annotation)

    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        if value is None or isinstance(value, (bool, list, dict)):
            value = text
        try:
            return adapter.validate_python(value, strict=True)
        except PydanticError:
            raise argparse.ArgumentTypeError(f"not a value of {name}: {text!r}") from None
    parse.__name__ = name
    return parse


def _metavar(annotation: Any) -> str | None:
    """{latent,kl,gate} for a choice among words, else argparse's default (the flag's name)."""
    words = [a for a in typing.get_args(annotation) if typing.get_origin(a) is Literal]
    if len(words) == 1 and len(typing.get_args(annotation)) == 2:   # Literal[...] | None
        return "{" + ",".join(typing.get_args(words[0])) + "}"
    return None
