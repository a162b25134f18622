"""Speculation on the native executor against the PyTorch path and plain decoding: greedy chain and tree
rounds (stepwise rows, one call a round, the pipeline, the policy), sampled rounds under shared noise, and
crowded batches (tests/kernels/native_pair.py builds the models)."""

from __future__ import annotations

import pytest
import torch

kernels = pytest.importorskip("tinyloop.kernels.lib")
try:
    kernels.load("native")
except kernels.NativeBuildError as exc:  # no compiler here: the PyTorch path serves, nothing to compare
    pytest.skip(f"native library unavailable: {exc}", allow_module_level=True)

from native_pair import CONFIGS, attach_varied_exits, make_pair  # noqa: E402


@pytest.fixture(autouse=True)
def exact_activations(monkeypatch):
    """fp32 activations for int4 layers (exact to the dequantized weights), as in test_native.py."""
    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "0")


def _record_spec_rounds(model, note) -> list:
    """Wrap the native executor's `spec_round`: each call's note(args, kwargs, result) is appended to the list
    returned."""
    seen: list = []
    orig = model.executor.spec_round

    def spec_round(*a, **kw):
        res = orig(*a, **kw)
        seen.append(note(a, kw, res))
        return res
    model.executor.spec_round = spec_round
    return seen


def _ids(model, prompt, params, use_native, **kw):
    from conftest import core_ids
    ex = model.executor
    model.executor = ex if use_native else None
    try:
        stats = {}
        out = core_ids(model, prompt, params, stats, **kw)
        return out, stats
    finally:
        model.executor = ex


@pytest.mark.parametrize("mode,kw", [("speculative", {"draft_loops": 1, "draft_ahead": 4}),
                                     ("speculative", {"draft_loops": 2, "draft_ahead": 3}),
                                     ("tree_speculative", {"draft_loops": 1, "k_branches": 2})])
@pytest.mark.parametrize("name,with_exit", [("tiny", False), ("tiny", True), ("parcae-like", True)])
def test_speculation_native_equals_pytorch(mode, kw, name, with_exit):
    """Draft steps (capture, draft-exit read-outs, the exit's catch-up row) and verification, chain or
    tree-masked, run natively, stepwise and as whole rounds in one call (chain, pipeline, tree); greedy tokens and acceptance equal the PyTorch path's, and equal plain greedy decoding.
    parcae-like: the exit's own copy of C runs natively as in PyTorch (the coda's value embeddings, which the
    exit leaves out, only in verification)."""
    from tinyloop.engine import SamplingParams

    _, nat = make_pair(CONFIGS[name], "fp32")
    if with_exit:
        attach_varied_exits(nat, {1: 1, 2: 2})
    calls, rounds = [], []
    orig, orig_round = nat.executor.decode, nat.executor.spec_round
    nat.executor.decode = lambda kv, rows: (calls.append([(r.n, r.first_loop, r.capture) for r in rows]),
                                            orig(kv, rows))[1]
    nat.executor.spec_round = lambda *a, **kw: (rounds.append(a[5]), orig_round(*a, **kw))[1]
    orig_tree, trees, verified = nat.executor.tree_round, [], []

    def tree_round(*a, **kw):
        trees.append(a[5])
        res = orig_tree(*a, **kw)
        verified.append((a[5], res["verified"], len(res["path"])))   # (depth, nodes verified, path length)
        return res
    nat.executor.tree_round = tree_round
    prompt = [5, 17, 300, 42, 7, 9]
    params = SamplingParams(max_tokens=24, mode=mode, verify_loops=4, temperature=0, **kw)
    ref, st_t = _ids(nat, prompt, params, False, draft_vocab=None, adaptive=False)
    plain, _ = _ids(nat, prompt, SamplingParams(max_tokens=24, loops=4, temperature=0), True)
    assert ref == plain
    # the stepwise native rows (a pass per engine step), then whole rounds in one call (tl_spec_round)
    calls.clear()
    step, st_s = _ids(nat, prompt, params, True, draft_vocab=None, adaptive=False, native_round=False)
    assert step == ref and st_s["acceptance_rate"] == st_t["acceptance_rate"] and not rounds
    step_rows = [r for c in calls for r in c]
    whole, st_w = _ids(nat, prompt, params, True, draft_vocab=None, adaptive=False)
    chain = mode == "speculative" or kw.get("k_branches", 1) == 1
    assert whole == ref and st_w["acceptance_rate"] == st_t["acceptance_rate"]
    assert st_w["native_rounds"]
    # (the last round may draft fewer); a tree of K > 1 in one call too (tl_tree_round), its depth draft_ahead
    assert (rounds and max(rounds) == kw["draft_ahead"] and not trees) if chain else \
        (not rounds and trees and max(trees) == params.effective_draft_ahead())
    # a tree round verifies lazily: the greedy chain (depth + 1 nodes), and a chain below a sibling only where
    # the walk takes one; both happen here, and the output is still the verification of every node's
    assert chain or any(v == depth + 1 for depth, v, _ in verified)
    assert chain or any(v > depth + 1 for depth, v, _ in verified)
    # the policy's draft lengths change the speed only
    auto, st_a = _ids(nat, prompt, params, True, draft_vocab=None)
    assert auto == ref and "draft_ahead_chosen" in st_a
    assert chain or st_a["tree_rounds"] >= 1 and st_a["chain_rounds"] >= 1   # a tree request measures both shapes
    # depth-aligned passes (tl_spec_pipeline): the same tokens; its drafts may read verified coda entries,
    # so acceptance may differ from the chain's
    loops0 = nat.core_loop_tokens
    piped, st_p = _ids(nat, prompt, params, True, draft_vocab=None, adaptive=False, pipeline=True)
    assert piped == ref and 0 <= st_p["acceptance_rate"] <= 1
    assert nat.core_loop_tokens - loops0 >= 4 * 24   # every emitted token ran its 4 loops
    width = 1 if chain else kw["k_branches"]   # a tree's drafts and verification are tree-masked rows
    assert any(n == width and first == 0 and cap for n, first, cap in step_rows)       # draft steps
    assert any(n > 1 and first > 0 for n, first, _ in step_rows)                      # verification


