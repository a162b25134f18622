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

kernels = pytest.importorskip("tinyloop.kernels.lib")
try:
    kernels.load("native")
    kernels.load("portable")
    kernels.load("avx2")
except kernels.NativeBuildError as exc:  # no compiler here: the PyTorch path serves, nothing to compare
    pytest.skip(f"native library unavailable: {exc}", allow_module_level=True)

from native_pair import BASE, CONFIGS, PAGE, clone_kv, make_pair, prefilled_pool  # noqa: E402
from tinyloop.kernels.executor import NativeExecutor  # noqa: E402
from tinyloop.model.paged import PagedKV, PagedStep, Rows  # noqa: E402
from tinyloop.quant.linear import QuantLinear  # noqa: E402
from tinyloop.quant.packing import pack, quantize_rtn  # noqa: E402

SEQS = [  # (prompt length, loops, window): rows of one step, different depths, positions and windows
    (9, 3, 0), (5, 1, 0), (14, 2, 6), (3, 3, 0),
]


@torch.inference_mode()
def one_step(ref, nat, kv_format="fp16", kv_dtype=torch.float32, seqs=SEQS, rule=None, out=None):
    cfg = ref.cfg
    slots = cfg.n_prelude + cfg.n_coda + cfg.n_core * max(s[1] for s in seqs)
    kv, tables, toks = prefilled_pool(ref, seqs, PAGE, slots, kv_format, kv_dtype)
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


def test_int8_activations_at_a_width_of_whole_32s(monkeypatch):
    """A model whose width is whole 32s but not 64s (96 here; Huginn's 5280) in int4 groups of 32 takes int8
    activations in those layers too, the last 32 columns an activation block of their own. Its step equals the
    outer-product panels' (forced), which round the activations to int8 the same way (per block) and then sum
    in fp32: they differ only by the order of fp32 sums (~1e-7 relative per product here, 7e-7 measured after
    the step's layers; 1e-5 leaves room), where the int8 rounding itself moves these chaotic random logits by
    ~5e-2, so a block scaled or placed wrongly could not pass. And greedy speculation (verification rows beside
    each other, drafts alone) gives plain decoding's tokens, which needs a row's logits not to depend on the
    rows beside it."""
    from tinyloop.engine import SamplingParams
    from conftest import core_ids

    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "1")
    cfg = CONFIGS["huginn-like"].replace(dim=96, n_heads=6, n_kv_heads=2, head_dim=16, ffn_dim=256,
                                         embed_scale=math.sqrt(96))
    ref_m, nat = make_pair(cfg, "int4")
    descs = nat.executor.linears()
    assert any(d.act_q8 and d.k % 64 == 32 for d in descs)
    lib = kernels.load()
    _, tiles, _, _ = one_step(ref_m, nat)
    old = lib.tl_set_panel_min_rows(1)
    try:
        _, panels, _, _ = one_step(ref_m, nat)
    finally:
        lib.tl_set_panel_min_rows(old)
    err = (tiles - panels).abs().max().item() / panels.abs().max().item()
    assert err < 1e-5, err
    prompt = [5, 17, 300, 42, 7, 9]
    plain = core_ids(nat, prompt, SamplingParams(max_tokens=24, loops=4, temperature=0))
    for kw in (dict(pipeline=False), dict(pipeline=True)):
        spec = core_ids(nat, prompt, SamplingParams(max_tokens=24, mode="speculative", draft_loops=1, verify_loops=4,
                                                    draft_ahead=4, temperature=0), draft_vocab=None, adaptive=False, **kw)
        assert spec == plain, kw


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


@pytest.mark.parametrize("kv_format,kv_dtype", [("fp16", torch.float32), ("fp16", torch.float16),
                                                ("fp16", torch.bfloat16), ("int8", torch.float32),
                                                ("int4", torch.float32), ("int4-h", torch.float32)])
def test_a_prefill_chunk_attends_as_rows_one_at_a_time(kv_format, kv_dtype):
    """Attention is computed per row in one order whatever rows share the call (attention.cpp; a float pool's
    prefill rows in groups of up to eight that read each key once, heads whole 32s: `tl_attend_rows`), so a
    prefill chunk's positions have bitwise the logits they have with the first one to seven positions in a step of
    their own (every row then sits at each place in its group, in groups of 2 to 8), or the last
    (windows and grouped heads included: SEQS, nanbeige-like; groups over several blocks of eight keys, the rows
    left over at a chunk's end, and a last key block only a group's later rows fill: 40 and 23 positions).
    Nothing here is a tolerance."""
    configs = {"tiny": CONFIGS["tiny"], "nanbeige-like": CONFIGS["nanbeige-like"],
               "heads of 32": CONFIGS["tiny"].replace(n_heads=2, n_kv_heads=1, head_dim=32)}
    for name, cfg in configs.items():
        ref, nat = make_pair(cfg, "fp32")
        for seq in SEQS + [(40, 2, 0), (23, 3, 0)]:
            whole = prefill_pair(ref, nat, kv_format, kv_dtype, seqs=[seq])[1]
            for split in sorted({*range(1, 8), seq[0] - 1} & set(range(1, seq[0]))):
                assert torch.equal(whole, prefill_pair(ref, nat, kv_format, kv_dtype, seqs=[seq], split=split)[1]), \
                    (name, seq, split)


