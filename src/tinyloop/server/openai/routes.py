"""OpenAI-compatible routes (/v1/*). The /api/v0 routes (openai/lmstudio.py) reuse these handlers with extras."""

from __future__ import annotations

from typing import Any, Callable

from fastapi import APIRouter, Request

from ...chat import Chat
from ...engine import SamplingParams
from ...engine.thinking import THINK, resolve
from ...errors import ValidationError
from ..access import note
from ..errors import APIError
from ..generation import MergedHandle, ServerState, state_of, collect_all, new_id, now, stream, sum_usage, total_usage
from ..logprobs import chat_content, chat_logprobs, completion_logprobs, completion_tail, join
from .schemas import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from ..sse import ChatFramer, CompletionFramer, ToolChatFramer
from ..reasoning import Answer, thinking_budget
from ..structured import ToolPlan

router = APIRouter()


def model_card(state: ServerState) -> dict[str, Any]:
    """OpenAI's model object, and the depths it runs at (TinyLoop): `default_loops`, `max_loops` (any depth
    1..max_loops per request), and `trained_loops`, [shallowest, deepest] as the model's family declares
    them (where reasoning_effort picks its depth), or null where it declares none."""
    cfg = state.worker.require_engine().config
    return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "tinyloop",
            "default_loops": cfg.default_loops, "max_loops": cfg.max_loops,
            "trained_loops": list(cfg.trained_loops) or None}


def find_model(state: ServerState, model_id: str) -> None:
    """`/v1/models/{id}`: any of the server's names (its id first: the file's stem by default)."""
    state.worker.require_engine()
    if model_id not in state.names:
        raise APIError(404, f"model {model_id!r} not found; this server serves {state.model_id!r}", param="model",
                       code="model_not_found")


def model_routes(router: APIRouter, prefix: str, card: Callable[[ServerState], dict[str, Any]]) -> None:
    """GET {prefix}/models (the list) and {prefix}/models/{id} (one, or 404 model_not_found): the served
    model as `card` describes it (OpenAI's shape here, LM Studio's on /api/v0)."""

    lmstudio = prefix == "/api/v0"

    @router.get(f"{prefix}/models")
    async def list_models(request: Request):
        pool = state_of(request)
        if pool.single and pool.default.served is not None:   # one model: its card, as it always was
            return {"object": "list", "data": [card(pool)]}
        return {"object": "list", "data": [pool.card(entry, card, lmstudio) for entry in pool.entries]}

    @router.get(f"{prefix}/models/{{model_id:path}}")
    async def get_model(model_id: str, request: Request):
        pool = state_of(request)
        if pool.single and pool.default.served is not None:
            find_model(pool, model_id)
            return card(pool)
        return pool.card(pool.listed(model_id), card, lmstudio)


model_routes(router, "/v1", model_card)


def chat_inputs(engine, body: ChatCompletionRequest, params: SamplingParams, *,
                reasoning: str = "auto") -> tuple[Chat, SamplingParams, ToolPlan | None]:
    """A chat request's conversation as the engine renders it, its sampling params with the constraint its
    tools add and its thinking budget, and its tool plan (their prompt, constraint and parsing; None without
    tools): what every chat route submits (/v1 and /api/v0 chat completions, and Anthropic's Messages API
    translated onto them). `reasoning`: the server's TINYLOOP_REASONING_PARSER (server/reasoning.py)."""
    template = getattr(engine.tokenizer, "chat_template", None)
    tools = body.tool_plan(template)
    if tools is not None:
        params = params.replace(constraint=tools.constraint(engine.tokenizer))
    return body.prompt(template, tools), thinking_params(engine, body, params, reasoning), tools


def thinking_params(engine, body: ChatCompletionRequest, params: SamplingParams, reasoning: str) -> SamplingParams:
    """The thinking block's tags (the server's reasoning parser: auto, none, think) and budget
    (max_thinking_tokens, else reasoning_effort's); neither has an effect on a model that does not think."""
    thinking = {"none": False, "think": THINK}.get(reasoning)
    budget = thinking_budget(body.max_thinking_tokens, getattr(body, "reasoning_effort", None))
    if budget is not None and resolve(thinking, engine.tokenizer) is None:
        budget = None
    return params.replace(thinking=thinking, max_thinking_tokens=budget)


def messages_error(exc: ValidationError) -> ValidationError:
    """A chat request's prompt is its messages: an error about the prompt (over the context, a template
    that refused it) names `messages`."""
    if exc.param != "prompt":
        return exc
    return ValidationError("messages" + exc.message.removeprefix("prompt").replace("the prompt", "the messages"),
                           param="messages", code=exc.code)


def loops_report(results) -> dict[str, Any]:
    """How deep the answer went, beside `usage` (a TinyLoop extension; `stats`' names on /api/v0 and /generate):
    `loops_used`, the mean core loops over every generated token of every choice (under `loops: "auto"` each
    token's own depth; else the depth asked for), and `loops_histogram`, core loops -> tokens that ran that many.
    A stream says the same per chunk (`choices[].loops` under "auto")."""
    histogram: dict[int, int] = {}
    for r in results:
        for loops, count in (r.stats.get("loops_histogram") or {}).items():
            histogram[int(loops)] = histogram.get(int(loops), 0) + count
    tokens = sum(histogram.values())
    if not tokens:   # nothing generated (echo with max_tokens 0): the depth the request ran at
        used = results[0].stats.get("loops_used")
    elif len(histogram) == 1:
        used = next(iter(histogram))
    else:
        used = round(sum(k * v for k, v in histogram.items()) / tokens, 3)
    return {"loops_used": used, "loops_histogram": {str(k): histogram[k] for k in sorted(histogram)}}


