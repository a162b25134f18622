import pytest
import torch

from tinyloop.config import preset
from tinyloop.model import CacheError, KVCache, build_model
from tinyloop.quant.hadamard import hadamard_matrix
from tinyloop.quant.kv import KV_FORMATS, dequantize_vectors, quantize_vectors

CFG = preset("tiny").replace(vocab_size=512, eos_token_id=511)


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=0)


def tokens(n, seed=0):
    return torch.randint(0, CFG.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def run_cached(model, x, fmt, window=0, prefill=8):
    cache = KVCache(CFG, max_positions=x.shape[1], loops=3, kv_format=fmt, window=window, rollback_margin=8)
    outs = [model(x[:, :prefill], 3, cache=cache, start=0)]
    cache.length = prefill
    for t in range(prefill, x.shape[1]):
        outs.append(model(x[:, t:t + 1], 3, cache=cache, start=t))
        cache.length += 1
    return torch.cat(outs, dim=1), cache


def rel(a, b):
    return float((a - b).norm() / b.norm())


@torch.inference_mode()
def test_quantized_formats_track_fp16(model):
    x = tokens(32)
    ref, _ = run_cached(model, x, "fp16")
    errs = {fmt: rel(run_cached(model, x, fmt)[0], ref) for fmt in ("int8", "int4", "int4-h")}
    assert errs["int8"] < 2e-3
    assert errs["int4"] < 5e-2 and errs["int4-h"] < 5e-2
    assert errs["int8"] < errs["int4"] / 5


def test_hadamard_int4_beats_plain_int4_with_outlier_channels():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 50, 64, generator=g)
    x[..., 3] *= 20.0   # a few outlier channels, as in real keys
    x[..., 17] -= 12.0
    plain = dequantize_vectors(*quantize_vectors(x, 4), 4)
    H = hadamard_matrix(64)
    rot = dequantize_vectors(*quantize_vectors(x @ H, 4), 4) @ H
    assert rel(rot, x) < 0.5 * rel(plain, x)
    # and through the cache: int4-h stores rotated codes but hands back the original basis
    caches = {f: KVCache(CFG.replace(n_kv_heads=2, n_heads=2, dim=128), batch=4, max_positions=50, loops=1, kv_format=f)
              for f in ("int4", "int4-h")}
    got = {f: c.update(0, 0, x[:, :, :, :64], x[:, :, :, :64])[0] for f, c in caches.items()}
    assert rel(got["int4-h"], x) < 0.5 * rel(got["int4"], x)


def test_bytes_per_token_per_slot():
    fp32 = KVCache(CFG, max_positions=16, kv_format="fp16")
    D, Hkv = CFG.head_dim, CFG.n_kv_heads
    assert fp32.bytes_per_token_per_slot() == 2 * Hkv * D * 4
    fp16_bytes = 2 * Hkv * D * 2  # a 16-bit cache
    cfg64 = preset("tinyloop-16m")  # head dim 64, the shipped shape
    for fmt, want in (("int8", 2 * 4 * (64 + 4)), ("int4", 2 * 4 * (32 + 4)), ("int4-h", 2 * 4 * (32 + 4))):
        c = KVCache(cfg64, max_positions=4, loops=1, kv_format=fmt)
        assert c.bytes_per_token_per_slot() == want
    int4 = KVCache(cfg64, max_positions=4, loops=1, kv_format="int4")
    assert int4.bytes_per_token_per_slot() <= 0.3 * (2 * 4 * 64 * 2)
    small = KVCache(CFG, max_positions=16, loops=3, kv_format="int4")
    assert small.nbytes() == small.n_slots * 16 * small.bytes_per_token_per_slot()
    assert fp16_bytes > 0


@pytest.mark.parametrize("fmt", KV_FORMATS)
@torch.inference_mode()
def test_window_and_rollback_replay_exactly(model, fmt):
    x = tokens(40, seed=1)
    y = tokens(6, seed=2)
    # straight: 30 tokens then y
    straight, _ = run_cached(model, torch.cat([x[:, :30], y], 1), fmt, window=12)
    # with a detour: 30 tokens, 5 wrong tokens, roll back, then y
    cache = KVCache(CFG, max_positions=64, loops=3, kv_format=fmt, window=12, rollback_margin=8)
    model(x[:, :8], 3, cache=cache, start=0)
    cache.length = 8
    for t in range(8, 30):
        model(x[:, t:t + 1], 3, cache=cache, start=t)
        cache.length += 1
    model(x[:, 30:35], 3, cache=cache, start=30)  # a rejected speculation
    cache.length = 35
    cache.rollback(30)
    out = model(y, 3, cache=cache, start=30)
    assert torch.allclose(out, straight[:, 30:], atol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "int4-h"])
@torch.inference_mode()
def test_gather_positions_moves_codes(model, fmt):
    x = tokens(12, seed=3)
    cache = KVCache(CFG, max_positions=16, loops=3, kv_format=fmt)
    model(x, 3, cache=cache, start=0)
    at = lambda *pos: (2, slice(None), slice(None), torch.tensor(pos))  # noqa: E731
    before = cache.k.read(at(7, 9))
    cache.gather_positions([7, 9], 4)
    assert torch.equal(cache.k.read(at(4, 5)), before)


def test_unknown_format_and_bad_head_dim():
    with pytest.raises(CacheError, match="unknown KV cache format 'int3'"):
        KVCache(CFG, max_positions=8, kv_format="int3")
    odd = CFG.replace(dim=96, n_heads=4, n_kv_heads=2)  # head dim 24
    with pytest.raises(CacheError, match="power-of-two head dim"):
        KVCache(odd, max_positions=8, kv_format="int4-h")
    KVCache(odd, max_positions=8, kv_format="int4")  # plain int4 has no such need
