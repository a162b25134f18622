"""ByteDance Ouro (1.4B, 2.6B, -Thinking; `model_type` "ouro"): `total_ut_steps` passes of the same
layers, sandwich norms (the attention and MLP outputs are normed before the residual add), the final norm
ending every step, a learned exit gate, an untied head, GQA. Every piece is shared math
(`norm_placement="sandwich"`, `exit_gate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...config import ModelConfig
from . import Emit, Family, need
from .common import LLAMA_LAYER, llama_shape, llama_top

LAYER = {**LLAMA_LAYER, "input_layernorm_2.weight": "attn_out_norm.weight",   # the sandwich norms
         "post_attention_layernorm_2.weight": "mlp_out_norm.weight"}


def config(hf: dict[str, Any], src: Path, eos: list[int], names=None) -> ModelConfig:
    d, H = hf["hidden_size"], hf["num_attention_heads"]
    need(hf.get("head_dim", d // H) * H == d, src, f"head_dim {hf.get('head_dim')} x {H} heads != hidden_size {d}")
    need(hf.get("hidden_act", "silu") == "silu", src, f"hidden_act {hf.get('hidden_act')!r} (only silu is supported)")
    need(not hf.get("rope_scaling"), src, f"rope_scaling {hf.get('rope_scaling')!r} is not supported")
    need(not hf.get("use_sliding_window"), src, "use_sliding_window is not supported")
    need(not hf.get("attention_bias", False), src, "attention_bias is not supported for Ouro")
    steps = int(hf.get("total_ut_steps", 4))
    # trained_loops: Ouro's objective (arXiv 2510.25741, the entropy-regularized expected loss over exit steps
    # t = 1..total_ut_steps, the exit gate's distribution weighting each) trains the head's output after
    # every step, not only the last: each depth 1..total_ut_steps is one it was trained to exit at
    return llama_shape(hf, eos, steps, head_dim=None, loop_norm=True, head_norm=False, norm_placement="sandwich",
                       exit_gate=True, trained_loops=(1, steps))


def tensor(cfg: ModelConfig, name: str, t: torch.Tensor, emit: Emit) -> bool:
    parts = name.split(".")
    if llama_top(cfg, name, t, emit):
        pass
    elif name == "model.norm.weight":
        emit("core_norm.weight", t)  # ends every step; with head_norm off it is the only final norm
    elif name.startswith("model.early_exit_gate."):
        emit("exit_gate." + parts[-1], t)
    elif name.startswith("model.layers.") and len(parts) >= 5:
        i, rest = parts[2], ".".join(parts[3:])
        if rest not in LAYER:
            return False
        emit(f"core.{i}.{LAYER[rest]}", t)
    else:
        return False
    return True


FAMILY = Family(name="ouro", summary="ByteDance Ouro-1.4B/2.6B and their Thinking variants", config=config,
                tensors=lambda cfg, hf: tensor)
