"""How a greedy speculative request chooses its rounds, on measured costs alone (no model): the draft-length policy
(engine/draft_policy.py `DraftPolicy`, `RoundCosts`, `PlainCheck`) and a tree request's round shape
(engine/round_shape.py). The exactness of the rounds themselves is tests/engine/test_speculative.py's."""

from __future__ import annotations


def test_draft_policy_follows_acceptance_and_costs():
    """The draft-length policy (greedy native rounds): drafts that are never accepted bring it to plain
    rounds (k = 0) with a probe of one draft now and then, fewer as they keep failing; drafts that are
    always accepted and cheap bring it to the ceiling; a fixed policy always drafts the ceiling."""
    from tinyloop.engine.draft_policy import DraftPolicy, RoundCosts

    def drive(accept, draft_ms, verify_ms, rounds=200, cap=4):
        pol = DraftPolicy(cap, costs=RoundCosts())
        for _ in range(rounds):
            k = pol.choose(cap)
            pol.update(k, k if accept else 0, draft_ms * k, verify_ms(k))
        return pol.chosen

    never = drive(False, 1.0, lambda k: 3.0 + 0.2 * k)
    assert never[0] == 1                                   # the first round measures one draft
    tail = never[50:]
    assert tail.count(0) > 0.9 * len(tail) and 0 < tail.count(1) <= 8   # probes, backing off
    always = drive(True, 0.2, lambda k: 3.0 + 0.1 * k)
    assert always[-50:].count(4) >= 40                     # (every 8th round tries another length)
    fixed = DraftPolicy(4, adaptive=False)
    assert [fixed.choose(4) for _ in range(5)] + [fixed.choose(2)] == [4, 4, 4, 4, 4, 2]


def test_draft_policy_weighs_a_long_chain_run_only_while_drafts_are_accepted():
    """A request naming no draft_ahead (RequestPlan.draft_run 8): beside 1..draft_ahead, the policy weighs one
    chain round of draft_run drafts, and takes it where drafts are always accepted and a long round's rate is the
    best (Dory's depth-agreeing shape: 9 tokens for 1.6x a round of 4's time); while drafts mostly fail it never
    drafts past draft_ahead; a request that names draft_ahead (k_run = draft_ahead) never does."""
    from tinyloop.engine.draft_policy import DraftPolicy, RoundCosts

    def drive(accept, k_run, rounds=120):
        pol = DraftPolicy(4, costs=RoundCosts(), k_run=k_run)
        for _ in range(rounds):
            k = pol.choose(4, None, 8)
            pol.update(k, k if accept else 0, 90.0 * k, 210.0 + 31.0 * k)   # (Dory 4B at loops 4: ms, measured)
        return pol.chosen

    long_run = drive(True, 8)
    assert max(long_run) == 8 and long_run[-40:].count(8) >= 30
    assert max(drive(False, 8)) <= 4
    assert max(drive(True, 4)) == 4


def test_draft_policy_explores_less_once_settled_and_ends_in_one_round():
    """Once the best draft length and every one near it are timed over a whole window, the policy explores
    SETTLED times less often (every 32nd round instead of every 8th); and at a request's last tokens (cap =
    remaining - 1 below the ceiling), with drafts mostly accepted, it drafts cap so that one round can end the
    request, even where a shorter round has the better rate (it would leave a call more to make)."""
    from tinyloop.engine.draft_policy import DraftPolicy, RoundCosts

    costs = RoundCosts()
    pol = DraftPolicy(4, costs=costs)
    verify = {0: 3.0, 1: 3.0, 2: 3.4, 3: 3.6, 4: 3.8}
    for _ in range(200):
        k = pol.choose(4)
        pol.update(k, k, 0.2 * k, verify[k])
    assert costs.samples(4) >= RoundCosts.WINDOW and costs.samples(3) >= RoundCosts.WINDOW   # (the best, and near)
    assert pol.explore_every == DraftPolicy.EXPLORE * DraftPolicy.SETTLED
    assert pol.chosen[-96:].count(4) >= 90          # (six explorations at most in 96 rounds; twelve at every 8th)
    pol.rounds = 1
    assert pol.chain_run(4, 8) == 8                 # a call runs up to the next exploring round
    # the tail: a two-draft round has the worse rate here (its verification is dear), yet it ends the request
    verify[2] = 20.0
    for _ in range(RoundCosts.WINDOW):
        costs.update(2, 0.4, verify[2])
    assert costs.verify(2) == 20.0 and pol.choose(2) == 2
    pol.acc, pol.prop = 0.0, 20.0                    # (drafts failing: no such preference)
    pol.first, pol.cont = [0.0, 20.0], [0.0, 20.0]
    assert pol.choose(2) in (0, 1)


