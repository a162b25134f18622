"""The decode fast path (model.fast, quant.fp16) against the eager model it replaces.

Tolerances stated here are the ones docs/decode.md quotes:
- fusion (fp64): logits equal the eager model's to 1e-10 and greedy tokens are identical;
- fp16 weights from a bf16 model: logits within 1e-4 absolute (|logits| ~ 1) of an fp32 evaluation of
  the very same bf16 weights, and no further from it than the eager bf16 model itself is.
"""

from __future__ import annotations

import copy

from conftest import core_ids, reference_ids

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tinyloop.config import preset
from tinyloop.engine.knobs import SamplingParams
from tinyloop.model import KVCache, build_model
from tinyloop.model.fast import fuse_projections, prepare_for_decode, swap_linears
from tinyloop.model.layers import MLP, Attention
from tinyloop.quant.fp16 import FP16Linear, fbgemm_fp16_available

needs_fbgemm = pytest.mark.skipif(not fbgemm_fp16_available(), reason="needs FBGEMM (x86 CPU torch build)")


def tiny_cfg(**kw):
    return preset("tiny").replace(vocab_size=300, eos_token_id=299, **kw)


def pair(cfg, dtype=torch.float64, **prep):
    """(eager model, prepared copy with the same weights)."""
    eager = build_model(cfg, seed=0, dtype=dtype)
    fast = prepare_for_decode(copy.deepcopy(eager), threads=None, **prep)
    return eager, fast


def toks(B, T, vocab=300, seed=1):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


# -- fusion: exact -------------------------------------------------------------------------------
@pytest.mark.parametrize("injection", ["none", "add", "concat-adapter"])
@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_fused_full_forward_equals_eager(injection, mlp):
    cfg = tiny_cfg(injection=injection, mlp=mlp)  # GQA (4 heads, 2 kv heads), prelude + core + coda
    eager, fast = pair(cfg)
    assert fast.decode_prepared["fused"] == (cfg.n_prelude + cfg.n_core + cfg.n_coda) * (2 if mlp == "swiglu" else 1)
    assert all(not hasattr(m, "wq") for m in fast.modules() if isinstance(m, Attention))
    x = toks(2, 19)
    for loops in (1, 3, 5):
        torch.testing.assert_close(fast(x, loops=loops), eager(x, loops=loops), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_fused_cached_decode_equals_full_forward(n_kv_heads):
    cfg = tiny_cfg(n_kv_heads=n_kv_heads)
    eager, fast = pair(cfg)
    x = toks(2, 20)
    full = eager(x, loops=4)
    cache = KVCache(cfg, batch=2, loops=4, dtype=torch.float64)
    outs = [fast(x[:, :7], loops=4, cache=cache, start=0)]
    for t in range(7, 20):
        outs.append(fast(x[:, t:t + 1], loops=4, cache=cache, start=t))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)


def test_fused_sliding_window_equals_eager():
    cfg = tiny_cfg()
    eager, fast = pair(cfg)
    x = toks(1, 30)
    caches = [KVCache(cfg, loops=3, window=6, rollback_margin=4, dtype=torch.float64) for _ in range(2)]
    for t in range(30):
        a = eager(x[:, t:t + 1], loops=3, cache=caches[0], start=t)
        b = fast(x[:, t:t + 1], loops=3, cache=caches[1], start=t)
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


def test_fused_tree_step_equals_eager():
    """Speculation's entry points: explicit positions + tree_mask through embed_prelude/core_loop/coda_logits."""
    cfg = tiny_cfg()
    eager, fast = pair(cfg)
    prompt = toks(1, 9)
    tree = toks(1, 5, seed=2)
    # tokens 0..4 of the step: a root, two children of it, one child of each child
    tree_mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                             dtype=torch.bool)
    positions = torch.tensor([9, 10, 10, 11, 11])
    results = []
    for m in (eager, fast):
        cache = KVCache(cfg, loops=3, dtype=torch.float64)
        m(prompt, loops=3, cache=cache, start=0)
        cache.length = 9
        ctx = m.context(5, cache=cache, start=9, positions=positions, tree_mask=tree_mask)
        e = m.embed_prelude(tree, ctx)
        h = m.init_state(e)
        for r in range(3):
            h = m.core_loop(h, e, r, ctx)
        results.append(m.coda_logits(h, ctx))
    torch.testing.assert_close(results[1], results[0], rtol=1e-10, atol=1e-10)


