"""TinyLoop-native routes: /generate (and its speculative variants), /tokenize, /detokenize."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request

from ..errors import ValidationError
from .logprobs import native_logprob
from .generation import collect, stream
from .openai import state_of
from .schemas import (DetokenizeRequest, GenerateRequest, SpeculativeRequest, TokenizeRequest,
                      TreeSpeculativeRequest, render_chat)
from .sse import NativeFramer

router = APIRouter()


async def run_generate(request: Request, body: GenerateRequest):
    state = state_of(request)
    handle = await state.submit(body.prompt, body.sampling_params(), timeout_s=body.timeout_s,
                                max_tokens_given=body.max_tokens_given())
    if body.stream:
        return await stream(handle, NativeFramer(id="", created=0, model=""), state.settings.keepalive_s)
    result = (await collect(handle, request))[0]
    out = {"tokens": result.token_ids, "text": result.text, "finish_reason": result.finish_reason,
           "stats": result.stats}
    if result.logprobs is not None:
        out["logprobs"] = [native_logprob(lp) for lp in result.logprobs]
    return out


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request):
    return await run_generate(request, body)


@router.post("/generate/speculative")
async def generate_speculative(body: SpeculativeRequest, request: Request):
    return await run_generate(request, body)


@router.post("/generate/tree_speculative")
async def generate_tree_speculative(body: TreeSpeculativeRequest, request: Request):
    return await run_generate(request, body)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    """{"text": ...} (or vLLM's "prompt", llama.cpp's "content") or {"messages": [...]} (rendered with the
    chat template) -> token ids."""
    engine = state_of(request).worker.require_engine()
    if body.given() != 1:
        raise ValidationError("give exactly one of text (or prompt, or content) or messages", param="text")
    text = body.plain_text()
    if text is not None:
        ids = await anyio.to_thread.run_sync(engine.tokenizer.encode, text)
    else:  # what a chat request would feed the model: its chat template, special tokens as ids
        ids = await anyio.to_thread.run_sync(engine.encode_prompt, render_chat(body.messages))
    return {"tokens": ids, "count": len(ids), "max_seq_len": engine.max_seq_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    engine = state_of(request).worker.require_engine()
    vocab = engine.tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ValidationError(f"tokens: ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}", param="tokens")
    text = await anyio.to_thread.run_sync(engine.tokenizer.decode, body.tokens)
    return {"text": text}
