"""`tinyloop convert` on the retrofitted-recurrence checkpoints (McLeish et al. 2025: Llama and OLMo-2 layers
in Huginn's prelude / recurrent block / coda, `model_type: huginn_raven`), against logits and greedy tokens
recorded by the authors' own modelling code (tests/fixtures/reference/raven-{llama,olmo}-tiny, made by
scripts/reference_fixtures/raven.py with transformers 4.57.6).

Tolerance: each fixture records how far the reference's own float32 logits lie from a float64 run of the same
code (`checks.float64_vs_float32_max_abs`: 4e-6 .. 1.6e-5 here, on logits up to |11|, i.e. ~1e-6 relative).
TinyLoop's float32 forward makes rounding errors of the same kind and size (other summation orders, F.rms_norm,
float64-made RoPE tables), so |TinyLoop - reference| <= |TinyLoop - exact| + |reference - exact| is about twice
that; 4x that deviation per loop count leaves a margin for thread counts and ISAs (measured here: 0.5x .. 1x).
A wrong engine is far outside it: the two variants' norm placements, OLMo's q/k norms or a missed adapter half
move the logits by O(1), and every recorded argmax has a top-1/top-2 gap >= 0.05 on its greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tinyloop.engine import Engine, SamplingParams
from tinyloop.model import KVCache
from tinyloop.tools.convert import ConvertError, convert, model_config
from test_convert import copy_fixture, edit_config  # (the snapshot fixtures' helpers, shared)

FIXTURES = Path(__file__).parent / "fixtures" / "reference"
VARIANTS = ["raven-llama-tiny", "raven-olmo-tiny"]


def reference(name: str) -> dict:
    return json.loads((FIXTURES / name / "reference.json").read_text())


def tolerance(ref: dict, k: int) -> float:
    return 4 * ref["checks"]["float64_vs_float32_max_abs"][str(k)]


@pytest.fixture(scope="module", params=VARIANTS)
def converted(request, tmp_path_factory):
    name = request.param
    return name, convert(FIXTURES / name, tmp_path_factory.mktemp(name) / "m.tinyloop", dtype="float32",
                         progress=False)


def test_config_maps_onto_the_variant(converted):
    name, path = converted
    ref, cfg = reference(name), Engine.load(path, executor="torch").config
    hf = json.loads((FIXTURES / name / "config.json").read_text())
    assert (cfg.injection, cfg.loop_norm, cfg.post_loop_norm, cfg.head_norm) == ("concat-adapter", False, False, True)
    assert not cfg.tie_embeddings and cfg.n_kv_heads == hf["num_key_value_heads"] < cfg.n_heads   # GQA
    assert cfg.embed_scale == hf["init_values"]["embed_scale"] == 1.0
    assert cfg.rope_theta == hf["rope_theta"]     # (Llama's rope_base, Huginn's 500000, is not what the code reads)
    assert cfg.default_loops == hf["mean_recurrence"] == ref["default_loops"]
    if ref["variant"] == "llama":
        assert (cfg.norm_placement, cfg.qk_norm_full, cfg.head_dim) == ("pre", False, hf["n_embd"] // hf["n_heads"])
        assert hf["rope_base"] != hf["rope_theta"]
    else:
        assert (cfg.norm_placement, cfg.qk_norm_full, cfg.head_dim) == ("post", True, hf["head_dim"])
        assert cfg.head_dim * cfg.n_heads != cfg.dim


def _native_or_torch() -> str:
    """"native" where the library builds on this host (asked for explicitly, whatever TINYLOOP_EXECUTOR says),
    else "torch" (no compiler: the native checks below have nothing to check)."""
    from tinyloop.kernels import lib
    try:
        lib.load("native")
    except lib.NativeBuildError:
        return "torch"
    return "native"


NATIVE = _native_or_torch()


def test_logits_and_greedy_match_the_reference_code(converted):
    """Every loop count, served per request (`loops`), and the default one (mean_recurrence) when none is
    asked for; greedy through the engine's cached decoding equals the reference's full no-cache forwards."""
    name, path = converted
    ref = reference(name)
    logits = load_file(str(FIXTURES / name / "reference_logits.safetensors"))
    engine = Engine.load(path)
    ids = ref["prompt"]["ids"]
    for k in ref["loops"]:
        run = ref["runs"][str(k)]
        err = (engine.logits(ids, loops=k) - logits[run["logits_key"]]).abs().max().item()
        assert err <= tolerance(ref, k), f"{name} loops {k}: max abs logit error {err:.2e}"
        out = engine.generate(ids, SamplingParams(max_tokens=len(run["greedy_ids"]), loops=k, temperature=0,
                                                  ignore_eos=True))
        assert out.token_ids == run["greedy_ids"], f"{name} loops {k}"
    default = engine.generate(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert default.token_ids == ref["runs"][str(ref["default_loops"])]["greedy_ids"]
    # the loop count matters in these fixtures (a loop bug cannot hide)
    assert len({tuple(r["greedy_ids"]) for r in ref["runs"].values()}) >= 3
    assert len({tuple(r["prompt_argmax"]) for r in ref["runs"].values()}) == len(ref["loops"])


def test_cached_decode_equals_full_forward(converted):
    """The contiguous cache, the prompt then one token a step, gives the full forward's logits at every
    position (to float32 rounding) and the same greedy tokens, at two depths."""
    name, path = converted
    ref = reference(name)
    m = Engine.load(path, executor="torch").model
    ids = torch.tensor([ref["prompt"]["ids"] + ref["runs"]["4"]["greedy_ids"]])
    for k in (2, 7):
        with torch.no_grad():
            full = m(ids, loops=k)
            cache = KVCache(m.cfg, loops=k, dtype=torch.float32)
            outs = [m(ids[:, :5], loops=k, cache=cache, start=0)]
            outs += [m(ids[:, t:t + 1], loops=k, cache=cache, start=t) for t in range(5, ids.shape[1])]
        cached = torch.cat(outs, 1)
        torch.testing.assert_close(cached, full, rtol=0, atol=tolerance(ref, k))
        assert torch.equal(cached.argmax(-1), full.argmax(-1))


def test_llama3_rope_scaling_matches_the_reference(tmp_path):
    """Llama-3.2's retrofits carry rope_type llama3 (convert_llama.py writes it): the same weights with it,
    against the reference's own runs with that config, natively and in PyTorch."""
    ref = reference("raven-llama-tiny")
    r3 = ref["llama3_rope"]
    src = copy_fixture("raven-llama-tiny", tmp_path)
    edit_config(src, rope_scaling=r3["rope_scaling"])
    path = convert(src, tmp_path / "l3.tinyloop", dtype="float32", progress=False)
    logits = load_file(str(src / "reference_logits.safetensors"))
    ids = ref["prompt"]["ids"]
    for engine in (Engine.load(path), Engine.load(path, executor="torch")):
        assert engine.config.rope_llama3 == (4.0, 1.0, 4.0, 16.0)
        torch.testing.assert_close(engine.model.rotary.inv_freq, torch.tensor(r3["inv_freq"], dtype=torch.float64),
                                   rtol=1e-6, atol=0)   # (the reference's are float32)
        for k in r3["loops"]:
            err = (engine.logits(ids, loops=k) - logits[f"llama3_loops_{k}"]).abs().max().item()
            assert err <= tolerance(ref, k), f"llama3 RoPE, loops {k}: {err:.2e}"
            assert r3[f"max_abs_diff_to_plain_rope_{k}"] > 1.0   # the scaling matters at these positions
            out = engine.generate(ids, SamplingParams(max_tokens=8, loops=k, temperature=0, ignore_eos=True))
            assert out.token_ids == r3["greedy_ids"][str(k)], k
    assert r3["greedy_ids"]["4"] != ref["runs"]["4"]["greedy_ids"]