def test_fused_greedy_tokens_equal(tiny64):
    fast = prepare_for_decode(copy.deepcopy(tiny64), threads=None)
    prompt = toks(1, 6, vocab=512)[0].tolist()
    for loops in (1, 3, 6):
        params = SamplingParams(max_tokens=24, loops=loops, ignore_eos=True)
        assert core_ids(fast, prompt, params) == core_ids(tiny64, prompt, params) == reference_ids(tiny64, prompt, params)


def test_fusion_leaves_non_linear_modules_alone():
    cfg = tiny_cfg()
    m = build_model(cfg, dtype=torch.float64)

    class Marker(nn.Linear):  # stands in for a quantized module: not a plain nn.Linear
        pass

    attn = m.core[0].attn
    attn.wk = Marker(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, dtype=torch.float64)
    fuse_projections(m)
    assert attn.wqkv is None and hasattr(attn, "wq")
    assert m.core[1].attn.wqkv is not None


def test_swap_linears_is_generic():
    cfg = tiny_cfg()
    m = build_model(cfg)
    names = []

    def factory(name, lin):
        names.append(name)
        return None if name.endswith("wo") else nn.Identity()

    n_blocks = cfg.n_prelude + cfg.n_core + cfg.n_coda
    assert swap_linears(m, factory) == n_blocks * (4 + 3 - 1)  # 4 attn + 3 swiglu linears, minus the kept wo
    assert "core.0.attn.wq" in names and "coda.0.mlp.w_down" in names
    assert all(isinstance(mod.wo, nn.Linear) for mod in m.modules() if isinstance(mod, Attention))
    assert all(isinstance(mod.w_up, nn.Identity) for mod in m.modules() if isinstance(mod, MLP))


def test_prepare_keeps_file_names_and_rejects_bad_mode(tiny_model_path):
    from tinyloop.modelfile.loader import load_model

    loaded = load_model(tiny_model_path)
    names = set(loaded.model.state_dict())
    assert "core.0.attn.wqkv.weight" in names  # the loaded model has the file's (fused) names
    with pytest.raises(ValueError, match="weights must be one of"):
        prepare_for_decode(loaded.model, weights="int3")


def test_engine_fast_option_same_tokens(tiny_model_path):
    from tinyloop.engine import Engine

    plain = Engine.load(tiny_model_path, fast=False)
    fast = Engine.load(tiny_model_path, fast=True)
    assert fast.model.decode_prepared and not getattr(plain.model, "decode_prepared", None)
    params = SamplingParams(max_tokens=16, loops=3, ignore_eos=True)
    assert fast.generate("The loop", params).token_ids == plain.generate("The loop", params).token_ids