async def run_completion(request: Request, body: OpenAIRequest, *, chat: bool, extended: bool):
    """Shared by /v1 and /api/v0, chat and text completion. A text completion's list of prompts is a batch:
    one engine request per prompt, running side by side; prompt i's choices are indices i*n .. i*n+n-1."""
    state = await state_of(request).model(body.model, body.timeout_s, body.keep_alive)
    params = body.sampling_params(state.settings.temperature)
    n = body.choices()
    engine = state.worker.require_engine()
    tools = None
    if chat:
        prompt, params, tools = chat_inputs(engine, body, params, reasoning=state.settings.reasoning_parser)
        prompts = [prompt]
    else:
        prompts = body.prompt_inputs(engine.config.vocab_size)
    handles = []
    try:
        for prompt in prompts:
            handles.append(await state.submit(prompt, params, n=n, timeout_s=body.timeout_s,
                                              max_tokens_given=body.max_tokens_given()))
    except BaseException as exc:
        for h in handles:
            h.abort()
        if chat and isinstance(exc, ValidationError):
            raise messages_error(exc) from None
        raise
    if len(handles) > 1:  # the access line counts the whole batch
        note(n=n * len(handles), prompt_tokens=sum(h.plan.n_prompt for h in handles))
    # echo: each prompt's text (as given, or its ids decoded) and ids
    echo = [(p if isinstance(p, str) else engine.tokenizer.decode(p), list(h.plan.prompt_ids))
            for p, h in zip(prompts, handles)] if not chat and body.echo else None
    rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
    # how a chat answer is read: reasoning apart (a model that thinks) and tool calls (server/reasoning.py)
    thinking = handles[0].plan.thinking if chat else None
    answer = Answer(tools, thinking) if tools is not None or thinking is not None else None
    extras = state.lmstudio_extras if extended else None
    tokenizer = engine.tokenizer if params.logprobs is not None else None
    if body.wants_stream():
        framer = ToolChatFramer(plan=answer, id=rid, created=created, model=body.model, extras=extras, n=n,
                                include_usage=body.include_usage(), tokenizer=tokenizer) if answer is not None else \
            ChatFramer(id=rid, created=created, model=body.model, include_usage=body.include_usage(),
                       extras=extras, n=n, tokenizer=tokenizer) if chat else \
            CompletionFramer(id=rid, created=created, model=body.model, include_usage=body.include_usage(),
                             extras=extras, n=n * len(handles), per_prompt=n, tokenizer=tokenizer, echo=echo)
        handle = handles[0] if len(handles) == 1 else MergedHandle(handles, n)
        return await stream(handle, framer, state.settings.keepalive_s)
    batches = await collect_all(handles, request)
    choices = []
    for p, results in enumerate(batches):
        for i, result in enumerate(results):
            if chat:
                message, finish = ({"role": "assistant", "content": result.text}, result.finish_reason) \
                    if answer is None else answer.message(result.text, result.finish_reason)
                message["refusal"] = None   # OpenAI's schema: required, null (these models refuse nothing apart)
                choices.append({"index": i, "message": message, "logprobs": None, "finish_reason": finish})
                if result.stats.get("schema_check"):   # a schema checked after generation (docs/structured.md)
                    choices[-1]["schema_check"] = result.stats["schema_check"]
                if tokenizer is not None:
                    choices[-1]["logprobs"] = chat_logprobs(chat_content(tokenizer, result.token_ids, result.logprobs))
                continue
            head, ids = echo[p] if echo else ("", [])
            choices.append({"text": head + result.text, "index": p * n + i, "logprobs": None,
                            "finish_reason": result.finish_reason})
            if tokenizer is not None:
                lp = completion_tail(tokenizer, result.token_ids, result.logprobs, result.stop_logprob, len(head),
                                     len(head) + len(result.text))
                if echo:
                    lp = join(completion_logprobs(tokenizer, ids, result.prompt_logprobs), lp)
                choices[-1]["logprobs"] = lp
            if result.stats.get("schema_check"):   # a schema checked after generation (docs/structured.md)
                choices[-1]["schema_check"] = result.stats["schema_check"]
    out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
           "model": body.model, "choices": choices, "usage": sum_usage([total_usage(r) for r in batches]),
           **loops_report([r for results in batches for r in results])}
    if extras:
        out.update(extras(batches[0][0].stats))
    return out


def completion_routes(router: APIRouter, prefix: str, chat_body: type[OpenAIRequest], text_body: type[OpenAIRequest],
                      *, extended: bool) -> None:
    """POST {prefix}/chat/completions and {prefix}/completions, their bodies read as `chat_body` and `text_body`
    (/v1: OpenAI's; /api/v0: LM Studio's, `extended` with stats, model_info and runtime)."""

    async def chat_completions(body, request: Request):
        return await run_completion(request, body, chat=True, extended=extended)

    async def completions(body, request: Request):
        return await run_completion(request, body, chat=False, extended=extended)

    for handler, body_type, path in ((chat_completions, chat_body, "/chat/completions"),
                                     (completions, text_body, "/completions")):
        handler.__annotations__ = {"body": body_type, "request": Request}
        router.post(prefix + path)(handler)


completion_routes(router, "/v1", ChatCompletionRequest, CompletionRequest, extended=False)
