"""A GGUF's quantized blocks as they are, through the native library against model/'s definition: int4's min form
(w = q * scale + min, a float16 minimum per group: Q4_1's blocks; quant/packing.py `dequantize_min`), one layer on
every path the int4 format runs on (fp32 activations: the portable build's and `TINYLOOP_NATIVE_Q8=0`; int8
activations: the vector tiles, qq_rows8, the 16-rows-a-vector packed kernel, the AMX tiles where the host has them)
and whole decode steps of the test models; and int8 in groups of 32 (Q8_0's blocks: the head). tests/kernels/
test_every_build.py runs this file on the avx2 and portable builds too."""

from __future__ import annotations

import pytest
import torch

from tinyloop.quant.linear import QuantLinear
from tinyloop.quant.packing import dequantize, dequantize_min, pack, quantize_min

kernels = pytest.importorskip("tinyloop.kernels.lib")
try:
    kernels.load()
except kernels.NativeBuildError as exc:  # no compiler here: the PyTorch path serves, nothing to compare
    pytest.skip(f"native library unavailable: {exc}", allow_module_level=True)

from native_pair import CONFIGS, make_pair  # noqa: E402
from test_native import check, one_step  # noqa: E402
from tinyloop.kernels.executor import _forward, linear_desc  # noqa: E402
from tinyloop.kernels.layers import pack_int4  # noqa: E402

PORTABLE = kernels.load().tl_isa() == b"portable scalar"
EPS32 = 2.0 ** -24   # fp32's unit roundoff


@pytest.fixture(autouse=True)
def exact_activations(monkeypatch):
    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "0")


def _layer(n: int, k: int, group: int, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[0, :group] += 0.3    # a group of positive weights only: its minimum > 0
    w[1, :group] -= 0.3    # and one of negative ones only
    q, s, m = quantize_min(w, group)
    lin = QuantLinear.from_portable(pack(q, 4), s, None, 4, kernel="native", mins=m)
    assert lin.kind == "native" and "mins" in lin.native_weights()
    return lin, q, s, m


def _w64(q, s, m):
    """The weights exactly: q * s + m in float64 (fp16 s and m, 4-bit q: no rounding)."""
    G = q.shape[1] // s.shape[1]
    return (q.double().reshape(q.shape[0], -1, G) * s.double()[..., None] + m.double()[..., None]).reshape(q.shape)


def _q8(x: torch.Tensor, ab: int) -> torch.Tensor:
    """The activations as the integer kernels quantize them (intdot.h quantize_q8): per block of `ab` columns
    d = max|x| / 127 and q = round-half-even(x * (1 / d)) in fp32; returned as q * d in float64."""
    xb = x.float().reshape(x.shape[0], -1, ab)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(xb * inv).double() * d.double()).reshape(x.shape)


@pytest.mark.parametrize("k", [576, 96, 1056])
@torch.inference_mode()
def test_min_form_with_fp32_activations(k):
    """fp32 activations (every build: the portable one's only form), 1 .. 40 rows, 1 and 2 threads, batch-invariant
    or not (the outer-product panels from 6 rows, whose weights are dequantized q * s + min): each output within
    1e-6 of the exact product, relative to the sum of |x w| it is made of. The kernel sums the group's s q x in fp32
    and adds -min times the group's fp32 sum of x: each of its ~2k roundings moves a partial sum by at most 2^-24 of
    |partial| <= sum |x w| + |min| sum |x| (the min term of a group is as large as its codes' term), so 2k 2^-24
    (5e-7 at k = 4,000) bounds every path's difference; k <= 1,056 here, and 1e-6 of that abs sum is above it."""
    lin, q, s, m = _layer(101, k, 32)
    desc = linear_desc(lin, [])
    assert not desc.act_q8
    w64 = _w64(q, s, m)
    absw = w64.abs()
    lib = kernels.load()
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3, 7, 8, 13, 16, 17, 40):
        x = torch.randn(rows, k, generator=g)
        exact = x.double() @ w64.t()
        bound = 1e-6 * (x.double().abs() @ absw.t() + x.double().abs().sum(1, keepdim=True) * m.double().abs().amax())
        for threads, mode in ((1, 1), (2, 1), (2, 0)):
            old = lib.tl_set_batch_invariant(mode)
            try:
                got = _forward(desc, x, threads).double()
            finally:
                lib.tl_set_batch_invariant(old)
            assert ((got - exact).abs() <= bound).all(), (rows, threads, mode)


