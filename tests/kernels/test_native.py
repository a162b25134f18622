"""The native executor (`kernels/`) against the PyTorch forward (`model/`), configuration by configuration.

Each case builds one model twice with the same effective weights: the reference runs every row in PyTorch
with fp32 weights (quantized codes dequantized, 16-bit weights rounded); the native one holds the weights in
the format under test and runs its one-token rows through the library. Both start from the same KV pool (a
prompt prefilled in PyTorch), take one decode step for several sequences at once (different loops,
windows, positions), and must agree on the logits (1e-4) and on what they wrote into the pool.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

from conftest import varied_model
from tinyloop.config import preset

kernels = pytest.importorskip("tinyloop.kernels.lib")
try:
    kernels.load("native")
    kernels.load("portable")
    kernels.load("avx2")
except kernels.NativeBuildError as exc:  # no compiler here: the PyTorch path serves, nothing to compare
    pytest.skip(f"native library unavailable: {exc}", allow_module_level=True)

from tinyloop.kernels.executor import NativeExecutor  # noqa: E402
from tinyloop.model.paged import PagedKV, PagedStep, Rows  # noqa: E402
from tinyloop.quant.linear import QuantLinear  # noqa: E402
from tinyloop.quant.packing import pack, quantize_rtn  # noqa: E402

BASE = preset("tiny").replace(vocab_size=512, eos_token_id=511, max_seq_len=128)
CONFIGS = {
    "tiny": BASE,                                                       # GQA, swiglu, add, prelude/coda
    "gelu-none": BASE.replace(mlp="gelu", injection="none", loop_norm=False, n_kv_heads=4),
    "ouro-like": BASE.replace(n_prelude=0, n_coda=0, injection="none", norm_placement="sandwich",
                              loop_norm=True, head_norm=False, tie_embeddings=False, exit_gate=True),
    "huginn-like": BASE.replace(norm_placement="sandwich-residual", qk_bias=True, embed_scale=math.sqrt(BASE.dim),
                                injection="concat-adapter", loop_norm=False, post_loop_norm=True),
    # GQA 6:1 with heads wider than dim / n_heads (q and the attention output 192 wide on a 64 hidden)
    "nanbeige-like": BASE.replace(n_heads=12, n_kv_heads=2, head_dim=16, n_prelude=0, n_coda=0, injection="none",
                                  loop_norm=True, head_norm=False, tie_embeddings=False),
}
PAGE = 4


def _linears(model):
    for mod in model.modules():
        for name, child in list(mod.named_children()):
            if type(child) is nn.Linear and name != "lm_head":
                yield mod, name, child


def make_pair(cfg, weights: str):
    """(reference fp32 model, native model) with the same effective weights."""
    ref = varied_model(cfg, seed=1)
    if cfg.qk_bias:
        with torch.no_grad():
            for blk in [*ref.prelude, *ref.core, *ref.coda]:
                blk.attn.qk_bias.normal_(0, 1, generator=torch.Generator().manual_seed(5))
    nat = copy.deepcopy(ref)
    if weights in ("fp16", "bf16"):
        dt = torch.float16 if weights == "fp16" else torch.bfloat16
        for (_, _, r), (_, _, n) in zip(_linears(ref), _linears(nat)):
            w = r.weight.detach().to(dt)
            r.weight.data = w.float()
            n.weight = nn.Parameter(w, requires_grad=False)
    elif weights.startswith("int"):
        bits = int(weights[3:])
        for (rm, rn, r), (nm, nn_, n) in zip(_linears(ref), _linears(nat)):
            q, s, z = quantize_rtn(r.weight.detach(), bits, None if bits == 8 else 32)
            qw = pack(q, bits)
            setattr(rm, rn, QuantLinear.from_portable(qw, s, z, bits, kernel="dense"))
            setattr(nm, nn_, QuantLinear.from_portable(qw, s, z, bits, kernel="native"))
    nat.executor = NativeExecutor(nat, threads=2)
    return ref.eval(), nat.eval()


def clone_kv(kv: PagedKV) -> PagedKV:
    out = copy.copy(kv)
    out.k, out.v = copy.copy(kv.k), copy.copy(kv.v)
    for t in (out.k, out.v):
        t.parts = tuple(p.clone() for p in t.parts)
        if t.bits is None:
            t.data = t.parts[0]
        else:
            t.codes, t.scale, t.offset = t.parts
    return out


SEQS = [  # (prompt length, loops, window): rows of one step, different depths, positions and windows
    (9, 3, 0), (5, 1, 0), (14, 2, 6), (3, 3, 0),
]


@torch.inference_mode()
def one_step(ref, nat, kv_format="fp16", kv_dtype=torch.float32, seqs=SEQS, rule=None, out=None):
    cfg = ref.cfg
    slots = cfg.n_prelude + cfg.n_coda + cfg.n_core * max(s[1] for s in seqs)
    blocks = max(-(-(n + 1) // PAGE) for n, _, _ in seqs)
    kv = PagedKV(cfg, len(seqs) * blocks * slots, PAGE, kv_format, kv_dtype)
    g = torch.Generator().manual_seed(7)
    tables, toks = [], []
    for i, (n, loops, window) in enumerate(seqs):
        table = torch.randperm(blocks * slots, generator=g).view(blocks, slots) + i * blocks * slots
        prompt = torch.randint(0, cfg.vocab_size, (n + 1,), generator=g).tolist()
        ref.run(PagedStep(kv, [Rows(table=table, start=0, n=n, last_loop=loops, tokens=prompt[:n], window=window)],
                          ref.rotary, torch.float32, "cpu"))
        tables.append(table)
        toks.append(prompt[n])
    kv_nat = clone_kv(kv)

    def rows():
        return [Rows(table=t, start=n, n=1, last_loop=loops, tokens=[tok], window=w,
                     exit_rule=None if rule is None else rule(loops))
                for t, tok, (n, loops, w) in zip(tables, toks, seqs)]

    r_ref, r_nat = rows(), rows()
    ref.run(PagedStep(kv, r_ref, ref.rotary, torch.float32, "cpu"))
    nat.run(PagedStep(kv_nat, r_nat, nat.rotary, torch.float32, "cpu"))
    if out is not None:
        out.extend([(a.last_loop, b.last_loop, a.exit_survival, b.exit_survival) for a, b in zip(r_ref, r_nat)])
    lr = ref.logits(torch.cat([r.hidden for r in r_ref])[None])[0]
    ln = ref.logits(torch.cat([r.hidden.float() for r in r_nat])[None])[0]
    return lr, ln, kv, kv_nat


def check(lr, ln, kv, kv_nat, tol=1e-4):
    err = (lr - ln).abs().max().item()
    assert err <= tol, f"logits differ by {err:.3g}"
    for a, b in ((kv.k, kv_nat.k), (kv.v, kv_nat.v)):
        ra, rb = a.read(slice(None), torch.float32), b.read(slice(None), torch.float32)
        scale = ra.abs().max().item()
        # Before rounding into the pool the two paths' values differ by fp32 reordering (~1e-6 here; 1e-4 of
        # the largest value allowed). 16-bit and quantized pools then round each value; one that sits on a
        # rounding boundary may round the other way, by one step of the format at that entry: |v| 2^-10
        # (fp16), |v| 2^-7 (bf16), or the row's code step (int8/int4: its scale; int4-h's rotation back
        # spreads a step over the row, each entry by less). Every entry lies within that.
        step = _pool_step(a, ra).maximum(_pool_step(b, rb))
        over = (ra - rb).abs() - step - 1e-4 * max(1.0, scale)
        assert over.max().item() <= 0, f"{(over > 0).float().mean().item():.3%} of pool entries beyond a rounding step"


def _pool_step(t, values: torch.Tensor) -> torch.Tensor:
    """One rounding step of pool t's format at each entry (values: t read as fp32)."""
    if t.bits is not None:
        return t.scale.float().expand(values.shape)
    eps = {torch.float32: 0.0, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[t.dtype]
    return values.abs() * eps + (2.0 ** -24 if t.dtype == torch.float16 else 0.0)


@pytest.fixture(autouse=True)
def exact_activations(monkeypatch):
    """fp32 activations for int4 layers (exact to the dequantized weights); test_int8_activations covers
    the int8 ones."""
    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "0")