def test_draft_policy_charges_every_length_the_same_call_and_learns_its_yield():
    """Two biases that settled the shipped model's default at k = 2 by chance (docs/speculative.md): a length
    the policy tries in a call of its own must not be charged that call's whole Python against the held
    length's share (the call's own cost is measured apart, `RoundCosts.call`, and shared alike by the rounds
    a call holds), and where rounds of a length yield more than the request's acceptance predicts (drafts
    agree in runs), the model-wide yield ratio of that length (`calibration`) makes it win."""
    from tinyloop.engine.draft_policy import DraftPolicy, RoundCosts

    costs = RoundCosts()
    costs.call(2.0)                                  # a call's own cost, far above a round's native time
    pol = DraftPolicy(4, costs=costs)
    pol.held = 4
    verify = {0: 1.5, 1: 0.6, 2: 0.7, 3: 0.8, 4: 0.9}
    for k in (0, 1, 2, 3, 4):                        # every length timed once (native times only)
        pol.update(k, min(k, 1), 0.1 * k, verify[k])
    pol.first, pol.cont = [10.0, 20.0], [5.0, 20.0]  # a request that looks mediocre: 1 + 0.5 (1 + 0.26 + ..)
    rate = {k: pol.expected(k) * costs.calibration(k) / (0.1 * k + verify[k] + 2.0 / 4) for k in (1, 2, 3, 4)}
    assert pol.choose(4) == max(rate, key=rate.get) == 1
    assert costs.calibration(4) == 1.0               # (no yield measured yet)
    for _ in range(40):                              # rounds of 4 that yield all 5 tokens where 1.67 were predicted
        costs.observe_yield(4, 4, pol.expected(4))
    assert 2.0 < costs.calibration(4) < 5 / pol.expected(4)   # (drawn toward 1 by CALIBRATE rounds)
    assert pol.choose(4) == 4
    pol.held = 1                                     # (not alone: a call per round, the same for every length)
    assert pol.choose(4) == 4


def test_draft_policy_takes_the_longest_of_near_ties():
    """Among lengths whose rates are within TIE of the best, the policy drafts the longest (an estimate from a
    few drafts cannot tell them apart, and a draft too short costs more than one too long); a length whose
    rate is clearly lower is not taken."""
    from tinyloop.engine.draft_policy import DraftPolicy, RoundCosts

    costs = RoundCosts()
    pol = DraftPolicy(4, costs=costs)
    verify = {0: 2.0, 1: 0.6, 2: 0.7, 3: 0.8, 4: 0.9}
    for k in verify:
        pol.update(k, min(k, 1), 0.1 * k, verify[k])
    def rates():
        return {k: pol.expected(k) / (0.1 * k + verify[k]) for k in (1, 2, 3, 4)}
    pol.first, pol.cont = [18.0, 20.0], [16.0, 20.0]      # a near tie: the best rate at k = 2, k = 4 within 5%
    r = rates()
    best = max(r, key=r.get)
    assert best < 4 and r[4] >= (1 - DraftPolicy.TIE) * r[best]
    assert pol.choose(4) == 4
    pol.first, pol.cont = [8.0, 20.0], [4.0, 20.0]        # drafts failing: k = 4 far below the best
    r = rates()
    assert r[4] < (1 - DraftPolicy.TIE) * max(r.values())
    assert pol.choose(4) == max(k for k in r if r[k] >= (1 - DraftPolicy.TIE) * max(r.values())) < 4


