"""Embeddings on the engine core (engine/embedding.py): each input prefilled in the continuous batch at the
request's loops, its final-normed states pooled (mean or last) and L2-normalized, equal to the PyTorch
model's own forward (model/: prelude, the loops, coda, final norm) pooled the same way; batched equal to one
by one, chunked, preempted, side by side with generation; no KV kept; bad requests refused naming the field.

Tolerances, derived:
- float64 models: the vector is handed out as float32, whose rounding of a component |v_i| <= 1 is at most
  2^-24 ~ 6e-8; the float64 arithmetic behind it (a few hundred operations per component at unit roundoff
  1.1e-16) adds ~1e-13. So 1e-7 (observed 1-3e-8).
- float32 models (the native executor, or PyTorch, against PyTorch's eager fp32 forward): both sides round
  every dot product at u = 6e-8; a state component (RMS 1 after each norm) carries ~sqrt(K) u ~ 7e-7 per
  layer (K = 128, the widest reduction), over at most ~20 layer applications (loops 8 x 2 core blocks,
  prelude, coda), and the final L2 normalization divides by sqrt(dim) = 8: ~2e-6. So 1e-5 (observed 3e-7).
- the shipped int4 model natively (int8 activations, docs/decode.md) against its PyTorch forward (fp32
  activations): one int8 rounding per activation group, relative 1/254 per element: the 2e-2 the int4
  kernels are checked to (observed 2-4e-3), and the vectors' cosine above 0.999.
"""

from __future__ import annotations

import pytest
import torch

from conftest import varied_model
from tinyloop.config import preset
from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.embedding import MAX_INPUTS, Pooler, plan_embedding, to_base64, truncate
from tinyloop.engine.serving import BatchEngine
from tinyloop.errors import ValidationError
from tinyloop.modelfile.loader import LoadedModel

CFG = preset("tiny").replace(vocab_size=512, eos_token_id=511, default_loops=3)
TOL64 = 1e-7
TOL32 = 1e-5
TOL_INT4 = 2e-2


@torch.inference_mode()
def reference(model, ids, loops, pooling="mean"):
    """The PyTorch model's forward at `loops` without its LM head: the states it reads, pooled, normalized."""
    ctx = model.context(len(ids))
    e = model.embed_prelude(torch.tensor([ids]), ctx)
    h = model.init_state(e, ctx.positions)
    for r in range(loops):
        h = model.core_loop(h, e, r, ctx)
    x = model.final_norm(model.run_coda(h, ctx))[0].double()
    v = x.mean(0) if pooling == "mean" else x[-1]
    return v / v.norm()


@pytest.fixture(scope="module")
def engine():
    return Engine(LoadedModel(varied_model(CFG, seed=0, dtype=torch.float64), None, {}, None))


def inputs(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in lengths]


def run(core, plans):
    """Queue embedding plans (and generation plans) on `core` together, step to the end: each one's events."""
    events = [[] for _ in plans]
    for i, plan in enumerate(plans):
        core.add(plan, lambda ev, i=i: ev is not None and events[i].append(ev))
    while core.has_work:
        core.step()
    return events


def vectors(events):
    return torch.stack([ev.embedding for ev in sorted(events, key=lambda e: e.index)])


@pytest.mark.parametrize("pooling", ["mean", "last"])
@pytest.mark.parametrize("loops", [1, 3, 7])
def test_equal_to_the_model_forward_pooled(engine, loops, pooling):
    xs = inputs(1, 5, 17, 40)
    r = engine.embed(xs, loops=loops, pooling=pooling)
    assert r.embeddings.shape == (4, CFG.dim) and r.embeddings.dtype == torch.float32
    assert r.prompt_tokens == [1, 5, 17, 40] and r.loops == loops and r.pooling == pooling
    for v, ids in zip(r.embeddings, xs):
        assert (v.double() - reference(engine.model, ids, loops, pooling)).abs().max() < TOL64
        assert abs(float(v.double().norm()) - 1) < 1e-6


def test_default_depth_and_pooling(engine):
    ids = inputs(9)[0]
    r = engine.embed(ids)
    assert r.loops == CFG.default_loops and r.pooling == "mean"
    assert (r.embeddings[0].double() - reference(engine.model, ids, CFG.default_loops)).abs().max() < TOL64


def test_batched_equals_one_by_one_and_chunked(engine):
    xs = inputs(3, 30, 12, 1, 25, seed=1)
    together = engine.embed(xs, loops=2).embeddings
    for i, ids in enumerate(xs):
        alone = engine.embed([ids], loops=2).embeddings[0]
        assert (together[i] - alone).abs().max() < TOL64
    # prompts split into chunks of at most 7 tokens across steps, several inputs in each step
    core = BatchEngine(engine, max_num_seqs=3, max_batched_tokens=7, page_size=4)
    plan = plan_embedding(xs, CFG, max_seq_len=CFG.max_seq_len, loops=2)
    chunked = vectors(run(core, [plan])[0])
    assert core.steps > 10
    assert (chunked - together).abs().max() < TOL64


