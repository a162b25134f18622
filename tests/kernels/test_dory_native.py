"""NVIDIA Dory on the native executor (csrc/dory.cpp, described from model/families/dory.py NGPTBlock.native_fields) against the model's one definition
(model/families/dory.py, the PyTorch path) and against tests/model/test_dory.py's independent numpy reference,
on the hidden tiny checkpoints test_dory.py builds (the real Hugging Face layout, converted): nGPT
single-sublayer layers "S-" "*S-" "*-", a window of 3 (prompts of 10), the sliding layers on RoPE profile 2
(base 500, rotary factor 0.75) and the full ones on profile 1 (base 10000, factor 0.5), heads wider than the
hidden size, both KV modes (per_loop, last_loop), at loops 1-4; every build of the library this host runs.

Tolerance. Both sides compute in fp32 from the same weights (16-bit and quantized weights: the reference holds
the very rounded or dequantized values in fp32, and int4/int8 layers take fp32 activations here, so both
multiply by the same numbers). They differ only in the order of sums (dot products of at most 64 terms, each
justnorm's and softmax's sums) and in e^x (the library's vexp, ~2e-7 relative against libm's), a few ulps
(~1e-7 relative) at each step. Every layer ends in a justnorm, which puts the state back on the unit sphere, so
those errors do not grow with the activations: the state's error stays ~1e-6 through the 2 + 3 x 4 + 2 layers
of four loops. The logits are the unit state times head rows of norm ~3.4 (N(0, 0.6) over 32), scaled by
logit_scale / std <= 15: ~1e-6 x 3.4 x 15 = 5e-5 at worst (1.7e-5 measured, logits up to ~29). 1e-4 absolute
is the bound test_dory.py holds the PyTorch path to against the same reference; a real difference (a missed
scale, norm, window, profile or slot) moves logits by O(0.1) and more (each depth even changes the greedy
tokens: test_dory.py). int8 activations (the integer dot products, the default for int4/int8 weights) round
every activation to 8 bits: ~0.4% a layer, which the state's sphere keeps from compounding; 5e-2 of the largest
logit there (the bound test_native.py holds the other families to).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

kernels = pytest.importorskip("tinyloop.kernels.lib")
try:
    kernels.load("native")
except kernels.NativeBuildError as exc:  # no compiler here: the PyTorch path serves, nothing to compare
    pytest.skip(f"native library unavailable: {exc}", allow_module_level=True)

from conftest import core_ids  # noqa: E402
from native_pair import clone_kv, native_twin, prefilled_pool  # noqa: E402
from tinyloop.engine import Engine, SamplingParams  # noqa: E402
from tinyloop.kernels.executor import NativeExecutor  # noqa: E402
from tinyloop.model.cache import SlotLayout  # noqa: E402
from tinyloop.model.exits import ExitRule  # noqa: E402
from tinyloop.model.paged import PagedKV, PagedStep, Rows  # noqa: E402
from tinyloop.modelfile.loader import load_model  # noqa: E402
from tinyloop.quant.linear import QuantLinear  # noqa: E402
from tinyloop.quant.packing import pack, quantize_rtn  # noqa: E402
from tinyloop.tools.convert import convert  # noqa: E402

# test_dory.py's checkpoint writer and reference (loaded under a name of its own: pytest collects that file too)
_spec = importlib.util.spec_from_file_location("dory_fixture", Path(__file__).parents[1] / "model" / "test_dory.py")
D = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(D)

PAGE = 4
TOL = 1e-4
CHUNKS = [4, 1, 1, 3, 1]   # a prompt in calls (each a prefill chunk or a decode row; last_loop: each a call)


def builds() -> list[str]:
    """The library's builds this host runs: its own, the AVX2 one where its own goes beyond AVX2 (VNNI,
    AVX-512, AMX), the scalar one (test_every_build.py's rule)."""
    native = kernels.load().tl_isa().decode()
    wider = any(w in native for w in ("vnni", "avx512", "amx"))
    return ["native"] + (["avx2"] if wider else []) + (["portable"] if "avx2" in native else [])


@pytest.fixture(params=builds())
def isa(request, monkeypatch):
    monkeypatch.setenv("TINYLOOP_NATIVE_ISA", request.param)
    kernels.load(request.param)
    return request.param


@pytest.fixture(params=["dot", "panel"])
def matmul_path(request, isa):
    """Both multi-row matmul paths (test_native.py's fixture): the dot-product tiles, and the outer-product panels
    (6 or 12 rows and more by default outside batch-invariant mode; here every call, so that the chunks' rows and
    the head take them: the logit scale is applied after either)."""
    lib = kernels.load(isa)
    old = lib.tl_set_panel_min_rows(1 if request.param == "panel" else 1 << 30)
    yield request.param
    lib.tl_set_panel_min_rows(old)


@pytest.fixture(autouse=True)
def exact_activations(monkeypatch):
    """fp32 activations for int4/int8 layers (exact to the dequantized weights); one test takes the int8 ones."""
    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "0")


