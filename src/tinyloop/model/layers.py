"""Transformer pieces: RMSNorm, rotary embeddings, attention over a KV cache slot, MLPs, blocks."""

from __future__ import annotations

import math
from typing import Any, Protocol

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


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last axis (nGPT's justnorm: a state on the unit sphere), computed in
    fp32 (or wider) and returned in that dtype."""
    f = x if x.dtype in (torch.float32, torch.float64) else x.float()
    return f * torch.rsqrt(f.square().sum(dim=-1, keepdim=True) + 1e-6)


def rope_frequencies(head_dim: int, theta: float, llama3: tuple[float, ...] = (), rotary_dim: int = 0) -> torch.Tensor:
    """The D/2 rotary frequencies theta^(-2i/D), float64. With `llama3` = (factor, low, high, old_len), Llama-3's
    rescaling: a frequency whose wavelength 2 pi / f exceeds old_len / low is divided by `factor`, one whose
    wavelength is below old_len / high is kept, and those between are blended linearly in old_len / wavelength
    (weight s = (old_len / wavelength - low) / (high - low) on the kept one, 1 - s on the divided one).

    Partial rotary (`rotary_dim` R, 0 < R < D): the first R/2 pairs turn at theta^(-2i/R), the other pairs at
    frequency 0 (cos 1, sin 0: left exactly as they are)."""
    if rotary_dim and rotary_dim != head_dim:
        inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu") / rotary_dim))
        return torch.cat([inv, torch.zeros(head_dim // 2 - rotary_dim // 2, dtype=torch.float64, device="cpu")])
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    if not llama3:
        return inv
    factor, low, high, old_len = llama3
    s = ((old_len * inv / (2 * math.pi) - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - s) * inv / factor + s * inv


class Rotary:
    """cos/sin tables for rotary position embeddings, grown on demand, one per dtype/device. `alt`: the
    model's second RoPE profile (`ModelConfig.rope_profile` 2: e.g. an nGPT model's sliding-window layers), or None."""

    def __init__(self, head_dim: int, theta: float, llama3: tuple[float, ...] = (), rotary_dim: int = 0,
                 alt: "Rotary | None" = None):
        self.head_dim = head_dim
        self.theta = theta
        self.inv_freq = rope_frequencies(head_dim, theta, llama3, rotary_dim)   # (D/2,) float64
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.alt = alt

    def profile(self, profile: int) -> "Rotary":
        """This table (profile 1) or the second profile's."""
        if profile == 1:
            return self
        if self.alt is None:
            raise ValueError(f"RoPE profile {profile}: the model has one profile")
        return self.alt

    def table(self, n: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (dtype, str(device))
        cached = self._tables.get(key)
        if cached is None or cached[0].shape[0] < n:
            size = max(n, 2 * (cached[0].shape[0] if cached else 512))
            ang = torch.arange(size, dtype=torch.float64)[:, None] * self.inv_freq[None, :]  # (P, D/2)
            cached = (ang.cos().to(dtype=dtype, device=device), ang.sin().to(dtype=dtype, device=device))
            self._tables[key] = cached
        return cached

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(positions.max()) + 1 if positions.numel() else 1
        cos, sin = self.table(n, dtype, positions.device)
        return cos[positions], sin[positions]  # (T, D/2) each


def apply_rope_full(x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, GPT-NeoX half-split layout, in 4 ops: for x = (x1, x2) the result is
    (x1*cos - x2*sin, x2*cos + x1*sin), bit for bit (x1*cos + x2*(-sin) is exactly x1*cos - x2*sin in IEEE
    arithmetic). x: (..., D); cos_full = cat(cos, cos) and sin_signed = cat(-sin, sin), both broadcastable
    to x (`rope_tables`)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos_full + torch.cat([x2, x1], dim=-1) * sin_signed


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean (Tq, Tk) mask, True where query may attend: causal, and within `window` if > 0."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window > 0:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed


def build_mask(q_pos: torch.Tensor, key_pos: torch.Tensor, window: int, tree_mask: torch.Tensor | None = None,
               tree_key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean (T, L) mask for queries at `q_pos` over keys at `key_pos`: causal and within `window`.

    With a `tree_mask` (T, S) the last S keys are uncommitted tree nodes (the step's own tokens last)
    whose storage index is not their position: the tree mask replaces the causal part there, and the
    window is measured on their real positions `tree_key_positions` (S,)."""
    mask = attention_mask(q_pos, key_pos, window)
    if tree_mask is not None:
        S = tree_mask.shape[1]
        tree = tree_mask
        if window > 0:
            tree = tree & attention_mask(q_pos, tree_key_positions, window)
        mask[:, mask.shape[1] - S:] = tree
    return mask


def grouped_sdpa(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None,
                 causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads, without copying K and V.

    q: (G, H, T, D); K, V: (G, Hkv, L, D), all in the attention dtype; mask: None, (T, L) or (G, 1, T, L)
    boolean (True = may attend). Query heads g*rep .. g*rep+rep-1 share kv head g: they are folded into
    the query axis (row r*T + t of a group is query head g*rep + r at token t). Returns (G, H, T, D)."""
    G, H, T, D = q.shape
    rep = H // K.shape[1]
    if rep > 1:
        q = q.reshape(G, K.shape[1], rep * T, D)
        if causal:
            mask, causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), False
        if mask is not None and mask.shape[-2] != 1:
            mask = mask.repeat(rep, 1) if mask.dim() == 2 else mask.repeat(1, 1, rep, 1)
    if mask is None:
        out = F.scaled_dot_product_attention(q, K, V, is_causal=causal)
    else:
        out = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)
    return out.reshape(G, H, T, D)


class AttentionContext(Protocol):
    """The one storage protocol: what a step gives the model's blocks. `StepContext` (a contiguous
    `KVCache`, or no cache) and `paged.PagedView` (the serving pool) implement it.

    slots:       the `cache.SlotLayout` that names each layer's cache slot (None: no cache)
    rope_full(profile=1): the step's rows' rotary tables, each (T, 1, D), for `apply_rope_full` (profile 2:
                 the model's second RoPE profile, `Rotary.alt`)
    attend(slot, q, k, v, window=0): store the rows' new keys/values (k, v: (B, T, Hkv, D)) in `slot`, then
                 return attention of q (B, T, H, D) over every key each row may see: (B, T, H, D); a layer's
                 `window` W > 0 (a sliding-window layer's) further limits each query at position t to keys
                 at t-W+1 .. t (with a row's own window too, the narrower one holds: `combine_windows`)
    """

    slots: Any

    def rope_full(self, profile: int = 1) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attend(self, slot: int | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int = 0) -> torch.Tensor: ...


def combine_windows(a: int, b: int) -> int:
    """The window of two limits (0: none): the narrower of those set."""
    return min(a, b) if a and b else a or b


class Attention(nn.Module):
    """Projections, RoPE and the output projection; which keys each query sees (and where new keys are
    stored) is the step context's business: `ctx.attend(slot, q, k, v)`. With `value_embed` the
    block's value embedding of each token `ve` (B, T, n_kv_heads * head_dim) is added to v through a gate
    read from the first `ve_gate_channels` of the block's (normed) input; with `cfg.qk_norm` q and k are
    RMS-normed per head after RoPE (no weights, torch's default epsilon); with `cfg.qk_norm_full` (OLMo-2)
    all q heads are RMS-normed together, and all k heads, with weights, before the bias and RoPE."""

    def __init__(self, cfg: ModelConfig, value_embed: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.wqkv: nn.Module | None = None  # set by model.fast.fuse_projections (wq, wk, wv removed)
        # q and k biases (n_heads + n_kv_heads, head_dim), added after the projection, before RoPE
        self.qk_bias = nn.Parameter(torch.zeros(cfg.n_heads + cfg.n_kv_heads, cfg.head_dim)) if cfg.qk_bias else None
        self.qk_norm = cfg.qk_norm
        full = cfg.qk_norm_full
        self.q_norm = RMSNorm(cfg.n_heads * cfg.head_dim, cfg.norm_eps) if full else None
        self.k_norm = RMSNorm(cfg.n_kv_heads * cfg.head_dim, cfg.norm_eps) if full else None
        self.ve_channels = cfg.ve_gate_channels
        self.ve_gate = nn.Linear(cfg.ve_gate_channels, cfg.n_kv_heads, bias=False) if value_embed else None

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, dim) -> q, k and v heads (B, T, H + 2 Hkv, D): one fused projection, or three."""
        B, T, _ = x.shape
        if self.wqkv is not None:
            qkv = self.wqkv(x)
        else:
            qkv = torch.cat([self.wq(x), self.wk(x), self.wv(x)], dim=-1)
        return qkv.view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, ctx: AttentionContext, slot: int | None,
                ve: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.project_qkv(x)
        cos_full, sin_signed = ctx.rope_full()                                  # (T, 1, D) each
        qk = qkv[:, :, :H + Hkv]
        if self.q_norm is not None:                                             # over all heads: (B, T, H * D)
            q = _norm(qk[:, :, :H].reshape(B, T, H * D), self.q_norm).view(B, T, H, D)
            k = _norm(qk[:, :, H:].reshape(B, T, Hkv * D), self.k_norm).view(B, T, Hkv, D)
            qk = torch.cat([q, k], dim=2)
        if self.qk_bias is not None:
            qk = qk + self.qk_bias
        qk = apply_rope_full(qk, cos_full, sin_signed)                          # one RoPE over q and k
        if self.qk_norm:
            qk = F.rms_norm(qk, (D,))
        v = qkv[:, :, H + Hkv:]
        if self.ve_gate is not None:
            if ve is None:
                raise ValueError("this block adds value embeddings: it needs its tokens' (the loop input's)")
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :self.ve_channels]))    # (B, T, Hkv), in (0, 2)
            v = v + gate.unsqueeze(-1) * ve.view(B, T, Hkv, D).to(v.dtype)
        out = ctx.attend(slot, qk[:, :, :H], qk[:, :, H:], v)                   # (B, T, H, D)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return self.wo(out.reshape(B, T, H * D))


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
        if self.kind == "relu2":
            return self.w_down(torch.square(F.relu(self.w_up(x))))
        return self.w_down(F.gelu(self.w_up(x), approximate="tanh"))


def _norm(x: torch.Tensor, n: RMSNorm) -> torch.Tensor:
    """RMSNorm's math without a module call (a module call costs a decode step ~2 us)."""
    return F.rms_norm(x, n.weight.shape, n.weight, n.eps)


class Block(nn.Module):
    """Attention then MLP, each a residual branch; where the norms sit is `cfg.norm_placement`."""

    def __init__(self, cfg: ModelConfig, value_embed: bool = False):
        super().__init__()
        self.placement = cfg.norm_placement
        post = cfg.norm_placement == "post"   # no norm on the branch inputs
        self.attn_norm = None if post else RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, value_embed)
        self.mlp_norm = None if post else RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)
        sandwich = cfg.norm_placement != "pre"
        self.attn_out_norm = RMSNorm(cfg.dim, cfg.norm_eps) if sandwich else None
        self.mlp_out_norm = RMSNorm(cfg.dim, cfg.norm_eps) if sandwich else None

    def forward(self, x: torch.Tensor, ctx: "StepContext", slot: int | None,
                ve: torch.Tensor | None = None) -> torch.Tensor:
        if self.placement == "pre":
            x = x + self.attn(_norm(x, self.attn_norm), ctx, slot, ve)
            return x + self.mlp(_norm(x, self.mlp_norm))
        if ve is not None:
            raise ValueError("value embeddings are implemented for pre-norm blocks only")
        if self.placement == "post":
            x = x + _norm(self.attn(x, ctx, slot), self.attn_out_norm)
            return x + _norm(self.mlp(x), self.mlp_out_norm)
        if self.placement == "sandwich":
            x = x + _norm(self.attn(_norm(x, self.attn_norm), ctx, slot), self.attn_out_norm)
            return x + _norm(self.mlp(_norm(x, self.mlp_norm)), self.mlp_out_norm)
        x = _norm(x + self.attn(_norm(x, self.attn_norm), ctx, slot), self.attn_out_norm)  # sandwich-residual
        return _norm(x + self.mlp(_norm(x, self.mlp_norm)), self.mlp_out_norm)


