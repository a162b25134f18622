"""NVIDIA Dory1.0 (issue 55): tiny random checkpoints in the real Hugging Face layout (safetensors, config.json, a
tokenizer), converted by `tinyloop convert`, against an independent numpy float32 reference written here from
the issue's formulas (not from any port's code):

    justnorm(x) = x / sqrt(sum(x^2) + 1e-6)
    layer       h <- justnorm(a + |alpha * alpha_init / std| * (justnorm(f(h)) - a)), a = justnorm(h)
    attention   NeoX RoPE (two profiles, partial rotary) on q and k; q = (sqk sqrt(D) / std)^2 justnorm(q),
                k = justnorm(k) per head; softmax(q k / sqrt(D)) v (S layers: the window); times
                sigmoid(g (s_gate sqrt(g0) / std)^2); justnorm over all heads; o_proj
    MLP         justnorm(silu(gate * suv_gate sqrt(d)) * up * suv_up sqrt(d)); down_proj
    loops       x0 = input block; state = x0; each loop: h = justnorm(state + x0), recurrent layers,
                state = justnorm(h); output block; logits = lm_head(x) * logit_scale / std

The reference runs "calls" (chunks of positions), each seeing earlier calls' keys in a dict of caches: one per
layer and loop (per_loop), or one per layer that every loop of a call overwrites (last_loop), which is exactly
what the two `recurrent_kv_cache_mode`s mean. Every check is in fp32 except where it says otherwise.

The shapes: hidden 32, 4 query heads of 16 (q and the gate are 64 wide, wider than the hidden size), 2 kv
heads, 2 input + 3 recurrent + 2 output layers "S-" "*S-" "*-", a window of 3 (prompts are longer), sliding
layers on RoPE profile 2 (base 500, rotary factor 0.75) and full layers on profile 1 (base 10000, factor 0.5).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.serving import BatchEngine, run_to_completion
from tinyloop.errors import ValidationError
from tinyloop.model import KVCache, param_count
from tinyloop.modelfile.loader import load_model
from tinyloop.tools.convert import ConvertError, convert

TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "reference" / "nanbeige-tiny"
STD = 0.02
D_MODEL, NH, NK, HD, FF, VOCAB = 32, 4, 2, 16, 64, 512
COUNTS = (2, 3, 2)                      # input, recurrent, output layers
PATTERN = "S-*S-*-"
WINDOW = 3
THETA, FRAC, THETA2, FRAC2 = 10000.0, 0.5, 500.0, 0.75
DEFAULT_LOOPS = 3
PROMPT = [3, 17, 250, 99, 7, 400, 12, 64, 301, 5]    # longer than the window


def hf_config(mode: str, **over) -> dict:
    cfg = {"architectures": ["DoryForCausalLM"], "model_type": "dory", "dory_format_version": 1,
           "vocab_size": VOCAB, "hidden_size": D_MODEL, "num_hidden_layers": len(PATTERN),
           "intermediate_size": FF, "num_attention_heads": NH, "num_key_value_heads": NK, "attention_head_dim": HD,
           "head_dim": HD, "max_position_embeddings": 128, "tie_word_embeddings": False,
           "hybrid_layer_pattern": PATTERN, "swa_window_size": WINDOW, "swa_num_attention_heads": None,
           "swa_num_key_value_heads": None, "swa_head_dim": None, "rope_theta": THETA,
           "partial_rotary_factor": FRAC, "rope_theta_2": THETA2, "partial_rotary_factor_2": FRAC2,
           "rope_profile_layers": [2 if c == "S" else 1 for c in PATTERN], "no_rope_layers": [0] * len(PATTERN),
           "ngpt": True, "fngpt": True, "init_method_std": STD, "ngpt_alpha_init": 0.05,
           "ngpt_enable_final_norm": False, "attention_output_gate": True,
           "attention_output_gate_logit_scale_init": None, "mlp_hidden_act": "silu", "mlp_bias": False,
           "attention_bias": False, "n_input_layers": COUNTS[0], "n_recurrent_layers": COUNTS[1],
           "n_output_layers": COUNTS[2], "n_recurrent_loops": DEFAULT_LOOPS, "recurrent_kv_cache_mode": mode,
           "initial_state": "input_copy", "input_transform": "residual", "output_transform": "replace",
           "mixer_type": None, "eos_token_id": 505, "torch_dtype": "float32"}
    cfg.update(over)
    return cfg


def random_weights(seed: int = 1729) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under their Hugging Face names (scale vectors without a .weight suffix).
    Projections are wide enough that every nonlinearity is exercised; the scale vectors sit around std (so
    scale / std is O(1), as after training); alpha and the logit scale are larger, so that the loops move
    the state (each loop count gives other tokens) and the greedy margins are wide."""
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {}

    def mat(name, shape, s=0.3):
        w[name] = rng.normal(0, s, shape).astype(np.float32)

    def vec(name, n, lo=0.7, hi=1.3):
        w[name] = (rng.uniform(lo, hi, n) * STD).astype(np.float32)

    mat("backbone.embeddings.weight", (VOCAB, D_MODEL), 1.0)
    mat("lm_head.weight", (VOCAB, D_MODEL), 0.6)
    vec("lm_head.logit_scale", VOCAB, 5, 15)
    for i, c in enumerate(PATTERN):
        p = f"backbone.layers.{i}."
        if c == "-":
            vec(p + "mlp_alpha", D_MODEL, 2, 8)
            mat(p + "mixer.gate_proj.weight", (FF, D_MODEL))
            mat(p + "mixer.up_proj.weight", (FF, D_MODEL))
            mat(p + "mixer.down_proj.weight", (D_MODEL, FF))
            vec(p + "mixer.suv_gate", FF)
            vec(p + "mixer.suv_up", FF)
        else:
            vec(p + "attn_alpha", D_MODEL, 2, 8)
            for role, rows in (("q", NH * HD), ("k", NK * HD), ("v", NK * HD), ("g", NH * HD)):
                mat(p + f"mixer.{role}_proj.weight", (rows, D_MODEL))
            mat(p + "mixer.o_proj.weight", (D_MODEL, NH * HD))
            vec(p + "mixer.sqk", NH * HD)
            vec(p + "mixer.s_gate", NH * HD)
    return w