@pytest.fixture(scope="module")
def weights():
    return D.random_weights()


@pytest.fixture(scope="module", params=["per_loop", "last_loop"])
def dory(request, tmp_path_factory, weights):
    """(mode, hf config, converted fp32 model file) for each KV mode."""
    mode = request.param
    hf = D.hf_config(mode)
    root = tmp_path_factory.mktemp(f"dory-native-{mode}")
    src = D.write_checkpoint(root / "hf", hf, weights)
    return mode, hf, convert(src, root / "dory.tinyloop", dtype="float32", progress=False)


def pair(path, weights: str = "fp32"):
    """(PyTorch reference, native model): the converted file loaded twice; the native one's block projections in
    `weights` (the output gate's too), the reference's holding the same values in fp32 (tests/kernels/native_pair.py's
    rule). The LM head and the scale vectors stay fp32 in both."""
    return native_twin(load_model(path).model.eval(), weights)


def counting(nat) -> list[int]:
    """The number of rows each native call took (every row of these steps must run natively)."""
    calls: list[int] = []
    orig = nat.executor.decode
    nat.executor.decode = lambda kv, rows: (calls.append(sum(r.n for r in rows)), orig(kv, rows))[1]
    return calls


@torch.inference_mode()
def chunked(model, cfg, loops: int, tokens: list[int], chunks: list[int], kv_format="fp16", kv_dtype=torch.float32):
    """`tokens` through the paged pool in calls of `chunks` positions (one sequence, pages shuffled): the logits
    of every position (the model's own head: the native one where the executor is attached) and the pool."""
    slots = SlotLayout(cfg, loops).n_slots
    blocks = -(-len(tokens) // PAGE)
    kv = PagedKV(cfg, blocks * slots, PAGE, kv_format, kv_dtype)
    table = torch.randperm(blocks * slots, generator=torch.Generator().manual_seed(3)).view(blocks, slots)
    out, s = [], 0
    for n in chunks:
        r = Rows(table=table, start=s, n=n, last_loop=loops, tokens=tokens[s:s + n])
        model.run(PagedStep(kv, [r], model.rotary, torch.float32, "cpu"))
        out.append(model.logits(r.hidden[None].float())[0, :, :D.VOCAB])
        s += n
    return torch.cat(out), kv


def pool_close(kv_a, kv_b, tol: float = TOL) -> None:
    for a, b in ((kv_a.k, kv_b.k), (kv_a.v, kv_b.v)):
        ra, rb = a.read(slice(None), torch.float32), b.read(slice(None), torch.float32)
        assert (ra - rb).abs().max().item() <= tol


@pytest.mark.parametrize("loops", [1, 2, 3, 4])
def test_prefill_and_decode_rows_match_the_reference(isa, matmul_path, dory, weights, loops):
    """The prompt in calls of 4, 1, 1, 3, 1 positions (prefill chunks and decode rows, all native): the logits of
    every position equal the numpy reference's own chunked run (per_loop: the same as one call; last_loop: each
    call's tokens at their last loop) and the PyTorch path's, the native head's per-token logit scale included;
    the pools agree (keys and values of every layer, loop and kept slot)."""
    mode, hf, path = dory
    ref, nat = pair(path)
    assert isa in nat.executor.name
    calls = counting(nat)
    got, kv_n = chunked(nat, nat.cfg, loops, D.PROMPT, CHUNKS)
    assert calls == CHUNKS   # every row ran natively
    want_t, kv_t = chunked(ref, ref.cfg, loops, D.PROMPT, CHUNKS)
    want = D.reference(weights, hf, D.PROMPT, loops, CHUNKS)
    assert np.abs(got.numpy() - want).max() < TOL, (mode, loops)
    assert (got - want_t).abs().max().item() < TOL, (mode, loops)
    pool_close(kv_t, kv_n)


@pytest.mark.parametrize("weights_fmt", ["fp16", "bf16", "int8", "int4"])
def test_every_weight_format(isa, matmul_path, dory, weights_fmt):
    """16-bit and quantized projections (the output gate's too): native prefill and decode rows equal the PyTorch
    path over the same rounded weights at loops 1 and 4."""
    mode, hf, path = dory
    ref, nat = pair(path, weights_fmt)
    for loops in (1, 4):
        got, kv_n = chunked(nat, nat.cfg, loops, D.PROMPT, CHUNKS)
        want, kv_t = chunked(ref, ref.cfg, loops, D.PROMPT, CHUNKS)
        assert (got - want).abs().max().item() < TOL, (weights_fmt, loops)
        pool_close(kv_t, kv_n)


def test_int8_activations(dory, monkeypatch):
    """int4 weights with activations quantized to int8 (the integer dot products, the default): within 5e-2 of
    the largest logit of the exact (dequantized, fp32-activation) result."""
    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "1")
    mode, hf, path = dory
    ref, nat = pair(path, "int4")
    if not any(d.act_q8 for d in nat.executor.linears()):
        pytest.skip("this build has no int8 activations")
    got, _ = chunked(nat, nat.cfg, 3, D.PROMPT, CHUNKS)
    want, _ = chunked(ref, ref.cfg, 3, D.PROMPT, CHUNKS)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert 0 < err < 5e-2, err


