"""Pieces several families' converters share: Llama's tensor names, RoPE pair orders and the checks of a
stored RoPE table (each family's own mapping is in its module)."""

from __future__ import annotations

from typing import Any

import torch

from ...config import ModelConfig
from ..layers import rope_frequencies
from . import ConvertError, Emit

# A Llama decoder layer's tensors (Ouro's, Nanbeige's) -> TinyLoop's block names
LLAMA_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "mlp_norm.weight",
               "self_attn.q_proj.weight": "attn.wq.weight", "self_attn.k_proj.weight": "attn.wk.weight",
               "self_attn.v_proj.weight": "attn.wv.weight", "self_attn.o_proj.weight": "attn.wo.weight",
               "mlp.gate_proj.weight": "mlp.w_gate.weight", "mlp.up_proj.weight": "mlp.w_up.weight",
               "mlp.down_proj.weight": "mlp.w_down.weight"}

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


# The top-level tensors of the `huginn_raven` checkpoints (Huginn-0125's and the retrofits')
RAVEN_TOP = {"transformer.wte.weight": "embed.weight", "transformer.ln_f.weight": "norm.weight",
             "transformer.adapter.weight": "adapter.weight"}


def llama_shape(hf: dict[str, Any], eos: list[int], steps: int, **kw: Any) -> ModelConfig:
    """A transformers Llama-style config.json (Ouro's, Nanbeige's: hidden_size, num_hidden_layers, ...) whose
    layers form the whole core, run `steps` loops by default -> ModelConfig; `kw`: the family's own fields."""
    d, H = hf["hidden_size"], hf["num_attention_heads"]
    return ModelConfig(**{"dim": d, "n_heads": H, "n_kv_heads": hf.get("num_key_value_heads") or H,
                          "head_dim": hf.get("head_dim") or d // H, "ffn_dim": hf["intermediate_size"],
                          "n_prelude": 0, "n_core": hf["num_hidden_layers"], "n_coda": 0,
                          "vocab_size": hf["vocab_size"], "default_loops": steps, "max_loops": max(64, 4 * steps),
                          "max_seq_len": hf.get("max_position_embeddings", 4096),
                          "norm_eps": hf.get("rms_norm_eps", 1e-6), "rope_theta": float(hf.get("rope_theta", 10000.0)),
                          "mlp": "swiglu", "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
                          "injection": "none", "eos_token_id": eos[0], "eos_token_ids": tuple(eos[1:]), **kw})


def emit_fused_mlp(cfg: ModelConfig, base: str, name: str, t: torch.Tensor, emit: Emit) -> None:
    """A fused MLP input projection `fc` (2 ffn_dim rows: gate, then up; silu(first half) * second half, the
    raven checkpoints') -> TinyLoop's w_gate and w_up."""
    if tuple(t.shape) != (2 * cfg.ffn_dim, cfg.dim):
        raise ConvertError(f"{name} has shape {list(t.shape)}, the config needs [{2 * cfg.ffn_dim}, {cfg.dim}]")
    gate, up = t.split(cfg.ffn_dim, dim=0)
    emit(f"{base}.mlp.w_gate.weight", gate)
    emit(f"{base}.mlp.w_up.weight", up)


def emit_fused_qkv(cfg: ModelConfig, base: str, name: str, t: torch.Tensor, emit: Emit,
                   perm: torch.Tensor | None = None) -> None:
    """A fused attention input projection `Wqkv` (q rows, then k, then v) -> TinyLoop's wq, wk and wv; `perm`
    reorders each q and k head's dimensions (interleaved RoPE pairs -> halves: `half_split`)."""
    H, Hkv, D, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim
    if tuple(t.shape) != ((H + 2 * Hkv) * D, d):
        raise ConvertError(f"{name} has shape {list(t.shape)}, the config needs [{(H + 2 * Hkv) * D}, {d}]")
    q, k, v = t.split([H * D, Hkv * D, Hkv * D], dim=0)
    if perm is not None:
        q, k = q.reshape(H, D, -1)[:, perm].reshape(H * D, -1), k.reshape(Hkv, D, -1)[:, perm].reshape(Hkv * D, -1)
    emit(f"{base}.attn.wq.weight", q)
    emit(f"{base}.attn.wk.weight", k)
    emit(f"{base}.attn.wv.weight", v)


