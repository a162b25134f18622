"""The serving engine: many requests, one model, one batched forward pass per step.

    batch = BatchEngine(engine)
    req = batch.add(prompt_ids, params, emit, n=2)   # emit(StreamEvent | Exception | None) per event
    while batch.has_work:
        batch.step()                                 # schedule -> run the batch -> sample -> text events

Plain generation goes through the continuous batch (`Scheduler` + `BatchRunner`): each step batches
the decode tokens of every running sequence with chunks of waiting prompts. Every request keeps its own
`Sampler` (seed, penalties, top-k/top-p), loops, stop strings and cache window inside the batch.

Speculative modes keep their own cache and run outside the batch: each step advances every running
speculative request by one token (a draft-and-verify round when its verified tokens are used up), so
they are interleaved with the batch instead of waiting for it. They are admitted under the same FIFO
order, `max_num_seqs` and KV memory as the batch (they reserve the pages their cache is worth).

`emit` is called on the engine thread: StreamEvents (text deltas; a final one per choice with
finish_reason and stats), an Exception if the request failed, and None once the request is over.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ..errors import RequestTimeout, ValidationError
from .batch import BatchRunner, PagedKV, n_slots
from .engine import Engine, StreamEvent, TextStream
from .params import SamplingParams
from .sampling import Sampler
from .scheduler import Scheduler, SchedulerError, Sequence

log = logging.getLogger("tinyloop.engine")

Emit = Callable[[Any], None]
DEFAULT_POOL_BYTES_CAP = 1 << 30        # the default pool: enough for max_num_seqs full contexts, at most 1 GiB
SPEC_MARGIN = 72                        # positions a speculative cache holds beyond prompt + max_tokens


@dataclass(eq=False)
class _Output:
    index: int
    sampler: Sampler
    text: TextStream
    seq: Sequence | None = None
    gen: Iterator[int] | None = None             # speculative modes: the request's token generator
    run_stats: dict[str, Any] = field(default_factory=dict)
    done: bool = False


@dataclass(eq=False)
class Request:
    req_id: int
    prompt_ids: list[int]
    params: SamplingParams
    emit: Emit
    outputs: list[_Output]
    t0: float
    deadline: float | None = None
    on_admit: Callable[[], None] | None = None    # called once, when the request first gets to run
    admitted: float | None = None                 # when it did (perf_counter)
    started: bool = False                         # a token has gone out

    @property
    def done(self) -> bool:
        return all(o.done for o in self.outputs)


class BatchEngine:
    def __init__(self, engine: Engine, *, max_num_seqs: int = 32, max_batched_tokens: int = 512,
                 page_size: int = 16, kv_pool_bytes: int | None = None):
        self.engine = engine
        model = engine.model
        self.model = model
        cfg = engine.config
        page_bytes = PagedKV.page_bytes(model, page_size, engine.kv_format)
        blocks_full = -(-engine.max_seq_len // page_size)
        if kv_pool_bytes is None:
            want = max_num_seqs * blocks_full * n_slots(model, cfg.default_loops) * page_bytes
            kv_pool_bytes = min(want, DEFAULT_POOL_BYTES_CAP)
        n_pages = max(1, kv_pool_bytes // page_bytes)
        self.kv = PagedKV(model, n_pages, page_size, engine.kv_format)
        self.runner = BatchRunner(model, self.kv)
        self.sched = Scheduler(n_pages=n_pages, page_size=page_size, max_num_seqs=max_num_seqs,
                               max_batched_tokens=max_batched_tokens)
        self.page_bytes = page_bytes
        self.requests: dict[int, Request] = {}
        self._outputs: dict[int, tuple[Request, _Output]] = {}   # seq_id -> (request, output)
        self._next_id = 1
        self.steps = 0
        self.preemptions = 0
        self.peak_running = 0          # most sequences in one step's batch so far

    # -- requests in ------------------------------------------------------------------------
    def add(self, prompt_ids: list[int], params: SamplingParams, emit: Emit, *, n: int = 1,
            timeout_s: float | None = None, on_admit: Callable[[], None] | None = None) -> Request:
        """Queue a validated request (`Engine.check` has run). ValidationError if it can never fit."""
        if not 1 <= n <= 8:
            raise ValidationError(f"n: must be in 1..8, got {n}", param="n")
        t0 = time.perf_counter()
        cfg = self.engine.config
        outputs = []
        for i in range(n):
            p = params if (i == 0 or params.seed is None) else params.replace(seed=params.seed + i)
            outputs.append(_Output(i, Sampler(p, prompt_ids, cfg.vocab_size),
                                   self.engine.text_stream(prompt_ids, params, t0, index=i)))
        req = Request(self._next_id, list(prompt_ids), params, emit, outputs, t0,
                      deadline=None if not timeout_s else t0 + timeout_s, on_admit=on_admit)
        self._next_id += 1
        loops = params.effective_loops(cfg.default_loops)
        seqs = []
        if params.mode == "generate":
            seq = Sequence(self.sched.new_seq_id(), list(prompt_ids), params.max_tokens, n_slots(self.model, loops),
                           loops=loops, window=params.cache_window, n=n)
            outputs[0].seq = seq
            seqs.append(seq)
        else:  # speculative: n independent sequences outside the batch, each reserving its cache's pages
            positions = len(prompt_ids) + params.max_tokens + SPEC_MARGIN
            exits = getattr(self.model, "draft_exits", None) or {}  # a draft exit has cache slots of its own
            extra = len(exits[params.draft_loops].coda) if params.draft_loops in exits else 0
            pages = self.sched.blocks_for(positions) * (n_slots(self.model, loops) + extra)
            for o in outputs:
                o.seq = Sequence(self.sched.new_seq_id(), list(prompt_ids), params.max_tokens, 0,
                                 loops=loops, external_pages=pages)
                seqs.append(o.seq)
        try:
            for s in seqs:
                self.sched.add(s)
        except SchedulerError as exc:
            for s in seqs:
                self.sched.finish(s, "abort")
            raise ValidationError(f"max_tokens: {exc}; lower max_tokens, loops or n",
                                  param="max_tokens", code="kv_capacity_exceeded") from None
        for o in outputs:
            if o.seq is not None:
                self._outputs[o.seq.seq_id] = (req, o)
        self.requests[req.req_id] = req
        return req

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
        for seq in out.admitted_external:
            self._start_speculative(seq)
        for seq in [c.seq for c in out.chunks] + out.admitted_external:
            entry = self._outputs.get(seq.seq_id)
            if entry is not None and entry[0].admitted is None:
                req = entry[0]
                req.admitted = time.perf_counter()
                if req.on_admit is not None:
                    req.on_admit()
        if out.chunks:
            try:
                logits = self.runner.execute(out.chunks, out.copies)
            except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving the rest
                log.exception("batch step failed")
                for req in {id(r): r for r in (self._outputs[c.seq.seq_id][0] for c in out.chunks
                                                if c.seq.seq_id in self._outputs)}.values():
                    self.fail(req, exc)
                return
            argmax = self._plain_greedy_argmax(logits)
            for chunk in out.chunks:
                group = self.sched.complete(chunk)
                if not group:
                    continue
                row = logits[chunk.seq.seq_id]
                for seq in group[1:]:  # new siblings (n > 1) take the request's unbound outputs
                    self._bind_sibling(chunk.seq, seq)
                for seq in group:
                    req, o = self._outputs[seq.seq_id]
                    quick = argmax.get(chunk.seq.seq_id) if o.sampler.plain_greedy else None
                    tok = quick if quick is not None else o.sampler.sample(row)
                    o.sampler.accept(tok)
                    self.sched.append_token(seq, tok)
                    self._token(req, o, tok)
        for seq in list(self.sched.running):
            if seq.external and seq.seq_id in self._outputs:
                req, o = self._outputs[seq.seq_id]
                self._advance_speculative(req, o)

    # -- internals --------------------------------------------------------------------------
    def _plain_greedy_argmax(self, logits: dict[int, torch.Tensor]) -> dict[int, int]:
        """One argmax over the step's whole logits matrix for the greedy, unpenalized sequences (the
        common case) instead of one call per row."""
        ids = self.runner.last_ids
        if sum(1 for sid in ids if sid in self._outputs and self._outputs[sid][1].sampler.plain_greedy) < 2:
            return {}
        best = self.runner.last_logits[:, :self.engine.config.vocab_size].argmax(dim=-1).tolist()
        return dict(zip(ids, best))

    def _bind_sibling(self, parent: Sequence, kid: Sequence) -> None:
        req, _ = self._outputs[parent.seq_id]
        o = next(o for o in req.outputs if o.seq is None)
        o.seq = kid
        self._outputs[kid.seq_id] = (req, o)

    def _token(self, req: Request, o: _Output, tok: int) -> None:
        req.started = True
        ev = o.text.feed(tok)
        if ev is not None:
            req.emit(ev)
        if o.text.stopped:
            self._finish(req, o, None)
        elif o.text.n >= req.params.max_tokens:
            self._finish(req, o, "length")

    def _finish(self, req: Request, o: _Output, reason: str | None) -> None:
        self._release(o, reason or "stop")
        req.emit(o.text.close(o.run_stats, reason))
        if req.done:
            self.requests.pop(req.req_id, None)
            req.emit(None)

    def _release(self, o: _Output, reason: str) -> None:
        if o.done:
            return
        o.done = True
        if o.gen is not None:
            o.gen.close()  # frees the speculative cache now
            o.gen = None
        if o.seq is not None:
            self.sched.finish(o.seq, reason)
            self._outputs.pop(o.seq.seq_id, None)

    def _start_speculative(self, seq: Sequence) -> None:
        req, o = self._outputs[seq.seq_id]
        o.gen = self.engine.token_ids(req.prompt_ids, req.params, o.run_stats, sampler=o.sampler)

    def _advance_speculative(self, req: Request, o: _Output) -> None:
        try:
            tok = next(o.gen)
        except StopIteration:
            self._finish(req, o, "length")
            return
        except Exception as exc:  # noqa: BLE001
            log.exception("speculative request %d failed", req.req_id)
            self.fail(req, exc)
            return
        self._token(req, o, tok)

    def _expire(self) -> None:
        now = time.perf_counter()
        for req in list(self.requests.values()):
            if req.deadline is None or now < req.deadline:
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
def run_to_completion(batch: BatchEngine, items: list[tuple[list[int], SamplingParams]], n: int = 1) -> list[list[StreamEvent]]:
    """Run several requests together to the end (tests and benchmarks): the events of each, in order."""
    events: list[list[StreamEvent]] = [[] for _ in items]
    for i, (ids, params) in enumerate(items):
        batch.add(ids, params, lambda ev, i=i: ev is not None and events[i].append(ev), n=n)
    while batch.has_work:
        batch.step()
    return events
