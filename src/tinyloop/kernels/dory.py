"""NVIDIA Dory's pieces described for the native library (`csrc/dory.cpp`): what `NativeExecutor` adds to the
model's, blocks' and head's descriptors for a model with nGPT single-sublayer blocks (`cfg.layer_pattern`), from
the same modules model/families/dory.py computes with. Each scale vector is the product the model forms, made
here by the same torch expression in fp32, so the library multiplies by the very values the PyTorch path does."""

from __future__ import annotations

import ctypes

import torch

from . import lib as L
from .layers import _vec, linear_desc


def dory_desc(model, m: L.TlModel, keep: list) -> None:
    """The model-wide pieces: nGPT on, and the cache slot of each slot number the library forms (prelude i,
    n_prelude + coda i, n_prelude + n_coda + loop * n_core + j), SlotLayout's at the deepest depth (a last_loop
    model: one slot per recurrent attention layer for every loop; MLP layers: -1, none)."""
    cfg = model.cfg
    lay = model.slot_layout()
    P, C, K = cfg.n_prelude, cfg.n_core, cfg.n_coda

    def slot(s: int | None) -> int:
        return -1 if s is None else s

    slots = [slot(lay.prelude(i)) for i in range(P)] + [slot(lay.coda(i)) for i in range(K)]
    slots += [slot(lay.core(r, j)) for r in range(cfg.max_loops) for j in range(C)]
    arr = (ctypes.c_int32 * len(slots))(*slots)
    keep.append(arr)
    m.ngpt, m.slot_map, m.slot_loops = 1, ctypes.cast(arr, ctypes.c_void_p), cfg.max_loops


def dory_block_desc(blk, b: L.TlBlock, keep: list) -> None:
    """An `NGPTBlock`'s descriptor: an attention layer (q, k, v as one or three parts, wo, the gate's wg; its
    window and RoPE profile) or an MLP layer (gate and up as one or two parts, down), and its scales."""
    f = torch.float32
    rate = (blk.alpha.detach().to(f) * blk.alpha_factor).abs()
    b.alpha = _vec(rate, keep)
    if blk.mlp is not None:
        mlp = blk.mlp
        up = [mlp.w_gate_up] if mlp.w_gate_up is not None else [mlp.w_gate, mlp.w_up]
        for i, lin in enumerate(up):
            b.up[i] = linear_desc(lin, keep)
        b.n_up = len(up)
        b.down = linear_desc(mlp.w_down, keep)
        b.suv_gate = _vec(mlp.suv_gate.detach().to(f) * mlp.suv_factor, keep)
        b.suv_up = _vec(mlp.suv_up.detach().to(f) * mlp.suv_factor, keep)
        b.ngpt = 2
        return
    a = blk.attn
    qkv = [a.wqkv] if a.wqkv is not None else [a.wq, a.wk, a.wv]
    for i, lin in enumerate(qkv):
        b.qkv[i] = linear_desc(lin, keep)
    b.n_qkv = len(qkv)
    b.wo, b.wg = linear_desc(a.wo, keep), linear_desc(a.wg, keep)
    b.sqk = _vec((a.sqk.detach().to(f) * a.sqk_factor).square(), keep)
    b.s_gate = _vec((a.s_gate.detach().to(f) * a.gate_factor).square(), keep)
    b.ngpt, b.window, b.profile = 1, a.window, a.profile


def logit_scale_desc(model, head: L.TlLinear, keep: list) -> None:
    """The head's per-token scale logit_scale / ngpt_std (model/looped.py logits), as the head's out_scale; a
    padded head's extra rows keep their logits as they are (scale 1)."""
    s = model.logit_scale.detach().to(torch.float32) / model.cfg.ngpt_std
    if head.n > s.numel():
        s = torch.cat([s, torch.ones(head.n - s.numel())])
    head.out_scale = _vec(s, keep)
