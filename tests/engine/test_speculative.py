"""Self-speculative decoding: exactness against plain generation, cache state, reuse, streaming, validation."""

from __future__ import annotations

import pytest
import torch

from conftest import core_ids, drive, pool_entries, reference_ids, standalone
from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.sampling import Sampler
from tinyloop.errors import ValidationError
from tinyloop.model import KVCache

PROMPTS = [[5, 17, 300, 42, 7], [1], [400, 3, 3, 3, 9, 250, 77, 12, 100, 5, 6], [0, 511, 256]]


def chi2_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability ~0.001 (Wilson-Hilferty; 37.7 for 15 dof)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * a ** 0.5) ** 3


_PLAIN: dict = {}


def plain(model, prompt, n, V, **kw):
    """Plain generate's tokens (memoised: the tiny64 fixture is rebuilt identically for every test)."""
    key = (tuple(prompt), n, V, tuple(sorted(kw.items())))
    if key not in _PLAIN:
        _PLAIN[key] = reference_ids(model, prompt, SamplingParams(max_tokens=n, loops=V, **kw))
    return _PLAIN[key]


def spec(model, prompt, n, V, mode="speculative", stats=None, draft_vocab=None, draft_stop=0.0, fast_head=True,
         **kw):
    p = SamplingParams(max_tokens=n, mode=mode, verify_loops=V, **kw)
    return core_ids(model, prompt, p, stats, draft_vocab=draft_vocab, draft_stop=draft_stop, fast_head=fast_head)


def test_tiny_model_is_not_degenerate(tiny64):
    """The exactness tests below mean something only if outputs vary and drafts are sometimes wrong."""
    out = plain(tiny64, PROMPTS[0], 40, 6)
    assert len(set(out)) > 8
    stats = {}
    spec(tiny64, PROMPTS[0], 40, 6, stats=stats, draft_loops=2, draft_ahead=4)
    assert 0.0 < stats["acceptance_rate"] < 1.0


# (d, V, k, draft vocabulary, fp16 argmax head): every knob varies, the prompts cycle through PROMPTS
CHAIN = [(1, 3, 1, None, True), (1, 6, 4, 48, True), (2, 6, 3, None, False), (5, 6, 8, 48, False),
         (3, 8, 16, None, True), (2, 6, 2, 48, True)]


@pytest.mark.parametrize("i", range(len(CHAIN)))
def test_greedy_chain_equals_generate(tiny64, i):
    d, V, k, vocab, fast = CHAIN[i]
    for prompt in (PROMPTS[i % 4], PROMPTS[(i + 1) % 4]):
        ref = plain(tiny64, prompt, 24, V)
        assert spec(tiny64, prompt, 24, V, draft_loops=d, draft_ahead=k, draft_vocab=vocab, fast_head=fast) == ref


# (K, depth, d, draft vocabulary, fp16 argmax head)
TREE = [(2, 4, 1, None, True), (3, 3, 2, 48, False), (4, 2, 1, 48, True), (4, 8, 3, None, True),
        (8, 8, 2, 48, True), (16, 4, 1, None, False)]


@pytest.mark.parametrize("i", range(len(TREE)))
def test_greedy_tree_equals_generate(tiny64, i):
    K, depth, d, vocab, fast = TREE[i]
    for prompt in (PROMPTS[i % 4], PROMPTS[(i + 1) % 4]):
        out = spec(tiny64, prompt, 24, 6, mode="tree_speculative", draft_loops=d, draft_ahead=depth, k_branches=K,
                   draft_vocab=vocab, fast_head=fast)
        assert out == plain(tiny64, prompt, 24, 6)


def test_exact_argmax_head_finds_near_ties():
    """The fp16-candidate argmax must agree with the fp32 head even where fp16 cannot tell rows apart."""
    from tinyloop.config import preset
    from tinyloop.model import build_model
    from tinyloop.engine.draft_head import ExactArgmax

    torch.manual_seed(0)
    model = build_model(preset("tiny").replace(vocab_size=512), seed=1)
    with torch.no_grad():
        w = model.head_weight
        for a in range(0, 40, 2):  # pairs of rows equal after fp16 rounding, different in fp32
            w[a + 1] = w[a] + 1e-6 * torch.randn(w.shape[1])
    head = ExactArgmax(model)
    x = torch.randn(200, 64)
    x[:100] = w[:100:2].repeat(2, 1)[:100] * 3.0  # rows pointing at the near-tied pairs
    with torch.inference_mode():
        logits = model.logits(x[None])[0]
        got = head(x)
    # The fp32 full head and the fp32 rescoring of the candidates may round a true near-tie differently
    # (a 1-ulp difference, seen for some seeds); the pick must be the argmax up to that rounding, and
    # it must never be a token that fp16 alone would have confused with a clearly better one.
    best = logits.max(dim=-1).values
    picked = logits[torch.arange(200), torch.tensor(got)]
    assert torch.all(picked >= best - 4 * torch.finfo(torch.float32).eps * best.abs())