@pytest.fixture(params=["dot", "panel"])
def matmul_path(request):
    """Both multi-row matmul paths: the dot-product tiles, and the outer-product panels (which take 6 or 12 rows
    and more by default; here every call, so that a step's few rows and the head exercise them)."""
    lib = kernels.load()
    old = lib.tl_set_panel_min_rows(1 if request.param == "panel" else 1 << 30)
    yield request.param
    lib.tl_set_panel_min_rows(old)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("weights", ["fp32", "fp16", "bf16", "int8", "int4", "int2"])
def test_native_step_equals_pytorch(name, weights, matmul_path):
    ref, nat = make_pair(CONFIGS[name], weights)
    check(*one_step(ref, nat))


def test_int8_activations(monkeypatch):
    """int4 weights against activations quantized to int8 per 32 values (the integer dot products): one
    layer is within the 2e-2 the PyTorch int4 kernels (bf16 activations) are checked to; a whole step of
    the chaotic random model (weights 8x GPT-2's scale) amplifies it, and stays within 5e-2 of the logits."""
    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "1")
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    q, sc, z = quantize_rtn(w, 4, 32)
    lin = QuantLinear.from_portable(pack(q, 4), sc, z, 4, kernel="native")
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    ref = x @ (QuantLinear.from_portable(pack(q, 4), sc, z, 4, kernel="dense").w.t())
    got = lin(x)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert 0 < err < 2e-2, err
    ref_m, nat = make_pair(CONFIGS["huginn-like"], "int4")
    assert any(d.act_q8 for b in nat.executor.blocks for d in (b.wo, b.down))
    lr, ln, _, _ = one_step(ref_m, nat)
    err = (lr - ln).abs().max().item() / lr.abs().max().item()
    assert 0 < err < 5e-2, err


