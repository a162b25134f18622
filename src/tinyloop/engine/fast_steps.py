"""The engine core's shortcuts past per-token work (a mixin of engine/serving.py's BatchEngine, whose
scheduler, runner, outputs and token path they use):

- a sequence decoding alone makes up to MULTI_STEPS tokens in one native call (`_lone_plain_steps`,
  `tl_generate`), grammar included;
- jump-forward: the tokens a grammar forces after a pick are outputs at once, their rows run in one pass with
  the pick's (inside that call, or in the shared step as the sequence's next decode chunk: `_take_forced`).

Both give the outputs the engine's one-token steps give (tests/kernels/test_lone_steps.py,
tests/engine/test_constraint.py)."""

from __future__ import annotations

import contextlib
import logging

from ..model.paged import Rows
from .requests import Output, Request
from .scheduler import FORCED_TAIL, ScheduledChunk, Sequence

log = logging.getLogger("tinyloop.engine")

MULTI_STEPS = 8   # plain tokens a lone plain sequence makes per native call (`_lone_plain_steps`)


class FastSteps:
    """BatchEngine's lone-sequence calls and jump-forward (the module's docstring)."""

    def _lone_plain_steps(self, out, spec) -> bool:
        """A sequence decoding alone makes up to MULTI_STEPS tokens in one native call (`tl_generate`): the
        same rows, head and draws as that many engine steps, without each step's Python (scheduling, the rows,
        two calls: ~0.3 ms a token on the shipped model, a fifth of a token at 8 loops). Only where nothing
        else runs or waits (a request arriving meanwhile waits for the call, ~MULTI_STEPS tokens), for a greedy
        or sampled output without penalties, bias, thinking budget, logprobs or n > 1, on the native executor.
        Under a grammar each pick is over the grammar's bitmask, and a callback hands the token to the grammar,
        which computes the next position's mask before the call goes on (`Matcher.lazily`); the tokens the
        grammar forces after a pick (`Matcher.forced`) are taken at once, their rows run together in the next
        pass, without a head row or a mask each (jump-forward; the same outputs, tests/engine/test_constraint.py).
        The tokens are fed one by one as the steps would have fed them: stop ids, stop strings, max_tokens and
        an abort end the output at the same token (the steps after it computed keys past the sequence's
        length, which nothing reads). Returns whether it ran the step."""
        if not self.runner.natively or spec or len(out.chunks) != 1 or out.copies or out.admitted_external \
                or len(self.sched.running) != 1 or self.sched.waiting or self.model.random_start:
            return False
        c = out.chunks[0]
        seq = c.seq
        entry = self._outputs.get(seq.seq_id)
        if entry is None or c.n != 1 or not c.needs_logits or c.start < len(seq.prompt) or seq.external:
            return False
        req, o = entry
        params = req.plan.params
        steps = min(MULTI_STEPS, params.max_tokens - o.stream.n)
        s = o.sampler
        grammar = s.head_matcher   # (a constraint's; not a thinking block's, which may force a token later)
        if steps < 2 or len(req.outputs) != 1 or req.embedding or params.logprobs is not None \
                or (s.matcher is not None and grammar is None) or s.head_pick() is False:
            return False
        row = Rows(table=self.runner.table(seq), start=c.start, n=1, last_loop=seq.loops, tokens=[seq.tokens[c.start]],
                   window=seq.window, exit_rule=seq.exit_rule)
        if not self.runner.supports(row) or not self.sched.reserve(seq, c.start + steps):
            return False
        noise = None if params.greedy else (s.seed, s.n_out, *s.draw_params()[1:])
        failed: list[BaseException] = []

        def follow(tok: int, room: int) -> list[int] | None:   # the grammar inside the call (tl_gen): take tok,
            try:                                                  # and what the grammar forces after it, fill
                s.accept(tok)                                     # the next pick's mask
                forced = grammar.forced(room, o.stream.stop_ids)
                for f in forced:
                    s.accept(f)
                grammar.bitmask()   # (lazily: computed here, on this thread)
                return forced
            except BaseException as exc:  # noqa: BLE001 - raised below, after the call
                failed.append(exc)
                return None

        try:
            with grammar.lazily() if grammar is not None else contextlib.nullcontext():
                toks, used = self.runner.lone_steps(seq, c.start, steps, noise, o.stream.stop_ids,
                                                    None if grammar is None else (grammar.bitmask(), follow))
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            log.exception("batch step failed")
            self.fail(req, failed[0] if failed else exc)
            return True
        for j, tok in enumerate(toks):
            try:
                self.sched.complete(ScheduledChunk(seq, c.start + j, 1, True))
                if grammar is None:   # (under a grammar the call's callback accepted it)
                    s.accept(tok)
                self.sched.append_token(seq, tok)
                self._token(req, o, tok, used[j] if seq.exit_rule is not None else None)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                log.exception("request %d failed", req.req_id)
                self.fail(req, exc)
                return True
            if o.done:
                break
        return True

    def _jump_grammar(self, req: Request, o: Output, seq: Sequence, group: int):
        """The grammar whose forced tokens this output takes at once after a pick in the shared step
        (`_take_forced`), or None: a constraint the head picks under (no penalties or bias), one choice, no
        logprobs or thinking block, a fixed depth (the forced rows' loops are then the pick's)."""
        grammar = o.sampler.head_matcher
        if grammar is None or group != 1 or len(req.outputs) != 1 or seq.exit_rule is not None \
                or req.plan.params.logprobs is not None or o.thought is not None:
            return None
        return grammar

    def _take_forced(self, req: Request, o: Output, seq: Sequence, grammar, loops) -> None:
        """Jump-forward in the shared step: the tokens the grammar forces after the pick just taken (`Matcher.
        forced`: each the only token its position allows, so the pick a step would make there) are outputs at
        once; their rows go in with the next decode chunk (`Sequence.forced_tail`), without a head row or a
        mask of their own, as in the lone steps' call. Stop ids and EOS stay the head's to pick; a stop string
        or max_tokens ends the output at the same token as the steps would."""
        if o.done:
            return
        room = min(FORCED_TAIL, req.plan.params.max_tokens - o.stream.n, self.sched.max_batched_tokens - 1)
        for f in grammar.forced(room, o.stream.stop_ids):
            o.sampler.accept(f)
            self.sched.append_token(seq, f)
            self._token(req, o, f, loops)
            if o.done:
                return
