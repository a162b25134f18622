import pytest
import torch

from tinyloop.config import ConfigError, ModelConfig, preset
from tinyloop.model import CacheError, KVCache, build_model


def test_presets_param_counts():
    from tinyloop.model import param_count

    assert 400e6 < param_count(preset("tinyloop-407m")) < 410e6
    for name in ("tinyloop-16m", "tiny"):   # (the meta-device count is the built model's)
        cfg = preset(name)
        assert sum(p.numel() for p in build_model(cfg).parameters()) == param_count(cfg)
    # the shipped files' own counts (fp16, and GPTQ int4 with an int8 head beside the float one) are their models'
    from tinyloop.modelfile.header import header_config, held_params, packaged_model_path, packaged_models, read_header

    for name in packaged_models():
        path = packaged_model_path(name)
        assert held_params(*read_header(path)) == param_count(header_config(path)), name


def test_config_roundtrip_and_errors():
    cfg = preset("tiny")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown config fields"):
        ModelConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    with pytest.raises(ConfigError, match="divisible"):
        cfg.replace(dim=63)
    with pytest.raises(ConfigError, match="injection"):
        cfg.replace(injection="mul")
    with pytest.raises(ConfigError, match="preset"):
        preset("nope")


@pytest.mark.parametrize("injection,loop_norm", [("none", True), ("add", True), ("concat-adapter", True),
                                                 ("none", False)])
def test_cached_decode_equals_full_forward(injection, loop_norm):
    cfg = preset("tiny").replace(vocab_size=300, injection=injection, loop_norm=loop_norm)
    m = build_model(cfg, dtype=torch.float64)
    toks = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    full = m(toks, loops=4)
    cache = KVCache(cfg, batch=2, loops=4, dtype=torch.float64)
    outs = [m(toks[:, :9], loops=4, cache=cache, start=0)]
    for t in range(9, 24):
        outs.append(m(toks[:, t:t + 1], loops=4, cache=cache, start=t))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)


def unrolled_reference(m, toks, loops):
    """The looped model written out by hand: prelude, `loops` copies of the core, coda, head."""
    import torch.nn.functional as F
    cfg = m.cfg
    ctx = m.context(toks.shape[1])
    x = m.embed(toks)
    for blk in m.prelude:
        x = blk(x, ctx, None)
    e = x
    h = e if cfg.injection == "none" else torch.zeros_like(e)
    for _ in range(loops):
        if cfg.injection == "add":
            y = h + e
        elif cfg.injection == "concat-adapter":
            y = F.linear(torch.cat([h, e], -1), m.adapter.weight)
        else:
            y = h
        for blk in m.core:
            y = blk(y, ctx, None)
        h = F.rms_norm(y, (cfg.dim,), m.core_norm.weight, cfg.norm_eps) if cfg.loop_norm else y
    for blk in m.coda:
        h = blk(h, ctx, None)
    return F.linear(F.rms_norm(h, (cfg.dim,), m.norm.weight, cfg.norm_eps), m.embed.weight)


@pytest.mark.parametrize("loops", [1, 2, 5, 11])
@pytest.mark.parametrize("shape", [dict(), dict(injection="none", loop_norm=False),
                                   dict(injection="concat-adapter", n_prelude=0, n_coda=0)])
def test_loops_equal_unrolled_reference(loops, shape):
    cfg = preset("tiny").replace(vocab_size=300, **shape)
    m = build_model(cfg, dtype=torch.float64)
    toks = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(m(toks, loops=loops), unrolled_reference(m, toks, loops))
    assert m.core_loop_tokens == 16 * loops


def test_loops_out_of_range():
    m = build_model(preset("tiny").replace(vocab_size=300))
    with pytest.raises(ValueError, match="loops"):
        m(torch.zeros(1, 2, dtype=torch.long), loops=65)


def banded_reference(m, toks, loops, window):
    """Full forward without a cache where each query sees the `window` most recent positions."""
    T = toks.shape[1]
    pos = torch.arange(T)
    band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    ctx = m.context(T, tree_mask=band)
    e = m.embed_prelude(toks, ctx)
    h = m.init_state(e)
    for r in range(loops):
        h = m.core_loop(h, e, r, ctx)
    return m.coda_logits(h, ctx)


@pytest.mark.parametrize("prefill", [1, 5, 13])
def test_cache_window_is_a_sliding_window(prefill):
    """With cache_window W every query, in every layer and loop, sees exactly the W most recent positions,
    itself included; memory holds W + rollback margin positions, not the whole context."""
    cfg = preset("tiny").replace(vocab_size=300)
    m = build_model(cfg, dtype=torch.float64)
    W, T = 4, 20
    toks = torch.randint(0, 300, (1, T), generator=torch.Generator().manual_seed(3))
    ref = banded_reference(m, toks, 3, W)
    cache = KVCache(cfg, loops=3, window=W, rollback_margin=2, dtype=torch.float64)
    assert cache.capacity == W + 2
    outs = [m(toks[:, :prefill], loops=3, cache=cache, start=0)]
    for t in range(prefill, T):
        outs.append(m(toks[:, t:t + 1], loops=3, cache=cache, start=t))
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-10, atol=1e-10)
    # and it differs from full attention once the window is exceeded
    assert not torch.allclose(ref[:, W:], m(toks, loops=3)[:, W:])


def test_cache_slots_size_and_rollback():
    cfg = preset("tiny").replace(vocab_size=300)
    cache = KVCache(cfg, batch=2, max_positions=32, loops=5, dtype=torch.float16)
    assert cache.n_slots == cfg.n_prelude + cfg.n_coda + 5 * cfg.n_core
    assert len({cache.slot_core(r, j) for r in range(5) for j in range(cfg.n_core)}
               | {cache.slot_prelude(0), cache.slot_coda(0)}) == cache.n_slots
    per = 2 * cfg.n_kv_heads * cfg.head_dim * 2
    assert cache.bytes_per_token_per_slot() == per
    assert cache.nbytes() == per * cache.n_slots * 2 * 32
    with pytest.raises(CacheError, match="loop 5"):
        cache.slot_core(5, 0)
    cache.length = 10
    cache.rollback(7)
    assert cache.length == 7
    with pytest.raises(CacheError):
        cache.rollback(8)


def test_rollback_then_redo_matches_plain_run():
    cfg = preset("tiny").replace(vocab_size=300)
    m = build_model(cfg, dtype=torch.float64)
    toks = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(4))
    other = torch.randint(0, 300, (1, 3), generator=torch.Generator().manual_seed(5))
    cache = KVCache(cfg, loops=3, dtype=torch.float64)
    m(toks[:, :8], loops=3, cache=cache, start=0)
    cache.length = 8
    m(other, loops=3, cache=cache, start=8)  # a speculative detour
    cache.length = 11
    cache.rollback(8)
    out = m(toks[:, 8:], loops=3, cache=cache, start=8)
    torch.testing.assert_close(out, m(toks, loops=3)[:, 8:], rtol=1e-10, atol=1e-10)