def emit_fused(cfg: ModelConfig, base: str, rest: str, name: str, t: torch.Tensor, emit: Emit,
               perm: torch.Tensor | None = None) -> bool:
    """A raven block's fused projections (`attn.Wqkv.weight`, `mlp.fc.weight`) split into TinyLoop's; False for
    any other tensor."""
    if rest == "attn.Wqkv.weight":
        emit_fused_qkv(cfg, base, name, t, emit, perm)
    elif rest == "mlp.fc.weight":
        emit_fused_mlp(cfg, base, name, t, emit)
    else:
        return False
    return True


def half_split(cfg: ModelConfig) -> torch.Tensor:
    """Head-dim permutation: new index j < D/2 takes interleaved 2j, j >= D/2 takes 2(j - D/2) + 1."""
    D = cfg.head_dim
    return torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])


def llama_top(cfg: ModelConfig, name: str, t: torch.Tensor, emit: Emit) -> bool:
    """The top-level tensors of a Llama-shaped checkpoint (Ouro's, Nanbeige's): the embedding and an untied
    head; False for any other name."""
    if name == "model.embed_tokens.weight":
        emit("embed.weight", t)
    elif name == "lm_head.weight":
        if not cfg.tie_embeddings:
            emit("lm_head.weight", t)
    else:
        return False
    return True


def rope_llama3(scaling: Any, bad: list[str]) -> tuple[float, ...]:
    """transformers' `rope_scaling` as the Llama / OLMo-2 rotary embedding reads it: none or rope_type
    "default" (plain RoPE), or "llama3" (Llama-3.2's) -> ModelConfig.rope_llama3; anything else is appended
    to `bad`."""
    if not scaling:
        return ()
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind == "default":
        return ()
    if kind == "llama3" and all(isinstance(scaling.get(k), (int, float)) for k in LLAMA3_KEYS):
        return tuple(float(scaling[k]) for k in LLAMA3_KEYS)
    bad.append(f"rope_scaling = {scaling!r} (RoPE scaling other than rope_type llama3 with "
               f"{', '.join(LLAMA3_KEYS)})")
    return ()


def check_freqs_cis(cfg: ModelConfig, name: str, t: torch.Tensor) -> None:
    """A stored RoPE table (1, L, 1, D/2, 2) of cos and sin (fp32 angles, Parcae's) must be the one the RoPE
    base and the head width give (TinyLoop recomputes it): a zeroed or other-theta buffer would not run as
    saved."""
    D = cfg.head_dim
    if t.dim() != 5 or tuple(t.shape[2:]) != (1, D // 2, 2) or t.shape[0] != 1:
        raise ConvertError(f"{name} has shape {list(t.shape)}, the config needs [1, L, 1, {D // 2}, 2]")
    n = min(t.shape[1], 64)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    want = torch.stack([ang.cos(), ang.sin()], dim=-1)
    if not torch.allclose(t[0, :n, 0].double(), want, rtol=0, atol=1e-3):
        raise ConvertError(f"{name} is not the RoPE table of rope_base {cfg.rope_theta:g} and head width {D}; "
                           "the checkpoint would not run as saved")


def check_inv_freq(cfg: ModelConfig, name: str, t: torch.Tensor) -> None:
    """A stored RoPE `inv_freq` must be the one `rope_theta` and `head_dim` give (the reference computes it
    in fp32: rel. error ~1e-7; bf16 storage rounds to 2^-9 relative): a zeroed buffer (a loader bug that
    saved it so) or another theta would make the converted model differ from the checkpoint's own."""
    D = cfg.head_dim
    want = rope_frequencies(D, cfg.rope_theta, cfg.rope_llama3)
    if tuple(t.shape) != (D // 2,) or not torch.allclose(t.double(), want, rtol=1e-2, atol=0):
        raise ConvertError(f"{name} is not the RoPE frequencies of rope_theta {cfg.rope_theta:g} and head_dim {D} "
                           f"(first values {t.flatten()[:3].tolist()}); the checkpoint would not run as saved")
