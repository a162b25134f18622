"""How long a greedy speculative round drafts: the measured costs of a round on this host (`RoundCosts`, one
per model and setting) and each request's choice of draft length from them and its acceptance
(`DraftPolicy`). docs/speculative.md, "A greedy round in one native call"."""

from __future__ import annotations

import math
import statistics
import time
import weakref
from collections import deque

from ..model import LoopedTransformer
from .plain_check import PlainCheck


class RoundCosts:
    """What a greedy native round costs on this host for one (model, draft_loops, verify_loops, draft exit):
    the time of one draft and of a verification by draft length k. Shared by every request of the model
    (`round_costs`): a property of the machine and the model, not of the request."""

    WINDOW = 9   # the recent samples a cost is the median of
    PRIOR_DRAFTS = 20   # the most drafts' worth a kept acceptance weighs in a later process
    CALIBRATE = 8   # rounds' worth of evidence that a length's yield is as predicted (`calibration`)

    def __init__(self):
        self.draft_ms: float | None = None
        self.verify_ms: dict[int, float] = {}
        self.call_ms = 0.0   # a drafting call's own cost: its cycle less its native draft and verification
        self._drafts: deque[float] = deque(maxlen=self.WINDOW)
        self._verifies: dict[int, deque[float]] = {}
        self._calls: deque[float] = deque(maxlen=self.WINDOW)
        self.accepted = self.proposed = 0.0   # decayed sums over every request's drafting rounds
        self._yields: dict[int, list[float]] = {}   # k -> decayed [tokens yielded, tokens predicted, rounds]
        self.check = PlainCheck()   # (the chain table's is the setting's: whether drafting pays at all, measured)
        self.setting: str | None = None   # its key in the kept table (None: not kept: `round_costs`)
        self.to_restore = False   # a new table the runner has not yet started from the kept costs
        self.kept_at: float | None = None   # when this process last kept it (`due`), and the rounds since
        self.rounds_since_kept = 0

    def observe(self, k: int, accepted: int) -> None:
        if k > 0:
            self.accepted = 0.95 * self.accepted + accepted
            self.proposed = 0.95 * self.proposed + tested(k, accepted)

    def observe_yield(self, k: int, accepted: int, predicted: float) -> None:
        """A round of k drafts yielded accepted + 1 tokens where `predicted` were expected."""
        y = self._yields.setdefault(k, [0.0, 0.0, 0.0])
        y[0], y[1], y[2] = 0.95 * y[0] + accepted + 1, 0.95 * y[1] + predicted, 0.95 * y[2] + 1

    def calibration(self, k: int) -> float:
        """What rounds of k drafts have yielded against what the requests' acceptances predicted for them
        (decayed over the model's requests; 1 until measured, drawn toward 1 by CALIBRATE rounds' worth). A
        request's acceptance is a few decayed drafts and a two-state chain: on the shipped model it predicted
        4.0 tokens for k = 4 rounds that yielded 4.4 and nearly right for k = 2, so long drafts lost to short
        ones they beat; the ratio corrects such a bias by length, the acceptance still follows the request."""
        y = self._yields.get(k)
        if not y or y[1] <= 0:
            return 1.0
        prior = self.CALIBRATE * y[1] / y[2]   # (CALIBRATE rounds of the mean prediction, yielding as predicted)
        return (y[0] + prior) / (y[1] + prior)

    def call(self, ms: float) -> None:
        """A drafting call's own cost (Python, scheduling, emission): paid once by a call of several rounds."""
        self._calls.append(ms)
        self.call_ms = statistics.median(self._calls)

    def prior(self) -> float | None:
        """The acceptance of this model's recent drafts, across requests (None before any)."""
        return self.accepted / self.proposed if self.proposed > 0 else None

    def update(self, k: int, draft_ms: float, verify_ms: float) -> None:
        """A round's measured times. Each cost is the median of its last WINDOW samples: a round the OS
        preempted (2-4 ms more on a 2-core host with anything else running, every few rounds) moves a mean
        for many rounds and would keep the draft length it happened to hit out of the choice."""
        if k > 0:
            self._drafts.append(draft_ms / k)
            self.draft_ms = statistics.median(self._drafts)
        q = self._verifies.setdefault(k, deque(maxlen=self.WINDOW))
        q.append(verify_ms)
        self.verify_ms[k] = statistics.median(q)
        self.rounds_since_kept += 1

    def kept(self) -> dict:
        """What a later process starts from (`due`): the costs this process measured (each the median of its
        window), a call's own cost, the acceptance's and the yields' decayed sums. Not the plain check's verdict: a
        process that found drafting losing under a neighbour would leave the next one decoding plain, and a short
        request never probes back. Not a cost only carried over: what no round here measured is not passed on."""
        return {"draft": self.draft_ms if self._drafts else None,
                "verify": {str(k): self.verify_ms[k] for k, q in self._verifies.items() if q},
                "call": self.call_ms if self._calls else None, "accepted": self.accepted, "proposed": self.proposed,
                "yields": {str(k): y for k, y in self._yields.items()}}

    def restore(self, kept: dict) -> None:
        """Start from what an earlier process kept (`kept`): its costs as estimates only, no samples (`samples` stays
        0, so the policy explores each soon, and a round's first measurement replaces it: a cost kept from a busy
        minute must not keep its length out, as three kept samples did, counted as measured), its acceptance as the
        prior worth at most PRIOR_DRAFTS drafts and its yields at most CALIBRATE rounds. Anything malformed is left
        out whole."""
        try:
            draft = None if kept["draft"] is None else float(kept["draft"])
            verifies = {int(k): float(v) for k, v in kept["verify"].items()}
            call = None if kept["call"] is None else float(kept["call"])
            accepted, proposed = float(kept["accepted"]), float(kept["proposed"])
            yields = {int(k): [float(x) for x in y] for k, y in kept["yields"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            return
        costs = [x for x in (draft, call) if x is not None] + list(verifies.values())
        if not all(math.isfinite(x) and x > 0 for x in costs) or not 0 <= accepted <= proposed \
                or any(len(y) != 3 or min(y) < 0 for y in yields.values()):
            return
        self.draft_ms = draft
        self.verify_ms.update(verifies)
        self.call_ms = call or 0.0
        scale = min(1.0, self.PRIOR_DRAFTS / proposed) if proposed > 0 else 0.0
        self.accepted, self.proposed = accepted * scale, proposed * scale
        for k, y in yields.items():
            f = min(1.0, self.CALIBRATE / y[2]) if y[2] > 0 else 0.0
            self._yields[k] = [v * f for v in y]

    def samples(self, k: int) -> int:
        """How many rounds of k drafts the cost of k is the median of."""
        return len(self._verifies.get(k, ()))

    def verify(self, k: int) -> float:
        """Measured, or estimated: k = 0 (one plain pass) only from itself; k >= 1 from the nearest measured
        k >= 1 plus the slope between the smallest and largest of them (flat while only one is known: the
        policy then tries the longer draft and measures it)."""
        if k in self.verify_ms:
            return self.verify_ms[k]
        seen = sorted(s for s in self.verify_ms if s >= 1)
        if k == 0 or not seen:
            return min(self.verify_ms.values())
        near = min(seen, key=lambda s: (abs(s - k), s))
        lo, hi = seen[0], seen[-1]
        slope = max(0.0, (self.verify_ms[hi] - self.verify_ms[lo]) / (hi - lo)) if hi > lo else 0.0
        return self.verify_ms[near] + slope * (k - near)


def tested(k: int, accepted: int) -> int:
    """The drafts a round of k put to the test: the accepted ones and the first rejected one. Drafts after
    a rejection are never checked, so counting them as failures would bias the acceptance low, the more
    the longer the draft (a geometric acceptance's maximum-likelihood estimate counts these)."""
    return min(k, accepted + 1)


def head_chunk(costs: list[float], a: float, n: int) -> int:
    """Rows per head call in a chain round's lazy verification (`tl_round.head_rows`): row j of the k + 1 = n
    is scored only if the drafts before it were all accepted (probability a^j at acceptance a), and a call
    scores `c` rows at once at costs[c - 1] ms (the head's measured cost by rows on this host). Returns the c
    with the least expected head time: pairs where the rows cost their own arithmetic (AVX2: at a = 0.9 and
    k = 4, 1.52 ms against 1.67 for one call), all rows in one call where a call costs little more than one
    row (AMX tiles: 0.61 against 1.15). Speed only: a head row is bitwise the same in any call."""
    best, best_ms = 2, float("inf")
    for c in range(1, n + 1):
        ms = sum(a ** j * costs[min(c, n - j, len(costs)) - 1] for j in range(0, n, c))
        if ms < best_ms - 1e-9:
            best, best_ms = c, ms
    return best


_ROUND_COSTS: "weakref.WeakKeyDictionary[LoopedTransformer, dict]" = weakref.WeakKeyDictionary()


KEEP = True          # round costs kept for the next process on this host (`due`; tests/conftest.py: off)
KEEP_EVERY = 10.0    # seconds between two writes of one table by a process (the first request's end writes)


def _setting(key: tuple) -> str:
    d, V, exit, pipeline, sampled = key
    return f"d{d} V{V} exit {int(exit)} pipeline {int(pipeline)} sampled {int(sampled)}"


def round_costs(model: LoopedTransformer, d: int, V: int, exit: bool, pipeline: bool = False,
                sampled: bool = False) -> RoundCosts:
    """The model's table for one setting and round shape; greedy and sampled rounds apart (a sampled round
    draws each row under its noise, and its drafts are accepted less often: neither should steer the other).
    A chain table has a `setting` (its key among the kept costs): the batch runner starts a new one from what an
    earlier process on this host kept for it before the request's first round (`BatchRunner.prepare`), and keeps it
    at a request's end (`due`, `BatchRunner.finish`). Without it each `tinyloop generate` process spent its one
    request finding the draft length (measured on the shipped model, 64 tokens: ~35.7 ms against ~30.5 with the
    costs known, plain ~35.6)."""
    table = _ROUND_COSTS.setdefault(model, {})
    key = (d, V, exit, pipeline, sampled)
    costs = table.get(key)
    if costs is None:
        costs = table[key] = RoundCosts()
        # (not a pipeline table's: a pipeline round's time by k depends on where its drafts stopped being accepted;
        # kept costs of 1.9 ms for 9 drafts in flight drew a later process through one pipeline length after another)
        costs.setting = None if pipeline or not KEEP else _setting(key)
        costs.to_restore = costs.setting is not None
    return costs


def due(model: LoopedTransformer) -> list[tuple[str, dict]]:
    """The model's tables to keep now for the next process, as (setting, `RoundCosts.kept()`): each keepable table
    that measured a round since it was last kept, at most once per KEEP_EVERY seconds (marked kept here)."""
    if not KEEP:
        return []
    now, out = time.monotonic(), []
    for costs in _ROUND_COSTS.get(model, {}).values():
        if costs.setting is not None and costs.rounds_since_kept \
                and (costs.kept_at is None or now - costs.kept_at >= KEEP_EVERY):
            out.append((costs.setting, costs.kept()))
            costs.kept_at, costs.rounds_since_kept = now, 0
    return out


class DraftPolicy:
    """Each round's draft length k in 0..k_max (and, where the executor offers both, its shape: a chain
    round or depth-aligned passes), from what this request's rounds accepted and what rounds cost on this
    host (`RoundCosts`, shared by the model's requests). Greedy rounds only: any k and either shape give the
    same tokens, so the choice changes the speed and never the output.

    A round of k drafts yields E(k) = 1 + p1 (1 + p + ... + p^(k-1)) tokens on average when a round's first
    draft is accepted with probability p1 and a draft after an accepted one with probability p (`expected`:
    the decayed acceptances of this request's drafting rounds, with Jeffreys' prior, both starting from the
    model's recent acceptance across requests, worth PRIOR drafts; p1 = p is the geometric 1 + a + ... + a^k
    of sessions 13-22) times what rounds of k have yielded against such predictions across the model's
    requests (`RoundCosts.calibration`), and costs k x (one draft's time) + the verification of k + 1
    positions (native times; a pipeline round: its whole time, by k) + a call's own cost (its Python,
    scheduling and emission, measured apart) over the rounds a call holds (`held`: CHAIN_ROUNDS while the
    request runs alone), the same for every k: charged to the round that paid it, a length tried in a call
    of its own lost to the length in use, and which length led first decided where a request settled.
    The policy takes the (shape, k) with the most tokens per millisecond, and k = 0 (plain decoding in one
    call) only where it is faster than that (by a margin as large as the acceptance times MARGIN - 1);
    while it is chosen,
    a round with one draft is tried now and then (after 8, 16, .., 64 rounds) so that a request whose
    drafts start to agree gets speculation back; while drafting pays, every 8th round takes another
    (shape, 1..draft_ahead) in turn, among those whose rate is within EXPLORE_WITHIN of the best or whose cost
    has fewer than 3 samples (every 64th round among all), so that a cost measured once under load (or not
    yet: costs are not monotonic in k, the kernels' row tiles are 4 x 2) does not keep a choice out for good;
    once the best and the choices near it are timed over a whole window, every 32nd round (SETTLED). At a
    request's last tokens, with drafts mostly accepted, a round drafts all that remains (one call ends it). Until a
    shape's rounds have been timed, its round drafts one token (a failed round of many drafts costs
    several plain tokens on a model whose depths disagree); then, until it is timed, a plain round.

    Over all of it, while the request runs alone, the check of whether drafting pays at all (`PlainCheck`, the
    model's): the choice above stands where drafting calls have realized more tokens a ms than plain calls over the
    same stretch (whole cycles, means: a busy host's preemption included), and gives way to plain calls where they
    have not, each mode probed now and then (`_checked`, `timed`)."""

    DECAY = 0.95
    EXPLORE = 8
    EXPLORE_WITHIN = 0.8
    PRIOR = 16
    MARGIN = 1.1
    LONG_RUN = 0.8
    RUN_ACCEPT = 0.95   # a chain's long run (draft_run) is weighed from this acceptance estimate on
    SETTLED = 4
    TIE = 0.05

    def __init__(self, k_max: int, adaptive: bool = True, costs: RoundCosts | None = None,
                 pipeline_costs: RoundCosts | None = None, prefer_pipeline: bool = False, k_run: int = 0):
        """`pipeline_costs`: the pipeline's table where the executor has it (None: chain rounds only);
        `prefer_pipeline`: the shape a fixed (non-adaptive) policy takes; `k_run`: the longest chain round,
        weighed beside 1..k_max while drafts are mostly accepted (RequestPlan.draft_run; <= k_max: none)."""
        self.k_max, self.adaptive, self.k_run = k_max, adaptive, k_run
        self.rounds = 0
        self.tables = {False: costs or RoundCosts()}
        if pipeline_costs is not None:
            self.tables[True] = pipeline_costs
        self.pipeline = prefer_pipeline and pipeline_costs is not None   # the shape of the round chosen last
        self.pipeline_only = prefer_pipeline and pipeline_costs is None   # (its one table is the pipeline's)
        self.prime()
        self.idle, self.probe_every = 0, 8
        self.explore_every = self.EXPLORE
        self.chosen: list[int] = []
        self.k_sum = self.plain_rounds = 0   # (the sum of chosen and its zeros, kept as they come)
        self.held = 1   # the chain rounds a call holds (the speculator sets it: CHAIN_ROUNDS while alone)
        self._predicted: float | None = None   # the tokens the last choice's rounds were expected to yield
        self.check = self.tables[False].check   # whether drafting pays at all, measured (the model's, per setting)
        # what the call chosen last is for the check: "draft" (the length chosen), "plain" (plain calls, the check
        # holding them or the length chosen being 0), "probe" (of the mode not in use), None (not counted: the
        # first rounds, a probe of one draft for acceptance)
        self._call: str | None = None
        self._probing = False   # (this request's calls are the check's probe)
        self.fresh = True   # no plain call yet in this request (its draft-exit entries are whole)
        self.room = 1 << 30   # the tokens the request may still make (the speculator sets it)

    @property
    def costs(self) -> RoundCosts:
        return self.tables[self.pipeline]

    @property
    def acceptance(self) -> float:
        return (self.acc + 0.5) / (self.prop + 1.0)   # Jeffreys' prior: one failed draft is evidence

    def expected(self, k: int) -> float:
        """Tokens a round of k drafts yields on average: 1 + p1 (1 + p + ... + p^(k-1)), p1 the acceptance of a
        round's first draft and p of a draft after an accepted one (each decayed, Jeffreys' prior): a two-state
        chain, where a geometric acceptance (p1 = p) undervalued long drafts on the shipped model, whose drafts
        agree in runs (k = 4 rounds yielded 4.4 tokens where one acceptance of 0.89 predicts 4.0)."""
        p1 = (self.first[0] + 0.5) / (self.first[1] + 1.0)
        p = min((self.cont[0] + 0.5) / (self.cont[1] + 1.0), 0.999)
        return 1.0 + p1 * sum(p ** i for i in range(k))

    def prime(self) -> None:
        """A new request starts from the model's recent acceptance, worth PRIOR drafts of evidence (its own rounds
        outweigh it within a few rounds); before any, Jeffreys' prior alone. Again once the runner has started the
        tables from kept costs (`BatchRunner.prepare`), before any round."""
        p = self.tables[False].prior()
        self.acc, self.prop = (self.PRIOR * p, float(self.PRIOR)) if p is not None else (0.0, 0.0)
        # the same evidence split by position in a round: a round's first draft, and the drafts after an accepted
        # one (agreement comes in runs: a draft after an accepted one is accepted more often than a first one)
        self.first = [self.acc, self.prop]
        self.cont = [self.acc, self.prop]

    @staticmethod
    def _timed(c: RoundCosts) -> bool:
        return c.draft_ms is not None and any(s >= 1 for s in c.verify_ms)

    def choose(self, cap: int, pipeline_cap: int | None = None, run_cap: int = 0) -> int:
        """This round's k (and `pipeline`): chain rounds draft at most `cap` (within k_max), or one run of
        `run_cap` (within k_run) past it; pipeline rounds, whose drafts in flight the executor bounds by k_max,
        at most `pipeline_cap` in all (None: `cap`)."""
        cap = max(0, min(cap, self.k_max))
        run_cap = max(0, min(run_cap, self.k_run))
        pipeline_cap = cap if pipeline_cap is None else max(0, pipeline_cap)
        self._call = None
        if not self.adaptive:
            self._chose(cap)
            return cap
        # (the pipeline's warm-up waits for a draft to be accepted: on a model whose depths disagree it
        # would only cost)
        untimed = [p for p, c in self.tables.items() if not self._timed(c) and (not p or self.acc > 0)]
        if untimed:
            self.pipeline, k = untimed[0], min(cap, 1)
        elif 0 not in self.tables[False].verify_ms and cap > 0:
            # plain's own cost, once per model and setting (a plain round is never slower than plain): the
            # choice below weighs every draft length against it, and an estimate of it from other rounds
            # (a pipeline round of one draft costs about a plain token) could keep k = 1 forever
            self.pipeline, k = False, 0
        else:
            a = min(self.acceptance, 0.999)
            accept_probe = False
            best, best_rate = (False, 0), -1.0
            rates = {}
            for pipe, c in self.tables.items():
                if not self._timed(c):
                    continue
                # a pipeline weighs 1..cap drafts and, past them, one run to its cap (not every length between:
                # among many noisy rates the best is the luckiest, and the lengths past cap differ only in
                # where a run may stop), and that only while drafts rarely fail (acceptance >= LONG_RUN: at 0.65
                # a run of 16 yields 2.86 tokens against 2.54 for 4, a gain the costs' noise swamps; the
                # 1.3B value-embedding shape measured 0.82-0.97x plain with it, 0.92-0.99 without)
                ks = list(range(1, cap + 1))
                if (pipe or self.pipeline_only) and pipeline_cap > cap and a >= self.LONG_RUN:
                    ks.append(pipeline_cap)
                elif not pipe and not self.pipeline_only and run_cap > cap and a >= self.RUN_ACCEPT:
                    # a chain's long run likewise (a request naming no draft_ahead): on a depth-agreeing 4B nGPT
                    # shape a round of 8 drafts yields 9 tokens in 1.6x a round of 4's time (docs/
                    # speculative.md), where drafting only 1..4 held speculation to 1.19-1.38x plain
                    ks.append(run_cap)
                # (a call's own cost, by the rounds a call of this shape holds: the same for every k, so that
                # a length tried in a call of its own is not charged a whole call against a held one's share)
                call = c.call_ms / (1 if pipe else self.held)
                for k in ks:
                    rate = rates[pipe, k] = self.expected(k) * c.calibration(k) / (k * c.draft_ms + c.verify(k) + call)
                    if rate > best_rate * (1 + 1e-9):
                        best, best_rate = (pipe, k), rate
            # among near ties (within TIE of the best rate, the same shape) the longest: a request's acceptance is a
            # few decayed drafts, and a draft too long costs little (past the best length the rate falls slowly)
            # while one too short costs much (the shipped model at two threads, fixed k: 29.6 ms a 64-token
            # request at k = 2, 26.6 at 3, 25.7 at 4, 25.2 at 5, 25.6 at 6)
            # (a pipeline's run past cap gives way to a near tie within it; a chain's long run is one of the ties:
            # weighed only at acceptance >= RUN_ACCEPT, where a run too long costs little)
            if best[1] > 0:
                best = max((o for o, r in rates.items() if o[0] == best[0] and (o[1] <= cap or not o[0])
                            and r >= (1 - self.TIE) * best_rate), key=lambda o: o[1], default=best)
            # k = 0 (the chain's plain pass) teaches nothing about the drafts: where they have been accepted
            # it is taken only when it beats the best draft length clearly (by MARGIN at acceptance 1), not on
            # a near tie that one unlucky round produced; where they keep failing, on any lead
            drafting = best   # (what a probe of drafting takes where the check holds plain calls)
            if 1.0 / self.tables[False].verify(0) > best_rate * (1.0 + (self.MARGIN - 1.0) * a):
                best = (False, 0)
            if 0 < best[1] < cap < self.k_max and a >= self.LONG_RUN:
                # the request's last tokens (cap = remaining - 1): a round of cap drafts can end it in this
                # call; a shorter one, whatever its rate, leaves a call more to make (k = 1 then a plain round
                # cost 1 ms more than k = 2 at the end of a 64-token request, ~2% of it)
                best = (best[0], cap)
            self.pipeline, k = best
            self.rounds += 1
            # once the best and every choice near it are timed over a whole window (the model's table: other
            # requests' rounds count), they are explored SETTLED times less often: an exploring round costs its
            # rate's shortfall and a call of its own (the chain call before it ends early)
            settled = all(self.tables[o[0]].samples(o[1]) >= RoundCosts.WINDOW for o, r in rates.items()
                          if o == best or (r >= self.EXPLORE_WITHIN * best_rate and o[1] <= self.k_max))
            self.explore_every = self.EXPLORE * (self.SETTLED if settled else 1)
            if k > 0 and self.rounds % self.explore_every == 0:   # now and then another choice, so that no stale
                # or missing cost keeps one out: every EXPLORE-th round one that may be as fast (its rate
                # within EXPLORE_WITHIN of the best, or its cost measured fewer than 3 times), every
                # EXPLORE * 8-th any; the rounds spent on choices at half the best rate cost ~6% before
                # (a pipeline run past draft_ahead is tried for its few samples only where its extrapolated
                # rate is near)
                near = [o for o, r in rates.items() if o != best and
                        (r >= self.EXPLORE_WITHIN * best_rate or
                         (o[1] <= self.k_max and self.tables[o[0]].samples(o[1]) < 3))]
                pool = near if near and self.rounds % (8 * self.EXPLORE) else [o for o in rates if o != best]
                if pool:
                    self.pipeline, k = pool[(self.rounds // self.EXPLORE) % len(pool)]
            elif k == 0 and cap > 0 and (self.held <= 1 or self.check.drafting):
                # (where the check holds plain calls, its own probes of drafting stand for these)
                self.idle += 1
                if self.idle >= self.probe_every:
                    self.idle, self.probe_every = 0, min(64, 2 * self.probe_every)
                    k = 1
                    accept_probe = True
            elif k > 0:
                self.idle, self.probe_every = 0, 8
            if self.held > 1 and not accept_probe:   # (one draft for its acceptance is not what drafting realizes)
                k = self._checked(k, drafting)
        if k == 0:
            self.pipeline, self.fresh = False, False
        self._predicted = self.expected(k) if k else None
        self._chose(k)
        return k

    def _checked(self, k: int, drafting: tuple[bool, int]) -> int:
        """The length chosen, under the check (`PlainCheck`) while the request runs alone: drafting (k > 0) gives
        way to plain calls where the check holds them, and each mode to a probe of the other when one is due: of
        plain calls at the request's last TAIL tokens (`room`), to its end; of drafting, PROBE tokens at its start,
        at `drafting`, the best (shape, length) by the rates (whatever they say of plain: under the check they decide
        nothing there). Plain calls write no draft-exit entries, and a draft after them attends to what the pool
        holds there: one probe of eight plain tokens took the drafts' acceptance over the rest of a request from
        0.81-0.87 to 0.76-0.78, so probes go where no draft comes after (plain) or none came before (drafting), or,
        a probe overdue (the requests end first), where they are. Sets `_call`."""
        chk = self.check
        if chk.drafting:
            if self._probing or k > 0 and chk.due() and (self.room <= chk.TAIL or chk.overdue()):
                k, self._call, self._probing = 0, "probe", True
            else:
                self._call = "plain" if k == 0 else "draft"
            return k
        if drafting[1] > 0 and (self._probing and chk.probe[1] < chk.PROBE or
                                chk.due() and (self.fresh or chk.overdue())):
            self.pipeline, k = drafting
            self._call, self._probing = "probe", True
        else:
            k, self._call, self._probing = 0, "plain", False
        return k

    def timed(self, k: int, tokens: int, cycle_ms: float, full: bool = True) -> None:
        """The last call's tokens and whole cycle (until the next one starts: the engine's step, scheduling and
        emission included), for the check, while the request runs alone; `full`: a plain call of all the steps a
        call of plain rounds holds (a shorter one pays its call's own cost for fewer tokens)."""
        call, self._call = self._call, None
        if call is None or self.held <= 1 or (k == 0 and not full):
            return
        self.check.record(k > 0, tokens, cycle_ms, probe=call == "probe")

    def plain_run(self, most: int) -> int:
        """After `choose` gave k = 0: how many plain rounds in a row it would give before its next probe (at
        most `most`, at least 1), counted as chosen now so that they can run as one call."""
        if most <= 1:
            return 1
        if not self.adaptive:
            n = most
        elif self._call == "probe" or self._call == "plain" and not self.check.drafting:
            n = most   # (the check's plain calls, and its probe of them: whole calls, as plain decoding makes)
            self.rounds += n - 1
        elif self.idle == 0:   # (timing plain's cost, or a probe just reset the count: one round)
            return 1
        else:
            n = max(1, min(most, self.probe_every - self.idle))
            self.idle += n - 1
            self.rounds += n - 1
        for _ in range(n - 1):
            self._chose(0)
        return n

    def chain_run(self, k: int, most: int) -> int:
        """After `choose` gave k >= 1: how many rounds at k to run back to back in one call (at most `most`, at
        least 1), up to the next round that explores another choice, counted as chosen now."""
        n = max(1, most)
        if self.adaptive:
            e = self.explore_every
            n = min(n, e - self.rounds % e) if self.rounds % e else 1
        for _ in range(n - 1):
            self._chose(k)
        self.rounds += n - 1
        return n

    def _chose(self, k: int) -> None:
        self.chosen.append(k)
        self.k_sum += k
        self.plain_rounds += k == 0

    def update(self, k: int, accepted: int, draft_ms: float, verify_ms: float) -> None:
        """The round just run (of the shape `pipeline` says)."""
        if k > 0:   # (evidence ages only as new evidence comes: plain rounds say nothing about drafts)
            self.acc = self.DECAY * self.acc + accepted
            self.prop = self.DECAY * self.prop + tested(k, accepted)
            self.first = [self.DECAY * self.first[0] + (accepted > 0), self.DECAY * self.first[1] + 1]
            self.cont = [self.DECAY * self.cont[0] + max(0, accepted - 1),
                         self.DECAY * self.cont[1] + tested(k, accepted) - 1]
        self.tables[False].observe(k, accepted)
        if k > 0 and self._predicted is not None:
            self.costs.observe_yield(k, accepted, self._predicted)
        self.costs.update(k, draft_ms, verify_ms)
