"""TinyLoop-native routes: /generate (and its speculative variants), /tokenize, /detokenize."""

from __future__ import annotations

from functools import partial

import anyio
from fastapi import APIRouter, Request

from ...errors import ValidationError
from ...tokenizer import HFTokenizer
from ..logprobs import native_logprob
from ..generation import collect, stream
from ..generation import state_of
from .schemas import (DetokenizeRequest, GenerateRequest, SpeculativeRequest, TokenizeRequest,
                             TreeSpeculativeRequest)
from ..knobs import render_chat
from ..sse import NativeFramer

router = APIRouter()


async def model_of(request: Request, name: str | None, timeout_s: float | None = None, keep_alive=None):
    """The model a native request names (several served; default the first): with one served, its `model` is
    not read, as before."""
    pool = state_of(request)
    return await pool.model(None if pool.single else name, timeout_s, keep_alive)


async def run_generate(request: Request, body: GenerateRequest):
    state = await model_of(request, body.model, body.timeout_s, body.keep_alive)
    handle = await state.submit(body.prompt, body.sampling_params(), timeout_s=body.timeout_s,
                                max_tokens_given=body.max_tokens_given())
    if body.stream:
        return await stream(handle, NativeFramer(id="", created=0, model=""), state.settings.keepalive_s)
    result = (await collect(handle, request))[0]
    out = {"tokens": result.token_ids, "text": result.text, "finish_reason": result.finish_reason,
           "stats": result.stats}
    if result.logprobs is not None:
        out["logprobs"] = [native_logprob(lp) for lp in result.logprobs]
    if result.prompt_logprobs is not None:
        out["prompt_logprobs"] = [native_logprob(lp) for lp in result.prompt_logprobs]
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
    engine = (await model_of(request, body.model)).worker.require_engine()
    if body.given() != 1:
        raise ValidationError("give exactly one of text (or prompt, or content) or messages", param="text")
    text = body.plain_text()
    if text is not None:
        encode = engine.tokenizer.encode
        if isinstance(engine.tokenizer, HFTokenizer):  # GPT-2 BPE adds no special tokens either way
            encode = partial(encode, add_special_tokens=body.add_special_tokens)
        ids = await anyio.to_thread.run_sync(encode, text)
    else:  # what a chat request would feed the model: its chat template, special tokens as ids
        chat = render_chat(body.messages, getattr(engine.tokenizer, "chat_template", None))
        ids = await anyio.to_thread.run_sync(engine.encode_prompt, chat)
    return {"tokens": ids, "count": len(ids), "max_seq_len": engine.max_seq_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    engine = (await model_of(request, body.model)).worker.require_engine()
    vocab = engine.tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ValidationError(f"tokens: ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}", param="tokens")
    text = await anyio.to_thread.run_sync(engine.tokenizer.decode, body.tokens)
    return {"text": text, "prompt": text}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None):
    """vLLM's tokenizer description, which lm-eval's `local-completions` model looks for to tokenize through
    this server (`/tokenize`, `/detokenize`) instead of loading a Hugging Face tokenizer (docs/evaluation.md)."""
    engine = (await model_of(request, model)).worker.require_engine()
    tok = engine.tokenizer
    if tok is None:
        raise ValidationError("this model has no tokenizer", param=None)
    return {"tokenizer_class": "HFTokenizer" if isinstance(tok, HFTokenizer) else "GPT2BPE (tiktoken)",
            "eos_token": tok.eos_token, "bos_token": getattr(tok, "bos_token", None), "pad_token": None,
            "chat_template": getattr(tok, "chat_template", None), "model_max_length": engine.max_seq_len,
            "vocab_size": tok.vocab_size}
