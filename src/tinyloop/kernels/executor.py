"""The native executor: one C call runs a decode step's one-token rows through the whole looped model.

`NativeExecutor(model)` describes the model to the library once (pointers to the very weight tensors the
PyTorch modules hold: no copies, except fp32 copies of the small norm vectors and q/k biases) and
`run(kv, rows)` takes the rows of a serving step it supports (`model.paged.Rows`), runs them natively over
the same paged KV pool, and hands back the others for `LoopedTransformer._run`. `supports` says which rows
it takes: decode rows of every kind except tree-masked ones and the kl criterion; prefill chunks stay in
PyTorch.

Calls that run a whole piece of one request (speculation and tree rounds, a lone request's steps) are in
calls.py. The math is model/'s; tests/kernels/test_native.py checks every configuration against it.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref

import torch
import torch.nn as nn

from . import lib as L
from .lib import _INJECTIONS, _LOOP_STARTS, _PLACEMENTS, config_refusal, unsupported_features  # noqa: F401
from .layers import (_CALL, _FLOAT_KINDS, Unsupported, _forward, _vec, default_threads,  # noqa: F401
                     describe, linear_desc, own_linears, pack_int4, packed_int4, cold, tensor_desc)   # (_forward: tests and benchmarks take it from here)
from .calls import RequestCalls, _draft_desc, _int64
from .features import features_desc, value_embed_desc

_KV_QUANT = {"int8": L.TL_KV_I8, "int4": L.TL_KV_I4, "int4-h": L.TL_KV_I4H}


STREAMED_BYTES = 64 << 20
PACK_STREAMED_BYTES = 512 << 20   # a streamed model's int4 codes up to this are packed too (TINYLOOP_NATIVE_PACK)
_BITS = {L.TL_F32: 32, L.TL_F16: 16, L.TL_BF16: 16, L.TL_Q8: 8, L.TL_Q4: 4, L.TL_Q2: 2}


class NativeExecutor(RequestCalls):
    def __init__(self, model, threads: int | None = None):
        cfg = model.cfg
        why = config_refusal(cfg)
        if why:
            raise Unsupported(why)
        if model.embed.weight.device.type != "cpu":
            raise Unsupported("the native executor runs on the CPU")
        self.lib = L.load()
        self.model, self.keep = model, []
        self._head_costs: list[float] = []   # (head_costs)
        self._model_digest: str | None = None   # (_model_key)
        m = self.desc = L.TlModel()
        m.dim, m.n_heads, m.n_kv_heads, m.head_dim = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        m.ffn_dim, m.vocab = cfg.ffn_dim, cfg.vocab_size
        m.n_prelude, m.n_core, m.n_coda = cfg.n_prelude, cfg.n_core, cfg.n_coda
        m.swiglu, m.injection = int(cfg.mlp == "swiglu"), _INJECTIONS[cfg.injection]
        m.relu2 = int(cfg.mlp == "relu2")
        m.placement, m.loop_norm, m.post_loop_norm = _PLACEMENTS[cfg.norm_placement], cfg.loop_norm, cfg.post_loop_norm
        m.norm_eps, m.embed_scale = cfg.norm_eps, cfg.embed_scale
        emb = model.embed.weight
        if emb.dtype not in _FLOAT_KINDS:
            raise Unsupported(f"{emb.dtype} embeddings")
        m.embed, m.embed_kind = emb.data_ptr(), _FLOAT_KINDS[emb.dtype]
        blocks = [*model.prelude, *model.core, *model.coda]
        self.blocks = (L.TlBlock * len(blocks))(*(self._block(b, i) for i, b in enumerate(blocks)))
        features_desc(model, m, self.keep)
        m.sphere = int(model.sphere)   # the state on the unit sphere (loop entry and end: l2norm)
        self._slot_map(model, m)
        m.blocks = self.blocks
        m.core_norm = _vec(model.core_norm.weight if model.core_norm is not None else None, self.keep)
        m.final_norm = _vec(model.norm.weight if cfg.post_loop_norm else None, self.keep)
        if model.adapter is not None:
            m.adapter = linear_desc(model.adapter, self.keep)
        head = model.head_linear
        self.head = linear_desc(head, self.keep) if head is not None else tensor_desc(model.head_weight, self.keep)
        if model.logit_scale is not None:   # the head's per-token scales (model/looped.py logits)
            self.head.out_scale = _vec(model.logit_scales(self.head.n), self.keep)
        self._mark_streamed(m)
        self.copy_bytes = 0   # bytes of the weights' copies this executor holds (packed int4 codes: _pack)
        self._pack(self.linears())
        self.head_norm = _vec(model.norm.weight if cfg.head_norm else None, self.keep)   # model.final_norm
        self.head_eps = float(getattr(model.norm, "eps", cfg.norm_eps))
        m.head, m.head_norm, m.head_eps = ctypes.pointer(self.head), self.head_norm, self.head_eps   # (kl rule)
        m.loop_start = _LOOP_STARTS[cfg.loop_start]
        self._head_buf = torch.empty(0)   # logits of argmax-only calls (under _CALL)
        self._rope(512)
        self.threads = default_threads() if threads is None else threads
        self.scratch = torch.empty(0)
        self._kv: tuple | None = None
        self._exit_blocks: dict[int, tuple] = {}
        self.isa = self.lib.tl_isa().decode()

    def linears(self, blocks: str = "all") -> list:
        """The linear layers' descriptors of the model's blocks ("all"), or of its core's ("core": one loop's
        matrices, what a pass over the weights reads), in block order."""
        m = self.desc
        return _linears(self.blocks[m.n_prelude:m.n_prelude + m.n_core] if blocks == "core" else self.blocks)

    def _mark_streamed(self, m) -> None:
        """Weights a token reads beyond STREAMED_BYTES come from memory every step: the integer kernels then
        read one row after the other (the order the prefetcher follows), else several rows side by side
        (faster from cache). The cut is fixed rather than read from the cache size, which a VM reports for
        the whole host: the shipped int4 model (~16 MB with its int8 head) stays in cache here, a 1.4B real
        shape (0.85 GB a token) does not."""
        descs = [self.head] + [d for d in (m.adapter, m.inj_B, m.state_proj) if d.n] + self.linears()
        total = sum(d.n * d.k * _BITS.get(d.kind, 8) // 8 for d in descs)
        streamed = int(total > STREAMED_BYTES)
        for d in descs:
            d.streamed = streamed
        self.streamed = bool(streamed)
        self._marked = descs

    def _pack(self, descs) -> None:
        """int4 layers take the packed kernel (16 weight rows a vector, `layers.pack_int4`: a copy of their codes,
        ~2 MB for the shipped model) where the build has it (AVX-512 VNNI). A model that stays in cache always,
        with fp32 scales and s z' (`packed_f32`: the 16-bit strips cost the shipped model's 8 and 16 rows 10-13%);
        a streamed one whose int4 codes are at most PACK_STREAMED_BYTES too, at load (SmolLM2's 53 MB: 1.08-1.20x
        its decode on an AVX-512 EPYC, whose two threads read ~45 GB/s while the row-at-a-time kernel took ~19);
        a larger one's after the load, on a background thread (`_pack_later`; the model serves from its mapped
        codes meanwhile, so the start stays as fast): on the AVX-512 EPYC, the 4B nGPT shape (1.65 GB of codes, group
        32) decodes 1.56-1.60x faster once packed, the 1.4B real shape (group 128) 1.4-1.6x (0.85-0.93 of the read
        ceiling against 0.51-0.63; docs/decode.md). TINYLOOP_NATIVE_PACK=all packs every one at load, =0 none (the
        portable codes, shared by every process that maps the file). A packed model's kernels run as from cache
        (its descriptors not `streamed`). A layer's outputs are bitwise the same either way (both form the
        canonical reduction), so a layer may change kernels between two calls; what changes is the speed
        (benchmarks/pass_cost.py; docs/decode.md)."""
        setting = os.environ.get("TINYLOOP_NATIVE_PACK", "1").strip().lower()
        if setting not in ("0", "1", "all"):
            raise ValueError(f"TINYLOOP_NATIVE_PACK must be 1, 0 or all, got {setting!r}")
        todo = [d for d in descs if d.kind == L.TL_Q4 and d.act_q8 and not d.packed]
        self._packer = None
        if setting == "0" or not todo:
            return
        for d in todo:   # in cache: fp32 scales and s z' (8 bytes a group and row, not 3; fewer operations a call)
            d.packed_f32 = int(not self.streamed)
        self.copy_bytes += sum(max(0, self.lib.tl_pack_int4_size(d)) for d in todo)   # (counted from the start)
        if self.streamed and setting != "all" and sum(d.n * d.k // 2 for d in todo) > PACK_STREAMED_BYTES:
            if self.lib.tl_pack_int4_size(todo[0]) > 0:
                self._packer = threading.Thread(target=_pack_later, args=(weakref.ref(self), todo),
                                                name="tinyloop-pack", daemon=True)
                self._packer.start()
            return
        packed = [pack_int4(d, self.keep) for d in todo]
        if self.streamed and any(packed):
            self._stop_streaming()

    def _stop_streaming(self) -> None:
        for d in self._marked:
            d.streamed = 0
        self.streamed = False

    def packing_done(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds (None: until done) for the background packing of a large model's int4
        codes (`_pack`); True once none is running."""
        if self._packer is not None:
            self._packer.join(timeout)
        return self._packer is None or not self._packer.is_alive()

    @property
    def name(self) -> str:
        mode = "batch-invariant" if L.batch_invariant_setting() else "panels from 6-12 rows (not batch-invariant)"
        return f"native ({self.isa}, {self.threads} thread{'s' if self.threads != 1 else ''}, {mode})"

    def _slot_map(self, model, m: L.TlModel) -> None:
        """The cache slot of each slot number the library forms (prelude i, n_prelude + coda i, n_prelude + n_coda
        + loop * n_core + j), SlotLayout's at the deepest depth, where it is not that number itself: a model whose
        layers do not each keep keys (an MLP-only layer: -1, none) or whose loops share one slot a layer
        (kv_mode last_loop). Else no map (the library takes the numbers as slots)."""
        cfg, lay = model.cfg, model.slot_layout()
        P, C, K = cfg.n_prelude, cfg.n_core, cfg.n_coda
        slots = [lay.prelude(i) for i in range(P)] + [lay.coda(i) for i in range(K)]
        slots += [lay.core(r, j) for r in range(cfg.max_loops) for j in range(C)]
        slots = [-1 if s is None else s for s in slots]
        if slots == list(range(len(slots))):
            return
        arr = (ctypes.c_int32 * len(slots))(*slots)
        self.keep.append(arr)
        m.slot_map, m.slot_loops = ctypes.cast(arr, ctypes.c_void_p), cfg.max_loops

    def _block(self, blk, index: int | None = None) -> L.TlBlock:
        """A block's descriptor; `index`: its number among the model's (prelude, core, coda) blocks, which
        says where its value embeddings come from (None: a draft exit's block, which has none)."""
        b, k = L.TlBlock(), self.keep
        own = getattr(blk, "native_fields", None)   # a family's own layers say what the library reads (nGPT's)
        if own is not None:
            if index is None:
                raise Unsupported(f"a draft exit's {type(blk).__name__} blocks")
            describe(b, own(), k)
            return b
        a, mlp = blk.attn, blk.mlp
        qkv = [a.wqkv] if a.wqkv is not None else [a.wq, a.wk, a.wv]
        for i, lin in enumerate(qkv):
            b.qkv[i] = linear_desc(lin, k)
        b.n_qkv = len(qkv)
        b.wo = linear_desc(a.wo, k)
        up = [mlp.w_gate_up] if mlp.w_gate_up is not None else \
            ([mlp.w_gate, mlp.w_up] if mlp.kind == "swiglu" else [mlp.w_up])
        for i, lin in enumerate(up):
            b.up[i] = linear_desc(lin, k)
        b.n_up = len(up)
        b.down = linear_desc(mlp.w_down, k)
        b.attn_norm = _vec(blk.attn_norm.weight if blk.attn_norm is not None else None, k)   # (post: none)
        b.mlp_norm = _vec(blk.mlp_norm.weight if blk.mlp_norm is not None else None, k)
        b.attn_out_norm = _vec(blk.attn_out_norm.weight if blk.attn_out_norm is not None else None, k)
        b.mlp_out_norm = _vec(blk.mlp_out_norm.weight if blk.mlp_out_norm is not None else None, k)
        b.qk_bias = _vec(a.qk_bias, k)
        if a.q_norm is not None:   # OLMo-2's, over all heads together
            b.q_norm, b.k_norm = _vec(a.q_norm.weight, k), _vec(a.k_norm.weight, k)
        if a.ve_gate is not None:
            if index is None:
                raise Unsupported("value embeddings in a draft exit's blocks")
            value_embed_desc(self.model, index, b, k)
        return b

    def _rope(self, n: int) -> None:
        rot = self.model.rotary
        cos, sin = rot.table(n, torch.float32, "cpu")   # the PyTorch path's own tables
        self.rope = (cos.contiguous(), sin.contiguous())
        self.desc.rope_cos, self.desc.rope_sin = self.rope[0].data_ptr(), self.rope[1].data_ptr()
        self.desc.rope_len = self.rope[0].shape[0]
        if rot.alt is not None:   # the second profile's, as many rows
            cos2, sin2 = (t[:self.desc.rope_len].contiguous() for t in rot.alt.table(self.desc.rope_len, torch.float32, "cpu"))
            self.rope += (cos2, sin2)
            self.desc.rope_cos2, self.desc.rope_sin2 = cos2.data_ptr(), sin2.data_ptr()

    def _kv_desc(self, kv) -> L.TlKV:
        if self._kv is not None and self._kv[0] is kv:
            return self._kv[1]
        d = L.TlKV()
        d.page_size = kv.page_size
        if kv.kv_format in _KV_QUANT:
            d.format = _KV_QUANT[kv.kv_format]
            d.k, d.v = kv.k.codes.data_ptr(), kv.v.codes.data_ptr()
            d.k_scale, d.k_offset = kv.k.scale.data_ptr(), kv.k.offset.data_ptr()
            d.v_scale, d.v_offset = kv.v.scale.data_ptr(), kv.v.offset.data_ptr()
        else:
            if kv.dtype not in _FLOAT_KINDS:
                raise Unsupported(f"a {kv.dtype} KV pool")
            d.format = {torch.float32: L.TL_KV_F32, torch.float16: L.TL_KV_F16, torch.bfloat16: L.TL_KV_BF16}[kv.dtype]
            d.k, d.v = kv.k.data.data_ptr(), kv.v.data.data_ptr()
        self._kv = (kv, d)
        return d

    def supports(self, r) -> bool:
        """Rows this executor runs: one token from its embedding (plain decoding, a draft step, adaptive depth
        with the latent, gate or kl criterion); a prefill chunk (consecutive positions from their tokens, each
        a row of the call: every block writes all the call's keys before any row attends, so each position
        sees the chunk's earlier ones); or a run of consecutive positions continuing from a draft's states
        (chain verification, a draft exit's catch-up); tree nodes under a `tree_mask` (a tree round's draft
        passes and its verification: each row's keys at its storage index, its RoPE at its real position,
        attending to the committed keys and its ancestors); read out by the coda, a draft exit or nothing.
        Rows from tokens of a model that starts its recurrence from a random state (`state_seed`) bring that
        state (`_initial_states`)."""
        rule, ro = r.exit_rule, r.readout
        if r.tree_mask is not None:
            if rule is not None:
                return False
        elif not (getattr(r, "default_positions", False) or (
                int(r.positions[0]) == r.start and (r.n == 1 or int(r.positions[-1]) == r.start + r.n - 1))):
            return False
        if not (ro is None or ro == "coda" or (isinstance(ro, tuple) and isinstance(getattr(ro[0], "coda", None),
                                                                                    nn.ModuleList))):
            return False
        if isinstance(ro, tuple) and hasattr(self.model.core[0], "native_fields"):
            return False   # (a draft exit's copies of a family's own blocks: not described)
        if r.tokens is not None:
            return (r.first_loop == 0
                    and (rule is None or (r.n == 1 and rule.criterion in L.TL_EXIT and rule.max_loops == r.last_loop
                                          and (rule.criterion != "gate" or self.model.exit_gate is not None))))
        return rule is None and r.first_loop > 0

    def _gate(self) -> None:
        """The exit gate's weights (it may be attached after the executor is made: `Engine.load`)."""
        g = self.model.exit_gate
        key = None if g is None else (g.weight.data_ptr(), g.weight._version)
        if key != getattr(self, "_gate_key", None):
            self._gate_key = key
            self.gate_w = None if g is None else g.weight.detach().reshape(-1).float().contiguous()
            self.desc.gate_w = None if g is None else self.gate_w.data_ptr()
            self.desc.gate_b = 0.0 if g is None else float(g.bias.detach().double()[0])

    def _readout(self, ro, table: dict, keep: list) -> int:
        """-1 (none), 0 (the coda), or the index + 1 of a draft exit's read-out in this call's list."""
        if ro is None:
            return -1
        if ro == "coda":
            return 0
        key = (id(ro[0]), tuple(ro[1]))
        if key not in table:
            blocks = self._exit_blocks.get(id(ro[0]))
            if blocks is None or blocks[0] is not ro[0]:
                proj = getattr(ro[0], "state_proj", None)   # an exit's copy of C (none: a zero descriptor)
                blocks = self._exit_blocks[id(ro[0])] = (ro[0], (L.TlBlock * len(ro[0].coda))(
                    *(self._block(b) for b in ro[0].coda)),
                    linear_desc(proj, self.keep) if proj is not None else L.TlLinear())
                self._pack(_linears(blocks[1]))
            slots = (ctypes.c_int32 * len(ro[1]))(*ro[1])
            keep.append(slots)
            table[key] = (len(table) + 1, L.TlReadout(len(ro[0].coda), blocks[1], slots, blocks[2]))
        return table[key][0]

    def _set_readouts(self, readouts: dict) -> None:
        """The call's read-out list (`_readout`'s table, in index order) into the model descriptor."""
        arr = (L.TlReadout * max(1, len(readouts)))(*(v[1] for v in sorted(readouts.values(), key=lambda v: v[0])))
        self.desc.readouts, self.desc.n_readouts = arr, len(readouts)

    def _grow_scratch(self, need: int) -> None:
        if self.scratch.numel() < need:
            self.scratch = torch.empty(int(need * 1.25) + 4096, dtype=torch.float32)

    def run(self, kv, rows: list) -> list:
        """Run the supported ones of a step's `Rows` over the pool `kv`; returns the others."""
        ok = [self.supports(r) for r in rows]
        if any(ok):
            self.decode(kv, [r for r, o in zip(rows, ok) if o])
        return [r for r, o in zip(rows, ok) if not o]

    def decode(self, kv, rows) -> None:
        """Supported `Rows` (rows from tokens first): each gets `hidden` (n, dim) after its read-out, and
        `out_state` when it asks for it."""
        with _CALL:   # one call at a time: the descriptors and the scratch are shared (engine cores per thread)
            self._decode(kv, rows)

    def _decode(self, kv, rows) -> None:
        rows = sorted(rows, key=lambda r: r.tokens is None)       # stable: rows from tokens first
        dim = self.model.cfg.dim
        M = sum(r.n for r in rows)
        max_pos = max(r.start + r.n - 1 for r in rows)
        if max_pos >= self.desc.rope_len:
            self._rope(max_pos + 1)
        keep, readouts = [], {}
        crow = (L.TlRow * M)()
        hidden = torch.empty(M, dim, dtype=torch.float32)
        i = 0
        for r in rows:
            t = _int64(r.table)
            keep.append(t)
            ro = self._readout(r.readout, readouts, keep)
            if r.state is not None:
                e, h = (x.float().contiguous() for x in r.state)
                keep += [e, h]
            if r.capture:
                oe, oh = torch.empty(r.n, self.model.loop_input_width), torch.empty(r.n, dim)
                r.out_state = (oe, oh)
            if r.tokens is not None:
                tokens = r.tokens.tolist() if isinstance(r.tokens, torch.Tensor) else r.tokens
                h0 = self._initial_states(r, keep)
            tree = None if r.tree_mask is None else _tree_keys(r, keep)
            for j in range(r.n):
                c = crow[i + j]
                c.pos, c.loops, c.window, c.first_loop, c.readout = r.start + j, r.last_loop, r.window, r.first_loop, ro
                if tree is not None:
                    c.pos, c.store, c.tree_base = tree[0][j], r.start + j, tree[1]
                    c.tree_n, c.tree_keys, c.tree_pos = tree[2][j]
                c.table, c.stride, c.n_blocks = t.data_ptr(), t.shape[1], t.shape[0]
                if r.tokens is not None:
                    c.token = tokens[j]
                    if h0 is not None:
                        c.state_h = h0[j].data_ptr()
                else:
                    c.state_e, c.state_h = e[j].data_ptr(), h[j].data_ptr()
                if r.capture:
                    c.out_e, c.out_h = oe[j].data_ptr(), oh[j].data_ptr()
                if r.exit_rule is not None:
                    c.exit_kind, c.min_loops = L.TL_EXIT[r.exit_rule.criterion], r.exit_rule.min_loops
                    c.threshold, c.survival = r.exit_rule.threshold, r.exit_survival
            i += r.n
        if any(r.exit_rule is not None and r.exit_rule.criterion == "gate" for r in rows):
            self._gate()
        self._set_readouts(readouts)
        kvd = self._kv_desc(kv)
        self._grow_scratch(self.lib.tl_scratch_floats(self.desc, M, max_pos + 1))
        self.lib.tl_set_threads(self.threads)
        rc = self.lib.tl_decode(self.desc, kvd, crow, M, hidden.data_ptr(), self.scratch.data_ptr(),
                                self.scratch.numel())
        if rc != 0:
            raise RuntimeError(f"native decode step failed (code {rc})")
        act = self.model.act_dtype or self.model.embed.weight.dtype
        if act != torch.float32:
            hidden = hidden.to(act)
        i = 0
        loops = 0
        for r in rows:
            if r.readout is not None:
                r.hidden = hidden[i:i + r.n]
            if r.capture and act != torch.float32:
                r.out_state = tuple(x.to(act) for x in r.out_state)
            if r.exit_rule is not None:   # adaptive depth: the loops it ran (the runner reports them)
                r.last_loop, r.exit_survival = crow[i].loops_run, crow[i].survival
            loops += r.n * (r.last_loop - r.first_loop)
            i += r.n
        self.model.core_loop_tokens += loops

    def _initial_states(self, r, keep: list) -> torch.Tensor | None:
        """The states loop 0 starts from for a row's positions where the model draws them at random
        (`state_seed`: model/looped.py init_state, by position, in the activations' dtype as the PyTorch path
        has them); None where it starts from zeros or from e (the library's own rule)."""
        m = self.model
        if not m.random_start:
            return None
        act = m.act_dtype or m.embed.weight.dtype
        h0 = m.init_state(torch.zeros(1, r.n, m.cfg.dim, dtype=act), r.positions)[0].float().contiguous()
        keep.append(h0)
        return h0

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head of rows x (..., dim) (`LoopedTransformer.logits`): fp32 logits (..., n)."""
        x2 = x.reshape(-1, self.head.k).float().contiguous()
        y = torch.empty(x2.shape[0], self.head.n, dtype=torch.float32)
        self._head(x2, y, None)
        return y.reshape(*x.shape[:-1], self.head.n)

    def argmax(self, x: torch.Tensor, noise: list | None = None) -> list[int]:
        """`LoopedTransformer.greedy_tokens`: the argmax over the vocabulary of each row of x (T, dim)'s logits,
        fused into the head call (the logits stay in a scratch buffer); a row whose noise[i] is (key, 1 / T,
        top_k, top_p) is drawn instead (`tl_draw`; 1 / T = 0: the argmax), and with a fifth entry, a grammar's
        `Matcher`, over the tokens its bitmask allows (read when the head runs: its fill overlaps the loops)."""
        x2 = x.reshape(-1, self.head.k).float().contiguous()
        ids = torch.empty(x2.shape[0], dtype=torch.int32)
        with _CALL:
            if self._head_buf.numel() < x2.shape[0] * self.head.n:
                self._head_buf = torch.empty(x2.shape[0] * self.head.n, dtype=torch.float32)
            self._head(x2, self._head_buf, ids, noise)
        return ids.tolist()

    def project(self, x: torch.Tensor, w) -> torch.Tensor:
        """x (..., k) @ w (n, k)^T for a draft head's rows (float, read as stored, or int8 rows of the head:
        `draft_head._QuantRows`): fp32 (..., n)."""
        return _forward(_draft_desc(w, []), x, self.threads)

    def _head(self, x2: torch.Tensor, y: torch.Tensor, ids: torch.Tensor | None, noise: list | None = None) -> None:
        M, k = x2.shape
        scratch = torch.empty(2 * M * k + M * (k // 8) + 16, dtype=torch.float32)
        draws = None
        if noise is not None:   # (key, 1 / T, top_k, top_p[, matcher]) per row, None: the argmax
            draws = (L.TlSampling * M)(*[L.TlSampling(0, 0.0, 0, 1.0) if z is None else
                                         L.TlSampling(*z[:4], z[4].bitmask() if len(z) > 4 else None)
                                         for z in noise])
        with _CALL:
            self.lib.tl_set_threads(self.threads)
            rc = self.lib.tl_head(self.head, x2.data_ptr(), M, self.head_norm, self.head_eps,
                                  self.model.cfg.vocab_size, y.data_ptr(), None if ids is None else ids.data_ptr(),
                                  scratch.data_ptr(), draws, self.model.cfg.logit_softcap)
        if rc != 0:
            raise RuntimeError(f"native LM head failed (code {rc})")


def _tree_keys(r, keep: list) -> tuple[list[int], int, list[tuple[int, int, int]]]:
    """A tree-masked `Rows` for the native rows: each row's real position, the storage index the tree's
    keys start at (its last S keys, S = tree_mask's columns), and per row (count, storage indices, real
    positions) of the node keys it sees."""
    S = r.tree_mask.shape[1]
    base = r.end - S
    kpos = r.tree_key_positions.to(torch.int32)
    per_row = []
    for j in range(r.n):
        cols = r.tree_mask[j].nonzero().flatten()
        idx = (cols + base).to(torch.int32).contiguous()
        pos = kpos[cols].contiguous()
        keep += [idx, pos]
        per_row.append((len(cols), idx.data_ptr(), pos.data_ptr()))
    return r.positions.tolist(), base, per_row


def _linears(blocks) -> list:
    """The linear layers' descriptors of block descriptors, in order (references into them; a family's own
    block's own layers after the shared fields, and none of a sublayer it does not have)."""
    return [d for b in blocks for d in (*b.qkv[:b.n_qkv], b.wo, *b.up[:b.n_up], b.down, *own_linears(b)) if d.n]


def _pack_later(ref, todo: list) -> None:
    """`NativeExecutor._pack`'s background packing: each layer's packed copy is made outside the call lock
    (the model serves from the mapped codes meanwhile), then pointed at under it, between two native calls; the
    mapped codes are advised cold (`layers.cold`: reclaimable first, never dropped). The thread runs at a lower
    priority than serving; it stops if the executor goes (the model unloaded)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):   # (not Linux, or not allowed: at the same priority)
        pass
    for d in todo:
        ex = ref()
        if ex is None:
            return
        buf = packed_int4(d)
        if buf is None:
            return
        with _CALL:
            ex.keep.append(buf)
            d.packed = buf.data_ptr()
        cold(d.w, d.n * d.k // 2)
        del ex
    ex = ref()
    if ex is not None:
        with _CALL:
            ex._stop_streaming()