@torch.inference_mode()
def prefill_pair(ref, nat, kv_format="fp16", kv_dtype=torch.float32, seqs=SEQS, split=0):
    """Prefill every sequence of `seqs` in one step (after a first chunk of `split` tokens each, in a step
    of its own, when split > 0), in PyTorch and natively: logits of every position, and both pools."""
    cfg = ref.cfg
    slots = cfg.n_prelude + cfg.n_coda + cfg.n_core * max(s[1] for s in seqs)
    blocks = max(-(-(n + 1) // PAGE) for n, _, _ in seqs)
    kv = PagedKV(cfg, len(seqs) * blocks * slots, PAGE, kv_format, kv_dtype)
    kv_nat = clone_kv(kv)
    g = torch.Generator().manual_seed(7)
    tables = [torch.randperm(blocks * slots, generator=g).view(blocks, slots) + i * blocks * slots
              for i in range(len(seqs))]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n, _, _ in seqs]
    outs = []
    for model, pool in ((ref, kv), (nat, kv_nat)):
        hidden = []
        for a, b in ((0, split), (split, None)) if split else ((0, None),):
            rows = [Rows(table=t, start=a, n=len(p[a:b]), last_loop=loops, tokens=p[a:b], window=w)
                    for t, p, (_, loops, w) in zip(tables, prompts, seqs) if p[a:b]]
            assert model is ref or all(nat.executor.supports(r) for r in rows)
            model.run(PagedStep(pool, rows, model.rotary, torch.float32, "cpu"))
            hidden += [r.hidden.float() for r in rows]
        outs.append(ref.logits(torch.cat(hidden)[None])[0])
    return outs[0], outs[1], kv, kv_nat


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("weights", ["fp32", "bf16", "int4"])
def test_native_prefill_equals_pytorch(name, weights):
    """A prefill chunk runs natively, each position a row of the call: its logits and keys are the PyTorch
    forward's, whole or after a first chunk (the second continuing at its start)."""
    ref, nat = make_pair(CONFIGS[name], weights)
    check(*prefill_pair(ref, nat))
    check(*prefill_pair(ref, nat, split=4))


@pytest.mark.parametrize("kv_format,kv_dtype", [("fp16", torch.float16), ("int8", torch.float32),
                                                ("int4-h", torch.float32)])
def test_native_prefill_every_kv_format(kv_format, kv_dtype):
    """Lossy pools: both paths attend to the keys as stored, and a key that sits on a rounding boundary
    may round the other way (~1e-6 apart before rounding); over a prompt's positions and loops of this
    chaotic random model that moves the logits by up to a few 1e-3."""
    ref, nat = make_pair(CONFIGS["tiny"], "fp32")
    check(*prefill_pair(ref, nat, kv_format, kv_dtype), tol=1e-2)


@pytest.mark.parametrize("kv_format,kv_dtype", [("fp16", torch.float16), ("fp16", torch.bfloat16),
                                                ("int8", torch.float32), ("int4", torch.float32),
                                                ("int4-h", torch.float32)])
@pytest.mark.parametrize("name", ["tiny", "huginn-like"])
def test_native_step_every_kv_format(name, kv_format, kv_dtype):
    ref, nat = make_pair(CONFIGS[name], "fp32")
    check(*one_step(ref, nat, kv_format, kv_dtype))


def test_portable_build_equals_pytorch(monkeypatch):
    """The scalar fallback (no SIMD) computes the same step."""
    monkeypatch.setenv("TINYLOOP_NATIVE_ISA", "portable")
    ref, nat = make_pair(CONFIGS["huginn-like"], "int4")
    assert "portable" in nat.executor.name
    check(*one_step(ref, nat, "int4-h"))


def test_one_thread_equals_two():
    ref, nat = make_pair(CONFIGS["tiny"], "int4")
    _, l2, _, kv2 = one_step(ref, nat)
    nat.executor.threads = 1
    _, l1, _, kv1 = one_step(ref, nat)
    assert torch.equal(l1, l2)


def test_unsupported_rows_run_in_pytorch():
    """Rows the executor does not take (a multi-token chunk, a state continuation) run in PyTorch in the same
    step, next to native rows."""
    ref, nat = make_pair(CONFIGS["tiny"], "fp32")
    calls = []
    orig = nat.executor.decode
    nat.executor.decode = lambda kv, rows: (calls.append(len(rows)), orig(kv, rows))
    lr, ln, kv, kv_nat = one_step(ref, nat, seqs=[(9, 3, 0), (5, 2, 0)])
    check(lr, ln, kv, kv_nat)
    assert calls[-1] == 2


@pytest.mark.parametrize("criterion,thresholds", [("latent", [0.05, 0.4, 0.8, 1.5]), ("gate", [0.2, 0.5, 0.9])])
def test_adaptive_exits_run_natively(criterion, thresholds):
    """loops "auto": each row's criterion is checked inside the call; an exit copies its last loop's keys into
    the skipped slots. Same loops, survival, logits and pool as PyTorch, and some rows do exit early."""
    from tinyloop.model.exits import ExitRule

    ref, nat = make_pair(CONFIGS["ouro-like"], "fp32")
    if criterion == "gate":
        with torch.no_grad():   # a gate that fires: a bias around zero, weights of a useful scale
            for m in (ref, nat):
                m.exit_gate.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
                m.exit_gate.bias.fill_(-0.5)
    seqs = [(9, 6, 0), (5, 6, 0), (14, 5, 6), (3, 6, 0), (7, 4, 0)]
    runs = []
    for th in thresholds:
        got = []
        check(*one_step(ref, nat, seqs=seqs, rule=lambda loops: ExitRule(criterion, th, 2, loops), out=got))
        for lr, ln, sr, sn in got:
            assert lr == ln and abs(sr - sn) < 1e-6
        runs += [lr < s[1] for (lr, _, _, _), s in zip(got, seqs)]
    assert any(runs) and not all(runs)


@pytest.mark.parametrize("kv_format,kv_dtype", [("fp16", torch.float32), ("int8", torch.float32)])
@pytest.mark.parametrize("name", ["tiny", "ouro-like"])
@torch.inference_mode()
def test_native_tree_rows_equal_pytorch(name, kv_format, kv_dtype):
    """Tree-masked rows (a tree round's passes: engine/tree.py) run natively: node i's keys at storage index
    L + i, its RoPE at position L + depth, attending to the committed keys (within the window) and its
    ancestors. A pass from tokens (loops 0..1, states kept), then its continuation from those states
    (loops 2..3, the coda), next to an ordinary decode row of another sequence, in one step each; hidden
    states and both pools equal the PyTorch path's (check's tolerance)."""
    from tinyloop.engine.tree import ancestor_mask

    ref, nat = make_pair(CONFIGS[name], "fp32")
    cfg = ref.cfg
    parents = [-1, 0, 0, 1, 2, 3, 3]   # a root, two branches, a fork at depth 2
    depths = [0, 1, 1, 2, 2, 3, 3]
    seqs = [(10, 0), (12, 5)]          # (committed length, window): the tree's sequence, then a plain row's
    slots = cfg.n_prelude + cfg.n_coda + cfg.n_core * 4
    blocks = -(-(max(n for n, _ in seqs) + len(parents)) // PAGE)
    g = torch.Generator().manual_seed(3)
    for window in (0, 3):   # the tree under a window too: keys at real positions 3 or more back are out
        kv = PagedKV(cfg, len(seqs) * blocks * slots, PAGE, kv_format, kv_dtype)
        tables = [torch.randperm(blocks * slots, generator=g).view(blocks, slots) + i * blocks * slots
                  for i in range(len(seqs))]
        prompts = [torch.randint(0, cfg.vocab_size, (n + 1,), generator=g).tolist() for n, _ in seqs]
        for t, p, (n, w) in zip(tables, prompts, seqs):
            ref.run(PagedStep(kv, [Rows(table=t, start=0, n=n, last_loop=4, tokens=p[:n], window=w)],
                              ref.rotary, torch.float32, "cpu"))
        kv_nat = clone_kv(kv)
        L = seqs[0][0]
        nodes = torch.randint(0, cfg.vocab_size, (len(parents),), generator=g).tolist()
        pos = torch.tensor([L + d for d in depths])
        tree = dict(positions=pos, tree_mask=ancestor_mask(parents), tree_key_positions=pos, window=window)
        hidden = []
        for model, pool in ((ref, kv), (nat, kv_nat)):
            a = Rows(table=tables[0], start=L, n=len(nodes), last_loop=2, tokens=nodes, capture=True,
                     readout=None, **tree)
            plain = Rows(table=tables[1], start=seqs[1][0], n=1, last_loop=4, tokens=[prompts[1][-1]],
                         window=seqs[1][1])
            assert model is ref or all(nat.executor.supports(r) for r in (a, plain))
            model.run(PagedStep(pool, [a, plain], model.rotary, torch.float32, "cpu"))
            b = Rows(table=tables[0], start=L, n=len(nodes), last_loop=4, first_loop=2,
                     state=tuple(x.float() for x in a.out_state), **tree)
            assert model is ref or nat.executor.supports(b)
            model.run(PagedStep(pool, [b], model.rotary, torch.float32, "cpu"))
            hidden.append(torch.cat([b.hidden.float(), plain.hidden.float()]))
        # an int8 pool: the continuation reads keys the first pass rounded, and one on a rounding boundary
        # may have rounded the other way (test_native_prefill_every_kv_format's argument and tolerance)
        check(ref.logits(hidden[0][None])[0], ref.logits(hidden[1][None])[0], kv, kv_nat,
              tol=1e-4 if kv_format == "fp16" else 1e-2)


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
@pytest.mark.parametrize("with_exit", [False, True])
def test_speculation_native_equals_pytorch(mode, kw, with_exit):
    """Draft steps (capture, draft-exit read-outs, the exit's catch-up row) and verification, chain or
    tree-masked, run natively, stepwise and as whole rounds in one call (chain, pipeline, tree); greedy tokens and acceptance equal the PyTorch path's, and equal plain greedy decoding."""
    from tinyloop.engine import SamplingParams
    from tinyloop.model.draft_exit import DraftExit, attach_draft_exits

    _, nat = make_pair(CONFIGS["tiny"], "fp32")
    if with_exit:
        exits = {}
        for d in (1, 2):
            ex = DraftExit.from_model(nat)
            with torch.no_grad():
                g = torch.Generator().manual_seed(d)
                for p in ex.parameters():
                    p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=g))
            exits[d] = ex.eval()
        attach_draft_exits(nat, exits)
    calls, rounds = [], []
    orig, orig_round = nat.executor.decode, nat.executor.spec_round
    nat.executor.decode = lambda kv, rows: (calls.append([(r.n, r.first_loop, r.capture) for r in rows]),
                                            orig(kv, rows))[1]
    nat.executor.spec_round = lambda *a, **kw: (rounds.append(a[5]), orig_round(*a, **kw))[1]
    orig_tree, trees = nat.executor.tree_round, []
    nat.executor.tree_round = lambda *a, **kw: (trees.append(a[5]), orig_tree(*a, **kw))[1]
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
        (not rounds and trees and max(trees) == params.draft_ahead)
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