SEQS = [(9, 3, 0, None), (5, 1, 0, None), (13, 4, 2, None), (7, 2, 5, None), (11, 4, 0, 0.5)]   # (prompt length,
# loops, the row's own cache window, a latent exit threshold): the rows of one decode step


@torch.inference_mode()
def one_step(ref, nat, kv_format="fp16", kv_dtype=torch.float32, seqs=SEQS):
    """The prompts of `seqs` prefilled in PyTorch into one pool, copied; then one decode step of all of them in
    PyTorch and natively, each on its own copy: (PyTorch rows, native rows, both pools, the native calls' rows)."""
    slots = SlotLayout(ref.cfg, max(s[1] for s in seqs)).n_slots
    kv, tables, toks = prefilled_pool(ref, seqs, PAGE, slots, kv_format, kv_dtype)
    kv_nat = clone_kv(kv)

    def rows():
        return [Rows(table=t, start=n, n=1, last_loop=loops, tokens=[tok], window=w,
                     exit_rule=None if th is None else ExitRule("latent", th, 1, loops))
                for t, tok, (n, loops, w, th) in zip(tables, toks, seqs)]

    r_ref, r_nat = rows(), rows()
    calls = counting(nat)
    ref.run(PagedStep(kv, r_ref, ref.rotary, torch.float32, "cpu"))
    nat.run(PagedStep(kv_nat, r_nat, nat.rotary, torch.float32, "cpu"))
    return r_ref, r_nat, kv, kv_nat, calls


def test_one_step_of_rows_at_mixed_depths_windows_and_exits(isa, dory):
    """One decode step of five sequences at once (loops 1-4, positions 5-13, one with a cache window of its own
    narrower and one wider than the layers' window of 3, one leaving early by the latent rule), prompts
    prefilled in PyTorch: logits and pools equal the PyTorch path's, and the early exit happens at the same
    loop on both sides (its skipped loops' keys copied; last_loop: the one slot is already the last loop's)."""
    mode, hf, path = dory
    ref, nat = pair(path)
    r_ref, r_nat, kv, kv_nat, calls = one_step(ref, nat)
    assert calls == [len(SEQS)]
    assert [r.last_loop for r in r_nat] == [r.last_loop for r in r_ref]
    assert r_ref[-1].last_loop < SEQS[-1][1]   # the exit happened
    with torch.inference_mode():
        lr = ref.logits(torch.cat([r.hidden for r in r_ref])[None])[0]
        ln = nat.logits(torch.cat([r.hidden for r in r_nat])[None])[0]   # (the native head)
    assert (lr - ln).abs().max().item() < TOL
    pool_close(kv, kv_nat)


