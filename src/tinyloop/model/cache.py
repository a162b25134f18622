"""The KV cache: one preallocated slot per (loop, core layer) plus the prelude and coda layers.

Slot order: prelude layers, coda layers, then core layers loop by loop, then `extra_slots` more (a
draft exit's blocks, `model.draft_exit`). `slot_core(loop_idx, layer_idx)` and `slot_extra(i)` are the
one place that arithmetic lives.

Storage is a ring indexed by `position % capacity`. Without a window the capacity is the whole
context, so the ring never wraps and reads are plain slices. With `window = W > 0` a query at
position t attends to keys at positions t-W+1 .. t (the W most recent, itself included) in every slot,
prelude and coda included; the ring keeps W + `rollback_margin` positions so that speculation can
still roll back a few positions without losing keys the window needs.

`kv_format` chooses the storage: "fp16" keeps keys and values in the cache's float dtype (unquantized);
"int8", "int4" and "int4-h" keep codes plus a float16 scale and offset per (token, head) vector
(`QuantizedKV`, quantizers in `quant.kv`), and `update` returns them dequantized to the float dtype.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..quant.hadamard import hadamard_matrix, is_power_of_two
from ..quant.kv import bytes_per_vector, dequantize_vectors, kv_format_bits, kv_format_rotates, quantize_vectors


class CacheError(RuntimeError):
    pass


def check_kv_format(cfg: ModelConfig, kv_format: str) -> int | None:
    """Bits per stored KV value for `kv_format` (None: unquantized); CacheError if this model cannot use it."""
    try:
        bits = kv_format_bits(kv_format)
    except ValueError as exc:
        raise CacheError(str(exc)) from None
    if kv_format_rotates(kv_format) and not is_power_of_two(cfg.head_dim):
        raise CacheError(f"KV format {kv_format!r} needs a power-of-two head dim, got {cfg.head_dim}")
    return bits


class QuantizedKV:
    """Quantized keys (or values) of every slot: codes + float16 scale/offset per (token, head) vector.

    Shapes (S, B, Hkv, P, .) like the float storage; `dtype` is the float dtype written in and read out.
    With `rotate` (int4-h) vectors are multiplied by the orthonormal Hadamard matrix H before quantizing
    and by H again (H @ H = I) after dequantizing, so callers see the original basis.
    """

    def __init__(self, shape: tuple[int, ...], bits: int, rotate: bool, dtype: torch.dtype, device):
        S, B, Hkv, P, D = shape
        self.shape, self.bits, self.dtype, self.device = shape, bits, dtype, torch.device(device)
        self.codes = torch.zeros(S, B, Hkv, P, D * bits // 8, dtype=torch.uint8, device=device)
        self.scale = torch.zeros(S, B, Hkv, P, 1, dtype=torch.float16, device=device)
        self.offset = torch.zeros(S, B, Hkv, P, 1, dtype=torch.float16, device=device)
        rdt = torch.float64 if dtype == torch.float64 else torch.float32
        self.H = hadamard_matrix(D, rdt, device) if rotate else None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset))

    def write(self, slot: int, idx, x: torch.Tensor, keep_from: int = 0) -> torch.Tensor:
        """Quantize x (B, Hkv, T, D), store x[:, :, keep_from:] at positions idx; returns all of x dequantized."""
        if self.H is not None:
            x = x.to(self.H.dtype) @ self.H
        codes, scale, offset = quantize_vectors(x, self.bits)
        self.codes[slot][:, :, idx] = codes[:, :, keep_from:]
        self.scale[slot][:, :, idx] = scale[:, :, keep_from:]
        self.offset[slot][:, :, idx] = offset[:, :, keep_from:]
        return self._dequantize(codes, scale, offset)

    def read(self, slot: int, idx) -> torch.Tensor:
        """Dequantized (B, Hkv, L, D) for positions idx (a slice or index tensor) of one slot."""
        return self._dequantize(self.codes[slot][:, :, idx], self.scale[slot][:, :, idx],
                                self.offset[slot][:, :, idx])

    def _dequantize(self, codes, scale, offset) -> torch.Tensor:
        if self.H is None:
            return dequantize_vectors(codes, scale, offset, self.bits, self.dtype)
        return (dequantize_vectors(codes, scale, offset, self.bits, self.H.dtype) @ self.H).to(self.dtype)

    def copy(self, slot: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in (self.codes, self.scale, self.offset):
            t[slot][:, :, dst] = t[slot][:, :, src].clone()


class KVCache:
    def __init__(self, cfg: ModelConfig, *, batch: int = 1, max_positions: int | None = None,
                 loops: int | None = None, window: int = 0, rollback_margin: int = 72,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 kv_format: str = "fp16", extra_slots: int = 0):
        bits = check_kv_format(cfg, kv_format)
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
        if extra_slots < 0:
            raise CacheError("extra_slots must be >= 0")
        self.extra_slots = extra_slots
        self.n_slots = cfg.n_prelude + cfg.n_coda + self.loops * cfg.n_core + extra_slots
        shape = (self.n_slots, batch, cfg.n_kv_heads, cap, cfg.head_dim)  # (S, B, Hkv, P, D)
        if bits is None:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        else:  # quantized: `k`/`v` still report the float dtype attention hands in and gets back
            rotate = kv_format_rotates(kv_format)
            self.k = QuantizedKV(shape, bits, rotate, dtype, device)
            self.v = QuantizedKV(shape, bits, rotate, dtype, device)
        self.quantized = bits is not None
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

    def slot_extra(self, i: int) -> int:
        if not 0 <= i < self.extra_slots:
            raise CacheError(f"cache has {self.extra_slots} extra slots; slot {i} does not exist")
        return self.cfg.n_prelude + self.cfg.n_coda + self.loops * self.cfg.n_core + i

    # -- size -----------------------------------------------------------------------------
    def nbytes(self) -> int:
        if self.quantized:
            return self.k.nbytes() + self.v.nbytes()
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def bytes_per_token_per_slot(self) -> int:
        """Stored bytes of one position's keys and values in one slot (codes, scales and offsets included)."""
        elt = torch.tensor([], dtype=self.k.dtype).element_size()
        return 2 * self.cfg.n_kv_heads * bytes_per_vector(self.cfg.head_dim, self.kv_format, elt)

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
        if self.quantized:
            return self._update_quantized(slot, start, k_new, v_new)
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

    def _update_quantized(self, slot: int, start: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """`update` for int8/int4/int4-h: store codes, return dequantized keys/values (the new ones too, so a
        token sees the same rounded keys whether it was computed alone or in a batch with others)."""
        T = k_new.shape[2]
        end = start + T
        dev = k_new.device
        if self.window == 0:
            self.k.write(slot, slice(start, end), k_new)
            self.v.write(slot, slice(start, end), v_new)
            return self.k.read(slot, slice(0, end)), self.v.read(slot, slice(0, end)), torch.arange(end, device=dev)
        cap = self.capacity
        lo = max(0, start - self.window + 1)
        past = torch.arange(lo, start, device=dev)
        idx = past % cap
        keep = min(T, cap)
        wpos = torch.arange(end - keep, end, device=dev) % cap
        K_new = self.k.write(slot, wpos, k_new, keep_from=T - keep)
        V_new = self.v.write(slot, wpos, v_new, keep_from=T - keep)
        K = torch.cat([self.k.read(slot, idx), K_new], dim=2)
        V = torch.cat([self.v.read(slot, idx), V_new], dim=2)
        key_pos = torch.cat([past, torch.arange(start, end, device=dev)])
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
        if self.quantized:
            for sl in slots:
                self.k.copy(sl, s, d)
                self.v.copy(sl, s, d)
            return
        for sl in slots:
            self.k[sl][:, :, d] = self.k[sl][:, :, s].clone()
            self.v[sl][:, :, d] = self.v[sl][:, :, s].clone()