@pytest.mark.parametrize("draft_loops,with_exit", [(1, False), (2, True)])
def test_sampled_speculation_is_plain_sampling(draft_loops, with_exit):
    """Sampling by shared noise (engine/sampling.py): speculation's output under temperature > 0 is plain
    sampling's output for the seed, token for token: stepwise rows, whole rounds in one call (chain and
    pipeline, their draws in the library), the policy's draft lengths, and the PyTorch path; with top-p too.
    The plain sampled rows draw in the head call (tl_head's draws) and equal the PyTorch path's draws."""
    from tinyloop.engine import SamplingParams
    from tinyloop.model.draft_exit import DraftExit, attach_draft_exits

    _, nat = make_pair(CONFIGS["tiny"], "fp32")
    if with_exit:
        ex = DraftExit.from_model(nat)
        with torch.no_grad():
            g = torch.Generator().manual_seed(3)
            for p in ex.parameters():
                p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=g))
        attach_draft_exits(nat, {draft_loops: ex.eval()})
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


def test_sampled_speculation_in_a_crowded_batch_is_plain_sampling():
    """Six sampled speculative requests at once (past ALONE_UP_TO: their rounds become plain rows of the shared
    step, drawn in its one head call) beside plain sampled ones: each answer is its seed's plain answer."""
    from tinyloop.engine import Engine, SamplingParams
    from tinyloop.engine.serving import BatchEngine, run_to_completion
    from tinyloop.modelfile import LoadedModel

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