@pytest.mark.parametrize("mode,start", [("embed-init", "embed"), ("skip-adapter", "skip")])
def test_olmo_initial_state_modes_match_the_reference(tmp_path, mode, start):
    """The OLMo code's other starts: the recurrence from the prelude output, or its first step on it without
    the adapter; against the reference's own runs with that config.json."""
    ref = reference("raven-olmo-tiny")
    runs = ref["initial_state_modes"]
    src = copy_fixture("raven-olmo-tiny", tmp_path)
    edit_config(src, initial_state_mode=mode)
    engine = Engine.load(convert(src, tmp_path / "m.tinyloop", dtype="float32", progress=False), executor="torch")
    assert engine.config.loop_start == start
    logits = load_file(str(src / "reference_logits.safetensors"))
    ids = ref["prompt"]["ids"]
    for k in runs["loops"]:
        err = (engine.logits(ids, loops=k) - logits[f"{mode}_loops_{k}"]).abs().max().item()
        assert err <= tolerance(ref, k), f"{mode}, loops {k}: {err:.2e}"
        assert runs[f"{mode}_max_abs_diff_to_random_mode_{k}"] > 1.0   # the start matters
        out = engine.generate(ids, SamplingParams(max_tokens=8, loops=k, temperature=0, ignore_eos=True))
        assert out.token_ids == runs["greedy_ids"][f"{mode}_{k}"], k
    spec = engine.generate(ids, SamplingParams(max_tokens=8, mode="speculative", verify_loops=4, draft_loops=1,
                                               draft_ahead=3, temperature=0, ignore_eos=True))
    assert spec.token_ids == runs["greedy_ids"][f"{mode}_4"]
    native = Engine.load(tmp_path / "m.tinyloop", executor=NATIVE)   # the start runs natively too (loop_start)
    if NATIVE == "torch":
        return
    assert native.model.executor is not None
    for k in runs["loops"]:
        out = native.generate(ids, SamplingParams(max_tokens=8, loops=k, temperature=0, ignore_eos=True))
        assert out.token_ids == runs["greedy_ids"][f"{mode}_{k}"], ("native", k)
    spec = native.generate(ids, SamplingParams(max_tokens=8, mode="speculative", verify_loops=4, draft_loops=1,
                                               draft_ahead=3, temperature=0, ignore_eos=True))
    assert spec.token_ids == runs["greedy_ids"][f"{mode}_4"]