@pytest.mark.skipif(PORTABLE, reason="the portable build has no int8 activations (its layers run in fp32)")
@pytest.mark.parametrize("k,group", [(576, 32), (1536, 32), (1056, 32), (1024, 128), (2112, 64)])
@torch.inference_mode()
def test_min_form_with_int8_activations(monkeypatch, k, group):
    """int8 activations (VNNI, AVX2; the SmolLM2 shapes 576 and 1536 wide, in groups of 32; 1056: a last block of
    32 columns alone; 2112 in groups of 64: qq_rows8's 1,024-column chunks): the kernel's integer sums are exact, so
    its output is the exact product of the weights with the activations as it rounds them (`_q8`, its arithmetic
    replayed) up to its fp32 scaling and summing: per block t = fma(I_a, d_a s_g, t) (two roundings) and per group
    corr = fma(-min_g, X_g, corr) with X_g the block scales times code sums (two more), so at most 2 (k/ab + k/g)
    + 8 roundings of 2^-24 of the abs sum. That bound is ~1e-6 relative; the int8 rounding itself moves outputs
    by ~1e-2 (asserted too, so the comparison is against the right arithmetic). Then: a row's result is bitwise the
    same alone or in any batch (1 .. 40 rows, 1 or 2 threads: every tile), streamed, and from the 16-rows-a-vector
    packed codes (AVX-512 VNNI builds), as the zero-point form's is (test_native_linear.py)."""
    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "1")
    lin, q, s, m = _layer(71, k, group, seed=2)
    keep: list = []
    desc = linear_desc(lin, keep)
    assert desc.act_q8
    ab = 32 if group % 64 else min(group, 256)   # intdot.h act_block
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, k, generator=g)
    x[:, 100] = 6.0    # a large value: its block's scale differs from its neighbours'
    x[:, k - 3] = -5.0
    alone = torch.cat([_forward(desc, x[i:i + 1], 1) for i in range(len(x))])
    w64 = _w64(q, s, m)
    xq = _q8(x, ab)
    replay = xq @ w64.t()
    terms = xq.abs() @ w64.abs().t() + xq.abs().sum(1, keepdim=True) * m.double().abs().amax()
    roundings = 2 * (k // ab + k // group) + 8
    assert ((alone.double() - replay).abs() <= roundings * EPS32 * terms).all()
    exact = x.double() @ w64.t()
    assert (alone.double() - exact).abs().max() > 1e-4 * exact.abs().max()   # the activations were rounded
    for rows in (2, 3, 4, 5, 7, 8, 13, 16, 17, 24, 40):
        for threads in (1, 2):
            part = torch.cat([_forward(desc, x[i:i + rows], threads) for i in range(0, len(x) - rows + 1, rows)])
            assert torch.equal(part, alone[:len(part)]), (rows, threads)
    desc.streamed = 1
    assert torch.equal(torch.cat([_forward(desc, x[i:i + 1], 2) for i in range(len(x))]), alone)
    desc.streamed = 0
    for f32 in (0, 1):   # (AVX-512 VNNI builds: the packed strips, at every row count, float16 or fp32 minimums)
        desc = linear_desc(lin, keep)
        desc.packed_f32 = f32
        if not pack_int4(desc, keep):
            break
        for rows in (1, 3, 8, 9, 40):
            part = torch.cat([_forward(desc, x[i:i + rows], 2) for i in range(0, len(x) - rows + 1, rows)])
            assert torch.equal(part, alone[:len(part)]), ("packed", f32, rows)


@pytest.mark.skipif(PORTABLE, reason="the portable build has no int8 activations")
@pytest.mark.parametrize("group", [32, 128])
@torch.inference_mode()
def test_min_form_amx_tiles_equal_the_vector_tiles(monkeypatch, group):
    """Where the host has AMX (its native build), the AMX tiles take int4 layers from 8 or 16 rows; with the min
    form they are bitwise the vector tiles, as with zero points. Elsewhere both runs are the vector tiles."""
    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "1")
    lib = kernels.load()
    lin, q, s, m = _layer(83, 512, group, seed=4)
    desc = linear_desc(lin, [])
    old = lib.tl_set_amx(-1)
    g = torch.Generator().manual_seed(5)
    try:
        for rows in (8, 9, 15, 16, 17, 31, 40):
            x = torch.randn(rows, 512, generator=g)
            x[0, :32] = 50.0
            lib.tl_set_amx(0)
            vec = _forward(desc, x, 2)
            lib.tl_set_amx(1)
            assert torch.equal(vec, _forward(desc, x, 2)), rows
    finally:
        lib.tl_set_amx(old)


def test_min_form_is_int4_only():
    """The min form is int4's: an int8 or int2 layer with mins is refused (the library would return code 2)."""
    from tinyloop.kernels.layers import Unsupported

    class Fake:
        def native_weights(self):
            return {"bits": 8, "group_size": 64, "qweight": torch.zeros(4, 64, dtype=torch.uint8),
                    "scales": torch.zeros(4, 1, dtype=torch.float16), "mins": torch.zeros(4, 1, dtype=torch.float16)}
    with pytest.raises(Unsupported, match="min"):
        linear_desc(Fake(), [])


