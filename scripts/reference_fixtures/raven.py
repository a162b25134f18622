#!/usr/bin/env python3
"""Build the retrofitted-recurrence fixtures (tests/fixtures/reference/raven-{llama,olmo}-tiny) by RUNNING the
reference code of McLeish et al. 2025 (LoopedLMs/retrofitting-recurrence, `convert_pretrained_model/`).

    REF=/tmp/ravenref/raven_retrofit   # raven_config_minimal.py, raven_modeling_minimal_{llama,olmo}.py
    PYTHONPATH=/tmp/tfpkgs python scripts/reference_fixtures/raven.py --ref-dir $REF --variant llama
    PYTHONPATH=/tmp/tfpkgs python scripts/reference_fixtures/raven.py --ref-dir $REF --variant olmo

(one variant a process: both modelling files register the same `huginn_raven` config class with
transformers' Auto classes, which refuses a second registration). Runs under torch 2.13.0 with transformers
4.57.6 (the other fixtures' pins; here installed with `pip install --target /tmp/tfpkgs transformers==4.57.6`,
outside the project's venv); never imports tinyloop.

The three reference files are copied into a TEMPORARY package and imported from there; nothing of them is
written into the fixture directory. The config is built as the authors' converters build theirs
(convert_llama.py / convert_olmo.py: `RavenConfig`, then head_dim, num_key_value_heads, padded_vocab_size,
rope_theta, max_position_embeddings, tie_embeddings False, qk_bias False, init_values["embed_scale"] 1.0) at a
tiny size, the model is the reference `RavenForCausalLM`, its weights come from our own seeded generator, and
`save_pretrained` writes config.json and model.safetensors (bfloat16, as the released checkpoints are stored).
The reference outputs are computed after reloading that directory with `from_pretrained(dtype=float32)`.

Recorded (reference.json, reference_logits.safetensors): float32, batch 1, one thread, full forwards without a
cache; `forward(num_steps=k, init_scale=0.0)` (the zero initial state; the default init_scale 1.0 draws a random
one) at k in LOOPS (`loops_k`); from a random state drawn by the reference's own rule (`initialize_state`,
recorded as `initial_state`) at 1 and 4 (`state_loops_k`); Llama only: with Llama-3's RoPE scaling (`LLAMA3`,
passed to from_pretrained) at 1 and 4 (`llama3_loops_k`, greedy tokens in reference.json); OLMo only: with
initial_state_mode "embed-init" and "skip-adapter" at 1 and 4 (`{mode}_loops_k`, greedy tokens); greedy
continuations (argmax of full forwards) and the reference's own cached decoding (forward with its
HuginnDynamicCache, one token a step) compared with them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "reference"
CODE = ["raven_config_minimal.py", "raven_modeling_minimal_llama.py", "raven_modeling_minimal_olmo.py"]
TOKENIZER_FROM = FIXTURES / "ouro-tiny"   # a 512-entry byte-level BPE; the retrofits carry their base's tokenizer
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
ROPE = {"llama": 10000.0, "olmo": 500000.0}   # the base models' rope_theta (TinyLlama, OLMo-2)
VOCAB, LOOPS, STATE_LOOPS, NEW_TOKENS = 512, [1, 2, 4, 7], [1, 4], 8
# rope_type llama3 as convert_llama.py writes it for Llama-3.2 (its factor 32, original context 8192), scaled
# down so that a 20-token prompt sees every frequency band: wavelengths above 16 slowed 4x, below 4 kept
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
PROMPT = [0, 65, 283, 90, 401, 17, 300, 42, 7, 260, 133, 5]
# the tiny shapes: GQA 4:2 in both; OLMo's heads wider than n_embd / n_heads (its code reads config.head_dim)
SHAPES = {"llama": dict(n_embd=32, n_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64),
          "olmo": dict(n_embd=32, n_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64)}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def top2_gap(row: torch.Tensor) -> float:
    t = torch.topk(row.double(), 2).values
    return float(t[0] - t[1])


def make_config(R, variant: str):
    """The authors' converters' recipe: a RavenConfig, then their update_dict, at a tiny size."""
    cfg = R.RavenConfig()
    s = SHAPES[variant]
    update = {**s, "n_layers": 4, "n_layers_in_prelude": 1, "n_layers_in_recurrent_block": 2,
              "n_layers_in_coda": 1, "norm_eps": 1e-05 if variant == "llama" else 1e-06, "vocab_size": VOCAB,
              "padded_vocab_size": VOCAB, "rope_base": 500000.0 if variant == "llama" else ROPE[variant],
              "tie_embeddings": False, "torch_dtype": "bfloat16", "qk_bias": False, "max_position_embeddings": 256,
              "mean_recurrence": 4, "mean_backprop_depth": 2, "block_size": 256}
    for k, v in update.items():
        setattr(cfg, k, v)
    cfg.init_values["embed_scale"] = 1.0
    cfg.rope_theta = ROPE[variant]   # Llama: the base model's rope_theta (rope_base stays Huginn's 500000, unread)
    cfg.tie_word_embeddings = False
    cfg.bos_token_id, cfg.eos_token_id = 0, 0
    return cfg


def fill(model, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights from our own generator, rounded to bfloat16 (what the file stores)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm_" in name or name.endswith("ln_f.weight"):
                v = 0.6 + 0.8 * torch.rand(p.shape, generator=g)
            elif name.endswith("wte.weight") or name == "lm_head.weight":
                v = 0.5 * torch.randn(p.shape, generator=g)
            else:
                v = 0.8 * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
            p.copy_(v.to(torch.bfloat16).float())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def build(ref_dir: Path, variant: str, seed: int, work: Path) -> dict | None:
    pkg = work / "ravenref"
    if not pkg.exists():
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        for f in CODE:
            shutil.copyfile(ref_dir / f, pkg / f)
        sys.path.insert(0, str(work))
    import importlib

    R = importlib.import_module(f"ravenref.raven_modeling_minimal_{variant}")
    cfg = make_config(R, variant)
    torch.manual_seed(seed)
    model = R.RavenForCausalLM(cfg).float()
    written = fill(model, seed)
    hf = work / f"hf-{variant}-{seed}"
    model.to(torch.bfloat16).save_pretrained(str(hf), safe_serialization=True)
    m = R.RavenForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    loaded = m.state_dict()
    for k, v in written.items():
        assert torch.equal(loaded[k], v), f"loaded weight differs: {k}"
    ids = torch.tensor([PROMPT])

    def fwd(seq, k, states=None):
        with torch.no_grad():
            out = m(torch.tensor([seq]), num_steps=k, init_scale=0.0, input_states=states, use_cache=False)
        return out.logits[0].float()

    logits, runs = {}, {}
    for k in LOOPS:
        pl = fwd(PROMPT, k)
        seq, gaps = list(PROMPT), []
        for _ in range(NEW_TOKENS):
            last = fwd(seq, k)[-1]
            gaps.append(top2_gap(last))
            seq.append(int(last.argmax()))
        greedy_ids = seq[len(PROMPT):]
        # the reference's own cached decoding: its HuginnDynamicCache, the prompt then one token a step
        cache, cached_ids, pos = R.HuginnDynamicCache(), [], len(PROMPT)
        with torch.no_grad():
            out = m(ids, num_steps=k, init_scale=0.0, past_key_values=cache, use_cache=True)
            cached_first = (out.logits[0].float() - pl).abs().max().item()
            tok = int(out.logits[0, -1].argmax())
            for _ in range(NEW_TOKENS):
                cached_ids.append(tok)
                out = m(torch.tensor([[tok]]), num_steps=k, init_scale=0.0, past_key_values=cache, use_cache=True,
                        cache_position=torch.tensor([pos]))
                tok, pos = int(out.logits[0, -1].argmax()), pos + 1
        assert cached_ids == greedy_ids, (variant, k, cached_ids, greedy_ids)
        logits[f"loops_{k}"] = pl.contiguous()
        runs[str(k)] = {"logits_key": f"loops_{k}", "prompt_argmax": pl.argmax(-1).tolist(),
                        "prompt_min_top2_gap": min(top2_gap(r) for r in pl), "greedy_ids": greedy_ids,
                        "greedy_min_top2_gap": min(gaps), "cached_prompt_logits_max_abs_diff": cached_first}
    if min(r["greedy_min_top2_gap"] for r in runs.values()) < 0.05:
        log(f"  {variant} seed {seed}: a greedy gap < 0.05; next seed")
        return None
    if len({tuple(r["greedy_ids"]) for r in runs.values()}) < 3:
        log(f"  {variant} seed {seed}: the loop count hardly changes the greedy tokens; next seed")
        return None
    # a random initial state by the reference's own rule (trunc. normal, init_values std, times embed_scale)
    torch.manual_seed(seed)
    with torch.no_grad():
        e = m.transformer.wte(ids)
        x0 = m.initialize_state(e, scale=1.0)
    logits["initial_state"] = x0[0].contiguous()
    for k in STATE_LOOPS:
        logits[f"state_loops_{k}"] = fwd(PROMPT, k, x0).contiguous()
    llama3 = None
    if variant == "llama":   # Llama-3's RoPE scaling (what the Llama-3.2 retrofits carry), at a tiny context
        cfg3 = R.RavenConfig.from_pretrained(str(hf))
        cfg3.rope_scaling = dict(LLAMA3)
        m3 = R.RavenForCausalLM.from_pretrained(str(hf), config=cfg3, dtype=torch.float32).eval()
        llama3 = {"rope_scaling": LLAMA3, "loops": STATE_LOOPS, "greedy_ids": {}}
        for k in STATE_LOOPS:
            with torch.no_grad():
                l3 = m3(ids, num_steps=k, init_scale=0.0, use_cache=False).logits[0].float()
            logits[f"llama3_loops_{k}"] = l3.contiguous()
            llama3[f"max_abs_diff_to_plain_rope_{k}"] = float((l3 - logits[f"loops_{k}"]).abs().max())
            seq = list(PROMPT)
            for _ in range(NEW_TOKENS):
                with torch.no_grad():
                    last = m3(torch.tensor([seq]), num_steps=k, init_scale=0.0, use_cache=False).logits[0, -1]
                seq.append(int(last.argmax()))
            llama3["greedy_ids"][str(k)] = seq[len(PROMPT):]
        inv = m3.rotary_emb.inv_freq.double()
        llama3["inv_freq"] = inv.tolist()
    modes = None
    if variant == "olmo":   # the OLMo code's other initial_state_mode values (the Llama code has none)
        modes = {"loops": STATE_LOOPS, "greedy_ids": {}}
        for mode in ("embed-init", "skip-adapter"):
            cfgm = R.RavenConfig.from_pretrained(str(hf))
            cfgm.initial_state_mode = mode
            mm = R.RavenForCausalLM.from_pretrained(str(hf), config=cfgm, dtype=torch.float32).eval()
            for k in STATE_LOOPS:
                with torch.no_grad():
                    lm = mm(ids, num_steps=k, init_scale=0.0, use_cache=False).logits[0].float()
                logits[f"{mode}_loops_{k}"] = lm.contiguous()
                modes[f"{mode}_max_abs_diff_to_random_mode_{k}"] = float((lm - logits[f"loops_{k}"]).abs().max())
                seq = list(PROMPT)
                for _ in range(NEW_TOKENS):
                    with torch.no_grad():
                        last = mm(torch.tensor([seq]), num_steps=k, init_scale=0.0, use_cache=False).logits[0, -1]
                    seq.append(int(last.argmax()))
                modes["greedy_ids"][f"{mode}_{k}"] = seq[len(PROMPT):]
    m64 = R.RavenForCausalLM.from_pretrained(str(hf), dtype=torch.float64).eval()
    fp64 = {}
    for k in LOOPS:
        with torch.no_grad():
            l64 = m64(ids, num_steps=k, init_scale=0.0, use_cache=False).logits[0]
        fp64[str(k)] = float((l64 - logits[f"loops_{k}"].double()).abs().max())
    saved = json.loads((hf / "config.json").read_text())
    ref = {"family": "huginn_raven", "variant": variant, "seed": seed, "prompt": {"ids": PROMPT},
           "vocab_size": VOCAB, "default_loops": saved["mean_recurrence"], "loops": LOOPS, "runs": runs,
           "loop_parameter": "forward(num_steps=k, init_scale=0.0): the zero initial state",
           "state_runs": {"loops": STATE_LOOPS, "initial_state_key": "initial_state",
                          "rule": "initialize_state: trunc_normal(0, std, +-3 std) * embed_scale",
                          "std": saved["init_values"]["std"], "embed_scale": saved["init_values"]["embed_scale"]},
           "greedy": {"new_tokens": NEW_TOKENS, "eos_stopping": False,
                      "method": "argmax of full no-cache forwards; equal to the reference's HuginnDynamicCache "
                                "decoding (checked)"},
           "checks": {"float64_vs_float32_max_abs": fp64},
           **({"llama3_rope": llama3} if llama3 else {}),
           **({"initial_state_modes": modes} if modes else {}),
           "generator": {"script": "scripts/reference_fixtures/raven.py", "python": sys.version.split()[0],
                         "torch": torch.__version__, "transformers": transformers.__version__,
                         "dtype": "float32 (weights stored bfloat16)", "threads": torch.get_num_threads(),
                         "reference": "LoopedLMs/retrofitting-recurrence@3797dedd3854f40d8ace983971573ed9aace0562",
                         "reference_code_sha256": {f: sha256(ref_dir / f) for f in CODE}}}
    ref["_hf"], ref["_logits"] = str(hf), logits
    return ref


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref-dir", required=True, type=Path)
    ap.add_argument("--variant", required=True, choices=["llama", "olmo"])
    ap.add_argument("--out", type=Path, default=FIXTURES)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory(prefix="tinyloop-raven-") as tmp:
        for seed in range(args.seed, args.seed + 50):
            ref = build(args.ref_dir.resolve(), args.variant, seed, Path(tmp))
            if ref is not None:
                break
        else:
            log("error: no seed passed the gap checks")
            return 1
        hf = Path(ref.pop("_hf"))
        dest = args.out / f"raven-{args.variant}-tiny"
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        cfg = json.loads((hf / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
        shutil.copyfile(hf / "model.safetensors", dest / "model.safetensors")
        for f in TOKENIZER_FILES:
            shutil.copyfile(TOKENIZER_FROM / f, dest / f)
        save_file(ref.pop("_logits"), str(dest / "reference_logits.safetensors"), metadata={"format": "pt"})
        os.chmod(dest / "reference_logits.safetensors", 0o644)
        (dest / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
        assert not list(dest.glob("*.py")), "reference code must not be copied into the fixtures"
        log(f"{dest}: seed {ref['seed']}, fp64 vs fp32 {ref['checks']['float64_vs_float32_max_abs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