@pytest.mark.parametrize("ahead", [1, 2, 4])
@pytest.mark.parametrize("with_exit", [False, True])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_long_pipeline_rounds_are_exact(monkeypatch, ahead, with_exit, batch):
    """A pipeline round runs on while its drafts are accepted, up to PIPELINE_RUN drafts in all, with at most
    `draft_ahead` in the passes at once (a draft waits to enter its loop 0 while that many are); positions
    through the coda wait for their head row until `batch` are due (or nothing else runs), then are checked
    in order; a draft's pick due then shares their head call where the draft reads the model's own head.
    Output equal to plain greedy decoding's, at every bound and batch, with and without a draft exit."""
    from tinyloop.engine import SamplingParams, native_rounds
    from tinyloop.engine.draft_policy import DraftPolicy

    monkeypatch.setattr(native_rounds.NativeRound, "head_rows", lambda self, chunk: batch)

    _, nat = make_pair(CONFIGS["tiny"], "fp32")
    if with_exit:
        attach_varied_exits(nat, {1: 1, 2: 2})
    runs = _record_spec_rounds(nat, lambda a, kw, res: (a[5], kw.get("ahead"), len(res["emitted"])))

    def longest(self, cap, pipeline_cap=None, run_cap=0):   # every round as long a pipeline as the request allows
        self._chose(pipeline_cap)
        return pipeline_cap
    monkeypatch.setattr(DraftPolicy, "choose", longest)
    prompt = [5, 17, 300, 42, 7, 9]
    plain, _ = _ids(nat, prompt, SamplingParams(max_tokens=40, loops=4, temperature=0), True)
    params = SamplingParams(max_tokens=40, mode="speculative", draft_loops=1, verify_loops=4, temperature=0,
                            draft_ahead=ahead)
    piped, st = _ids(nat, prompt, params, True, draft_vocab=None, pipeline=True)
    assert piped == plain
    assert runs and all(a == ahead for _, a, _ in runs)
    assert max(n for _, _, n in runs) > ahead + 1   # a round ran past `ahead` drafts (tiny's drafts often agree)
    assert st["native_rounds"] and 0 <= st["acceptance_rate"] <= 1


