"""Pure functions for tree speculation: the draft tree's layout, masks, beam step and accepted path.

A draft tree is a flat list of nodes in the order they were drafted (node 0 is the round's root, the
last emitted token; every node's parent has a smaller index). Node i sits at position `L + depth[i]`
but is stored at cache index `L + i` until the accepted path is compacted into place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)    # -1 for the root
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)   # cumulative draft log-probability
    children: list[dict[int, int]] = field(default_factory=list)  # token -> child node

    def add(self, token: int, parent: int, score: float) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(0 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(score)
        self.children.append({})
        if parent >= 0:
            self.children[parent][token] = node
        return node

    def __len__(self) -> int:
        return len(self.tokens)

    def best_chain(self, node: int) -> list[int]:
        """`node`, then its highest-scoring child, that child's, ... down to a leaf."""
        chain = [node]
        while self.children[chain[-1]]:
            kids = self.children[chain[-1]].values()
            chain.append(max(kids, key=lambda c: self.scores[c]))
        return chain

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root down to `node`, both included."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def ancestor_mask(parents: list[int], rows: range | None = None) -> torch.Tensor:
    """Boolean (len(rows), N): row i allows node j iff j is node i itself or one of its ancestors.

    `parents[j] < j` for every non-root node. `rows` picks the query nodes (default: all N).
    """
    n = len(parents)
    full = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            full[i] = full[p]
        full[i, i] = True
    return full if rows is None else full[rows.start:rows.stop]


def beam_step(logp: torch.Tensor, frontier_scores: torch.Tensor, k: int) -> tuple[list[int], list[int], list[float]]:
    """One beam step: the greedy child of frontier row 0, then the k-1 best other (row, column) pairs by
    cumulative log-probability.

    Row 0 is always the draft's greedy chain (the first node of every depth), so the tree contains the
    path chain speculation would draft and never accepts less than it; the rest of the beam is ranked
    by cumulative draft log-probability. logp: (F, n) draft log-probabilities of each frontier node's
    children over the draft vocabulary; frontier_scores: (F,). Returns (rows, cols, scores), greedy first.
    """
    total = (logp.double() + frontier_scores.to(logp.device, torch.float64)[:, None]).flatten()  # (F*n,)
    greedy = int(torch.argmax(logp[0]))
    greedy_score = float(total[greedy])
    total[greedy] = float("inf")
    k = min(k, total.numel())
    best = torch.topk(total, k)
    n = logp.shape[1]
    idx = best.indices.tolist()
    scores = best.values.tolist()
    scores[0] = greedy_score
    return [i // n for i in idx], [i % n for i in idx], scores
