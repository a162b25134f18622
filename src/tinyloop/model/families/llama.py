"""Llama, imported from a llama.cpp GGUF file (`general.architecture` "llama": SmolLM2, TinyLlama-style
and Llama-3 GGUFs) as a **one-loop** model: every layer in the core, run once (n_prelude 0, n_core L, n_coda
0, `default_loops` = `max_loops` = 1, no injection, no loop norm, pre-norm blocks, the final norm before the
head). A request's `loops` above 1, or speculation, is refused by name (`engine/knobs.py`): the model has
no depth to choose.

GGUF metadata -> ModelConfig (`gguf_config`) and GGUF tensor names -> TinyLoop's (`gguf_tensor`); the file
is read by `tools/gguf.py`. llama.cpp stores `attn_q` and `attn_k` with each head's rows interleaved for its
adjacent-pair RoPE (its converter permutes Hugging Face's half-split rows so); `gguf_tensor` puts them back
in the half-split order TinyLoop computes (`unpermute`: `common.half_split`'s permutation, which Huginn's
and Parcae's interleaved checkpoints take too). Options llama.cpp's `llama` graph has that TinyLoop does not run (partial
RoPE, RoPE scaling other than Llama-3's, biases, experts, a q/k/v width that is not heads x head_dim) are
refused by name. The family has no Hugging Face snapshot conversion (it is not a looped family)."""

from __future__ import annotations

from typing import Any

import torch

from ...config import ModelConfig
from ..layers import rope_frequencies
from . import ConvertError, Emit, Family

LAYER = {"attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "mlp_norm.weight",
         "attn_q.weight": "attn.wq.weight", "attn_k.weight": "attn.wk.weight", "attn_v.weight": "attn.wv.weight",
         "attn_output.weight": "attn.wo.weight", "ffn_gate.weight": "mlp.w_gate.weight",
         "ffn_up.weight": "mlp.w_up.weight", "ffn_down.weight": "mlp.w_down.weight"}
# metadata keys of llama.cpp's llama graph that change the forward; set (non-zero), each is refused by name
OFF = ("expert_count", "expert_used_count", "attention.clamp_kqv", "attention.sliding_window", "logit_scale",
       "attention.max_alibi_bias", "embedding_scale", "residual_scale", "attention.scale")
LLAMA3_STANDARD = (1.0, 4.0, 8192.0)   # low_freq_factor, high_freq_factor, original context: Llama-3.1 / 3.2's


def _int(g: Any, key: str, default: Any = None) -> int:
    v = g.arch_key(key, default)
    if v is None:
        raise ConvertError(f"{g.path}: no {g.arch}.{key} in the metadata")
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise ConvertError(f"{g.path}: {g.arch}.{key} differs between layers ({sorted(set(v))}); TinyLoop's "
                               "layers share one shape")
        v = v[0]
    return int(v)


