"""The native routes' request bodies (/generate*, /tokenize, /detokenize): every looped-model knob, no OpenAI
wrapping; unknown fields are refused (422). Shared types and checks are schemas.py's."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from ...engine import SamplingParams, param_default
from ...engine.constraint import Constraint
from ...errors import ValidationError
from ...engine.knobs import DepthKnobs, Int, RequestKnobs, SpeculationKnobs, TreeKnobs, knob_params, rng
from ..knobs import (DEFAULT_MAX_TOKENS, EFFORT_DEPTH_DOC, MAX_STOP, ChatMessage, NonEmptyStr, PromptIds,
                     ReasoningEffort, StopStrings, TokenIds, logit_bias_field, logit_bias_of, seed_of)


class GenerateRequest(DepthKnobs, RequestKnobs):
    """POST /generate: every looped-model knob (the depth and request knobs every API shares, server/knobs.py),
    no OpenAI wrapping. Unknown fields are refused (422)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    MODE: ClassVar[str] = "generate"

    prompt: NonEmptyStr | PromptIds = Field(description="text or token ids; not empty")
    model: str | None = Field(None, description="several models served: which one (default: the first)")
    max_tokens: Int = rng(DEFAULT_MAX_TOKENS, lo=0, hi_limit="max_tokens", description="0 only with prompt_logprobs")
    reasoning_effort: ReasoningEffort | None = Field(None, description=EFFORT_DEPTH_DOC)
    logprobs: Int | None = rng(lo=0, hi=20, description="each token's log-probability and this many alternatives "
                                                         "(ids), 0..20; every mode")
    prompt_logprobs: Int | None = rng(lo=0, hi=20, description="each prompt token's log-probability (the first "
                                      "null) and this many alternatives (ids), 0..20, under the model's raw "
                                      "distribution at the request's loops; mode generate only")
    temperature: float = rng(param_default("temperature"), lo=0, hi=2)
    top_k: Int = rng(param_default("top_k"), lo=0, hi=1000)   # SamplingParams' (the CLI's, Engine's) defaults
    top_p: float = rng(param_default("top_p"), gt=0, hi=1)
    presence_penalty: float = rng(param_default("presence_penalty"), lo=-2, hi=2)
    frequency_penalty: float = rng(param_default("frequency_penalty"), lo=-2, hi=2)
    logit_bias: dict[str, float] | None = logit_bias_field()   # OpenAI's: {"token id": bias}, every mode
    sample_seed: Int = Field(0, description="any integer; outside [-2**63, 2**64) taken modulo 2**64")
    stream: bool = False
    stop: NonEmptyStr | StopStrings | TokenIds | None = Field(
        None, description=f"a string, up to {MAX_STOP} non-empty strings, or stop token ids")
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
            max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=seed_of(self.sample_seed, "sample_seed"), stop=stop, stop_token_ids=stop_ids, mode=self.MODE,
            logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs, constraint=self.constraint(),
            logit_bias=logit_bias_of(self.logit_bias), reasoning_effort=self.reasoning_effort, **knob_params(self))

    def max_tokens_given(self) -> bool:
        return "max_tokens" in self.model_fields_set


class SpeculativeRequest(GenerateRequest, SpeculationKnobs):
    MODE: ClassVar[str] = "speculative"


class TreeSpeculativeRequest(SpeculativeRequest, TreeKnobs):
    MODE: ClassVar[str] = "tree_speculative"


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
