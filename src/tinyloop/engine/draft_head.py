"""What scores a speculative round's drafts and verifies them: the draft head over a reduced vocabulary,
and the exact greedy argmax of the full head through fp16 weights (the PyTorch path's verification).
`engine/speculative.py` drives them; docs/speculative.md says why each exists."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ..model import LoopedTransformer
from .draft_vocab import frequency_ranking, has_ranking

DRAFT_VOCAB = 2048      # draft head rows (most frequent tokens); None or >= vocab -> the full head. 2,048 rows
                        # and the request's own tokens (CONTEXT_ROWS) yielded 3.99 tokens a d=2 k=4 round on 32
                        # corpus prompts against 4.00 with 4,096, at 0.88x a draft's time (0.5 MB of int8 rows a
                        # draft, which the core's 0.85 MB of int4 codes share the L2 with)
CONTEXT_ROWS = 1024     # extra draft rows for the request's own tokens outside the ranked set


class DraftHead:
    """The LM head restricted to a token subset, for drafting only (verification uses the full head).

    Rows: the `size` most frequent tokens, then every prompt or output token outside them as it appears.
    `size` "auto": DRAFT_VOCAB rows where the vocabulary has a measured ranking (GPT-2's), else the full
    head (`draft_vocab.has_ranking`). A draft's logits over these rows come from the batch runner, which runs the
    draft's rows (`Rows.draft`, `BatchRunner.draft_logits`: `norm`, then `native_rows` or `weight`).
    """

    def __init__(self, model: LoopedTransformer, size: int | str | None, extra_rows: int = CONTEXT_ROWS,
                 norm: torch.nn.Module | None = None, natively: bool = False):
        """`natively`: the native executor runs the model (`BatchRunner.natively`): the draft then reads the head as
        stored (its int8 rows where it has them), and without it 16-bit rows in fp32."""
        self.model = model
        self.norm = model.final_norm if norm is None else norm  # a draft exit brings its own final norm
        vocab = model.cfg.vocab_size
        weight = _draft_head_weight(model, natively)
        self.ids: torch.Tensor | None = None
        self.q: _QuantRows | None = None   # (int8 rows of the model's head: below)
        if size == "auto":   # the reduced head only where a measured ranking says which tokens to keep
            size = DRAFT_VOCAB if has_ranking(vocab) else None
        if size is None or size <= 0 or size >= vocab:
            self._weight, self.n = weight, vocab
            return
        ranked, self._ranked = _ranked_ids(model, weight, size)
        cap = min(vocab, size + extra_rows)
        self.ids = torch.zeros(cap, dtype=torch.long, device=weight.device)
        self.ids[:size] = ranked
        self._added: set[int] = set()   # (Python sets: a tensor lookup a token cost more than the rest of `add`)
        self._source, self._size = weight, size
        self.n = size
        # where the model's head is int8 (the shipped int4 file) and the native executor runs, the draft reads
        # those codes' rows (1 MB for 4,096 rows, against 2 MB of 16-bit embedding rows: the draft head's
        # GEMV was 8% of a round), which are also closer to the verifier's own head; the 16-bit rows are then
        # not copied (2.6 MB a request, ~0.3 ms of its first token)
        self.q = _QuantRows.of(model, self.ids, size) if natively else None
        self._weight = None if self.q is not None else self._float_rows()

    def _float_rows(self) -> torch.Tensor:
        """This request's 16-bit (or fp32) draft rows: the ranked block, then the rows `add` made draftable."""
        w = torch.empty(self.ids.shape[0], self._source.shape[1], dtype=self._source.dtype, device=self._source.device)
        size = self._size
        w[:size] = _ranked_block(self.model, self._source, size)
        if self.n > size:
            w[size:self.n] = self._source[self.ids[size:self.n]]
        return w

    @property
    def weight(self) -> torch.Tensor:
        """The float draft rows (the PyTorch path's; made on first use where int8 rows serve the native one)."""
        if self._weight is None:
            self._weight = self._float_rows()
        return self._weight

    def native_rows(self):
        """What the native executor reads as the draft head: the int8 rows (`_QuantRows`, a view of the first
        n) or the float rows."""
        return self.q.view(self.n) if self.q is not None else self.weight[: self.n]

    def add(self, tokens: list[int]) -> None:
        """Make `tokens` draftable (prompt and output tokens recur far more often than their rank says)."""
        if self.ids is None:
            return
        for t in tokens:
            if t not in self._ranked and t not in self._added and self.n < self.ids.shape[0]:
                self._added.add(t)
                self.ids[self.n] = t
                if self._weight is not None:
                    self._weight[self.n] = self._source[t]
                if self.q is not None:
                    self.q.copy_row(self.n, t)
                self.n += 1

    def token(self, col: int) -> int:
        return col if self.ids is None else int(self.ids[col])

    def tokens(self, cols: list[int]) -> list[int]:
        return cols if self.ids is None else self.ids[torch.tensor(cols)].tolist()

    def full_logits(self, lg: torch.Tensor, vocab: int) -> torch.Tensor:
        """(n,) draft logits -> (vocab,) with -inf for tokens the draft cannot propose."""
        if self.ids is None:
            return lg
        out = torch.full((vocab,), float("-inf"), dtype=torch.float64, device=lg.device)
        out[self.ids[: self.n]] = lg.double()
        return out


_DRAFT_WEIGHTS: "weakref.WeakKeyDictionary[LoopedTransformer, tuple]" = weakref.WeakKeyDictionary()


class _QuantRows:
    """Rows of the model's int8 head (codes, fp16 scales, zero points) gathered for a draft head, read by the
    native executor as an int8 layer (`layers.linear_desc` through `native_weights`)."""

    def __init__(self, src: dict, bufs: dict, n: int | None = None):
        self.src, self.bufs, self.n = src, bufs, n

    @classmethod
    def of(cls, model: LoopedTransformer, ids: torch.Tensor, size: int) -> "_QuantRows | None":
        head = getattr(model, "head_linear", None)
        if head is None or not hasattr(head, "native_weights"):
            return None
        src = head.native_weights()
        if not isinstance(src, dict) or src["bits"] != 8:
            return None
        # the ranked rows gathered once per model, head and size (a request copies them, as the float rows)
        per_model = _QUANT_RANKED.setdefault(model, {})
        hit = per_model.get(size)
        if hit is None or hit[0] is not src["qweight"]:
            rows = ids[:size].cpu()
            block = {k: src[k].index_select(0, rows) for k in ("qweight", "scales", "zeros")}
            hit = per_model[size] = (src["qweight"], block)
        bufs = {}
        for k, block in hit[1].items():
            bufs[k] = torch.empty((ids.shape[0], *block.shape[1:]), dtype=block.dtype)
            bufs[k][:size] = block
        return cls(src, bufs)

    def copy_row(self, i: int, token: int) -> None:
        for k, b in self.bufs.items():
            b[i] = self.src[k][token]

    def view(self, n: int) -> "_QuantRows":
        return _QuantRows(self.src, self.bufs, n)

    def native_weights(self) -> dict:
        return {"bits": 8, "group_size": self.src["group_size"],
                **{k: b[: self.n] for k, b in self.bufs.items()}}


def _draft_head_weight(model: LoopedTransformer, natively: bool) -> torch.Tensor:
    """The LM head as drafts read it: 16-bit weights in fp32 on CPU without the native executor (torch's
    16-bit GEMV is slow there and the draft needs no exactness), as stored with it. Made once per model (a
    50k-row conversion costs tens of ms), rebuilt if the head changes; read only."""
    w = model.head_weight
    key = (w.data_ptr(), w._version, natively)
    cached = _DRAFT_WEIGHTS.get(model)
    if cached is None or cached[0] != key:
        weight = w.detach()
        if weight.device.type == "cpu" and weight.dtype in (torch.float16, torch.bfloat16) \
                and not natively:   # (the native executor reads 16 bits as stored)
            weight = weight.float()
        if getattr(model, "logit_scale", None) is not None:   # each token's logit scale folded into its row
            s = model.logit_scales(weight.shape[0], torch.promote_types(weight.dtype, torch.float32)).detach()
            weight = (weight.to(s.dtype) * s[:, None]).to(weight.dtype)
        cached = _DRAFT_WEIGHTS[model] = (key, weight)
    return cached[1]


_RANKED: "weakref.WeakKeyDictionary[LoopedTransformer, dict]" = weakref.WeakKeyDictionary()
_QUANT_RANKED: "weakref.WeakKeyDictionary[LoopedTransformer, dict]" = weakref.WeakKeyDictionary()


def _ranked_ids(model: LoopedTransformer, weight: torch.Tensor, size: int):
    """The `size` most frequent tokens' ids and their set, made once per model, head and size (a request copies
    them: building them each time cost 10-60 ms a request with the rows below); read only."""
    per_model = _RANKED.setdefault(model, {})
    hit = per_model.get(size)
    if hit is None or hit[0] is not weight:   # (`_draft_head_weight` makes a new tensor when the head changes)
        ranked = frequency_ranking(model.cfg.vocab_size, size).to(weight.device)
        hit = per_model[size] = (weight, ranked, frozenset(ranked.tolist()), None)
    return hit[1:3]


def _ranked_block(model: LoopedTransformer, weight: torch.Tensor, size: int) -> torch.Tensor:
    """Those tokens' float head rows, gathered once per model, head and size, on first use: the PyTorch path's
    draft rows (where the native executor reads the head's int8 rows, never: the gather of 2,048 16-bit rows
    was most of a draft head's first build, ~10 ms of a fresh process's first speculative request)."""
    weight_, ranked, ids, block = _RANKED[model][size]
    if block is None:
        block = weight[ranked].contiguous()
        _RANKED[model][size] = (weight_, ranked, ids, block)
    return block


class ExactArgmax:
    """The full LM head's argmax without the full fp32 head: fp16-weight logits, then exact rescoring.

    Verification scores several positions at once, where fp32 GEMM on this CPU costs 2-3x a single row
    while FBGEMM's fp16-weight kernel costs about the same as one. For each row the fp16 logits a'
    differ from the fp32 logits a by at most B = ||x|| * (max_v ||w_v - fp16(w_v)|| + 2 * gamma *
    max_v ||w_v||) (weight rounding plus both accumulations; gamma = n * 2^-24, a 2x safety factor on
    top), so the true argmax is among the candidates a'_v >= max(a') - 2B; those few rows are
    rescored with the fp32 (or float64) weights and the best one is taken. Greedy decoding without
    penalties only; anything else uses the full head.
    """

    def __init__(self, model: LoopedTransformer):
        from ..quant.fp16 import FP16Linear

        w = model.head_weight.detach()
        self.model, self.weight = model, w
        self.fp16 = FP16Linear(w)
        wf = w.double()
        err = (wf - w.half().double()).norm(dim=1).max().item()
        gamma = w.shape[1] * 2.0 ** -24
        self.slack = 2.0 * (err + 2.0 * gamma * wf.norm(dim=1).max().item() + 2.0 ** -20)

    @classmethod
    def for_model(cls, model: LoopedTransformer) -> "ExactArgmax":
        """One per model (packing the fp16 head costs tens of ms), rebuilt if the head's weights change."""
        w = model.head_weight
        key = (w.data_ptr(), w._version)
        cached = _ARGMAX_HEADS.get(model)
        if cached is None or cached[0] != key:
            cached = (key, cls(model))
            _ARGMAX_HEADS[model] = cached
        return cached[1]

    @staticmethod
    def usable(model: LoopedTransformer) -> bool:
        from ..quant.fp16 import fbgemm_fp16_available

        w = model.head_weight
        plain_head = getattr(model, "head_linear", None) is None  # the fast path may replace logits()
        plain_head = plain_head and getattr(model, "logit_scale", None) is None   # (nGPT's per-token scales)
        return (plain_head and w.device.type == "cpu" and w.dtype in (torch.float32, torch.float64)
                and fbgemm_fp16_available())

    def __call__(self, x: torch.Tensor) -> list[int]:
        """x: (T, dim) coda output -> the full head's argmax token of each row."""
        xn = self.model.final_norm(x)                            # (T, dim)
        approx = self.fp16(xn)                                   # (T, vocab) fp32
        bound = 2.0 * self.slack * xn.double().norm(dim=1)      # (T,)
        top = approx.max(dim=1).values.double()
        out = []
        for row in range(xn.shape[0]):
            cand = (approx[row].double() >= top[row] - bound[row]).nonzero().flatten()
            if cand.numel() == 1:
                out.append(int(cand[0]))
                continue
            exact = F.linear(xn[row:row + 1], self.weight[cand])[0]
            out.append(int(cand[int(torch.argmax(exact))]))
        return out


_ARGMAX_HEADS: "weakref.WeakKeyDictionary[LoopedTransformer, tuple]" = weakref.WeakKeyDictionary()
