"""The tiny Ouro fixture: config with the real key names, one model.safetensors (untied head, exit gate,
GQA), the ChatML tokenizer, and the reference runs at 1, 2, 3, 4 and 6 steps."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .common import (CHAT_CASES, GREEDY_TOKENS, PROMPT_TEXT, VOCAB, check_loaded, chunks, fill_weights, finalize,
                     gap_too_small, greedy, greedy_spec, logits_spec, loop_sensitivity, new_hf_dir, run_entry,
                     save_hf_tokenizer, tokenizer_records, write_json)

CODE_FILES = ["configuration_ouro.py", "modeling_ouro.py"]
FIXTURE_FILES = ["config.json", "generation_config.json", "model.safetensors"]

OURO_CHAT_TEMPLATE_SOURCE = (
    "LoopedLMs/ouro_rl ouro_rl/modeling/chat_template.jinja at 3bad4c1891fa7a1c5e11f8eb4e59e7d1cec5502b (the same "
    "repository and commit as ../shared/reference/ouro/*.py; ChatML with a leading system message and the "
    "Thinking variants' enable_thinking switch). The hub tokenizer_config.json is not reachable from here."
)
OURO_CHAT_TEMPLATE = (
    "{# Ouro chat template with enable_thinking support. #}\n"
    "{# When enable_thinking=True, prepends <think>\\n to trigger CoT reasoning. #}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "    {%- if message.role == 'system' and loop.first -%}\n"
    "        {# Skip #}\n"
    "    {%- else -%}\n"
    "        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is true -%}\n"
    "        {{- '<think>\\n' }}\n"
    "    {%- endif -%}\n"
    "{%- endif -%}\n"
)
OURO_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_ouro_tokenizer(text: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=OURO_SPECIALS,  # trained specials come first: ids 0, 1, 2 as in the real vocabulary
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(chunks(text), trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    for i, s in enumerate(OURO_SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def make_ouro(ref_dir: Path, work: Path, out: Path, text: str, seed: int, min_gap: float) -> dict | None:
    hf = new_hf_dir(work, "ouro-hf", ref_dir / "ouro", CODE_FILES)
    cfg = {
        "architectures": ["OuroForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_ouro.OuroConfig",
            "AutoModel": "modeling_ouro.OuroModel",
            "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
        },
        "model_type": "ouro",
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 176,
        "layer_types": ["full_attention", "full_attention"],
        "max_position_embeddings": 1024,
        "max_window_layers": 2,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }
    write_json(hf / "config.json", cfg)
    config = AutoConfig.from_pretrained(str(hf), trust_remote_code=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    written = fill_weights(model, seed, "ouro")
    model.save_pretrained(str(hf), safe_serialization=True)
    # config.json: keep our hand-written real-key file (save_pretrained rewrote it with the class's dump)
    write_json(hf / "config.json", {**cfg, "transformers_version": transformers.__version__})
    write_json(
        hf / "generation_config.json",
        {"bos_token_id": 0, "eos_token_id": 2, "transformers_version": transformers.__version__},
    )
    tok_raw = build_ouro_tokenizer(text)
    save_hf_tokenizer(
        tok_raw,
        hf,
        "GPT2Tokenizer",
        OURO_CHAT_TEMPLATE,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=1024,
    )
    assert sorted(p.name for p in hf.glob("*.safetensors")) == ["model.safetensors"]

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(hf))
    prompt_ids = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    loops = [1, 2, 3, 4, 6]
    logits_out, runs, prompt_logits, greedy_ids = {}, {}, {}, {}
    models = {}
    for k in loops:
        m = AutoModelForCausalLM.from_pretrained(str(hf), trust_remote_code=True, dtype=torch.float32, total_ut_steps=k)
        m.eval()
        assert m.model.total_ut_steps == k
        models[k] = m
    check_loaded(models[4].state_dict(), written)
    attn_impl = models[4].config._attn_implementation

    def fwd(m):
        def f(seq):
            with torch.no_grad():
                return m(torch.tensor([seq]), use_cache=False).logits[0].float()

        return f

    for k in loops:
        m = models[k]
        pl = fwd(m)(prompt_ids)
        # the 1.0 early-exit threshold must select the last step (it can fire early in fp32 if gates saturate)
        with torch.no_grad():
            last = m(torch.tensor([prompt_ids]), use_cache=False, exit_at_step=k - 1).logits[0].float()
        assert torch.equal(pl, last), f"ouro loops={k}: threshold exit differs from the last step"
        g_ids, gaps = greedy(fwd(m), prompt_ids, GREEDY_TOKENS)
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
        for use_cache in (False, True):
            with torch.no_grad():
                gen = m.generate(
                    torch.tensor([prompt_ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False, use_cache=use_cache
                )
            assert gen[0, len(prompt_ids) :].tolist() == g_ids, (k, use_cache, gen.tolist(), g_ids)
        logits_out[f"loops_{k}"] = pl.contiguous()
        prompt_logits[k] = pl
        greedy_ids[k] = g_ids
        runs[str(k)] = run_entry(k, pl, g_ids, gaps, tok)
    # numerical sensitivity of the fp32 reference: the same model in float64
    fp64 = {}
    for k in loops:
        m64 = AutoModelForCausalLM.from_pretrained(
            str(hf), trust_remote_code=True, dtype=torch.float64, total_ut_steps=k
        )
        with torch.no_grad():
            l64 = m64(torch.tensor([prompt_ids]), use_cache=False).logits[0]
        fp64[str(k)] = float((l64 - prompt_logits[k].double()).abs().max())
    # k steps == exit_at_step=k-1 of the deepest model
    deep = models[max(loops)]
    step_consistency = {}
    for k in loops:
        with torch.no_grad():
            e = deep(torch.tensor([prompt_ids]), use_cache=False, exit_at_step=k - 1).logits[0].float()
        step_consistency[str(k)] = float((e - prompt_logits[k]).abs().max())
        assert step_consistency[str(k)] <= 1e-5, step_consistency
    # eager vs sdpa attention of the reference itself
    eager = AutoModelForCausalLM.from_pretrained(
        str(hf), trust_remote_code=True, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        el = eager(torch.tensor([prompt_ids]), use_cache=False).logits[0].float()
    eager_diff = float((el - prompt_logits[4]).abs().max())
    # exit gate of the trained depth
    with torch.no_grad():
        _, hs_list, gate_list = models[4].model(torch.tensor([prompt_ids]), use_cache=False)
    gate_logits = [g[0, :, 0].tolist() for g in gate_list]
    lam = [torch.sigmoid(g[0, :, 0]) for g in gate_list]
    rem = torch.ones_like(lam[0])
    pdf = []
    for i, l in enumerate(lam):
        if i < len(lam) - 1:
            pdf.append(l * rem)
            rem = rem * (1 - l)
        else:
            pdf.append(rem)
    pdf_t = torch.stack(pdf, dim=1)  # [T, steps]

    if gap_too_small("ouro", seed, runs, min_gap):
        return None
    sens = loop_sensitivity(prompt_logits, greedy_ids)
    checks, chats = tokenizer_records(tok, CHAT_CASES)
    ref = {
        "family": "ouro",
        "model_type": "ouro",
        "seed": seed,
        "prompt": {"text": PROMPT_TEXT, "ids": prompt_ids},
        "vocab_size": VOCAB,
        "loop_parameter": "total_ut_steps (from_pretrained(..., total_ut_steps=k); read once at construction)",
        "default_loops": 4,
        "loops": loops,
        "runs": runs,
        "greedy": greedy_spec(),
        "logits": logits_spec(loops, len(prompt_ids)),
        "exit_gate": {
            "loops": 4,
            "gate_logits": gate_logits,  # [steps][T]: early_exit_gate(h_t)
            "exit_pdf": pdf_t.tolist(),  # [T][steps]
            "threshold": 1.0,
            "note": "the 1.0 threshold selects the last step at every position (checked)",
        },
        "loop_sensitivity": sens,
        "checks": {
            "k_steps_vs_exit_at_step_of_6_step_model_max_abs": step_consistency,
            "eager_vs_default_attention_max_abs_loops_4": eager_diff,
            "float64_vs_float32_max_abs": fp64,
            "generate_matches_greedy": {"use_cache_false": True, "use_cache_true": True},
            "attn_implementation": attn_impl,
        },
        "special_tokens": {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2},
        "eos": {"config": 2, "generation_config": 2, "tokenizer": 0, "stop_on": [0, 2]},
        "tokenizer_checks": checks,
        "chat_template": {"source": OURO_CHAT_TEMPLATE_SOURCE, "cases": chats},
    }
    finalize(hf, out / "ouro-tiny", FIXTURE_FILES, ref, logits_out, ref_dir / "ouro", CODE_FILES)
    return ref
