"""The engine core: many requests, one model, one KV pool, one batched forward pass per step.

    batch = BatchEngine(engine)
    req = batch.add(engine.plan(prompt_ids, params, n=2), emit)  # emit(StreamEvent | Exception | None)
    while batch.has_work:
        batch.step()                 # schedule -> one batched forward -> sample -> events

Every path runs through it: the server's engine thread, `Engine.generate`/`stream` (a batch of one),
the CLI. Each step batches the decode tokens of every running sequence, chunks of waiting prompts, and
the current pass of every speculative sequence (a prefill chunk, a draft step or a verification:
`speculative.Speculator.passes`), all as rows of one `LoopedTransformer.run` over the paged pool.
Every request keeps its own `Sampler` (seed, penalties, top-k/top-p), loops, stop strings and cache
window inside the batch. Speculative sequences are admitted under the same FIFO order, `max_num_seqs`
and KV memory as the others: their pages are pool pages, reserved whole at admission.

The core works on token ids. What an output's tokens mean to the caller (text, stop strings) is the
output stream's business (`engine.text`), made per output by `engine.open_stream`.

`emit` is called on the engine thread: StreamEvents (deltas; a final one per choice with finish_reason
and stats), an Exception if the request failed, and None once the request is over.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable

import torch

from ..errors import RequestTimeout, ValidationError
from ..model.cache import SlotLayout
from ..model.paged import PagedKV, Rows
from .batch import BatchRunner, cache_dtype
from .embedding import EmbeddingPlan, EmbeddingStream
from .knobs import SamplingParams
from .plan import RequestPlan
from .sampling import Sampler
from .fast_steps import FastSteps
from .scheduler import FORCED_TAIL, Scheduler, SchedulerError, Sequence, ring_blocks_for
from .native_rounds import NativeRound
from .requests import Emit, Output, Request
from .speculative import PREFILL_CHUNK, Speculator, speculative_layout
from .text import StreamEvent

log = logging.getLogger("tinyloop.engine")

DEFAULT_POOL_BYTES_CAP = 1 << 30        # the default pool: enough for max_num_seqs full contexts, at most 1 GiB


WARM_UP_TOKENS = 48   # the tokens of each warm-up request (BatchEngine.warm_up)


def sequence_layout(model, plan: RequestPlan, draft_exit: bool = True) -> SlotLayout:
    """The cache slots one sequence of `plan` uses (a speculative one adds its draft exit's)."""
    if plan.speculative:
        return speculative_layout(model, plan, draft_exit)
    return SlotLayout(model.cfg, plan.loops, kv_loops=plan.kv_loops)


def sequence_ring(layout: SlotLayout, window: int, n_positions: int, *, page_size: int, max_batched_tokens: int,
                  speculative: bool = False) -> dict[str, Any]:
    """A sequence's sliding-window ring (engine/scheduler.py), as `Sequence` fields: its windowed columns keep R
    blocks of pages when it can grow past R blocks (shorter ones keep every page). A step writes at most a
    chunk (`max_batched_tokens`, a grammar's forced tail after it; a speculative prefill `PREFILL_CHUNK`)."""
    windows = layout.windows(window)
    if not any(windows):
        return {}
    longest = max_batched_tokens + FORCED_TAIL
    if speculative:
        longest = max(longest, PREFILL_CHUNK)
    R = ring_blocks_for(max(windows), page_size, longest)
    if -(-n_positions // page_size) <= R:
        return {}
    return {"ring_cols": tuple(s for s, w in enumerate(windows) if w), "ring_blocks": R}


def plan_pages(model, plan: RequestPlan, *, page_size: int = 16, max_batched_tokens: int = 512,
               draft_exit: bool = True) -> int:
    """KV pages `plan` holds at its longest, every choice (a sliding-window column no more than its ring)."""
    layout = sequence_layout(model, plan, draft_exit)
    blocks = plan.blocks(page_size)
    ring = sequence_ring(layout, plan.window, plan.max_positions, page_size=page_size,
                         max_batched_tokens=max_batched_tokens, speculative=plan.speculative)
    return Scheduler.block_pages(Sequence(0, [], 0, layout.n_slots, **ring), 0, blocks) * plan.n


def pool_bytes_for(engine, plan: RequestPlan, *, page_size: int = 16, draft_exit: bool = True) -> int:
    """Bytes of a pool that holds exactly `plan` (every choice, at its longest)."""
    page = PagedKV.page_bytes(engine.model.cfg, page_size, engine.kv_format, cache_dtype(engine.model))
    return plan_pages(engine.model, plan, page_size=page_size, draft_exit=draft_exit) * page


class BatchEngine(FastSteps):
    def __init__(self, engine, *, max_num_seqs: int = 32, max_batched_tokens: int = 512,
                 page_size: int = 16, kv_pool_bytes: int | None = None,
                 speculation: dict[str, Any] | None = None, prefix_caching: bool = True):
        """engine: an `Engine` (its model, KV format, context limit and output streams are used).
        speculation: options for every `Speculator` (draft_vocab, draft_stop, fast_head, draft_exit).
        prefix_caching: share full KV blocks across requests by content (`engine.prefix_cache`)."""
        self.engine = engine
        model = engine.model
        self.model = model
        self.speculation = dict(speculation or {})
        cfg = model.cfg
        dtype = cache_dtype(model)
        page_bytes = PagedKV.page_bytes(cfg, page_size, engine.kv_format, dtype)
        blocks_full = -(-engine.max_seq_len // page_size)
        if kv_pool_bytes is None:
            want = max_num_seqs * blocks_full * SlotLayout(cfg, cfg.default_loops).n_slots * page_bytes
            kv_pool_bytes = min(want, DEFAULT_POOL_BYTES_CAP)
        n_pages = max(1, kv_pool_bytes // page_bytes)
        self.kv = PagedKV(cfg, n_pages, page_size, engine.kv_format, dtype, next(model.parameters()).device)
        self.runner = BatchRunner(model, self.kv)
        self.sched = Scheduler(n_pages=n_pages, page_size=page_size, max_num_seqs=max_num_seqs,
                               max_batched_tokens=max_batched_tokens, prefix_caching=prefix_caching)
        self.page_bytes = page_bytes
        self.requests: dict[int, Request] = {}
        self._outputs: dict[int, tuple[Request, Output]] = {}   # seq_id -> (request, output)
        self._next_id = 1
        self.steps = 0
        self.preemptions = 0
        self.peak_running = 0          # most sequences in one step's batch so far

    # -- sizing -----------------------------------------------------------------------------
    def layout(self, plan: RequestPlan) -> SlotLayout:
        return sequence_layout(self.model, plan, self.speculation.get("draft_exit", True))

    def pages_needed(self, plan: RequestPlan) -> int:
        """Pages the whole request holds at its longest (every choice)."""
        return plan_pages(self.model, plan, page_size=self.sched.page_size,
                          max_batched_tokens=self.sched.max_batched_tokens,
                          draft_exit=self.speculation.get("draft_exit", True))

    # -- requests in ------------------------------------------------------------------------
    def add(self, plan: RequestPlan, emit: Emit, *, timeout_s: float | None = None,
            on_admit: Callable[[], None] | None = None, t0: float | None = None) -> Request:
        """Queue a planned request (`Engine.plan` or `Engine.plan_embedding` has checked it). ValidationError
        if it can never fit."""
        t0 = time.perf_counter() if t0 is None else t0
        if isinstance(plan, EmbeddingPlan):
            return self._add_embedding(plan, emit, t0, timeout_s, on_admit)
        cfg, params, n = self.model.cfg, plan.params, plan.n
        prompt = list(plan.prompt_ids)
        outputs = []
        for i in range(n):
            p = params if (i == 0 or params.seed is None) else params.replace(seed=params.seed + i)
            # a constrained output's grammar state (its compiled grammar is cached: this is a copy)
            # (its budget: max_tokens, for the JSON closing rule, engine/schema_close.py)
            matcher = None if params.constraint is None else self.engine.grammars.matcher(params.constraint,
                                                                                          params.max_tokens)
            think, thought = plan.thinking, None
            if think is not None:
                from .thinking import ThinkingMatcher

                eos = min(self.engine.eos_ids) if self.engine.eos_ids else 0
                if think.budget is not None or (matcher is not None and think.inside):
                    # the budget, and a constraint held off until the answer (engine/thinking.py)
                    inner = matcher
                    matcher = thought = ThinkingMatcher(think, matcher, self.engine.tokenizer.token_bytes,
                                                        cfg.vocab_size, eos)
                    if inner is not None:   # the block's tokens count in the answer's budget
                        inner.outside = lambda t=thought: t.closed_at
                else:   # only followed, for usage's reasoning_tokens (the sampler stays unconstrained)
                    thought = ThinkingMatcher(think, None, self.engine.tokenizer.token_bytes, cfg.vocab_size, eos)
            sampler = Sampler(p, prompt, cfg.vocab_size, matcher, draw=self.runner.draw_row)
            outputs.append(Output(i, sampler, self.engine.open_stream(plan, t0, i), thought=thought))
        req = Request(self._next_id, plan, emit, outputs, t0,
                      deadline=None if not timeout_s else t0 + timeout_s, on_admit=on_admit)
        self._next_id += 1
        layout = self.layout(plan)
        slots = layout.n_slots
        seqs = []
        if not plan.speculative:
            seq = Sequence(self.sched.new_seq_id(), prompt, params.max_tokens, slots,
                           loops=plan.loops, window=plan.window, n=n, exit_rule=plan.exit_rule,
                           slot_cols=layout.columns(), **self._ring(plan, layout, len(prompt) + params.max_tokens),
                           **self._prefix_rules(plan))
            outputs[0].seq = seq
            seqs.append(seq)
        else:  # n independent sequences, each with every block it can reach
            for o in outputs:
                o.seq = Sequence(self.sched.new_seq_id(), prompt, params.max_tokens, slots,
                                 loops=plan.loops, window=plan.window, reserve_positions=plan.max_positions,
                                 **self._ring(plan, layout, plan.max_positions), **self._prefix_rules(plan))
                seqs.append(o.seq)
        return self._admit(req, outputs, seqs, "max_tokens", "lower max_tokens, loops or n")

    def _add_embedding(self, plan: EmbeddingPlan, emit: Emit, t0: float, timeout_s: float | None,
                       on_admit: Callable[[], None] | None) -> Request:
        """An embedding request: one output per input, each a sequence that prefills its input at the plan's
        loops and ends with its pooled state (no sampler, nothing generated; engine/embedding.py)."""
        layout = SlotLayout(self.model.cfg, plan.loops)
        outputs, seqs = [], []
        for i, ids in enumerate(plan.inputs):
            o = Output(i, None, EmbeddingStream(plan, i, t0))
            # every position is computed (mean pooling needs each one's state), the blocks named for later requests
            o.seq = Sequence(self.sched.new_seq_id(), list(ids), 0, layout.n_slots, loops=plan.loops,
                             slot_cols=layout.columns(), prefix_salt=("loops", plan.loops, "window", 0),
                             prefix_reads=False)
            outputs.append(o)
            seqs.append(o.seq)
        req = Request(self._next_id, plan, emit, outputs, t0, deadline=None if not timeout_s else t0 + timeout_s,
                      on_admit=on_admit, embedding=True)
        self._next_id += 1
        return self._admit(req, outputs, seqs, "input", "shorten the input or lower loops")

    def _admit(self, req: Request, outputs: list, seqs: list, param: str, advice: str) -> Request:
        """The request's sequences into the scheduler, all or none (a pool too small for them: a 400 naming
        `param`, with `advice`); its outputs then known to the core by sequence."""
        try:
            for s in seqs:
                self.sched.add(s)
        except SchedulerError as exc:
            for s in seqs:
                self.sched.finish(s, "abort")
            raise ValidationError(f"{param}: {exc}; {advice}", param=param, code="kv_capacity_exceeded") from None
        for o in outputs:
            if o.seq is not None:
                self._outputs[o.seq.seq_id] = (req, o)
        self.requests[req.req_id] = req
        return req

    def _ring(self, plan: RequestPlan, layout: SlotLayout, n_positions: int) -> dict[str, Any]:
        return sequence_ring(layout, plan.window, n_positions, page_size=self.sched.page_size,
                             max_batched_tokens=self.sched.max_batched_tokens, speculative=plan.speculative)

    @staticmethod
    def _prefix_rules(plan: RequestPlan) -> dict[str, Any]:
        """How the sequences of `plan` use the prefix cache (what may be shared: engine.prefix_cache)."""
        if plan.kv_loops is not None:  # a ring slot's keys depend on how the prompt was chunked
            return {}
        if plan.speculative:  # the prompt's blocks only (drafts are rolled back inside later blocks), shared
            # with speculative sequences of the same layout: verify depth, draft depth (its draft exit's slots)
            return {"prefix_salt": ("speculative", plan.loops, "draft", plan.draft_loops, "window", plan.window),
                    "prefix_upto": plan.n_prompt}
        return {"prefix_salt": ("loops", plan.loops, "window", plan.window),
                # prompt scoring needs every prompt position's logits: it computes them all
                "prefix_reads": plan.params.prompt_logprobs is None,
                # adaptive depth: generated tokens may exit early, so only the prompt's blocks are shared
                "prefix_upto": None if plan.exit_rule is None else plan.n_prompt,
                "cache_save": plan.cache_save}   # (POST /v1/cache/save: engine/disk_cache.py)

    def abort(self, req: Request) -> None:
        """The client went away: free everything now, emit nothing more."""
        for o in req.outputs:
            self._release(o, "abort")
        self.requests.pop(req.req_id, None)

    def fail(self, req: Request, exc: BaseException) -> None:
        for o in req.outputs:
            self._release(o, "error")
        self.requests.pop(req.req_id, None)
        req.emit(exc)
        req.emit(None)

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    def warm_up(self) -> None:
        """A short greedy plain request, then speculative ones, through this core before any user's (the server
        runs it at load): what a process pays once for the native executor (the head's cost by rows, the draft
        vocabulary's rows, the draft policy's first round costs and lengths: ~30 ms on the shipped model, which
        had made a process's first speculative request 0.8x plain) is then not a user's. Nothing of it stays: the
        prefix cache is off for it and the step counters are left as they were. Only for a model that stays in
        cache (not `streamed`): a larger one's first request takes seconds, and its 144 warm-up tokens would too."""
        if not self.runner.natively or self.runner.streamed or self.requests:
            return
        ids = [1, 2, 3, 4]
        n = max(1, min(WARM_UP_TOKENS, self.engine.max_seq_len - len(ids) - 1))
        kept = self.steps, self.preemptions, self.peak_running, self.sched.prefix
        self.sched.prefix = None
        try:
            kinds = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)]
            if self.model.cfg.default_loops >= 2:   # (a draft needs fewer loops than the verifier)
                kinds += [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, mode="speculative")] * 2
            for params in kinds:
                run_to_completion(self, [(ids, params)])
        finally:
            self.steps, self.preemptions, self.peak_running, self.sched.prefix = kept

    @property
    def runs_natively(self) -> bool:
        """Whether the native executor runs this core's steps (its forward is then one call without the GIL)."""
        return self.runner.natively

    @property
    def num_running(self) -> int:
        return len(self.sched.running)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> None:
        self._expire()
        out = self.sched.schedule()
        self.steps += 1
        self.preemptions += len(out.preempted)
        self.peak_running = max(self.peak_running, len(self.sched.running))
        with self._spec_python():
            for seq in out.admitted_external:
                self._start_speculative(seq)
        for seq in [c.seq for c in out.chunks] + out.admitted_external:
            entry = self._outputs.get(seq.seq_id)
            if entry is not None and entry[0].admitted is None:
                req = entry[0]
                req.admitted = time.perf_counter()
                if req.on_admit is not None:
                    req.on_admit()
        spec = [self._outputs[s.seq_id] for s in self.sched.running
                if s.external and s.seq_id in self._outputs and self._outputs[s.seq_id][1].pending is not None]
        if not out.chunks and not spec:
            return
        if self._lone_plain_steps(out, spec):
            return
        try:
            logits = self.runner.execute(out.chunks, out.copies, [o.pending for _, o in spec],
                                         score=self._scoring(out.chunks), greedy=self._greedy(out.chunks),
                                         embed=self._embedding(out.chunks))
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving the rest
            log.exception("batch step failed")
            reqs = [self._outputs[c.seq.seq_id][0] for c in out.chunks if c.seq.seq_id in self._outputs]
            for req in {id(r): r for r in reqs + [r for r, _ in spec]}.values():
                self.fail(req, exc)
            return
        for sid, (first, entries) in self.runner.last_scores.items():
            if sid in self._outputs:
                self._outputs[sid][0].scores[first:first + len(entries)] = entries
        for sid, (start, states) in self.runner.last_hidden.items():
            entry = self._outputs.get(sid)
            if entry is not None:
                try:
                    entry[1].stream.pooler.add(start, states)
                except Exception as exc:  # noqa: BLE001 - this request fails alone
                    log.exception("embedding request %d failed", entry[0].req_id)
                    self.fail(entry[0], exc)
        argmax = self.runner.last_argmax
        with self.runner.one_thread():   # one row at a time: no OpenMP wake-ups (native.one_thread)
            for chunk in out.chunks:
                self._complete(chunk, logits, argmax)
        with self._spec_python():
            for req, o in spec:
                if not o.done:
                    self._advance_speculative(req, o)

    # -- internals --------------------------------------------------------------------------
    def _spec_python(self):
        """A speculator's set-up and its Python between native passes (`BatchRunner.python_between_calls`)."""
        return self.runner.python_between_calls()

    def _complete(self, chunk, logits: dict[int, torch.Tensor], argmax: dict[int, int]) -> None:
        """A chunk's forward pass is done: each of its sequences (a prompt's last chunk: all n choices)
        samples its next token from the chunk's logits."""
        group = self.sched.complete(chunk)
        if not group:
            return
        row = logits.get(chunk.seq.seq_id)   # None for a greedy sequence: its token is in `argmax`
        for seq in group[1:]:  # new siblings (n > 1) take the request's unbound outputs
            self._bind_sibling(chunk.seq, seq)
        if not chunk.seq.n_generated:  # the prompt's last chunk: its scores are complete
            self._deliver_scores(chunk.seq)
        for seq in group:
            entry = self._outputs.get(seq.seq_id)
            if entry is None:  # its request failed on a sibling choice just now
                continue
            req, o = entry
            if req.params.max_tokens == 0:  # prompt scoring only (or an embedding): nothing is generated
                try:
                    self._finish(req, o, "length")
                except Exception as exc:  # noqa: BLE001 - this request fails alone; the batch goes on
                    log.exception("request %d failed", req.req_id)
                    self.fail(req, exc)
                continue
            try:
                quick = argmax.get(chunk.seq.seq_id) if len(group) == 1 else None   # (the head picked it: _greedy)
                tok = quick if quick is not None else o.sampler.sample(row)
                lp = None
                if req.plan.params.logprobs is not None:
                    lp = o.sampler.logprobs(row, tok, req.plan.params.logprobs)
                loops = self.runner.last_loops.get(chunk.seq.seq_id)
                grammar = self._jump_grammar(req, o, seq, len(group))
                with grammar.lazily() if grammar is not None else contextlib.nullcontext():
                    o.sampler.accept(tok)
                    self.sched.append_token(seq, tok)
                    self._token(req, o, tok, loops, lp)
                    if grammar is not None:
                        self._take_forced(req, o, seq, grammar, loops)
            except Exception as exc:  # noqa: BLE001 - this request fails alone; the batch goes on
                log.exception("request %d failed", req.req_id)
                self.fail(req, exc)

    def _scoring(self, chunks) -> dict[int, int]:
        """{seq_id: alternatives} of this step's chunks whose prompt positions are scored (prompt_logprobs):
        a prompt's first pass only (a sequence recomputed after preemption has its scores already)."""
        score = {}
        for c in chunks:
            entry = self._outputs.get(c.seq.seq_id)
            if entry is None or entry[0].params.prompt_logprobs is None or c.seq.n_generated:
                continue
            req = entry[0]
            if req.scores is None:
                req.scores = [None] * len(c.seq.prompt)
            score[c.seq.seq_id] = req.params.prompt_logprobs
        return score

    def _deliver_scores(self, seq: Sequence) -> None:
        """The prompt is cached and scored: every choice's stream carries the scores on its next event."""
        entry = self._outputs.get(seq.seq_id)
        if entry is not None and entry[0].scores is not None:
            for o in entry[0].outputs:
                o.stream.prompt_logprobs = entry[0].scores

    def _embedding(self, chunks) -> set[int]:
        """This step's sequences of embedding requests: their states are pooled, no logits computed."""
        return {c.seq.seq_id for c in chunks if (e := self._outputs.get(c.seq.seq_id)) is not None and e[0].embedding}

    def _greedy(self, chunks) -> dict:
        """The sequences whose next token the head picks itself (one choice, no penalties, constraint or
        logprobs): greedy ones (None: the argmax) and plain sampled ones (their draw's parameters, (key, 1 / T,
        top_k, top_p): engine/sampling.py); the runner returns their tokens, not their logits."""
        ids = {}
        for c in chunks:
            entry = self._outputs.get(c.seq.seq_id)
            if entry is not None and entry[0].params.max_tokens > 0 and len(entry[0].outputs) == 1 \
                    and entry[0].plan.params.logprobs is None:
                pick = entry[1].sampler.head_pick()
                if pick is not False:
                    ids[c.seq.seq_id] = pick
        return ids

    def _bind_sibling(self, parent: Sequence, kid: Sequence) -> None:
        req, _ = self._outputs[parent.seq_id]
        o = next(o for o in req.outputs if o.seq is None)
        o.seq = kid
        self._outputs[kid.seq_id] = (req, o)

    def _token(self, req: Request, o: Output, tok: int, loops: int | None = None, logprob=None) -> None:
        req.started = True
        if o.thought is not None and o.thought is not o.sampler.matcher:   # (the sampler's own has it)
            o.thought.accept(tok)
        ev = o.stream.feed(tok, loops, logprob)
        if ev is not None:
            req.emit(ev)
        if o.stream.stopped:
            self._finish(req, o, None)
        elif o.stream.n >= req.params.max_tokens:
            self._finish(req, o, "length")

    def _finish(self, req: Request, o: Output, reason: str | None) -> None:
        if o.seq is not None:
            o.run_stats["prompt_tokens_cached"] = o.seq.prompt_cached
        if o.thought is not None:   # a thinking model's output: the tokens of its thinking block (not a stop id)
            o.run_stats["reasoning_tokens"] = min(o.thought.reasoning_tokens, o.stream.n)
        self._release(o, reason or "stop")
        req.emit(o.stream.close(o.run_stats, reason))
        if req.done:
            self.requests.pop(req.req_id, None)
            req.emit(None)

    def _release(self, o: Output, reason: str) -> None:
        if o.done:
            return
        o.done = True
        if o.spec is not None:
            o.spec.finish(o.run_stats)
        if o.passes is not None:
            o.passes.close()
            o.passes = o.pending = None
            self.runner.finish(o.spec)
        if o.seq is not None:
            self.sched.finish(o.seq, reason)
            self._outputs.pop(o.seq.seq_id, None)

    def _start_speculative(self, seq: Sequence) -> None:
        req, o = self._outputs[seq.seq_id]
        table = torch.tensor(seq.block_table, device=self.kv.k.parts[0].device)
        o.spec = Speculator(self.model, req.plan, o.sampler, self.kv, table, cached=seq.n_cached,
                            running=lambda: len(self.sched.running), runner=self.runner, **self.speculation)
        self.runner.prepare(o.spec)
        o.passes = o.spec.passes()
        self._advance_speculative(req, o)

    def _advance_speculative(self, req: Request, o: Output) -> None:
        """Resume the speculator after its pass ran: emit what it verified, up to its next pass."""
        o.pending = None
        try:
            while True:
                item = next(o.passes)
                if isinstance(item, (Rows, NativeRound)):
                    o.pending = item
                    return
                o.spec.finish(o.run_stats)
                if o.seq.n_cached < len(o.seq.prompt):   # the first token: the prompt is in the cache
                    self.sched.prompt_computed(o.seq)
                lps = o.spec.logprobs
                for i, tok in enumerate(item):
                    self._token(req, o, tok, None, lps[i] if i < len(lps) else None)
                    if o.done:
                        return
        except StopIteration:
            if not o.done:
                self._finish(req, o, "length")
        except Exception as exc:  # noqa: BLE001
            log.exception("speculative request %d failed", req.req_id)
            self.fail(req, exc)

    def _expire(self) -> None:
        now = time.perf_counter()
        for req in list(self.requests.values()):
            if req.deadline is None or now < req.deadline:
                continue
            if req.embedding and req.admitted is not None:   # its inputs are running: their vectors are not cut short
                continue
            if not req.started:
                self.fail(req, RequestTimeout(f"the request waited {now - req.t0:.1f} s without starting "
                                              f"(timeout {req.deadline - req.t0:g} s); retry later"))
                continue
            for o in req.outputs:
                if not o.done:
                    o.run_stats["timed_out"] = True
                    self._finish(req, o, "length")


@torch.inference_mode()
def run_to_completion(batch: BatchEngine, items: list[tuple[list[int], Any]], n: int = 1) -> list[list[StreamEvent]]:
    """Run several requests (prompt ids, SamplingParams) together to the end (tests and benchmarks): the
    events of each, in order."""
    events: list[list[StreamEvent]] = [[] for _ in items]
    for i, (ids, params) in enumerate(items):
        batch.add(batch.engine.plan(ids, params, n=n), lambda ev, i=i: ev is not None and events[i].append(ev))
    while batch.has_work:
        batch.step()
    return events


def run_ids(engine, prompt_ids: list[int], params, *, stats: dict[str, Any] | None = None,
            **speculation) -> list[int]:
    """One request to the end on a core of its own, sized for it (benchmarks, tests): its token ids (a stop
    id ends the output and is not included); `stats` receives the final event's stats. `speculation`:
    the `Speculator` options (draft_vocab, draft_stop, fast_head, draft_exit)."""
    plan = engine.plan(prompt_ids, params)
    pool = pool_bytes_for(engine, plan, draft_exit=speculation.get("draft_exit", True))
    core = BatchEngine(engine, max_num_seqs=1, kv_pool_bytes=pool, speculation=speculation)
    events = run_to_completion(core, [(prompt_ids, params)])[0]
    if stats is not None:
        stats.update(events[-1].stats)
    return [t for e in events for t in e.token_ids]