def test_cached_greedy_decoding_and_logprobs(isa, dory, weights):
    """The engine on the native executor (paged pool, batches of one): greedy tokens equal the numpy reference
    recomputed from scratch at every token, log-probabilities within 1e-4 (the logits' bound; a log-softmax
    moves no value by more than twice it), at loops 1, 2 and 4, in both KV modes; an int8 KV pool gives the
    same tokens."""
    mode, hf, path = dory
    engine = Engine.load(path, executor="native")
    assert isinstance(engine.model.executor, NativeExecutor) and isa in engine.model.executor.name
    for loops in (1, 2, 4):
        want, want_lp = D.reference_greedy(weights, hf, D.PROMPT, loops, 8)
        out = engine.generate(D.PROMPT, SamplingParams(max_tokens=8, loops=loops, temperature=0, ignore_eos=True,
                                                       logprobs=0))
        assert out.token_ids == want, (mode, loops)
        assert np.allclose([lp for lp, _ in out.logprobs], want_lp, atol=2 * TOL), (mode, loops)
    want, _ = D.reference_greedy(weights, hf, D.PROMPT, 3, 6)
    kv8 = Engine.load(path, executor="native", kv_format="int8")
    assert kv8.generate(D.PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)).token_ids == want


def test_speculation_natively_equals_plain(isa, dory):
    """per_loop: self-speculation (drafts at 1 loop, verified at 4) as chain rounds and as the pipeline of
    depth-aligned passes (tl_spec_pipeline: the loops' justnorm and the slots there too) gives plain greedy's
    tokens, natively. (last_loop refuses speculation by name: test_dory.py.)"""
    mode, hf, path = dory
    if mode != "per_loop":
        pytest.skip("a last_loop model refuses speculation (test_dory.py)")
    _, nat = pair(path)
    prompt = D.PROMPT
    plain = core_ids(nat, prompt, SamplingParams(max_tokens=16, loops=4, temperature=0))
    for kw in (dict(pipeline=False), dict(pipeline=True)):
        spec = core_ids(nat, prompt, SamplingParams(max_tokens=16, mode="speculative", draft_loops=1, verify_loops=4,
                                                    draft_ahead=4, temperature=0), draft_vocab=None, adaptive=False,
                        **kw)
        assert spec == plain, kw


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_file_decodes_natively_as_in_pytorch(isa, dory, weights, dtype):
    """The file loaded in fp16 or bf16 (its projections 16-bit as stored, read by the native kernels; fp32
    activations): the same greedy tokens natively as on the PyTorch path, and as the fp32 reference (the random
    checkpoint's greedy margins are wide: test_dory.py)."""
    mode, hf, path = dory
    params = SamplingParams(max_tokens=8, loops=3, temperature=0, ignore_eos=True)
    native = Engine.load(path, dtype=dtype, executor="native")
    assert isinstance(native.model.executor, NativeExecutor)
    got = native.generate(D.PROMPT, params).token_ids
    assert got == Engine.load(path, dtype=dtype, executor="torch").generate(D.PROMPT, params).token_ids
    assert got == D.reference_greedy(weights, hf, D.PROMPT, 3, 8)[0]