@pytest.mark.parametrize("draft_loops,with_exit", [(1, False), (2, True)])
def test_sampled_speculation_is_plain_sampling(draft_loops, with_exit):
    """Sampling by shared noise (engine/sampling.py): speculation's output under temperature > 0 is plain
    sampling's output for the seed, token for token: stepwise rows, whole rounds in one call (chain and
    pipeline, their draws in the library), the policy's draft lengths, and the PyTorch path; with top-p too.
    The plain sampled rows draw in the head call (tl_head's draws) and equal the PyTorch path's draws."""
    from tinyloop.engine import SamplingParams

    _, nat = make_pair(CONFIGS["tiny"], "fp32")
    if with_exit:
        attach_varied_exits(nat, {draft_loops: 3})
    rounds = []
    orig_round = nat.executor.spec_round
    nat.executor.spec_round = lambda *a, **kw: (rounds.append(kw.get("noise")), orig_round(*a, **kw))[1]
    prompt = [5, 17, 300, 42, 7, 9]
    for extra in ({}, {"top_p": 0.9}):
        plain_p = SamplingParams(max_tokens=24, loops=4, temperature=0.9, seed=11, **extra)
        spec_p = SamplingParams(max_tokens=24, mode="speculative", verify_loops=4, draft_loops=draft_loops,
                                draft_ahead=4, temperature=0.9, seed=11, **extra)
        plain, _ = _ids(nat, prompt, plain_p, True)
        assert plain == _ids(nat, prompt, plain_p, False)[0]
        assert plain != _ids(nat, prompt, plain_p.replace(seed=12), True)[0]
        torch_spec, st = _ids(nat, prompt, spec_p, False, draft_vocab=None, adaptive=False)
        assert torch_spec == plain and 0 < st["acceptance_rate"] < 1
        rounds.clear()
        for kw in (dict(adaptive=False, native_round=False), dict(adaptive=False), dict(adaptive=False, pipeline=True),
                   dict()):
            got, st = _ids(nat, prompt, spec_p, True, draft_vocab=None, **kw)
            assert got == plain, (extra, kw)
        # the sampled rounds ran in one call each, with their seed and top-p
        assert rounds and all(r is not None and r[0] == 11 and r[4] == extra.get("top_p", 1.0) for r in rounds)


def test_sampled_tree_speculation_is_plain_sampling():
    """A sampled tree request (K = 2) runs its tree rounds in one native call each (tl_tree_round with the
    round's draws: the verifier's token after a node at depth t drawn under the key of output index n0 + t),
    and its output is plain sampling's for the seed, with and without top-p, tree rounds only or chosen
    against chain rounds; more than one token is accepted in some round. Without the one-call rounds a
    sampled tree request drafts a chain (the stepwise tree walk is greedy only): the same output."""
    from tinyloop.engine import SamplingParams, round_shape

    _, nat = make_pair(CONFIGS["tiny"], "fp32")
    trees = []
    orig_tree = nat.executor.tree_round
    nat.executor.tree_round = lambda *a, **kw: (trees.append(kw.get("noise")), orig_tree(*a, **kw))[1]
    prompt = [5, 17, 300, 42, 7, 9]
    for extra in ({}, {"top_p": 0.9}):
        plain_p = SamplingParams(max_tokens=24, loops=4, temperature=0.8, seed=5, **extra)
        tree_p = SamplingParams(max_tokens=24, mode="tree_speculative", verify_loops=4, draft_loops=2,
                                draft_ahead=3, k_branches=2, temperature=0.8, seed=5, **extra)
        plain, _ = _ids(nat, prompt, plain_p, True)
        for kw in (dict(adaptive=False), dict(), dict(native_round=False)):
            trees.clear()
            # (tree and chain rates are the model's, across requests: the second request would otherwise start
            # from the first one's and, the chain timed faster, might try no tree round in its few rounds)
            round_shape._SHAPE_RATES.pop(nat, None)
            got, st = _ids(nat, prompt, tree_p, True, draft_vocab=None, **kw)
            assert got == plain, (extra, kw)
            if kw.get("native_round", True):
                assert trees and all(t is not None and t[0] == 5 and t[4] == extra.get("top_p", 1.0) for t in trees)
                assert st["acceptance_rate"] > 0
            else:
                assert not trees


