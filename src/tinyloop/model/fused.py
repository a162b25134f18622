"""A model's module structure to match a file's layout (`modelfile.layout`), without copying any weight.

- `fuse_structure(model)`: on a model built on the meta device (no data), replace wq/wk/wv by one
  `attn.wqkv` linear and (swiglu) w_gate/w_up by one `mlp.w_gate_up`, so that its state dict has a
  version 2 file's names and the loader can bind the file's tensors to it as they lie.
- `split_projections(model)`: the reverse on a loaded model: separate linears again, each weight a row view
  of the fused one (no copy), for tools that work per projection (GPTQ, exporting to other formats).

`model.fast.fuse_projections` fuses a model that holds data (a model built or trained in memory, or a
version 1 file at load): that one concatenates, a copy.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from .layers import MLP, Attention
from .looped import LoopedTransformer

# What modules' constructors run to initialise their weights: on the meta device they compute nothing,
# but the first of them imports torch._dynamo (~1.5 s on an idle machine, several on a loaded one)
_INIT_OPS = {"normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "xavier_uniform_",
             "xavier_normal_", "zero_", "zeros_", "ones_", "fill_", "constant_"}


class _SkipMetaInit(TorchFunctionMode):
    """Skip in-place initialisation of meta tensors (thread-local, like every torch function mode)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _INIT_OPS:
            t = args[0] if args else kwargs.get("tensor")  # (torch.nn.init passes it by keyword)
            if getattr(t, "is_meta", False):
                return t
        return func(*args, **kwargs)


def meta_model(cfg, *, fused: bool = True) -> nn.Module:
    """A `LoopedTransformer` of `cfg` on the meta device, no weight initialised; `fused`: with a file's
    fused projections (`fuse_structure`). What the loader binds a file's tensors to."""
    with torch.device("meta"), _SkipMetaInit():
        model = LoopedTransformer(cfg)
    if fused:
        fuse_structure(model)
    return model


def param_count(cfg) -> int:
    """The parameters of the model `cfg` describes, counted on a meta-device build of it (nothing allocated): the
    blocks the config's family builds, whatever their tensors (a model file's own count, without torch:
    `modelfile.header.held_params`)."""
    return sum(p.numel() for p in meta_model(cfg, fused=False).parameters())


def _linear(in_features: int, out_features: int) -> nn.Linear:
    with _SkipMetaInit():
        return nn.Linear(in_features, out_features, bias=False, device="meta")


def fuse_structure(model: nn.Module) -> int:
    """Fuse the projections of every Attention and swiglu MLP of a meta-device model, in place (the
    fused modules hold meta tensors until the file's are assigned). Returns how many were fused."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, Attention) and mod.wqkv is None:
            parts = (mod.wq, mod.wk, mod.wv)
            mod.wqkv = _linear(parts[0].in_features, sum(p.out_features for p in parts))
            del mod.wq, mod.wk, mod.wv
            n += 1
        elif isinstance(mod, MLP) and mod.kind == "swiglu" and mod.w_gate_up is None:
            mod.w_gate_up = _linear(mod.w_gate.in_features, mod.w_gate.out_features + mod.w_up.out_features)
            del mod.w_gate, mod.w_up
            n += 1
    return n


def _split(fused: nn.Linear, rows: list[int]) -> list[nn.Linear]:
    out, row = [], 0
    for n in rows:
        lin = _linear(fused.in_features, n)
        lin.weight = nn.Parameter(fused.weight.detach()[row:row + n], requires_grad=fused.weight.requires_grad)
        out.append(lin)
        row += n
    return out


def split_projections(model: nn.Module) -> int:
    """Separate wq/wk/wv and w_gate/w_up again where a model holds them fused as plain `nn.Linear`s (a
    loaded float model); each part's weight is a row view of the fused weight. Returns how many were split."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, Attention) and type(mod.wqkv) is nn.Linear:
            q, kv = mod.n_heads * mod.head_dim, mod.n_kv_heads * mod.head_dim
            mod.wq, mod.wk, mod.wv = _split(mod.wqkv, [q, kv, kv])
            mod.wqkv = None
            n += 1
        elif isinstance(mod, MLP) and type(mod.w_gate_up) is nn.Linear:
            half = mod.w_gate_up.out_features // 2
            mod.w_gate, mod.w_up = _split(mod.w_gate_up, [half, half])
            mod.w_gate_up = None
            n += 1
    return n
