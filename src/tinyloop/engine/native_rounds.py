"""Speculation rounds that the native executor runs whole, one call each: work items the speculator yields
like a `model.paged.Rows`; the batch runner runs each in the same engine step (`BatchRunner.run_round`, which
reads the speculator's state through the helpers here), and its `result` holds the round's tokens and times when
the generator resumes (engine/speculative.py, engine/tree_rounds.py). Nothing here calls native code."""

from __future__ import annotations

ALONE_UP_TO = 4         # greedy native rounds speculate while at most this many sequences run; beyond, a
                        # plain row in the shared batched step costs less than a round of its own
PLAIN_STEPS = 8         # plain rounds (k = 0) a request running alone makes per native call (NativeSteps)
PIPELINE_RUN = 16       # drafts a pipeline round may make in all while they are accepted (draft_ahead bounds
                        # those in flight at once): a round's fill and drain passes, paid once a round
PIPELINE_HEAD = 8       # a pipeline round's verification rows per head call at most (NativeRound.head_rows)
CHAIN_ROUNDS = 4        # chain rounds a request running alone makes per native call at the policy's k: the
                        # Python between rounds (emission, the policy, the call's set-up) paid once a call


def draft_norm(sp):
    """The norm the draft head reads: the draft head's own, or (where it is the model's final norm) the
    model's norm before the head, None unless head_norm."""
    norm = sp.head.norm
    if norm == sp.model.final_norm:
        norm = sp.model.norm if sp.model.cfg.head_norm else None
    return norm


class NativeRound:
    """A whole greedy round for the native executor (`NativeExecutor.spec_round`: a chain round, or the
    pipeline of depth-aligned passes): the speculator yields it like a `Rows`, the batch runner runs it in
    the same engine step, and `result` holds its tokens and times when the generator resumes."""

    def __init__(self, spec: "Speculator", k: int):
        self.spec, self.k = spec, k
        self.rounds = 1   # (chain rounds back to back in the call: Speculator._native_round sets it)
        self.result: dict | None = None

    def head_rows(self, chunk: int) -> int:
        """Verification rows per head call: `chunk` as the runner chooses it from the head's cost by rows
        (`BatchRunner.chunk`): a chain round's among its k + 1 positions, lazily; a pipeline's among up to
        PIPELINE_HEAD positions that wait for it (parked after the coda until that many are due). (A seam for
        tests that fix it.)"""
        return chunk


class NativeSteps(NativeRound):
    """Plain rounds (k = 0) back to back in one native call (`NativeExecutor.generate`, as a lone plain
    request's steps: engine/serving.py): the policy's held plain rounds up to its next probe, while the
    request runs alone. `result`: their tokens (ending after a stop id)."""


def stop_ids(sp) -> list[int]:
    """The ids that end a request (its stop ids, and the model's end ids unless ignore_eos): a call of several
    rounds or steps ends after the one that emits one."""
    cfg = sp.model.cfg
    stop = list(sp.params.stop_token_ids)
    if not sp.params.ignore_eos:
        stop += [cfg.eos_token_id, *cfg.eos_token_ids]
    return [t for t in stop if t is not None]


def noise(sp):
    """A sampled round's draws (seed, index of the token after the pending one, 1 / T, top_k, top_p); None:
    greedy."""
    return None if sp.params.greedy else (sp.sampler.seed, sp.sampler.n_out, *sp.sampler.draw_params()[1:])


class NativeTreeRound(NativeRound):
    """A whole tree round (K > 1, greedy or sampled) for the native executor (`NativeExecutor.tree_round`),
    run like a `NativeRound` (`head_rows`: rows of a verified chain per head call, up to depth + 1)."""