def write_checkpoint(path: Path, hf: dict, w: dict[str, np.ndarray]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    save_file({k: torch.from_numpy(v) for k, v in w.items()}, str(path / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        shutil.copy(TOKENIZER / name, path / name)
    return path


# -- the reference ---------------------------------------------------------------------------------------
F32 = np.float32


def jn(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + F32(1e-6))


def rope(x: np.ndarray, pos: np.ndarray, theta: float, frac: float) -> np.ndarray:
    """NeoX rotation of the first R = D * frac dims of each head (x: (T, heads, D)): pairs (i, i + R/2) at
    angle pos * theta^(-2i/R); the dims past R as they are."""
    R = int(x.shape[-1] * frac)
    half = R // 2
    ang = pos[:, None].astype(np.float64) * theta ** (-np.arange(0, R, 2, dtype=np.float64) / R)[None]
    c, s = np.cos(ang).astype(F32)[:, None], np.sin(ang).astype(F32)[:, None]
    a, b = x[..., :half], x[..., half:R]
    return np.concatenate([a * c - b * s, b * c + a * s, x[..., R:]], axis=-1)


def reference(w: dict, hf: dict, tokens: list[int], loops: int, chunks: list[int] | None = None) -> np.ndarray:
    """Logits (T, vocab) of every position, the tokens run as consecutive calls of `chunks` positions (default:
    one call), each call's attention seeing what earlier calls left in the caches."""
    P, C, K = COUNTS
    per_loop = hf["recurrent_kv_cache_mode"] == "per_loop"
    g0 = hf["attention_output_gate_logit_scale_init"] or math.sqrt(D_MODEL)
    rate_of = F32(hf["ngpt_alpha_init"] / STD)
    T = len(tokens)
    caches: dict = {}

    def layer(x, i, pos, key):
        g = lambda role: w[f"backbone.layers.{i}.{role}"]   # noqa: E731
        if PATTERN[i] == "-":
            gate = (x @ g("mixer.gate_proj.weight").T) * (g("mixer.suv_gate") * F32(math.sqrt(D_MODEL)))
            up = (x @ g("mixer.up_proj.weight").T) * (g("mixer.suv_up") * F32(math.sqrt(D_MODEL)))
            y = jn(gate / (1 + np.exp(-gate)) * up) @ g("mixer.down_proj.weight").T
            alpha = g("mlp_alpha")
        else:
            n = len(pos)
            theta, frac = (hf["rope_theta_2"], hf["partial_rotary_factor_2"]) if hf["rope_profile_layers"][i] == 2 \
                else (hf["rope_theta"], hf["partial_rotary_factor"])
            q = (x @ g("mixer.q_proj.weight").T).reshape(n, NH, HD)
            k = (x @ g("mixer.k_proj.weight").T).reshape(n, NK, HD)
            v = (x @ g("mixer.v_proj.weight").T).reshape(n, NK, HD)
            q = jn(rope(q, pos, theta, frac)) * (g("mixer.sqk").reshape(NH, HD) * F32(math.sqrt(HD) / STD)) ** 2
            k = jn(rope(k, pos, theta, frac))
            Kc, Vc = caches.setdefault(key, (np.zeros((T, NK, HD), F32), np.zeros((T, NK, HD), F32)))
            Kc[pos], Vc[pos] = k, v                       # this call's keys (over a previous loop's, last_loop)
            end = pos[-1] + 1
            Ks, Vs = np.repeat(Kc[:end], NH // NK, axis=1), np.repeat(Vc[:end], NH // NK, axis=1)
            scores = np.einsum("thd,shd->hts", q, Ks) / F32(math.sqrt(HD))
            kpos = np.arange(end)
            allowed = kpos[None, :] <= pos[:, None]
            if PATTERN[i] == "S":
                allowed &= kpos[None, :] > pos[:, None] - WINDOW
            scores = np.where(allowed[None], scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            y = np.einsum("hts,shd->thd", p, Vs).reshape(n, NH * HD)
            sg = (g("mixer.s_gate") * F32(math.sqrt(g0) / STD)) ** 2
            y = y / (1 + np.exp(-(x @ g("mixer.g_proj.weight").T) * sg))
            y = jn(y) @ g("mixer.o_proj.weight").T
            alpha = g("attn_alpha")
        a, b = jn(x), jn(y)
        return jn(a + np.abs(alpha * rate_of) * (b - a))

    out, s = [], 0
    for n in chunks or [T]:
        pos = np.arange(s, s + n)
        x = w["backbone.embeddings.weight"][tokens[s:s + n]]
        for i in range(P):
            x = layer(x, i, pos, ("in", i))
        x0 = state = x
        for r in range(loops):
            h = jn(state + x0)
            for i in range(P, P + C):
                h = layer(h, i, pos, ("rec", i, r if per_loop else 0))
            state = jn(h)
        x = state
        for i in range(P + C, P + C + K):
            x = layer(x, i, pos, ("out", i))
        out.append((x @ w["lm_head.weight"].T) * (w["lm_head.logit_scale"] / F32(STD)))
        s += n
    return np.concatenate(out)


def reference_greedy(w, hf, prompt, loops, n) -> tuple[list[int], list[float]]:
    """Greedy decoding as the engine runs it, recomputed from scratch at every token: the prompt in one call,
    then one call per generated token (which matters in last_loop mode only). Returns the tokens and each
    one's log-probability."""
    toks, lps = list(prompt), []
    for _ in range(n):
        logits = reference(w, hf, toks, loops, [len(prompt)] + [1] * (len(toks) - len(prompt)))[-1].astype(np.float64)
        t = int(logits.argmax())
        lps.append(float(logits[t] - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))))
        toks.append(t)
    return toks[len(prompt):], lps


# -- fixtures --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def weights():
    return random_weights()


@pytest.fixture(scope="module", params=["per_loop", "last_loop"])
def dory(request, tmp_path_factory, weights):
    """(mode, hf config, converted fp32 model file) for each KV mode."""
    mode = request.param
    hf = hf_config(mode)
    root = tmp_path_factory.mktemp(f"dory-{mode}")
    src = write_checkpoint(root / "hf", hf, weights)
    out = convert(src, root / "dory.tinyloop", dtype="float32", progress=False)
    return mode, hf, out


@pytest.fixture(scope="module")
def engines(dory):
    mode, hf, path = dory
    return Engine.load(path)


# -- the model against the reference -----------------------------------------------------------------------
def test_the_converted_config(dory):
    mode, hf, path = dory
    cfg = load_model(path).model.cfg
    assert (cfg.n_prelude, cfg.n_core, cfg.n_coda) == COUNTS and cfg.layer_pattern == PATTERN
    assert cfg.n_heads * cfg.head_dim > cfg.dim                      # heads wider than the hidden size
    assert cfg.kv_mode == mode and cfg.sliding_window == WINDOW < len(PROMPT)
    assert (cfg.rotary_dim, cfg.rotary_dim_2) == (int(HD * FRAC), int(HD * FRAC2))
    assert cfg.rope_profile == tuple(hf["rope_profile_layers"]) and cfg.default_loops == DEFAULT_LOOPS


def test_the_model_takes_its_blocks_from_the_family_module(dory):
    """The registry's `own_blocks` picks Dory's module for an nGPT config (and no family for the shared blocks'
    configs): the model is built of its `NGPTBlock`s, one sublayer each by the layer pattern, on the sphere."""
    from tinyloop.config import preset
    from tinyloop.model.families import FAMILIES, own_blocks
    from tinyloop.model.families.dory import NGPTBlock

    mode, hf, path = dory
    model = load_model(path).model
    assert own_blocks(model.cfg) is FAMILIES["dory"] and model.sphere
    blocks = [*model.prelude, *model.core, *model.coda]
    assert all(type(b) is NGPTBlock for b in blocks)
    assert "".join("-" if b.mlp is not None else b.kind for b in blocks) == PATTERN
    assert own_blocks(preset("tiny")) is None


def test_the_familys_own_scalars_live_in_family_params(dory):
    """nGPT's init std, alpha init and gate logit init are the family's (`ModelConfig.family_params`, read and checked
    by model/families/dory.py only): written under family_params, read from headers that held them at the top level,
    and a model built with a bad one refused by field name."""
    from tinyloop.config import ConfigError, ModelConfig, preset
    from tinyloop.model import build_model

    mode, hf, path = dory
    cfg = load_model(path).model.cfg
    assert cfg.family_params == {"ngpt_std": STD, "ngpt_alpha_init": hf["ngpt_alpha_init"],
                                 "gate_logit_init": pytest.approx(math.sqrt(cfg.dim))}
    d = cfg.to_dict()
    assert d["family_params"] == cfg.family_params and "ngpt_std" not in d
    assert ModelConfig.from_dict(d) == cfg
    old = {k: v for k, v in d.items() if k != "family_params"} | cfg.family_params   # a header of before
    assert ModelConfig.from_dict(old) == cfg
    assert "family_params" not in preset("tiny").to_dict()   # (left out where empty: other headers as they were)
    for params, field in (({"ngpt_std": 0.0}, "ngpt_std"), ({"ngpt_std": STD, "gate_logit_init": -1.0},
                                                             "gate_logit_init"), ({"ngpt_std": STD, "sqk": 1}, "sqk")):
        with pytest.raises(ConfigError, match=field):
            build_model(cfg.replace(family_params=params))


@torch.inference_mode()
def test_fp32_logits_match_the_reference_at_every_position(dory, weights):
    """Tolerance 1e-4 (absolute, on logits of magnitude ~10): both sides are fp32; every layer ends in a
    justnorm, so rounding errors (~6e-8 relative a step, a few dozen steps, accumulations of <= 64 terms) stay
    at ~1e-6 relative of the unit-norm state and the logits' ~1e-5 at the scale logit_scale / std ~ 10 puts on
    them; 1e-4 leaves a 10x margin while any real difference (a missed scale, norm or window) moves logits by
    O(0.1) and more. Both the plain modules and the decode-prepared ones (fused projections) are checked."""
    mode, hf, path = dory
    loaded = load_model(path)
    from tinyloop.model.fast import prepare_for_decode

    fast = prepare_for_decode(load_model(path).model, executor="torch")
    ids = torch.tensor([PROMPT])
    seen = set()
    for loops in (1, 2, 3, 4):
        want = reference(weights, hf, PROMPT, loops)
        for model in (loaded.model, fast):
            got = model(ids, loops)[0, :, :VOCAB].numpy()
            assert np.abs(got - want).max() < 1e-4, (mode, loops, np.abs(got - want).max())
        seen.add(tuple(want.argmax(-1)))
    assert len(seen) == 4   # each depth predicts other tokens: a loop bug cannot hide


@torch.inference_mode()
def test_chunked_calls_match_the_reference_in_both_kv_modes(dory, weights):
    """The contiguous cache, the tokens in calls of 4, 1, 1, 3, 1: per_loop equals one call at every depth;
    last_loop equals the reference's own chunked run (earlier calls' tokens seen at their last loop) and, past
    one loop, differs from one call (the mode is really there)."""
    mode, hf, path = dory
    model = load_model(path).model
    chunks = [4, 1, 1, 3, 1]
    for loops in (1, 2, 4):
        cache = KVCache(model.cfg, max_positions=32, loops=loops)
        got, s = [], 0
        for n in chunks:
            got.append(model(torch.tensor([PROMPT[s:s + n]]), loops, cache=cache, start=s)[0, :, :VOCAB].numpy())
            s += n
        got = np.concatenate(got)
        want = reference(weights, hf, PROMPT, loops, chunks)
        assert np.abs(got - want).max() < 1e-4, (mode, loops)
        whole = reference(weights, hf, PROMPT, loops)
        if mode == "per_loop" or loops == 1:
            assert np.abs(want - whole).max() < 1e-4
        else:
            assert np.abs(want - whole).max() > 1e-2
    if mode == "last_loop":   # one slot per recurrent attention layer, none per loop (and none for MLP layers)
        assert KVCache(model.cfg, loops=4).n_slots == KVCache(model.cfg, loops=1).n_slots == PATTERN.count("-") + 1


# -- the engine ---------------------------------------------------------------------------------------------
def test_cached_greedy_decoding_and_logprobs_equal_uncached_forwards(dory, engines, weights):
    """Engine (paged pool, decode-prepared model) greedy tokens and log-probabilities == the reference
    recomputed from scratch at every token, at loops 1, 2 and 4, in both KV modes."""
    mode, hf, path = dory
    n = 8
    for loops in (1, 2, 4):
        want, want_lp = reference_greedy(weights, hf, PROMPT, loops, n)
        out = engines.generate(PROMPT, SamplingParams(max_tokens=n, loops=loops, temperature=0, ignore_eos=True,
                                                      logprobs=0))
        assert out.token_ids == want, (mode, loops)
        assert np.allclose([lp for lp, _ in out.logprobs], want_lp, atol=1e-4), (mode, loops)


def test_the_default_depth_is_the_checkpoints(dory, engines, weights):
    mode, hf, path = dory
    assert engines.config.default_loops == DEFAULT_LOOPS
    want, _ = reference_greedy(weights, hf, PROMPT, DEFAULT_LOOPS, 6)
    assert engines.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)).token_ids == want


def test_batched_requests_at_mixed_depths_with_a_shared_prefix(dory, engines, weights):
    """Continuous batching: several requests at once, each at its own depth, two sharing a prompt prefix
    (the prefix cache where the mode allows it), each equal to its reference."""
    mode, hf, path = dory
    other = PROMPT[:7] + [88, 123]
    items = [(PROMPT, SamplingParams(max_tokens=5, loops=1, temperature=0, ignore_eos=True)),
             (PROMPT, SamplingParams(max_tokens=5, loops=3, temperature=0, ignore_eos=True)),
             (other, SamplingParams(max_tokens=5, loops=3, temperature=0, ignore_eos=True)),
             (other[:5], SamplingParams(max_tokens=5, loops=2, temperature=0, ignore_eos=True))]
    batch = BatchEngine(engines, max_num_seqs=8, page_size=4)
    for _ in range(2):   # the second time, the prompts' blocks are in the prefix cache (per_loop)
        events = run_to_completion(batch, items)
        for (ids, params), evs in zip(items, events):
            got = [t for e in evs for t in e.token_ids]
            assert got == reference_greedy(weights, hf, ids, params.loops, 5)[0], (mode, params.loops)


def test_small_pages_read_only_the_window_and_chunked_prefill(dory, engines, weights):
    """Pages of 4 positions: a sliding-window layer reads only the pages its window reaches (the rest of the
    context is neither read nor scored), alone (one sequence) and with a prompt prefilled in chunks of 4
    (per_loop: chunking changes nothing; last_loop: a chunk is a call, checked against the reference's own
    chunked run)."""
    mode, hf, path = dory
    params = SamplingParams(max_tokens=8, loops=3, temperature=0, ignore_eos=True)
    alone = BatchEngine(engines, max_num_seqs=1, page_size=4)
    got = [t for e in run_to_completion(alone, [(PROMPT, params)])[0] for t in e.token_ids]
    assert got == reference_greedy(weights, hf, PROMPT, 3, 8)[0]
    chunked = BatchEngine(engines, max_num_seqs=1, page_size=4, max_batched_tokens=4, prefix_caching=False)
    got = [t for e in run_to_completion(chunked, [(PROMPT, params)])[0] for t in e.token_ids]
    toks = list(PROMPT)
    for _ in range(8):
        calls = [4, 4, 2] + [1] * (len(toks) - len(PROMPT))
        toks.append(int(reference(weights, hf, toks, 3, calls)[-1].argmax()))
    assert got == toks[len(PROMPT):], mode


def test_speculative_decoding_equals_plain_greedy(dory, engines, weights):
    """Self-speculation (drafts at 1 loop, verified at 3) and tree speculation give plain greedy's tokens
    (per_loop); a last_loop model refuses them by name: a verification pass would see its drafted tokens at
    each loop instead of at their last loop, so it could not equal plain decoding."""
    mode, hf, path = dory
    want, _ = reference_greedy(weights, hf, PROMPT, 3, 10)
    for spec, k in (("speculative", 1), ("tree_speculative", 2)):
        params = SamplingParams(max_tokens=10, mode=spec, verify_loops=3, draft_loops=1, draft_ahead=3,
                                k_branches=k, temperature=0, ignore_eos=True)
        if mode == "per_loop":
            assert engines.generate(PROMPT, params).token_ids == want, spec
        else:
            with pytest.raises(ValidationError) as err:
                engines.generate(PROMPT, params)
            assert err.value.param == "mode" and "last_loop" in str(err.value)


def test_the_native_executor_runs_dory(dory, engines):
    """Dory runs on the native executor where its library builds (csrc/dory.cpp, described from model/families/dory.py NGPTBlock.native_fields; compared
    with model/ in tests/kernels/test_dory_native.py), so the engine tests above ran natively there."""
    from tinyloop.kernels.executor import unsupported_features
    from tinyloop.kernels.lib import native_wanted
    from tinyloop.model.fast import executor_name

    mode, hf, path = dory
    assert unsupported_features(engines.config) == []
    want = "native" if native_wanted() else "torch"
    assert executor_name(engines.model).startswith(want)
    info = engines.model_info()
    assert info["executor"].startswith(want) and info["kv_loops"].startswith("last") == (mode == "last_loop")


def test_tokenizer_and_chat_template_come_from_the_checkpoint(dory, engines):
    mode, hf, path = dory
    assert engines.tokenizer.chat_template == (TOKENIZER / "chat_template.jinja").read_text()
    assert 505 in engines.eos_ids


# -- refusals ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("dory_format_version", 2), ("mixer_type", "mamba2"), ("ngpt_enable_final_norm", True), ("ngpt", False),
    ("fngpt", False), ("no_rope_layers", [0, 1, 0, 0, 0, 0, 0]), ("rope_profile_layers", [2, 1, 0, 2, 1, 1, 1]),
    ("swa_head_dim", 8), ("swa_num_attention_heads", 2), ("swa_num_key_value_heads", 1),
    ("attention_bias", True), ("mlp_bias", True), ("tie_word_embeddings", True), ("initial_state", "zeros"),
    ("input_transform", "add"), ("output_transform", "add"), ("attention_output_gate", False),
    ("mlp_hidden_act", "gelu"), ("recurrent_kv_cache_mode", "shared"), ("hybrid_layer_pattern", "S-*S-*"),
    ("partial_rotary_factor", 0.3125), ("n_recurrent_layers", 2), ("init_method_std", 0.0),
    ("quantization_config", {"quant_method": "modelopt", "quant_algo": "NVFP4"}),
])
def test_each_refusal_names_its_field(tmp_path, weights, field, value):
    src = write_checkpoint(tmp_path / "hf", hf_config("per_loop", **{field: value}), weights)
    with pytest.raises(ConvertError) as err:
        convert(src, tmp_path / "x.tinyloop", dtype="float32", progress=False)
    msg = str(err.value)
    assert field in msg or (field == "n_recurrent_layers" and "n_recurrent_layers 2" in msg), msg
    if field == "quantization_config":
        assert "NVFP4" in msg
    assert not (tmp_path / "x.tinyloop").exists()


