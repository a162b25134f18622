"""Sampling as pure functions over one row of logits, plus a small per-request `Sampler`.

Order: logit bias (OpenAI's `logit_bias`) -> repetition penalty (prompt + output) -> presence/frequency
penalties (output) -> temperature -> top-k -> top-p -> draw. Greedy (temperature 0) takes the argmax after the
bias and penalties. Draws use the request's own `torch.Generator` and inverse-CDF sampling, so a seeded
request gives the same tokens whatever else the engine runs.
"""

from __future__ import annotations

import contextlib
import os

import torch

from .params import SamplingParams

_NONE = torch.zeros(0, dtype=torch.int64)   # no ids / no counts (penalties that do not apply)


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float] | None,
                     cols: torch.Tensor | None = None) -> torch.Tensor:
    """OpenAI's `logit_bias`: bias[t] added to token t's logit (a token the constraint forbids stays -inf).
    `cols`: the token id of each entry of `logits` (a draft head's subset of the vocabulary); None: entry t is
    token t."""
    if not bias:
        return logits
    keys = torch.tensor(sorted(bias), dtype=torch.long)
    vals = torch.tensor([float(bias[k]) for k in keys.tolist()], dtype=logits.dtype)
    if cols is None:
        ids = keys
    else:   # the entries whose token has a bias, and which bias
        cols = cols.to("cpu", torch.long)
        at = torch.searchsorted(keys, cols).clamp(max=keys.numel() - 1)
        hit = keys[at] == cols
        ids, vals = hit.nonzero().flatten(), vals[at[hit]]
    out = logits.clone()
    out.index_add_(0, ids.to(out.device), vals.to(out.device))
    return out


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style: for every seen token, positive logits are divided by `penalty`, negative multiplied."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    out = logits.clone()
    vals = out[seen]
    out[seen] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return out


def apply_presence_frequency(logits: torch.Tensor, counts: torch.Tensor, presence: float,
                             frequency: float) -> torch.Tensor:
    """OpenAI's definition: logit[j] -= count[j] * frequency + (count[j] > 0) * presence."""
    if presence == 0.0 and frequency == 0.0:
        return logits
    c = counts.to(logits.dtype)
    return logits - c * frequency - (c > 0).to(logits.dtype) * presence


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to >= p (at least one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits.double(), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
    drop_sorted = before >= p
    drop_sorted[0] = False
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def processed_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor,
                     counts: torch.Tensor) -> torch.Tensor:
    """Logit bias and penalties only (what greedy takes the argmax of). logits: (V,)."""
    x = apply_logit_bias(logits.double(), params.logit_bias)
    x = apply_repetition_penalty(x, seen, params.repetition_penalty)
    return apply_presence_frequency(x, counts, params.presence_penalty, params.frequency_penalty)


