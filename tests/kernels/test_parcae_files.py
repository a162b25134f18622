"""Parcae-like model files end to end (issue 35): `tinyloop quantize` (RTN and GPTQ) of a file whose coda has
value embeddings, B and C quantized like the blocks' linears, the quantized file natively and on the PyTorch
path; draft exits built, trained and attached for it (model/draft_exit.py)."""

from __future__ import annotations

import pytest
import torch

kernels = pytest.importorskip("tinyloop.kernels.lib")
try:
    kernels.load("native")
except kernels.NativeBuildError as exc:  # no compiler here: the PyTorch path serves, nothing to compare
    pytest.skip(f"native library unavailable: {exc}", allow_module_level=True)

from conftest import core_ids, reference_ids, varied_model  # noqa: E402
from native_pair import CONFIGS  # noqa: E402
from tinyloop.engine import Engine, SamplingParams  # noqa: E402
from tinyloop.kernels.executor import NativeExecutor  # noqa: E402
from tinyloop.modelfile.loader import read_header, write_model  # noqa: E402
from tinyloop.quant.formats import is_quantizable  # noqa: E402
from tinyloop.quant.packing import dequantize, quantize_rtn  # noqa: E402
from tinyloop.tokenizer import Tokenizer  # noqa: E402
from tinyloop.tools.gptq import QuantSpec  # noqa: E402
from tinyloop.tools.quantize import quantize_file  # noqa: E402

# every Parcae piece, value embeddings in a prelude, a core and the coda block (GQA)
CFG = CONFIGS["parcae-like"]
PROMPT = [5, 17, 300, 42, 7, 9]
TEXT = "the quick brown fox jumps over the lazy dog; a stitch in time saves nine. " * 60


def small_tokenizer() -> Tokenizer:
    """511 tokens (bytes and 255 letter pairs) and EOS 511: every id the 512-row model emits decodes."""
    ranks = {bytes([i]): i for i in range(256)}
    letters = b"etaoinshrdlucmfwypvbgkqjxz "
    pairs = [bytes([a, b]) for a in letters for b in letters][:255]
    ranks.update({p: 256 + i for i, p in enumerate(pairs)})
    return Tokenizer(ranks)


def parcae_model(cfg=CFG):
    model = varied_model(cfg, seed=1)
    with torch.no_grad():   # a decay and dt of its own per channel (as native_pair.make_pair)
        g = torch.Generator().manual_seed(6)
        model.injection.A_log.normal_(0, 1, generator=g)
        model.injection.dt_bias.normal_(0, 1, generator=g)
    return model.eval()


@pytest.fixture(scope="module")
def parcae_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("parcae")
    model = parcae_model()
    path = write_model(d / "p.tinyloop", model, tokenizer=small_tokenizer(), provenance={"tool": "tests"})
    (d / "calib.txt").write_text(TEXT)
    return path, model


def rtn_reference(model, bits: int):
    """The float model with every quantizable linear replaced by its RTN-dequantized weights: what a
    quantized file computes (up to the kernels' activation rounding)."""
    import copy

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, mod in ref.named_modules():
            if isinstance(mod, torch.nn.Linear) and is_quantizable(f"{name}.weight", tuple(mod.weight.shape)):
                q, s, z = quantize_rtn(mod.weight.float(), bits, None if bits == 8 else 32)
                mod.weight.copy_(dequantize(q, s, z, mod.weight.dtype))
    return ref


