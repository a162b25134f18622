"""The tiny Huginn fixture: the reference config class's config.json, two shards with an index (tied head,
q/k biases, the freqs_cis buffer), the aeolian-split tokenizer with its specials at the end of the
vocabulary, and the reference runs at 1, 2, 4 and 8 steps from the zero initial state."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .common import (CHAT_CASES, GREEDY_TOKENS, PROMPT_TEXT, VOCAB, check_loaded, chunks, fill_weights, finalize,
                     gap_too_small, greedy, greedy_spec, logits_spec, loop_sensitivity, new_hf_dir, run_entry,
                     save_hf_tokenizer, tokenizer_records, write_json)

CODE_FILES = ["raven_config_minimal.py", "raven_modeling_minimal.py"]

HUGINN_CHAT_TEMPLATE_SOURCE = (
    "seal-rg/recurrent-pretraining: the template the authors' checkpoint conversion/upload script sets on the "
    "tokenizer it pushes next to the model (\"sean template\", with {% generation %}); the hub "
    "tokenizer_config.json is not reachable from here."
)
HUGINN_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set start_content = '<|begin_header|>' %}"
    "{% set end_content = message['content'] | trim  + '<|end_turn|>' %}{% if loop.index0 == 0 %}"
    "{% set start_content = bos_token + start_content %}{% endif %}"
    "{% if message['role'] == 'Huginn' or message['role'] == 'assistant' %}"
    "{% set start_content = start_content + 'Huginn<|end_header|>\\n\\n' %}{{ start_content }}"
    "{% generation %}{{ end_content }}{% endgeneration %}{% else %}"
    "{% set start_content = start_content + message['role'] + '<|end_header|>\\n\\n' %}{{ start_content }}"
    "{{ end_content }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|begin_header|>Huginn<|end_header|>\\n\\n' }}{% else %}{{ '<|end_text|>' }}{% endif %}"
)
def build_huginn_tokenizer(text: str, ref_dir: Path) -> tuple[Tokenizer, list[str]]:
    regex = (ref_dir / "huginn" / "aeolian_regex.txt").read_text(encoding="utf-8")
    specials = json.loads((ref_dir / "huginn" / "special_tokens_complete.json").read_text(encoding="utf-8"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # no post-processor: prompts carry <|begin_text|> explicitly, as in the real tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - len(specials),
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(chunks(text), trainer)
    assert tok.get_vocab_size() == VOCAB - len(specials), tok.get_vocab_size()
    tok.add_special_tokens(specials)  # appended: the END of the vocabulary, as in the real one (65504 ...)
    assert tok.get_vocab_size() == VOCAB
    for i, s in enumerate(specials):
        assert tok.token_to_id(s) == VOCAB - len(specials) + i
    return tok, specials


def make_huginn(ref_dir: Path, work: Path, out: Path, text: str, seed: int, min_gap: float) -> dict | None:
    hf = new_hf_dir(work, "huginn-hf", ref_dir / "huginn", CODE_FILES)
    tok_raw, specials = build_huginn_tokenizer(text, ref_dir)
    sid = {s: VOCAB - len(specials) + i for i, s in enumerate(specials)}
    # the reference config class writes the full config.json (the real files come from it); we then add the
    # hub-only keys
    minimal = {
        "architectures": ["RavenForCausalLM"],
        "auto_map": {
            "AutoConfig": "raven_config_minimal.RavenConfig",
            "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM",
        },
        "model_type": "huginn_raven",
        "n_embd": 64,
        "n_heads": 4,
        "n_layers": 4,
        "n_layers_in_prelude": 1,
        "n_layers_in_recurrent_block": 2,
        "n_layers_in_coda": 1,
        "mean_recurrence": 4,
        "mean_backprop_depth": 2,
        "block_size": 256,
        "vocab_size": VOCAB,
        "padding_multiple": 64,
        "intermediate_size": 176,
        "qk_bias": True,
        "tie_embeddings": True,
        "bias": False,
        "rope_base": 50000,
        "norm_eps": 1e-06,
        "torch_dtype": "float32",
        "bos_token_id": sid["<|begin_text|>"],
        "eos_token_id": sid["<|end_text|>"],
        "pad_token_id": sid["<|pad|>"],
    }
    write_json(hf / "config.json", minimal)
    config = AutoConfig.from_pretrained(str(hf), trust_remote_code=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    written = fill_weights(model, seed, "huginn")
    total = sum(v.numel() * v.element_size() for k, v in written.items() if k != "lm_head.weight")
    model.save_pretrained(str(hf), safe_serialization=True, max_shard_size=int(total * 0.6))
    shards = sorted(p.name for p in hf.glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], shards
    saved_cfg = json.loads((hf / "config.json").read_text(encoding="utf-8"))
    if "dtype" in saved_cfg and "torch_dtype" not in saved_cfg:
        saved_cfg["torch_dtype"] = saved_cfg.pop("dtype")
    saved_cfg["torch_dtype"] = "float32"
    saved_cfg["padded_vocab_size"] = VOCAB
    hub_keys = ("architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id")
    saved_cfg.update({k: minimal[k] for k in hub_keys})
    write_json(hf / "config.json", dict(sorted(saved_cfg.items())))
    write_json(
        hf / "generation_config.json",
        {
            "bos_token_id": sid["<|begin_text|>"],
            "eos_token_id": [sid["<|end_text|>"], sid["<|end_turn|>"]],
            "pad_token_id": sid["<|pad|>"],
            "transformers_version": transformers.__version__,
        },
    )
    save_hf_tokenizer(
        tok_raw,
        hf,
        "PreTrainedTokenizerFast",
        HUGINN_CHAT_TEMPLATE,
        bos_token="<|begin_text|>",
        eos_token="<|end_text|>",
        pad_token="<|pad|>",
        model_max_length=256,
    )

    tok = AutoTokenizer.from_pretrained(str(hf))
    prompt_ids = [sid["<|begin_text|>"]] + tok.encode(PROMPT_TEXT, add_special_tokens=False)
    assert tok.encode("<|begin_text|>" + PROMPT_TEXT, add_special_tokens=False) == prompt_ids
    m = AutoModelForCausalLM.from_pretrained(str(hf), trust_remote_code=True, dtype=torch.float32)
    m.eval()
    loaded = m.state_dict()
    check_loaded(loaded, written)
    assert torch.equal(loaded["lm_head.weight"], loaded["transformer.wte.weight"])
    saved_keys = set()
    for s in shards:
        saved_keys |= set(load_file(str(hf / s)).keys())
    assert "freqs_cis" in saved_keys and "lm_head.weight" not in saved_keys, sorted(saved_keys)

    loops = [1, 2, 4, 8]

    def fwd(k):
        def f(seq):
            with torch.no_grad():
                return m(torch.tensor([seq]), num_steps=k, init_scale=0.0, use_cache=False).logits[0].float()

        return f

    # the default init_scale=1.0 is random: show it (two calls differ)
    with torch.no_grad():
        r1 = m(torch.tensor([prompt_ids]), num_steps=4, use_cache=False).logits[0]
        r2 = m(torch.tensor([prompt_ids]), num_steps=4, use_cache=False).logits[0]
    random_default_diff = float((r1 - r2).abs().max())
    logits_out, runs, prompt_logits, greedy_ids = {}, {}, {}, {}
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = sid["<|pad|>"]
    gen_check = {}
    for k in loops:
        pl = fwd(k)(prompt_ids)
        z = torch.zeros(1, len(prompt_ids), 64)
        with torch.no_grad():
            pz = m(torch.tensor([prompt_ids]), num_steps=k, input_states=z, use_cache=False).logits[0].float()
        assert torch.equal(pl, pz), "init_scale=0.0 != input_states=zeros"
        g_ids, gaps = greedy(fwd(k), prompt_ids, GREEDY_TOKENS)
        for use_cache in (False, True):
            with torch.no_grad():
                gen = m.generate(
                    torch.tensor([prompt_ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                    use_cache=use_cache, num_steps=k, init_scale=0.0,
                )
            gen_check[f"{k}_cache_{use_cache}"] = gen[0, len(prompt_ids):].tolist() == g_ids
            assert gen[0, len(prompt_ids):].tolist() == g_ids, (k, use_cache, gen.tolist(), g_ids)
        logits_out[f"loops_{k}"] = pl.contiguous()
        prompt_logits[k] = pl
        greedy_ids[k] = g_ids
        runs[str(k)] = run_entry(k, pl, g_ids, gaps, tok)
    m64 = AutoModelForCausalLM.from_pretrained(str(hf), trust_remote_code=True, dtype=torch.float64)
    fp64 = {}
    for k in loops:
        with torch.no_grad():
            l64 = m64(torch.tensor([prompt_ids]), num_steps=k, init_scale=0.0, use_cache=False).logits[0]
        fp64[str(k)] = float((l64 - prompt_logits[k].double()).abs().max())
    if gap_too_small("huginn", seed, runs, min_gap):
        return None
    sens = loop_sensitivity(prompt_logits, greedy_ids)
    checks, chats = tokenizer_records(tok, CHAT_CASES)
    stop_ids = sorted({sid["<|end_text|>"], sid["<|end_turn|>"]})
    ref = {
        "family": "huginn",
        "model_type": "huginn_raven",
        "seed": seed,
        "prompt": {"text": "<|begin_text|>" + PROMPT_TEXT, "ids": prompt_ids},
        "vocab_size": VOCAB,
        "loop_parameter": "num_steps (forward(num_steps=k, init_scale=0.0): zero initial state)",
        "initial_state": "zeros",
        "default_loops": 4,
        "loops": loops,
        "runs": runs,
        "greedy": greedy_spec(),
        "logits": logits_spec(loops, len(prompt_ids)),
        "loop_sensitivity": sens,
        "checks": {
            "init_scale_0_equals_input_states_zeros": True,
            "default_init_scale_1_two_calls_max_abs_diff": random_default_diff,
            "float64_vs_float32_max_abs": fp64,
            "generate_matches_greedy": gen_check,
        },
        "special_tokens": {s: sid[s] for s in specials},
        "eos": {"config": sid["<|end_text|>"], "generation_config": stop_ids, "tokenizer": sid["<|end_text|>"],
                "stop_on": stop_ids},
        "tokenizer_checks": checks,
        "chat_template": {"source": HUGINN_CHAT_TEMPLATE_SOURCE, "cases": chats},
    }
    files = ["config.json", "generation_config.json", "model.safetensors.index.json"] + shards
    finalize(hf, out / "huginn-tiny", files, ref, logits_out, ref_dir / "huginn", CODE_FILES)
    return ref
