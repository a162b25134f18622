"""The batched runner: one forward pass over the chunks a `Scheduler` step chose, KV in a paged pool.

All the step's tokens are packed into one (1, N, dim) row block, so every linear layer reads its
weights once for the whole batch. Chunks are ordered by loop count, deepest first, so the rows still
looping at loop r are a prefix: a sequence stops taking part after its last loop and its rows go
straight on to the coda. Attention is per chunk, over that sequence's own pages.

Paged storage: `PagedKV` keeps keys and values as (n_pages, Hkv, page_size, D) float tensors, or, for
the quantized KV formats, codes plus a float16 scale and offset per (token, head) vector, exactly as
`model.cache.QuantizedKV` does for a single request (int4-h rotates by a Hadamard matrix first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model import LoopedTransformer
from ..model.cache import check_kv_format
from ..model.layers import apply_rope_full, attention_mask
from ..quant.hadamard import hadamard_matrix
from ..quant.kv import bytes_per_vector, dequantize_vectors, kv_format_rotates, quantize_vectors
from .scheduler import ScheduledChunk, Sequence


def n_slots(model: LoopedTransformer, loops: int) -> int:
    c = model.cfg
    return c.n_prelude + c.n_coda + loops * c.n_core


def cache_dtype(model: LoopedTransformer) -> torch.dtype:
    """The float dtype KV is kept in: the weights' (as for a single request's cache), at least float16."""
    p = next(model.parameters())
    return p.dtype if p.dtype.is_floating_point else torch.float32


class _PagedTensor:
    """Keys or values of every page: float storage, or codes + scale + offset (quantized formats).

    Layout (n_pages, page_size, Hkv, X): a sequence's gathered pages reshape to (positions, Hkv, X)
    without a copy, and attention reads them through a transposed view."""

    def __init__(self, n_pages: int, page_size: int, hkv: int, d: int, dtype, device, bits: int | None,
                 rotate: bool):
        self.dtype, self.bits = dtype, bits
        self.H = None
        if bits is None:
            self.data = torch.zeros(n_pages, page_size, hkv, d, dtype=dtype, device=device)
            self.parts = [self.data]
            return
        self.codes = torch.zeros(n_pages, page_size, hkv, d * bits // 8, dtype=torch.uint8, device=device)
        self.scale = torch.zeros(n_pages, page_size, hkv, 1, dtype=torch.float16, device=device)
        self.offset = torch.zeros(n_pages, page_size, hkv, 1, dtype=torch.float16, device=device)
        self.parts = [self.codes, self.scale, self.offset]
        if rotate:
            self.H = hadamard_matrix(d, torch.float64 if dtype == torch.float64 else torch.float32, device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts)

    def write(self, pages: torch.Tensor, offs: torch.Tensor, x: torch.Tensor) -> None:
        """x: (Hkv, T, D) for the T positions at (pages[t], offs[t])."""
        x = x.transpose(0, 1)                                         # (T, Hkv, D)
        if self.bits is None:
            self.data[pages, offs] = x.to(self.dtype)
            return
        if self.H is not None:
            x = x.to(self.H.dtype) @ self.H
        codes, scale, offset = quantize_vectors(x, self.bits)
        self.codes[pages, offs] = codes
        self.scale[pages, offs] = scale
        self.offset[pages, offs] = offset

    def _gathered(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The pages at `index` (any shape I) as (*I, page_size, Hkv, D) in `dtype` (dequantized)."""
        if self.bits is None:
            return self.data[index].to(dtype)
        x = dequantize_vectors(self.codes[index], self.scale[index], self.offset[index], self.bits,
                               dtype if self.H is None else self.H.dtype)
        return x if self.H is None else (x @ self.H).to(dtype)

    def read(self, pages: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
        """(Hkv, length, D) for one sequence whose pages (in order) are `pages`."""
        return self.read_batched(pages[None], dtype)[0, :, :length]

    def read_batched(self, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B, Hkv, nP * page_size, D) for B sequences whose pages are the rows of `table` (B, nP)."""
        g = self._gathered(table, dtype)                              # (B, nP, ps, Hkv, D)
        B, nP, ps, hkv, d = g.shape
        return g.reshape(B, nP * ps, hkv, d).transpose(1, 2)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in self.parts:
            t[dst] = t[src]


class PagedKV:
    def __init__(self, model: LoopedTransformer, n_pages: int, page_size: int, kv_format: str = "fp16",
                 dtype: torch.dtype | None = None):
        cfg = model.cfg
        bits = check_kv_format(cfg, kv_format)
        self.kv_format, self.page_size, self.n_pages = kv_format, page_size, n_pages
        self.dtype = dtype or cache_dtype(model)
        device = next(model.parameters()).device
        rotate = bits is not None and kv_format_rotates(kv_format)
        dims = (n_pages, page_size, cfg.n_kv_heads, cfg.head_dim)
        self.k = _PagedTensor(*dims, self.dtype, device, bits, rotate)
        self.v = _PagedTensor(*dims, self.dtype, device, bits, rotate)

    @staticmethod
    def page_bytes(model: LoopedTransformer, page_size: int, kv_format: str, dtype: torch.dtype | None = None) -> int:
        cfg = model.cfg
        elt = torch.tensor([], dtype=dtype or cache_dtype(model)).element_size()
        return 2 * page_size * cfg.n_kv_heads * bytes_per_vector(cfg.head_dim, kv_format, elt)

    def nbytes(self) -> int:
        return self.k.nbytes() + self.v.nbytes()

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies])
        dst = torch.tensor([d for _, d in copies])
        self.k.copy(src, dst)
        self.v.copy(src, dst)


class _Seg:
    """One chunk's rows in the packed batch and its view of the pages, per step."""

    def __init__(self, chunk: ScheduledChunk, row0: int, page_size: int, device):
        self.chunk, self.seq = chunk, chunk.seq
        self.row0, self.row1 = row0, row0 + chunk.n
        self.start, self.end = chunk.start, chunk.start + chunk.n
        pos = torch.arange(self.start, self.end, device=device)
        self.positions = pos
        self.page_idx = pos // page_size                # logical block of each new position
        self.offs = pos % page_size
        self.table = torch.tensor(chunk.seq.block_table, device=device)  # (blocks, slots) page ids
        self.n_read = -(-self.end // page_size)          # blocks holding keys this step can see
        self._mask: dict[int, torch.Tensor | None] = {}

    def mask(self, window: int, rep: int) -> torch.Tensor | None:
        key = (window, rep)
        if key not in self._mask:
            T = self.end - self.start
            if T == 1 and window == 0:
                m = None  # one query sees every key up to itself
            else:
                m = attention_mask(self.positions, torch.arange(self.end, device=self.positions.device), window)
                if rep > 1:
                    m = m.repeat(rep, 1)
            self._mask[key] = m
        return self._mask[key]


class _DecodeGroup:
    """The step's one-token (decode) chunks, attended together in one padded SDPA call per layer.

    They keep the runner's order (deepest first), so the ones still looping at any loop are a prefix."""

    def __init__(self, segs: list[_Seg], page_size: int, device):
        self.segs = segs
        B = len(segs)
        n_blocks = max(s.n_read for s in segs)          # only blocks some query can see are read
        n_slots_max = max(s.table.shape[1] for s in segs)
        table = torch.zeros(B, n_blocks, n_slots_max, dtype=torch.long, device=device)
        for i, s in enumerate(segs):
            nb = min(n_blocks, s.table.shape[0])
            table[i, :nb, :s.table.shape[1]] = s.table[:nb]
        self.table = table
        self.rows = torch.tensor([s.row0 for s in segs], device=device)
        pos = torch.tensor([s.start for s in segs], device=device)
        self.blk = pos // page_size
        self.off = pos % page_size
        self.arange = torch.arange(B, device=device)
        key_pos = torch.arange(n_blocks * page_size, device=device)
        allowed = key_pos[None, :] <= pos[:, None]
        win = torch.tensor([s.seq.window for s in segs], device=device)
        allowed &= (win[:, None] == 0) | (key_pos[None, :] > pos[:, None] - win[:, None])
        self.mask = allowed[:, None, None, :]                                  # (B, 1, 1, L)


class BatchRunner:
    def __init__(self, model: LoopedTransformer, kv: PagedKV):
        self.model = model
        self.kv = kv
        self.device = next(model.parameters()).device
        self.last_logits: torch.Tensor | None = None   # (k, V) of the last step, rows in `last_ids` order
        self.last_ids: list[int] = []

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], copies: list[tuple[int, int]] = ()) -> dict[int, torch.Tensor]:
        """Run the chunks; returns {seq_id: logits (V,)} for each chunk that needs logits."""
        self.kv.copy_pages(list(copies))
        if not chunks:
            return {}
        m, cfg = self.model, self.model.cfg
        order = sorted(chunks, key=lambda c: -c.seq.loops)   # deepest first: active rows are a prefix
        segs, row = [], 0
        for c in order:
            segs.append(_Seg(c, row, self.kv.page_size, self.device))
            row += c.n
        dec = [sg for sg in segs if sg.chunk.n == 1]
        self._dec = _DecodeGroup(dec, self.kv.page_size, self.device) if len(dec) > 1 else None
        tokens = torch.tensor([t for c in order for t in c.token_ids], device=self.device)[None]
        positions = torch.cat([s.positions for s in segs])
        dtype = m.act_dtype or m.embed.weight.dtype
        cos, sin = m.rotary.cos_sin(positions, dtype)
        # RoPE tables in the 4-op form (`apply_rope_full`, bit-identical to apply_rope), made once per step
        cos, sin = torch.cat([cos, cos], dim=-1)[:, None], torch.cat([-sin, sin], dim=-1)[:, None]  # (N, 1, D)
        x = m.embed(tokens)
        if m.act_dtype is not None:
            x = x.to(m.act_dtype)
        base = cfg.n_prelude + cfg.n_coda
        for i, blk in enumerate(m.prelude):
            x = self._block(blk, x, i, segs, cos, sin)
        e = x
        h = m.init_state(e)
        max_loops = max(c.seq.loops for c in order)
        for r in range(max_loops):
            active = [s for s in segs if s.seq.loops > r]
            n = active[-1].row1
            hx, ex = h[:, :n], e[:, :n]
            if cfg.injection == "add":
                hx = hx + ex
            elif cfg.injection == "concat-adapter":
                hx = m.adapter(torch.cat([hx, ex], dim=-1))
            for j, blk in enumerate(m.core):
                hx = self._block(blk, hx, base + r * cfg.n_core + j, active, cos[:n], sin[:n])
            m.core_loop_tokens += n
            if m.core_norm is not None:
                hx = m.core_norm(hx)
            h = hx if n == h.shape[1] else torch.cat([hx, h[:, n:]], dim=1)
        x = h
        for i, blk in enumerate(m.coda):
            x = self._block(blk, x, cfg.n_prelude + i, segs, cos, sin)
        want = [s for s in segs if s.chunk.needs_logits]
        if not want:
            return {}
        rows = torch.tensor([s.row1 - 1 for s in want], device=self.device)
        logits = m.logits(x[:, rows])[0]                                       # (k, V)
        self.last_logits, self.last_ids = logits, [s.seq.seq_id for s in want]
        return {s.seq.seq_id: logits[i] for i, s in enumerate(want)}

    def _attend_decode(self, grp: _DecodeGroup, n: int, slot: int, q, k, v, out, rep: int, adt) -> None:
        """The first n decode chunks: write their new keys/values, then one padded SDPA over their pages."""
        H, _, D = q.shape
        Hkv = k.shape[0]
        rows = grp.rows[:n]
        table = grp.table[:n, :, slot]                                         # (n, blocks)
        wpages = table[grp.arange[:n], grp.blk[:n]]
        self.kv.k.write(wpages, grp.off[:n], k[:, rows])
        self.kv.v.write(wpages, grp.off[:n], v[:, rows])
        K = self.kv.k.read_batched(table, adt)                                 # (n, Hkv, L, D)
        V = self.kv.v.read_batched(table, adt)
        qs = q[:, rows].to(adt).transpose(0, 1).reshape(n, Hkv, rep, D)       # (n, Hkv, rep, D)
        o = F.scaled_dot_product_attention(qs, K, V, attn_mask=grp.mask[:n])  # (n, Hkv, rep, D)
        out[:, rows] = o.reshape(n, H, D).transpose(0, 1)

    def _block(self, blk, x, slot: int, segs: list[_Seg], cos, sin) -> torch.Tensor:
        x = x + self._attention(blk.attn, blk.attn_norm(x), slot, segs, cos, sin)
        return x + blk.mlp(blk.mlp_norm(x))

    def _attention(self, attn, a: torch.Tensor, slot: int, segs: list[_Seg], cos, sin) -> torch.Tensor:
        """Attention for the rows of `segs` (a prefix of the step's rows): each chunk over its own pages;
        the decode chunks all at once (`_DecodeGroup`) when there are several."""
        _, N, _ = a.shape
        H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
        # cos, sin: the step's (N, 1, D) tables for `apply_rope_full`
        if attn.wqkv is not None:
            qkv = attn.wqkv(a).view(N, H + 2 * Hkv, D)
            qk = apply_rope_full(qkv[:, :H + Hkv], cos, sin)                   # one RoPE over q and k
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hkv:]
        else:
            q = apply_rope_full(attn.wq(a).view(N, H, D), cos, sin)
            k = apply_rope_full(attn.wk(a).view(N, Hkv, D), cos, sin)
            v = attn.wv(a).view(N, Hkv, D)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)   # (H or Hkv, N, D)
        rep = H // Hkv
        adt = torch.promote_types(q.dtype, torch.float32)
        out = torch.empty(H, N, D, dtype=adt, device=a.device)
        grp = self._dec
        n_dec = 0
        if grp is not None:
            n_dec = sum(1 for s in segs if s.chunk.n == 1)  # still looping: a prefix of the group
            if n_dec > 1:
                self._attend_decode(grp, n_dec, slot, q, k, v, out, rep, adt)
            else:
                n_dec = 0
        for s in segs:
            if n_dec and s.chunk.n == 1:
                continue
            kv_pages = s.table[:, slot][s.page_idx]
            self.kv.k.write(kv_pages, s.offs, k[:, s.row0:s.row1])
            self.kv.v.write(kv_pages, s.offs, v[:, s.row0:s.row1])
            pages = s.table[:s.n_read, slot]                                   # not the blocks past `end`
            K = self.kv.k.read(pages, s.end, adt)                             # (Hkv, L, D)
            V = self.kv.v.read(pages, s.end, adt)
            T = s.row1 - s.row0
            qs = q[:, s.row0:s.row1].to(adt).reshape(Hkv, rep * T, D)        # query heads grouped by kv head
            mask = s.mask(s.seq.window, rep)
            o = F.scaled_dot_product_attention(qs[None], K[None], V[None], attn_mask=mask)
            out[:, s.row0:s.row1] = o[0].reshape(H, T, D)
        out = out.to(a.dtype).transpose(0, 1).reshape(1, N, H * D)
        return attn.wo(out)