def test_random_initial_state(converted):
    """From the reference's own random draw (recorded), the same logits; the converted rule (state_seed) is
    the reference's: trunc. normal with init_values.std, times embed_scale (1)."""
    name, path = converted
    ref = reference(name)
    logits = load_file(str(FIXTURES / name / "reference_logits.safetensors"))
    engine = Engine.load(path, executor="torch")
    rule = ref["state_runs"]
    assert engine.config.state_init_std == pytest.approx(rule["std"], rel=1e-12) and rule["embed_scale"] == 1.0
    m, ids = engine.model, torch.tensor([ref["prompt"]["ids"]])
    x0 = logits[rule["initial_state_key"]]
    m.init_state = lambda e, positions=None: x0[None].to(e.dtype).clone()
    for k in rule["loops"]:
        with torch.no_grad():
            got = m(ids, loops=k)[0]
        err = (got - logits[f"state_loops_{k}"]).abs().max().item()
        assert err <= tolerance(ref, max(ref["loops"])), f"{name} random state, loops {k}: {err:.2e}"
        assert (logits[f"state_loops_{k}"] - logits[f"loops_{k}"]).abs().max() > 1e-3   # the state matters


def test_native_and_pytorch_paths_agree(converted):
    """Both variants run natively (the OLMo's post-norm blocks and q/k norms over all heads since session 18);
    the native and PyTorch paths give the same greedy tokens, speculation included."""
    name, path = converted
    ref = reference(name)
    native = Engine.load(path, executor=NATIVE)
    assert (native.model.executor is not None) == (NATIVE == "native")
    torch_path = Engine.load(path, executor="torch")
    k, ids = ref["default_loops"], ref["prompt"]["ids"]
    want = ref["runs"][str(k)]["greedy_ids"]
    for engine in (native, torch_path):
        for mode, K in (("plain", 1), ("speculative", 1), ("tree_speculative", 2)):
            extra = {} if mode == "plain" else dict(mode=mode, verify_loops=k, draft_loops=1, draft_ahead=3,
                                                      k_branches=K)
            out = engine.generate(ids, SamplingParams(max_tokens=len(want), temperature=0, ignore_eos=True, **extra))
            assert out.token_ids == want, (name, mode)