def test_engine_cores_of_several_threads_share_the_executor(tiny_model_path):
    """Engine.generate from several threads at once (a core each) through one executor: each output equals
    the same request run alone."""
    import threading

    from tinyloop.engine import Engine, SamplingParams

    e = Engine.load(tiny_model_path, executor="native")
    e.model.executor.threads = 2
    prompts = ["The king said", "A quick brown fox", "Once upon a time", "In the beginning"]
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [e.generate(t, p).text for t in prompts]
    got = [None] * len(prompts)

    def run(i):
        got[i] = e.generate(prompts[i], p).text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone


def _with_head(model, w: torch.Tensor):
    """`model` with its LM head's weight (the embedding when tied) replaced by `w`."""
    target = model.embed if model.cfg.tie_embeddings else model.lm_head
    target.weight = nn.Parameter(w, requires_grad=False)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["tiny", "ouro-like"])
@torch.inference_mode()
def test_native_head_and_greedy_tokens(name, dtype, matmul_path):
    """The final norm and LM head natively (`logits`, and the argmax fused into it: `greedy_tokens`) against
    PyTorch with the same weights in fp32, several rows at once, the head read in its own dtype."""
    ref = varied_model(CONFIGS[name], seed=3).eval()
    w = ref.head_weight.detach().to(dtype)
    _with_head(ref, w.float().clone())
    nat = _with_head(copy.deepcopy(ref), w.clone())
    nat.executor = NativeExecutor(nat, threads=2)
    x = torch.randn(5, ref.cfg.dim, generator=torch.Generator().manual_seed(2)) * 3
    lr, ln = ref.logits(x), nat.logits(x)
    assert ln.shape == lr.shape and (lr - ln).abs().max().item() <= 1e-4
    assert nat.greedy_tokens(x) == ref.greedy_tokens(x) == lr[:, :ref.cfg.vocab_size].argmax(-1).tolist()


