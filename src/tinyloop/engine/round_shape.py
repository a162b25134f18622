"""A greedy tree request's round shape, round by round: a tree round or a chain round, whichever has yielded
more tokens per millisecond on this model and setting (`TreeOrChain`, over `ShapeRates` the model's requests
share). docs/speculative.md; the chain's own draft length is draft_policy.py's."""

from __future__ import annotations

import weakref

from ..model import LoopedTransformer


class ShapeRates:
    """The decayed tokens and milliseconds of tree and chain rounds for one model and setting, across its
    requests (`shape_rates`): which shape is faster is the machine's and the model's, not the request's."""

    DECAY = 0.8

    def __init__(self):
        self.tokens = {True: 0.0, False: 0.0}
        self.ms = {True: 0.0, False: 0.0}
        self.timed = {True: 0, False: 0}
        self.rounds = 0   # (rounds chosen by any of the model's requests: the exploration's clock)

    def update(self, tree: bool, tokens: int, ms: float) -> None:
        self.tokens[tree] = self.DECAY * self.tokens[tree] + tokens
        self.ms[tree] = self.DECAY * self.ms[tree] + max(ms, 1e-6)
        self.timed[tree] += 1


_SHAPE_RATES: "weakref.WeakKeyDictionary[LoopedTransformer, dict]" = weakref.WeakKeyDictionary()


def shape_rates(model: LoopedTransformer, d: int, V: int, K: int, sampled: bool) -> ShapeRates:
    return _SHAPE_RATES.setdefault(model, {}).setdefault((d, V, K, sampled), ShapeRates())


class TreeOrChain:
    """A greedy tree request's round shape, round by round: a tree round (`tl_tree_round`) or a chain round
    under the request's `DraftPolicy`, whichever has yielded more tokens per millisecond of its whole cycle
    (decayed means over the model's requests, `ShapeRates`); a shape not yet timed is measured first, and every
    EXPLORE-th round (counted over the model's requests: a short request would otherwise never try the other
    shape again, nor refresh its rate) takes the other shape so that a rate measured under load does not keep it
    out for good; every EXPLORE x SETTLE-th once the other's rate is below FAR x the best's over SETTLED_AFTER
    timed rounds (tree rounds at ~0.75x the chain's rate on the shipped model, tried every 8th round, cost ~3%).
    Both give the tokens plain greedy decoding gives, so the choice changes the speed only."""

    EXPLORE = 8
    FAR = 0.8
    SETTLED_AFTER = 3
    SETTLE = 4

    def __init__(self, rates: ShapeRates | None = None):
        self.r = rates if rates is not None else ShapeRates()
        self.counts = {True: 0, False: 0}   # (this request's rounds of each shape)

    def choose(self) -> bool:
        """True: a tree round."""
        r = self.r
        r.rounds += 1
        untimed = [s for s in (True, False) if r.ms[s] == 0.0]
        if untimed:
            tree = untimed[0]
        else:
            rate = {s: r.tokens[s] / r.ms[s] for s in (True, False)}
            tree = rate[True] >= rate[False]
            far = rate[not tree] < self.FAR * rate[tree] and r.timed[not tree] >= self.SETTLED_AFTER
            if r.rounds % (self.EXPLORE * (self.SETTLE if far else 1)) == 0:
                tree = not tree
        self.counts[tree] += 1
        return tree

    def update(self, tree: bool, tokens: int, ms: float) -> None:
        self.r.update(tree, tokens, ms)