def _pool_step(t, values: torch.Tensor) -> torch.Tensor:
    """One rounding step of pool t's format at each entry (values: t read as fp32): test_native.py's rule."""
    if t.bits is not None:
        return t.scale.float().expand(values.shape)
    eps = {torch.float32: 0.0, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[t.dtype]
    return values.abs() * eps + (2.0 ** -24 if t.dtype == torch.float16 else 0.0)


@pytest.mark.parametrize("kv_format,kv_dtype", [("fp16", torch.float16), ("fp16", torch.bfloat16),
                                                ("int8", torch.float32), ("int4", torch.float32),
                                                ("int4-h", torch.float32)])
def test_every_kv_format(isa, dory, kv_format, kv_dtype):
    """Lossy pools, one decode step of SEQS over prompts prefilled (in PyTorch) into the pool: both sides round
    the same keys and values (within fp32 reordering, ~1e-6) into it; one that sits on a rounding boundary may
    round the other way, by one step of the format at that entry, so every pool entry agrees within a step
    (+ 1e-4). Such a flip moves the scores it enters by about |q_i| step / sqrt(D), q being a unit vector per
    head times (sqk sqrt(D) / std)^2 ~ 8-27 here: an int8 step (~1/255 of a key's range) moves a score by ~1e-2,
    an int4 step by 16x that, and the later loops carry it on (a prefill through such a pool, where every
    position's flips feed every later one, moved the logits by up to 0.13 at loop 4: not compared). The step's
    own logits: 1e-2 (measured: 1e-5 where nothing flipped, up to 3.7e-3 where something did: int4 per_loop,
    bf16 last_loop on the portable build), while a wrong scale, offset or rotation of the pool moves them by
    O(1)."""
    mode, hf, path = dory
    ref, nat = pair(path)
    r_ref, r_nat, kv, kv_nat, _ = one_step(ref, nat, kv_format, kv_dtype)
    with torch.inference_mode():
        lr = ref.logits(torch.cat([r.hidden for r in r_ref])[None])[0]
        ln = nat.logits(torch.cat([r.hidden for r in r_nat])[None])[0]
    assert (lr - ln).abs().max().item() < 1e-2
    for a, b in ((kv.k, kv_nat.k), (kv.v, kv_nat.v)):
        ra, rb = a.read(slice(None), torch.float32), b.read(slice(None), torch.float32)
        step = _pool_step(a, ra).maximum(_pool_step(b, rb))
        assert ((ra - rb).abs() - step - 1e-4).max().item() <= 0, kv_format


def test_sampled_decoding_natively_equals_pytorch(isa, dory):
    """Sampled decoding (temperature 0.8, top-p 0.9, a seed: each token drawn under the shared noise of its output
    index, engine/sampling.py) gives the PyTorch path's tokens natively, the native head's logit scale in the
    draws; per_loop: sampled self-speculation gives plain sampling's tokens too."""
    mode, hf, path = dory
    modes = [{}] + ([dict(mode="speculative", draft_loops=1, verify_loops=3)] if mode == "per_loop" else [])
    out = {}
    for executor in ("torch", "native"):
        engine = Engine.load(path, executor=executor)
        out[executor] = [engine.generate(D.PROMPT, SamplingParams(max_tokens=16, loops=3, temperature=0.8, top_p=0.9,
                                                                  seed=5, ignore_eos=True, **kw)).token_ids
                         for kw in modes]
    assert out["native"] == out["torch"]
    assert all(toks == out["native"][0] for toks in out["native"])


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_head_takes_the_logit_scale(isa, dory, bits):
    """A quantized LM head (`quantize --head-bits`: the model's `head_linear`) scales its logits per token as the
    float one does: natively (its codes through the library, fp32 activations) equal to PyTorch's dequantized
    head times the scale, within the fp32 bound."""
    mode, hf, path = dory
    ref, nat = pair(path)
    q, s, z = quantize_rtn(ref.lm_head.weight.detach(), bits, None if bits == 8 else 32)
    ref.head_linear = QuantLinear.from_portable(pack(q, bits), s, z, bits, kernel="dense")
    nat.head_linear = QuantLinear.from_portable(pack(q, bits), s, z, bits, kernel="native")
    nat.executor = NativeExecutor(nat, threads=2)   # (described with its head)
    got, _ = chunked(nat, nat.cfg, 3, D.PROMPT, CHUNKS)
    want, _ = chunked(ref, ref.cfg, 3, D.PROMPT, CHUNKS)
    assert (got - want).abs().max().item() < TOL


def test_a_family_block_kind_is_found_by_name_and_an_unknown_one_refused(isa, dory):
    """The library's block kinds are registered by the families' csrc files under a name (step.h register_block):
    "ngpt" is one in every build; a block naming a kind the library lacks is refused as Unsupported (the model is
    then served by the PyTorch path), never run as the shared block; and every layer of a described nGPT block is
    found, its own output gate among them (what the background packing and `linears` walk)."""
    from tinyloop.kernels import layers

    lib = kernels.load(isa)
    assert lib.tl_block_kind(b"ngpt") >= 1
    assert lib.tl_block_kind(b"no-such-kind") == 0
    mode, hf, path = dory
    _, nat = pair(path)
    attn = next(b for b in nat.core if b.attn is not None)
    fields = attn.native_fields()
    (name, layout), values = fields["own"]
    desc, keep = kernels.TlBlock(), []
    with pytest.raises(layers.Unsupported, match="no-such-kind"):
        layers.describe(desc, {"own": (("no-such-kind", layout), values)}, keep)
    layers.describe(desc, fields, keep)
    assert desc.own == lib.tl_block_kind(name.encode())
    own = layers.own_linears(desc)
    assert [(d.n, d.k) for d in own] == [(attn.attn.wg.weight.shape[0], attn.attn.wg.weight.shape[1])]
    with pytest.raises(ValueError, match="f64"):
        layers.own_struct((("x", "f64"),))
