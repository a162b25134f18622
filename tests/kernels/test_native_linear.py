"""One linear layer through the native library (`kernels/csrc/matmul.cpp`, `amx.cpp`) against the layer in
fp32: every weight format and row count, and the integer kernels' canonical reduction: a row's result
bitwise the same in any batch, on the VNNI, AVX2 and AMX paths, at the codes' extremes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from tinyloop.quant.linear import QuantLinear
from tinyloop.quant.packing import pack, quantize_rtn

kernels = pytest.importorskip("tinyloop.kernels.lib")
try:
    kernels.load("native")
    kernels.load("avx2")
except kernels.NativeBuildError as exc:  # no compiler here: the PyTorch path serves, nothing to compare
    pytest.skip(f"native library unavailable: {exc}", allow_module_level=True)


@pytest.fixture(autouse=True)
def exact_activations(monkeypatch):
    """fp32 activations for int4 layers unless a test asks for int8 ones (TINYLOOP_NATIVE_Q8=1)."""
    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "0")


@pytest.mark.parametrize("weights", ["fp32", "fp16", "bf16", "int8", "int4", "int2"])
@torch.inference_mode()
def test_native_linear_every_row_count(weights):
    """One linear layer over 1 .. 40 input rows (a decode batch, a head over it, a prefill chunk), on 1 and 2
    threads, in batch-invariant mode (the dot-product tiles at every row count) and out of it (the outer-product
    panels from 6 rows, 12 for float weights; a remainder of rows and of weight rows included): each agrees
    with the layer in fp32."""
    from tinyloop.kernels.executor import _forward, linear_desc

    g = torch.Generator().manual_seed(11)
    w = torch.randn(101, 96, generator=g) * 0.1     # 101 outputs: not a multiple of the 6-row micro-tiles
    if weights.startswith("int"):
        bits = int(weights[3:])
        q, sc, z = quantize_rtn(w, bits, None if bits == 8 else 32)
        ref_w = QuantLinear.from_portable(pack(q, bits), sc, z, bits, kernel="dense").w.float()
        lin = QuantLinear.from_portable(pack(q, bits), sc, z, bits, kernel="native")
    else:
        dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[weights]
        ref_w = w.to(dt).float()
        lin = nn.Linear(96, 101, bias=False)
        lin.weight.data = w.to(dt)
    keep: list = []
    desc = linear_desc(lin, keep)
    lib = kernels.load()
    for m in (1, 3, 7, 8, 13, 16, 17, 40, 100):   # 100: two slabs of rows
        x = torch.randn(m, 96, generator=g)
        ref = x @ ref_w.t()
        for threads, mode in ((1, 0), (2, 0), (2, 1)):
            old = lib.tl_set_batch_invariant(mode)
            try:
                got = _forward(desc, x, threads)
            finally:
                lib.tl_set_batch_invariant(old)
            assert (got - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item()), (m, threads, mode)


@pytest.mark.skipif(kernels.load().tl_isa() == b"portable scalar",
                    reason="the portable build has no int8 activations (its layers run in fp32)")
@pytest.mark.parametrize("bits,group,width", [(4, 32, 1024), (4, 64, 1024), (4, 128, 1024), (4, 256, 1024),
                                               (8, None, 1024), (4, 32, 1056),
                                               (4, 32, 2080), (4, 128, 2176), (8, None, 2112)])
@torch.inference_mode()
def test_int8_activations_do_not_depend_on_the_batch(monkeypatch, bits, group, width):
    """Batch invariance of a layer with int8 activations: a row's result is bitwise the same alone, in a
    batch of any size (1 .. 24 rows: every tile shape, and the AMX tiles where the host has them), at any
    position in it, on 1 or 2 threads, and with its weights streamed (one weight row at a time). Every
    integer kernel forms each activation block's exact int32 sum and adds the scaled sums in block order
    (matmul.cpp, the canonical reduction), so nothing here is a tolerance. Width 1056 = 16 x 64 + 32 (as
    Huginn's 5280): int4 in activation blocks of 32 takes int8 activations too, its last 32 columns a block
    of their own (intdot.cpp's qq_tail32). Widths past 1,024 columns: several rows go through the codes in
    chunks of 1,024 (qq_rows8's buffer), each row's running total kept between chunks."""
    from tinyloop.kernels.executor import linear_desc, _forward

    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "1")
    w = torch.randn(71, width, generator=torch.Generator().manual_seed(0)) * 0.05
    q, sc, z = quantize_rtn(w, bits, group)
    lin = QuantLinear.from_portable(pack(q, bits), sc, z, bits, kernel="native")
    keep: list = []
    desc = linear_desc(lin, keep)
    assert desc.act_q8
    x = torch.randn(40, width, generator=torch.Generator().manual_seed(1))
    x[:, 100] = 6.0   # a large value: its block's scale differs from its neighbours'
    x[:, width - 3] = -5.0   # and one in the last block
    alone = torch.cat([_forward(desc, x[i:i + 1], 1) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 7, 8, 13, 16, 17, 24, 40):   # 71 weight rows: odd tails of every tile
        for threads in (1, 2):
            part = torch.cat([_forward(desc, x[i:i + rows], threads) for i in range(0, len(x) - rows + 1, rows)])
            assert torch.equal(part, alone[:len(part)]), (rows, threads)
    desc.streamed = 1   # weights read from memory: one row at a time, one stream
    streamed = torch.cat([_forward(desc, x[i:i + 1], 2) for i in range(len(x))])
    assert torch.equal(streamed, alone)
    exact = x @ QuantLinear.from_portable(pack(q, bits), sc, z, bits, kernel="dense").w.float().t()
    scale = exact.abs().max().item()
    assert (alone - exact).abs().max().item() < 2e-2 * scale
    assert (alone - exact).abs().max().item() > 1e-4 * scale   # the activations were rounded


@pytest.mark.parametrize("weights", ["fp32", "fp16", "bf16", "int4", "int2"])
@torch.inference_mode()
def test_float_and_fp32_activation_layers_do_not_depend_on_the_batch(weights):
    """Batch invariance of 16-bit layers and of quantized ones with fp32 activations (int2, or int4 with
    TINYLOOP_NATIVE_Q8=0 as here; in a model, int4 layers whose width is not whole 64s): every dot-product
    kernel (the one-row GEMV, eight weight rows finished at once, from cache or streamed, every tile shape, and
    16-bit weights converted once for many rows)
    reduces an output in one order (one accumulator over k, vsum's lane order; per group for the codes), so a
    row's result is bitwise the same alone and in a batch of fewer rows than the panels take; in batch-invariant
    mode (`tl_set_batch_invariant`, TINYLOOP_BATCH_INVARIANT=1) the panels are not taken and that holds for any
    batch. Nothing here is a tolerance."""
    from tinyloop.kernels.executor import _forward, linear_desc

    g = torch.Generator().manual_seed(5)
    rows_out = 1030 if weights in ("fp32", "fp16", "bf16") else 71   # float: 4.2-8.4 MB, a streamed GEMV
    w = torch.randn(rows_out, 1024, generator=g) * 0.05
    if weights.startswith("int"):
        bits = int(weights[3:])
        q, sc, z = quantize_rtn(w, bits, 32)
        lin = QuantLinear.from_portable(pack(q, bits), sc, z, bits, kernel="native")
    else:
        lin = nn.Linear(1024, rows_out, bias=False)
        lin.weight.data = w.to({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[weights])
    keep: list = []
    desc = linear_desc(lin, keep)
    assert not desc.act_q8 or weights == "int2"
    x = torch.randn(40, 1024, generator=g)
    lib = kernels.load()
    alone = torch.cat([_forward(desc, x[i:i + 1], 1) for i in range(len(x))])
    below = 12 if weights in ("fp32", "fp16", "bf16") else 6   # the panels' row counts (matmul.cpp)
    old = lib.tl_set_batch_invariant(0)
    try:
        for rows in range(2, below):
            part = torch.cat([_forward(desc, x[i:i + rows], 2) for i in range(0, len(x) - rows + 1, rows)])
            assert torch.equal(part, alone[:len(part)]), rows
        lib.tl_set_batch_invariant(1)
        # (from 24 rows, 16-bit layers on AVX-512 take the converted panel in tiles of 6 rows: 24-29 end on every
        # remainder)
        for rows in (2, 5, 7, 12, 13, 16, 24, 25, 26, 27, 28, 29, 40):
            for threads in (1, 2):
                part = torch.cat([_forward(desc, x[i:i + rows], threads) for i in range(0, len(x) - rows + 1, rows)])
                assert torch.equal(part, alone[:len(part)]), (rows, threads)
    finally:
        lib.tl_set_batch_invariant(old)


def _amx_host() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " amx_int8" in flags and " amx_tile" in flags


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, None)])
@torch.inference_mode()
def test_amx_tiles_equal_the_vector_tiles(monkeypatch, bits, group):
    """Where the host has AMX the native build uses its int8 tiles from AMX_MIN_ROWS rows (`tl_amx()`, the
    ISA string names them), and int8 weights (the head: `amx_rows_q8`) from three; they are bitwise the vector
    tiles (both form the canonical reduction): row counts from 2 (int8) or 8 to 40, two activation blocks a row
    (int8 weights are per channel: one group), weight rows not a multiple of 16, int8 codes at their extremes.
    Elsewhere the switch reports no AMX and both runs are the vector tiles."""
    from tinyloop.kernels.executor import linear_desc, _forward

    lib = kernels.load()
    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "1")
    native_build = os.environ.get("TINYLOOP_NATIVE_ISA", "native") == "native"   # (avx2, portable: no AMX)
    if _amx_host() and native_build and os.environ.get("TINYLOOP_NATIVE_AMX") != "0":
        assert lib.tl_amx() == 1, "an AMX host whose native build does not use its tiles"
        assert b"amx" in lib.tl_isa()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(83, 512, generator=g) * 0.05
    w[0, :64] = 1.0     # codes at the top and bottom of their range
    w[1, :64] = -1.0
    q, sc, z = quantize_rtn(w, bits, group)
    lin = QuantLinear.from_portable(pack(q, bits), sc, z, bits, kernel="native")
    keep: list = []
    desc = linear_desc(lin, keep)
    assert desc.act_q8
    old = lib.tl_set_amx(-1)
    try:
        for m in ((2, 3, 5) if bits == 8 else ()) + (8, 9, 15, 16, 17, 31, 40):
            x = torch.randn(m, 512, generator=g)
            x[0, :32] = 50.0   # a block at the activations' extreme codes
            lib.tl_set_amx(0)
            vec = _forward(desc, x, 2)
            lib.tl_set_amx(1)
            amx = _forward(desc, x, 2)
            assert torch.equal(vec, amx), m
    finally:
        lib.tl_set_amx(old)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (4, 256), (8, None)])
@torch.inference_mode()
def test_vnni_build_equals_avx2_build(monkeypatch, bits, group):
    """The integer dot products with VNNI (vpdpbusd, where the host has it) form the same int32 lanes as
    the AVX2 maddubs + madd sequence, so every layer is bit-identical between the host's build and its
    build without VNNI ("avx2"), for every tile shape (1..9 rows) and at the codes' extremes. On a host
    without VNNI both builds are the AVX2 one and this checks the build option only."""
    from tinyloop.kernels.executor import linear_desc, _forward

    if kernels.load("native").tl_isa().decode() == "portable scalar":
        pytest.skip("no SIMD build here")
    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "1")
    K = 1024
    w = torch.randn(37, K, generator=torch.Generator().manual_seed(0)) * 0.05
    q, sc, z = quantize_rtn(w, bits, group)
    q[0] = (1 << bits) - 1                       # the largest codes, and the smallest with a zero point
    q[1] = 0
    lin = QuantLinear.from_portable(pack(q, bits), sc, z, bits, kernel="native")
    desc = linear_desc(lin, [])
    assert desc.act_q8
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(1))
    x[0] = 1.0
    x[1] = -1.0
    out = {}
    for isa in ("native", "avx2"):
        monkeypatch.setenv("TINYLOOP_NATIVE_ISA", isa)
        out[isa] = [_forward(desc, x[:m], 1) for m in range(1, 10)]
        desc.streamed = 1
        out[isa].append(_forward(desc, x[:1], 1))
        desc.streamed = 0
    for a, b in zip(out["native"], out["avx2"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 256), (8, None)])
@torch.inference_mode()
def test_int8_activations_at_the_extremes(monkeypatch, bits, group):
    """Every code at its largest against every activation at +-127: the integer sums of a block (int16
    pairs added across up to 256 columns for int4) do not saturate."""
    from tinyloop.kernels.executor import linear_desc, _forward

    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "1")
    K, top = 512, (1 << bits) - 1
    q = torch.full((8, K), top, dtype=torch.uint8)
    q[1] = 0                                                   # (and the smallest, with a zero point)
    n_groups = K // (group or K)
    sc = torch.full((8, n_groups), 0.01, dtype=torch.float16)
    z = torch.zeros(8, n_groups, dtype=torch.uint8)
    z[1] = top
    lin = QuantLinear.from_portable(pack(q, bits), sc, z, bits, kernel="native")
    keep: list = []
    desc = linear_desc(lin, keep)
    assert desc.act_q8
    x = torch.ones(2, K)
    x[1] = -1.0
    got = _forward(desc, x, 1)
    exact = x @ QuantLinear.from_portable(pack(q, bits), sc, z, bits, kernel="dense").w.float().t()
    assert torch.allclose(got, exact, rtol=1e-5, atol=1e-3), (got, exact)


@torch.inference_mode()
def test_int8_activations_with_more_groups_than_the_stack_holds(monkeypatch):
    """A weight row of more than 512 groups (its scales as fp32 no longer fit a tile's stack buffer, so a
    per-thread one holds them): the integer tiles agree with the panels, a row alone with a batch, and both
    with the dequantized weights to the activations' rounding."""
    from tinyloop.kernels.executor import linear_desc, _forward

    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "1")
    K = 514 * 32   # 514 groups of 32
    w = torch.randn(9, K, generator=torch.Generator().manual_seed(0)) * 0.05
    q, sc, z = quantize_rtn(w, 4, 32)
    lin = QuantLinear.from_portable(pack(q, 4), sc, z, 4, kernel="native")
    keep: list = []
    desc = linear_desc(lin, keep)
    assert desc.act_q8 and K // 32 > 512
    x = torch.randn(7, K, generator=torch.Generator().manual_seed(1))
    lib = kernels.load()
    tiles = _forward(desc, x, 2)                                      # 4 x 2, 2 x 2 and 1 x 4 tiles
    alone = torch.cat([_forward(desc, x[i:i + 1], 1) for i in range(7)])
    old = lib.tl_set_panel_min_rows(1)
    try:
        panels = _forward(desc, x, 2)
    finally:
        lib.tl_set_panel_min_rows(old)
    scale = panels.abs().max().item()
    assert (tiles - panels).abs().max().item() <= 1e-5 * scale
    assert (alone - panels).abs().max().item() <= 1e-5 * scale
    exact = x @ QuantLinear.from_portable(pack(q, 4), sc, z, 4, kernel="dense").w.float().t()
    assert (tiles - exact).abs().max().item() < 2e-2 * exact.abs().max().item()


@pytest.mark.parametrize("f32", [0, 1])
@pytest.mark.parametrize("group,k", [(32, 256), (32, 288), (128, 512), (256, 768)])
@torch.inference_mode()
def test_packed_int4_kernel_equals_the_portable_codes(monkeypatch, group, k, f32):
    """int4 layers of models that stay in cache take codes repacked 16 weight rows a vector (`pack_int4`,
    AVX-512 VNNI builds); a row's outputs are bitwise those of the portable codes' kernels (one canonical
    reduction) at every row count the packed kernel takes and past it, for groups of 32 (a last block of 32
    columns too), 128 and 256 and weight rows not a multiple of 16, with the strips' scales as the file has them
    (float16, a streamed model's) or in fp32 beside their s z' (`packed_f32`, a model in cache). Builds without
    the kernel say so (`tl_pack_int4_size` < 0) and are not packed."""
    from tinyloop.kernels.executor import _forward, linear_desc, pack_int4

    kernels.load()
    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "1")
    g = torch.Generator().manual_seed(11)
    w = torch.randn(83, k, generator=g) * 0.05
    w[81, :32] = 1.0    # codes at the top and bottom of their range (past the rows the load checks)
    w[82, :32] = -1.0
    q, sc, z = quantize_rtn(w, 4, group)
    lin = QuantLinear.from_portable(pack(q, 4), sc, z, 4, kernel="native")
    keep: list = []
    plain = linear_desc(lin, keep)
    assert plain.act_q8
    packed = linear_desc(lin, keep)
    packed.packed_f32 = f32
    if not pack_int4(packed, keep):
        assert kernels.load().tl_pack_int4_size(packed) < 0
        pytest.skip("this build has no packed int4 kernel (AVX-512 VNNI)")
    for m in (1, 2, 3, 5, 8, 9, 13, 16, 17, 24):
        x = torch.randn(m, k, generator=g)
        x[0, :32] = 40.0
        for threads in (1, 2):
            assert torch.equal(_forward(packed, x, threads), _forward(plain, x, threads)), (m, threads)


@torch.inference_mode()
def test_which_models_pack_their_int4_codes(monkeypatch):
    """`Executor._pack`: a model that stays in cache packs its int4 codes where the build has the kernel; a streamed
    one (here the shipped int4 model, made `streamed` by a lower cut) packs them at load when they are at most
    PACK_STREAMED_BYTES, or with TINYLOOP_NATIVE_PACK=all, and then runs as from cache (no descriptor `streamed`);
    a larger one packs its layers on a background thread after the load, serving from the mapped codes meanwhile,
    and ends the same; TINYLOOP_NATIVE_PACK=0 packs nothing; any other
    value is refused by name. The logits are bitwise the same in every case (one canonical reduction), also while
    the background packing runs."""
    import tinyloop.kernels.executor as X
    from tinyloop.engine import Engine
    from tinyloop.engine.native import copy_bytes
    from tinyloop.modelfile.header import DEFAULT_MODEL_NAME

    monkeypatch.setattr(X, "STREAMED_BYTES", 1 << 10)
    can_pack = None
    runs = {}
    for name, setting, cut in (("small", "1", 1 << 40), ("large", "1", 0), ("all", "all", 0), ("off", "0", 1 << 40)):
        monkeypatch.setenv("TINYLOOP_NATIVE_PACK", setting)
        monkeypatch.setattr(X, "PACK_STREAMED_BYTES", cut)
        engine = Engine.load(DEFAULT_MODEL_NAME, executor="native")
        ex = engine.model.executor
        if name == "large":   # packing in the background: the model answers meanwhile, the same
            during = engine.logits(engine.tokenizer.encode("The king said"))
            assert ex.packing_done(timeout=120)
        packed = [bool(d.packed) for d in ex.linears()]
        can_pack = any(packed) if can_pack is None else can_pack
        runs[name] = (ex.streamed, any(packed), engine.logits(engine.tokenizer.encode("The king said")))
        # the copies' memory, as the server counts a model's (server/model_memory.py): every packed strip's bytes
        sizes = [kernels.load().tl_pack_int4_size(d) for d in ex.linears() if d.packed]
        assert copy_bytes(engine.model) == sum(sizes) and (sum(sizes) > 0) == any(packed)
    if not can_pack:   # a build without the packed kernel (AVX2, portable): everything stays streamed
        assert all(streamed and not packed for streamed, packed, _ in runs.values())
    else:
        assert [runs[n][:2] for n in ("small", "large", "all", "off")] == [(False, True), (False, True), (False, True),
                                                                        (True, False)]
    assert all(torch.equal(r[2], runs["off"][2]) for r in runs.values()) and torch.equal(during, runs["off"][2])
    monkeypatch.setenv("TINYLOOP_NATIVE_PACK", "sometimes")
    with pytest.raises(ValueError, match="TINYLOOP_NATIVE_PACK"):
        Engine.load(DEFAULT_MODEL_NAME, executor="native")


@torch.inference_mode()
def test_background_packing_ends_with_its_model(monkeypatch):
    """A model unloaded while its codes are packed in the background: the packing thread holds it only while it
    packs a layer (a weak reference between layers), so the model's memory goes and the thread ends."""
    import gc
    import weakref

    import tinyloop.kernels.executor as X
    from tinyloop.engine import Engine
    from tinyloop.modelfile.header import DEFAULT_MODEL_NAME

    monkeypatch.setattr(X, "STREAMED_BYTES", 1 << 10)
    monkeypatch.setattr(X, "PACK_STREAMED_BYTES", 0)
    monkeypatch.setenv("TINYLOOP_NATIVE_PACK", "1")
    engine = Engine.load(DEFAULT_MODEL_NAME, executor="native")
    packer, model = engine.model.executor._packer, weakref.ref(engine.model)
    if packer is None:   # a build without the packed kernel
        return
    del engine
    packer.join(timeout=120)
    gc.collect()
    assert not packer.is_alive() and model() is None
