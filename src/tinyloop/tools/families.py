"""The looped families `tinyloop convert` reads: each one's config.json -> ModelConfig and tensor names ->
TinyLoop's (`tools/convert.py` streams the snapshot through them).

Families (recognised by `config.json`'s `model_type`, never by a name):

    ouro          ByteDance Ouro (1.4B, 2.6B, -Thinking): `total_ut_steps` passes of the same layers, sandwich
                  norms (the attention and MLP outputs are normed before the residual add), the final norm
                  ending every step, a learned exit gate, an untied head, GQA
    huginn_raven  Huginn-0125: prelude, a recurrent block re-entered through a concat adapter from a zero
                  state, coda; norms after each residual add, q/k biases, a sqrt(dim) embedding scale,
                  interleaved RoPE, a tied head. The same model_type holds the retrofitted-recurrence Llama
                  and OLMo-2 conversions (GQA, an untied head, pre- or post-norm blocks, OLMo's full-width
                  q/k norms, no embedding scale): `tools/family_raven.py`
    nanbeige      Nanbeige4.2 (NanbeigeForCausalLM): `num_hidden_layers` Llama pre-norm layers run `num_loops`
                  times, the final norm ending every loop (or only the last, `skip_loop_final_norm`), GQA with
                  an explicit `head_dim` (q wider than the hidden size), half-split RoPE, an untied head; the
                  options its code has but the released checkpoints leave off are refused by name
    parcae        SandyResearch Parcae (140M-1.3B): its config.json has no model_type; it is recognised by
                  `_class_name` "ParcaeConfig" / `model_class_name` "Parcae". Prelude, a recurrent block
                  entered through the diagonal injection from a zero state, the projection C, coda; pre-norm
                  ReLU^2 blocks, a prelude norm, q/k norms after interleaved RoPE, gated value embeddings, a
                  logit soft-cap; weights in a pickled `pytorch_model.bin`, read with
                  torch.load(weights_only=True) only; the tokenizer is a repository of its own (`tokenizer`)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import ModelConfig

FAMILIES = ("ouro", "huginn_raven", "nanbeige", "parcae")


def family_of(hf: dict[str, Any]) -> Any:
    """The family a config.json describes: its `model_type`, or "parcae" for Parcae's configs, which have none
    (the reference's ParcaeConfig writes `_class_name` and `model_class_name` instead)."""
    if hf.get("model_type") is None and (hf.get("_class_name") == "ParcaeConfig"
                                         or hf.get("model_class_name") == "Parcae"):
        return "parcae"
    return hf.get("model_type")


class ConvertError(ValueError):
    """A snapshot this converter cannot turn into a TinyLoop model; the message names what and where."""


def _need(cond: bool, src: Path, what: str) -> None:
    if not cond:
        raise ConvertError(f"{src / 'config.json'}: {what}")


# -- configs ------------------------------------------------------------------------------------------
def ouro_config(hf: dict[str, Any], src: Path, eos: list[int]) -> ModelConfig:
    d, H = hf["hidden_size"], hf["num_attention_heads"]
    _need(hf.get("head_dim", d // H) * H == d, src, f"head_dim {hf.get('head_dim')} x {H} heads != hidden_size {d}")
    _need(hf.get("hidden_act", "silu") == "silu", src, f"hidden_act {hf.get('hidden_act')!r} (only silu is supported)")
    _need(not hf.get("rope_scaling"), src, f"rope_scaling {hf.get('rope_scaling')!r} is not supported")
    _need(not hf.get("use_sliding_window"), src, "use_sliding_window is not supported")
    _need(not hf.get("attention_bias", False), src, "attention_bias is not supported for Ouro")
    steps = int(hf.get("total_ut_steps", 4))
    return ModelConfig(dim=d, n_heads=H, n_kv_heads=hf.get("num_key_value_heads") or H,
                       ffn_dim=hf["intermediate_size"], n_prelude=0, n_core=hf["num_hidden_layers"], n_coda=0,
                       vocab_size=hf["vocab_size"], default_loops=steps, max_loops=max(64, 4 * steps),
                       max_seq_len=hf.get("max_position_embeddings", 4096), norm_eps=hf.get("rms_norm_eps", 1e-6),
                       rope_theta=float(hf.get("rope_theta", 10000.0)), mlp="swiglu",
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)), injection="none", loop_norm=True,
                       head_norm=False, norm_placement="sandwich", exit_gate=True,
                       eos_token_id=eos[0], eos_token_ids=tuple(eos[1:]))


def huginn_config(hf: dict[str, Any], src: Path, eos: list[int]) -> ModelConfig:
    d, H = hf["n_embd"], hf["n_heads"]
    _need(not hf.get("bias", False), src, "bias = true (biased linear layers) is not supported")
    _need(hf.get("tie_embeddings", True), src, "an untied Huginn head is not supported (a retrofitted-recurrence "
                                                "Llama / OLMo checkpoint, which has one, names its RoPE base "
                                                "rope_theta in config.json)")
    steps = hf.get("mean_recurrence", 32)
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


# Options of Nanbeige's code that no released checkpoint turns on; each changes the forward (or the cache),
# so a config that sets one is refused by name rather than converted into a different model.
NANBEIGE_OFF = ("enable_double_loop_split", "loop_share_kv", "mhc_diff_for_loop", "enable_hyper_connection",
                "enable_mhc", "enable_h_res_identity", "enable_depth_attention", "qk_layernorm",
                "ngram_insert_all_layers", "ngram_compressed_tokenizer", "attention_bias", "mlp_bias")
NANBEIGE_UNSET = ("emb_neighbor_num", "emb_split_num", "ngram_vocab_size_ratio", "insert_ngram_layer_idx",
                  "mhc_double_stream_position_for_loop")


def nanbeige_config(hf: dict[str, Any], src: Path, eos: list[int]) -> ModelConfig:
    on = [k for k in NANBEIGE_OFF if hf.get(k)] + [k for k in NANBEIGE_UNSET if hf.get(k) not in (None, [])]
    _need(not on, src, f"{', '.join(f'{k} = {hf[k]!r}' for k in on)}: not supported (TinyLoop runs Nanbeige's "
                       "plain loop: no LoopSplit, shared-loop KV, hyper-connections, depth attention, n-gram "
                       "embeddings, q/k norms or biases)")
    quant = hf.get("quantization_config")
    method = quant.get("quant_method", quant) if isinstance(quant, dict) else quant
    _need(not quant, src, f"quantization_config {method!r}: a pre-quantized checkpoint (the FP8 / GPTQ-Int8 "
                          "variants) is not converted; convert the 16-bit one and run tinyloop quantize "
                          "(or pull NAME:int4)")
    _need(hf.get("hidden_act", "silu") == "silu", src, f"hidden_act {hf.get('hidden_act')!r} (only silu is supported)")
    scaling = hf.get("rope_scaling")
    _need(not scaling or (scaling.get("rope_type", scaling.get("type")) in (None, "default")
                          and float(scaling.get("factor", 1.0)) == 1.0),
          src, f"rope_scaling {scaling!r} is not supported")
    d, H = hf["hidden_size"], hf["num_attention_heads"]
    weights = hf.get("loop_loss_weights") or []
    steps = len(weights) + 1 if weights else int(hf.get("num_loops", 1))  # the reference's own rule
    _need(steps >= 1, src, f"num_loops {steps} must be >= 1")
    skip = bool(hf.get("skip_loop_final_norm", False))
    return ModelConfig(dim=d, n_heads=H, n_kv_heads=hf.get("num_key_value_heads") or H,
                       head_dim=hf.get("head_dim") or d // H, ffn_dim=hf["intermediate_size"], n_prelude=0,
                       n_core=hf["num_hidden_layers"], n_coda=0, vocab_size=hf["vocab_size"], default_loops=steps,
                       max_loops=max(64, 4 * steps), max_seq_len=hf.get("max_position_embeddings", 4096),
                       norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(hf.get("rope_theta", 10000.0)),
                       mlp="swiglu", tie_embeddings=bool(hf.get("tie_word_embeddings", False)), injection="none",
                       norm_placement="pre", loop_norm=not skip, head_norm=skip,
                       eos_token_id=eos[0], eos_token_ids=tuple(eos[1:]))


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


def parcae_config(hf: dict[str, Any], src: Path, eos: list[int]) -> ModelConfig:
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
    _need(not bad, src, f"{'; '.join(bad)}: not supported (TinyLoop runs the released Parcae configs: pre-norm "
                        "RMSNorm blocks with a ReLU2 BaseMLP, the diagonal injection, one width throughout)")
    steps = int(hf.get("mean_recurrence", 32))
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


# -- tensors ------------------------------------------------------------------------------------------
def _half_split(cfg: ModelConfig) -> torch.Tensor:
    """Head-dim permutation: new index j < D/2 takes interleaved 2j, j >= D/2 takes 2(j - D/2) + 1."""
    D = cfg.head_dim
    return torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])


