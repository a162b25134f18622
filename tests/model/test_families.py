"""The architecture features imported families need (issue 15), each through the model contract: cached
decode == full forward, batched == single, speculative greedy == plain greedy. The shapes are tiny
stand-ins for Ouro (sandwich norms, the final norm ending every loop, no head norm, an exit gate, an
untied head, GQA) and Huginn (norms after the residual add, q/k biases, a scaled embedding, the concat
adapter, the final norm ending the recurrence and again before the tied head)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import core_ids, reference_ids, varied_model
from tinyloop.config import ConfigError, preset
from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.serving import BatchEngine, run_to_completion
from tinyloop.model import KVCache, LoopedTransformer
from tinyloop.modelfile.loader import LoadedModel

BASE = preset("tiny").replace(vocab_size=512, eos_token_id=511)
OURO_LIKE = BASE.replace(n_prelude=0, n_coda=0, injection="none", norm_placement="sandwich", loop_norm=True,
                         head_norm=False, exit_gate=True, tie_embeddings=False, default_loops=4)
HUGINN_LIKE = BASE.replace(norm_placement="sandwich-residual", qk_bias=True, embed_scale=math.sqrt(BASE.dim),
                           injection="concat-adapter", loop_norm=False, post_loop_norm=True, default_loops=4)
# Nanbeige: Llama pre-norm blocks looped with the final norm ending every loop (no head norm after it),
# an untied head, GQA 6:2 with heads wider than dim / n_heads (q_proj and o_proj are 96 wide on a 64 dim)
NANBEIGE_LIKE = BASE.replace(n_heads=6, n_kv_heads=2, head_dim=16, n_prelude=0, n_coda=0, injection="none",
                             norm_placement="pre", loop_norm=True, head_norm=False, tie_embeddings=False,
                             default_loops=2)
# Parcae: pre-norm ReLU^2 blocks, a prelude norm, the diagonal injection from a zero state, the projection C
# after the loops, parameter-free q/k norms after RoPE, gated value embeddings in a prelude, a core and a
# coda block (the core's and coda's ride in the loop input), a logit soft-cap, GQA 4:2
PARCAE_LIKE = BASE.replace(norm_placement="pre", mlp="relu2", injection="diagonal", loop_norm=False, head_norm=True,
                           prelude_norm=True, state_proj=True, qk_norm=True, value_embeds=(0, 2, 3),
                           logit_softcap=30.0, state_init_std=math.sqrt(2 / (5 * BASE.dim)), default_loops=4)
# The retrofitted-recurrence conversions (huginn_raven, McLeish et al. 2025): Huginn's prelude / concat adapter
# / coda from a zero state, an untied head, GQA, the final norm before the head only. Llama's blocks are pre-norm;
# OLMo-2's normalise only the branch outputs (post) and norm all q heads together (and all k heads), with
# weights, before RoPE; its heads here are wider than dim / n_heads, as OLMo's code allows.
RETRO_LLAMA_LIKE = BASE.replace(norm_placement="pre", injection="concat-adapter", loop_norm=False, head_norm=True,
                                tie_embeddings=False, default_loops=4)
RETRO_OLMO_LIKE = RETRO_LLAMA_LIKE.replace(norm_placement="post", qk_norm_full=True, head_dim=24)
# the OLMo code's other starts: the state is the prelude output ("embed-init"), or loop 0 runs on it without
# the adapter ("skip-adapter")
FAMILIES = {"ouro-like": OURO_LIKE, "huginn-like": HUGINN_LIKE, "nanbeige-like": NANBEIGE_LIKE,
            "parcae-like": PARCAE_LIKE, "retro-llama-like": RETRO_LLAMA_LIKE, "retro-olmo-like": RETRO_OLMO_LIKE,
            "retro-olmo-embed-start": RETRO_OLMO_LIKE.replace(loop_start="embed"),
            "retro-olmo-skip-start": RETRO_OLMO_LIKE.replace(loop_start="skip")}


def model_of(name: str):
    m = varied_model(FAMILIES[name], seed=3, dtype=torch.float64)
    if m.cfg.qk_bias:
        with torch.no_grad():
            for blk in [*m.prelude, *m.core, *m.coda]:
                blk.attn.qk_bias.normal_(0, 1, generator=torch.Generator().manual_seed(5))
    if m.cfg.qk_norm_full:   # the norms' gains away from 1 (their init), so that a missed weight shows
        with torch.no_grad():
            g = torch.Generator().manual_seed(7)
            for blk in [*m.prelude, *m.core, *m.coda]:
                for norm in (blk.attn.q_norm, blk.attn.k_norm, blk.attn_out_norm, blk.mlp_out_norm):
                    norm.weight.uniform_(0.5, 1.5, generator=g)
    if m.injection is not None:  # per-channel decays away from 1/2 (their init is zeros)
        with torch.no_grad():
            g = torch.Generator().manual_seed(6)
            m.injection.A_log.normal_(0, 0.5, generator=g)
            m.injection.dt_bias.normal_(0, 1, generator=g)
    return m


def test_param_counts_and_config_checks(tmp_path, tokenizer):
    """A file's parameter count (`held_params`, from its tensor index, without torch) is its model's, in every
    family's layout; so is the count of the model a config describes (`param_count`)."""
    from tinyloop.model import param_count
    from tinyloop.modelfile.header import held_params, read_header
    from tinyloop.modelfile.loader import write_model

    for name, cfg in FAMILIES.items():
        m = varied_model(cfg, seed=3)
        path = write_model(tmp_path / f"{name}.tinyloop", m, tokenizer=tokenizer, provenance={"tool": "tests"})
        assert held_params(*read_header(path)) == sum(p.numel() for p in m.parameters()) == param_count(cfg)
    with pytest.raises(ConfigError, match="norm_placement"):
        BASE.replace(norm_placement="post-residual")
    with pytest.raises(ConfigError, match="loop_start"):
        BASE.replace(loop_start="random")
    from tinyloop.kernels.executor import unsupported_features   # the C++ code runs both retrofits (session 18)
    assert unsupported_features(RETRO_LLAMA_LIKE) == []
    assert unsupported_features(RETRO_OLMO_LIKE.replace(loop_start="skip")) == []
    assert unsupported_features(RETRO_LLAMA_LIKE.replace(loop_start="embed")) == []
    blk = LoopedTransformer(RETRO_OLMO_LIKE).core[0]   # post-norm: no norm on the branch inputs
    assert blk.attn_norm is None and blk.mlp_norm is None and blk.attn.q_norm.weight.shape == (4 * 24,)
    assert blk.attn.k_norm.weight.shape == (2 * 24,)
    with pytest.raises(ConfigError, match="head_norm"):
        BASE.replace(loop_norm=False, head_norm=False)
    assert NANBEIGE_LIKE.head_dim * NANBEIGE_LIKE.n_heads == 96 != NANBEIGE_LIKE.dim
    assert NANBEIGE_LIKE.replace(dim=128).head_dim == 16 and BASE.replace(dim=128).head_dim == 32
    with pytest.raises(ConfigError, match="head dim"):
        BASE.replace(head_dim=15)
    with pytest.raises(ConfigError, match="eos_token_ids"):
        BASE.replace(eos_token_ids=(600,))
    assert BASE.replace(eos_token_ids=[3, 4]).stop_token_ids == {511, 3, 4}


