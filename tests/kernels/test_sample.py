"""Sampling by shared noise: the native library's noise and draws (kernels/csrc/sample.cpp) against their
definition in engine/sampling.py, bit for bit, on every build the host runs (the host's, AVX2 without VNNI/AMX,
portable scalar). The noise is float32 operations each rounded alone, so the builds agree exactly, not
within a tolerance: a sampled token must not depend on the host."""

from __future__ import annotations

import pytest
import torch

from tinyloop.engine import sampling

kernels = pytest.importorskip("tinyloop.kernels.lib")
BUILDS = ("native", "avx2", "portable")
try:
    for isa in BUILDS:
        kernels.load(isa)
except kernels.NativeBuildError as exc:
    pytest.skip(f"native library unavailable: {exc}", allow_module_level=True)

SEEDS = [(0, 0), (7, 3), (2**62 + 5, 123456), (12345678901234, 99), (2**63 - 1, 2**31 + 7)]


@pytest.mark.parametrize("isa", BUILDS)
def test_keys_and_noise_equal_the_definition(isa):
    lib = kernels.load(isa)
    g = torch.Generator().manual_seed(0)
    for seed, n in SEEDS:
        key = sampling.noise_key(seed, n)
        assert lib.tl_noise_key(seed, n) == key
        for ids in (torch.arange(50_257), torch.randint(0, 2**31 - 1, (4_099,), generator=g)):
            out = torch.empty(ids.numel(), dtype=torch.float32)
            lib.tl_gumbel(key, ids.data_ptr(), ids.numel(), out.data_ptr())
            assert torch.equal(out, sampling.gumbel(key, ids)), (isa, seed, n)


@pytest.mark.parametrize("isa", BUILDS)
def test_draws_equal_the_definition(isa):
    """tl_choose: argmax of x / T + g in float32, -inf entries never drawn, over a subset's token ids too."""
    lib = kernels.load(isa)
    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        n = int(torch.randint(1, 3000, (), generator=g))
        x = torch.randn(n, generator=g) * 4
        x[torch.rand(n, generator=g) < 0.3] = float("-inf")
        x[0] = 1.0                                    # one finite entry at least
        ids = None if trial % 2 else torch.randint(0, 50_257, (n,), generator=g)
        inv_t = [1.0, 1 / 0.7, 1 / 1.9, 5.0][trial % 4]
        key = sampling.noise_key(trial, trial * 3)
        want = int(torch.argmax(x * torch.tensor(inv_t, dtype=torch.float32)
                                + sampling.gumbel(key, torch.arange(n) if ids is None else ids)))
        row = x.clone()
        got = lib.tl_choose(row.data_ptr(), n, None if ids is None else ids.data_ptr(), inv_t, key)
        assert got == want and torch.isfinite(x[got])
        row = x.clone()   # (held: a temporary's memory is freed before the call writes into it)
        assert lib.tl_choose(row.data_ptr(), n, None, 0.0, key) == int(torch.argmax(x))   # T = 0: argmax


