"""Nanbeige4.2 (`model_type` "nanbeige", NanbeigeForCausalLM): `num_hidden_layers` Llama pre-norm layers
run `num_loops` times, the final norm ending every loop (or only the last, `skip_loop_final_norm`), GQA with
an explicit `head_dim` (q wider than the hidden size), half-split RoPE, an untied head. The options its code
has but the released checkpoints leave off are refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...config import ModelConfig
from . import Emit, Family, need
from .common import LLAMA_LAYER, check_inv_freq, llama_shape, llama_top

# Options of Nanbeige's code that no released checkpoint turns on; each changes the forward (or the cache),
# so a config that sets one is refused by name rather than converted into a different model.
NANBEIGE_OFF = ("enable_double_loop_split", "loop_share_kv", "mhc_diff_for_loop", "enable_hyper_connection",
                "enable_mhc", "enable_h_res_identity", "enable_depth_attention", "qk_layernorm",
                "ngram_insert_all_layers", "ngram_compressed_tokenizer", "attention_bias", "mlp_bias")
NANBEIGE_UNSET = ("emb_neighbor_num", "emb_split_num", "ngram_vocab_size_ratio", "insert_ngram_layer_idx",
                  "mhc_double_stream_position_for_loop")


def config(hf: dict[str, Any], src: Path, eos: list[int], names=None) -> ModelConfig:
    on = [k for k in NANBEIGE_OFF if hf.get(k)] + [k for k in NANBEIGE_UNSET if hf.get(k) not in (None, [])]
    need(not on, src, f"{', '.join(f'{k} = {hf[k]!r}' for k in on)}: not supported (TinyLoop runs Nanbeige's "
                       "plain loop: no LoopSplit, shared-loop KV, hyper-connections, depth attention, n-gram "
                       "embeddings, q/k norms or biases)")
    quant = hf.get("quantization_config")
    method = quant.get("quant_method", quant) if isinstance(quant, dict) else quant
    need(not quant, src, f"quantization_config {method!r}: a pre-quantized checkpoint (the FP8 / GPTQ-Int8 "
                          "variants) is not converted; convert the 16-bit one and run tinyloop quantize "
                          "(or pull NAME:int4)")
    need(hf.get("hidden_act", "silu") == "silu", src, f"hidden_act {hf.get('hidden_act')!r} (only silu is supported)")
    scaling = hf.get("rope_scaling")
    need(not scaling or (scaling.get("rope_type", scaling.get("type")) in (None, "default")
                          and float(scaling.get("factor", 1.0)) == 1.0),
          src, f"rope_scaling {scaling!r} is not supported")
    weights = hf.get("loop_loss_weights") or []
    # The reference reads a non-empty `loop_loss_weights` as `len + 1` loops and ports differ on it (some take
    # `num_loops`, some the weights): the released checkpoints leave it empty, so a non-empty one is refused by
    # name rather than run at a depth the checkpoint may not have been trained for.
    need(not weights, src, f"loop_loss_weights = {weights!r}: not supported (the loop count would be "
                           f"{len(weights) + 1 if isinstance(weights, list) else '?'} by the reference's rule and "
                           f"{hf.get('num_loops', 1)} by num_loops; the released checkpoints leave it empty: set "
                           "num_loops and empty loop_loss_weights)")
    steps = int(hf.get("num_loops", 1))
    need(steps >= 1, src, f"num_loops {steps} must be >= 1")
    skip = bool(hf.get("skip_loop_final_norm", False))
    # trained_loops: with loop_loss_weights empty (refused otherwise, above) the loss is the last loop's only:
    # the one depth it was trained at is num_loops
    return llama_shape(hf, eos, steps, norm_placement="pre", loop_norm=not skip, head_norm=skip,
                       trained_loops=(steps, steps))


def tensor(cfg: ModelConfig, name: str, t: torch.Tensor, emit: Emit) -> bool:
    parts = name.split(".")
    if llama_top(cfg, name, t, emit):
        pass
    elif name == "model.norm.weight":
        # the same norm ends every loop (loop_norm) or, with skip_loop_final_norm, only the last (head_norm)
        emit("core_norm.weight" if cfg.loop_norm else "norm.weight", t)
    elif name.startswith("model.layers.") and len(parts) >= 5:
        i, rest = parts[2], ".".join(parts[3:])
        if rest == "self_attn.rotary_emb.inv_freq":
            check_inv_freq(cfg, name, t)  # a patched checkpoint stores the RoPE buffer; TinyLoop recomputes it
        elif rest in LLAMA_LAYER:
            emit(f"core.{i}.{LLAMA_LAYER[rest]}", t)
        else:
            return False
    else:
        return False
    return True


FAMILY = Family(name="nanbeige", summary="Nanbeige4.2, NanbeigeForCausalLM", config=config,
                tensors=lambda cfg, hf: tensor)
