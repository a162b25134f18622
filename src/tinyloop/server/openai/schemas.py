"""OpenAI's request bodies (/v1/chat/completions, /v1/completions, and LM Studio's /api/v0 variants): OpenAI's
fields, names and defaults on top of TinyLoop's knobs (server/knobs.py, declared once for every route)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from ...chat import Chat
from ...engine import SamplingParams, param_default
from ...engine.constraint import Constraint
from ...engine.plan import MAX_N
from ...errors import ValidationError
from ...engine.knobs import Int, LoopKnobs, or_default, doc, knob_params, rng
from ..knobs import (ChatMessage, DEFAULT_MAX_TOKENS, EFFORT_DOC, MAX_STOP, NO_EFFECT, NonEmptyStr,
                     OPENAI_TEMPERATURE, Prediction, PromptIds, ReasoningEffort, StopStrings, StreamOptions, UNSUPPORTED, closed_schema,
                     seed_of, is_default, logit_bias_field, logit_bias_of, render_chat, requested_loops)
from ..structured import ResponseFormat, Tool, ToolChoice, ToolPlan


class OpenAIRequest(LoopKnobs):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI's names and defaults), plus
    TinyLoop's knobs (LoopKnobs). A field that is neither is a 400 naming it (`unknown_parameter`), never
    silently ignored: a typo'd knob would otherwise run as plain generation. Extra fields are let through
    pydantic (so that this is a 400 naming the field, not a 422) and refused in `check_unsupported`; the
    document says `additionalProperties: false`."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=closed_schema)

    model: str = Field(description='any name, echoed into the response (under --strict-model-names one of the '
                                   'server\'s names, GET /v1/models, else 404 model_not_found); a name ending in '
                                   '"@loops=K" (K a depth or "auto") '
                                   'asks for that depth when the body names no loops (harnesses that fix the '
                                   'rest of the body: docs/evaluation.md)', json_schema_extra={"x-model-names": True})
    max_tokens: Int | None = rng(lo=1, hi_limit="max_tokens")
    temperature: float | None = rng(lo=0, hi=2)
    top_p: float | None = rng(gt=0, hi=1)
    top_k: Int | None = rng(lo=0, hi=1000)   # extension: off unless given
    n: Int | None = rng(lo=1, hi=MAX_N)
    stop: NonEmptyStr | StopStrings | None = Field(None, description=f"up to {MAX_STOP} non-empty strings")
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    seed: Int | None = Field(None, description="any integer; outside [-2**63, 2**64) taken modulo 2**64")
    presence_penalty: float | None = rng(lo=-2, hi=2)
    frequency_penalty: float | None = rng(lo=-2, hi=2)
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = logit_bias_field()
    # OpenAI's bookkeeping fields: accepted, no effect here (docs/server.md)
    user: str | None = Field(None, description=NO_EFFECT)
    metadata: dict[str, str] | None = Field(None, description=NO_EFFECT)
    store: bool | None = Field(None, description="false (or null) only: chat completions are not stored here "
                                                 "(true is a 400; /v1/responses stores)",
                               json_schema_extra={"enum": [False, None]})
    service_tier: str | None = Field(None, description=NO_EFFECT)
    safety_identifier: str | None = Field(None, description=NO_EFFECT)
    prompt_cache_key: str | None = Field(None, description="accepted; no effect (the prefix cache is automatic)")
    # OpenAI's (chat; taken by text completions too): the depth on a model with a trained range (engine/knobs.py
    # SamplingParams.with_effort), and chat's thinking budget (server/reasoning.py)
    reasoning_effort: ReasoningEffort | None = Field(None, description=EFFORT_DOC)

    def check_unsupported(self) -> None:
        if self.store:
            raise ValidationError("store: chat completions are not stored by this server (leave store false; "
                                  "/v1/responses stores responses)", param="store", code="unsupported_parameter")
        for name, value in (self.model_extra or {}).items():
            if name not in UNSUPPORTED:
                raise ValidationError(f"{name}: unknown field; this route takes OpenAI's fields and TinyLoop's "
                                      "knobs (the list: /docs or /openapi.json)", param=name,
                                      code="unknown_parameter")
            if not is_default(value, UNSUPPORTED[name]):
                raise ValidationError(f"{name}: is not supported by TinyLoop", param=name, code="unsupported_parameter")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def wants_stream(self) -> bool:
        return bool(self.stream)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int:
        return or_default(self.max_tokens, DEFAULT_MAX_TOKENS)

    def max_tokens_given(self) -> bool:
        return self.max_tokens is not None

    def sampling_params(self, temperature: float | None = None) -> SamplingParams:
        """`temperature`: the server's for a request that gives none (`serve --temperature`; None: OpenAI's 1.0)."""
        self.check_unsupported()
        if self.stream_options is not None and not self.stream:
            raise ValidationError("stream_options: only allowed when stream is true", param="stream_options")
        return SamplingParams(
            max_tokens=self.requested_max_tokens(),
            temperature=or_default(self.temperature, or_default(temperature, OPENAI_TEMPERATURE)),
            top_p=or_default(self.top_p, param_default("top_p")),
            top_k=or_default(self.top_k, param_default("top_k")),
            presence_penalty=or_default(self.presence_penalty, param_default("presence_penalty")),
            frequency_penalty=or_default(self.frequency_penalty, param_default("frequency_penalty")),
            seed=seed_of(self.seed, "seed"), stop=self.stop_list(),
            logprobs=self.logprobs_param(), constraint=self.constraint(), logit_bias=logit_bias_of(self.logit_bias),
            reasoning_effort=self.reasoning_effort, **knob_params(self, loops=self.requested_loops()))

    def constraint(self) -> Constraint | None:
        """What the output must match (`response_format`; chat's `tools` add theirs: server/tools.py)."""
        return self.response_format.constraint() if self.response_format is not None else None

    def requested_loops(self) -> int | str | None:
        return requested_loops(self.loops, self.model)

    def logprobs_param(self) -> int | None:
        """Alternatives per token to report (SamplingParams.logprobs), or None."""
        return None

    def choices(self) -> int:
        """`n` as asked (default 1); the request plan checks its range with every other knob."""
        return or_default(self.n, 1)


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: Int | None = rng(lo=1, hi_limit="max_tokens")  # newer clients' name for max_tokens
    logprobs: bool | None = Field(None, description="return each output token's log-probability (docs/server.md)")
    top_logprobs: Int | None = rng(lo=0, hi=20, description="alternatives per token, 0..20; needs logprobs: true")

    # accepted OpenAI fields (docs/server.md): text output only; the rest have no effect on this server
    modalities: list[Literal["text"]] | None = Field(None, description='["text"] only (the models write text)')
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description=NO_EFFECT)
    prediction: Prediction | None = Field(None, description="accepted (type content); it does not change the output")

    def logprobs_param(self) -> int | None:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ValidationError(f"top_logprobs: must be in 0..20 (alternatives per token), got {self.top_logprobs}",
                                  param="top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise ValidationError("top_logprobs: needs logprobs: true", param="top_logprobs")
        return or_default(self.top_logprobs, 0) if self.logprobs else None

    def requested_max_tokens(self) -> int:
        if self.max_completion_tokens is not None and self.max_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValidationError(f"max_tokens: {self.max_tokens} and max_completion_tokens "
                                  f"{self.max_completion_tokens} disagree; give one (max_tokens is OpenAI's older name)",
                                  param="max_tokens")
        value = or_default(self.max_completion_tokens, or_default(self.max_tokens, DEFAULT_MAX_TOKENS))
        if value < 1:  # chat has no prompt scoring: the engine's "0 only with prompt_logprobs" does not apply
            name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
            raise ValidationError(f"{name}: must be at least 1, got {value}", param=name)
        return value

    def max_tokens_given(self) -> bool:
        return self.max_tokens is not None or self.max_completion_tokens is not None

    tools: list[Tool] | None = Field(None, description="functions the model may call (docs/structured.md)")
    tool_choice: ToolChoice | None = Field(None, description='"none", "auto" (default with tools), "required", '
                                           'or {"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: bool | None = Field(None, description="allow more than one call per answer (default true)")
    # reasoning (docs/server.md, "Reasoning"); reasoning_effort is OpenAI's (OpenAIRequest)
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="more variables for the model's chat "
                                                        "template (enable_thinking: false turns thinking off)")
    max_thinking_tokens: Int | None = rng(lo=0, hi=8192, description="tokens the thinking block may hold; then "
                                          "its closing tag is forced and the answer starts (no effect on a model "
                                          "that does not think)")

    def tool_plan(self, template: str | None) -> ToolPlan | None:
        plan = ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls, template, self.chat_template_kwargs)
        if plan is not None and self.response_format is not None and self.response_format.type != "text":
            raise ValidationError("response_format: give tools or a response_format, not both (or tool_choice "
                                  '"none")', param="response_format")
        return plan

    def prompt(self, template: str | None = None, tools: ToolPlan | None = None) -> Chat:
        chat = render_chat(self.messages, template)
        if self.chat_template_kwargs:
            chat = Chat(chat.messages, template_kwargs=self.chat_template_kwargs)
        return tools.chat(chat) if tools is not None else chat