def hand_written(m, toks, loops):
    """The forward written out from the family descriptions, without the model's blocks."""
    cfg = m.cfg
    n = lambda x, w: F.rms_norm(x, (cfg.dim,), w.weight, cfg.norm_eps)  # noqa: E731
    T = toks.shape[1]
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv
    cos, sin = ang.cos(), ang.sin()

    def rope(x):  # (T, heads, D), half-split pairs (i, i + D/2)
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        c, s = cos[:, None], sin[:, None]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    def attn(blk, x, idx):
        a = blk.attn
        q, k = x @ a.wq.weight.T, x @ a.wk.weight.T
        if cfg.qk_norm_full:   # all heads together, with weights, before RoPE
            q = F.rms_norm(q, (H * D,), a.q_norm.weight, cfg.norm_eps)
            k = F.rms_norm(k, (Hkv * D,), a.k_norm.weight, cfg.norm_eps)
        q, k = q.view(T, H, D), k.view(T, Hkv, D)
        v = (x @ a.wv.weight.T).view(T, Hkv, D)
        if idx in cfg.value_embeds:
            gate = 2 * torch.sigmoid(x[:, :cfg.ve_gate_channels] @ a.ve_gate.weight.T)       # (T, Hkv)
            v = v + gate[..., None] * m.value_embeds[str(idx)].weight[toks[0]].view(T, Hkv, D)
        if a.qk_bias is not None:
            q, k = q + a.qk_bias[:H], k + a.qk_bias[H:]
        q, k = rope(q), rope(k)
        if cfg.qk_norm:
            q, k = F.rms_norm(q, (D,)), F.rms_norm(k, (D,))
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        s = torch.einsum("thd,uhd->htu", q, k) / math.sqrt(D)
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        return torch.einsum("htu,uhd->thd", s.softmax(-1), v).reshape(T, H * D) @ a.wo.weight.T

    def mlp(blk, x):
        w = blk.mlp
        if cfg.mlp == "relu2":
            return F.relu(x @ w.w_up.weight.T) ** 2 @ w.w_down.weight.T
        return (F.silu(x @ w.w_gate.weight.T) * (x @ w.w_up.weight.T)) @ w.w_down.weight.T

    def block(blk, x, idx):
        if cfg.norm_placement == "pre":
            x = x + attn(blk, n(x, blk.attn_norm), idx)
            return x + mlp(blk, n(x, blk.mlp_norm))
        if cfg.norm_placement == "post":
            x = x + n(attn(blk, x, idx), blk.attn_out_norm)
            return x + n(mlp(blk, x), blk.mlp_out_norm)
        if cfg.norm_placement == "sandwich":
            x = x + n(attn(blk, n(x, blk.attn_norm), idx), blk.attn_out_norm)
            return x + n(mlp(blk, n(x, blk.mlp_norm)), blk.mlp_out_norm)
        x = n(x + attn(blk, n(x, blk.attn_norm), idx), blk.attn_out_norm)
        return n(x + mlp(blk, n(x, blk.mlp_norm)), blk.mlp_out_norm)

    P, C = cfg.n_prelude, cfg.n_core
    e = m.embed.weight[toks[0]] * cfg.embed_scale
    for i, blk in enumerate(m.prelude):
        e = block(blk, e, i)
    if cfg.prelude_norm:
        e = n(e, m.prelude_norm)
    h = e if cfg.injection == "none" or cfg.loop_start != "state" else torch.zeros_like(e)
    for r in range(loops):
        if r == 0 and cfg.loop_start == "skip":
            x = e
        elif cfg.injection == "concat-adapter":
            x = torch.cat([h, e], -1) @ m.adapter.weight.T
        elif cfg.injection == "diagonal":
            inj = m.injection
            dt = F.softplus(inj.dt_bias)
            x = h * torch.exp(-dt * torch.exp(inj.A_log)) + dt * (e @ inj.B.weight.T)
        else:
            x = h
        for j, blk in enumerate(m.core):
            x = block(blk, x, P + j)
        h = n(x, m.core_norm) if cfg.loop_norm else x
    if cfg.post_loop_norm:
        h = n(h, m.norm)
    if cfg.state_proj:
        h = h @ m.state_proj.weight.T
    for i, blk in enumerate(m.coda):
        h = block(blk, h, P + C + i)
    if cfg.head_norm:
        h = n(h, m.norm)
    logits = h @ m.head_weight.T
    c = cfg.logit_softcap
    return logits if c == 0 else c * torch.tanh(logits / c)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("loops", [1, 3, 6])