@torch.inference_mode()
def test_native_argmax_ties_and_nan_follow_torch():
    """Equal maxima: the first index wins; a NaN logit is the argmax (torch.argmax's rules)."""
    cfg = CONFIGS["tiny"]
    model = varied_model(cfg, seed=3).eval()
    x = torch.randn(1, cfg.dim, generator=torch.Generator().manual_seed(4))
    w = torch.zeros(cfg.vocab_size, cfg.dim)
    w[300] = w[17] = model.final_norm(x)[0]          # two equal best rows
    _with_head(model, w)
    model.executor = NativeExecutor(model, threads=2)
    assert model.greedy_tokens(x) == [17] == [int(torch.argmax(model.logits(x)[0]))]
    w2 = w.clone()
    w2[400] = float("nan")
    _with_head(model, w2)
    model.executor = NativeExecutor(model, threads=2)
    assert model.greedy_tokens(x) == [400] == [int(torch.argmax(model.logits(x)[0]))]


@pytest.mark.parametrize("bits", [8, 4])
@torch.inference_mode()
def test_native_quantized_head(bits, matmul_path):
    """A quantized LM head (`tinyloop quantize --head-bits`) runs natively: logits equal the dequantized
    head's in fp32 (fp32 activations here), and greedy tokens are their argmax."""
    from tinyloop.quant.formats import quantize_head

    ref = varied_model(CONFIGS["tiny"], seed=3).eval()
    tensors, entry = quantize_head(ref, bits, 32)
    parts = [tensors[f"head.{s}"] for s in ("qweight", "scales", "zeros")]
    nat = copy.deepcopy(ref)
    ref.head_linear = QuantLinear.from_portable(*parts, bits, kernel="dense")
    nat.head_linear = QuantLinear.from_portable(*parts, bits, kernel="native")
    nat.executor = NativeExecutor(nat, threads=2)
    assert nat.executor.head.kind == {8: kernels.TL_Q8, 4: kernels.TL_Q4}[bits]
    x = torch.randn(4, ref.cfg.dim, generator=torch.Generator().manual_seed(2)) * 3
    lr, ln = ref.logits(x), nat.logits(x)
    assert (lr - ln).abs().max().item() <= 1e-4
    assert nat.greedy_tokens(x) == lr.argmax(-1).tolist()