# -- quantized weights and KV ---------------------------------------------------------------------------------
def test_quantized_weights_and_int8_kv_run_dory(tmp_path, weights):
    """`tinyloop quantize` takes every projection of a Dory file (the output gate's too: it joins q, k and v's
    calibration group); int8 weights and an int8 KV pool stay close to the fp32 reference (max logit error
    below 1 on logits ~10; the greedy start unchanged); int4 weights load and decode (their accuracy on a
    random model this small says nothing: no claim)."""
    from tinyloop.tools.gptq import QuantSpec
    from tinyloop.tools.quantize import quantize_file

    hf = hf_config("per_loop")
    src = write_checkpoint(tmp_path / "hf", hf, weights)
    f32 = convert(src, tmp_path / "f32.tinyloop", dtype="float32", progress=False)
    want = reference(weights, hf, PROMPT, DEFAULT_LOOPS)
    greedy, _ = reference_greedy(weights, hf, PROMPT, DEFAULT_LOOPS, 3)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for bits, group in ((8, None), (4, 32)):
        out = tmp_path / f"int{bits}.tinyloop"
        quantize_file(f32, out, QuantSpec(bits=bits, group_size=group, method="rtn"), progress=False)
        engine = Engine.load(out)
        with torch.inference_mode():
            got = engine.model(torch.tensor([PROMPT]), DEFAULT_LOOPS)[0, :, :VOCAB].float().numpy()
        toks = engine.generate(PROMPT, params).token_ids
        assert len(toks) == 3 and np.isfinite(got).all()
        # (the file's count, from its codes' shapes, is the float model's: the gate's rows in the fused
        # projection and the per-unit scales that stay float counted once each)
        assert engine.model_info()["params"] == param_count(engine.config) == Engine.load(f32).model_info()["params"]
        if bits == 8:
            assert np.abs(got - want).max() < 1.0 and toks == greedy
    kv8 = Engine.load(f32, kv_format="int8")
    assert kv8.generate(PROMPT, params).token_ids == greedy


