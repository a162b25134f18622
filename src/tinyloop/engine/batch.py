"""The batched runner: turn a scheduler step into the model's rows, run them, return logits; and the engine's
one runner of native work.

It builds step metadata only (which tokens, at which positions, through which pages, with how many
loops) and calls `LoopedTransformer.run`; the model owns every piece of the forward pass and the paged
pool (`model.paged`) owns where keys go and which keys each row sees. Speculative sequences add their
own `Rows` (a draft step, a verification) to the same step, or a whole round that the native
executor runs in one call (`native_rounds.NativeRound`, `NativeSteps`, `NativeTreeRound`: work items whose
fields the speculator fills; `run_round` runs them).

`BatchRunner` is the only engine object that runs native code, and the only importer of `engine/native.py` (the
one module that names the model's executor): the step's rows and head, the whole rounds, a lone sequence's tokens
in one call (`lone_steps`, for `fast_steps`), the tokens the head picks itself (`head_tokens`), a draft head's
logits over its rows (`Rows.draft`), the head's cost by rows that a round's verification is chunked by, and the
library's row draw (`draw_row`, handed to the core's Samplers). Other modules ask it whether native code runs
(`natively`) and hand it work; the `Engine` calls its static methods to attach the executor at load and let it go.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model import LoopedTransformer
from ..model.paged import PagedKV, PagedStep, Rows
from . import native, native_rounds as items
from .draft_policy import due, head_chunk
from .native_rounds import NativeRound, NativeSteps, NativeTreeRound
from .sampling import draw_row, score_tokens
from .scheduler import ScheduledChunk

SCORE_ROWS = 128  # prompt positions per LM-head call when scoring a prompt


def cache_dtype(model: LoopedTransformer) -> torch.dtype:
    """The float dtype KV is kept in: the weights' float dtype (float32 for quantized weights)."""
    p = next(model.parameters())
    return p.dtype if p.dtype.is_floating_point else torch.float32


