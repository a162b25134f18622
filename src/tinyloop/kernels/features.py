"""The optional pieces of the shared step (config switches: the diagonal injection, the prelude norm, the
state projection C, q/k norms, value embeddings, the soft-cap) described for the native library (`csrc/features.cpp`): what `NativeExecutor` adds to the
model's and blocks' descriptors for them, from the same modules model/ computes with."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import lib as L
from .layers import _FLOAT_KINDS, Unsupported, _vec, linear_desc


def features_desc(model, m: L.TlModel, keep: list) -> None:
    """The model-wide pieces (zero / null where the model has none): the diagonal injection's per-channel
    decay and dt in fp32 as DiagonalInjection computes them, B, the prelude norm, C, the q/k norms' epsilon
    (torch's default for the activations' dtype), the value-embedding gates' width, the loop input's width
    (value embeddings after dim) and the soft-cap."""
    cfg = model.cfg
    act = model.act_dtype or model.embed.weight.dtype
    inj = model.injection
    if inj is not None:
        f = torch.promote_types(inj.dt_bias.dtype, torch.float32)
        dt = F.softplus(inj.dt_bias.detach().to(f))
        decay = torch.exp(-dt * torch.exp(inj.A_log.detach().to(f)))
        m.inj_decay, m.inj_dt = _vec(decay.to(act), keep), _vec(dt.to(act), keep)
        m.inj_B = linear_desc(inj.B, keep)
    m.prelude_norm = _vec(model.prelude_norm.weight if model.prelude_norm is not None else None, keep)
    if model.state_proj is not None:
        m.state_proj = linear_desc(model.state_proj, keep)
    m.qk_norm, m.qk_eps = int(cfg.qk_norm), torch.finfo(act).eps
    m.ve_channels, m.e_width = cfg.ve_gate_channels, model.loop_input_width
    m.logit_softcap = cfg.logit_softcap


def value_embed_desc(model, index: int, b: L.TlBlock, keep: list) -> None:
    """Block `index`'s (prelude, core, coda numbering) value embeddings: its gate's weights (Hkv, C) in fp32,
    its table as stored, and where a row finds its embedding (the loop input's column, or -1: by token)."""
    gate = [*model.prelude, *model.core, *model.coda][index].attn.ve_gate
    table = model.value_embeds[str(index)].weight
    if table.dtype not in _FLOAT_KINDS:
        raise Unsupported(f"{table.dtype} value embeddings")
    if type(gate) is nn.Linear:
        w = gate.weight
    else:   # a swapped module (fp16, quantized): its weights as it computes them, from the identity
        with torch.no_grad():
            w = gate(torch.eye(model.cfg.ve_gate_channels, dtype=model.act_dtype or torch.float32)).T
    b.ve_gate = _vec(w, keep)
    b.ve_table, b.ve_kind = table.data_ptr(), _FLOAT_KINDS[table.dtype]
    b.ve_col = model.ve_cols.get(index, -1)
