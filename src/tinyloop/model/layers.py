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


def apply_rope_full(x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Same result as `apply_rope`, bit for bit, in 4 ops instead of 8.

    x: (..., D); cos_full = cat(cos, cos) and sin_signed = cat(-sin, sin), both broadcastable to x.
    (x1*cos + x2*(-sin) is exactly x1*cos - x2*sin in IEEE arithmetic.)
    """
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos_full + torch.cat([x2, x1], dim=-1) * sin_signed


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
        self.wqkv: nn.Module | None = None  # set by model.fast.fuse_projections (wq, wk, wv removed)

    def forward(self, x: torch.Tensor, ctx: "StepContext", slot: int | None) -> torch.Tensor:
        if self.wqkv is not None:
            return self._forward_fused(x, ctx, slot)
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

    def _forward_fused(self, x: torch.Tensor, ctx: "StepContext", slot: int | None) -> torch.Tensor:
        """The decode fast path: one QKV projection, one RoPE over q and k together, GQA without copies."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x).view(B, T, H + 2 * Hkv, D)                           # (B, T, H+2Hkv, D)
        cos_full, sin_signed = ctx.rope_full()                                  # (T, 1, D) each
        qk = apply_rope_full(qkv[:, :, :H + Hkv], cos_full, sin_signed)         # (B, T, H+Hkv, D)
        q = qk[:, :, :H].transpose(1, 2)                                        # (B, H, T, D)
        k = qk[:, :, H:].transpose(1, 2)                                        # (B, Hkv, T, D)
        v = qkv[:, :, H + Hkv:].transpose(1, 2)                                 # (B, Hkv, T, D)
        causal = False
        if ctx.cache is None or slot is None:
            K, V, mask = k, v, ctx.self_mask
            causal = mask is None and T > 1
        else:
            cdt = ctx.cache.k.dtype
            if k.dtype != cdt:
                k, v = k.to(cdt), v.to(cdt)
            K, V, key_pos = ctx.cache.update(slot, ctx.start, k, v)
            mask = ctx.mask_for(key_pos)
        adt = torch.promote_types(q.dtype, torch.float32)
        if q.dtype != adt or K.dtype != adt:  # (a no-op .to still costs a dispatch per call)
            q, K, V = q.to(adt), K.to(adt), V.to(adt)
        rep = H // Hkv
        if rep > 1:
            # Query heads g*rep .. g*rep+rep-1 share kv head g: fold them into the query axis instead of
            # copying K and V rep times. Row r*T + t of a group is query head g*rep + r at token t.
            q = q.reshape(B, Hkv, rep * T, D)                                   # (B, Hkv, rep*T, D)
            if causal:
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                causal = False
            if mask is not None:
                mask = mask.repeat(rep, 1)                                      # (rep*T, L)
        if mask is None:
            out = F.scaled_dot_product_attention(q, K, V, is_causal=causal)
        else:
            out = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)
        out = out.reshape(B, H, T, D)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return self.wo(out.transpose(1, 2).reshape(B, T, H * D))                 # (B, T, H*D)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.mlp
        if cfg.mlp == "swiglu":
            self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w_gate_up: nn.Module | None = None  # set by model.fast.fuse_projections (swiglu only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w_gate_up is not None:
            gate, up = self.w_gate_up(x).chunk(2, dim=-1)
            return self.w_down(F.silu(gate) * up)
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
    speculation); by default the step's tokens are causal in their position order. A wider
    `tree_mask` (T, S), S > T, covers the last S keys attention sees: S - T tree nodes an earlier
    step wrote just below `start` (not yet committed), then the step's own T tokens; their positions
    are `tree_key_positions` (S,) (default: `positions` when S == T). The window, if any, is applied
    on those positions, not on storage indices.
    """

    def __init__(self, *, rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype, cache=None,
                 start: int = 0, tree_mask: torch.Tensor | None = None,
                 tree_key_positions: torch.Tensor | None = None):
        self.cache = cache
        self.start = start
        self.positions = positions  # (T,) absolute positions of the step's tokens
        self.cos, self.sin = rotary.cos_sin(positions, dtype)
        self.tree_mask = tree_mask
        if tree_mask is not None and tree_key_positions is None:
            if tree_mask.shape[1] != positions.shape[0]:
                raise ValueError("a tree_mask wider than the step needs tree_key_positions")
            tree_key_positions = positions
        self.tree_key_positions = tree_key_positions
        self.window = cache.window if cache is not None else 0
        T = positions.shape[0]
        self.self_mask = None if tree_mask is None else tree_mask
        self._mask_cache: dict[int, torch.Tensor | None] = {}
        self._simple = tree_mask is None and self.window == 0
        self.T = T
        self._rope_full: tuple[torch.Tensor, torch.Tensor] | None = None

    def rope_full(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cat(cos, cos), cat(-sin, sin)), each (T, 1, D): the tables `apply_rope_full` takes, made once per step."""
        if self._rope_full is None:
            cos_full = torch.cat([self.cos, self.cos], dim=-1).unsqueeze(1)
            sin_signed = torch.cat([-self.sin, self.sin], dim=-1).unsqueeze(1)
            self._rope_full = (cos_full, sin_signed)
        return self._rope_full

    def mask_for(self, key_pos: torch.Tensor) -> torch.Tensor | None:
        L = key_pos.shape[0]
        if L in self._mask_cache:
            return self._mask_cache[L]
        if self._simple and self.T == 1:
            mask = None  # one query sees every cached key
        else:
            mask = attention_mask(self.positions, key_pos, self.window)
            if self.tree_mask is not None:
                # the last S keys are uncommitted tree nodes (this step's tokens last): their storage
                # index is not their position, so the tree mask replaces the causal part, and the
                # window is measured on their real positions
                S = self.tree_mask.shape[1]
                tree = self.tree_mask
                if self.window > 0:
                    tree = tree & attention_mask(self.positions, self.tree_key_positions, self.window)
                mask[:, L - S:] = tree
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
