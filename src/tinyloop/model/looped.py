"""The weight-shared looped transformer: prelude once -> core x loops -> coda once -> LM head.

This module owns the model's one forward. Its pieces (`embed_prelude`, `core_loop`, `run_coda`, `logits`)
take a step context that says where keys go and which keys each query sees: `layers.StepContext`
over a contiguous `KVCache` (or none: training, evaluation) or a `paged.PagedView` of a step over the
serving pool. `forward` runs one (B, T) block through all of them; `run` runs a serving step: many
sequences' rows packed together, each with its own loops (a row leaves after its last loop), positions,
starting point (tokens, or a draft's states after loop d-1) and read-out.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from .cache import KVCache, SlotLayout
from .exits import gate_survival, kl_divergence, should_exit
from .paged import PagedStep, Rows
from .families import own_blocks
from .layers import Block, DiagonalInjection, RMSNorm, Rotary, StepContext, init_weights, l2norm, linear_as


class LoopedTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        ve = set(cfg.value_embeds)   # blocks numbered prelude, core, coda
        P, C = cfg.n_prelude, cfg.n_core
        own = own_blocks(cfg)   # a family whose blocks are its own (`model.families`), or None
        if own is not None and own.check is not None:
            own.check(cfg)   # (its own scalars: ModelConfig.family_params)
        # nGPT: the state lives on the unit sphere (loops enter as l2norm(state + e) and end with l2norm)
        self.sphere = cfg.ngpt

        def make(b: int) -> nn.Module:
            return own.block(cfg, b) if own is not None else Block(cfg, b in ve)
        self.prelude = nn.ModuleList(make(i) for i in range(P))
        self.core = nn.ModuleList(make(P + j) for j in range(C))
        self.coda = nn.ModuleList(make(P + C + i) for i in range(cfg.n_coda))
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(cfg.vocab_size, cfg.n_kv_heads * cfg.head_dim)
                                           for i in cfg.value_embeds}) if ve else None
        # The core's and coda's value embeddings ride in the loop input e after its first dim columns (looked
        # up once, with the prelude, from the tokens): a draft's (e, h) state carries them to later loops.
        kv = cfg.n_kv_heads * cfg.head_dim
        self.ve_cols = {i: cfg.dim + n * kv for n, i in enumerate(i for i in cfg.value_embeds if i >= P)}
        self.loop_input_width = cfg.dim + len(self.ve_cols) * kv
        self.prelude_norm = RMSNorm(cfg.dim, cfg.norm_eps) if cfg.prelude_norm else None
        self.core_norm = RMSNorm(cfg.dim, cfg.norm_eps) if cfg.loop_norm else None  # ends every loop
        self.adapter = nn.Linear(2 * cfg.dim, cfg.dim, bias=False) if cfg.injection == "concat-adapter" else None
        self.injection = DiagonalInjection(cfg.dim) if cfg.injection == "diagonal" else None
        self.state_proj = nn.Linear(cfg.dim, cfg.dim, bias=False) if cfg.state_proj else None  # after the loops
        # the final norm: before the head (head_norm) and/or ending the recurrence (post_loop_norm)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps) if cfg.head_norm or cfg.post_loop_norm else None
        self.exit_gate = nn.Linear(cfg.dim, 1, bias=True) if cfg.exit_gate else None  # read by adaptive depth
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # blocks on the sphere: the logits are scaled per token by logit_scale / the family's divisor
        self.logit_scale = nn.Parameter(torch.ones(cfg.vocab_size)) if cfg.ngpt else None
        self.logit_divisor = own.logit_divisor(cfg) if own is not None and own.logit_divisor is not None else 1.0
        alt = Rotary(cfg.head_dim, cfg.rope_theta_2, (), cfg.rotary_dim_2) if 2 in cfg.rope_profile else None
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_llama3, cfg.rotary_dim, alt)
        self.core_loop_tokens = 0  # core-loop evaluations x tokens, counted (tests check draft reuse)
        # Set by model.fast.prepare_for_decode: the dtype activations run in (None: the embedding's) and a
        # module computing the LM head (None: F.linear with head_weight).
        self.act_dtype: torch.dtype | None = None
        self.head_linear: nn.Module | None = None
        self.decode_threads: int | None = None  # torch threads for one-token forward calls (None: as set)
        # With a seed (and cfg.state_init_std > 0) every token's recurrence starts from a random state drawn
        # by the family's rule from a generator seeded by (seed, position): a token's state depends on its
        # position only, so cached decoding, batching and speculation see the same states. None: zeros.
        self.state_seed: int | None = None
        # Set by model.fast.prepare_for_decode: the native executor (`kernels/`) that runs the one-token rows
        # of a serving step it supports in one call (None: every row runs here, in PyTorch).
        self.executor = None

    def init_weights(self, seed: int | None = None) -> "LoopedTransformer":
        gen_state = torch.random.get_rng_state()
        if seed is not None:
            torch.manual_seed(seed)
        n_layers = self.cfg.n_prelude + self.cfg.n_coda + self.cfg.n_core * self.cfg.default_loops
        own = own_blocks(self.cfg)
        if own is not None and own.init is not None:
            own.init(self)
        else:
            init_weights(self, n_layers)
        if seed is not None:
            torch.random.set_rng_state(gen_state)
        return self

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def slot_layout(self, loops: int | None = None) -> SlotLayout:
        """The cache slot of each layer at `loops` (default: the deepest), as the paged pool numbers them (what
        the native executor's descriptors are told, without importing model/)."""
        return SlotLayout(self.cfg, self.cfg.max_loops if loops is None else loops)

    @contextlib.contextmanager
    def _decode_threads(self, n_rows: int):
        """One-row calls (decode steps) on `decode_threads` torch threads; bigger ones keep every thread."""
        n = self.decode_threads
        if n is None or n_rows != 1 or torch.get_num_threads() == n:
            yield
            return
        prev = torch.get_num_threads()
        torch.set_num_threads(n)  # ~0.5 us a switch
        try:
            yield
        finally:
            torch.set_num_threads(prev)

    # -- pieces ---------------------------------------------------------------------------
    def context(self, T: int, *, cache: KVCache | None = None, start: int = 0,
                positions: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None) -> StepContext:
        device = self.embed.weight.device
        if positions is None:
            positions = torch.arange(start, start + T, device=device)
        dtype = self.act_dtype or self.embed.weight.dtype
        return StepContext(rotary=self.rotary, positions=positions, dtype=dtype,
                           cache=cache, start=start, tree_mask=tree_mask)

    def embed_prelude(self, tokens: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """tokens: (B, T) -> e: (B, T, loop_input_width), the input every loop receives: the prelude's
        output (dim wide), then the value embeddings of the core's and coda's blocks that have them."""
        x = self.embed(tokens)
        if self.act_dtype is not None:
            x = x.to(self.act_dtype)
        if self.cfg.embed_scale != 1.0:
            x = x * self.cfg.embed_scale
        for i, blk in enumerate(self.prelude):
            ve = self.value_embeds[str(i)](tokens) if self.value_embeds is not None and blk.attn.ve_gate is not None \
                else None
            x = blk(x, ctx, ctx.slots.prelude(i) if ctx.slots is not None else None, ve)
        if self.prelude_norm is not None:
            x = self.prelude_norm(x)
        if self.ve_cols:
            x = torch.cat([x] + [self.value_embeds[str(i)](tokens).to(x.dtype) for i in self.ve_cols], dim=-1)
        return x

    def _ve(self, e: torch.Tensor | None, block: int) -> torch.Tensor | None:
        """Block `block`'s value embeddings from the loop input e (None: the block has none)."""
        c = self.ve_cols.get(block)
        if c is None:
            return None
        if e is None:
            raise ValueError(f"block {block} adds value embeddings: pass the loop input e")
        return e[..., c:c + self.cfg.n_kv_heads * self.cfg.head_dim]

    @property
    def random_start(self) -> bool:
        """Whether loop 0 starts from the family's random draw (`init_state`): a seed, a spread, an injection,
        and the state (not e) as the start."""
        return (self.state_seed is not None and self.cfg.state_init_std != 0 and self.cfg.injection != "none"
                and self.cfg.loop_start == "state")

    def init_state(self, e: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The state loop 0 starts from: e itself (no injection, or `loop_start` "embed" / "skip"), else
        zeros, or with `state_seed` the family's random rule per position (`positions` (T,) of e's (B, T, dim)
        rows; default 0..T-1)."""
        from_e = self.cfg.injection == "none" or self.cfg.loop_start != "state"
        if e.shape[-1] != self.cfg.dim:   # value embeddings ride along (`ve_cols`): the state is the first dim
            e = e[..., :self.cfg.dim]
            if from_e:
                return e.clone()
        if from_e:
            return e
        if not self.random_start:
            return torch.zeros_like(e)
        std = self.cfg.state_init_std
        if positions is None:
            positions = torch.arange(e.shape[1])
        rows = []
        for p in positions.tolist():
            g = torch.Generator().manual_seed((self.state_seed * 1_000_003 + p) % 2**63)
            x = torch.empty(e.shape[-1], dtype=torch.float64)
            torch.nn.init.trunc_normal_(x, 0.0, std, -3 * std, 3 * std, generator=g)
            rows.append(x * self.cfg.embed_scale)
        return torch.stack(rows).to(e.dtype).to(e.device).expand_as(e).clone()

    def core_loop(self, h: torch.Tensor, e: torch.Tensor, loop_idx: int, ctx: StepContext) -> torch.Tensor:
        """One application of the shared core (loop `loop_idx`), writing that loop's cache slots."""
        full, e = e, e[..., :self.cfg.dim] if self.ve_cols else e
        if loop_idx == 0 and self.cfg.loop_start == "skip":
            x = e   # the first loop runs on the prelude output itself, without the injection
        elif self.sphere:
            x = l2norm(h + e).to(h.dtype)   # the sum back on the sphere
        elif self.cfg.injection == "add":
            x = h + e
        elif self.cfg.injection == "concat-adapter":
            x = self.adapter(torch.cat([h, e], dim=-1))
        elif self.cfg.injection == "diagonal":
            x = self.injection(h, e)
        else:
            x = h
        P = self.cfg.n_prelude
        for j, blk in enumerate(self.core):
            ve = self._ve(full, P + j) if self.ve_cols else None
            x = blk(x, ctx, ctx.slots.core(loop_idx, j) if ctx.slots is not None else None, ve)
        self.core_loop_tokens += h.shape[0] * h.shape[1]
        if self.sphere:
            return l2norm(x).to(x.dtype)
        return x if self.core_norm is None else self.core_norm(x)

    def run_coda(self, h: torch.Tensor, ctx, e: torch.Tensor | None = None) -> torch.Tensor:
        """The coda blocks (the final norm and head are `logits`); with `post_loop_norm` the final norm
        first ends the recurrence, with `state_proj` a projection of the state does. `e`, the loop input, is
        read only by coda blocks with value embeddings."""
        x = self.norm(h) if self.cfg.post_loop_norm else h
        if self.state_proj is not None:
            x = linear_as(self.state_proj, x)
        base = self.cfg.n_prelude + self.cfg.n_core
        for i, blk in enumerate(self.coda):
            ve = self._ve(e, base + i) if self.ve_cols else None
            x = blk(x, ctx, ctx.slots.coda(i) if ctx.slots is not None else None, ve)
        return x

    def coda_logits(self, h: torch.Tensor, ctx: StepContext, *, last_only: bool = False,
                    e: torch.Tensor | None = None) -> torch.Tensor:
        x = self.run_coda(h, ctx, e)
        if last_only:
            x = x[:, -1:]
        return self.logits(x)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The norm before the LM head (identity when the loop norm already ended the state)."""
        return self.norm(x) if self.cfg.head_norm else x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head: x (..., dim) -> logits (..., vocab, padded as the head is)."""
        if self.executor is not None:
            return self.executor.logits(x)   # the same, natively
        x = self.final_norm(x)
        if self.head_linear is not None:
            out = self.head_linear(x)
        else:
            w = self.head_weight   # 16-bit under fp32 activations when the native executor took the head: widened
            out = F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype))
        if self.logit_scale is not None:   # nGPT: per-token scales
            s = self.logit_scales(out.shape[-1], torch.promote_types(out.dtype, torch.float32))
            out = out.to(s.dtype) * s
        c = self.cfg.logit_softcap
        return out if c == 0 else c * torch.tanh(out / c)

    def logit_scales(self, rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The per-token factors `logits` multiplies by (logit_scale / logit_divisor, in `dtype`) for a head of `rows`
        outputs, a padded head's extra rows 1 (kept as they are); the native executor's head applies the same."""
        s = self.logit_scale.to(dtype) / self.logit_divisor
        return torch.cat([s, s.new_ones(rows - s.numel())]) if rows > s.numel() else s

    def greedy_tokens(self, x: torch.Tensor) -> list[int]:
        """The greedy token of each row of x (T, dim): the argmax of `logits` over the vocabulary (the first
        of equal maxima). The native executor fuses it into the head and keeps the logits to itself."""
        if self.executor is not None:
            return self.executor.argmax(x)
        return self.logits(x)[..., :self.cfg.vocab_size].argmax(dim=-1).reshape(-1).tolist()

    # -- whole pass -------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, loops: int | None = None, *, cache: KVCache | None = None,
                start: int = 0, last_only: bool = False) -> torch.Tensor:
        """tokens: (B, T) at positions start..start+T-1 -> logits (B, T or 1, vocab)."""
        loops = self.cfg.default_loops if loops is None else loops
        if not 1 <= loops <= self.cfg.max_loops:
            raise ValueError(f"loops must be in 1..{self.cfg.max_loops}, got {loops}")
        with self._decode_threads(tokens.shape[1]):
            ctx = self.context(tokens.shape[1], cache=cache, start=start)
            e = self.embed_prelude(tokens, ctx)
            h = self.init_state(e, ctx.positions)
            for r in range(loops):
                h = self.core_loop(h, e, r, ctx)
            return self.coda_logits(h, ctx, last_only=last_only, e=e)

    # -- a serving step ---------------------------------------------------------------------
    def run(self, step: PagedStep) -> None:
        """Run every sequence's rows of a paged step; results land in each `Rows` (`hidden`, `out_state`).

        Rows are in the step's order; each phase (prelude, loop r, each read-out) runs once over the
        sequences taking part, packed (a contiguous slice when they are adjacent, else gathered)."""
        if self.executor is not None:
            rest = self.executor.run(step.kv, step.rows)   # its rows are done; the rest (if any) run here
            if not rest:
                return
            if len(rest) < len(step.rows):
                step = PagedStep(step.kv, rest, self.rotary, self.act_dtype or self.embed.weight.dtype, step.device)
        with self._decode_threads(step.n):
            self._run(step)

    def _adaptive_exits(self, step: PagedStep, v, loop: int, h_in: torch.Tensor, h_out: torch.Tensor,
                        e_in: torch.Tensor | None = None) -> None:
        """Rows with an exit rule whose criterion holds after `loop` leave the step's later loops (their
        `last_loop` drops to loop + 1) and their skipped slots get the fallback keys (`model.exits`)."""
        live = [(i, r) for i, r in enumerate(v.members)
                if r.exit_rule is not None and r.n == 1 and r.last_loop > loop + 1]
        if not live:
            return
        by_rule: dict = {}
        for i, r in live:
            by_rule.setdefault(r.exit_rule, []).append((i, r))
        for rule, group in by_rule.items():
            idx = torch.tensor([v.local[i] for i, _ in group], device=h_in.device)
            survival = None
            if rule.criterion == "gate":  # the cumulative rule needs every loop's gate, checked or not
                g = self.exit_gate
                logit = F.linear(h_out[0, idx].double(), g.weight.double(), g.bias.double())[:, 0]
                prev = torch.tensor([r.exit_survival for _, r in group], dtype=torch.float64, device=h_in.device)
                survival = gate_survival(prev, logit)
                for (_, r), s in zip(group, survival.tolist()):
                    r.exit_survival = s
            kl = None
            if rule.needs_distribution_after(loop):  # the read-out on this loop's state: coda, norm, head
                members = [r for _, r in group]
                x = self.run_coda(h_out[:, idx], step.view(members), e_in[:, idx] if e_in is not None else None)
                logp = torch.log_softmax(self.logits(x)[0, :, :self.cfg.vocab_size].double(), dim=-1)
                prev = [r.exit_logp for r in members]
                kl = torch.full((len(members),), float("inf"), dtype=torch.float64)
                have = [i for i, p in enumerate(prev) if p is not None]
                if have:
                    kl[have] = kl_divergence(logp[have], torch.stack([prev[i] for i in have]))
                for r, lp in zip(members, logp):
                    r.exit_logp = lp
            if not rule.may_exit_after(loop):
                continue
            stop = should_exit(rule, h_in[0, idx], h_out[0, idx], survival, kl).tolist()
            for (_, r), s in zip(group, stop):
                if s:
                    step.fill_skipped(r, loop + 1, r.last_loop)
                    r.last_loop = loop + 1

    def _run(self, step: PagedStep) -> None:
        rows = step.rows
        N, dim = step.n, self.cfg.dim
        fresh = [r for r in rows if r.tokens is not None]
        e = h = None
        if fresh:
            fv = step.view(fresh)
            toks = torch.tensor([t for r in fresh for t in r.tokens], device=step.device)[None]
            e_f = self.embed_prelude(toks, fv)
            fresh_pos = torch.cat([r.positions for r in fresh]) if self.state_seed is not None else None
            if len(fresh) == len(rows):
                e = e_f
                h = self.init_state(e, fresh_pos)
                if h is e:
                    h = e.clone()  # h is updated in place below; e must stay
        if e is None:
            dtype = self.act_dtype or self.embed.weight.dtype
            e = torch.empty(1, N, self.loop_input_width, dtype=dtype, device=step.device)
            h = torch.empty(1, N, dim, dtype=dtype, device=step.device)
            if fresh:
                e = fv.put(e, e_f)
                h = fv.put(h, self.init_state(e_f, fresh_pos).clone())
            for r in rows:
                if r.state is not None:
                    e[0, r.row0:r.row0 + r.n] = r.state[0]
                    h[0, r.row0:r.row0 + r.n] = r.state[1]
        for loop in range(max(r.last_loop for r in rows)):
            members = [r for r in rows if r.first_loop <= loop < r.last_loop]
            if not members:
                continue
            v = step.view(members)
            h_in, e_in = v.take(h), v.take(e)
            h_out = self.core_loop(h_in, e_in, loop, v)
            self._adaptive_exits(step, v, loop, h_in, h_out, e_in)
            h = v.put(h, h_out)
            for r in members:
                if r.capture and loop == r.last_loop - 1:
                    r.out_state = (e[0, r.row0:r.row0 + r.n].clone(), h[0, r.row0:r.row0 + r.n].clone())
        readouts: dict[object, list[Rows]] = {}  # one call per read-out: the coda, each exit
        for r in rows:
            if r.readout is not None:
                key = "coda" if r.readout == "coda" else (id(r.readout[0]), tuple(r.readout[1]))
                readouts.setdefault(key, []).append(r)
        for members in readouts.values():
            v = step.view(members)
            ro = members[0].readout
            x = self.run_coda(v.take(h), v, v.take(e) if self.ve_cols else None) if ro == "coda" \
                else ro[0].blocks(v.take(h), v, ro[1])
            for r, a in zip(members, v.local):
                r.hidden = x[0, a:a + r.n]


def build_model(cfg: ModelConfig, *, seed: int | None = 0, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> LoopedTransformer:
    """A randomly initialised model (seeded) in `dtype` on `device`."""
    model = LoopedTransformer(cfg).init_weights(seed)
    return model.to(device=device, dtype=dtype).eval()