@pytest.mark.parametrize("kv_format,kv_dtype", [("fp16", torch.float16), ("fp16", torch.bfloat16),
                                                ("int8", torch.float32), ("int4", torch.float32),
                                                ("int4-h", torch.float32)])
@pytest.mark.parametrize("name", ["tiny", "huginn-like", "parcae-like"])   # (parcae: q/k norms and value
def test_native_step_every_kv_format(name, kv_format, kv_dtype):               # embeddings before the pool)
    """One step's own keys, rounded into a lossy pool, may round the other way where they sit on a rounding
    boundary (test_native_prefill_every_kv_format's argument): check bounds every pool entry by one step of
    the format; a bf16 step (2^-8 relative, 8x fp16's) on one entry moves these chaotic models' logits by
    ~1e-4 (parcae-like: 1.2e-4 measured), so 1e-3 there."""
    ref, nat = make_pair(CONFIGS[name], "fp32")
    check(*one_step(ref, nat, kv_format, kv_dtype), tol=1e-3 if kv_dtype == torch.bfloat16 else 1e-4)


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


@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_random_initial_state_runs_natively(weights):
    """Huginn's random start (`state_seed`): rows from tokens bring the state model/looped.py draws for their
    positions, so a prefill (whole and chunked) and a decode step equal PyTorch's, natively; the draw does
    matter (another seed moves the logits far beyond the tolerance)."""
    cfg = CONFIGS["huginn-like"].replace(state_init_std=0.4)
    ref, nat = make_pair(cfg, weights)
    ref.state_seed = nat.state_seed = 11
    r = Rows(table=torch.zeros(1, 1, dtype=torch.long), start=0, n=1, last_loop=2, tokens=[3])
    assert nat.executor.supports(r)
    check(*prefill_pair(ref, nat))
    check(*prefill_pair(ref, nat, split=4))
    lr, ln, kv, kv_nat = one_step(ref, nat)
    check(lr, ln, kv, kv_nat)
    nat.state_seed = 12
    lr2, ln2, _, _ = one_step(ref, nat)
    assert (lr2 - ln2).abs().max().item() > 1e-2


@pytest.mark.parametrize("name,criterion,thresholds", [
    ("ouro-like", "latent", [0.05, 0.4, 0.8, 1.5]), ("ouro-like", "gate", [0.2, 0.5, 0.9]),
    ("ouro-like", "kl", [0.01, 0.1, 0.5, 2.0]),
    ("parcae-like", "latent", [0.05, 0.4, 0.8, 1.5]),   # (kl: its read-out is C, then the coda with value
    ("parcae-like", "kl", [0.01, 0.1, 0.5, 2.0])])      # embeddings from the loop input, the capped head)
def test_adaptive_exits_run_natively(name, criterion, thresholds):
    """loops "auto": each row's criterion is checked inside the call; an exit copies its last loop's keys into
    the skipped slots. Same loops, survival, logits and pool as PyTorch, and some rows do exit early."""
    from tinyloop.model.exits import ExitRule

    ref, nat = make_pair(CONFIGS[name], "fp32")
    if criterion == "gate":
        with torch.no_grad():   # a gate that fires: a bias around zero, weights of a useful scale
            for m in (ref, nat):
                m.exit_gate.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
                m.exit_gate.bias.fill_(-0.5)
    seqs = [(9, 6, 0), (5, 6, 0), (14, 5, 6), (3, 6, 0), (7, 4, 0)]
    row = Rows(table=torch.zeros(4, 8, dtype=torch.long), start=9, n=1, last_loop=6, tokens=[3],
               exit_rule=ExitRule(criterion, thresholds[0], 2, 6))
    assert nat.executor.supports(row)   # (not the PyTorch fallback)
    runs = []
    for th in thresholds:
        got = []
        check(*one_step(ref, nat, seqs=seqs, rule=lambda loops: ExitRule(criterion, th, 2, loops), out=got))
        for lr, ln, sr, sn in got:
            assert lr == ln and abs(sr - sn) < 1e-6
        runs += [lr < s[1] for (lr, _, _, _), s in zip(got, seqs)]
    assert any(runs) and not all(runs)