@pytest.mark.parametrize("name", ["olmo-like", "olmo-embed"])
def test_speculation_on_post_norm_models_with_their_loop_starts_is_plain_decoding(name):
    """Retrofitted OLMo-2's pieces natively (post-norm blocks, q/k norms over all heads; loop 0 on e without
    the adapter, or the state from e): one-call chain rounds, depth-aligned pipeline rounds (each row at its
    own loop: only loop-0 rows skip the adapter) and tree rounds give plain greedy decoding's tokens."""
    from tinyloop.engine import SamplingParams

    _, nat = make_pair(CONFIGS[name], "fp32")
    prompt = [5, 17, 300, 42, 7, 9]
    plain, _ = _ids(nat, prompt, SamplingParams(max_tokens=16, loops=4, temperature=0), True)
    assert plain == _ids(nat, prompt, SamplingParams(max_tokens=16, loops=4, temperature=0), False)[0]
    spec = SamplingParams(max_tokens=16, mode="speculative", verify_loops=4, draft_loops=1, draft_ahead=3, temperature=0)
    for kw in (dict(adaptive=False, pipeline=False), dict(adaptive=False, pipeline=True)):
        assert _ids(nat, prompt, spec, True, draft_vocab=None, **kw)[0] == plain, kw
    tree = spec.replace(mode="tree_speculative", k_branches=2)
    assert _ids(nat, prompt, tree, True, draft_vocab=None, adaptive=False)[0] == plain


def test_greedy_and_sampled_requests_keep_their_round_costs_apart():
    """A greedy request's native rounds (their costs, their acceptance) do not become a sampled request's
    prior: a sampled round draws every row and its drafts agree less often, so each regime has its table."""
    from tinyloop.engine import SamplingParams
    from tinyloop.engine.draft_policy import round_costs

    _, nat = make_pair(CONFIGS["tiny"], "fp32")
    p = SamplingParams(max_tokens=16, mode="speculative", verify_loops=4, draft_loops=2, draft_ahead=3)
    greedy, sampled = (round_costs(nat, 2, 4, False, False, s) for s in (False, True))
    _ids(nat, [5, 17, 300, 42], p.replace(temperature=0), True, draft_vocab=None, pipeline=False)
    assert greedy.prior() is not None and greedy.verify_ms and sampled.prior() is None and not sampled.verify_ms
    _ids(nat, [5, 17, 300, 42], p.replace(temperature=0.9, seed=3), True, draft_vocab=None, pipeline=False)
    assert sampled.verify_ms


def test_sampled_speculation_in_a_crowded_batch_is_plain_sampling():
    """Six sampled speculative requests at once (past ALONE_UP_TO: their rounds become plain rows of the shared
    step, drawn in its one head call) beside plain sampled ones: each answer is its seed's plain answer."""
    from tinyloop.engine import Engine, SamplingParams
    from tinyloop.engine.serving import BatchEngine, run_to_completion
    from tinyloop.modelfile.loader import LoadedModel

    _, nat = make_pair(CONFIGS["tiny"], "fp32")
    engine = Engine(LoadedModel(nat, None, {}, None))
    items = []
    for i in range(8):
        knobs = dict(mode="speculative", verify_loops=4, draft_loops=1, draft_ahead=3) if i < 6 else dict(loops=4)
        items.append(([5 + i, 17, 300, 42], SamplingParams(max_tokens=16, temperature=0.8, seed=40 + i,
                                                            ignore_eos=True, **knobs)))
    events = run_to_completion(BatchEngine(engine), items)
    got = [[t for e in ev for t in e.token_ids] for ev in events]
    want = [engine.generate(ids, SamplingParams(max_tokens=16, temperature=0.8, seed=p.seed, loops=4,
                                                ignore_eos=True)).token_ids for ids, p in items]
    assert got == want
    assert any(ev[-1].stats.get("batched_rounds") for ev in events[:6])