def test_tree_or_chain_learns_across_requests_and_settles():
    """A tree request's round shape: the rates are the model's (`ShapeRates`), so a later request starts from
    what earlier ones measured (no untimed round of each shape again); a shape far slower than the other is
    tried every 32nd round instead of every 8th (rounds counted over the model's requests), one within FAR of
    the other every 8th."""
    from tinyloop.engine.round_shape import ShapeRates, TreeOrChain

    def drive(rates, tree_ms, rounds):
        t = TreeOrChain(rates)
        shapes = []
        for _ in range(rounds):
            tree = t.choose()
            shapes.append(tree)
            t.update(tree, 5 if tree else 4, tree_ms if tree else 2.0)
        return shapes

    slow = ShapeRates()
    first = drive(slow, 5.0, 16)                     # a tree round yields 1.0 token a ms, a chain round 2.0
    assert first[:2] == [True, False]                # each shape timed once
    later = drive(slow, 5.0, 48)
    assert later.count(True) == 2                    # the model's rounds 32 and 64 only
    assert sum(sum(drive(slow, 5.0, 8)) for _ in range(4)) == 1   # four short requests: the model's 96th round
    close = ShapeRates()
    drive(close, 2.4, 16)                            # 2.08 tokens a ms: the tree is the faster shape
    again = drive(close, 2.4, 64)
    assert again[0] is True and again.count(False) == 8   # every 8th of the model's rounds the chain


