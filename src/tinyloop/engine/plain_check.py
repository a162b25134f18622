"""Whether drafting pays at all, here and now: drafting calls against plain calls, measured over their whole cycles
(`PlainCheck`, one per model and setting, held by engine/draft_policy.py's `RoundCosts`; `DraftPolicy` asks it).
docs/speculative.md, "How a round is charged"."""

from __future__ import annotations

import math


class PlainCheck:
    """Whether drafting pays here and now, measured: the milliseconds a token that calls realize over their whole
    cycle (native time, Python, scheduling, emission, and whatever the OS took from them), drafting calls against
    plain calls over the same stretch of time. The model's for one setting (`RoundCosts.check`, the chain table's):
    the conditions (a neighbour on the cores, the host) are the machine's, not a request's. Lone requests' calls
    only (`DraftPolicy.timed`).

    Why: the round costs the draft lengths are weighed by are medians of native times (a round the OS preempted must
    not move them), and plain's own cost was timed once and then only while plain rounds ran. On a busy host the
    medians hid what preemption took from drafting calls (their whole cycles 1.1-1.5x the policy's prediction, beside
    one spinning process), and a plain cost timed under other conditions stood for plain's (6.4 ms a token, timed
    beside a neighbour, while plain ran at 2.0-3.5 once it had gone). So this check compares what each mode realizes.

    The mode in use runs and the other is probed once `gap` tokens of the mode in use have run: plain calls at a
    request's last TAIL tokens, to its end, while drafting; drafting calls (the policy's choice of length) for PROBE
    tokens at a request's start, while plain. (Plain calls write no draft-exit entries, and drafts after them attend
    to what the pool holds there: so probes go where no draft comes after or none came before; one overdue by LATE
    gaps, the requests ending first, runs where it is.) A probe gives each mode one sample, its ms a token: the
    probe's, and the mode in use's over its calls since the last probe (means, not medians: what the OS takes now
    and then is part of what a mode costs). A mode's estimate is the mean of its samples, each probe multiplying the
    weight of those before by DECAY (about seven probes' stretch), alike for both.

    Drafting goes on unless log(plain / drafting ms a token) is below log LEAVE by Z standard errors (from the
    samples' spread, MIN samples' weight of each mode at least), and once fallen back resumes when it is above log
    RESUME by as much: on a shared host a call's time is noisy (two passes over the same 512 tokens took 0.78-1.44x
    each other at five times as many runnable threads as cores), and there a switch waits for more probes or a
    larger difference. The gap doubles (GAP to MAX_GAP tokens) while the mode in use leads by CLEAR (by Z standard
    errors), so that probes cost little where the answer is plain, and is back at GAP when it does not and when the
    mode changes. When the mode in use's ms a token since the last probe (GAP tokens of it at least) is SHIFT away
    from its estimate, or two probes in a row are on the same side of theirs (a neighbour started or stopped), the
    samples before weigh FADE times less and the gap is back at GAP; after one such probe, the next comes GAP
    tokens later."""

    DECAY = 0.85
    MIN = 3.0
    Z = 1.0
    LEAVE = 1.0
    RESUME = 1.04
    GAP = 256
    MAX_GAP = 2048
    CLEAR = 1.15
    SHIFT = 1.5
    FADE = 0.3
    SD_FLOOR = 0.05
    PROBE = 16
    TAIL = 32
    LATE = 4

    def __init__(self):
        self.drafting = True   # the mode in use (drafting: the policy's choice of length; else plain calls)
        # each mode's samples (ms a token), decayed alike: weight, sum, log sum, log sum of squares
        self.stats = {True: [0.0, 0.0, 0.0, 0.0], False: [0.0, 0.0, 0.0, 0.0]}
        self.cur = [0, 0.0]   # the mode in use's tokens and ms since the last probe
        self.probe = [0, 0, 0.0]   # the probe under way: its calls, tokens and ms
        self.shifted = False   # (they are SHIFT away from its estimate)
        self.gap = self.GAP
        self.side = 0   # where the last probe fell against its mode's estimate: -1 / 1 beyond SHIFT, else 0
        self.probes = self.switches = self.shifts = 0

    def ms_per_token(self, drafting: bool) -> float | None:
        w, s, _, _ = self.stats[drafting]
        return s / w if w > 0 else None

    def estimate(self) -> tuple[float, float] | None:
        """log(plain / drafting ms a token) (> 0: drafting pays) and its standard error; None before MIN samples'
        weight of each mode."""
        if min(self.stats[m][0] for m in (True, False)) < self.MIN:
            return None
        var = 0.0
        for w, _, l1, l2 in self.stats.values():
            sd = max(self.SD_FLOOR, math.sqrt(max(0.0, l2 / w - (l1 / w) ** 2) * w / (w - 1)))
            var += sd * sd / w
        return math.log(self.ms_per_token(False) / self.ms_per_token(True)), math.sqrt(var)

    @property
    def ratio(self) -> float | None:
        """Plain ms / drafting ms a token as measured (> 1: drafting pays); None before both modes have samples."""
        p, d = self.ms_per_token(False), self.ms_per_token(True)
        return p / d if p is not None and d is not None else None

    def due(self) -> bool:
        """Whether a probe of the mode not in use is due (none under way)."""
        return self.cur[0] >= self.gap and self.probe[1] == 0

    def overdue(self) -> bool:
        """Whether a probe has been due for LATE gaps (requests that end before their tail: it runs where it is)."""
        return self.due() and self.cur[0] >= self.LATE * self.gap

    def record(self, drafting: bool, tokens: int, ms: float, probe: bool) -> None:
        """A lone request's call just timed: `drafting` or plain, `tokens` emitted in `ms` of its whole cycle;
        `probe`: it probed the mode not in use (other calls of that mode are not counted). A probe's calls count
        together, weighed when the mode in use's next call comes."""
        if tokens <= 0 or ms <= 0:
            return
        if probe and drafting != self.drafting:
            pr = self.probe
            pr[0], pr[1], pr[2] = pr[0] + 1, pr[1] + tokens, pr[2] + ms
        elif drafting == self.drafting:
            if self.probe[1] > 0:
                self._probed()
            c = self.cur
            c[0], c[1] = c[0] + tokens, c[1] + ms
            mean = self.ms_per_token(drafting)
            if not self.shifted and c[0] >= self.GAP and mean is not None and \
                    max(c[1] / c[0] / mean, mean * c[0] / c[1]) >= self.SHIFT:
                self.shifted, self.gap = True, self.GAP   # (the conditions changed: a probe soon)

    def _probed(self) -> None:
        """The probe just ended: one sample of each mode, then the weighing."""
        _, tokens, ms = self.probe
        self.probe = [0, 0, 0.0]
        self.probes += 1
        probed = not self.drafting
        x, mean = ms / tokens, self.ms_per_token(probed)
        # two probes in a row SHIFT away from the probed mode's estimate on the same side: its conditions changed
        # (a probe alone is too noisy to say so: on a busy host one in two or three is)
        side = 0 if mean is None or max(x / mean, mean / x) < self.SHIFT else (1 if x > mean else -1)
        if side and side == self.side or self.shifted:
            self._shift()
        elif side:
            self.gap = self.GAP   # (the next probe soon: it says whether this one was noise)
        self.side = side
        for st in self.stats.values():
            st[:] = [self.DECAY * v for v in st]
        self._add(probed, x)
        if self.cur[0] > 0:
            self._add(self.drafting, self.cur[1] / self.cur[0])
        self.cur = [0, 0.0]
        self._weigh()

    def _shift(self) -> None:
        """The conditions changed: what came before weighs FADE times less, and probes come sooner."""
        for st in self.stats.values():
            st[:] = [self.FADE * v for v in st]
        self.gap, self.side, self.shifted = self.GAP, 0, False
        self.shifts += 1

    def _add(self, drafting: bool, x: float) -> None:
        st, y = self.stats[drafting], math.log(x)
        st[0], st[1], st[2], st[3] = st[0] + 1.0, st[1] + x, st[2] + y, st[3] + y * y

    def _weigh(self) -> None:
        est = self.estimate()
        if est is None:
            return
        x, se = est
        lo, hi = x - self.Z * se, x + self.Z * se
        if self.drafting and hi < math.log(self.LEAVE) or not self.drafting and lo > math.log(self.RESUME):
            self.drafting = not self.drafting
            self.switches += 1
            self.gap = self.GAP
            return
        clear = lo >= math.log(self.CLEAR) if self.drafting else hi <= -math.log(self.CLEAR)
        self.gap = min(self.MAX_GAP, 2 * self.gap) if clear and not self.side else self.GAP