@pytest.mark.parametrize("name", ["tiny", "huginn-like", "ouro-like"])
def test_native_step_with_min_form_weights(name):
    """A decode step of the test models with every block projection in the min form (fp32 activations): the
    native executor's logits and KV pool against the PyTorch path's on the dequantized weights, within
    test_native.py's tolerance (1e-4: fp32 reordering)."""
    ref, nat = make_pair(CONFIGS[name], "int4-min")
    check(*one_step(ref, nat))


@pytest.mark.skipif(PORTABLE, reason="the portable build has no int8 activations")
def test_native_step_with_min_form_weights_and_int8_activations(monkeypatch):
    """The same with int8 activations (what decode runs): within test_native.py's 5e-2 of the logits for the
    chaotic random model (its test_int8_activations' bound: int8 rounding, amplified by the model)."""
    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "1")
    ref, nat = make_pair(CONFIGS["huginn-like"], "int4-min")
    assert any(d.act_q8 and d.mins for b in nat.executor.blocks for d in (b.wo, b.down))
    lr, ln, _, _ = one_step(ref, nat)
    err = (lr - ln).abs().max().item() / lr.abs().max().item()
    assert 0 < err < 5e-2, err



def _q8_0_layer(n: int, k: int, seed: int = 6):
    """int8 codes in groups of 32 with zero point 128, as a GGUF's Q8_0 blocks import (codes q + 128, d per 32);
    codes at both ends of their range in the first rows."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(1, 256, (n, k), generator=g, dtype=torch.uint8)
    c[0, :32], c[1, :32] = 255, 1
    s = (torch.rand(n, k // 32, generator=g) * 0.01).half()
    z = torch.full((n, k // 32), 128, dtype=torch.uint8)
    lin = QuantLinear.from_portable(c, s, z, 8, kernel="native")
    assert lin.kind == "native" and lin.group_size == 32
    return lin, dequantize(c, s, z, torch.float64)


@pytest.mark.parametrize("k", [576, 1024])
@torch.inference_mode()
def test_q8_0_groups_with_fp32_activations(k):
    """int8 in groups of 32 with fp32 activations (every build): within 1e-6 of the sum of |x w| of the exact
    product (each of the ~2k fp32 roundings moves a partial sum by at most 2^-24 of it, as the min form's test
    argues)."""
    lin, w64 = _q8_0_layer(67, k)
    desc = linear_desc(lin, [])
    assert not desc.act_q8
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(7))
    got = torch.cat([_forward(desc, x[i:i + r], 2) for i, r in ((0, 1), (1, 3), (4, 5))]).double()
    exact = x.double() @ w64.t()
    assert ((got - exact).abs() <= 1e-6 * (x.double().abs() @ w64.abs().t())).all()


@pytest.mark.skipif(PORTABLE, reason="the portable build has no int8 activations")
@pytest.mark.parametrize("k", [576, 1024])
@torch.inference_mode()
def test_q8_0_groups_with_int8_activations(monkeypatch, k):
    """int8 in groups of 32 with int8 activations (SmolLM2's Q8_0 head: 576 wide): the int8 tiles take its
    32-column blocks as int4's groups of 32 (codes and activations in split8's order, intdot.cpp), exact int32 sums
    per block, so the output is the exact product with the activations as rounded (`_q8`) up to the fp32 scaling
    and summing (2 (k/32 + k/32) + 8 roundings of 2^-24 of the abs sum, as above); bitwise the same alone or in any
    batch, on 1 or 2 threads, streamed, and with the AMX switch on or off (AMX takes int8 weights in whole 64s
    only: the vector tiles run either way)."""
    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "1")
    lin, w64 = _q8_0_layer(71, k)
    desc = linear_desc(lin, [])
    assert desc.act_q8
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(8))
    x[:, 100] = 6.0
    x[0, :32] = 50.0
    alone = torch.cat([_forward(desc, x[i:i + 1], 1) for i in range(len(x))])
    xq = _q8(x, 32)
    replay = xq @ w64.t()
    bound = (2 * (k // 32 + k // 32) + 8) * EPS32 * (xq.abs() @ w64.abs().t())
    assert ((alone.double() - replay).abs() <= bound).all()
    assert (alone.double() - x.double() @ w64.t()).abs().max() > 1e-4 * replay.abs().max()
    lib = kernels.load()
    old = lib.tl_set_amx(-1)
    try:
        for amx in (0, 1):
            lib.tl_set_amx(amx)
            for rows in (2, 3, 5, 8, 13, 16, 17, 40):
                for threads in (1, 2):
                    part = torch.cat([_forward(desc, x[i:i + rows], threads)
                                      for i in range(0, len(x) - rows + 1, rows)])
                    assert torch.equal(part, alone[:len(part)]), (amx, rows, threads)
    finally:
        lib.tl_set_amx(old)
    desc.streamed = 1
    assert torch.equal(torch.cat([_forward(desc, x[i:i + 1], 2) for i in range(len(x))]), alone)