def test_round_costs_ignore_a_preempted_round():
    """A round the OS preempted (a few ms more, now and then, on a busy host) does not move a cost: each is
    the median of its recent samples, so one slow sample among steady ones leaves it where it was, and a
    cost that really changes follows within half the window. The acceptance counts only the drafts a
    round tested (the accepted ones and the first rejected one)."""
    from tinyloop.engine.draft_policy import RoundCosts, tested

    c = RoundCosts()
    for ms in (3.0, 3.0, 9.0, 3.0, 3.0):
        c.update(4, 4 * 0.35, ms)
    assert c.verify_ms[4] == 3.0 and c.draft_ms == 0.35
    for _ in range(c.WINDOW // 2 + 1):
        c.update(4, 4 * 0.35, 5.0)
    assert c.verify_ms[4] == 5.0
    assert [tested(4, a) for a in range(5)] == [1, 2, 3, 4, 4]


def test_draft_policy_times_plain_before_trusting_drafts():
    """A request that finds round costs measured by earlier ones (a long chain round, cheap pipeline
    rounds) but never a plain round measures one before weighing drafts against it: on drafts that always
    fail it then settles on plain rounds, instead of pipeline rounds of one draft that each cost a little
    more than a plain token (the 1.4B shape's 0.87x)."""
    from tinyloop.engine.draft_policy import DraftPolicy, RoundCosts

    chain, pipe = RoundCosts(), RoundCosts()
    chain.update(3, 30.0, 300.0)                     # a fixed chain round of three drafts, earlier
    for k in (1, 2, 3):
        pipe.update(k, 0.0, 150.0 + 10 * k)          # pipeline rounds (their whole time, by k)
    pol = DraftPolicy(4, costs=chain, pipeline_costs=pipe, prefer_pipeline=True)
    for _ in range(100):
        k = pol.choose(4)
        ms = 150.0 if k == 0 else 150.0 + 10 * k if pol.pipeline else 100.0 + 70 * k
        pol.update(k, 0, 0.0 if pol.pipeline or k == 0 else 10.0 * k, ms)
    assert pol.chosen[20:].count(0) > 0.8 * 80


def test_draft_policy_picks_the_faster_round_shape():
    """With both round shapes on offer the policy times each and settles on the faster one, trying the
    other now and then."""
    from tinyloop.engine.draft_policy import DraftPolicy, RoundCosts

    for pipeline_faster in (True, False):
        pol = DraftPolicy(4, costs=RoundCosts(), pipeline_costs=RoundCosts())
        shapes = []
        for _ in range(120):
            k = pol.choose(4)
            shapes.append(pol.pipeline)
            per_draft = 0.5 if pol.pipeline == pipeline_faster else 1.5
            pol.update(k, k, 0.0, 2.0 + per_draft * k)
        tail = shapes[40:]
        assert tail.count(pipeline_faster) > 0.8 * len(tail)
        assert tail.count(not pipeline_faster) > 0                 # (explored)


def _drive_lone_calls(costs, calls, stalled, log, plain_ms=1.0):
    """Calls of lone greedy requests (64 tokens each) as the speculator makes them, against simulated times: a plain
    call of n steps takes n x plain_ms over its whole cycle; a drafting round of k drafts 0.3 k ms of native draft
    time and 1.5 + 0.2 k of verification, all drafts accepted, and a call's own cost 0.4 ms. `stalled`: two calls in
    five of drafting also lose 3x their native time to something the medians never see (a preempted call on a
    busy host), so that drafting (1.39x plain otherwise) realizes 0.64x plain. Appends (k, tokens, ms, check
    drafting) a call to `log`."""
    from tinyloop.engine.draft_policy import DraftPolicy

    pol, left = None, 0
    for i in range(calls):
        if left <= 0:
            pol, left = DraftPolicy(4, costs=costs), 64
        pol.held, pol.room = 4, left
        k = pol.choose(min(4, left - 1))
        if k == 0:
            n = pol.plain_run(min(8, left))
            ms = n * plain_ms
            pol.update(0, 0, 0.0, ms / n)
            pol.timed(0, n, ms, full=n == 8)
            log.append((0, n, ms, pol.check.drafting))
            left -= n
            continue
        r = pol.chain_run(k, min(4, left // (k + 1)))
        draft, verify = 0.3 * k, 1.5 + 0.2 * k
        native = r * (draft + verify)
        ms = native + 0.4 + (3 * native if stalled and i % 5 in (0, 2) else 0.0)
        costs.call(ms - native)
        for _ in range(r):
            pol.update(k, k, draft, verify)
        pol.timed(k, r * (k + 1), ms)
        log.append((k, r * (k + 1), ms, pol.check.drafting))
        left -= r * (k + 1)


def test_draft_policy_falls_back_to_plain_where_drafting_does_not_pay_and_comes_back():
    """The check of whether drafting pays at all (`PlainCheck`): drafting calls that lose, two in five, three times
    their native time to something the round costs' medians never see (as on a busy host) realize fewer tokens a ms
    than plain calls (0.49x here), though every length's modelled rate still favours drafting; plain calls probed at
    requests' tails measure it, and within a bounded number of calls the requests decode plain (then at >= 0.9x
    plain's speed, the probes of drafting included). When drafting's costs
    recover, probes at requests' starts measure that and drafting resumes; while drafting clearly pays, the plain
    probes cost little."""
    from tinyloop.engine.draft_policy import RoundCosts
    from tinyloop.engine.plain_check import PlainCheck

    costs = RoundCosts()

    def rate(log):   # tokens a ms over the calls, against plain's (1 token a ms)
        return sum(n for _, n, _, _ in log) / sum(ms for _, _, ms, _ in log)

    def plain_share(log):
        return sum(n for k, n, _, _ in log if k == 0) / sum(n for _, n, _, _ in log)

    # (bounds from the check's constants, in calls of 8 tokens or more: a change seen within GAP tokens, then MIN
    # samples a GAP apart at requests' tails, 64 tokens each)
    settle = (PlainCheck.MIN + 2) * (PlainCheck.GAP + 64) // 8
    idle: list = []
    _drive_lone_calls(costs, 400, False, idle)
    assert all(d for *_, d in idle) and rate(idle[100:]) > 1.33   # drafting: 1.39x plain
    assert plain_share(idle[200:]) < 0.03                          # (the probes, once the gap has grown)
    busy: list = []
    _drive_lone_calls(costs, 500, True, busy)
    switched = next(i for i, (*_, d) in enumerate(busy) if not d)
    assert switched <= settle
    tail = busy[switched + 20:]
    assert rate(tail) >= 0.9 and plain_share(tail) > 0.8
    back: list = []
    _drive_lone_calls(costs, 500, False, back)
    resumed = next(i for i, (*_, d) in enumerate(back) if d)
    assert resumed <= PlainCheck.MAX_GAP // 8 + settle
    assert rate(back[resumed + 20:]) > 1.3