def gguf_config(g: Any, eos: list[int]) -> ModelConfig:
    """A `llama` GGUF's metadata (and tensor shapes) -> the one-loop ModelConfig."""
    on = [f"{g.arch}.{k} = {g.arch_key(k)!r}" for k in OFF if g.arch_key(k) not in (None, 0, 0.0, False, [])]
    if on:
        raise ConvertError(f"{g.path}: {', '.join(on)}: not supported (TinyLoop runs the plain Llama graph)")
    d, L, H = _int(g, "embedding_length"), _int(g, "block_count"), _int(g, "attention.head_count")
    Hkv = _int(g, "attention.head_count_kv", H)
    D = _int(g, "attention.key_length", d // H if H and d % H == 0 else None)
    if _int(g, "attention.value_length", D) != D:
        raise ConvertError(f"{g.path}: {g.arch}.attention.value_length {g.arch_key('attention.value_length')} != "
                           f"key_length {D}: not supported")
    rot = _int(g, "rope.dimension_count", D)
    if rot != D:
        raise ConvertError(f"{g.path}: {g.arch}.rope.dimension_count {rot} < head width {D}: partial RoPE is not "
                           "supported")
    scaling = g.arch_key("rope.scaling.type")
    factor = float(g.arch_key("rope.scaling.factor", 1.0) or 1.0)
    if scaling not in (None, "none") and not (scaling == "linear" and factor == 1.0):
        raise ConvertError(f"{g.path}: {g.arch}.rope.scaling.type {scaling!r} (factor {factor:g}) is not supported "
                           "(Llama-3's scaling, stored as rope_freqs.weight, is)")
    theta = float(g.arch_key("rope.freq_base", 10000.0))
    names = set(g.tensors)
    biased = sorted(n for n in names if n.endswith(".bias"))
    if biased:
        raise ConvertError(f"{g.path}: tensor {biased[0]!r}: biased projections are not supported")
    if "token_embd.weight" not in names:
        raise ConvertError(f"{g.path}: no token_embd.weight")
    vocab = g.shape("token_embd.weight")[0]
    tokens = g.get("tokenizer.ggml.tokens") or []
    if g.arch_key("vocab_size") not in (None, vocab):
        raise ConvertError(f"{g.path}: {g.arch}.vocab_size {g.arch_key('vocab_size')} but token_embd.weight has "
                           f"{vocab} rows")
    ffn = _int(g, "feed_forward_length")
    eps = float(g.arch_key("attention.layer_norm_rms_epsilon", 1e-5))
    llama3 = _rope_llama3(g, D, theta) if "rope_freqs.weight" in names else ()
    try:
        return ModelConfig(dim=d, n_heads=H, n_kv_heads=Hkv, head_dim=D, ffn_dim=ffn, n_prelude=0, n_core=L,
                           n_coda=0, vocab_size=max(vocab, len(tokens)), default_loops=1, max_loops=1,
                           max_seq_len=_int(g, "context_length", 4096), norm_eps=eps, rope_theta=theta,
                           rope_llama3=llama3, mlp="swiglu", tie_embeddings="output.weight" not in names,
                           injection="none", loop_norm=False, post_loop_norm=False, head_norm=True,
                           norm_placement="pre", trained_loops=(1, 1),   # a plain stack, trained at its one pass
                           eos_token_id=eos[0], eos_token_ids=tuple(eos[1:]))
    except ValueError as exc:   # ConfigError
        raise ConvertError(f"{g.path}: the metadata describes no model TinyLoop runs ({exc})") from None


def _rope_llama3(g: Any, D: int, theta: float) -> tuple[float, ...]:
    """Llama-3's RoPE scaling, which llama.cpp stores as per-frequency divisors (`rope_freqs.weight`) rather
    than its four numbers: the factor is the largest divisor, the other three Llama-3.1's (or the metadata's,
    where given); accepted only if they reproduce every stored divisor (fp32: rel. 1e-5)."""
    stored = g.tensor("rope_freqs.weight").double().flatten()
    if stored.shape[0] != D // 2:
        raise ConvertError(f"{g.path}: rope_freqs.weight has {stored.shape[0]} values, the head width {D} needs "
                           f"{D // 2}")
    low, high, orig = LLAMA3_STANDARD
    orig = float(g.arch_key("rope.scaling.original_context_length", orig) or orig)
    cand = (float(stored.max()), low, high, orig)
    base = rope_frequencies(D, theta)
    if not torch.allclose(base / stored, rope_frequencies(D, theta, cand), rtol=1e-5, atol=0):
        raise ConvertError(f"{g.path}: rope_freqs.weight is not Llama-3's RoPE scaling (factor {cand[0]:g}, "
                           f"low/high frequency factors {low:g}/{high:g}, original context {orig:g}): not supported")
    return cand


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k rows (each head's pairs (i, i + D/2) stored as rows 2i, 2i + 1) -> half-split order."""
    D = w.shape[0] // heads
    perm = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])
    return w.reshape(heads, D, *w.shape[1:])[:, perm].reshape(w.shape)


def gguf_tensor(cfg: ModelConfig, g: Any, name: str, t: torch.Tensor, emit: Emit) -> bool:
    """One GGUF tensor -> TinyLoop's name(s); False for a name the family does not have."""
    parts = name.split(".")
    if name == "token_embd.weight":
        emit("embed.weight", t)
    elif name == "output_norm.weight":
        emit("norm.weight", t)
    elif name == "output.weight":
        emit("lm_head.weight", t)
    elif name == "rope_freqs.weight":
        pass   # checked and read into rope_llama3 by gguf_config
    elif parts[0] == "blk" and len(parts) == 4 and parts[1].isdigit():
        rest = ".".join(parts[2:])
        if rest not in LAYER:
            return False
        if rest in ("attn_q.weight", "attn_k.weight"):
            heads = cfg.n_heads if rest == "attn_q.weight" else cfg.n_kv_heads
            if t.dim() != 2 or t.shape[0] != heads * cfg.head_dim:
                raise ConvertError(f"{g.path}: tensor {name!r} has shape {list(t.shape)}, the config needs "
                                   f"[{heads * cfg.head_dim}, {cfg.dim}]")
            t = unpermute(t, heads)
        emit(f"core.{parts[1]}.{LAYER[rest]}", t)
    else:
        return False
    return True


FAMILY = Family(name="llama", summary="Llama from a llama.cpp GGUF (one loop: its depth is fixed)",
                extra={"gguf_config": gguf_config, "gguf_tensor": gguf_tensor})