Emit = Callable[[str, torch.Tensor], None]


LLAMA_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "mlp_norm.weight",
               "self_attn.q_proj.weight": "attn.wq.weight", "self_attn.k_proj.weight": "attn.wk.weight",
               "self_attn.v_proj.weight": "attn.wv.weight", "self_attn.o_proj.weight": "attn.wo.weight",
               "mlp.gate_proj.weight": "mlp.w_gate.weight", "mlp.up_proj.weight": "mlp.w_up.weight",
               "mlp.down_proj.weight": "mlp.w_down.weight"}


OURO_LAYER = {**LLAMA_LAYER, "input_layernorm_2.weight": "attn_out_norm.weight",   # the sandwich norms
              "post_attention_layernorm_2.weight": "mlp_out_norm.weight"}


def _llama_top(cfg: ModelConfig, name: str, t: torch.Tensor, emit: Emit) -> bool:
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


def ouro_tensor(cfg: ModelConfig, name: str, t: torch.Tensor, emit: Emit) -> bool:
    parts = name.split(".")
    if _llama_top(cfg, name, t, emit):
        pass
    elif name == "model.norm.weight":
        emit("core_norm.weight", t)  # ends every step; with head_norm off it is the only final norm
    elif name.startswith("model.early_exit_gate."):
        emit("exit_gate." + parts[-1], t)
    elif name.startswith("model.layers.") and len(parts) >= 5:
        i, rest = parts[2], ".".join(parts[3:])
        if rest not in OURO_LAYER:
            return False
        emit(f"core.{i}.{OURO_LAYER[rest]}", t)
    else:
        return False
    return True


