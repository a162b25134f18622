"""Sampling as pure functions over one row of logits, plus a small per-request `Sampler`.

Order: logit bias (OpenAI's `logit_bias`) -> repetition penalty (prompt + output) -> presence/frequency
penalties (output) -> temperature -> top-k -> top-p -> draw. Greedy (temperature 0) takes the argmax after the
bias and penalties.

**Sampling by shared noise.** A draw is a Gumbel-max: the token at output index n of a request with seed s is
argmax_j (x_j / T + g_j) over the tokens top-k / top-p / the grammar keep, where x is the row after bias and
penalties and g_j = -ln(-ln(u_j)) with u_j a counter-based hash of (s, n, j) (`noise_key`, `gumbel`). The
argmax of logits plus independent Gumbel noise is an exact draw from softmax(x / T) over the kept tokens, so
the distribution is the usual one. What the noise buys: the draw depends only on (seed, index, row), not on a
generator's history, so
- a seeded request gives the same tokens whatever else the engine runs (as before), and
- speculation can be exact token for token under sampling too: a draft proposes the draft row's draw with the
  same noise, the verifier draws its own at each position, and a draft is accepted when the two tokens agree.
  The output *is* plain sampling's output for that seed (engine/speculative.py), the draft length may follow
  measured speed without changing it, and sampled rounds run in one native call like greedy ones.
The noise is defined in float32 operations each rounded alone (`_ln32`); the native library computes the
same bits (kernels/csrc/sample.cpp, tests/kernels/test_sample.py). u has 23 random bits (an odd multiple of
2^-24), so g is bounded by about 16.6: a token's probability is off by at most the chance of a larger draw
(~6e-8), below float32 softmax's own rounding. top-k and top-p act on x / T in float32 (`truncate`); the
library's version sums the nucleus's mass in another order, so wherever it is loaded the draws call it: the
engine core's Samplers draw through its batch runner (`BatchRunner.draw_row`), and the PyTorch definition
(`draw_row`) serves hosts without it.
"""

from __future__ import annotations

import os

import torch

from .knobs import SamplingParams

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