def test_speculation_in_a_crowded_batch_decodes_plain_rows():
    """Past ALONE_UP_TO running sequences a greedy native round is a plain row of the shared step: the
    tokens stay plain greedy decoding's, and the stats say how many rounds went that way."""
    from tinyloop.engine import Engine, SamplingParams
    from tinyloop.engine.serving import BatchEngine, run_to_completion
    from tinyloop.engine.native_rounds import ALONE_UP_TO
    from tinyloop.modelfile.loader import LoadedModel

    _, nat = make_pair(CONFIGS["tiny"], "fp32")
    engine = Engine(LoadedModel(nat, None, {}, None), kv_format="fp16")
    prompts = [[5, 17, 300 + i, 42, 7] for i in range(ALONE_UP_TO + 3)]
    spec = SamplingParams(max_tokens=12, mode="speculative", verify_loops=4, draft_loops=1, draft_ahead=3,
                          temperature=0, ignore_eos=True)
    plain = SamplingParams(max_tokens=12, loops=4, temperature=0, ignore_eos=True)
    alone = [run_to_completion(BatchEngine(engine, max_num_seqs=1), [(p, plain)])[0] for p in prompts]
    together = run_to_completion(BatchEngine(engine, max_num_seqs=16), [(p, spec) for p in prompts])
    for a, t in zip(alone, together):
        assert [x for e in t for x in e.token_ids] == [x for e in a for x in e.token_ids]
    assert sum(t[-1].stats.get("batched_rounds", 0) for t in together) > 0


@pytest.mark.parametrize("value_embeds,with_exit", [((0, 2, 3), False), ((), False), ((0, 2), True),
                                                     ((0, 2, 3), True)])
def test_parcae_like_speculation_is_exact(value_embeds, with_exit):
    """Speculation on a Parcae-like model (native_pair.py: ReLU^2, the diagonal injection, prelude norm, C,
    q/k norms, the soft-cap), with value embeddings in the loop input (the rounds keep e that wide) or
    without, with a draft exit (a copy of C and the coda, the coda's value embeddings left out even where
    its block has them (0, 2, 3): model/draft_exit.py) or the coda
    drafting, is exact: greedy chain and tree speculation give plain greedy decoding's tokens, natively (stepwise
    passes, and one call a round: chain, pipeline, tree) and on the PyTorch path, and sampled speculation
    plain sampling's (the soft-capped logits drawn in the library)."""
    from tinyloop.engine import SamplingParams

    # (a small soft-cap, so that it bends these logits and the draws)
    _, nat = make_pair(CONFIGS["parcae-like"].replace(value_embeds=value_embeds, logit_softcap=3.0), "fp32")
    if with_exit:
        attach_varied_exits(nat, {1: 3})
    calls = []
    for name in ("spec_round", "tree_round"):
        orig = getattr(nat.executor, name)
        setattr(nat.executor, name, lambda *a, _o=orig, _n=name, **kw: (calls.append(_n), _o(*a, **kw))[1])
    prompt = [5, 17, 300, 42, 7, 9]
    plain, _ = _ids(nat, prompt, SamplingParams(max_tokens=20, loops=4, temperature=0), True)
    assert plain == _ids(nat, prompt, SamplingParams(max_tokens=20, loops=4, temperature=0), False)[0]
    for mode, kw, shapes in (("speculative", dict(draft_loops=1, draft_ahead=3),
                              (dict(native_round=False), {}, dict(pipeline=True))),
                             ("tree_speculative", dict(draft_loops=1, k_branches=2), (dict(native_round=False), {}))):
        params = SamplingParams(max_tokens=20, mode=mode, verify_loops=4, temperature=0, **kw)
        assert _ids(nat, prompt, params, False, draft_vocab=None, adaptive=False)[0] == plain, mode
        for shape in shapes:
            calls.clear()
            got, st = _ids(nat, prompt, params, True, draft_vocab=None, adaptive=False, **shape)
            assert got == plain, (mode, shape)
            whole = shape.get("native_round", True)
            assert st["native_rounds"] == whole and bool(calls) == whole, (mode, shape)
    plain_p = SamplingParams(max_tokens=20, loops=4, temperature=0.9, seed=11)
    sampled, _ = _ids(nat, prompt, plain_p, True)
    assert sampled == _ids(nat, prompt, plain_p, False)[0] and sampled != plain
    spec_p = SamplingParams(max_tokens=20, mode="speculative", verify_loops=4, draft_loops=1, draft_ahead=3,
                            temperature=0.9, seed=11)
    for shape in ({}, dict(pipeline=True)):
        assert _ids(nat, prompt, spec_p, True, draft_vocab=None, adaptive=False, **shape)[0] == sampled, shape