def huginn_tensor(cfg: ModelConfig, name: str, t: torch.Tensor, emit: Emit) -> bool:
    H, Hkv, D, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim
    perm = _half_split(cfg)
    parts = name.split(".")
    if name == "transformer.wte.weight":
        emit("embed.weight", t)
    elif name == "transformer.ln_f.weight":
        emit("norm.weight", t)
    elif name == "transformer.adapter.weight":
        emit("adapter.weight", t)
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
        elif rest == "attn.Wqkv.weight":
            if t.shape[0] != (H + 2 * Hkv) * D:
                raise ConvertError(f"{name} has shape {list(t.shape)}, the config needs [{(H + 2 * Hkv) * D}, {d}]")
            q, k, v = t.split([H * D, Hkv * D, Hkv * D], dim=0)
            emit(f"{base}.attn.wq.weight", q.reshape(H, D, -1)[:, perm].reshape(H * D, -1))
            emit(f"{base}.attn.wk.weight", k.reshape(Hkv, D, -1)[:, perm].reshape(Hkv * D, -1))
            emit(f"{base}.attn.wv.weight", v)
        elif rest == "attn.qk_bias":
            if tuple(t.shape) != (2, 1, H, D):
                raise ConvertError(f"{name} has shape {list(t.shape)}, the config needs [2, 1, {H}, {D}]")
            emit(f"{base}.attn.qk_bias", torch.cat([t[0, 0], t[1, 0, :Hkv]])[:, perm])
        elif rest == "mlp.fc.weight":
            if t.shape[0] != 2 * cfg.ffn_dim:
                raise ConvertError(f"{name} has shape {list(t.shape)}, the config needs [{2 * cfg.ffn_dim}, {d}]")
            gate, up = t.split(cfg.ffn_dim, dim=0)
            emit(f"{base}.mlp.w_gate.weight", gate)
            emit(f"{base}.mlp.w_up.weight", up)
        else:
            return False
    else:
        return False
    return True