def penalized(p: SamplingParams) -> bool:
    """Penalties or a logit bias: the row is changed before the token is picked (no raw-argmax shortcut, no
    native round: they read the raw head)."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 \
        or bool(p.logit_bias)


def processed_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor,
                     counts: torch.Tensor, cols: torch.Tensor | None = None) -> torch.Tensor:
    """Logit bias and penalties only (what greedy takes the argmax of), in float64: the one chain every row
    goes through, a plain row's and a draft's alike. logits: (V,), or a draft head's (n,) over the token ids
    `cols`, with `seen` indexing and `counts` aligned to those entries."""
    x = apply_logit_bias(logits.double(), params.logit_bias, cols)
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


# -- sampling by shared noise ------------------------------------------------------------------------
_M32 = 0xFFFFFFFF
_MIX1, _MIX2, _GOLD = 0x7FEB352D, 0x846CA68B, 0x9E3779B9


def _f32(h: str) -> torch.Tensor:
    return torch.tensor(float.fromhex(h), dtype=torch.float32)


_C3, _C5, _C7, _C9 = _f32("0x1.555556p-2"), _f32("0x1.99999ap-3"), _f32("0x1.24924ap-3"), _f32("0x1.c71c72p-4")
_SQRT2, _LN2, _TWO_M24 = _f32("0x1.6a09e6p+0"), _f32("0x1.62e430p-1"), _f32("0x1p-24")
_ONE, _TWO, _HALF = _f32("0x1p+0"), _f32("0x1p+1"), _f32("0x1p-1")


def _mix32(x: int) -> int:
    """A 32-bit integer hash (lowbias32), on a Python int."""
    x ^= x >> 16
    x = (x * _MIX1) & _M32
    x ^= x >> 15
    x = (x * _MIX2) & _M32
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without leaving int64's range."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32_t(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX2)
    return x ^ (x >> 16)


def _ln32(x: torch.Tensor) -> torch.Tensor:
    """ln x of positive normal float32 values, as kernels/csrc/sample.cpp ln32 computes it (each operation
    rounded alone): x = 2^e m, m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh((m - 1) / (m + 1)) to t^9."""
    b = x.view(torch.int32)
    e = ((b >> 23) & 0xFF) - 127
    m = ((b & 0x7FFFFF) | 0x3F800000).view(torch.float32)
    big = m > _SQRT2
    m = torch.where(big, m * _HALF, m)
    e = e + big.to(torch.int32)
    t = (m - _ONE) / (m + _ONE)
    t2 = t * t
    s = _C9 * t2
    s = (((s + _C7) * t2 + _C5) * t2 + _C3) * t2 + _ONE
    return e.to(torch.float32) * _LN2 + (t * s) * _TWO


def noise_key(seed: int, n: int) -> int:
    """The 32-bit key of output index n of a request seeded `seed` (kernels/csrc/sample.cpp tl_noise_key)."""
    return _mix32(_mix32((seed & _M32) ^ _mix32(n & _M32)) ^ ((seed >> 32) & _M32))


def gumbel(key: int, ids: torch.Tensor) -> torch.Tensor:
    """float32 Gumbel noise g(key, token) of the token ids `ids` (int64)."""
    h = _mix32_t(_mul32(ids.to(torch.int64), _GOLD) ^ key)
    v = (((h >> 9) << 1) | 1).to(torch.float32) * _TWO_M24   # an odd multiple of 2^-24: exact in float32
    return -_ln32(-_ln32(v))


def _choose(x: torch.Tensor, inv_temp: float, key: int, ids: torch.Tensor | None) -> int:
    """The PyTorch definition of a draw: argmax of x * inv_temp + g in float32 (excluded tokens are -inf),
    inv_temp rounded to float32 first, as the native library takes it."""
    ids = torch.arange(x.shape[-1]) if ids is None else ids
    return int(torch.argmax(x.to(torch.float32) * torch.tensor(inv_temp, dtype=torch.float32) + gumbel(key, ids)))


def truncate(y: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """top-k and top-p on float32 scores y (x / T): dropped tokens become -inf. top-k keeps the scores at least
    the k-th largest; top-p then keeps, in descending order of score (ties by index), the tokens whose
    probability mass before them is below p (the first always), probabilities exp(y - max) in float32 over
    their sum in double (kernels/csrc/sample.cpp `truncate`, which the library's draws use: it may differ in
    the last bits of that sum, so at a cut that falls within rounding of p)."""
    n = y.shape[-1]
    if 0 < top_k < n:
        y = y.masked_fill(y < torch.topk(y, top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        mx = y.max()
        if torch.isfinite(mx):
            w = torch.exp(y - mx)
            w = torch.where(torch.isinf(y), torch.zeros_like(w), w)
            order = torch.sort(y, descending=True, stable=True).indices
            ws = w[order].double()
            before = torch.cumsum(ws, 0) - ws
            drop = before >= float(torch.tensor(top_p, dtype=torch.float32)) * ws.sum()
            drop[0] = False
            y = y.clone()
            y[order[drop]] = float("-inf")
    return y


def draw_row(x: torch.Tensor, key: int, inv_temp: float, top_k: int = 0, top_p: float = 1.0,
             ids: torch.Tensor | None = None) -> int:
    """The entry of row x (its tokens `ids`, None: 0..n-1) drawn under `key` at 1 / T, after top-k and top-p
    (`truncate`; 0 and 1: off). The definition: the engine core's Samplers draw through the batch runner, which
    has the native library compute it where it is loaded (`BatchRunner.draw_row`: the same noise bit for bit)."""
    if (0 < top_k < x.shape[-1]) or top_p < 1.0:
        x = truncate(x.to(torch.float32) * torch.tensor(inv_temp, dtype=torch.float32), top_k, top_p)
        inv_temp = 1.0
    return _choose(x, inv_temp, key, ids)


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


def request_seed(seed: int | None) -> int:
    """The seed a request draws with: its own, or fresh entropy (63 bits)."""
    return seed if seed is not None else int.from_bytes(os.urandom(8), "little") & (2**63 - 1)


class Sampler:
    """One request's sampling state: its generator, seen tokens and output counts, and under a constraint
    (`matcher`, engine/constraint.py) the grammar's state: its mask is applied to the row's logits before
    anything else (penalties leave -inf alone), so every rule below samples from the masked distribution."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, matcher=None, draw=None):
        """`draw`: the row draw (`draw_row`'s arguments; None: `draw_row` itself, the PyTorch definition); the engine
        core passes its runner's (`BatchRunner.draw_row`), the same draw computed natively."""
        self.params = params
        self._draw = draw_row if draw is None else draw
        self.vocab_size = vocab_size
        self.matcher = matcher
        self.seed = request_seed(params.seed)
        self.n_out = 0                  # tokens accepted so far: the output index of the next draw
        # the seen tokens and output counts over the vocabulary, made when a penalty first reads them (two
        # vocabulary-wide tensors a request cost ~0.3 ms of its first token: fresh pages, a parallel fill)
        self._prompt_ids = prompt_ids
        self._seen_mask: torch.Tensor | None = None
        self._token_counts: torch.Tensor | None = None
        self._pending: list[int] = []   # accepted tokens not yet in the two tensors (only penalties read them)

    def _flush(self) -> None:
        if self._seen_mask is None:
            self._seen_mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            if self._prompt_ids:
                self._seen_mask[torch.tensor(self._prompt_ids)] = True
            self._token_counts = torch.zeros(self.vocab_size, dtype=torch.int64)
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
        """Penalties or a logit bias (`penalized`)."""
        return penalized(self.params)

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

    @property
    def head_matcher(self):
        """The grammar's `Matcher` where the head can pick the token itself under its bitmask (a constraint's
        matcher, not a thinking block's; no penalties or bias: the pick is then the argmax or draw of the raw
        row over the allowed tokens, which `tl_draw` computes with the mask), else None."""
        m = self.active_matcher
        return m if m is not None and not self.penalized and hasattr(m, "bitmask") else None

    def head_pick(self):
        """What the head needs to pick this output's next token itself (`BatchRunner.execute`'s `greedy`):
        None (the raw argmax), (key, 1 / T, top_k, top_p) (a draw), either with the matcher as a fifth entry
        (1 / T = 0: the masked argmax); False where the row's logits must come back (penalties, bias, a thinking
        block)."""
        if self.plain_greedy:
            return None
        if self.plain_sampled:
            return self.draw_params()
        m = self.head_matcher
        if m is None:
            return False
        return (0, 0.0, 0, 1.0, m) if self.params.greedy else (*self.draw_params(), m)

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

    def key(self, ahead: int = 0) -> int:
        """The noise key of the draw `ahead` tokens after the next one (speculation's drafts)."""
        return noise_key(self.seed, self.n_out + ahead)

    @property
    def inv_temp(self) -> float:
        return 1.0 / self.params.temperature

    @property
    def plain_sampled(self) -> bool:
        """Sampling from the raw row (temperature, top-k, top-p; no penalties, bias or grammar): the draw is
        `draw_row` over the raw logits, which the native head computes itself (`tl_head`'s draws)."""
        return not self.params.greedy and not self.penalized and self.active_matcher is None

    def draw_params(self, ahead: int = 0) -> tuple[int, float, int, float]:
        """(key, 1 / T, top_k, top_p) of the draw `ahead` tokens after the next one (`draw_row`, `tl_draw`)."""
        p = self.params
        return self.key(ahead), self.inv_temp, p.top_k if 0 < p.top_k < self.vocab_size else 0, p.top_p

    def sample(self, logits: torch.Tensor, ahead: int = 0) -> int:
        """Pick the next token from one row of logits (does not record it: call `accept`); `ahead`: the draw
        that many tokens later (a speculative draft's, before the tokens between are accepted)."""
        if self.params.greedy:
            return self.greedy_token(logits)
        if self.active_matcher is not None and not self.penalized and self.params.top_k <= 0 \
                and self.params.top_p >= 1.0:
            # over the allowed tokens only (the masked row without its -inf entries: the same draw); cheaper
            # than masking the full row even where most tokens are allowed (docs/structured.md)
            ids = self.matcher.allowed_ids()
            sub = logits[: self.vocab_size].index_select(0, ids.to(logits.device))
            return int(ids[self._draw(sub, self.key(ahead), self.inv_temp, ids=ids)])
        x = processed_logits(self._row(logits), self.params, self._seen(), self.counts)
        return self._draw(x, *self.draw_params(ahead))

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
        self.n_out += 1
        self._pending.append(token)   # two tensor writes a token cost more than the greedy step's bookkeeping
        if self.matcher is not None:
            self.matcher.accept(token)
