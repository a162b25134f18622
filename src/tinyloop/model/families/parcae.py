"""SandyResearch Parcae (140M-1.3B): its config.json has no model_type; it is recognised by `_class_name`
"ParcaeConfig" / `model_class_name` "Parcae". Prelude, a recurrent block entered through the diagonal
injection from a zero state, the projection C, coda; pre-norm ReLU^2 blocks, a prelude norm, q/k norms after
interleaved RoPE, gated value embeddings, a logit soft-cap; weights in a pickled `pytorch_model.bin`, read
with torch.load(weights_only=True) only; the tokenizer is a repository of its own (`TOKENIZER_REPO`).
Its pieces are `ModelConfig` switches any family may take; natively `kernels/csrc/features.cpp` runs them
(described by `kernels/features.py`)."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import torch

from ...config import ModelConfig
from . import ConvertError, Emit, Family, need
from .common import check_freqs_cis, half_split

TOKENIZER_REPO = "SandyResearch/parcae-tokenizer"

# Parcae: what TinyLoop runs of the reference's options (parcae_lm/models/{config,parcae/config}.py); each
# other value changes the forward, so it is refused by name.
PARCAE_VALUES = {"block_class_name": ("TransformerPreNormBlock",), "norm_class_name": ("RMSNorm",),
                 "mlp_class_name": ("BaseMLP",), "nonlin_name": ("ReLU2",), "injection_type": ("diagonal",),
                 "use_fused_head": ("pytorch", "cce"), "state_init": ("like-init", "zero"),
                 "mup_model_scaling_factor": (1,)}
PARCAE_OFF = ("bias", "qk_bias", "clip_qkv", "use_abacus")
# Initialisation schemes whose inference-time scales are 1 (no embedding scale, no logit scale) and whose
# embedding std (the like-init state's) is sqrt(2 / (5 dim)): the reference's factor table
PARCAE_INITS = ("scaled-zero", "scaled", "scaled-geiping", "scaled-stuck", "small")


def _parcae_has_ve(i: int, n: int) -> bool:
    return i % 2 == (n - 1) % 2   # the reference's rule: alternate layers, the last one always


def parcae_value_embeds(hf: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
    """(blocks with a value-embedding table, blocks with a gate, blocks that use one: both), blocks numbered
    prelude, core, coda. The tables follow the prelude + core + coda count; the gates the attention's layer
    id (the coda's counted after mean_recurrence unrolled core steps) against n_layer = core layers x
    mean_backprop_depth, as the reference builds them; a table or gate alone is never read."""
    P, C, K = hf["n_layers_in_prelude"], hf["n_layers_in_recurrent_block"], hf["n_layers_in_coda"]
    n_eff, n_layer, R = P + C + K, C * hf.get("mean_backprop_depth", 8), hf.get("mean_recurrence", 32)
    layer_id = [*range(P), *(P + j for j in range(C)), *(P + C * R + i for i in range(K))]
    tables = [b for b in range(n_eff) if _parcae_has_ve(b, n_eff)]
    gates = [b for b in range(n_eff) if _parcae_has_ve(layer_id[b], n_layer)]
    return tables, gates, sorted(set(tables) & set(gates))


def config(hf: dict[str, Any], src: Path, eos: list[int], names=None) -> ModelConfig:
    bad = [f"{k} = {hf.get(k, '(default)')!r}" for k, ok in PARCAE_VALUES.items() if hf.get(k, ok[0]) not in ok]
    bad += [f"{k} = {hf[k]!r}" for k in PARCAE_OFF if hf.get(k)]
    init = hf.get("init_strategy", "scaled")
    if init not in PARCAE_INITS:
        bad.append(f"init_strategy = {init!r} (its embedding/logit scales are not read)")
    rope = hf.get("rope_settings") or {}
    if not rope.get("use_rope", True) or rope.get("rope_condense_ratio", 1) != 1:
        bad.append(f"rope_settings = {rope!r}")
    d, H = hf["n_embd"], hf["num_attention_heads"]
    ffn = hf.get("intermediate_size") or 4 * d
    if hf.get("num_key_value_heads") not in (None, H):
        bad.append(f"num_key_value_heads = {hf['num_key_value_heads']!r} (the reference's recurrent block "
                   "has all heads; grouped heads in the prelude and coda only are not supported)")
    if hf.get("recurrent_num_attention_heads") not in (None, H):
        bad.append(f"recurrent_num_attention_heads = {hf['recurrent_num_attention_heads']!r}")
    for k, same in (("recurrent_embedding_dimension", d), ("recurrent_intermediation_embedding_dimension", ffn)):
        if hf.get(k, same) != same:
            bad.append(f"{k} = {hf[k]!r} (a recurrent block wider or narrower than the prelude's)")
    need(not bad, src, f"{'; '.join(bad)}: not supported (TinyLoop runs the released Parcae configs: pre-norm "
                        "RMSNorm blocks with a ReLU2 BaseMLP, the diagonal injection, one width throughout)")
    steps = int(hf.get("mean_recurrence", 32))
    # no trained_loops: Parcae samples its recurrence per step around mean_recurrence (Huginn's recipe); its
    # config declares no bound, so no range is reported
    vocab = hf.get("padded_vocab_size")
    if not vocab:
        m = hf.get("padding_multiple", 512)
        vocab = -(-hf["vocab_size"] // m) * m   # the reference pads the vocabulary to a multiple
    softcap = hf.get("logit_softcap")
    return ModelConfig(dim=d, n_heads=H, n_kv_heads=H, ffn_dim=ffn, n_prelude=hf["n_layers_in_prelude"],
                       n_core=hf["n_layers_in_recurrent_block"], n_coda=hf["n_layers_in_coda"], vocab_size=vocab,
                       default_loops=steps, max_loops=max(64, 4 * steps), max_seq_len=hf.get("block_size", 4096),
                       norm_eps=hf.get("norm_eps", 1e-5), rope_theta=float(rope.get("rope_base", 50000)),
                       mlp="relu2", tie_embeddings=bool(hf.get("tie_embeddings", False)), injection="diagonal",
                       loop_norm=False, post_loop_norm=False, head_norm=True, norm_placement="pre",
                       prelude_norm=bool(hf.get("prelude_norm", False)), state_proj=True,
                       qk_norm=bool(hf.get("qk_norm", False)), logit_softcap=float(softcap or 0.0),
                       value_embeds=tuple(parcae_value_embeds(hf)[2]),
                       state_init_std=math.sqrt(2 / (5 * d)) if hf.get("state_init", "like-init") == "like-init"
                       else 0.0,
                       eos_token_id=eos[0], eos_token_ids=tuple(eos[1:]))


PARCAE_LAYER = {"norm_1.weight": "attn_norm.weight", "norm_2.weight": "mlp_norm.weight",
                "attn.c_v.weight": "attn.wv.weight", "attn.c_proj.weight": "attn.wo.weight",
                "mlp.fc.weight": "mlp.w_up.weight"}
PARCAE_TOP = {"transformer.wte.weight": "embed.weight", "transformer.ln_f.weight": "norm.weight",
              "transformer.ln_prelude.weight": "prelude_norm.weight", "transformer.C.weight": "state_proj.weight",
              "transformer.adapter.A_log": "injection.A_log", "transformer.adapter.dt_bias": "injection.dt_bias",
              "transformer.adapter.B": "injection.B.weight"}


def tensor(cfg: ModelConfig, name: str, t: torch.Tensor, emit: Emit, tables: tuple = (),
                  gates: tuple = ()) -> bool:
    """Parcae's state dict -> TinyLoop's names. q and k rows go from interleaved RoPE pairs to half-split
    ones (as Huginn's: the q/k norm is over the whole head, so it is unchanged by the permutation); the
    ReLU2's 0.5 (`relu(x)^2 * 0.5`) is folded into the MLP's output projection (exact: a power of two);
    value-embedding tables and gates that the reference builds but never reads (one without the other:
    `tables`, `gates`, `parcae_value_embeds`) are dropped."""
    for prefix in ("module.", "_orig_mod.", "model."):   # what the reference's loader strips
        if name.startswith(prefix):
            name = name[len(prefix):]
    used = set(cfg.value_embeds)
    parts = name.split(".")
    P, C = cfg.n_prelude, cfg.n_core
    if name in PARCAE_TOP:
        emit(PARCAE_TOP[name], t)
    elif name == "lm_head.weight":
        if not cfg.tie_embeddings:
            emit("lm_head.weight", t)
    elif name == "freqs_cis":
        check_freqs_cis(cfg, name, t)
    elif parts[0] == "value_embeds" and len(parts) == 3 and parts[2] == "weight" and parts[1].isdigit():
        if int(parts[1]) in used:
            emit(f"value_embeds.{parts[1]}.weight", t)
        elif int(parts[1]) not in tables:
            return False
    elif name.startswith("transformer.") and len(parts) >= 5 and parts[1] in ("prelude", "core_block", "coda") \
            and parts[2].isdigit():
        i = int(parts[2])
        group, block = {"prelude": ("prelude", i), "core_block": ("core", P + i), "coda": ("coda", P + C + i)}[parts[1]]
        base, rest = f"{group}.{i}", ".".join(parts[3:])
        H, D = cfg.n_heads, cfg.head_dim
        if rest in ("attn.c_q.weight", "attn.c_k.weight"):
            if tuple(t.shape) != (H * D, cfg.dim):
                raise ConvertError(f"{name} has shape {list(t.shape)}, the config needs [{H * D}, {cfg.dim}]")
            emit(f"{base}.attn.{'wq' if rest == 'attn.c_q.weight' else 'wk'}.weight",
                 t.reshape(H, D, -1)[:, half_split(cfg)].reshape(H * D, -1))
        elif rest == "mlp.proj.weight":
            emit(f"{base}.mlp.w_down.weight", t * 0.5)
        elif rest == "attn.ve_gate.weight":
            if block in used:
                emit(f"{base}.attn.ve_gate.weight", t)
            elif block not in gates:
                return False
        elif rest in PARCAE_LAYER:
            emit(f"{base}.{PARCAE_LAYER[rest]}", t)
        else:
            return False
    else:
        return False
    return True


def recognise(hf: dict[str, Any]) -> bool:
    """The reference's ParcaeConfig writes `_class_name` and `model_class_name`, no model_type."""
    return hf.get("_class_name") == "ParcaeConfig" or hf.get("model_class_name") == "Parcae"


def tensors(cfg: ModelConfig, hf: dict[str, Any]):
    """The mapping for one checkpoint: it knows the value-embedding tables and gates the checkpoint holds,
    used or not (the unused ones are dropped, anything else unknown is refused)."""
    tables, gates, _ = parcae_value_embeds(hf)
    return functools.partial(tensor, tables=tuple(tables), gates=tuple(gates))


FAMILY = Family(name="parcae", summary="SandyResearch Parcae, recognised by _class_name ParcaeConfig",
                config=config, tensors=tensors,
                recognise=recognise, weights=("pytorch_model.bin",), tokenizer_repo=TOKENIZER_REPO,
                default_eos="<|eos|>")