@pytest.mark.parametrize("method,bits", [("rtn", 4), ("rtn", 8), ("gptq", 4)])
def test_quantized_parcae_file_quantizes_b_and_c_and_runs_natively(parcae_file, monkeypatch, method, bits):
    """B (the diagonal injection's matrix) and C (the projection after the loops) are quantized like the blocks'
    linears, the value-embedding gates stay float; GPTQ calibrates through the coda's value embeddings (before:
    a ValueError from the coda block). With fp32 activations (TINYLOOP_NATIVE_Q8=0) the native layers compute
    the dequantized model exactly: RTN's logits and greedy tokens equal it (measured 0.0000 of the largest
    logit; native int8 activations 2.7%, torch's own bf16-activation kernels 1.1%), far from the float model's
    (int4: 23%), so B's and C's codes are what runs. Greedy decoding gives the same tokens natively and on the
    PyTorch path over the same layers, with the native int8 activations (the default) too."""
    src, model = parcae_file
    out = src.with_name(f"p-{method}{bits}.tinyloop")
    spec = QuantSpec(bits=bits, method=method, group_size=None if bits == 8 else 32)
    quantize_file(src, out, spec, calib=src.with_name("calib.txt") if method == "gptq" else None,
                  calib_tokens=512, calib_seq_len=64, progress=False)
    header, index = read_header(out)
    hp = header["weights"]["quant"]["high_precision"]
    for name in ("injection.B", "state_proj"):
        assert f"{name}.weight" not in hp and f"{name}.qweight" in index, name
    assert "coda.0.attn.ve_gate.weight" in hp and "value_embeds.3.weight" in hp
    params = SamplingParams(max_tokens=16, loops=3, temperature=0, ignore_eos=True)
    want_ids = reference_ids(rtn_reference(model, bits), PROMPT, params) if method == "rtn" else None
    for q8 in ("1", "0"):
        monkeypatch.setenv("TINYLOOP_NATIVE_Q8", q8)
        native = Engine.load(out, executor="native")   # (whatever TINYLOOP_EXECUTOR says: this test is the native one)
        m = native.model
        assert isinstance(m.executor, NativeExecutor)
        greedy = core_ids(m, PROMPT, params)
        ex, m.executor = m.executor, None   # the PyTorch path over the same layers
        assert core_ids(m, PROMPT, params) == greedy, q8
        m.executor = ex
        assert native.generate(PROMPT, params).token_ids == greedy
        if q8 == "0" and want_ids is not None:
            assert greedy == want_ids
    got_n = native.logits(PROMPT, loops=3)
    if method == "rtn":
        want = rtn_reference(model, bits)(torch.tensor([PROMPT]), loops=3)[0]
        scale = want.abs().max()
        assert (got_n - want).abs().max() <= 1e-4 * scale
        if bits == 4:
            assert (model(torch.tensor([PROMPT]), loops=3)[0] - want).abs().max() > 0.1 * scale
    # torch's own kernels (executor "torch": bf16 activations) round differently: close, not equal
    got_t = Engine.load(out, executor="torch").logits(PROMPT, loops=3)
    assert (got_n - got_t).abs().max() <= 0.03 * got_t.abs().max()


# -- draft exits --------------------------------------------------------------------------------------------
def loop_state(model, loops: int = 2):
    toks = torch.tensor([PROMPT])
    ctx = model.context(len(PROMPT))
    e = model.embed_prelude(toks, ctx)
    h = model.init_state(e)
    for r in range(loops):
        h = model.core_loop(h, e, r, ctx)
    return e, h