def test_sliding_window_layers_keep_a_ring_of_pages(dory, engines, weights, monkeypatch):
    """A sequence longer than its ring (pages of 4, steps of at most 16 positions: the S columns keep 28
    blocks): the S layers' columns reuse their pages, the pool holds fewer pages than without the ring, and
    greedy decoding is unchanged: bitwise the same logprobs as the same core without the ring, and the
    reference's tokens (chunked as the core chunks the prompt)."""
    mode, hf, path = dory
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 500, 60)]
    params = SamplingParams(max_tokens=60, loops=2, temperature=0, ignore_eos=True, logprobs=0)
    runs, real = {}, BatchEngine._ring
    for ring in (True, False):
        rings = []
        monkeypatch.setattr(BatchEngine, "_ring", lambda self, *a: rings.append(real(self, *a)) or
                            (rings[-1] if ring else {}))
        core = BatchEngine(engines, max_num_seqs=1, page_size=4, max_batched_tokens=16, prefix_caching=False)
        events, fewest, plan = [], core.sched.pool.num_free, engines.plan(prompt, params)
        core.add(plan, lambda ev: ev is not None and events.append(ev))
        needed = core.pages_needed(plan)
        while core.has_work:
            core.step()
            fewest = min(fewest, core.sched.pool.num_free)
        assert rings[-1]["ring_blocks"] == 28 and rings[-1]["ring_cols"]
        runs[ring] = ([t for e in events for t in e.token_ids], [lp for e in events for lp in (e.logprobs or [])],
                      core.sched.pool.n_pages - fewest)
        assert runs[ring][2] <= needed or not ring   # the pool a request is sized for (Engine.core) holds it
        assert core.sched.pool.num_free == core.sched.pool.n_pages
    (got, lps, used), (plain, plain_lps, plain_used) = runs[True], runs[False]
    assert got == plain and lps == plain_lps
    assert used < plain_used
    toks = list(prompt)
    for _ in range(len(got)):
        calls = [16, 16, 16, 12] + [1] * (len(toks) - len(prompt))
        toks.append(int(reference(weights, hf, toks, 2, calls)[-1].argmax()))
    assert got == toks[len(prompt):], mode