# -- fp16 weights (FBGEMM) ------------------------------------------------------------------------
@needs_fbgemm
def test_fp16_linear_matches_fp16_rounded_weights():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g) * 0.05
    b = torch.randn(48, generator=g)
    x = torch.randn(3, 5, 40, generator=g)
    lin = FP16Linear(w, b)
    ref = F.linear(x.double(), w.half().double(), b.double()).float()
    torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x.bfloat16()), F.linear(x.bfloat16().double(), w.half().double(), b.double()).float(),
                               rtol=1e-5, atol=1e-5)
    assert lin(x).dtype == torch.float32 and lin.weight_nbytes == 2 * 48 * 40
    try:   # unpacked (the native executor runs the model): the native kernels on the 16-bit weight
        from tinyloop.kernels.lib import load
        load()
    except Exception:
        pass
    else:
        raw = FP16Linear(w, b, pack=False)
        assert not raw.packed
        torch.testing.assert_close(raw(x), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fp16 cannot hold"):
        FP16Linear(torch.full((4, 4), 1e5))


@needs_fbgemm
@pytest.mark.parametrize("injection,tie", [("add", True), ("concat-adapter", False)])
def test_fp16_path_close_to_fp32_of_same_weights(injection, tie):
    cfg = tiny_cfg(injection=injection, tie_embeddings=tie, mlp="gelu" if tie else "swiglu")
    eager16 = build_model(cfg, seed=0, dtype=torch.bfloat16)
    ref32 = copy.deepcopy(eager16).float()  # the same bf16 weights, evaluated in fp32
    fast = prepare_for_decode(copy.deepcopy(eager16), threads=None)
    assert fast.decode_prepared["weights"] == "fp16"
    # the head: FBGEMM's pack, or (the native executor) the 16-bit weight read as stored, no pack beside it;
    # the layers likewise: with the executor, prefill runs on the native panels over the stored weights
    assert isinstance(fast.head_linear, FP16Linear) if fast.executor is None else fast.head_linear is None
    layers = [mod for mod in fast.modules() if isinstance(mod, FP16Linear)]
    assert layers and all(mod.packed == (fast.executor is None) for mod in layers)
    if fast.executor is not None:   # no copy: the layer reads the model's own 16-bit tensor
        assert fast.core[0].attn.wqkv.source.dtype == torch.bfloat16
    x = toks(1, 16)
    with torch.inference_mode():
        ref = ref32(x, loops=4).float()
        err_fast = (fast(x, loops=4).float() - ref).abs().max().item()
        err_eager = (eager16(x, loops=4).float() - ref).abs().max().item()
    assert err_fast <= 1e-4
    assert err_fast <= err_eager


@needs_fbgemm
def test_fp16_cached_decode_equals_full_forward():
    cfg = tiny_cfg()
    fast = prepare_for_decode(build_model(cfg, seed=0, dtype=torch.bfloat16), threads=None)
    x = toks(1, 14)
    with torch.inference_mode():
        full = fast(x, loops=3)
        cache = KVCache(cfg, loops=3, dtype=torch.float32)
        outs = [fast(x[:, :5], loops=3, cache=cache, start=0)]
        for t in range(5, 14):
            outs.append(fast(x[:, t:t + 1], loops=3, cache=cache, start=t))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-4, atol=1e-4)


def test_fp32_model_keeps_fp32_weights_unless_asked():
    m = prepare_for_decode(build_model(tiny_cfg()), threads=None)
    assert m.decode_prepared["weights"] == "keep" and m.head_linear is None
    assert all(type(c) is nn.Linear for mod in m.modules() if isinstance(mod, (Attention, MLP))
               for c in mod.children())


def test_prepare_leaves_quantized_linears_alone(tmp_path, tokenizer):
    """Quantized modules (quant.linear.QuantLinear) are not nn.Linear: never swapped for fp16 kernels; fused
    q/k/v only through QuantLinear.concat, which stacks them where this CPU's int4 layout allows (with
    AVX-512 the layout packs rows in blocks of 64, so this model's 32-row k/v stay apart)."""
    from tinyloop.modelfile.loader import load_model, make_header, write_model
    from tinyloop.quant.linear import QuantLinear
    from tinyloop.tools.gptq import QuantSpec, quantize_model

    cfg = preset("tiny").replace(vocab_size=512, eos_token_id=511)
    tensors, quant, _ = quantize_model(build_model(cfg, seed=0), QuantSpec(bits=4, group_size=32, method="rtn"),
                                       None, progress=False)
    header = make_header(cfg, torch.float32, tokenizer, {"tool": "tests"}, quant=quant)
    path = write_model(tmp_path / "q.tinyloop", None, tokenizer=tokenizer, tensors=tensors, header=header)
    plain, fast = load_model(path).model, prepare_for_decode(load_model(path).model, threads=None, executor="torch")
    attn = fast.core[0].attn
    assert isinstance(attn.wqkv, QuantLinear) if attn.wqkv is not None else isinstance(attn.wq, QuantLinear)
    x = toks(1, 12, vocab=512)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x, loops=3), plain(x, loops=3), rtol=0, atol=0)


def test_decode_threads_apply_to_one_token_steps_only():
    m = prepare_for_decode(build_model(tiny_cfg()), threads=1)
    seen = []
    m.core[0].register_forward_hook(lambda mod, args, out: seen.append((args[0].shape[1], torch.get_num_threads())))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cache = KVCache(m.cfg, loops=2)
        with torch.inference_mode():
            m(toks(1, 4), loops=2, cache=cache, start=0)
            m(toks(1, 1), loops=2, cache=cache, start=4)
        assert torch.get_num_threads() == 2  # restored after the step
    finally:
        torch.set_num_threads(before)
    assert seen == [(4, 2), (4, 2), (1, 1), (1, 1)]
