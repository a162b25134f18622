"""The retrofitted-recurrence conversions of Llama and OLMo-2 (McLeish et al. 2025,
LoopedLMs/retrofitting-recurrence, `convert_pretrained_model/raven_modeling_minimal_{llama,olmo}.py`): the
`huginn_raven` checkpoints that are not Huginn-0125 (`huginn.py` tells them apart and registers the family).

A retrofit is Huginn's shape (prelude, a recurrent block entered through the concat adapter, coda, the
recurrence's count `mean_recurrence`) built from a pretrained model's layers: GQA, an untied head, Llama's
half-split RoPE with the base model's `rope_theta` (and Llama-3's `llama3` frequency scaling where
`rope_scaling` has it), no embedding scale (`init_values.embed_scale` 1), the final norm only before the
head. Its blocks are the base model's:

    llama  x = x + attn(norm_1(x)); x = x + mlp(norm_2(x))                       (pre-norm)
    olmo   x = x + norm_1(attn(x)); x = x + norm_2(mlp(x))                       (post-norm), and q / k
           RMS-normed with weights over all their heads together, before RoPE  (q_norm, k_norm); its
           `initial_state_mode` may also start the recurrence from the prelude output ("embed-init") or
           run the first recurrence on it without the adapter ("skip-adapter"): `loop_start`
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ...config import ModelConfig
from . import Emit, need
from .common import RAVEN_TOP, check_inv_freq, emit_fused, rope_llama3

# Options of the retrofit code (raven_config_minimal.RavenConfig + what transformers' Llama/OLMo-2 RoPE
# reads) that change the forward and that TinyLoop does not run: refused by name, never converted into a
# different model. The authors' converters write every one of them off.
RETROFIT_OFF = {"bias": "biased adapter", "qk_bias": "q/k biases", "test_time_noise": "test-time noise"}
# initial_state_mode of the OLMo code -> ModelConfig.loop_start (the Llama code reads none: a random state)
OLMO_STATE_MODES = {"random": "state", "embed-init": "embed", "skip-adapter": "skip"}

def retrofit_config(hf: dict[str, Any], src: Path, eos: list[int], variant: str) -> ModelConfig:
    bad = [f"{k} = {hf[k]!r} ({what})" for k, what in RETROFIT_OFF.items() if hf.get(k)]
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        bad.append(f"partial_rotary_factor = {hf['partial_rotary_factor']!r} (RoPE on part of each head)")
    d, H = hf["n_embd"], hf["n_heads"]
    Hkv = hf.get("num_key_value_heads") or H
    head_dim = hf.get("head_dim") or d // H
    if variant == "llama" and head_dim * H != d:
        bad.append(f"head_dim = {head_dim} with {H} heads on n_embd {d} (the Llama code's heads are n_embd / "
                   "n_heads wide)")
    llama3 = rope_llama3(hf.get("rope_scaling"), bad)
    mode = hf.get("initial_state_mode", "random")
    if variant == "olmo" and mode not in OLMO_STATE_MODES:
        bad.append(f"initial_state_mode = {mode!r} (the OLMo code knows {', '.join(OLMO_STATE_MODES)})")
    need(not bad, src, f"{'; '.join(bad)}: not supported for a retrofitted {variant} checkpoint (TinyLoop runs "
                        "the authors' converters' settings: an unbiased adapter, no q/k bias, no test-time noise, "
                        "plain or Llama-3 RoPE)")
    init = hf.get("init_values") or {}   # the reference's RavenConfig computes these where config.json has none
    embed_scale = float(init.get("embed_scale", math.sqrt(d)))
    std = float(init.get("std", math.sqrt(2 / (5 * d))))
    steps = int(hf.get("mean_recurrence", 32))
    # no trained_loops: the retrofitted models train at a sampled recurrence around mean_recurrence (Huginn's
    # recipe), with no bound in the config: no range is reported
    need(steps >= 1, src, f"mean_recurrence {steps} must be >= 1")
    return ModelConfig(dim=d, n_heads=H, n_kv_heads=Hkv, head_dim=head_dim, ffn_dim=hf["intermediate_size"],
                       n_prelude=hf["n_layers_in_prelude"], n_core=hf["n_layers_in_recurrent_block"],
                       n_coda=hf["n_layers_in_coda"], vocab_size=hf.get("padded_vocab_size") or hf["vocab_size"],
                       default_loops=steps, max_loops=max(64, 4 * steps),
                       max_seq_len=hf.get("max_position_embeddings") or hf.get("block_size", 4096),
                       norm_eps=hf.get("norm_eps", 1e-6), rope_theta=float(hf["rope_theta"]), rope_llama3=llama3,
                       mlp="swiglu", tie_embeddings=bool(hf.get("tie_embeddings", True)), injection="concat-adapter",
                       loop_norm=False, post_loop_norm=False, head_norm=True,
                       norm_placement="pre" if variant == "llama" else "post", qk_norm_full=variant == "olmo",
                       embed_scale=embed_scale, state_init_std=std,
                       loop_start=OLMO_STATE_MODES[mode] if variant == "olmo" else "state",
                       eos_token_id=eos[0], eos_token_ids=tuple(eos[1:]))


# Block tensors that only change their names; norm_1 / norm_2 are the pre-norms (Llama) or the post-norms (OLMo)
RETROFIT_BLOCK = {"attn.proj.weight": "attn.wo.weight", "mlp.proj.weight": "mlp.w_down.weight",
                  "attn.q_norm.weight": "attn.q_norm.weight", "attn.k_norm.weight": "attn.k_norm.weight"}
RETROFIT_NORMS = {"pre": {"norm_1.weight": "attn_norm.weight", "norm_2.weight": "mlp_norm.weight"},
                  "post": {"norm_1.weight": "attn_out_norm.weight", "norm_2.weight": "mlp_out_norm.weight"}}


def retrofit_tensor(cfg: ModelConfig, name: str, t: torch.Tensor, emit: Emit) -> bool:
    """A retrofit's state dict -> TinyLoop's names. RoPE is already half-split (transformers' rotate_half),
    so q and k rows keep their order; Wqkv and the MLP's fc are split at their rows (q, k, v; gate, up)."""
    parts = name.split(".")
    if name in RAVEN_TOP:
        emit(RAVEN_TOP[name], t)
    elif name == "lm_head.weight":
        if not cfg.tie_embeddings:
            emit("lm_head.weight", t)
    elif name.endswith("rotary_emb.inv_freq"):
        check_inv_freq(cfg, name, t)   # not persisted by the reference; a patched save may hold it
    elif name.startswith("transformer.") and len(parts) >= 5 and parts[1] in ("prelude", "core_block", "coda") \
            and parts[2].isdigit():
        group = {"prelude": "prelude", "core_block": "core", "coda": "coda"}[parts[1]]
        base, rest = f"{group}.{parts[2]}", ".".join(parts[3:])
        norms = RETROFIT_NORMS[cfg.norm_placement]
        if rest in norms:
            emit(f"{base}.{norms[rest]}", t)
        elif rest in RETROFIT_BLOCK:
            emit(f"{base}.{RETROFIT_BLOCK[rest]}", t)
        elif not emit_fused(cfg, base, rest, name, t, emit):
            return False
    else:
        return False
    return True
