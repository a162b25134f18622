"""The KV cache: one preallocated slot per (loop, core layer) plus the prelude and coda layers.

Slot order: prelude layers, coda layers, then core layers loop by loop, so a cache built for more
loops only appends slots. `slot_core(loop_idx, layer_idx)` is the one place that arithmetic lives.

Storage is a ring indexed by `position % capacity`. Without a window the capacity is the whole
context, so the ring never wraps and reads are plain slices. With `window = W > 0` a query at
position t attends to keys at positions t-W+1 .. t (the W most recent, itself included) in every slot,
prelude and coda included; the ring keeps W + `rollback_margin` positions so that speculation can
still roll back a few positions without losing keys the window needs.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig


class CacheError(RuntimeError):
    pass


class KVCache:
    def __init__(self, cfg: ModelConfig, *, batch: int = 1, max_positions: int | None = None,
                 loops: int | None = None, window: int = 0, rollback_margin: int = 72,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 kv_format: str = "fp16"):
        if kv_format != "fp16":
            raise CacheError(f"KV format {kv_format!r} is not supported yet (only 'fp16', unquantized)")
        self.kv_format = kv_format
        self.cfg = cfg
        self.batch = batch
        self.loops = cfg.default_loops if loops is None else loops
        if not 1 <= self.loops <= cfg.max_loops:
            raise CacheError(f"loops must be in 1..{cfg.max_loops}, got {self.loops}")
        self.max_positions = cfg.max_seq_len if max_positions is None else max_positions
        if window < 0:
            raise CacheError("window must be >= 0")
        self.window = window
        cap = self.max_positions if window == 0 else min(self.max_positions, window + rollback_margin)
        self.capacity = cap
        self.n_slots = cfg.n_prelude + cfg.n_coda + self.loops * cfg.n_core
        shape = (self.n_slots, batch, cfg.n_kv_heads, cap, cfg.head_dim)  # (S, B, Hkv, P, D)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # positions committed (valid in every slot the model used)

    # -- slot arithmetic (the only place it lives) -------------------------------------------
    def slot_prelude(self, layer_idx: int) -> int:
        return layer_idx

    def slot_coda(self, layer_idx: int) -> int:
        return self.cfg.n_prelude + layer_idx

    def slot_core(self, loop_idx: int, layer_idx: int) -> int:
        if loop_idx >= self.loops:
            raise CacheError(f"cache was built for {self.loops} loops; loop {loop_idx} has no slot")
        return self.cfg.n_prelude + self.cfg.n_coda + loop_idx * self.cfg.n_core + layer_idx

    # -- size -----------------------------------------------------------------------------
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def bytes_per_token_per_slot(self) -> int:
        return 2 * self.cfg.n_kv_heads * self.cfg.head_dim * self.k.element_size()

    # -- read/write -------------------------------------------------------------------------
    def update(self, slot: int, start: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Store keys/values for positions start..start+T-1 and return what attention sees.

        k_new, v_new: (B, Hkv, T, D). Returns (K, V, key_pos) with K, V: (B, Hkv, L, D) and key_pos:
        (L,) the absolute position of each key, covering every key any of the T queries may see.
        """
        T = k_new.shape[2]
        end = start + T
        if end > self.max_positions and self.window == 0:
            raise CacheError(f"position {end} is past the cache's {self.max_positions} positions")
        cap = self.capacity
        if self.window == 0:
            self.k[slot, :, :, start:end] = k_new
            self.v[slot, :, :, start:end] = v_new
            key_pos = torch.arange(end, device=k_new.device)
            return self.k[slot, :, :, :end], self.v[slot, :, :, :end], key_pos
        lo = max(0, start - self.window + 1)
        past = torch.arange(lo, start, device=k_new.device)
        idx = past % cap
        K = torch.cat([self.k[slot][:, :, idx], k_new], dim=2)
        V = torch.cat([self.v[slot][:, :, idx], v_new], dim=2)
        keep = min(T, cap)
        wpos = torch.arange(end - keep, end, device=k_new.device) % cap
        self.k[slot][:, :, wpos] = k_new[:, :, T - keep:]
        self.v[slot][:, :, wpos] = v_new[:, :, T - keep:]
        key_pos = torch.cat([past, torch.arange(start, end, device=k_new.device)])
        return K, V, key_pos

    def rollback(self, length: int) -> None:
        """Forget positions >= length in every slot (keys past it are simply never read again)."""
        if length > self.length or length < 0:
            raise CacheError(f"cannot roll back to {length}: cache holds {self.length} positions")
        if self.window and self.length - length > self.capacity - self.window:
            raise CacheError("rollback is deeper than the window's rollback margin")
        self.length = length

    def gather_positions(self, src: list[int], dst_start: int, slots: range | None = None) -> None:
        """Copy the entries at positions `src` to positions dst_start.. (tree speculation compaction)."""
        slots = range(self.n_slots) if slots is None else slots
        cap = self.capacity
        s = torch.tensor([p % cap for p in src], device=self.k.device)
        d = torch.tensor([(dst_start + i) % cap for i in range(len(src))], device=self.k.device)
        for sl in slots:
            self.k[sl][:, :, d] = self.k[sl][:, :, s].clone()
            self.v[sl][:, :, d] = self.v[sl][:, :, s].clone()