def distribution(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor:
    """The probabilities the next token is drawn from (float64, (V,)). Greedy gives a one-hot."""
    x = processed_logits(logits, params, seen, counts)
    if params.greedy:
        out = torch.zeros_like(x)
        out[int(torch.argmax(x))] = 1.0
        return out
    x = x / params.temperature
    x = top_k_filter(x, params.top_k)
    x = top_p_filter(x, params.top_p)
    return torch.softmax(x, dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF draw from a (V,) distribution with one uniform from `generator`."""
    u = torch.rand((), generator=generator, dtype=torch.float64)
    cdf = torch.cumsum(probs.double(), dim=-1)
    idx = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    idx = min(idx, probs.shape[-1] - 1)
    while probs[idx] == 0 and idx > 0:  # never land on a token of zero probability (rounding at the edge)
        idx -= 1
    return idx


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Prompt scoring: for each row of `logits` (T, V), the log-probability of `targets[t]` under the raw
    distribution (log_softmax in float32: no temperature, penalties or truncation) and the `top` most
    likely tokens with theirs."""
    lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)   # (T, V)
    picked = lp.gather(1, targets.view(-1, 1)).view(-1).tolist()           # (T,)
    if top <= 0:
        return [(v, []) for v in picked]
    vals, ids = torch.topk(lp, top, dim=-1)                                 # (T, top)
    return [(v, list(zip(i, a))) for v, i, a in zip(picked, ids.tolist(), vals.tolist())]


@contextlib.contextmanager
def one_thread():
    """Run the step's per-row sampling on one torch thread. Its ops over one vocabulary row (50,257 entries
    for GPT-2) are just above torch's parallel grain, so each would wake a second OpenMP thread; next to
    the native executor's spinning workers (and on a shared machine) that wake-up cost milliseconds a
    token in `masked_fill` and `.double()` (profiled: docs/structured.md, "Cost per token")."""
    prev = torch.get_num_threads()
    if prev == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") & (2**63 - 1))
    return g


class Sampler:
    """One request's sampling state: its generator, seen tokens and output counts, and under a constraint
    (`matcher`, engine/constraint.py) the grammar's state: its mask is applied to the row's logits before
    anything else (penalties leave -inf alone), so every rule below samples from the masked distribution."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, matcher=None):
        self.params = params
        self.vocab_size = vocab_size
        self.matcher = matcher
        self.generator = make_generator(params.seed)
        self._seen_mask = torch.zeros(vocab_size, dtype=torch.bool)
        if prompt_ids:
            self._seen_mask[torch.tensor(prompt_ids)] = True
        self._token_counts = torch.zeros(vocab_size, dtype=torch.int64)
        self._pending: list[int] = []   # accepted tokens not yet in the two tensors (only penalties read them)

    def _flush(self) -> None:
        if self._pending:
            idx = torch.tensor(self._pending)
            self._seen_mask[idx] = True
            self._token_counts.index_add_(0, idx, torch.ones_like(idx))
            self._pending = []

    @property
    def seen(self) -> torch.Tensor:
        """(vocab,) bool: the prompt's and the output's tokens so far."""
        self._flush()
        return self._seen_mask

    @property
    def counts(self) -> torch.Tensor:
        """(vocab,) int64: how often each token was output so far."""
        self._flush()
        return self._token_counts

    def _row(self, logits: torch.Tensor) -> torch.Tensor:
        """The row over the vocabulary, with the tokens the constraint forbids at -inf."""
        row = logits[: self.vocab_size]
        m = self.active_matcher
        return row if m is None else m.apply(row)

    def _seen(self) -> torch.Tensor:
        """The ids the repetition penalty acts on (none without one: no full-vocabulary scan per token)."""
        return self.seen.nonzero().flatten() if self.params.repetition_penalty != 1.0 else _NONE

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return distribution(self._row(logits), self.params, self._seen(), self.counts)

    @property
    def penalized(self) -> bool:
        """Penalties or a logit bias: the row is changed before the token is picked (no raw-argmax shortcut)."""
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 \
            or bool(p.logit_bias)

    @property
    def active_matcher(self):
        """The matcher, unless this position allows every token (a thinking block's free text:
        engine/thinking.py)."""
        m = self.matcher
        return None if m is None or getattr(m, "free", False) else m

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no penalties, logit bias or constraint: the token is the argmax of the raw logits."""
        return self.params.greedy and not self.penalized and self.active_matcher is None

    def greedy_token(self, logits: torch.Tensor) -> int:
        if not self.penalized:  # argmax of the row (widening to float64 changes no order)
            if self.active_matcher is not None:
                # the raw argmax, when the grammar allows it, is the masked argmax (the first maximum either
                # way): the mask is applied only when it changes the answer
                best = int(torch.argmax(logits[: self.vocab_size]))
                if self.matcher.allows(best):
                    return best
            return int(torch.argmax(self._row(logits)))
        x = processed_logits(self._row(logits), self.params, self._seen(), self.counts)
        return int(torch.argmax(x))

    def sample(self, logits: torch.Tensor) -> int:
        """Pick the next token from one row of logits (does not record it: call `accept`)."""
        if self.params.greedy:
            return self.greedy_token(logits)
        if self.active_matcher is not None and not self.penalized:
            # the distribution over the allowed tokens only (the masked one without its zeros: the same
            # cumulative sums, so the same draw up to rounding); cheaper than masking the full row even where
            # most tokens are allowed (inside a JSON string: ~0.25 against ~0.6 ms, docs/structured.md)
            ids = self.matcher.allowed_ids()
            sub = logits[: self.vocab_size].index_select(0, ids.to(logits.device))
            return int(ids[draw(distribution(sub, self.params, _NONE, _NONE), self.generator)])
        return draw(self.probs(logits), self.generator)

    def logprobs(self, logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
        """Log-probability of `token` and the `top` most likely tokens with theirs, under the distribution
        the token is drawn from: penalties, then temperature, top-k and top-p when sampling (tokens cut by
        top-k/top-p have -inf); greedy takes the argmax of the penalized logits, and reports their
        log-softmax (temperature 1). Call before `accept` (penalties read the tokens so far)."""
        p = self.params
        x = processed_logits(self._row(logits), p, self._seen(), self.counts)
        if not p.greedy:
            x = top_p_filter(top_k_filter(x / p.temperature, p.top_k), p.top_p)
        lp = torch.log_softmax(x, dim=-1)
        alts = []
        if top > 0:
            vals, ids = torch.topk(lp, top)
            alts = list(zip(ids.tolist(), vals.tolist()))
        return float(lp[token]), alts

    def accept(self, token: int) -> None:
        self._pending.append(token)   # two tensor writes a token cost more than the greedy step's bookkeeping
        if self.matcher is not None:
            self.matcher.accept(token)
