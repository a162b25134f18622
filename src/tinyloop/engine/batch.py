"""The batched runner: turn a scheduler step into the model's rows, run them, return logits.

It builds step metadata only (which tokens, at which positions, through which pages, with how many
loops) and calls `LoopedTransformer.run`; the model owns every piece of the forward pass and the paged
pool (`model.paged`) owns where keys go and which keys each row sees. Speculative sequences add their
own `Rows` (a draft step, a verification) to the same step, or a whole greedy round that the native
executor runs in one call (`native_rounds.NativeRound`).
"""

from __future__ import annotations

import torch

from ..model import LoopedTransformer
from ..model.paged import PagedKV, PagedStep, Rows
from .sampling import head_tokens, score_tokens
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
            r.run(self.kv)
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
            toks = head_tokens(m, torch.stack([r.hidden[-1] for r in quick + also]), noise)   # (k, dim) -> k tokens
            self.last_argmax = {r.tag.seq.seq_id: t for r, t in zip(quick, toks)}
            for r, t in zip(also, toks[len(quick):]):
                r.argmax = t
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