@pytest.mark.parametrize("isa", BUILDS)
def test_truncated_draws_equal_the_definition(isa):
    """tl_draw with top-k and top-p against `truncate` + the draw in PyTorch: the same kept set (the float32
    exp of the two may differ in the last bit, and the two sums in their order: a cut within 1e-5 of p is
    skipped) and the same token."""
    lib = kernels.load(isa)
    g = torch.Generator().manual_seed(2)
    checked = 0
    for trial in range(60):
        n = int(torch.randint(2, 6000, (), generator=g))
        x = torch.randn(n, generator=g) * float(torch.rand((), generator=g) * 6 + 0.5)
        top_k = [0, 1, 5, 40, n + 3][trial % 5]
        top_p = [1.0, 0.9, 0.5, 0.95, 0.1][(trial // 5) % 5]
        inv_t = [1.0, 1 / 0.7, 2.0][trial % 3]
        key = sampling.noise_key(trial, 7)
        y = x * torch.tensor(inv_t, dtype=torch.float32)
        kept = sampling.truncate(y, top_k, top_p)
        if top_p < 1.0:   # how close the cut's cumulative mass is to p
            yk = sampling.truncate(y, top_k, 1.0)   # what top-p weighs: the tokens top-k kept
            ws = torch.sort(torch.exp(yk - yk.max()).double(), descending=True).values
            cum = torch.cumsum(ws, 0) / ws.sum()
            if (cum - top_p).abs().min() < 1e-5:
                continue
        want = int(torch.argmax(kept + sampling.gumbel(key, torch.arange(n))))
        s = kernels.TlSampling(key, inv_t, top_k, top_p)
        row = x.clone()
        assert lib.tl_draw(row.data_ptr(), n, None, s) == want, (trial, top_k, top_p)
        assert torch.isfinite(kept[want])
        if 0 < top_k < n:
            assert int(torch.isfinite(kept).sum()) <= top_k
        checked += 1
    assert checked > 40


@pytest.mark.parametrize("isa", BUILDS)
def test_masked_draws_equal_the_definition(isa):
    """tl_draw under a grammar's bitmask (llguidance's layout: bit j of word i allows token 32 i + j): the
    forbidden tokens -inf first, then the argmax (1 / T = 0) or the draw, top-k / top-p over what is left, as
    the PyTorch sampler does with the masked row; over the full row and over a subset's token ids. Masks mix
    words of all ones, all zeros and both (the kernel's three cases) and may allow a single token."""
    lib = kernels.load(isa)
    g = torch.Generator().manual_seed(3)
    for trial in range(48):
        n = int(torch.randint(40, 5000, (), generator=g))
        words = torch.randint(-2**31, 2**31, ((n + 31) // 32,), generator=g, dtype=torch.int64).to(torch.int32)
        kind = torch.randint(0, 3, words.shape, generator=g)
        words[kind == 0] = -1                            # all 32 allowed
        words[kind == 1] = 0                             # none
        if trial % 6 == 5:                               # one token alone
            words.zero_()
            one = int(torch.randint(0, n, (), generator=g))
            words[one >> 5] = torch.tensor(1 << (one & 31), dtype=torch.int64).to(torch.int32)
        ids = None if trial % 2 else torch.randint(0, n, (n // 2,), generator=g)
        tok = torch.arange(n) if ids is None else ids
        allowed = ((words.view(torch.uint32).to(torch.int64)[tok >> 5] >> (tok & 31)) & 1).bool()
        if not allowed.any():
            continue
        x = torch.randn(tok.numel(), generator=g) * 3
        masked = x.masked_fill(~allowed, float("-inf"))
        inv_t = [0.0, 1.0, 1 / 0.7][trial % 3]
        top_k, top_p = [(0, 1.0), (5, 1.0), (0, 0.8)][(trial // 3) % 3]
        key = sampling.noise_key(trial, 11)
        if inv_t == 0.0:
            want = int(torch.argmax(masked))
        else:
            kept = sampling.truncate(masked * torch.tensor(inv_t, dtype=torch.float32), top_k, top_p)
            want = int(torch.argmax(kept + sampling.gumbel(key, tok)))
        s = kernels.TlSampling(key, inv_t, top_k, top_p, words.data_ptr())
        row = x.clone()
        got = lib.tl_draw(row.data_ptr(), tok.numel(), None if ids is None else ids.data_ptr(), s)
        assert got == want and bool(allowed[got]), (trial, inv_t, top_k, top_p)


@pytest.mark.parametrize("isa", BUILDS)
def test_argmax_follows_torch(isa):
    """The library's argmax (the head's greedy pick, every draw's last step; tl_choose at 1 / T = 0): the first
    of equal maxima, the first NaN where there is one, as torch.argmax; rows of every length around the
    vector widths, with ties, -inf runs (a pruned draw's row), +inf, -0.0 against +0.0 and NaNs."""
    lib = kernels.load(isa)
    g = torch.Generator().manual_seed(5)
    for trial in range(400):
        n = [1, 7, 8, 31, 32, 33, 63, 100, 1000, 50_257][trial % 10]
        x = torch.randn(n, generator=g).round(decimals=1)            # (ties likely)
        kind = (trial // 10) % 8
        if kind == 1:
            x[torch.rand(n, generator=g) < 0.9] = float("-inf")
        elif kind == 2:
            x[:] = float("-inf")
        elif kind == 3:
            x[int(torch.randint(0, n, (), generator=g))] = float("inf")
            x[int(torch.randint(0, n, (), generator=g))] = float("inf")
        elif kind == 4:
            x[int(torch.randint(0, n, (), generator=g))] = float("nan")
            x[int(torch.randint(0, n, (), generator=g))] = float("inf")
        elif kind == 5:
            x[int(torch.randint(0, n, (), generator=g))] = float("nan")
            x[int(torch.randint(0, n, (), generator=g))] = float("nan")
        elif kind == 6:
            x[:] = 0.0
            x[int(torch.randint(0, n, (), generator=g))] = -0.0
        elif kind == 7:
            x = x.abs().neg()                                          # a max of -0.0 or 0.0 possibly tied
        row = x.clone()
        assert lib.tl_choose(row.data_ptr(), n, None, 0.0, 0) == int(torch.argmax(x)), (trial, n, kind)