def nanbeige_tensor(cfg: ModelConfig, name: str, t: torch.Tensor, emit: Emit) -> bool:
    parts = name.split(".")
    if _llama_top(cfg, name, t, emit):
        pass
    elif name == "model.norm.weight":
        # the same norm ends every loop (loop_norm) or, with skip_loop_final_norm, only the last (head_norm)
        emit("core_norm.weight" if cfg.loop_norm else "norm.weight", t)
    elif name.startswith("model.layers.") and len(parts) >= 5:
        i, rest = parts[2], ".".join(parts[3:])
        if rest == "self_attn.rotary_emb.inv_freq":
            _check_inv_freq(cfg, name, t)  # a patched checkpoint stores the RoPE buffer; TinyLoop recomputes it
        elif rest in LLAMA_LAYER:
            emit(f"core.{i}.{LLAMA_LAYER[rest]}", t)
        else:
            return False
    else:
        return False
    return True


PARCAE_LAYER = {"norm_1.weight": "attn_norm.weight", "norm_2.weight": "mlp_norm.weight",
                "attn.c_v.weight": "attn.wv.weight", "attn.c_proj.weight": "attn.wo.weight",
                "mlp.fc.weight": "mlp.w_up.weight"}
PARCAE_TOP = {"transformer.wte.weight": "embed.weight", "transformer.ln_f.weight": "norm.weight",
              "transformer.ln_prelude.weight": "prelude_norm.weight", "transformer.C.weight": "state_proj.weight",
              "transformer.adapter.A_log": "injection.A_log", "transformer.adapter.dt_bias": "injection.dt_bias",
              "transformer.adapter.B": "injection.B.weight"}


def parcae_tensor(cfg: ModelConfig, name: str, t: torch.Tensor, emit: Emit, tables: tuple = (),
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
        _check_freqs_cis(cfg, name, t)
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
                 t.reshape(H, D, -1)[:, _half_split(cfg)].reshape(H * D, -1))
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


def _check_freqs_cis(cfg: ModelConfig, name: str, t: torch.Tensor) -> None:
    """Parcae's stored RoPE table (1, L, 1, D/2, 2) of cos and sin (fp32 angles) must be the one rope_base
    and the head width give (TinyLoop recomputes it): a zeroed or other-theta buffer would not run as saved."""
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


def _check_inv_freq(cfg: ModelConfig, name: str, t: torch.Tensor) -> None:
    """A stored RoPE `inv_freq` must be the one `rope_theta` and `head_dim` give (the reference computes it
    in fp32: rel. error ~1e-7; bf16 storage rounds to 2^-9 relative): a zeroed buffer (a loader bug that
    saved it so) or another theta would make the converted model differ from the checkpoint's own."""
    from ..model.layers import rope_frequencies

    D = cfg.head_dim
    want = rope_frequencies(D, cfg.rope_theta, cfg.rope_llama3)
    if tuple(t.shape) != (D // 2,) or not torch.allclose(t.double(), want, rtol=1e-2, atol=0):
        raise ConvertError(f"{name} is not the RoPE frequencies of rope_theta {cfg.rope_theta:g} and head_dim {D} "
                           f"(first values {t.flatten()[:3].tolist()}); the checkpoint would not run as saved")


from .family_raven import raven_config, raven_tensor  # noqa: E402  (it builds on huginn_config / huginn_tensor)

CONFIGS = {"ouro": ouro_config, "huginn_raven": raven_config, "nanbeige": nanbeige_config, "parcae": parcae_config}
TENSORS = {"ouro": ouro_tensor, "huginn_raven": raven_tensor, "nanbeige": nanbeige_tensor, "parcae": parcae_tensor}
NAMED = ("huginn_raven",)   # families whose config function also reads the checkpoint's tensor names
