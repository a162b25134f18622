"""Perplexity by loop depth over a text, with sliding windows over the model's context.

Windows of `seq_len` tokens advance by `stride` (default seq_len // 2); each token is scored once, by the
first window in which it has at least seq_len - stride tokens of left context (the first window scores
all of its tokens). Windows run through a KV cache of the requested format, so KV quantization shows.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from ..model import KVCache, LoopedTransformer


def windows(n_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first_scored) triples covering positions 1..n_tokens-1 exactly once."""
    out = []
    start, scored_to = 0, 1
    while scored_to < n_tokens:
        end = min(start + seq_len, n_tokens)
        out.append((start, end, scored_to))
        scored_to = end
        if end == n_tokens:
            break
        start = max(0, end - (seq_len - stride))
        if start + seq_len > n_tokens:
            start = max(0, n_tokens - seq_len)
    return out


@torch.inference_mode()
def perplexity(model: LoopedTransformer, token_ids: list[int] | torch.Tensor, loops: int,
               seq_len: int | None = None, stride: int | None = None, kv_format: str = "fp16",
               max_tokens: int | None = None, on_window: Callable[[], None] | None = None) -> dict:
    """`on_window` is called after each window (progress bars)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    seq_len = seq_len or model.cfg.max_seq_len
    stride = stride or seq_len // 2
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    cache_dtype = dtype if dtype.is_floating_point else torch.float32
    nll, count = 0.0, 0
    t0 = time.perf_counter()
    for start, end, first in windows(len(ids), seq_len, stride):
        x = ids[start:end].to(device)[None]
        cache = KVCache(model.cfg, batch=1, max_positions=end - start, loops=loops, dtype=cache_dtype,
                        device=device, kv_format=kv_format)
        logits = model(x, loops, cache=cache, start=0)[0].float()  # (T, V)
        lo = first - start  # first scored target index within the window
        targets = x[0, lo:]
        nll += F.cross_entropy(logits[lo - 1:-1], targets, reduction="sum").item()
        count += targets.numel()
        if on_window is not None:
            on_window()
    loss = nll / max(count, 1)
    return {"loops": loops, "kv_format": kv_format, "tokens_scored": count, "loss": loss,
            "perplexity": math.exp(loss), "seconds": round(time.perf_counter() - t0, 2)}


@torch.inference_mode()
def kl_divergence(ref: LoopedTransformer, model: LoopedTransformer, token_ids: list[int] | torch.Tensor,
                  loops: int, seq_len: int | None = None, stride: int | None = None,
                  max_tokens: int | None = None) -> dict:
    """Mean KL(ref || model) of the next-token distributions over the positions `perplexity` scores.

    The measure of what quantization changes: unlike a perplexity difference, it cannot come out in the
    quantized model's favour by chance (llama.cpp's `--kl-divergence` reports the same quantity)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    seq_len = seq_len or ref.cfg.max_seq_len
    stride = stride or seq_len // 2
    total, count = 0.0, 0
    t0 = time.perf_counter()
    for start, end, first in windows(len(ids), seq_len, stride):
        x = ids[start:end][None]
        lo = first - start
        outs = []
        for m in (ref, model):
            dev = next(m.parameters()).device
            logits = m(x.to(dev), loops)[0, lo - 1:-1].double().cpu()
            outs.append(F.log_softmax(logits, dim=-1))
        p_log, q_log = outs
        total += (p_log.exp() * (p_log - q_log)).sum().item()
        count += p_log.shape[0]
    return {"loops": loops, "tokens_scored": count, "kl": total / max(count, 1),
            "seconds": round(time.perf_counter() - t0, 2)}


def perplexity_table(model: LoopedTransformer, token_ids, loops_list: Iterable[int], **kw) -> list[dict]:
    return [perplexity(model, token_ids, loops, **kw) for loops in loops_list]
