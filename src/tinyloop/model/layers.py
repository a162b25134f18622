"""Transformer pieces: RMSNorm, rotary embeddings, attention over a KV cache slot, MLPs, blocks."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Rotary:
    """cos/sin tables for rotary position embeddings, grown on demand, one per dtype/device."""

    def __init__(self, head_dim: int, theta: float):
        self.head_dim = head_dim
        self.theta = theta
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def table(self, n: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (dtype, str(device))
        cached = self._tables.get(key)
        if cached is None or cached[0].shape[0] < n:
            size = max(n, 2 * (cached[0].shape[0] if cached else 512))
            inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
            ang = torch.arange(size, dtype=torch.float64)[:, None] * inv[None, :]  # (P, D/2)
            cached = (ang.cos().to(dtype=dtype, device=device), ang.sin().to(dtype=dtype, device=device))
            self._tables[key] = cached
        return cached

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(positions.max()) + 1 if positions.numel() else 1
        cos, sin = self.table(n, dtype, positions.device)
        return cos[positions], sin[positions]  # (T, D/2) each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D) with D split in two halves (GPT-NeoX layout); cos/sin: (T, D/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean (Tq, Tk) mask, True where query may attend: causal, and within `window` if > 0."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window > 0:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, ctx: "StepContext", slot: int | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)      # (B, H, T, D)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)   # (B, Hkv, T, D)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)   # (B, Hkv, T, D)
        q = apply_rope(q, ctx.cos, ctx.sin)
        k = apply_rope(k, ctx.cos, ctx.sin)
        if ctx.cache is None or slot is None:
            K, V, mask = k, v, ctx.self_mask
        else:
            K, V, key_pos = ctx.cache.update(slot, ctx.start, k.to(ctx.cache.k.dtype), v.to(ctx.cache.v.dtype))
            mask = ctx.mask_for(key_pos)
        # Attention math in at least fp32 (bf16 SDPA at decode is slow on CPU and less exact).
        adt = torch.promote_types(q.dtype, torch.float32)
        q, K, V = q.to(adt), K.to(adt), V.to(adt)
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            K = K.repeat_interleave(rep, dim=1)
            V = V.repeat_interleave(rep, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, K, V, is_causal=(T > 1 and ctx.cache is None))
        else:
            out = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)
        out = out.to(x.dtype).transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*D)
        return self.wo(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.mlp
        if cfg.mlp == "swiglu":
            self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
        return self.w_down(F.gelu(self.w_up(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, ctx: "StepContext", slot: int | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), ctx, slot)
        return x + self.mlp(self.mlp_norm(x))


class StepContext:
    """Everything one forward step shares across layers: positions, rotary tables, masks, cache.

    `tree_mask` (T, T) optionally restricts which of the step's own tokens see each other (tree
    speculation); by default the step's tokens are causal in their position order.
    """

    def __init__(self, *, rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype, cache=None,
                 start: int = 0, tree_mask: torch.Tensor | None = None):
        self.cache = cache
        self.start = start
        self.positions = positions  # (T,) absolute positions of the step's tokens
        self.cos, self.sin = rotary.cos_sin(positions, dtype)
        self.tree_mask = tree_mask
        self.window = cache.window if cache is not None else 0
        T = positions.shape[0]
        self.self_mask = None if tree_mask is None else tree_mask
        self._mask_cache: dict[int, torch.Tensor | None] = {}
        self._simple = tree_mask is None and self.window == 0
        self.T = T

    def mask_for(self, key_pos: torch.Tensor) -> torch.Tensor | None:
        L = key_pos.shape[0]
        if L in self._mask_cache:
            return self._mask_cache[L]
        if self._simple and self.T == 1:
            mask = None  # one query sees every cached key
        else:
            mask = attention_mask(self.positions, key_pos, self.window)
            if self.tree_mask is not None:
                # the last T keys are this step's tokens: replace their causal part by the tree mask
                n_new = self.T
                mask[:, L - n_new:] = self.tree_mask
                if self.window > 0:
                    mask[:, L - n_new:] &= attention_mask(self.positions, key_pos[L - n_new:], self.window)
        self._mask_cache[L] = mask
        return mask


def init_weights(module: nn.Module, n_residual_layers: int) -> None:
    """GPT-2 style init: N(0, 0.02), output projections scaled by 1/sqrt(2 * residual layers)."""
    for name, p in module.named_parameters():
        if p.dim() < 2:
            continue
        std = 0.02
        if name.endswith("wo.weight") or name.endswith("w_down.weight"):
            std = 0.02 / math.sqrt(2 * n_residual_layers)
        nn.init.normal_(p, mean=0.0, std=std)
