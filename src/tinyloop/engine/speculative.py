"""Self-speculative decoding for looped models: chain and tree speculation that reuse the draft's loops.

The draft is the model itself run with `draft_loops = d` loops; the verifier is the same model with
`verify_loops = V`. Loops 0..d-1 of the draft are exactly loops 0..d-1 of the verifier on the same tokens,
so the draft's keys and values for those loops (and for the prelude, which depends on the tokens only)
are the verifier's: verification continues from each drafted position's state after loop d-1 (and its
prelude output, which every loop receives) through loops d..V-1 only, then runs the coda and the LM
head, all in one batched pass over the round's positions.

A speculative request is an ordinary sequence of the engine core (`engine.serving`): its KV lives on
pool pages like every other sequence's, and its passes (prefill, each draft step, the verification)
are rows of the core's batched steps, next to the plain sequences' rows (`Speculator.passes`). Cache
slots per round:

- prelude and core loops 0..d-1: written by the draft, kept as they are for the accepted positions;
- core loops d..V-1: written by the verification pass;
- coda: the draft writes coda entries computed from d-loop states (its own attention needs them), and
  the verification pass overwrites them with V-loop entries at every position it covers, so every
  committed position holds exactly what a plain V-loop run would have written;
- with a trained draft exit for depth d (`model.draft_exit`, attached by `Engine.load`), the draft reads
  out through the exit instead of the coda: the exit has cache slots of its own (`SlotLayout.extra_slot`),
  written from d-loop states at every prompt position (prefill) and every drafted position, and the
  coda slot is written by verification only. A last drafted token that is accepted has no exit entry
  yet (its pass ran no read-out); it is written with the next round's first draft step (`exit_backlog`).

Rejected positions are rolled back in every slot by not advancing `Speculator.length` past them: later
passes write over them before anything reads them. Tree speculation stores node i of a round's tree at
storage index L + i (L = committed length); the accepted path's entries are then copied into positions
L+1.. with `PagedKV.copy_positions` in every slot, never recomputed.

Round shapes:

- chain (mode "speculative", and a sampled tree request whose rounds cannot run natively): draft up to k = draft_ahead tokens one by
  one; drafting stops early when the draft's top probability drops below `draft_stop` (the draft is
  then likely wrong, and every further draft token costs d loops plus a head); verify k+1 positions.
- tree (mode "tree_speculative"; sampled: natively, tl_tree_round): a beam of width K = K_branches ranked by cumulative draft
  log-probability; each depth's K nodes are drafted in one batched pass with a tree attention mask
  (each node sees the committed context, its ancestors and itself); depth = draft_ahead. One
  verification pass covers all 1 + K*depth nodes; the head runs lazily, first over the beam's best
  path, then over a sub-path wherever the verifier leaves it. K = 1 is the chain, computed the same way.

The draft scores a reduced, frequency-ranked vocabulary (`draft_vocab` rows of the LM head plus every
token of the prompt and output); verification always scores the full vocabulary, so exactness holds.
Greedy output equals plain generation at V loops token for token in exact arithmetic; in floating point
a batched pass can round differently from one-token passes (float64 tests see no difference; float32
can flip only a near-tie). Sampling (chain) draws by shared noise (engine/sampling.py): the draft proposes
its row's draw under the noise of the position it fills, the verifier draws its own token at each position
with the same noise (penalties over the accepted prefix exactly as plain generate defines them), and the
round walks on while the two agree, as greedy rounds do. The output is plain sampling's output for the
request's seed, token for token, so its distribution is plain generate's.

With `logprobs` asked for, each emitted token's log-probability is taken from the verifier's row that
chose (or accepted) it, under the same `Sampler.logprobs` rule as plain generation, so under greedy they
equal plain decoding's; the verifier then scores the full head (no `ExactArgmax` shortcut).
"""

from __future__ import annotations

import time
from typing import Any, Generator

import torch

from ..model import LoopedTransformer
from ..model.cache import SlotLayout
from ..model.paged import PagedKV, Rows
from .batch import BatchRunner
from .draft_head import DraftHead, ExactArgmax
from .draft_policy import DraftPolicy, round_costs, tested
from .round_shape import TreeOrChain, shape_rates
from .sampling import Sampler, penalized, processed_logits
from .native_rounds import ALONE_UP_TO, CHAIN_ROUNDS, PIPELINE_RUN, PLAIN_STEPS, NativeRound, NativeSteps
from .tree_rounds import TreeRounds