class DiagonalInjection(nn.Module):
    """The diagonal injection's loop input: state * exp(-softplus(dt_bias) * exp(A_log)) + softplus(dt_bias) * (e B^T), a
    per-channel decay of the state plus the prelude output through B (dim, dim), scaled per channel."""

    def __init__(self, dim: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(dim))
        self.dt_bias = nn.Parameter(torch.zeros(dim))
        self.B = nn.Linear(dim, dim, bias=False)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        f = torch.promote_types(self.dt_bias.dtype, torch.float32)   # (16-bit files: in fp32)
        dt = F.softplus(self.dt_bias.to(f))
        decay = torch.exp(-dt * torch.exp(self.A_log.to(f)))
        return h * decay.to(h.dtype) + dt.to(h.dtype) * linear_as(self.B, e)


def linear_as(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A bias-free linear layer in x's dtype: a float `nn.Linear` (16-bit weights under fp32 activations are
    widened), or a swapped module (a quantized file's `QuantLinear`: the injection's B and the read-out's C are quantized like the
    blocks' linears), which computes in x's dtype itself."""
    if type(lin) is not nn.Linear:
        return lin(x)
    w = lin.weight
    return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype))


class StepContext:
    """One forward step over a contiguous cache (or none): positions, rotary tables, masks, the cache.

    Every (B, T) row block of a step shares positions. `tree_mask` (T, T) optionally restricts which of
    the step's own tokens see each other (tree speculation); by default the step's tokens are causal in
    their position order. A wider `tree_mask` (T, S), S > T, covers the last S keys attention sees: S - T
    tree nodes an earlier step wrote just below `start` (not yet committed), then the step's own T
    tokens; their positions are `tree_key_positions` (S,) (default: `positions` when S == T). The window,
    if any, is applied on those positions, not on storage indices. The paged pool's counterpart is
    `model.paged.PagedView`; both implement `AttentionContext`.
    """

    def __init__(self, *, rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype, cache=None,
                 start: int = 0, tree_mask: torch.Tensor | None = None,
                 tree_key_positions: torch.Tensor | None = None):
        self.cache = cache
        self.slots = cache.layout if cache is not None else None
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
        self._mask_cache: dict[tuple[int, int], torch.Tensor | None] = {}
        self.T = positions.shape[0]
        self._rotary = rotary
        self._rope_full: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope_full(self, profile: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(cat(cos, cos), cat(-sin, sin)), each (T, 1, D): the tables `apply_rope_full` takes, made once per step
        (profile 2: the model's second RoPE profile)."""
        tables = self._rope_full.get(profile)
        if tables is None:
            cos, sin = (self.cos, self.sin) if profile == 1 else \
                self._rotary.profile(profile).cos_sin(self.positions, self.cos.dtype)
            tables = self._rope_full[profile] = rope_tables(cos, sin)
        return tables

    def mask_for(self, key_pos: torch.Tensor, window: int = 0) -> torch.Tensor | None:
        """The (T, L) mask of the step's queries over keys at `key_pos`; `window`: the layer's (0: none)."""
        w = combine_windows(self.window, window)
        key = (key_pos.shape[0], w)
        if key not in self._mask_cache:
            if self.tree_mask is None and w == 0 and self.T == 1:
                mask = None  # one query sees every cached key
            else:
                mask = build_mask(self.positions, key_pos, w, self.tree_mask, self.tree_key_positions)
            self._mask_cache[key] = mask
        return self._mask_cache[key]

    def attend(self, slot: int | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int = 0) -> torch.Tensor:
        """q: (B, T, H, D), k, v: (B, T, Hkv, D) -> (B, T, H, D): store k, v in the cache slot (if any),
        then attend over what the cache holds for these positions (a layer's `window`: the W most recent)."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # (B, heads, T, D)
        causal = False
        if self.cache is None or slot is None:
            K, V, mask = k, v, self.tree_mask
            causal = mask is None and self.T > 1
            if window:   # the step's own keys, limited to the layer's window
                causal = False
                mask = build_mask(self.positions, self.positions, window, None) if mask is None else \
                    mask & attention_mask(self.positions, self.tree_key_positions, window)
        else:
            K, V, key_pos = self.cache.update(slot, self.start, k, v)
            mask = self.mask_for(key_pos, window)
        adt = torch.promote_types(q.dtype, torch.float32)  # attention math in at least fp32
        if q.dtype != adt or K.dtype != adt:  # (a no-op .to still costs a dispatch per call)
            q, K, V = q.to(adt), K.to(adt), V.to(adt)
        return grouped_sdpa(q, K, V, mask, causal).transpose(1, 2)


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, D/2) cos/sin -> the (T, 1, D) tables `apply_rope_full` takes."""
    return torch.cat([cos, cos], dim=-1).unsqueeze(1), torch.cat([-sin, sin], dim=-1).unsqueeze(1)


def init_weights(module: nn.Module, n_residual_layers: int) -> None:
    """GPT-2 style init: N(0, 0.02), output projections scaled by 1/sqrt(2 * residual layers)."""
    for name, p in module.named_parameters():
        if p.dim() < 2:
            continue
        std = 0.02
        if name.endswith("wo.weight") or name.endswith("w_down.weight"):
            std = 0.02 / math.sqrt(2 * n_residual_layers)
        nn.init.normal_(p, mean=0.0, std=std)