@torch.no_grad()
def test_a_parcae_draft_exit_copies_c_and_the_coda_without_value_embeddings():
    """DraftExit.from_model on a Parcae-like model whose coda block has value embeddings (before: a bare
    state_dict RuntimeError on its gate) copies C and the coda, the gates left out: without coda value
    embeddings the untrained exit reads a state out exactly as the model does (before, without C: argmax
    agreement 0 here); with them it differs by their term alone (the same coda with that block's gate
    removed). A quantized model's coda is refused by name."""
    from tinyloop.model.draft_exit import DraftExit

    for ve in ((0, 2), (0, 2, 3)):
        model = parcae_model(CFG.replace(value_embeds=ve))
        ex = DraftExit.from_model(model).eval()
        assert ex.state_proj is not None and torch.equal(ex.state_proj.weight, model.state_proj.weight)
        assert not any("ve_gate" in k for k in ex.state_dict())
        e, h = loop_state(model)
        got = model.logits(ex.blocks(h, model.context(len(PROMPT)), None))
        if ve == (0, 2):
            want = model.logits(model.run_coda(h, model.context(len(PROMPT)), e))
        else:   # the model's read-out without the coda block's value-embedding term
            model.coda[0].attn.ve_gate = None
            model.ve_cols.pop(3)
            want = model.logits(model.run_coda(h, model.context(len(PROMPT)), e))
        assert (got - want).abs().max() <= 1e-5, ve
    quant = parcae_model()
    q, s, z = quantize_rtn(quant.coda[0].attn.wq.weight, 8, None)
    from tinyloop.quant.linear import QuantLinear
    from tinyloop.quant.packing import pack
    quant.coda[0].attn.wq = QuantLinear.from_portable(pack(q, 8), s, z, 8, kernel="dense")
    with pytest.raises(ValueError, match="float model's coda"):
        DraftExit.from_model(quant)


def test_a_parcae_draft_exit_file_round_trips_and_refuses_one_without_c(tmp_path):
    """The exit file carries C (`d{d}.state_proj.weight`, config `state_proj: true`); a file made for a model
    without C is refused for a Parcae model by name, and the other way round."""
    from tinyloop.model.draft_exit import DraftExit, DraftExitError, read_draft_exits, write_draft_exits

    model = parcae_model()
    ex = DraftExit.from_model(model)
    path = write_draft_exits(tmp_path / "p.draft.safetensors", {1: ex}, model.cfg, {})
    exits, header = read_draft_exits(path, model.cfg)
    assert header["config"]["state_proj"] is True
    assert torch.allclose(exits[1].state_proj.weight, ex.state_proj.weight.half().float())
    no_c = CFG.replace(state_proj=False)
    with pytest.raises(DraftExitError, match="state_proj"):
        read_draft_exits(path, no_c)
    other = write_draft_exits(tmp_path / "n.draft.safetensors", {1: DraftExit(no_c)}, no_c, {})
    with pytest.raises(DraftExitError, match="state_proj None"):
        read_draft_exits(other, model.cfg)


def test_train_draft_on_a_parcae_file(parcae_file, tmp_path):
    """`tinyloop train-draft` on a Parcae-like file (coda value embeddings, C, the soft-cap): the teacher is the
    model's own read-out (its argmax the model's), the exits distil towards it, the file attaches and greedy
    speculation through it is plain greedy decoding, natively and on the PyTorch path."""
    from tinyloop.train.draft_exit import teacher_pass, train_draft_exits

    src, model = parcae_file
    windows = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    t = teacher_pass(model, windows, (1,), 2, full_argmax=True)
    assert torch.equal(t["argmax"], model(windows, loops=CFG.default_loops).argmax(-1))
    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog {i % 7}.\n" for i in range(300)))
    out = src.with_name("p.draft.safetensors")
    info = train_draft_exits(src, [text], out, draft_loops=(1,), tokens=2048, seq=32, batch=8, epochs=2,
                             lr=1e-3, val_tokens=512, val_fraction=0.1, draft_vocab=512, log=lambda s: None)
    assert info["agreement"]["1"]["kl_after"] < info["agreement"]["1"]["kl_before"]
    for executor in (None, "torch"):
        engine = Engine.load(src, executor=executor)
        assert sorted(engine.model.draft_exits) == [1]
        plain = engine.generate(PROMPT, SamplingParams(max_tokens=16, loops=3, temperature=0, ignore_eos=True))
        spec = engine.generate(PROMPT, SamplingParams(max_tokens=16, mode="speculative", verify_loops=3,
                                                      draft_loops=1, draft_ahead=3, temperature=0,
                                                      ignore_eos=True))
        assert spec.token_ids == plain.token_ids, executor
        assert spec.stats["draft_exit"] is True
    out.unlink()