DRAFT_STOP = 0.0        # chain: stop drafting when the draft's top probability falls below this
PREFILL_CHUNK = 256     # prompt positions per prefill pass
class Speculator(TreeRounds):
    """One speculative sequence of the engine core: its rounds as a generator of model passes.

    `passes()` yields either a `model.paged.Rows` (a pass over this sequence's pool pages, for the core
    to run inside its next batched step; its results are in the same object when the generator resumes)
    or a list of tokens (newly verified output). The core runs the passes of every speculative sequence
    with the plain sequences' rows in one forward, so speculation is an ordinary member of the batch.
    """

    def __init__(self, model: LoopedTransformer, plan, sampler: Sampler, kv: PagedKV, table: torch.Tensor, *,
                 draft_vocab: int | str | None = "auto", draft_stop: float = DRAFT_STOP, fast_head: bool = True,
                 draft_exit: bool = True, cached: int = 0, adaptive: bool = True, native_round: bool = True,
                 running=None, pipeline: bool | None = None, runner: BatchRunner | None = None):
        """`cached`: leading prompt positions whose KV (every slot) the pages already hold (prefix cache).
        `adaptive`: greedy rounds choose their draft length (`DraftPolicy`); False: always draft_ahead.
        `native_round`: False runs a greedy round's passes one engine step each even with the native
        executor (tests compare the two). `running`: a callable giving the sequences the engine core runs
        now; past ALONE_UP_TO a greedy native round becomes a plain row of the shared step. `pipeline`:
        True / False, greedy native rounds only as depth-aligned passes (`tl_spec_pipeline`) or only as
        chain rounds; None, the policy times both and takes the faster (with adaptive=False: the pipeline
        where the model's weights are streamed from memory). `runner`: the batch runner that runs this sequence's
        native work (the engine core's; None: one of its own, on this pool), asked whether native code runs the
        model and whether its weights stream from memory."""
        runner = runner if runner is not None else BatchRunner(model, kv)
        params = plan.params
        self.model, self.params, self.sampler, self.plan = model, params, sampler, plan
        self.d, self.V, self.K = plan.draft_loops, plan.loops, plan.k_branches
        # tree rounds: greedy, or sampled where the whole round runs natively (tl_tree_round draws as plain
        # sampling does; the stepwise tree walk is greedy only); other sampled tree requests run chain rounds
        self.tree = params.mode == "tree_speculative"
        self.draft_stop = draft_stop
        self.kv, self.table = kv, table       # the pool, and this sequence's pages in it (blocks, slots)
        self.length = 0                       # positions committed in every slot
        self.cached = cached
        # A trained draft exit for this depth (model.draft_exit), if the model has one: it replaces the
        # coda (and final norm) in the draft, with cache slots of its own.
        exits = getattr(model, "draft_exits", None) or {}
        self.exit = exits.get(self.d) if draft_exit else None
        self.layout = speculative_layout(model, plan, draft_exit)
        self.exit_readout = None if self.exit is None else \
            (self.exit, [self.layout.extra_slot(i) for i in range(len(self.exit.coda))])
        self.draft_readout = self.exit_readout or "coda"
        self.exit_backlog: torch.Tensor | None = None  # loop-d state of position L-1 if its exit entry is missing
        natively = runner.natively
        self.head = DraftHead(model, draft_vocab, norm=self.exit.norm if self.exit is not None else None,
                              natively=natively)
        self.head.add(list(plan.prompt_ids))
        self.penalties = penalized(params)
        # the exact-argmax shortcut reads the raw head: not with penalties, logprobs or a constraint's mask
        plain_greedy = params.greedy and not self.penalties and params.logprobs is None and sampler.matcher is None
        self.argmax = None
        if plain_greedy and fast_head:   # the native executor's fused head argmax (the runner's), else fp16's
            self.argmax = runner.head_tokens if natively else \
                ExactArgmax.for_model(model) if ExactArgmax.usable(model) else None
        # sampling from the raw rows (temperature, top-k, top-p): the native head draws the tokens itself (tl_draw)
        self.sampled_native = natively and fast_head and sampler.plain_sampled and params.logprobs is None
        # a round in one native call: the fused head argmax (or draw), no grammar or early stop
        native = (native_round and natively and (self.argmax is not None or self.sampled_native)
                  and sampler.matcher is None and draft_stop <= 0
                  and not model.random_start)   # (one-call rounds start loop 0 from zeros or e)
        if not params.greedy and not (native and self.sampled_native):
            self.tree = False
        self.native_tree = native and self.tree and self.K > 1   # a tree round in one call (tl_tree_round)
        # an adaptive tree request takes a tree round or a chain round, whichever measures faster
        self.shapes = TreeOrChain(shape_rates(model, self.d, self.V, self.K, not params.greedy)) \
            if self.native_tree and adaptive else None
        # (a fixed greedy tree request runs every round as a tree, its last plain round stepwise; a sampled
        # one takes native chain rounds where it does not draft)
        self.native = native and (not self.tree or self.K == 1 or self.shapes is not None or not params.greedy)
        self._shape_last: tuple | None = None   # (tree?, tokens, start) of the last round of a tree request
        self.running = running
        self._last: tuple | None = None   # (k, accepted, draft ms, start, rounds, verify ms) of the round(s) not yet timed
        # pipeline None: the policy picks chain or pipeline by measured speed (a fixed policy: the pipeline
        # where weights stream from memory); True / False: that shape only
        self.pipeline = self.native and (runner.streamed if pipeline is None else pipeline)
        both = self.native and pipeline is None
        # (greedy and sampled requests keep costs and an acceptance prior apart: a sampled round draws every
        # row, and its drafts agree less often)
        key = (self.d, self.V, self.exit is not None)
        sampled = not params.greedy
        self.policy = DraftPolicy(plan.draft_ahead, adaptive=adaptive, k_run=plan.draft_run,
                                  costs=round_costs(model, *key, self.pipeline and not both, sampled),
                                  pipeline_costs=round_costs(model, *key, True, sampled) if both else None,
                                  prefer_pipeline=self.pipeline)
        self.logprobs: list = []              # with params.logprobs: one entry per token of the last list yielded
        self.pending = -1
        self.stats = {"rounds": 0, "draft_tokens": 0, "proposed": 0, "accepted": 0, "emitted": 0,
                      "draft_s": 0.0, "verify_s": 0.0, "draft_passes": 0, "verify_positions": 0,
                      "compactions": 0, "batched_rounds": 0}

    # -- passes ---------------------------------------------------------------------------
    def _rows(self, start: int, n: int, last_loop: int, **kw) -> Rows:
        return Rows(table=self.table, start=start, n=n, last_loop=last_loop, window=self.plan.window, tag=self, **kw)

    def _draft(self, tokens: list[int], start: int, readout, **kw) -> Rows:
        """Prelude + loops 0..d-1 over `tokens` (their states kept for verification), then `readout`."""
        self.stats["draft_passes"] += 1
        return self._rows(start, len(tokens), self.d, tokens=tokens, capture=True, readout=readout, **kw)

    def _verify(self, e: torch.Tensor, h: torch.Tensor, start: int, **kw) -> Rows:
        """Loops d..V-1 from the draft's states, then the coda."""
        self.stats["verify_positions"] += h.shape[0]
        return self._rows(start, h.shape[0], self.V, state=(e, h), first_loop=self.d, readout="coda", **kw)

    def passes(self) -> Generator[Rows | list[int], None, None]:
        """The whole request: prefill, the first token, then rounds until max_tokens (stops are the
        caller's: it closes the generator)."""
        pick = self.sampler.head_pick() if self.params.logprobs is None else False
        last = yield from self.prefill(pick)
        self.logprobs = []
        if pick is not False:   # the head picked it itself (argmax, draw, grammar mask), as plain decoding's rows
            tok = last.argmax
        else:
            logits = self.model.logits(last.hidden[-1:][None])[0, 0]
            tok = self.sampler.sample(logits)
            self._logprob(logits, tok)
        self.sampler.accept(tok)
        self.pending = tok
        self.head.add([tok])
        yield [tok]
        emitted = 1
        try:
            while emitted < self.params.max_tokens:
                self.logprobs = []
                out = yield from self.round(self.params.max_tokens - emitted)
                emitted += len(out)
                yield out
        finally:   # (the last call is timed as it ends: its request with it; a probe of plain calls is one)
            self._time_last_chain()

    def prefill(self, pick=False) -> Generator[Rows, None, Rows]:
        """The prompt through all V loops (and, with a draft exit, the exit's entries from the prompt's
        loop-d states); returns the last rows run (their `hidden`: the final states). `pick`: unless False, the
        head picks the next token from the last position in the step's head call (`Rows.greedy`, `noise`:
        `Sampler.head_pick`), into the last rows' `argmax`."""
        prompt = list(self.plan.prompt_ids)
        last = None
        for s in range(self.cached, len(prompt), PREFILL_CHUNK):
            part = prompt[s:s + PREFILL_CHUNK]
            ends = s + PREFILL_CHUNK >= len(prompt) and pick is not False
            kw = {"greedy": True, "noise": pick} if ends else {}
            if self.exit is None:
                last = self._rows(s, len(part), self.V, tokens=part, **kw)
                yield last
            else:  # loops 0..d-1 and the exit, then loops d..V-1 from the loop-d states
                a = self._draft(part, s, self.exit_readout)
                yield a
                last = self._verify(*a.out_state, s, **kw)
                yield last
        self.length = len(prompt)
        return last

    def round(self, remaining: int) -> Generator[Rows, None, list[int]]:
        """One draft + verify round: returns the tokens it emits (1 .. min(remaining, draft_ahead + 1))."""
        ahead = min(self.plan.draft_ahead, remaining - 1)
        tree = self.native_tree and ahead > 0
        if tree and self.shapes is not None:
            now = time.perf_counter()
            if self._shape_last is not None:
                shape, n, t0 = self._shape_last
                self.shapes.update(shape, n, (now - t0) * 1000)
            tree = self.shapes.choose()
        if tree:
            out = yield from self._native_tree_round(ahead)
        elif self.native:
            out = yield from self._native_round(ahead, min(PIPELINE_RUN, remaining - 1),
                                                min(self.plan.draft_run, remaining - 1))
        else:
            out = yield from (self._tree_round(ahead) if self.tree else self._chain_round(ahead))
        if self.shapes is not None:
            self._shape_last = (tree, len(out), now) if self.native_tree and ahead > 0 else None
        self.head.add(out)
        self.pending = out[-1]
        st = self.stats
        st["rounds"] += 1
        st["emitted"] += len(out)
        return out

    def _full_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.logits(x[None])[0]  # (T, vocab)

    def _logprob(self, logits: torch.Tensor, tok: int) -> None:
        """Record `tok`'s log-probability under the verifier's `logits` row (call before `accept`)."""
        if self.params.logprobs is not None:
            self.logprobs.append(self.sampler.logprobs(logits, tok, self.params.logprobs))

    # -- draft choices ----------------------------------------------------------------------
    def _penalised(self, lg: torch.Tensor) -> torch.Tensor:
        """(n,) draft logits with the request's logit bias and penalties as of the round's start (float64)."""
        if not self.penalties:
            return lg.double()
        ids = self.head.ids[: self.head.n] if self.head.ids is not None else slice(None)
        return processed_logits(lg, self.params, self.sampler.seen[ids].nonzero().flatten(), self.sampler.counts[ids],
                                self._draft_cols())

    def _draft_cols(self) -> torch.Tensor | None:
        """The token id of each draft-head column (None: the full vocabulary)."""
        return None if self.head.ids is None else self.head.ids[: self.head.n].cpu()

    def _draft_pick(self, lg: torch.Tensor, j: int) -> int:
        """The draft's token at offset j of the round: the argmax of its row, or (sampling) the row's draw
        under the noise of output index n_out + j, the verifier's noise there."""
        if not self.params.greedy:   # the sampler's own rule (penalties, top-k/p, the grammar) on the full row
            return self.sampler.sample(self.head.full_logits(lg, self.model.cfg.vocab_size), ahead=j)
        x = self._penalised(lg)
        if self.sampler.matcher is not None:  # under a constraint: only what the grammar allows here
            x = self.sampler.matcher.mask_after([[]], x[None], self._draft_cols())[0]
        return self.head.token(int(torch.argmax(x)))

    def _chain_round(self, k: int):
        sampler = self.sampler
        L = self.length
        t0 = time.perf_counter()
        toks, es, hs = [self.pending], [], []
        backlog, self.exit_backlog = self.exit_backlog, None
        matcher, drafted = sampler.matcher, 0
        for j in range(k):
            draft = self._draft([toks[-1]], L + j, self.draft_readout, draft=self.head)
            if j == 0 and backlog is not None:  # position L-1's exit entry rides along with position L's
                # (the exit reads the state alone: the row's loop input, as wide as the model's, is not read)
                e_b = backlog if backlog.shape[-1] == self.model.loop_input_width else \
                    torch.cat([backlog, backlog.new_zeros(*backlog.shape[:-1], self.model.loop_input_width
                                                          - backlog.shape[-1])], dim=-1)
                catch_up = self._rows(L - 1, 1, self.d, state=(e_b, backlog), first_loop=self.d,
                                      readout=self.exit_readout)
                yield catch_up
                yield draft
            else:
                yield draft
            e, h = draft.out_state
            es.append(e)
            hs.append(h)
            lg = draft.draft_logits[0]
            x = self._draft_pick(lg, j)
            toks.append(x)
            if matcher is not None:  # the grammar follows the drafts (rolled back before verification)
                if x == matcher.eos or not matcher.allows(x):
                    break   # an end, or a token the verifier will refuse: nothing to draft past it
                matcher.accept(x)
                drafted += 1
            if self.draft_stop > 0 and j + 1 < k:
                top = float(torch.softmax(lg.float(), dim=-1).max())
                if top < self.draft_stop:
                    break
        n = len(toks) - 1
        draft = self._draft([toks[-1]], L + n, None)
        yield draft
        es.append(draft.out_state[0])
        hs.append(draft.out_state[1])
        t1 = time.perf_counter()
        verify = self._verify(torch.cat(es), torch.cat(hs), L)
        if matcher is not None:
            matcher.rollback(drafted)   # verification accepts (and so advances the grammar) token by token
        yield verify
        out = self._accept_chain(toks, verify.hidden)
        self.length = L + len(out)  # positions L .. L+len(out)-1 hold toks[0 .. len(out)-1]
        if self.exit is not None and len(out) == n + 1:
            self.exit_backlog = hs[-1]  # the last draft token was accepted: its exit entry is still due
        st = self.stats
        st["draft_s"] += t1 - t0
        st["verify_s"] += time.perf_counter() - t1
        st["draft_tokens"] += n
        st["proposed"] += n
        st["accepted"] += len(out) - 1
        return out

    def _native_round(self, cap: int, pipeline_cap: int, run_cap: int = 0):
        """A greedy round as one native call (chain or pipeline): the policy's k drafts, verification, head
        argmax. A chain round drafts at most `cap` (draft_ahead), or `run_cap` (draft_run: a request naming no
        draft_ahead, its drafts mostly accepted); a pipeline round keeps at most that many
        drafts in flight and runs on while they are accepted, up to `pipeline_cap` drafts in all. In a
        crowded batch, one plain row of the shared step instead (its rows share the batch's weight passes;
        a round of its own would not). A draft exit's entries of such positions are not written: later
        drafts attend to them as the pool holds them, which changes proposals only, never the output."""
        now = self._time_last_chain()
        if self.running is not None and self.running() > ALONE_UP_TO:
            return (yield from self._plain_row(batched=True))
        # (the rounds a call holds while this request runs alone: a call's own cost is shared among them; the tokens
        # it may still make: the check of whether drafting pays probes plain calls at its tail)
        self.policy.held = CHAIN_ROUNDS if self.running is None or self.running() == 1 else 1
        self.policy.room = min(self.plan.params.max_tokens - self.sampler.n_out, self.plan.max_positions - self.length)
        k = self.policy.choose(cap, pipeline_cap, run_cap)
        if len(self.policy.tables) == 2:   # the policy picks the shape too
            self.pipeline = self.policy.pipeline
        if k == 0:   # no draft: the plain row plain decoding runs (a round of one call of its own cost ~15% more)
            alone = self.running is None or self.running() == 1
            room = min(self.plan.params.max_tokens - self.sampler.n_out, self.plan.max_positions - self.length)
            n = self.policy.plain_run(min(PLAIN_STEPS, room)) if alone else 1
            if n > 1:   # the plain rounds the policy holds until its next probe, in one call (as generate's)
                call = NativeSteps(self, n)
                yield call
                out = call.result
                for y in out:
                    self.sampler.accept(y)
                self.length, self.exit_backlog = self.length + len(out), None
                self._last = (0, 0, 0.0, now, len(out), 0.0)
                return out
            out = yield from self._plain_row(batched=False)
            self._last = (0, 0, 0.0, now, 1, 0.0)   # (its whole cycle is plain's cost for the policy)
            return out
        call = NativeRound(self, k)
        alone = self.running is None or self.running() == 1
        if alone and not self.pipeline:   # the rounds the policy holds at this k, in one call (CHAIN_ROUNDS)
            room = min(self.plan.params.max_tokens - self.sampler.n_out, self.plan.max_positions - self.length)
            call.rounds = self.policy.chain_run(k, min(CHAIN_ROUNDS, room // (k + 1)))
        yield call
        res = call.result
        if "emitted" in res:   # the pipeline: its output as verified (it stops drafting at its first rejection:
            outs = [res["emitted"]]   # it proposed the drafts it tested), every exit entry written
            made = tested(k, len(outs[0]) - 1)
        elif "outs" in res:   # several chain rounds: each one's output
            outs, made = res["outs"], k
        else:   # one chain round: the accepted drafts, then the verifier's token
            toks, ys = res["tokens"], res["verify"]
            n = next(j for j in range(k + 1) if j == k or ys[j] != toks[j + 1]) + 1
            outs, made = [ys[:n]], k
        out = [y for o in outs for y in o]
        for y in out:
            self.sampler.accept(y)
        # a chain round whose drafts were all accepted leaves the last draft's exit entry due
        self.exit_backlog = res["last_h"] if "emitted" not in res and self.exit is not None \
            and len(outs[-1]) == k + 1 else None
        self.length += len(out)
        # timed when the next round starts: a round's Python, scheduling and emission count with it (a few
        # tenths of a ms, as much as a loop on the shipped model, and paid once per call, not per token)
        self._last = (k, [len(o) - 1 for o in outs], res["draft_ms"], now, len(outs), res["verify_ms"])
        st = self.stats
        st["rounds"] += len(outs) - 1   # (round() counts one)
        st["draft_s"] += res["draft_ms"] / 1000
        st["verify_s"] += res["verify_ms"] / 1000
        st["draft_tokens"] += made * len(outs)
        st["proposed"] += made * len(outs)
        st["accepted"] += len(out) - len(outs)
        st["draft_passes"] += (made + 1) * len(outs)
        st["verify_positions"] += (made + 1) * len(outs)
        return out

    def _time_last_chain(self) -> float:
        """The policy learns the last call's cost, its whole cycle up to now (the engine's step included), if
        it is not yet timed: a plain call's per round; a drafting call's native draft and verification times
        per round, and apart from them the call's own cost (its Python, scheduling and emission), which a call
        of several rounds pays once (`RoundCosts.call`). Returns now."""
        now = time.perf_counter()
        if self._last is not None:
            k0, accepted0, draft_ms0, t0, rounds, verify0 = self._last   # (rounds: rounds run as one call)
            cycle = (now - t0) * 1000
            accepted0 = accepted0 if isinstance(accepted0, list) else [accepted0]   # (each round's)
            if k0 > 0:
                self.policy.costs.call(max(0.0, cycle - draft_ms0 - verify0))
                for acc in accepted0:
                    self.policy.update(k0, acc, draft_ms0 / rounds, verify0 / rounds)
            else:   # (a plain call's own cost is shared by the steps a call holds: PLAIN_STEPS while alone)
                call = self.policy.costs.call_ms
                held = PLAIN_STEPS if self.policy.held > 1 else 1
                for acc in accepted0:
                    self.policy.update(k0, acc, 0.0, max(0.0, cycle - call) / rounds + call / held)
            # (and what the call realized, for the check of whether drafting pays at all: PlainCheck)
            self.policy.timed(k0, sum(a + 1 for a in accepted0) if k0 > 0 else rounds, cycle,
                              full=k0 > 0 or rounds == PLAIN_STEPS)
            self._last = None
        return now

    def _plain_row(self, batched: bool):
        """A plain row of the shared step, its token from the step's one head call: past ALONE_UP_TO running
        sequences (`batched`), or where the policy drafts nothing. Its draft-exit entry is not written (later
        drafts attend to the pool as it is: proposals change, never the output)."""
        L = self.length
        row = self._rows(L, 1, self.V, tokens=[self.pending], readout="coda", greedy=True,
                         noise=self.sampler.draw_params() if not self.params.greedy else None)
        yield row
        y = row.argmax
        self.sampler.accept(y)
        self.length, self.exit_backlog = L + 1, None
        if batched:
            self.stats["batched_rounds"] += 1
        return [y]

    def _accept_chain(self, toks: list[int], x: torch.Tensor) -> list[int]:
        """toks = [pending, x1..xn]; row j of x (coda output) scores the token after toks[j]. The verifier's
        token at each position (its argmax, or its draw under that position's noise), accepted drafts while
        they agree, then the first disagreement (or the bonus token)."""
        sampler = self.sampler
        n = len(toks) - 1
        out: list[int] = []
        if self.argmax is not None:
            ys = self.argmax(x)
        else:
            logits = self._full_logits(x)  # (n+1, vocab)
        for j in range(n + 1):
            y = ys[j] if self.argmax is not None else sampler.sample(logits[j])
            if self.argmax is None:
                self._logprob(logits[j], y)
            sampler.accept(y)
            out.append(y)
            if j < n and y == toks[j + 1]:
                continue
            return out
        raise AssertionError("unreachable")

    def finish(self, run_stats: dict[str, Any]) -> None:
        st = self.stats
        rounds = max(st["rounds"], 1)
        run_stats.update({
            "acceptance_rate": round(st["accepted"] / st["proposed"], 4) if st["proposed"] else 0.0,
            "mean_accepted_per_round": round(st["accepted"] / rounds, 3),
            "mean_tokens_per_round": round(st["emitted"] / rounds, 3),
            "rounds": st["rounds"],
            "proposed_tokens": st["proposed"],
            "accepted_tokens": st["accepted"],
            "draft_tokens": st["draft_tokens"],
            "verify_positions": st["verify_positions"],
            "draft_ms": round(st["draft_s"] * 1000, 2),
            "verify_ms": round(st["verify_s"] * 1000, 2),
            "draft_loops": self.d,
            "verify_loops": self.V,
            "draft_ahead": self.plan.draft_ahead,
            "K_branches": self.K,
            "draft_exit": self.exit is not None,
            "native_rounds": self.native or self.native_tree,
        })
        if self.policy.chosen:   # (kept as running sums: this runs after every round)
            pol = self.policy
            run_stats["draft_ahead_chosen"] = round(pol.k_sum / len(pol.chosen), 3)   # the policy's mean k per round
            run_stats["plain_rounds"] = pol.plain_rounds
        if self.shapes is not None:   # a tree request's rounds by shape
            run_stats["tree_rounds"], run_stats["chain_rounds"] = self.shapes.counts[True], self.shapes.counts[False]
        if st["batched_rounds"]:
            run_stats["batched_rounds"] = st["batched_rounds"]   # plain rows in a crowded shared step


def speculative_layout(model: LoopedTransformer, plan, draft_exit: bool = True) -> SlotLayout:
    """The cache slots of a speculative sequence: the verifier's loops, plus its draft exit's blocks."""
    exits = getattr(model, "draft_exits", None) or {}
    ex = exits.get(plan.draft_loops) if draft_exit else None
    return SlotLayout(model.cfg, plan.loops, len(ex.coda) if ex is not None else 0)