@pytest.mark.parametrize("kv_format,kv_dtype", [("fp16", torch.float32), ("int8", torch.float32)])
@pytest.mark.parametrize("name", ["tiny", "ouro-like", "parcae-like"])
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
@pytest.mark.parametrize("name", ["tiny", "ouro-like", "parcae-like"])
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


@pytest.mark.parametrize("feature", [dict(mlp="relu2"), dict(injection="diagonal"), dict(prelude_norm=True),
                                     dict(state_proj=True), dict(qk_norm=True), dict(value_embeds=(0,)),
                                     dict(value_embeds=(1,)), dict(value_embeds=(3,)), dict(logit_softcap=3.0)])
def test_each_parcae_feature_runs_natively(feature):
    """Each of Parcae's features alone on the tiny model (GQA, a prelude, core and coda; a value embedding in
    a prelude, core or coda block): the executor takes the model and a step's rows (several depths,
    positions and windows), their keys and values in the pool and the logits equal PyTorch's; the native
    head applies the soft-cap (a small c, so that it bends these logits)."""
    from tinyloop.kernels.executor import unsupported_features

    cfg = BASE.replace(**feature)
    assert unsupported_features(cfg) == []
    ref, nat = make_pair(cfg, "fp32")
    check(*one_step(ref, nat))
    x = torch.randn(3, cfg.dim, generator=torch.Generator().manual_seed(2)) * 3
    lr = ref.logits(x)
    assert (lr - nat.logits(x)).abs().max().item() <= 1e-4
    assert nat.greedy_tokens(x) == lr.argmax(-1).tolist()


def test_what_the_executor_lacks_is_refused_by_name():
    """What the C++ code does not implement is refused by name when the executor is made (the engine then
    warns and serves the model in PyTorch): value embeddings on heads wider than its per-head buffer."""
    from tinyloop.kernels.executor import Unsupported, unsupported_features

    wide = BASE.replace(n_heads=1, n_kv_heads=1, head_dim=1032, dim=1032, value_embeds=(1,))
    assert unsupported_features(wide) == ["value embeddings on heads wider than 1024"]
    assert unsupported_features(wide.replace(value_embeds=())) == []
    assert unsupported_features(CONFIGS["parcae-like"]) == []

    class Cfg:   # config values the library does not know (ModelConfig itself refuses such values)
        mlp, injection, value_embeds, head_dim = "geglu", "gated", (), 64
        norm_placement, loop_start = "peri", "noise"
    assert unsupported_features(Cfg) == ["the geglu MLP", "the gated injection", "peri-norm blocks",
                                         "loop 0 starting as 'noise'"]
    model = varied_model(BASE, seed=1)
    model.cfg = wide   # (only the config is read before the refusal)
    with pytest.raises(Unsupported, match="not implemented natively: value embeddings on heads wider than 1024"):
        NativeExecutor(model)


@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_parcae_like_model_is_served_natively_with_the_same_tokens(monkeypatch, weights):
    """The engine serves a Parcae-like model (every piece on) with the native executor attached, not the
    PyTorch fallback; greedy tokens equal the reference decoding's and the PyTorch executor's, and with a
    random initial state (`state_seed`) too."""
    monkeypatch.delenv("TINYLOOP_EXECUTOR", raising=False)   # "auto" here even in the suite's torch run
    import warnings

    from conftest import core_ids, reference_ids
    from tinyloop.engine import SamplingParams
    from tinyloop.model.fast import prepare_for_decode

    ref, nat = make_pair(CONFIGS["parcae-like"], weights)
    _, served = make_pair(CONFIGS["parcae-like"], weights)   # (its layers in the format under test)
    served.executor = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no "does not run this model" warning
        prepare_for_decode(served, executor="auto")
    assert isinstance(served.executor, NativeExecutor)
    params = SamplingParams(max_tokens=12, loops=3, ignore_eos=True)
    prompt = [5, 17, 300, 42, 7]
    want = reference_ids(ref, prompt, params)
    assert core_ids(served, prompt, params) == want
    assert core_ids(nat, prompt, params) == want
    ex, nat.executor = nat.executor, None   # the same model on the PyTorch path
    assert core_ids(nat, prompt, params) == want
    for m in (ref, served):
        m.state_seed = 3
    nat.state_seed, nat.executor = 3, ex
    want = reference_ids(ref, prompt, params)
    assert core_ids(served, prompt, params) == want == core_ids(nat, prompt, params)

