"""`huginn_raven` checkpoints: Huginn-0125 itself (this module) and the retrofitted-recurrence conversions
of Llama and OLMo-2 that share its `model_type`, config class and tensor names (`retrofit.py`).

Huginn-0125: prelude, a recurrent block re-entered through a concat adapter from a zero state, coda; norms
after each residual add (`sandwich-residual`), q/k biases, a sqrt(dim) embedding scale, interleaved RoPE
(permuted here to TinyLoop's half-split pairs: the same permutation of q and k rows leaves every attention
score unchanged), a tied head, a random initial state rule for seeded runs.

Which one a checkpoint is: the config tells Huginn-0125 from a retrofit (only the retrofits' converters write
`rope_theta`: Huginn's RoPE base is `rope_base`); the tensors tell the two retrofits apart (every OLMo block
has `attn.q_norm.weight`, no Llama block has; Huginn-0125's blocks have four norms). Where only config.json
is at hand (`tinyloop pull` before downloading), `auto_map` naming the OLMo modelling file picks OLMo.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

import torch

from ...config import ModelConfig
from . import ConvertError, Emit, Family, need
from .common import RAVEN_TOP, emit_fused, half_split
from .retrofit import retrofit_config, retrofit_tensor


def huginn_config(hf: dict[str, Any], src: Path, eos: list[int]) -> ModelConfig:
    d, H = hf["n_embd"], hf["n_heads"]
    need(not hf.get("bias", False), src, "bias = true (biased linear layers) is not supported")
    need(hf.get("tie_embeddings", True), src, "an untied Huginn head is not supported (a retrofitted-recurrence "
                                               "Llama / OLMo checkpoint, which has one, names its RoPE base "
                                               "rope_theta in config.json)")
    steps = hf.get("mean_recurrence", 32)
    # no trained_loops: Huginn trains at a recurrence drawn per step from a heavy-tailed distribution around
    # mean_recurrence (a log-normal Poisson), with no bound its config declares: no range is reported
    return ModelConfig(dim=d, n_heads=H, n_kv_heads=hf.get("num_key_value_heads") or H,
                       ffn_dim=hf["intermediate_size"], n_prelude=hf["n_layers_in_prelude"],
                       n_core=hf["n_layers_in_recurrent_block"], n_coda=hf["n_layers_in_coda"],
                       vocab_size=hf.get("padded_vocab_size") or hf["vocab_size"], default_loops=steps,
                       max_loops=max(64, 4 * steps), max_seq_len=hf.get("block_size", 4096),
                       norm_eps=hf.get("norm_eps", 1e-6), rope_theta=float(hf.get("rope_base", 50000.0)),
                       mlp="swiglu", tie_embeddings=True, injection="concat-adapter", loop_norm=False,
                       post_loop_norm=True, norm_placement="sandwich-residual", qk_bias=bool(hf.get("qk_bias", False)),
                       embed_scale=math.sqrt(d), state_init_std=float((hf.get("init_values") or {}).get(
                           "std", math.sqrt(2 / (5 * d)))),
                       eos_token_id=eos[0], eos_token_ids=tuple(eos[1:]))


def huginn_tensor(cfg: ModelConfig, name: str, t: torch.Tensor, emit: Emit) -> bool:
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    perm = half_split(cfg)
    parts = name.split(".")
    if name in RAVEN_TOP:
        emit(RAVEN_TOP[name], t)
    elif name in ("freqs_cis", "transformer.freqs_cis", "lm_head.weight"):
        pass  # RoPE table (recomputed) / the tied head
    elif name.startswith("transformer.") and parts[1] in ("prelude", "core_block", "coda") and len(parts) >= 5:
        group = {"prelude": "prelude", "core_block": "core", "coda": "coda"}[parts[1]]
        base, rest = f"{group}.{parts[2]}", ".".join(parts[3:])
        simple = {"norm_1.weight": "attn_norm.weight", "norm_2.weight": "attn_out_norm.weight",
                  "norm_3.weight": "mlp_norm.weight", "norm_4.weight": "mlp_out_norm.weight",
                  "attn.proj.weight": "attn.wo.weight", "mlp.proj.weight": "mlp.w_down.weight"}
        if rest in simple:
            emit(f"{base}.{simple[rest]}", t)
        elif rest == "attn.qk_bias":
            if tuple(t.shape) != (2, 1, H, D):
                raise ConvertError(f"{name} has shape {list(t.shape)}, the config needs [2, 1, {H}, {D}]")
            emit(f"{base}.attn.qk_bias", torch.cat([t[0, 0], t[1, 0, :Hkv]])[:, perm])
        elif not emit_fused(cfg, base, rest, name, t, emit, perm):
            return False
    else:
        return False
    return True


def raven_variant(hf: dict[str, Any], names: Iterable[str] | None) -> str:
    """ "huginn" (Huginn-0125), "llama" or "olmo" (the retrofits): see the module docstring."""
    names = None if names is None else set(names)
    four_norms = names is not None and any(n.endswith(".norm_4.weight") for n in names)
    if "rope_theta" not in hf:
        if names is not None and not four_norms and any(n.endswith(".norm_1.weight") for n in names):
            raise ConvertError("config.json has no rope_theta but the blocks have two norms (a retrofitted "
                               "Llama / OLMo checkpoint): its RoPE base is not known; add the base model's "
                               "rope_theta")
        return "huginn"
    if four_norms:
        raise ConvertError("config.json has rope_theta (a retrofitted checkpoint) but the blocks have Huginn's "
                           "four norms: the config and the weights do not belong together")
    if names is not None:
        return "olmo" if any(n.endswith(".attn.q_norm.weight") for n in names) else "llama"
    auto = " ".join(str(v) for v in (hf.get("auto_map") or {}).values())
    return "olmo" if "olmo" in auto.lower() else "llama"


def config(hf: dict[str, Any], src: Path, eos: list[int], names: Iterable[str] | None = None) -> ModelConfig:
    """config.json (and, when converting, the checkpoint's tensor names) -> ModelConfig."""
    try:
        variant = raven_variant(hf, names)
    except ConvertError as exc:
        raise ConvertError(f"{src / 'config.json'}: {exc}") from None
    if variant == "huginn":
        return huginn_config(hf, src, eos)
    return retrofit_config(hf, src, eos, variant)


def tensors(cfg: ModelConfig, hf: dict[str, Any]):
    return huginn_tensor if cfg.norm_placement == "sandwich-residual" else retrofit_tensor


FAMILY = Family(name="huginn_raven", summary="Huginn-0125 and the retrofitted-recurrence Llama / OLMo-2 models",
                config=config, tensors=tensors, needs_names=True)