def test_served_over_http_with_loops_per_request(converted):
    from server.conftest import ServerThread
    from tinyloop.server.settings import Settings

    name, path = converted
    ref = reference(name)
    ids = ref["prompt"]["ids"]
    with ServerThread(Settings(model_path=path)) as srv:
        for k in (1, 7, None):
            body = {"model": "tinyloop", "prompt": [ids], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            if k is not None:
                body["loops"] = k
            r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            want = ref["runs"][str(k or ref["default_loops"])]["greedy_ids"]
            assert r.json()["choices"][0]["text"] == Engine.load(path).tokenizer.decode(want), (name, k)


# -- what is refused, by name ---------------------------------------------------------------------------
REFUSED = [("raven-llama-tiny", {"qk_bias": True}, "qk_bias = True"),
           ("raven-llama-tiny", {"bias": True}, "bias = True"),
           ("raven-olmo-tiny", {"test_time_noise": 0.5}, "test_time_noise = 0.5"),
           ("raven-llama-tiny", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling = .*yarn"),
           ("raven-llama-tiny", {"rope_scaling": {"rope_type": "llama3", "factor": 32.0}}, "rope_scaling = .*llama3"),
           ("raven-llama-tiny", {"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
           ("raven-llama-tiny", {"head_dim": 16}, "head_dim = 16 with 4 heads"),
           ("raven-olmo-tiny", {"initial_state_mode": "zero"}, "initial_state_mode = 'zero'")]


@pytest.mark.parametrize("name,changes,message", REFUSED)
def test_options_the_converters_leave_off_are_refused_by_name(tmp_path, name, changes, message):
    src = copy_fixture(name, tmp_path)
    edit_config(src, **changes)
    with pytest.raises(ConvertError, match=message.replace("(", r"\(").replace("[", r"\[")):
        convert(src, tmp_path / "x.tinyloop", progress=False)
    assert not (tmp_path / "x.tinyloop").exists()


def test_the_llama_code_ignores_initial_state_mode(tmp_path):
    """Only the OLMo code reads initial_state_mode; the Llama code always starts from its random state."""
    src = copy_fixture("raven-llama-tiny", tmp_path)
    edit_config(src, initial_state_mode="skip-adapter")
    cfg = Engine.load(convert(src, tmp_path / "x.tinyloop", progress=False)).config
    assert (cfg.norm_placement, cfg.loop_start) == ("pre", "state")


def test_variant_comes_from_the_tensors_and_mismatches_are_refused(tmp_path):
    llama = json.loads((FIXTURES / "raven-llama-tiny" / "config.json").read_text())
    olmo_map = {"AutoModelForCausalLM": "raven_modeling_minimal_olmo.RavenForCausalLM"}
    # config.json alone (`tinyloop pull` before the download): auto_map naming OLMo's modelling file
    assert model_config(llama, tmp_path, [0]).norm_placement == "pre"
    assert model_config({**llama, "auto_map": olmo_map}, tmp_path, [0]).norm_placement == "post"
    # with the tensor names (convert), they decide
    llama_names = set(load_file(str(FIXTURES / "raven-llama-tiny" / "model.safetensors")))
    assert model_config({**llama, "auto_map": olmo_map}, tmp_path, [0], llama_names).norm_placement == "pre"
    olmo = json.loads((FIXTURES / "raven-olmo-tiny" / "config.json").read_text())
    olmo_names = set(load_file(str(FIXTURES / "raven-olmo-tiny" / "model.safetensors")))
    assert model_config({**olmo, "auto_map": {}}, tmp_path, [0], olmo_names).norm_placement == "post"
    huginn = json.loads((FIXTURES / "huginn-tiny" / "config.json").read_text())
    assert model_config(huginn, tmp_path, [0]).norm_placement == "sandwich-residual"
    # a retrofit's weights under a config without rope_theta (its RoPE base unknown)
    src = copy_fixture("raven-llama-tiny", tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["rope_theta"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match="untied Huginn head .* names its RoPE base rope_theta"):
        convert(src, tmp_path / "x.tinyloop", progress=False)
    edit_config(src, tie_embeddings=True)
    with pytest.raises(ConvertError, match="no rope_theta but the blocks have two norms"):
        convert(src, tmp_path / "x.tinyloop", progress=False)
    # Huginn-0125's four-norm weights under a retrofit's config
    hug = copy_fixture("huginn-tiny", tmp_path)
    edit_config(hug, rope_theta=50000.0, qk_bias=False)
    with pytest.raises(ConvertError, match="Huginn's four norms"):
        convert(hug, tmp_path / "x.tinyloop", progress=False)


def test_a_missing_or_misshapen_tensor_is_named(tmp_path):
    src = copy_fixture("raven-olmo-tiny", tmp_path)
    tensors = load_file(str(src / "model.safetensors"))
    tensors.pop("transformer.core_block.1.attn.k_norm.weight")
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConvertError, match="no tensor for 'core.1.attn.k_norm.weight'"):
        convert(src, tmp_path / "x.tinyloop", progress=False)
    tensors["transformer.core_block.1.attn.k_norm.weight"] = torch.ones(16)   # one head's width, not 2 x 16
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConvertError, match=r"core.1.attn.k_norm.weight has shape \[16\], the config needs \[32\]"):
        convert(src, tmp_path / "x.tinyloop", progress=False)