@pytest.mark.parametrize("head_rows", [1, 2, 3, 5])
def test_chain_rounds_verify_alike_at_any_head_chunk(monkeypatch, head_rows):
    """A chain round's lazy verification scores `head_rows` rows a head call up to the first disagreement
    (draft_policy.head_chunk picks it from the head's measured cost by rows); a head row is bitwise the same
    in any call, so every chunk gives plain greedy decoding's tokens, with rejections and full acceptances."""
    from tinyloop.engine import SamplingParams
    from tinyloop.engine.native_rounds import NativeRound

    _, nat = make_pair(CONFIGS["tiny"], "fp32")
    monkeypatch.setattr(NativeRound, "head_rows", lambda self, chunk: head_rows)
    prompt = [5, 17, 300, 42, 7, 9]
    plain, _ = _ids(nat, prompt, SamplingParams(max_tokens=40, loops=4, temperature=0), True)
    params = SamplingParams(max_tokens=40, mode="speculative", draft_loops=1, verify_loops=4, temperature=0,
                            draft_ahead=4)
    got, st = _ids(nat, prompt, params, True, draft_vocab=None, pipeline=False, adaptive=False)
    assert got == plain
    assert st["native_rounds"] and 0 < st["acceptance_rate"] < 1


@pytest.mark.parametrize("head_rows", [1, 3, 5])
def test_tree_rounds_verify_alike_at_any_head_chunk(monkeypatch, head_rows):
    """A native tree round scores each verified chain `head_rows` rows a head call as the walk reaches them;
    plain greedy decoding's tokens at every chunk."""
    from tinyloop.engine import SamplingParams
    from tinyloop.engine.native_rounds import NativeTreeRound

    _, nat = make_pair(CONFIGS["tiny"], "fp32")
    calls = []
    monkeypatch.setattr(NativeTreeRound, "head_rows", lambda self, chunk: calls.append(1) or head_rows)
    prompt = [5, 17, 300, 42, 7, 9]
    plain, _ = _ids(nat, prompt, SamplingParams(max_tokens=40, loops=4, temperature=0), True)
    params = SamplingParams(max_tokens=40, mode="tree_speculative", draft_loops=1, verify_loops=4, temperature=0,
                            draft_ahead=4, k_branches=2)
    got, st = _ids(nat, prompt, params, True, draft_vocab=None, adaptive=False)
    assert got == plain
    assert calls   # (the rounds ran natively, at this chunk)


def test_drafts_read_the_quantized_models_own_formats(monkeypatch):
    """The shipped int4 file's head is int8: a native draft head reads those codes' rows (the ranked tokens,
    then the request's own as they appear) instead of the 16-bit embedding rows; its draft exits (trained
    in float) are rounded to the blocks' int4 in groups of 32; greedy speculation stays plain decoding token
    for token, with the default policy and fixed drafts."""
    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "1")
    from tinyloop.engine import Engine, SamplingParams
    from tinyloop.engine.draft_head import DraftHead, _QuantRows
    from tinyloop.engine.serving import run_ids

    eng = Engine.load()
    if getattr(eng.model, "executor", None) is None:
        pytest.skip("the shipped model runs without the native executor here")
    from tinyloop.quant.linear import QuantLinear
    for ex in eng.model.draft_exits.values():
        lin = [m for b in ex.coda for m in b.modules() if isinstance(m, (torch.nn.Linear, QuantLinear))]
        assert lin and all(isinstance(m, QuantLinear) and (m.bits, m.group_size) == (4, 32) for m in lin)
    dh = DraftHead(eng.model, "auto", natively=True)   # (as a speculator on the native executor makes it)
    assert isinstance(dh.q, _QuantRows)
    src = eng.model.head_linear.native_weights()
    view = dh.native_rows().native_weights()
    assert torch.equal(view["qweight"], src["qweight"][dh.ids[: dh.n]])
    rows = set(dh.ids[: dh.n].tolist())
    tok = next(t for t in range(eng.model.cfg.vocab_size) if t not in rows)
    n = dh.n
    dh.add([tok, tok])   # (once)
    assert dh.n == n + 1
    assert dh.native_rows().native_weights()["qweight"][-1].equal(src["qweight"][tok])
    ids = eng.tokenizer.encode("ROMEO. But soft, what light through yonder window breaks? It is the east, and")
    plain = run_ids(eng, ids, SamplingParams(max_tokens=32, temperature=0, loops=8))
    for kw in ({}, {"draft_loops": 1, "draft_ahead": 4}):
        st = {}
        got = run_ids(eng, ids, SamplingParams(max_tokens=32, temperature=0, mode="speculative", **kw), stats=st)
        assert got == plain
        assert st["acceptance_rate"] > 0