def test_loops_changes_the_vector(engine):
    ids = inputs(20, seed=2)[0]
    vs = [engine.embed(ids, loops=k).embeddings[0] for k in (1, 2, 4, 8)]
    for a in range(len(vs)):
        for b in range(a + 1, len(vs)):
            assert float(vs[a] @ vs[b]) < 0.999, (a, b)
    for k, v in zip((1, 2, 4, 8), vs):
        assert (v.double() - reference(engine.model, ids, k)).abs().max() < TOL64


def test_dimensions_truncate_then_renormalize(engine):
    ids = inputs(6)[0]
    full = engine.embed(ids).embeddings[0]
    short = engine.embed(ids, dimensions=16).embeddings[0]
    assert short.shape == (16,) and abs(float(short.norm()) - 1) < 1e-6
    assert (short.double() - full[:16].double() / full[:16].double().norm()).abs().max() < TOL64
    assert torch.equal(truncate(full, None), full) and torch.equal(truncate(full, CFG.dim), full)


def test_side_by_side_with_generation_on_one_core(engine):
    """An embedding request and generation requests in the same steps: each answers as it would alone."""
    xs = inputs(14, 3, 22, seed=3)
    gen = [engine.plan(p, SamplingParams(max_tokens=12, loops=3, ignore_eos=True)) for p in inputs(5, 9, seed=4)]
    alone_tokens = [[t for ev in run(BatchEngine(engine), [p])[0] for t in ev.token_ids] for p in gen]
    alone_vectors = engine.embed(xs, loops=3).embeddings
    core = BatchEngine(engine, max_batched_tokens=16)
    plan = plan_embedding(xs, CFG, max_seq_len=CFG.max_seq_len, loops=3)
    events = run(core, [gen[0], plan, gen[1]])
    assert core.peak_running >= 3
    assert [t for ev in events[0] for t in ev.token_ids] == alone_tokens[0]
    assert [t for ev in events[2] for t in ev.token_ids] == alone_tokens[1]
    assert (vectors(events[1]) - alone_vectors).abs().max() < TOL64
    final = [ev for ev in events[1]]
    assert sorted(ev.index for ev in final) == [0, 1, 2]
    assert [ev.stats["prompt_tokens"] for ev in sorted(final, key=lambda e: e.index)] == [14, 3, 22]
    assert all(ev.token_ids == [] and ev.stats["completion_tokens"] == 0 for ev in final)


def test_no_kv_kept_and_no_logits(engine):
    core = BatchEngine(engine, page_size=4)
    heads = []
    model = engine.model
    real = model.logits
    model.logits = lambda x: heads.append(x.shape) or real(x)
    try:
        run(core, [plan_embedding(inputs(10, 33), CFG, max_seq_len=CFG.max_seq_len)])
    finally:
        del model.logits
    assert heads == []                                   # the LM head never ran
    assert not core.has_work and not core.sched.running and not core._outputs
    assert core.sched.pool.num_free == core.sched.pool.n_pages   # every page back (cached blocks stay reusable)


def test_survives_preemption(engine):
    """A generation request admitted first grows into the pool and preempts the embedding's sequence midway
    through its prompt: it is recomputed from its start, and its vector is still the reference's."""
    probe = BatchEngine(engine, page_size=4)
    core = BatchEngine(engine, page_size=4, max_batched_tokens=4, kv_pool_bytes=probe.page_bytes * 64)
    gen = engine.plan(inputs(4, seed=5)[0], SamplingParams(max_tokens=20, loops=2, ignore_eos=True))
    xs = inputs(40, seed=6)
    events = run(core, [gen, plan_embedding(xs, CFG, max_seq_len=CFG.max_seq_len, loops=2)])
    assert core.preemptions > 0
    assert sum(ev.stats["completion_tokens"] for ev in events[0] if ev.finish_reason) == 20
    assert (vectors(events[1])[0].double() - reference(engine.model, xs[0], 2)).abs().max() < TOL64


def test_pooler_resets_on_recompute_and_checks_order():
    p = Pooler("mean", 4)
    p.add(0, torch.ones(2, 3))
    p.add(0, torch.full((3, 3), 2.0))      # a recompute from position 0 (after a preemption)
    p.add(3, torch.full((1, 3), 2.0))
    assert torch.allclose(p.vector(), torch.full((3,), 3 ** -0.5))
    with pytest.raises(RuntimeError):
        p.add(2, torch.ones(1, 3))         # not where the last chunk ended
    with pytest.raises(RuntimeError):
        Pooler("last", 4).vector()         # nothing pooled yet


