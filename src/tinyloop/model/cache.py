"""The KV cache: one preallocated slot per (loop, core layer) plus the prelude and coda layers.

Slot order: prelude layers, coda layers, then core layers loop by loop, then `extra_slots` more (a
draft exit's blocks, `model.draft_exit`); `SlotLayout` is the one place that arithmetic lives.

Storage is a ring indexed by `position % capacity`. Without a window the capacity is the whole
context, so the ring never wraps and reads are plain slices. With `window = W > 0` a query at
position t attends to keys at positions t-W+1 .. t (the W most recent, itself included) in every slot,
prelude and coda included; the ring keeps W + `rollback_margin` positions so that speculation can
still roll back a few positions without losing keys the window needs.

`kv_format` chooses the storage (`quant.kv.KVTensor`, shared with the paged pool): "fp16" keeps keys and
values in the cache's float dtype; "int8", "int4" and "int4-h" keep codes plus a float16 scale and
offset per (token, head) vector, and `update` returns them dequantized to the float dtype.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..quant.hadamard import is_power_of_two
from ..quant.kv import KVTensor, bytes_per_vector, kv_format_bits, kv_format_rotates


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


class SlotLayout:
    """Where each layer's keys and values live: one slot per prelude layer, coda layer, core layer at each
    loop, and `extra` more (a draft exit's blocks). The one place this arithmetic lives; the contiguous
    cache and the paged pool both use it.

    Order: prelude layers, coda layers, core layers loop by loop, then the extra slots. The core slots of
    loop r do not depend on the total depth, so a layout for fewer loops is a prefix of a deeper one
    (extra slots aside).

    `kv_loops = k` (the loop-shared KV budget) keeps k core slots per layer instead of one per loop: loop r
    uses slot r mod k, so a position's slot holds its keys from the latest loop of that residue it ran
    (k = 1: its last loop). Attention at loop r then sees earlier steps' tokens at that loop, not at r.

    A model whose `kv_mode` is "last_loop" is always laid out with k = 1, in this ring's own slot
    order everywhere (`columns` is None: the step's layout and each sequence's are the same), and an nGPT
    model's MLP blocks (`layer_pattern` "-") have no slot: `prelude`, `coda` and `core` return None for them."""

    def __init__(self, cfg: ModelConfig, loops: int, extra: int = 0, kv_loops: int | None = None):
        if not 1 <= loops <= cfg.max_loops:
            raise CacheError(f"loops must be in 1..{cfg.max_loops}, got {loops}")
        if extra < 0:
            raise CacheError("extra_slots must be >= 0")
        if kv_loops is not None and kv_loops < 1:
            raise CacheError(f"kv_loops must be >= 1, got {kv_loops}")
        self.cfg, self.loops, self.extra = cfg, loops, extra
        self.model_ring = cfg.kv_mode == "last_loop"   # the model's own rule, not a request's budget
        if self.model_ring:
            kv_loops = 1
        self.ring = loops if kv_loops is None else min(kv_loops, loops)   # core slots per layer
        P, C = cfg.n_prelude, cfg.n_core
        kinds = cfg.layer_pattern or "*" * (P + C + cfg.n_coda)
        # each stack's layers that keep keys -> their index among the stack's such layers
        self._pre = {i: n for n, i in enumerate(i for i in range(P) if kinds[i] != "-")}
        self._core = {j: n for n, j in enumerate(j for j in range(C) if kinds[P + j] != "-")}
        self._coda = {i: n for n, i in enumerate(i for i in range(cfg.n_coda) if kinds[P + C + i] != "-")}
        self._base = len(self._pre) + len(self._coda)
        self.n_slots = self._base + self.ring * len(self._core) + extra

    def prelude(self, layer_idx: int) -> int | None:
        return self._pre.get(layer_idx)

    def coda(self, layer_idx: int) -> int | None:
        n = self._coda.get(layer_idx)
        return None if n is None else len(self._pre) + n

    def core(self, loop_idx: int, layer_idx: int) -> int | None:
        if loop_idx >= self.loops:
            raise CacheError(f"cache was built for {self.loops} loops; loop {loop_idx} has no slot")
        n = self._core.get(layer_idx)
        return None if n is None else self._base + (loop_idx % self.ring) * len(self._core) + n

    def core_kv_layers(self) -> list[int]:
        """The core layers that keep keys (all of them but an nGPT model's MLP blocks)."""
        return list(self._core)

    def extra_slot(self, i: int) -> int:
        if not 0 <= i < self.extra:
            raise CacheError(f"cache has {self.extra} extra slots; slot {i} does not exist")
        return self._base + self.ring * len(self._core) + i

    def windows(self, window: int = 0) -> list[int]:
        """Each slot's attention window (0: the whole context) for a request with its own `window`: a
        sliding-window layer's (`S`, `cfg.sliding_window`) or the request's, the narrower; the extra slots
        (a draft exit's) the request's alone."""
        kinds = self.cfg.layer_pattern
        out = [window] * self.n_slots
        if not kinds or "S" not in kinds:
            return out
        P, C, own = self.cfg.n_prelude, self.cfg.n_core, self.cfg.sliding_window
        layers = {**{slot: i for i, slot in self._pre.items()},
                  **{len(self._pre) + slot: P + C + i for i, slot in self._coda.items()}}
        for r in range(self.ring):
            layers.update({self._base + r * len(self._core) + slot: P + j for j, slot in self._core.items()})
        for slot, layer in layers.items():
            if kinds[layer] == "S":
                out[slot] = min(window, own) if window else own
        return out

    def columns(self) -> list[int] | None:
        """For a shared layout: this layout's slot for each slot of the one-slot-per-loop layout of the same
        depth (prelude, coda, then core loop by loop); None when there is nothing to map (a last_loop
        model's layouts are all the ring's)."""
        if self.ring == self.loops or self.model_ring:
            return None
        return [*range(self._base)] + [self.core(r, j) for r in range(self.loops) for j in self._core]


class KVCache:
    """The contiguous cache (training-time evaluation, tests, references): `batch` rows of one length.

    Implements the storage side of attention for `layers.StepContext`: `update(slot, start, k, v)` stores
    a step's keys/values and returns what its queries see. The paged pool (`model.paged`) is the other
    implementation, for serving."""

    def __init__(self, cfg: ModelConfig, *, batch: int = 1, max_positions: int | None = None,
                 loops: int | None = None, window: int = 0, rollback_margin: int = 72,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 kv_format: str = "fp16", extra_slots: int = 0, kv_loops: int | None = None):
        check_kv_format(cfg, kv_format)
        self.kv_format = kv_format
        self.cfg = cfg
        self.batch = batch
        self.layout = SlotLayout(cfg, cfg.default_loops if loops is None else loops, extra_slots, kv_loops)
        self.loops = self.layout.loops
        self.max_positions = cfg.max_seq_len if max_positions is None else max_positions
        if window < 0:
            raise CacheError("window must be >= 0")
        self.window = window
        cap = self.max_positions if window == 0 else min(self.max_positions, window + rollback_margin)
        self.capacity = cap
        self.extra_slots = extra_slots
        self.n_slots = self.layout.n_slots
        shape = (self.n_slots, batch, cfg.n_kv_heads, cap, cfg.head_dim)  # (S, B, Hkv, P, D)
        self.k = KVTensor(shape, kv_format, dtype, device)
        self.v = KVTensor(shape, kv_format, dtype, device)
        self.dtype = dtype
        self.quantized = self.k.quantized
        self.length = 0  # positions committed (valid in every slot the model used)

    # -- slots (SlotLayout) -----------------------------------------------------------------
    def slot_prelude(self, layer_idx: int) -> int:
        return self.layout.prelude(layer_idx)

    def slot_coda(self, layer_idx: int) -> int:
        return self.layout.coda(layer_idx)

    def slot_core(self, loop_idx: int, layer_idx: int) -> int:
        return self.layout.core(loop_idx, layer_idx)

    def slot_extra(self, i: int) -> int:
        return self.layout.extra_slot(i)

    # -- size -----------------------------------------------------------------------------
    def nbytes(self) -> int:
        return self.k.nbytes() + self.v.nbytes()

    def bytes_per_token_per_slot(self) -> int:
        """Stored bytes of one position's keys and values in one slot (codes, scales and offsets included)."""
        elt = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.cfg.n_kv_heads * bytes_per_vector(self.cfg.head_dim, self.kv_format, elt)

    # -- read/write -------------------------------------------------------------------------
    def update(self, slot: int, start: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Store keys/values for positions start..start+T-1 and return what attention sees.

        k_new, v_new: (B, Hkv, T, D). Returns (K, V, key_pos) with K, V: (B, Hkv, L, D) and key_pos:
        (L,) the absolute position of each key, covering every key any of the T queries may see. Quantized
        formats hand back what was stored (the new keys too, rounded), so a token sees the same keys
        whether it was computed alone or with others.
        """
        T = k_new.shape[2]
        end = start + T
        dev = k_new.device
        if self.window == 0:
            if end > self.max_positions:
                raise CacheError(f"position {end} is past the cache's {self.max_positions} positions")
            new, seen = (slot, slice(None), slice(None), slice(start, end)), (slot, slice(None), slice(None), slice(0, end))
            self.k.write(new, k_new)
            self.v.write(new, v_new)
            return self.k.read(seen), self.v.read(seen), torch.arange(end, device=dev)
        cap = self.capacity
        lo = max(0, start - self.window + 1)
        past = torch.arange(lo, start, device=dev)
        old = (slot, slice(None), slice(None), past % cap)
        K_old, V_old = self.k.read(old), self.v.read(old)
        keep = min(T, cap)
        wpos = (slot, slice(None), slice(None), torch.arange(end - keep, end, device=dev) % cap)
        self.k.write(wpos, k_new[:, :, T - keep:])
        self.v.write(wpos, v_new[:, :, T - keep:])
        if self.quantized:  # the new keys as stored (rounded); those past the ring's reach, rounded alike
            k_new = self.k.roundtrip(k_new)
            v_new = self.v.roundtrip(v_new)
        K = torch.cat([K_old, k_new.to(self.dtype)], dim=2)
        V = torch.cat([V_old, v_new.to(self.dtype)], dim=2)
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
        s = torch.tensor([p % cap for p in src])
        d = torch.tensor([(dst_start + i) % cap for i in range(len(src))])
        for sl in slots:
            for t in (self.k, self.v):
                t.copy((sl, slice(None), slice(None), s), (sl, slice(None), slice(None), d))
