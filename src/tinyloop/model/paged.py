"""The paged KV pool and the batched step over it: the serving side of the model's one forward.

`PagedKV` is the pool: keys and values of every page, `(n_pages, page_size, Hkv, D)`, stored by
`quant.kv.KVTensor` (float, or int8/int4/int4-h codes) exactly as the contiguous `KVCache` stores them.
A sequence's pages form a block table `(blocks, slots)`: page `table[b, s]` holds positions
`b*page_size .. (b+1)*page_size - 1` of cache slot `s` (`cache.SlotLayout`).

A step runs many sequences' rows through `LoopedTransformer.run` at once, packed into one `(1, N, dim)`
row block, so every linear layer reads its weights once for the whole batch. Each sequence contributes a
`Rows`: its tokens (or, to continue a draft, its states after some loop), the loops to run, the
read-out, and where its keys go. `PagedStep` is the step context the model's attention calls: it stores
each row's new keys in its sequence's pages and attends over that sequence's own pages, the one-token
rows of many sequences together in one padded call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig
from ..quant.kv import KVTensor, bytes_per_vector
from .cache import SlotLayout, check_kv_format
from .layers import build_mask, combine_windows, grouped_sdpa, rope_tables


class PagedKV:
    """The KV pool: fixed-size pages of keys and values, any sequence, any slot."""

    def __init__(self, cfg: ModelConfig, n_pages: int, page_size: int, kv_format: str = "fp16",
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        check_kv_format(cfg, kv_format)
        self.cfg, self.kv_format, self.page_size, self.n_pages, self.dtype = cfg, kv_format, page_size, n_pages, dtype
        shape = (n_pages, page_size, cfg.n_kv_heads, cfg.head_dim)
        self.k = KVTensor(shape, kv_format, dtype, device)
        self.v = KVTensor(shape, kv_format, dtype, device)

    @staticmethod
    def page_bytes(cfg: ModelConfig, page_size: int, kv_format: str, dtype: torch.dtype) -> int:
        elt = torch.tensor([], dtype=dtype).element_size()
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

    def copy_positions(self, table: torch.Tensor, src: list[int], dst_start: int) -> None:
        """In every slot of one sequence (`table` (blocks, slots)), the entries at storage indices `src`
        move to dst_start, dst_start+1, ... (tree speculation's compaction of an accepted path)."""
        ps = self.page_size
        s = torch.tensor(src)
        d = torch.arange(dst_start, dst_start + len(src))
        src_idx = (table[s // ps].T, (s % ps).expand(table.shape[1], -1))     # (slots, n) each
        dst_idx = (table[d // ps].T, (d % ps).expand(table.shape[1], -1))
        self.k.copy(src_idx, dst_idx)
        self.v.copy(src_idx, dst_idx)


_ARANGE = torch.arange(4096)


def _arange(start: int, end: int) -> torch.Tensor:
    """torch.arange(start, end) as a read-only view of one shared range (a step builds one per row)."""
    global _ARANGE
    if end > _ARANGE.numel():
        _ARANGE = torch.arange(max(end, 2 * _ARANGE.numel()))
    return _ARANGE[start:end]


@dataclass(eq=False)
class Rows:
    """One sequence's rows in a step, and what the model does with them.

    Storage: the rows' keys go to storage indices start .. start+n-1 of the sequence's pages (`table`);
    they attend to every key below (window permitting), causally among themselves, or as `tree_mask`
    (n, S) says over the last S keys (uncommitted tree nodes at `tree_key_positions`). `positions`
    (n,) are the rows' real positions (RoPE, window); by default start .. start+n-1.

    Program: core loops `first_loop .. last_loop - 1`. Rows with `first_loop == 0` start from `tokens`
    (embedding and prelude); others continue from `state` = (e, h), each (n, dim): the prelude output and
    the state after loop first_loop - 1 (a draft's). Then `readout`: "coda" (the model's coda), a
    (blocks module, slots) pair such as a draft exit, or None. `capture`: keep (e, h) after the last loop
    (`out.state`). The step's results are in `out`: `hidden` (n, dim) after the read-out, `state`.
    With an `exit_rule` (adaptive depth, one-row Rows only) `last_loop` is lowered to the loops actually
    run when the row exits early.
    """

    table: torch.Tensor
    start: int
    n: int
    last_loop: int
    tokens: list[int] | None = None
    state: tuple[torch.Tensor, torch.Tensor] | None = None
    first_loop: int = 0
    readout: Any = "coda"
    capture: bool = False
    positions: torch.Tensor | None = None
    window: int = 0
    tree_mask: torch.Tensor | None = None
    tree_key_positions: torch.Tensor | None = None
    tag: Any = None                       # the caller's (which sequence, which pass)
    exit_rule: Any = None                 # model.exits.ExitRule: one-row tokens may leave before last_loop
    exit_survival: float = 1.0            # the gate rule's probability of not having exited yet
    exit_logp: Any = None                 # the kl rule's log-probabilities after the previous loop (V,)
    greedy: bool = False                  # the batch runner takes the last row's greedy token (`argmax`) in the
                                          # step's one head call with the other sequences'
    noise: tuple | None = None            # with greedy: (key, 1 / T, top_k, top_p), the token drawn instead
    draft: Any = None                     # a speculator's draft head: the batch runner sets `draft_logits` (its
                                          # logits over the draft vocabulary for these rows' outputs)
    # filled by the step
    row0: int = 0
    hidden: torch.Tensor | None = None
    out_state: tuple[torch.Tensor, torch.Tensor] | None = None
    argmax: int | None = None
    draft_logits: torch.Tensor | None = None

    def __post_init__(self):
        self.default_positions = self.positions is None   # start .. start+n-1 (no tensor read needed)
        if self.positions is None:
            self.positions = _arange(self.start, self.start + self.n)
        if (self.tokens is None) == (self.state is None):
            raise ValueError("a Rows starts from tokens or from a state, not both or neither")

    @property
    def end(self) -> int:
        return self.start + self.n

    @property
    def decode_like(self) -> bool:
        """One causal row: attended together with the step's other such rows."""
        return self.n == 1 and self.tree_mask is None


class _DecodeGroup:
    """The view's one-row sequences, attended together in one padded SDPA call per layer."""

    def __init__(self, rows: list[Rows], local_row0: list[int], page_size: int, device):
        B = len(rows)
        n_blocks = max(-(-r.end // page_size) for r in rows)          # only blocks some query can see
        n_slots = max(r.table.shape[1] for r in rows)
        table = torch.zeros(B, n_blocks, n_slots, dtype=torch.long, device=device)
        for i, r in enumerate(rows):
            nb = min(n_blocks, r.table.shape[0])
            table[i, :nb, :r.table.shape[1]] = r.table[:nb]
        self.table = table
        self.rows = torch.tensor(local_row0, device=device)
        start = torch.tensor([r.start for r in rows], device=device)
        pos = torch.cat([r.positions for r in rows]).to(device)
        self.blk, self.off, self.arange = start // page_size, start % page_size, torch.arange(B, device=device)
        key_idx = torch.arange(n_blocks * page_size, device=device)
        allowed = key_idx[None, :] <= start[:, None]                      # storage index == position here
        win = torch.tensor([r.window for r in rows], device=device)
        self._parts = (key_idx, pos, allowed, [r.window for r in rows])
        allowed = allowed & ((win[:, None] == 0) | (key_idx[None, :] > pos[:, None] - win[:, None]))
        self.mask = allowed[:, None, None, :]                             # (B, 1, 1, L)
        self._masks: dict[int, torch.Tensor] = {0: self.mask}

    def mask_for(self, window: int) -> torch.Tensor:
        """The group's mask with a layer's `window` besides each row's own (0: the rows' own only)."""
        m = self._masks.get(window)
        if m is None:
            key_idx, pos, allowed, wins = self._parts
            win = torch.tensor([combine_windows(w, window) for w in wins], device=pos.device)
            allowed = allowed & ((win[:, None] == 0) | (key_idx[None, :] > pos[:, None] - win[:, None]))
            m = self._masks[window] = allowed[:, None, None, :]
        return m


class PagedView:
    """The step context for a subset of a step's sequences (those taking part in one phase: the prelude,
    loop r, a read-out). Row i of the model's (1, n, dim) input is row `rows[i]` of the step."""

    def __init__(self, step: "PagedStep", members: list[Rows]):
        self.kv, self.slots = step.kv, step.slots
        self.members = members
        ps, dev = step.kv.page_size, step.device
        self.local: list[int] = []
        idx, r0 = [], 0
        for m in members:
            self.local.append(r0)
            idx.append(torch.arange(m.row0, m.row0 + m.n))
            r0 += m.n
        self.n = r0
        first, last = members[0].row0, members[-1].row0 + members[-1].n
        self.span = (first, last) if last - first == r0 else None      # contiguous rows: slice, not gather
        self.rows = None if self.span else torch.cat(idx).to(dev)
        self._step = step
        self._rope = step.rope_rows(self)
        self._rope_alt: tuple[torch.Tensor, torch.Tensor] | None = None
        dec = [i for i, m in enumerate(members) if m.decode_like]
        self.dec = _DecodeGroup([members[i] for i in dec], [self.local[i] for i in dec], ps, dev) \
            if len(dec) > 1 else None
        self.dec_members = set(dec) if self.dec is not None else set()
        self._masks: dict[tuple[int, int], torch.Tensor | None] = {}
        # per other member, made once for every layer of the step: where its rows' keys go (a page per
        # slot; python ints for one row, the cheapest index) and the pages its queries read, slot-major
        self._io = {}
        for i, m in enumerate(members):
            if i in self.dec_members:
                continue
            nb = -(-m.end // ps)
            read = m.table[:nb].T.contiguous()                                   # (slots, nb)
            # a slot whose pages are consecutive in the pool is read as a slice (a view, no gather)
            runs = ((read[:, 1:] - read[:, :-1]) == 1).all(1).tolist() if nb > 1 else [True] * read.shape[0]
            first = read[:, 0].tolist()
            read = [slice(first[s], first[s] + nb) if runs[s] else read[s] for s in range(read.shape[0])]
            if m.n == 1:
                write = (m.table[m.start // ps].tolist(), m.start % ps)
            else:
                idx = torch.arange(m.start, m.end, device=dev)
                write = (m.table[idx // ps].T.contiguous(), idx % ps)             # (slots, n), (n,)
            self._io[i] = (write, read, nb)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This view's rows of a (1, N, .) step tensor."""
        if self.span is not None:
            a, b = self.span
            return x if (a, b) == (0, x.shape[1]) else x[:, a:b]
        return x[:, self.rows]

    def put(self, x: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """x with this view's rows replaced by `part` (in place where possible)."""
        if self.span is not None:
            a, b = self.span
            if (a, b) == (0, x.shape[1]):
                return part
            x[:, a:b] = part
            return x
        x[:, self.rows] = part
        return x

    def rope_full(self, profile: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if profile == 1:
            return self._rope
        if self._rope_alt is None:
            self._rope_alt = self._step.rope_rows(self, profile)
        return self._rope_alt

    def _first_block(self, i: int, m: Rows, window: int) -> int:
        """The first page block member i's queries can see with a layer's `window` (0 without one): a
        sliding-window layer reads and scores only the blocks its window reaches, not the whole context."""
        w = combine_windows(m.window, window)
        if not window or m.tree_mask is not None:
            return 0
        key = ("first", i, w)
        if key not in self._masks:
            self._masks[key] = max(0, int(m.positions.min()) - w + 1) // self.kv.page_size
        return self._masks[key]

    def _mask(self, i: int, m: Rows, device: torch.device, window: int = 0) -> torch.Tensor | None:
        w = combine_windows(m.window, window)
        key = (i, w, bool(window))   # (a row's own window alone reads from block 0: `_first_block`)
        if key not in self._masks:
            lo = self._first_block(i, m, window) * self.kv.page_size
            if m.n == 1 and w == 0 and m.tree_mask is None:
                mask = None
            else:   # (the rows' positions are host tensors; the mask goes where the queries are)
                key_pos = torch.arange(lo, m.end, device=m.positions.device)
                mask = build_mask(m.positions, key_pos, w, m.tree_mask, m.tree_key_positions).to(device)
            self._masks[key] = mask
        return self._masks[key]

    def _store(self, i: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Member i's new keys/values (n, Hkv, D) into its pages of `slot`."""
        (pages, offs), _, _ = self._io[i]
        at = (pages[slot], offs)
        if self.members[i].n == 1:  # python-int index: one (Hkv, D) vector
            k, v = k[0], v[0]
        self.kv.k.write(at, k)
        self.kv.v.write(at, v)

    def _keys(self, i: int, slot: int, dtype: torch.dtype, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key/value member i's queries may see in `slot`, from page block `first` on (a sliding
        window's: `_first_block`): (1, Hkv, L, D) each, in `dtype`."""
        _, pages, nb = self._io[i]
        end, ps = self.members[i].end, self.kv.page_size
        read = pages[slot]
        if first:
            read = slice(read.start + first, read.stop) if isinstance(read, slice) else read[first:]
        K = self.kv.k.read(read, dtype)
        V = self.kv.v.read(read, dtype)
        shape = (1, (nb - first) * ps, *K.shape[2:])
        n = end - first * ps
        return K.view(shape)[:, :n].transpose(1, 2), V.view(shape)[:, :n].transpose(1, 2)

    def attend(self, slot: int | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int = 0) -> torch.Tensor:
        """q: (1, n, H, D), k, v: (1, n, Hkv, D) for this view's rows -> (1, n, H, D); `window`: the layer's
        (each query sees the W most recent keys; with a row's own window, the narrower)."""
        adt = torch.promote_types(q.dtype, torch.float32)
        if len(self.members) == 1:  # a batch of one, or a speculative pass alone: no row bookkeeping
            (pages, offs), _, _ = self._io[0]
            if self.members[0].n == 1:  # one row: python-int indices, one (Hkv, D) vector each
                at = (pages[slot], offs)
                self.kv.k.write(at, k[0, 0])
                self.kv.v.write(at, v[0, 0])
            else:
                self._store(0, slot, k[0], v[0])
            q = q.transpose(1, 2)
            m = self.members[0]
            return grouped_sdpa(q if q.dtype == adt else q.to(adt), *self._keys(0, slot, adt, self._first_block(0, m, window)),
                                self._mask(0, m, q.device, window)).transpose(1, 2)
        q, k, v = q[0], k[0], v[0]
        n, H, D = q.shape
        out = torch.empty(n, H, D, dtype=adt, device=q.device)
        grp = self.dec
        # every row's keys first, then the reads: rows of one sequence in one step (a draft exit's
        # catch-up row and the next draft row) see each other as a batched causal step would
        if grp is not None:
            table = grp.table[:, :, slot]                                        # (G, blocks)
            wpages = table[grp.arange, grp.blk]
            self.kv.k.write((wpages, grp.off), k[grp.rows])
            self.kv.v.write((wpages, grp.off), v[grp.rows])
        for i in self._io:
            a = self.local[i]
            self._store(i, slot, k[a:a + self.members[i].n], v[a:a + self.members[i].n])
        if grp is not None:
            G, nb = table.shape
            ps = self.kv.page_size
            K = self.kv.k.read(table, adt).reshape(G, nb * ps, -1, D).transpose(1, 2)   # (G, Hkv, L, D)
            V = self.kv.v.read(table, adt).reshape(G, nb * ps, -1, D).transpose(1, 2)
            qs = q[grp.rows].to(adt)[:, :, None]                                # (G, H, 1, D)
            out[grp.rows] = grouped_sdpa(qs, K, V, grp.mask_for(window))[:, :, 0]
        for i in self._io:
            m, a = self.members[i], self.local[i]
            qs = q[a:a + m.n].to(adt).transpose(0, 1)[None]                     # (1, H, T, D)
            out[a:a + m.n] = grouped_sdpa(qs, *self._keys(i, slot, adt, self._first_block(i, m, window)),
                                          self._mask(i, m, qs.device, window))[0].transpose(0, 1)
        return out[None]


class PagedStep:
    """A step over the pool: the sequences' `Rows` in row order, their RoPE tables, and one cached
    `PagedView` per distinct subset of sequences the model asks for."""

    def __init__(self, kv: PagedKV, rows: list[Rows], rotary, dtype: torch.dtype, device):
        self.kv, self.rows, self.device = kv, rows, device
        self.slots = SlotLayout(kv.cfg, kv.cfg.max_loops)   # prelude, coda and core slots are the same at any depth
        r0 = 0
        for r in rows:
            r.row0 = r0
            r0 += r.n
        self.n = r0
        self._rotary, self._dtype = rotary, dtype
        self._rope_all: tuple[torch.Tensor, torch.Tensor] | None = None   # made when a view first needs it
        self._rope_alt: tuple[torch.Tensor, torch.Tensor] | None = None   # the second RoPE profile's (rope_profile 2)
        self._views: dict[tuple[int, ...], PagedView] = {}

    @property
    def _rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' RoPE tables, (N, 1, D) each (a step whose rows all run natively never makes them)."""
        if self._rope_all is None:
            positions = torch.cat([r.positions for r in self.rows]).to(self.device)
            self._rope_all = rope_tables(*self._rotary.cos_sin(positions, self._dtype))
        return self._rope_all

    def _rope_of(self, profile: int) -> tuple[torch.Tensor, torch.Tensor]:
        if profile == 1:
            return self._rope
        if self._rope_alt is None:
            positions = torch.cat([r.positions for r in self.rows]).to(self.device)
            self._rope_alt = rope_tables(*self._rotary.profile(profile).cos_sin(positions, self._dtype))
        return self._rope_alt

    def rope_rows(self, view: PagedView, profile: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        rope = self._rope_of(profile)
        if view.span is not None:
            a, b = view.span
            return rope if (a, b) == (0, self.n) else (rope[0][a:b], rope[1][a:b])
        return rope[0][view.rows], rope[1][view.rows]

    def fill_skipped(self, r: Rows, used: int, upto: int) -> None:
        """A one-row token that ran `used` core loops of `upto`: its keys/values of loops used..upto-1 (every
        core layer) become a copy of its last computed loop's (`model.exits`: the deeper slots later tokens
        read)."""
        if used >= upto:
            return
        ps = self.kv.page_size
        kv = self.slots.core_kv_layers()   # (an nGPT MLP block keeps no keys)
        src = [self.slots.core(used - 1, j) for _ in range(used, upto) for j in kv]
        dst = [self.slots.core(loop, j) for loop in range(used, upto) for j in kv]
        pages = r.table[r.start // ps]                                          # (slots,)
        at = (pages[torch.tensor(dst)], r.start % ps)
        frm = (pages[torch.tensor(src)], r.start % ps)
        self.kv.k.copy(frm, at)
        self.kv.v.copy(frm, at)

    def view(self, members: list[Rows]) -> PagedView:
        key = tuple(id(m) for m in members)
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = PagedView(self, members)
        return v