@pytest.mark.parametrize("with_exit", [False, True])
def test_chain_rounds_back_to_back_in_one_call(with_exit):
    """A lone request runs up to CHAIN_ROUNDS chain rounds per native call at the policy's k (here fixed), each
    from where the last ended, a draft exit's backlog carried between them; the output is plain decoding's,
    greedy and sampled, and a stop id emitted mid-call ends the request there as plain decoding's does."""
    from tinyloop.engine import SamplingParams

    _, nat = make_pair(CONFIGS["tiny"], "fp32")
    if with_exit:
        attach_varied_exits(nat, {1: 1, 2: 2})
    calls = _record_spec_rounds(nat, lambda a, kw, res: (kw.get("rounds", 1), len(res.get("outs", [None]))))
    prompt = [5, 17, 300, 42, 7, 9]
    plain, _ = _ids(nat, prompt, SamplingParams(max_tokens=48, loops=4, temperature=0), True)
    spec = dict(mode="speculative", draft_loops=1, verify_loops=4, draft_ahead=3)
    got, st = _ids(nat, prompt, SamplingParams(max_tokens=48, temperature=0, **spec), True, draft_vocab=None,
                   adaptive=False)
    assert got == plain
    assert any(r > 1 and n > 1 for r, n in calls)   # several rounds ran in one call
    stop = plain[20]
    cut = plain[:plain.index(stop) + 1]
    want, _ = _ids(nat, prompt, SamplingParams(max_tokens=48, loops=4, temperature=0, stop_token_ids=[stop]), True)
    got, _ = _ids(nat, prompt, SamplingParams(max_tokens=48, temperature=0, stop_token_ids=[stop], **spec), True,
                  draft_vocab=None, adaptive=False)
    assert got == want and want in (cut, cut[:-1])
    sampled = dict(temperature=0.8, seed=7, max_tokens=40)
    want, _ = _ids(nat, prompt, SamplingParams(loops=4, **sampled), True)
    got, _ = _ids(nat, prompt, SamplingParams(**sampled, **spec), True, draft_vocab=None, adaptive=False)
    assert got == want


def test_warm_up_pays_the_one_time_costs_and_leaves_nothing():
    """`BatchEngine.warm_up` (the server runs it at load) runs a plain and speculative requests through the core:
    afterwards the native head's cost table and the draft policy's round costs exist, while the core holds no
    request, no prefix-cache block and its step counters at zero; a request then decodes as on a fresh core. A
    model streamed from memory is not warmed up."""
    from tinyloop.engine import Engine, SamplingParams
    from tinyloop.engine.draft_policy import _ROUND_COSTS
    from tinyloop.engine.serving import BatchEngine, run_to_completion

    eng = Engine.load()
    if getattr(eng.model, "executor", None) is None:
        pytest.skip("the shipped model runs without the native executor here")
    ids = eng.tokenizer.encode("The king said to his people that")
    params = SamplingParams(max_tokens=24, temperature=0, mode="speculative")
    fresh = run_to_completion(BatchEngine(eng, max_num_seqs=4), [(ids, params)])[0]
    core = BatchEngine(eng, max_num_seqs=4, prefix_caching=True)
    core.warm_up()
    assert not core.requests and core.steps == 0 and core.peak_running == 0 and len(core.sched.prefix) == 0
    assert eng.model.executor._head_costs and any(c.draft_ms is not None for c in _ROUND_COSTS[eng.model].values())
    got = run_to_completion(core, [(ids, params)])[0]
    assert [t for e in got for t in e.token_ids] == [t for e in fresh for t in e.token_ids]
    from tinyloop.engine import serving   # a model streamed from memory: no warm-up (its tokens would take seconds)
    ex = eng.model.executor
    was, ex.streamed = ex.streamed, True
    try:
        serving.run_to_completion, real = (lambda *a, **k: pytest.fail("warmed up a streamed model")), run_to_completion
        BatchEngine(eng, max_num_seqs=4).warm_up()
    finally:
        ex.streamed, serving.run_to_completion = was, real