def test_forward_matches_the_family_written_out(name, loops):
    m = model_of(name)
    toks = torch.randint(0, 512, (1, 11), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(m(toks, loops=loops)[0], hand_written(m, toks, loops), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", FAMILIES)
def test_cached_decode_equals_full_forward(name):
    m = model_of(name)
    toks = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(2))
    full = m(toks, loops=4)
    cache = KVCache(m.cfg, batch=2, loops=4, dtype=torch.float64)
    outs = [m(toks[:, :7], loops=4, cache=cache, start=0)]
    for t in range(7, 20):
        outs.append(m(toks[:, t:t + 1], loops=4, cache=cache, start=t))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", FAMILIES)
def test_batched_equals_single_and_speculation_equals_plain(name):
    m = model_of(name)
    prompts = [[5, 17, 300, 42, 7], [1, 2], list(range(40, 60))]
    plain = [SamplingParams(max_tokens=12, loops=lp, ignore_eos=True) for lp in (2, 4, 5)]
    want = [reference_ids(m, p, sp) for p, sp in zip(prompts, plain)]
    engine = Engine(LoadedModel(m, None, {}, None))
    got = run_to_completion(BatchEngine(engine, page_size=4), list(zip(prompts, plain)))
    assert [[t for e in evs for t in e.token_ids] for evs in got] == want
    for mode, k in (("speculative", 1), ("tree_speculative", 3)):
        spec = SamplingParams(max_tokens=12, mode=mode, verify_loops=4, draft_loops=1, draft_ahead=3,
                              k_branches=k)
        assert core_ids(m, prompts[0], spec) == reference_ids(m, prompts[0], plain[1])


def test_seeded_random_initial_state_is_per_position():
    """Huginn's random start (state_seed): drawn by position, so the cache and the engine core agree with
    the full forward; different seeds give different outputs; no seed is the zero state."""
    cfg = HUGINN_LIKE.replace(state_init_std=0.5)
    m = varied_model(cfg, seed=3, dtype=torch.float64)
    toks = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(4))
    zero = m(toks, loops=3)
    m.state_seed = 7
    seeded = m(toks, loops=3)
    assert not torch.allclose(zero, seeded)
    cache = KVCache(cfg, loops=3, dtype=torch.float64)
    outs = [m(toks[:, :5], loops=3, cache=cache, start=0)] + \
        [m(toks[:, t:t + 1], loops=3, cache=cache, start=t) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(outs, 1), seeded, rtol=1e-10, atol=1e-10)
    params = SamplingParams(max_tokens=8, loops=3, ignore_eos=True)
    assert core_ids(m, toks[0].tolist(), params) == reference_ids(m, toks[0].tolist(), params)
    m.state_seed = 8
    assert not torch.allclose(m(toks, loops=3), seeded)