def test_draft_stop_keeps_exactness(tiny64):
    ref = plain(tiny64, PROMPTS[0], 40, 6)
    stats = {}
    assert spec(tiny64, PROMPTS[0], 40, 6, stats=stats, draft_loops=1, draft_ahead=8, draft_stop=0.5) == ref
    plain_rounds = {}
    spec(tiny64, PROMPTS[0], 40, 6, stats=plain_rounds, draft_loops=1, draft_ahead=8)
    assert stats["draft_tokens"] < plain_rounds["draft_tokens"]  # the stop did cut drafts short


@pytest.mark.parametrize("d,k", [(1, 4), (2, 2), (4, 8)])
def test_tree_with_one_branch_is_the_chain(tiny64, d, k):
    for prompt in PROMPTS:
        a, b = {}, {}
        chain = spec(tiny64, prompt, 25, 6, stats=a, draft_loops=d, draft_ahead=k)
        tree = spec(tiny64, prompt, 25, 6, mode="tree_speculative", stats=b, draft_loops=d, draft_ahead=k, k_branches=1)
        assert chain == tree
        assert (a["rounds"], a["draft_tokens"], a["acceptance_rate"]) == (b["rounds"], b["draft_tokens"],
                                                                        b["acceptance_rate"])


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.5), dict(presence_penalty=1.0),
                                       dict(frequency_penalty=0.7, repetition_penalty=0.8)])
@pytest.mark.parametrize("mode,K", [("speculative", 1), ("tree_speculative", 3)])
def test_greedy_with_penalties_equals_generate(tiny64, penalties, mode, K):
    ref = plain(tiny64, PROMPTS[2], 30, 6, **penalties)
    out = spec(tiny64, PROMPTS[2], 30, 6, mode=mode, draft_loops=2, draft_ahead=4, k_branches=K,
               draft_vocab=64, **penalties)
    assert out == ref


@pytest.mark.parametrize("mode,K", [("speculative", 1), ("tree_speculative", 4)])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 9, 17])
def test_max_tokens_is_exact(tiny64, mode, K, n):
    out = spec(tiny64, PROMPTS[0], n, 6, mode=mode, draft_loops=1, draft_ahead=8, k_branches=K)
    assert out == plain(tiny64, PROMPTS[0], n, 6)


@pytest.mark.parametrize("window", [4, 9])
def test_chain_with_cache_window_equals_generate(tiny64, window):
    prompt = list(range(3, 23))
    ref = plain(tiny64, prompt, 50, 6, cache_window=window)
    assert ref != plain(tiny64, prompt, 50, 6)  # the window does change the output
    assert spec(tiny64, prompt, 50, 6, draft_loops=2, draft_ahead=5, cache_window=window) == ref
    tree = spec(tiny64, prompt, 50, 6, mode="tree_speculative", draft_loops=2, draft_ahead=5, k_branches=1,
                cache_window=window)
    assert tree == ref


@pytest.mark.parametrize("kv_format", ["int8", "int4-h"])
@pytest.mark.parametrize("mode,K", [("speculative", 1), ("tree_speculative", 4)])
def test_quantized_kv_cache_equals_generate_with_it(tiny64, kv_format, mode, K):
    p = SamplingParams(max_tokens=30, loops=6)
    ref = reference_ids(tiny64, PROMPTS[0], p, kv_format=kv_format)
    sp = SamplingParams(max_tokens=30, mode=mode, verify_loops=6, draft_loops=2, draft_ahead=4, k_branches=K)
    assert core_ids(tiny64, PROMPTS[0], sp, kv_format=kv_format) == ref


def _plain_cache(model, prompt, tokens, V):
    """The contiguous cache of a plain V-loop run that has processed prompt + tokens."""
    cache = KVCache(model.cfg, max_positions=len(prompt) + len(tokens) + 1, loops=V, dtype=torch.float64)
    with torch.inference_mode():
        model(torch.tensor([prompt + tokens]), V, cache=cache, start=0)
    cache.length = len(prompt) + len(tokens)
    return cache