def test_speculation_in_a_crowded_batch_decodes_plain_rows():
    """Past ALONE_UP_TO running sequences a greedy native round is a plain row of the shared step: the
    tokens stay plain greedy decoding's, and the stats say how many rounds went that way."""
    from tinyloop.engine import Engine, SamplingParams
    from tinyloop.engine.serving import BatchEngine, run_to_completion
    from tinyloop.engine.native_rounds import ALONE_UP_TO
    from tinyloop.modelfile import LoadedModel

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


PARCAE_LIKE = BASE.replace(norm_placement="pre", mlp="relu2", injection="diagonal", loop_norm=False, prelude_norm=True,
                           state_proj=True, qk_norm=True, value_embeds=(0, 2, 3), logit_softcap=30.0)


@pytest.mark.parametrize("feature", [dict(mlp="relu2"), dict(injection="diagonal"), dict(prelude_norm=True),
                                     dict(state_proj=True), dict(qk_norm=True), dict(value_embeds=(1,)),
                                     dict(logit_softcap=15.0)])
def test_parcae_features_are_refused_by_name(feature):
    """Each of Parcae's features the C++ code lacks is refused when the executor is made (so the engine
    warns and serves the model in PyTorch), named in the message."""
    from tinyloop.kernels.executor import Unsupported

    with pytest.raises(Unsupported, match="not implemented natively"):
        NativeExecutor(varied_model(BASE.replace(**feature), seed=1))


def test_parcae_like_model_is_served_by_pytorch_with_the_same_tokens(monkeypatch):
    monkeypatch.delenv("TINYLOOP_EXECUTOR", raising=False)   # "auto" here even in the suite's torch run
    from conftest import core_ids, reference_ids
    from tinyloop.engine import SamplingParams
    from tinyloop.kernels.executor import Unsupported
    from tinyloop.model.fast import prepare_for_decode

    m = varied_model(PARCAE_LIKE, seed=1)
    with pytest.raises(Unsupported, match="the relu2 MLP, the diagonal injection, a prelude norm"):
        prepare_for_decode(copy.deepcopy(m), executor="native")
    served = copy.deepcopy(m)
    with pytest.warns(UserWarning, match="does not run this model .*value embeddings, a logit soft-cap"):
        prepare_for_decode(served, executor="auto")
    assert served.executor is None
    params = SamplingParams(max_tokens=10, loops=3, ignore_eos=True)
    prompt = [5, 17, 300, 42, 7]
    assert core_ids(served, prompt, params) == reference_ids(m, prompt, params)