class BatchRunner:
    def __init__(self, model: LoopedTransformer, kv: PagedKV):
        self.model = model
        self.kv = kv
        self.device = next(model.parameters()).device
        self.last_argmax: dict[int, int] = {}          # {seq_id: token} of the last step's greedy sequences
        self.last_loops: dict[int, int] = {}  # seq_id -> core loops its last row ran (adaptive depth)
        self.last_scores: dict[int, tuple[int, list]] = {}  # prompt log-probabilities of the last step (`execute`)
        self.last_hidden: dict[int, tuple[int, torch.Tensor]] = {}  # embedding sequences' states of the last step
        # called as a long op without the GIL starts: the forward when the native executor runs it, the LM
        # head (see server/worker.py)
        self.before_forward = None
        self.before_head = None

    def table(self, seq) -> torch.Tensor:
        """The sequence's pages as (blocks, slots) in the one-slot-per-loop order the model addresses; a
        loop-shared budget (`slot_cols`) maps several loops to one column. Kept on the sequence until its
        block table changes (the scheduler appends blocks, or replaces the last one or the whole table: the
        key holds the lists themselves, so that a changed table is never mistaken for the cached one)."""
        bt = seq.block_table
        last = bt[-1] if bt else None
        hit = getattr(seq, "_table_cache", None)
        if hit is not None:
            (c_bt, c_len, c_last, c_cols), table = hit
            if c_bt is bt and c_len == len(bt) and c_last is last and c_cols is seq.slot_cols:
                return table
        table = torch.tensor(bt, device=self.device)
        table = table if seq.slot_cols is None else table[:, seq.slot_cols]
        seq._table_cache = ((bt, len(bt), last, seq.slot_cols), table)
        return table

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], copies: list[tuple[int, int]] = (),
                extra: list[Rows] = (), score: dict[int, int] | None = None,
                greedy: frozenset[int] | set[int] | dict = frozenset(),
                embed: frozenset[int] | set[int] = frozenset()) -> dict[int, torch.Tensor]:
        """Run the chunks (and `extra` rows, whose results land in them); returns {seq_id: logits (V,)}
        for each chunk that needs logits, except the sequences in `greedy`, whose next token is the plain
        argmax: `last_argmax` gets {seq_id: token} for those (`LoopedTransformer.greedy_tokens`: the native
        executor keeps their logits to itself); a dict maps a sequence to its draw's parameters (key, 1 / T, top_k,
        top_p), or None for the argmax (engine/sampling.py `draw_row`). `score`: {seq_id: alternatives} of sequences whose prompt is
        scored (SamplingParams.prompt_logprobs): their chunks' prompt positions go through the LM head
        too, and `last_scores` gets {seq_id: (index of the first prompt token scored, [(logprob, alts)])}.
        `embed`: sequences of embedding requests (engine/embedding.py): no logits; `last_hidden` gets
        {seq_id: (chunk start, (n, dim) states)}, the coda's output through the final norm (what the head reads)."""
        self.kv.copy_pages(list(copies))
        self.last_scores = {}
        self.last_hidden = {}
        # adaptive depth applies to generated tokens (one-row chunks past the prompt); prompts run the ceiling
        rows = [Rows(table=self.table(c.seq), start=c.start, n=c.n,
                     last_loop=c.seq.loops, tokens=c.token_ids, window=c.seq.window, tag=c,
                     exit_rule=c.seq.exit_rule if c.n == 1 and c.start >= len(c.seq.prompt) else None)
                 for c in chunks]
        rounds = [x for x in extra if not isinstance(x, Rows)]   # speculation rounds run whole (NativeRound)
        everything = rows + [x for x in extra if isinstance(x, Rows)]
        if rounds and self.before_forward is not None and not everything:
            self.before_forward()
        for r in rounds:
            self.run_round(r)
        if not everything:
            self.last_loops, self.last_argmax = {}, {}
            return {}
        m = self.model
        # rows starting from tokens first, deepest first: the rows still looping at loop r are a prefix
        order = sorted(everything, key=lambda r: (r.first_loop, -r.last_loop))
        step = PagedStep(self.kv, order, m.rotary, m.act_dtype or m.embed.weight.dtype, self.device)
        if self.before_forward is not None:
            self.before_forward()
        m.run(step)
        self.last_loops = {r.tag.seq.seq_id: r.last_loop for r in rows}
        want = [r for r in rows if r.tag.needs_logits and r.tag.seq.seq_id not in embed]
        out, self.last_argmax = {}, {}
        also = [r for r in everything[len(rows):] if r.greedy]   # speculators' plain rows: the same head call
        if (want or also) and self.before_head is not None:
            self.before_head()
        quick = [r for r in want if r.tag.seq.seq_id in greedy]
        if quick or also:
            noise = [greedy.get(r.tag.seq.seq_id) if isinstance(greedy, dict) else None for r in quick] + \
                [r.noise for r in also]
            toks = self.head_tokens(torch.stack([r.hidden[-1] for r in quick + also]), noise)   # (k, dim) -> k tokens
            self.last_argmax = {r.tag.seq.seq_id: t for r, t in zip(quick, toks)}
            for r, t in zip(also, toks[len(quick):]):
                r.argmax = t
        for r in everything[len(rows):]:
            if r.draft is not None:
                r.draft_logits = self.draft_logits(r.draft, r.hidden)
        want = [r for r in want if r.tag.seq.seq_id not in greedy]
        if want:
            hidden = torch.stack([r.hidden[-1] for r in want])                   # (k, dim)
            logits = m.logits(hidden[None])[0]                                     # (k, V)
            out = {r.tag.seq.seq_id: logits[i] for i, r in enumerate(want)}
        for r in rows:
            if score and r.tag.seq.seq_id in score:
                self._score(r.tag, r.hidden, score[r.tag.seq.seq_id])
            if embed and r.tag.seq.seq_id in embed:
                self.last_hidden[r.tag.seq.seq_id] = (r.start, m.final_norm(r.hidden).float())
        return out

    def _score(self, chunk: ScheduledChunk, hidden: torch.Tensor, top: int) -> None:
        """Prompt log-probabilities of a chunk: the row at position p scores prompt token p + 1 (the last
        prompt position predicts the first generated token, which the sampler handles)."""
        prompt = chunk.seq.prompt
        n = min(chunk.n, len(prompt) - 1 - chunk.start)   # rows whose next token is still in the prompt
        if n <= 0:
            return
        vocab = self.model.cfg.vocab_size
        targets = torch.tensor(prompt[chunk.start + 1:chunk.start + 1 + n], device=self.device)
        entries = []
        for i in range(0, n, SCORE_ROWS):                  # bounded memory: SCORE_ROWS x vocab floats at a time
            logits = self.model.logits(hidden[None, i:min(n, i + SCORE_ROWS)])[0, :, :vocab]   # (t, V)
            entries += score_tokens(logits, targets[i:i + SCORE_ROWS], top)
        self.last_scores[chunk.seq.seq_id] = (chunk.start + 1, entries)

    # -- native work ------------------------------------------------------------------------------------------
    @property
    def natively(self) -> bool:
        """Whether the native executor runs the model (False: the PyTorch path serves it)."""
        return native.runs_natively(self.model)

    @property
    def streamed(self) -> bool:
        """Whether the executor reads the weights from memory each pass (a model larger than the cache)."""
        return self.natively and native.streamed(self.model)

    # -- the executor's life (Engine.load / release, the Engine's questions): no runner needed yet -------------
    @staticmethod
    def loading_for(executor: str | None):
        """The context a model is loaded in for `executor` ("native", "torch", None: the setting)."""
        return native.loading_for(executor)

    @staticmethod
    def attach(model: LoopedTransformer, executor: str | None = None) -> None:
        """Prepare a loaded model for decoding, the native executor attached where it runs the model."""
        native.attach(model, executor)

    @staticmethod
    def detach(model: LoopedTransformer) -> None:
        """Let go of the model's native executor (an unloaded model's memory freed at once)."""
        native.detach(model)

    @staticmethod
    def executor_name(model: LoopedTransformer) -> str:
        """Who runs the model's decode rows: "native (...)" or "torch"."""
        return native.name(model)

    @staticmethod
    def executor_bytes(model: LoopedTransformer) -> int:
        """Bytes of the weights' copies the native executor holds beside the model's tensors."""
        return native.copy_bytes(model)

    @staticmethod
    def weights_stay_in_cache(weight_bytes: int) -> bool:
        """Whether a model reading `weight_bytes` of weights a token is served as staying in cache."""
        return native.stays_in_cache(weight_bytes)

    @staticmethod
    def draw_row(x: torch.Tensor, key: int, inv_temp: float, top_k: int = 0, top_p: float = 1.0,
                 ids: torch.Tensor | None = None) -> int:
        """`sampling.draw_row`, computed by the native library where it is loaded (`tl_draw`: the same noise bit for
        bit, ~20x faster; no model, weights or pool): the row draw the engine core hands its Samplers."""
        got = native.draw(x, ids, key, inv_temp, top_k, top_p)
        return got if got is not None else draw_row(x, key, inv_temp, top_k, top_p, ids)

    @staticmethod
    def one_thread():
        """The context the step's per-row sampling runs in: one torch thread (`native.one_thread`)."""
        return native.one_thread()

    def python_between_calls(self):
        """The context a speculator's set-up and its Python between native passes run in
        (`native.python_between_calls`: the torch threads that Python keeps where the executor runs the passes)."""
        return native.python_between_calls(self.model)

    def head_tokens(self, x: torch.Tensor, noise: list | None = None) -> list[int]:
        """Each row of x (T, dim) through the head: its argmax, or where noise[i] is (key, 1 / T, top_k, top_p)
        its draw (1 / T = 0: the argmax), over the tokens a grammar allows where a fifth entry is its matcher
        (`Sampler.head_pick`). The native executor does all of it inside the head call (the logits stay there);
        the PyTorch path draws with `draw_row` over the (masked) logits."""
        m = self.model
        if noise is None or all(z is None for z in noise):
            return m.greedy_tokens(x)
        if self.natively:
            return native.head_argmax(m, x, noise)
        lg = m.logits(x)[..., :m.cfg.vocab_size].reshape(-1, m.cfg.vocab_size)
        out = []
        for i, z in enumerate(noise):
            row = lg[i] if z is None or len(z) < 5 else z[4].apply(lg[i])
            out.append(int(row.argmax()) if z is None or not z[1] > 0 else self.draw_row(row, *z[:4]))
        return out

    def draft_logits(self, head, x: torch.Tensor) -> torch.Tensor:
        """A draft head's logits (engine/draft_head.py `DraftHead`) for x (T, dim), the draft rows' coda output:
        (T, n) over its draft vocabulary, through its rows as the executor reads them (`native_rows`: the int8
        rows of the model's head where it has them) or, on the PyTorch path, its float rows."""
        xn = head.norm(x)
        if self.natively:
            return native.project(self.model, xn, head.native_rows())
        return F.linear(xn.to(head.weight.dtype), head.weight[: head.n])

    def prepare(self, spec) -> None:
        """Before a speculator's first round is timed: the head's cost by rows its chain rounds' verification is
        chunked by (`chunk`), measured once per model and host (kept beside the library: `NativeExecutor.
        head_costs`; inside a round the measurement made that round's cost, by which the policy ranks draft
        lengths, tens of ms too high), and its new cost tables started from what an earlier process on this host
        kept (`draft_policy.round_costs`, `RoundCosts.restore`)."""
        if not spec.native:
            return
        if spec.plan.draft_ahead > 0:
            native.head_costs(self.model, max(spec.plan.draft_ahead, spec.plan.draft_run) + 1)
        for costs in spec.policy.tables.values():
            if costs.to_restore:
                costs.to_restore = False
                kept = native.kept_round_costs(self.model, costs.setting)
                if kept is not None:
                    costs.restore(kept)
                    spec.policy.prime()

    def finish(self, spec) -> None:
        """A speculative request's end: the model's round costs kept for the next process on this host, where due
        (`draft_policy.due`: at most once per KEEP_EVERY seconds a table)."""
        if spec.native:
            for setting, kept in due(self.model):
                native.keep_round_costs(self.model, setting, kept)

    def chunk(self, spec, n: int) -> int:
        """Verification rows per head call among n, for the request's acceptance and what the head costs by rows on
        this host: draft_policy.head_chunk."""
        return head_chunk(native.head_costs(self.model, n), spec.policy.acceptance, n)

    def run_round(self, r: NativeRound) -> None:
        """A whole round in one native call; its `result` filled for the speculator: plain rounds back to back
        (`NativeSteps`: `NativeExecutor.generate`), a tree round (`NativeTreeRound`: `tree_round`), or a chain or
        pipeline round (`NativeRound`: `spec_round`)."""
        sp, kv = r.spec, self.kv
        if isinstance(r, NativeSteps):
            r.result, _ = native.generate(self.model, kv, sp.table, sp.plan.window, sp.pending, sp.length, sp.V, None,
                                          r.k, items.noise(sp), items.stop_ids(sp))
            return
        head, drafts = sp.head, r.k > 0
        rows = None if head.ids is None or not drafts else head.native_rows()   # (None: the model's head, whole)
        ids = None if head.ids is None or not drafts else head.ids[: head.n]
        if isinstance(r, NativeTreeRound):
            r.result = native.tree_round(
                self.model, kv, sp.table, sp.plan.window, sp.pending, sp.length, r.k, sp.K, sp.d, sp.V,
                sp.draft_readout, sp.exit_readout, rows, ids, items.draft_norm(sp), noise=items.noise(sp),
                head_rows=r.head_rows(self.chunk(sp, r.k + 1)))
            return
        n = (min(r.k + 1, items.PIPELINE_HEAD) if sp.pipeline else r.k + 1) if drafts else 0
        r.result = native.spec_round(
            self.model, kv, sp.table, sp.plan.window, sp.pending, sp.length, r.k, sp.d, sp.V, sp.draft_readout,
            rows, ids, items.draft_norm(sp) if drafts else None,
            sp.exit_backlog, want_state=sp.exit is not None, pipeline=sp.pipeline, noise=items.noise(sp),
            ahead=sp.plan.draft_ahead, head_rows=r.head_rows(self.chunk(sp, n) if drafts else 2), rounds=r.rounds,
            stop=items.stop_ids(sp) if r.rounds > 1 else ())

    def supports(self, row: Rows) -> bool:
        """Whether the executor runs this row (a lone sequence's steps: `lone_steps`)."""
        return self.natively and native.supports(self.model, row)

    def lone_steps(self, seq, start: int, steps: int, noise: tuple | None, stop: list[int], grammar=None):
        """A sequence decoding alone: `steps` plain tokens from position `start` in one native call
        (`tl_generate`; engine/fast_steps.py says when). Returns the tokens and the core loops each step ran."""
        if self.before_forward is not None:
            self.before_forward()
        return native.generate(self.model, self.kv, self.table(seq), seq.window, seq.tokens[start], start, seq.loops,
                               seq.exit_rule, steps, noise, stop, grammar)
