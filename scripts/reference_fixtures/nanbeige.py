"""The tiny Nanbeige4.2 fixture: a config with the real key names and `auto_map`, one model.safetensors
(untied head; GQA 12:2 with head_dim 16 on a 64 hidden, so q_proj is 3x wider than the hidden size, the real
model's 6:1 query-to-kv ratio; 2 layers looped `num_loops` 2 times), a ChatML tokenizer with its special
tokens at the end of the vocabulary, the checkpoint's own chat template in chat_template.jinja (as the Hub
repository ships it), and the reference runs at 1, 2, 3 and 4 loops, with the final norm after every loop and
(the same weights) with `skip_loop_final_norm`.

The remote code's `generate(use_cache=True)` fails on transformers 4.57 (`Cache.get_max_length`): cached
decoding is checked through its forward with an explicit DynamicCache, which it fills per loop (slot
`layer + loop * num_hidden_layers`), against full no-cache forwards. A seed must give every depth its own
greedy continuation under both norm rules, besides the common greedy-gap rule."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from .common import (GREEDY_TOKENS, PROMPT_TEXT, VOCAB, check_loaded, chunks, fill_weights, finalize, gap_too_small,
                     greedy, greedy_spec, log, logits_spec, loop_sensitivity, new_hf_dir, run_entry, tokenizer_records,
                     top2_gap, write_json)

CODE_FILES = ["configuration_nanbeige.py", "modeling_nanbeige.py"]
FIXTURE_FILES = ["config.json", "generation_config.json", "model.safetensors", "chat_template.jinja"]
LOOPS = [1, 2, 3, 4]
TEMPLATE_SOURCE = (
    "github johnhalloran321/Nanbeige4.2-3B-mps-fix at a8de726, patch/chat_template.jinja: a copy of the Hub "
    "repository's chat_template.jinja (Nanbeige/Nanbeige4.2-3B at 5d54321e); that repository's README says its "
    "template file is byte-identical to the original (its system-prompt fix patches the rendered text, not the "
    "file). The Hub file itself is not reachable from here"
)
# ChatML specials, then the template's tags as plain added tokens (matched in text, kept by decode)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string",
                   "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]
CHAT_CASES = [  # (messages, template variables beyond add_generation_prompt)
    ([{"role": "user", "content": "What is a loop? Answer in one word — please."}], {}),
    ([{"role": "user", "content": "What is a loop? Answer in one word — please."}], {"enable_thinking": False}),
    ([{"role": "system", "content": "You are terse."},
      {"role": "user", "content": "Hello there!"},
      {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\n  Good day, café friend.  "},
      {"role": "user", "content": "Count to 3."}], {"enable_thinking": True}),
    ([{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
          "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
      {"role": "tool", "content": "{\"temp\": 21}"}], {"tools": TOOLS}),
]


def build_tokenizer(text: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    n_added = len(SPECIALS) + len(TAGS)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - n_added, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(chunks(text), trainer)
    assert tok.get_vocab_size() == VOCAB - n_added, tok.get_vocab_size()
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    assert tok.get_vocab_size() == VOCAB
    return tok


def hub_config(skip_norm: bool = False) -> dict:
    return {
        "architectures": ["NanbeigeForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_nanbeige.NanbeigeConfig",
                     "AutoModel": "modeling_nanbeige.NanbeigeModel",
                     "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM"},
        "model_type": "nanbeige",
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "hidden_act": "silu",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 1024, "initializer_range": 0.02, "rms_norm_eps": 1e-06,
        "rope_theta": 70000000.0, "rope_scaling": None, "pretraining_tp": 1,
        "num_loops": 2, "skip_loop_final_norm": skip_norm, "loop_loss_weights": [],
        "enable_double_loop_split": False, "loop_share_kv": False, "enable_hyper_connection": False,
        "enable_mhc": False, "enable_depth_attention": False, "qk_layernorm": False,
        "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True, "vocab_size": VOCAB,
        "bos_token_id": None, "pad_token_id": None, "eos_token_id": VOCAB - len(TAGS) - 1,  # <|im_end|>
    }


def cached_greedy(m, ids: list[int], n: int) -> tuple[list[int], float]:
    """Greedy decoding through the reference's own per-loop cache (a DynamicCache, layer + loop * layers):
    the prompt in one forward, then one token a step. Returns the tokens and the largest difference of its
    logits from full no-cache forwards of the same sequences."""
    cache, seq, out, diff = DynamicCache(), list(ids), [], 0.0
    with torch.no_grad():
        logits = m(torch.tensor([seq]), use_cache=True, past_key_values=cache).logits[0, -1].float()
        for _ in range(n):
            full = m(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
            diff = max(diff, float((logits - full).abs().max()))
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            seq.append(nxt)
            logits = m(torch.tensor([[nxt]]), use_cache=True, past_key_values=cache).logits[0, -1].float()
    return out, diff


def hf_generate(m, ids: list[int], want: list[int]) -> dict:
    """HF generate, greedy, EOS off: without a cache it must equal `want`; with one, what it does is recorded
    (the remote code calls Cache.get_max_length, which transformers 4.57 no longer has)."""
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    out = {}
    for use_cache in (False, True):
        try:
            with torch.no_grad():
                gen = m.generate(torch.tensor([ids]), max_new_tokens=len(want), do_sample=False, use_cache=use_cache)
            got = gen[0, len(ids):].tolist()
            out[f"use_cache_{str(use_cache).lower()}"] = "equal to greedy" if got == want else f"differs: {got}"
        except Exception as exc:  # noqa: BLE001 (recorded, not hidden: reference.json says what failed)
            out[f"use_cache_{str(use_cache).lower()}"] = f"{type(exc).__name__}: {exc}"
    assert out["use_cache_false"] == "equal to greedy", out
    return out


def chat_records(tok) -> list[dict]:
    chats = []
    for msgs, kwargs in CHAT_CASES:
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
        ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = list(ids["input_ids"])
        assert ids == tok.encode(text, add_special_tokens=False), "template ids != encode(text)"
        chats.append({"messages": msgs, "add_generation_prompt": True, "template_kwargs": kwargs, "text": text,
                      "ids": list(ids)})
    return chats


def make_nanbeige(ref_dir: Path, work: Path, out: Path, text: str, seed: int, min_gap: float) -> dict | None:
    code = ref_dir / "nanbeige"
    hf = new_hf_dir(work, "nanbeige-hf", code, CODE_FILES)
    cfg = hub_config()
    write_json(hf / "config.json", cfg)
    config = AutoConfig.from_pretrained(str(hf), trust_remote_code=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    written = fill_weights(model, seed, "nanbeige")
    model.save_pretrained(str(hf), safe_serialization=True)
    write_json(hf / "config.json", {**cfg, "transformers_version": transformers.__version__})
    im_end, eot = VOCAB - len(TAGS) - 1, VOCAB - len(TAGS) - 3
    write_json(hf / "generation_config.json", {"eos_token_id": [im_end, eot], "do_sample": True, "temperature": 0.6,
                                               "top_p": 0.95, "top_k": 20,
                                               "transformers_version": transformers.__version__})
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(text), clean_up_tokenization_spaces=False,
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"], model_max_length=1024)
    fast.chat_template = (code / "chat_template.jinja").read_text(encoding="utf-8")
    fast.save_pretrained(str(hf))
    assert (hf / "chat_template.jinja").read_text(encoding="utf-8") == fast.chat_template  # its own file, as on the Hub
    assert sorted(p.name for p in hf.glob("*.safetensors")) == ["model.safetensors"]

    tok = AutoTokenizer.from_pretrained(str(hf))
    prompt_ids = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    logits_out, runs, prompt_logits, greedy_ids, checks = {}, {}, {}, {}, {"cached_vs_full_max_abs": {},
                                                                            "float64_vs_float32_max_abs": {},
                                                                            "generate": {}}

    def load(k: int, dtype=torch.float32, **kw):
        m = AutoModelForCausalLM.from_pretrained(str(hf), trust_remote_code=True, dtype=dtype, num_loops=k, **kw)
        assert m.model._get_num_loops() == k
        return m.eval()

    def fwd(m):
        def f(seq):
            with torch.no_grad():
                return m(torch.tensor([seq]), use_cache=False).logits[0].float()
        return f

    for k in LOOPS:
        m = load(k)
        if k == LOOPS[0]:
            check_loaded(m.state_dict(), written)
            inv = m.model.layers[0].self_attn.rotary_emb.inv_freq
            assert float(inv.min()) > 0, "the reference's RoPE buffer was zeroed on load (MPS_FIX_NOTES bug 4)"
            checks["attn_implementation"] = m.config._attn_implementation
            checks["rope_inv_freq_as_loaded"] = inv.tolist()  # not zeroed by this transformers (MPS_FIX_NOTES bug 4)
        pl = fwd(m)(prompt_ids)
        g_ids, gaps = greedy(fwd(m), prompt_ids, GREEDY_TOKENS)
        c_ids, cdiff = cached_greedy(m, prompt_ids, GREEDY_TOKENS)
        assert c_ids == g_ids, (k, c_ids, g_ids)
        checks["cached_vs_full_max_abs"][str(k)] = cdiff
        checks["generate"][str(k)] = hf_generate(m, prompt_ids, g_ids)
        with torch.no_grad():
            l64 = load(k, torch.float64)(torch.tensor([prompt_ids]), use_cache=False).logits[0]
        checks["float64_vs_float32_max_abs"][str(k)] = float((l64 - pl.double()).abs().max())
        logits_out[f"loops_{k}"] = pl.contiguous()
        prompt_logits[k], greedy_ids[k] = pl, g_ids
        runs[str(k)] = run_entry(k, pl, g_ids, gaps, tok)
        # the same weights with skip_loop_final_norm: the norm only after the last loop
        ms = load(k, skip_loop_final_norm=True)
        sl = fwd(ms)(prompt_ids)
        s_ids, s_gaps = greedy(fwd(ms), prompt_ids, GREEDY_TOKENS)
        logits_out[f"skip_norm_loops_{k}"] = sl.contiguous()
        runs[f"skip_norm_{k}"] = {**run_entry(k, sl, s_ids, s_gaps, tok), "logits_key": f"skip_norm_loops_{k}"}
    eager = load(2, attn_implementation="eager")
    with torch.no_grad():
        el = eager(torch.tensor([prompt_ids]), use_cache=False).logits[0].float()
    checks["eager_vs_default_attention_max_abs_loops_2"] = float((el - prompt_logits[2]).abs().max())
    # at one loop both place the one final norm after the only loop; deeper, the runs differ
    checks["skip_norm_vs_loop_norm_max_abs"] = {str(k): float((logits_out[f"skip_norm_loops_{k}"]
                                                               - logits_out[f"loops_{k}"]).abs().max()) for k in LOOPS}
    checks["skip_norm_differs_at"] = [k for k in LOOPS if not torch.allclose(
        logits_out[f"skip_norm_loops_{k}"], logits_out[f"loops_{k}"], atol=1e-3)]

    if gap_too_small("nanbeige", seed, runs, min_gap):
        return None
    for mode in ("", "skip_norm_"):  # every depth its own continuation, with either norm rule (a loop bug shows)
        if len({tuple(runs[f"{mode}{k}"]["greedy_ids"]) for k in LOOPS}) < len(LOOPS):
            log(f"  nanbeige seed {seed}: two depths{' (skip_loop_final_norm)' if mode else ''} give the same "
                "greedy tokens; trying another seed")
            return None
    tok_checks, _ = tokenizer_records(tok, [])
    ref = {
        "family": "nanbeige",
        "model_type": "nanbeige",
        "seed": seed,
        "prompt": {"text": PROMPT_TEXT, "ids": prompt_ids},
        "vocab_size": VOCAB,
        "loop_parameter": ("num_loops (from_pretrained(..., num_loops=k)); skip_norm_* runs add "
                           "skip_loop_final_norm=True"),
        "default_loops": cfg["num_loops"],
        "loops": LOOPS,
        "runs": runs,
        "greedy": {**greedy_spec(), "cached": "equal to greedy through the reference's DynamicCache (checked)"},
        "logits": {**logits_spec(LOOPS, len(prompt_ids)), "keys": sorted(logits_out)},
        "loop_sensitivity": loop_sensitivity(prompt_logits, greedy_ids),
        "checks": checks,
        "special_tokens": {s: tok.convert_tokens_to_ids(s) for s in SPECIALS + TAGS},
        "eos": {"config": im_end, "generation_config": [im_end, eot], "tokenizer": im_end, "stop_on": [im_end, eot]},
        "tokenizer_checks": tok_checks,
        "chat_template": {"source": TEMPLATE_SOURCE, "file": "chat_template.jinja", "cases": chat_records(tok)},
        "top2_gap_min_prompt": min(top2_gap(r) for pl in prompt_logits.values() for r in pl),
    }
    finalize(hf, out / "nanbeige-tiny", FIXTURE_FILES, ref, logits_out, code, CODE_FILES)
    return ref