MAX_PROMPTS = 16  # prompts in one /v1/completions request (each is a request of the batch)


class CompletionRequest(OpenAIRequest):
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], doc(minItems=1, maxItems=MAX_PROMPTS)] | PromptIds | \
        Annotated[list[PromptIds], doc(minItems=1, maxItems=MAX_PROMPTS)] = Field(
            description=f"text, token ids, or a list of up to {MAX_PROMPTS} of either (a batch: prompt i's choices are "
                        "indices i*n .. i*n+n-1); none empty")
    max_tokens: Int | None = rng(lo=0, hi_limit="max_tokens", description="0 only with echo: score the prompt")
    echo: bool | None = Field(False, description="return the prompt before the completion; with logprobs, the "
                                                 "prompt tokens' log-probabilities first (the first one null)")
    logprobs: Int | None = rng(lo=0, hi=5, description="return each output token's log-probability and this many "
                                                         "alternatives, 0..5 (docs/server.md)")

    def logprobs_param(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise ValidationError(f"logprobs: must be in 0..5 (alternatives per token), got {self.logprobs}",
                                  param="logprobs")
        return self.logprobs

    def sampling_params(self, temperature: float | None = None) -> SamplingParams:
        """As OpenAI's legacy completions: max_tokens 0 only with echo; echo with logprobs scores the prompt
        (SamplingParams.prompt_logprobs, so does echo with max_tokens 0)."""
        params = super().sampling_params(temperature)
        if not self.echo:
            if params.max_tokens == 0:
                raise ValidationError("max_tokens: must be at least 1; 0 only with echo: true (score the prompt)",
                                      param="max_tokens")
            return params
        if params.logprobs is None and params.max_tokens > 0:
            return params  # the prompt's text only: nothing to score
        if params.mode != "generate":
            raise ValidationError(f"echo: the prompt is not scored in mode {params.mode!r} yet (echo with logprobs "
                                  "or max_tokens 0); use mode generate", param="echo")
        return params.replace(prompt_logprobs=params.logprobs or 0)

    def prompt_inputs(self, vocab_size: int | None = None) -> list[str | list[int]]:
        """Each prompt: a string or token ids (a list of strings or of id lists is a batch)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValidationError("prompt: is empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]  # token ids
        if len(p) > MAX_PROMPTS:
            raise ValidationError(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(p)}", param="prompt")
        out = []
        for i, each in enumerate(p):
            if not each:
                raise ValidationError(f"prompt[{i}]: is empty", param="prompt")
            if vocab_size is not None and not isinstance(each, str):
                bad = [t for t in each if not 0 <= t < vocab_size]
                if bad:
                    raise ValidationError(f"prompt[{i}]: token ids {bad[:5]} are outside the vocabulary "
                                          f"0..{vocab_size - 1}", param="prompt")
            out.append(each if isinstance(each, str) else list(each))
        return out


class LMStudioChatRequest(ChatCompletionRequest):
    """/api/v0/chat/completions: the /v1 body (its own name in the document)."""


class LMStudioCompletionRequest(CompletionRequest):
    """/api/v0/completions: the /v1 body (its own name in the document)."""