@pytest.mark.parametrize("mode,K,d", [("speculative", 1, 2), ("tree_speculative", 3, 1), ("tree_speculative", 4, 3)])
def test_cache_after_rounds_equals_plain_cache(tiny64, mode, K, d):
    """After rounds (rejections, rollbacks, tree compactions), the sequence's pool pages hold exactly what
    a plain V-loop run writes, in every slot."""
    prompt, V = PROMPTS[0], 6
    params = SamplingParams(max_tokens=40, mode=mode, verify_loops=V, draft_loops=d, draft_ahead=5, k_branches=K)
    sp, kv = standalone(tiny64, prompt, params, draft_vocab=None)
    sampler = sp.sampler
    first = sampler.sample(tiny64.logits(drive(tiny64, kv, sp.prefill()).hidden[-1:][None])[0, 0])   # (prefill: the last state)
    sampler.accept(first)
    sp.pending, out = first, [first]
    while len(out) < 30:
        out += drive(tiny64, kv, sp.round(40 - len(out)))
    assert sp.stats["accepted"] < sp.stats["proposed"]  # some rounds rolled back drafted positions
    if K > 1:
        assert sp.stats["compactions"] > 0  # some accepted paths left the beam's first column
    n = sp.length
    assert n == len(prompt) + len(out) - 1  # every emitted token but the pending one is in the cache
    ref = _plain_cache(tiny64, prompt, out[:-1], V)
    for slot in range(ref.n_slots):
        k, v = pool_entries(kv, sp.table, slot, n)
        at = (slot, 0, slice(None), slice(0, n))
        torch.testing.assert_close(k, ref.k.read(at).transpose(0, 1), rtol=0, atol=1e-12)
        torch.testing.assert_close(v, ref.v.read(at).transpose(0, 1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode,K", [("speculative", 1), ("tree_speculative", 4)])
def test_draft_loop_entries_are_reused(tiny64, mode, K):
    """Every position the round covers gets exactly V core loops: d from the draft, V-d from verification.

    A verifier that recomputed all V loops would spend V + d per drafted position."""
    prompt, V, d = PROMPTS[2], 6, 2
    tiny64.core_loop_tokens = 0
    stats = {}
    out = spec(tiny64, prompt, 30, V, mode=mode, stats=stats, draft_loops=d, draft_ahead=4, k_branches=K)
    evaluated = tiny64.core_loop_tokens
    assert out == plain(tiny64, prompt, 30, V)
    covered = stats["verify_positions"]
    assert covered > len(out)  # drafts were made (and some rejected)
    assert evaluated == len(prompt) * V + covered * V


def test_streaming_concatenates_to_blocking(tiny_model_path):
    engine = Engine.load(tiny_model_path)
    for mode, K in (("speculative", 1), ("tree_speculative", 3)):
        params = SamplingParams(max_tokens=24, mode=mode, draft_loops=1, verify_loops=3, draft_ahead=4,
                                k_branches=K, ignore_eos=True)
        res = engine.generate("The king said", params)
        events = list(engine.stream("The king said", params))
        assert "".join(e.text for e in events) == res.text
        assert [t for e in events for t in e.token_ids] == res.token_ids
        assert sum(1 for e in events if e.token_ids) == len(res.token_ids)  # one event per verified token
        plain_res = engine.generate("The king said", SamplingParams(max_tokens=24, loops=3, ignore_eos=True))
        assert res.token_ids == plain_res.token_ids
        st = res.stats
        assert st["mode"] == mode and st["loops_used"] == 3
        assert 0.0 <= st["acceptance_rate"] <= 1.0 and st["rounds"] >= 1 and st["mean_accepted_per_round"] >= 0


def test_stream_closed_early_stops_cleanly(tiny_model_path):
    engine = Engine.load(tiny_model_path)
    params = SamplingParams(max_tokens=30, mode="speculative", draft_loops=1, verify_loops=3, draft_ahead=6,
                            ignore_eos=True)
    gen = engine.stream("Once upon a time", params)
    first = next(gen)
    gen.close()
    assert first.token_ids


def test_seeded_sampling_repeats(tiny64):
    p = dict(temperature=0.9, top_p=0.95, seed=7, draft_loops=1, draft_ahead=4)
    a = spec(tiny64, PROMPTS[0], 30, 6, **p)
    assert a == spec(tiny64, PROMPTS[0], 30, 6, **p)
    assert a != spec(tiny64, PROMPTS[0], 30, 6, **{**p, "seed": 8})


@pytest.mark.parametrize("kw,param", [
    (dict(draft_loops=6, verify_loops=6), "draft_loops"),
    (dict(draft_loops=7, verify_loops=6), "draft_loops"),
    (dict(draft_loops=0), "draft_loops"),
    (dict(draft_loops=33, verify_loops=40), "draft_loops"),
    (dict(verify_loops=65), "verify_loops"),
    (dict(draft_ahead=0), "draft_ahead"),
    (dict(draft_ahead=17), "draft_ahead"),
    (dict(mode="tree_speculative", k_branches=5, draft_ahead=13), "K_branches"),
    (dict(mode="tree_speculative", k_branches=17), "K_branches"),
    (dict(mode="tree_speculative", k_branches=2, cache_window=8), "cache_window"),
    (dict(mode="nope"), "mode"),
])
def test_validation_names_the_field(tiny64, kw, param):
    p = SamplingParams(max_tokens=4, **{"mode": "speculative", **kw})
    with pytest.raises(ValidationError) as err:
        core_ids(tiny64, [1, 2], p)
    assert err.value.param == param
    assert param in str(err.value)


def test_engine_rejects_bad_knobs_before_work(tiny_engine):
    with pytest.raises(ValidationError) as err:
        tiny_engine.generate("hi", SamplingParams(mode="speculative", draft_loops=8, verify_loops=8))
    assert err.value.param == "draft_loops"


@pytest.mark.timeout(1200)  # ~15 s on an idle machine; minutes under heavy load
@pytest.mark.parametrize("extra", [{}, dict(repetition_penalty=1.4, top_p=0.9)])
def test_chain_sampling_matches_the_verifier_distribution(tiny64, extra):
    """Speculative sampling must give the verifier's distribution (not the draft's): chi-square on the
    joint of the two tokens after a fixed context, over many seeded rounds that accept, reject and add
    bonus tokens. The draft's own distribution differs enough that the same test would reject it."""
    prompt, t1, d, V, N = [5, 17], 100, 1, 3, 600
    base = SamplingParams(max_tokens=3, mode="speculative", verify_loops=V, draft_loops=d, draft_ahead=2,
                          temperature=1.0, top_k=4, **extra)

    def dist(loops, prefix):
        s = Sampler(base, prompt, 512)
        for t in [t1, *prefix]:
            s.accept(t)
        with torch.inference_mode():
            return s.probs(tiny64(torch.tensor([prompt + [t1, *prefix]]), loops)[0, -1])

    def joint(loops):
        p2 = dist(loops, [])
        return {(a, b): float(p2[a]) * float(pb) for a in p2.nonzero().flatten().tolist()
                for b, pb in enumerate(dist(loops, [a]).tolist()) if pb > 0}

    exact, draft = joint(V), joint(d)
    sp, kv = standalone(tiny64, prompt, base, draft_vocab=None)
    drive(tiny64, kv, sp.prefill())
    counts: dict[tuple[int, int], int] = {}
    for seed in range(N):
        sp.sampler = Sampler(base.replace(seed=seed), prompt, 512)
        sp.sampler.accept(t1)
        sp.length, sp.pending = len(prompt), t1
        out: list[int] = []
        while len(out) < 2:
            out += drive(tiny64, kv, sp.round(3 - len(out)))
        counts[tuple(out[:2])] = counts.get(tuple(out[:2]), 0) + 1
    assert set(counts) <= set(exact)
    chi2 = sum((counts.get(c, 0) - N * p) ** 2 / (N * p) for c, p in exact.items())
    critical = chi2_critical(len(exact) - 1)
    assert chi2 < critical
    st = sp.stats
    assert 0.1 < st["accepted"] / st["proposed"] < 0.9  # both acceptance and rejection were exercised
    # power: the draft's distribution would score far above the critical value with this many samples
    draft_chi2 = sum(N * (draft.get(c, 0.0) - p) ** 2 / p for c, p in exact.items())
    assert draft_chi2 > 3 * critical


@pytest.mark.slow
def test_shipped_model_greedy_speculation_equals_generate(shipped_model_path):
    """The trained model, float32, default knobs and a wide tree: token for token plain generate's."""
    engine = Engine.load(shipped_model_path)
    prompt = "In the beginning God created the heaven and the earth. And the earth was"
    ref = engine.generate(prompt, SamplingParams(max_tokens=48, loops=8, ignore_eos=True))
    for knobs in (dict(mode="speculative"), dict(mode="speculative", draft_loops=1, draft_ahead=8),
                  dict(mode="tree_speculative", k_branches=4, draft_ahead=4)):
        res = engine.generate(prompt, SamplingParams(max_tokens=48, verify_loops=8, ignore_eos=True, **knobs))
        assert res.token_ids == ref.token_ids, knobs
        assert res.stats["mode"] == knobs["mode"] and res.stats["loops_used"] == 8
