"""Token-id generation for one sequence: prefill, then one decode step per token.

This layer knows nothing of text: ids in, ids out. Closing the generator frees its KV cache.
"""

from __future__ import annotations

from typing import Iterator

import torch

from ..model import KVCache, LoopedTransformer
from .params import SamplingParams
from .sampling import Sampler

PREFILL_CHUNK = 256


def new_cache(model: LoopedTransformer, n_positions: int, loops: int, window: int,
              dtype: torch.dtype | None = None, batch: int = 1, kv_format: str = "fp16",
              extra_slots: int = 0) -> KVCache:
    """A cache for one request: exactly the positions it can reach (or a ring of the window)."""
    p = next(model.parameters())
    cache_dtype = dtype if dtype is not None else (p.dtype if p.dtype.is_floating_point else torch.float32)
    return KVCache(model.cfg, batch=batch, max_positions=n_positions, loops=loops, window=window,
                   dtype=cache_dtype, device=p.device, kv_format=kv_format, extra_slots=extra_slots)


@torch.inference_mode()
def prefill(model: LoopedTransformer, ids: list[int], cache: KVCache, loops: int,
            chunk: int = PREFILL_CHUNK, after_loop=None) -> torch.Tensor:
    """Run the prompt through the model in chunks; returns the last position's logits (V,).
    `after_loop` is passed to the model's forward (see `LoopedTransformer.forward`)."""
    device = next(model.parameters()).device
    logits = None
    for s in range(0, len(ids), chunk):
        part = torch.tensor([ids[s:s + chunk]], device=device)
        logits = model(part, loops, cache=cache, start=cache.length, last_only=True, after_loop=after_loop)
        cache.length += part.shape[1]
    return logits[0, -1]


@torch.inference_mode()
def decode_step(model: LoopedTransformer, token: int, cache: KVCache, loops: int) -> torch.Tensor:
    device = next(model.parameters()).device
    logits = model(torch.tensor([[token]], device=device), loops, cache=cache, start=cache.length, last_only=True)
    cache.length += 1
    return logits[0, -1]


def generate_ids(model: LoopedTransformer, prompt_ids: list[int], params: SamplingParams,
                 sampler: Sampler | None = None, kv_format: str = "fp16") -> Iterator[int]:
    """Yield up to params.max_tokens token ids (plain generate mode). Stops are the caller's job."""
    loops = params.effective_loops(model.cfg.default_loops)
    sampler = sampler or Sampler(params, prompt_ids, model.cfg.vocab_size)
    cache = new_cache(model, len(prompt_ids) + params.max_tokens, loops, params.cache_window, kv_format=kv_format)
    try:
        logits = prefill(model, prompt_ids, cache, loops)
        for i in range(params.max_tokens):
            tok = sampler.sample(logits)
            sampler.accept(tok)
            yield tok
            if i + 1 < params.max_tokens:
                logits = decode_step(model, tok, cache, loops)
    finally:
        del cache
