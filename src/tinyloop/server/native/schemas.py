"""The native routes' request bodies (/generate*, /tokenize, /detokenize): every looped-model knob, no OpenAI
wrapping; unknown fields are refused (422). Shared types and checks are schemas.py's."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from ...engine import SamplingParams, param_default
from ...engine.constraint import Constraint
from ...errors import ValidationError
from ..knobs import (DEFAULT_MAX_TOKENS, EFFORT_DEPTH_DOC, KEEP_ALIVE_DOC, KeepAlive, KV_LOOPS_DOC, LOOPS_DOC, MAX_STOP, MAX_WINDOW, MIN_TIMEOUT_S,
                      ChatMessage, ExitCriterion, Int, KVLoops, Loops, NonEmptyStr, PromptIds, ReasoningEffort,
                      StopStrings, TokenIds, seed_of, check_knobs, check_timeout, logit_bias_field, logit_bias_of, rng)


class GenerateRequest(BaseModel):
    """POST /generate: every looped-model knob, no OpenAI wrapping. Unknown fields are refused (422)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    MODE: ClassVar[str] = "generate"

    prompt: NonEmptyStr | PromptIds = Field(description="text or token ids; not empty")
    model: str | None = Field(None, description="several models served: which one (default: the first)")
    keep_alive: KeepAlive | None = Field(None, description=KEEP_ALIVE_DOC)
    max_tokens: Int = rng(DEFAULT_MAX_TOKENS, lo=0, hi_limit="max_tokens", description="0 only with prompt_logprobs")
    loops: Loops | None = rng(lo=1, hi_limit="max_loops", description=LOOPS_DOC)  # None -> the model's default_loops
    exit_criterion: ExitCriterion = param_default("exit_criterion")
    exit_threshold: float | None = rng(gt=0, hi=10)        # None -> the criterion's default
    min_loops: Int = rng(param_default("min_loops"), lo=1, hi_limit="max_loops")
    max_loops: Int | None = rng(lo=1, hi_limit="max_loops")  # the ceiling of "auto"; None -> default_loops
    kv_loops: KVLoops = rng(param_default("kv_loops"), lo=1, hi_limit="max_loops", description=KV_LOOPS_DOC)
    reasoning_effort: ReasoningEffort | None = Field(None, description=EFFORT_DEPTH_DOC)
    logprobs: Int | None = rng(lo=0, hi=20, description="each token's log-probability and this many alternatives "
                                                         "(ids), 0..20; every mode")
    prompt_logprobs: Int | None = rng(lo=0, hi=20, description="each prompt token's log-probability (the first "
                                      "null) and this many alternatives (ids), 0..20, under the model's raw "
                                      "distribution at the request's loops; mode generate only")
    temperature: float = rng(param_default("temperature"), lo=0, hi=2)
    top_k: Int = rng(param_default("top_k"), lo=0, hi=1000)   # SamplingParams' (the CLI's, Engine's) defaults
    top_p: float = rng(param_default("top_p"), gt=0, hi=1)
    repetition_penalty: float = rng(param_default("repetition_penalty"), lo=0.5, hi=2)
    presence_penalty: float = rng(param_default("presence_penalty"), lo=-2, hi=2)
    frequency_penalty: float = rng(param_default("frequency_penalty"), lo=-2, hi=2)
    logit_bias: dict[str, float] | None = logit_bias_field()   # OpenAI's: {"token id": bias}, every mode
    sample_seed: Int = Field(0, description="any integer; outside [-2**63, 2**64) taken modulo 2**64")
    stream: bool = False
    stop: NonEmptyStr | StopStrings | TokenIds | None = Field(
        None, description=f"a string, up to {MAX_STOP} non-empty strings, or stop token ids")
    cache_window: Int = rng(param_default("cache_window"), lo=0, hi=MAX_WINDOW)
    timeout_s: float | None = rng(lo=MIN_TIMEOUT_S, hi=86400)  # time limit for this request (default: the server's)
    json_schema: dict[str, Any] | None = Field(None, description="the output must be JSON matching this schema "
                                               "(llama.cpp's name; docs/structured.md)")
    regex: NonEmptyStr | None = Field(None, description="the output must match this regular expression")
    grammar: NonEmptyStr | None = Field(None, description="the output must match this grammar: llama.cpp's GBNF "
                                        "(root rule `root`) or Lark (docs/structured.md)")

    def constraint(self) -> Constraint | None:
        given = [n for n in ("json_schema", "regex", "grammar") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValidationError(f"{given[1]}: give one of json_schema, regex or grammar, not {' and '.join(given)}",
                                  param=given[1])
        if self.json_schema is not None:
            return Constraint.json_schema(self.json_schema, param="json_schema")
        if self.regex is not None:
            return Constraint("regex", self.regex, param="regex")
        if self.grammar is not None:
            return Constraint("grammar", self.grammar, param="grammar")
        return None

    def sampling_params(self) -> SamplingParams:
        check_timeout(self.timeout_s)
        check_knobs(None, None, None, None, self.cache_window)
        stop: list[str] = []
        stop_ids: list[int] = []
        if isinstance(self.stop, str):
            stop = [self.stop]
        elif self.stop:
            if isinstance(self.stop[0], int):
                stop_ids = list(self.stop)
            else:
                stop = list(self.stop)
        return SamplingParams(
            max_tokens=self.max_tokens, loops=self.loops, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=seed_of(self.sample_seed, "sample_seed"), stop=stop,
            stop_token_ids=stop_ids, cache_window=self.cache_window, mode=self.MODE,
            exit_criterion=self.exit_criterion, exit_threshold=self.exit_threshold, min_loops=self.min_loops,
            max_loops=self.max_loops, kv_loops=self.kv_loops, logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs, constraint=self.constraint(), logit_bias=logit_bias_of(self.logit_bias),
            reasoning_effort=self.reasoning_effort, **self.speculative_params())

    def speculative_params(self) -> dict[str, Any]:
        return {}

    def max_tokens_given(self) -> bool:
        return "max_tokens" in self.model_fields_set


class SpeculativeRequest(GenerateRequest):
    MODE: ClassVar[str] = "speculative"
    draft_loops: Int | None = rng(lo=1, hi=32, description="must be smaller than verify_loops; default: a "
                                  "quarter of verify_loops, at least 1 (2 at 8 loops)")
    verify_loops: Int | None = rng(lo=1, hi_limit="max_loops")  # None -> loops, else the model's default_loops
    draft_ahead: Int = rng(param_default("draft_ahead"), lo=1, hi=16)

    def speculative_params(self) -> dict[str, Any]:
        return {"draft_loops": self.draft_loops, "verify_loops": self.verify_loops,
                "draft_ahead": self.draft_ahead}


class TreeSpeculativeRequest(SpeculativeRequest):
    MODE: ClassVar[str] = "tree_speculative"
    K_branches: Int = rng(param_default("k_branches"), lo=1, hi=16,
                          description="K_branches x draft_ahead <= 64; above 1: cache_window 0")

    def speculative_params(self) -> dict[str, Any]:
        return {**super().speculative_params(), "k_branches": self.K_branches}


class TokenizeRequest(BaseModel):
    """Exactly one of `text`, `prompt` (vLLM's name), `content` (llama.cpp's) or `messages` (null is not a
    value of any)."""
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "oneOf": [{"required": ["text"]}, {"required": ["prompt"]}, {"required": ["content"]},
                  {"required": ["messages"]}]})
    text: str | SkipJsonSchema[None] = None
    prompt: str | SkipJsonSchema[None] = None
    content: str | SkipJsonSchema[None] = None
    messages: list[ChatMessage] | SkipJsonSchema[None] = Field(None, json_schema_extra={"minItems": 1})
    model: str | None = None
    add_special_tokens: bool = Field(True, description="vLLM's: let the tokenizer add its special tokens (BOS) "
                                                       "to text; no effect for GPT-2 models and on messages")

    def plain_text(self) -> str | None:
        """The text to tokenize, under whichever name it came; None for `messages`."""
        given = [v for v in (self.text, self.prompt, self.content) if v is not None]
        return given[0] if given else None

    def given(self) -> int:
        return sum(getattr(self, n) is not None for n in ("text", "prompt", "content", "messages"))

    def model_post_init(self, _: Any) -> None:
        for name in ("text", "prompt", "content", "messages"):
            if name in self.model_fields_set and getattr(self, name) is None:
                raise ValidationError(f"{name}: must not be null", param=name)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    tokens: TokenIds
    model: str | None = None