def test_base64_is_little_endian_float32():
    import base64
    import struct

    v = torch.tensor([1.0, -0.5, 0.1, 3e-8])
    raw = base64.b64decode(to_base64(v))
    assert raw == struct.pack("<4f", *v.tolist())


@pytest.mark.parametrize("kw, param", [
    ({"inputs": []}, "input"), ({"inputs": [[]]}, "input"), ({"inputs": [[1, 2], []]}, "input"),
    ({"inputs": [[1, 512]]}, "input"), ({"inputs": [[1, -1]]}, "input"), ({"inputs": [[1] * 257]}, "input"),
    ({"inputs": [[1]] * (MAX_INPUTS + 1)}, "input"),
    ({"loops": 0}, "loops"), ({"loops": 65}, "loops"), ({"loops": "auto"}, "loops"), ({"loops": True}, "loops"),
    ({"loops": 2.5}, "loops"), ({"pooling": "max"}, "pooling"), ({"pooling": 1}, "pooling"),
])
def test_bad_requests_name_the_field(engine, kw, param):
    args = {"inputs": [[1, 2, 3]], **kw}
    with pytest.raises(ValidationError) as err:
        plan_embedding(args.pop("inputs"), CFG, max_seq_len=CFG.max_seq_len, **args)
    assert err.value.param == param


@pytest.mark.parametrize("value, code", [
    ("", "invalid_value"), ([], "invalid_value"), (5, "invalid_type"), (None, "invalid_type"), ([1, "a"], "invalid_type"),
    ([[1], "a", 3], "invalid_type"), ([[1, 2.5]], "invalid_type"), ([True], "invalid_type")])
def test_engine_inputs_refused(tiny_engine, value, code):
    with pytest.raises(ValidationError) as err:
        tiny_engine.plan_embedding(value)
    assert err.value.param == "input"
    if value != "":
        assert err.value.code == code
    with pytest.raises(ValidationError) as err:
        tiny_engine.embed("x", dimensions=0)
    assert err.value.param == "dimensions"


def test_text_inputs_and_the_native_path(tiny_engine, tiny_model_path):
    """Strings are tokenized as the completions route tokenizes a prompt; the file's engine (the native
    executor where it builds) against the eager fp32 forward of the same file."""
    slow = Engine.load(tiny_model_path, fast=False)
    texts = ["The king said", "A longer input, to pool over more positions than three.", "x"]
    for loops in (1, 3, 8):
        r = tiny_engine.embed(texts, loops=loops)
        assert r.prompt_tokens == [len(tiny_engine.tokenizer.encode(t)) for t in texts]
        for v, t in zip(r.embeddings, texts):
            assert (v.double() - reference(slow.model, slow.tokenizer.encode(t), loops)).abs().max() < TOL32
    same = tiny_engine.embed([tiny_engine.tokenizer.encode(texts[0])], loops=3).embeddings[0]
    assert torch.equal(same, tiny_engine.embed(texts[0], loops=3).embeddings[0])


def test_the_shipped_model_natively(shipped_model_path):
    fast, slow = Engine.load(shipped_model_path), Engine.load(shipped_model_path, fast=False)
    texts = ["The king said", "Once upon a time, a little girl went to the forest to find her grandmother."]
    for loops in (1, 8):
        for pooling in ("mean", "last"):
            r = fast.embed(texts, loops=loops, pooling=pooling)
            for v, t in zip(r.embeddings, texts):
                want = reference(slow.model, slow.tokenizer.encode(t), loops, pooling)
                assert (v.double() - want).abs().max() < TOL_INT4
                assert float(v.double() @ want) > 0.999


def test_timeout_fails_only_a_request_that_has_not_started(engine):
    from tinyloop.errors import RequestTimeout

    core = BatchEngine(engine, max_num_seqs=1, max_batched_tokens=4, page_size=4)
    gen, queued = [], []
    core.add(engine.plan(inputs(4)[0], SamplingParams(max_tokens=30, ignore_eos=True)), gen.append)
    core.add(plan_embedding(inputs(8), CFG, max_seq_len=CFG.max_seq_len), queued.append, timeout_s=1e-9)
    core.step()
    assert isinstance(queued[0], RequestTimeout) and queued[-1] is None
    # a running one is not cut short when its deadline passes: its vectors come out whole
    xs = inputs(40, 9, seed=7)
    events = []
    req = core.add(plan_embedding(xs, CFG, max_seq_len=CFG.max_seq_len), events.append, timeout_s=1000)
    while req.admitted is None:
        core.step()
    req.deadline = 0.0
    while core.has_work:
        core.step()
    assert events[-1] is None and not any(isinstance(e, BaseException) for e in events)
    got = vectors([e for e in events if e is not None])
    for v, ids in zip(got, xs):
        assert (v.double() - reference(engine.model, ids, CFG.default_loops)).abs().max() < TOL64
