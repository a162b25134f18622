"""A Speculator's tree rounds (K > 1, greedy): the beam drafted level by level, all its nodes verified in one
pass under the ancestor mask, the lazy greedy walk (`_tree_round`, the stepwise path), or all of it in one
native call (`_native_tree_round`, tl_tree_round); then the accepted path moved into place. A mixin of
engine/speculative.py's Speculator, whose state (the sequence, its pages, head, sampler and stats) it uses;
the pure tree functions are engine/tree.py's."""

from __future__ import annotations

import time

import torch

from .native_rounds import ALONE_UP_TO, NativeTreeRound
from .tree import DraftTree, ancestor_mask, beam_step


class TreeRounds:
    def _native_tree_round(self, depth: int):
        """A greedy tree round (K > 1) as one native call (`tl_tree_round`): the same beam, verification and
        walk as `_tree_round`, then the accepted path's entries moved into place. In a crowded batch, a
        plain row of the shared step instead."""
        self._time_last_chain()
        if self.running is not None and self.running() > ALONE_UP_TO:
            return (yield from self._plain_row(batched=True))
        L = self.length
        call = NativeTreeRound(self, depth)
        yield call
        res = call.result
        out, path = res["emitted"], res["path"]
        for y in out:
            self.sampler.accept(y)
        self._commit_path(L, out, path, depth, len(res["tokens"]))
        st = self.stats
        st["draft_s"] += res["draft_ms"] / 1000
        st["verify_s"] += res["verify_ms"] / 1000
        st["draft_passes"] += depth + 1
        st["verify_positions"] += len(res["tokens"])
        return out

    def _commit_path(self, L: int, out: list[int], path: list[int], depth: int, nodes: int) -> None:
        """The accepted path's entries moved into positions L+1.. (where the path left node order), the
        committed length and the round's counts."""
        if any(node != i for i, node in enumerate(path)):
            self.kv.copy_positions(self.table, [L + node for node in path[1:]], L + 1)
            self.stats["compactions"] += 1
        self.length = L + len(out)
        st = self.stats
        st["draft_tokens"] += nodes - 1
        st["proposed"] += depth
        st["accepted"] += len(out) - 1

    def _tree_round(self, depth: int):
        sampler, K = self.sampler, self.K
        L = self.length
        t0 = time.perf_counter()
        tree = DraftTree()
        tree.add(self.pending, -1, 0.0)
        es, hs = [], []
        frontier, greedy_path = [0], [0]
        for t in range(1, depth + 2):
            first = frontier[0]
            rows = range(first, first + len(frontier))
            kw = {"positions": torch.tensor([L + t - 1] * len(frontier))}
            if K > 1:  # (a one-node-wide tree is the causal chain)
                kw["tree_mask"] = ancestor_mask(tree.parents, rows)
                kw["tree_key_positions"] = torch.tensor([L + dd for dd in tree.depths])
            readout = self.draft_readout if t <= depth else self.exit_readout  # the exit's entries are due
            draft = self._draft([tree.tokens[i] for i in frontier], L + first, readout,
                                draft=self.head if t <= depth else None, **kw)
            yield draft
            es.append(draft.out_state[0])
            hs.append(draft.out_state[1])
            if t > depth:
                break
            lg = draft.draft_logits
            logp = torch.log_softmax(torch.stack([self._penalised(r) for r in lg]), dim=-1)
            if sampler.matcher is not None:  # each node's children: what the grammar allows after its path
                paths = [[tree.tokens[i] for i in tree.path_to(node)[1:]] for node in frontier]  # below the root
                logp = sampler.matcher.mask_after(paths, logp, self._draft_cols())
            rows_, cols, scores = beam_step(logp, torch.tensor([tree.scores[i] for i in frontier]), K)
            toks = self.head.tokens(cols)
            frontier = [tree.add(tok, frontier[r], s) for r, tok, s in zip(rows_, toks, scores)]
            greedy_path.append(frontier[0])  # beam_step puts the greedy child of the greedy node first
        t1 = time.perf_counter()
        n_nodes = len(tree)
        kw = {"positions": torch.tensor([L + dd for dd in tree.depths])}
        if K > 1:
            kw["tree_mask"] = ancestor_mask(tree.parents)
            kw["tree_key_positions"] = kw["positions"]
        verify = self._verify(torch.cat(es), torch.cat(hs), L, **kw)
        yield verify
        out, path = self._accept_tree(tree, verify.hidden, greedy_path)
        self._commit_path(L, out, path, depth, n_nodes)
        self.stats["draft_s"] += t1 - t0
        self.stats["verify_s"] += time.perf_counter() - t1
        return out

    def _accept_tree(self, tree: DraftTree, x: torch.Tensor, greedy_path: list[int]) -> tuple[list[int], list[int]]:
        """Greedy walk from the root while the verifier's token is a child. Returns (tokens, path nodes)."""
        logits: dict[int, int | torch.Tensor] = {}

        def score(nodes: list[int]) -> None:  # the LM head over a batch of nodes
            rows = x[torch.tensor(nodes, device=x.device)]
            picks = self.argmax(rows) if self.argmax is not None else list(self._full_logits(rows))
            for node, pick in zip(nodes, picks):
                logits[node] = pick

        score(greedy_path)  # the draft's greedy chain first: usually the only head call
        out, path, node = [], [0], 0
        while True:
            if node not in logits:
                score(tree.best_chain(node))
            pick = logits[node]  # a token, or a logits row (penalties depend on the accepted prefix)
            y = pick if isinstance(pick, int) else self.sampler.greedy_token(pick)
            if not isinstance(pick, int):
                self._logprob(pick, y)
            self.sampler.accept(y)
            out.append(y)
            child = tree.children[node].get(y)
            if child is None:
                return out, path
            path.append(child)
            node = child
