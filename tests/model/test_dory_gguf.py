"""NVIDIA Dory1.0 from llama.cpp's `dory` GGUF (issue 55): the tiny checkpoint of test_dory.py written as llama.cpp's
converter writes it, converted by `tinyloop convert x.gguf`, against test_dory.py's numpy reference."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tinyloop.engine import Engine, SamplingParams
from tinyloop.tools.convert import convert

# test_dory.py's checkpoint writer and reference (loaded under a name of its own: pytest collects that file too)
_spec = importlib.util.spec_from_file_location("dory_fixture", Path(__file__).parent / "test_dory.py")
D = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(D)
TOKENIZER, VOCAB, PATTERN, DEFAULT_LOOPS, PROMPT = D.TOKENIZER, D.VOCAB, D.PATTERN, D.DEFAULT_LOOPS, D.PROMPT
D_MODEL, NH, NK, HD, FF, WINDOW, COUNTS, STD = D.D_MODEL, D.NH, D.NK, D.HD, D.FF, D.WINDOW, D.COUNTS, D.STD
hf_config, reference, reference_greedy = D.hf_config, D.reference, D.reference_greedy


@pytest.fixture(scope="module")
def weights():
    return D.random_weights()


GGUF_NAMES = {"mlp_alpha": "dory_alpha", "attn_alpha": "dory_alpha", "mixer.gate_proj": "ffn_gate",
              "mixer.up_proj": "ffn_up", "mixer.down_proj": "ffn_down", "mixer.suv_gate": "dory_suv_gate",
              "mixer.suv_up": "dory_suv_up", "mixer.q_proj": "attn_q", "mixer.k_proj": "attn_k",
              "mixer.v_proj": "attn_v", "mixer.g_proj": "attn_gate", "mixer.o_proj": "attn_output",
              "mixer.sqk": "dory_sqk", "mixer.s_gate": "dory_s_gate"}


def gguf_name(hf_name: str) -> str:
    """A Hugging Face tensor name -> llama.cpp's `dory` GGUF name (its conversion/dory.py's table)."""
    top = {"backbone.embeddings.weight": "token_embd.weight", "lm_head.weight": "output.weight",
           "lm_head.logit_scale": "dory_logit_scale.weight"}
    if hf_name in top:
        return top[hf_name]
    parts = hf_name.split(".")
    rest = ".".join(parts[3:]).removesuffix(".weight")
    return f"blk.{parts[2]}.{GGUF_NAMES[rest]}.weight"


def write_dory_gguf(path: Path, hf: dict, w: dict[str, np.ndarray], qtype=None) -> dict[str, np.ndarray]:
    """The checkpoint as llama.cpp's converter writes it (full rotary: llama.cpp's Dory has no partial RoPE);
    returns the weights under Hugging Face names as the GGUF holds them (a Q8_0 matrix dequantized)."""
    gguf = pytest.importorskip("gguf")
    spec = json.loads((TOKENIZER / "tokenizer.json").read_text())
    tokens = [None] * VOCAB
    types = [1] * VOCAB
    for t, i in spec["model"]["vocab"].items():
        tokens[i] = t
    for a in spec["added_tokens"]:
        tokens[a["id"]], types[a["id"]] = a["content"], 3 if a["special"] else 4
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    wr = gguf.GGUFWriter(str(path), "dory")
    wr.add_block_count(len(PATTERN))
    wr.add_context_length(hf["max_position_embeddings"])
    wr.add_embedding_length(D_MODEL)
    wr.add_feed_forward_length(FF)
    wr.add_head_count(NH)
    wr.add_head_count_kv(NK)
    wr.add_key_length(HD)
    wr.add_value_length(HD)
    wr.add_rope_dimension_count(HD)
    wr.add_rope_freq_base(hf["rope_theta"])
    wr.add_sliding_window(WINDOW)
    for key, value in zip(("input", "recurrent", "output"), COUNTS):
        wr.add_uint32(f"dory.{key}_layer_count", value)
    wr.add_uint32("dory.recurrent_loop_count", hf["n_recurrent_loops"])
    wr.add_string("dory.layer_pattern", PATTERN)
    wr.add_string("dory.recurrent_kv_cache_mode", hf["recurrent_kv_cache_mode"])
    wr.add_array("dory.rope.profile", hf["rope_profile_layers"])
    wr.add_float32("dory.rope.freq_base_2", hf["rope_theta_2"])
    wr.add_float32("dory.init_std", STD)
    wr.add_float32("dory.alpha_init", hf["ngpt_alpha_init"])
    wr.add_float32("dory.gate_init", math.sqrt(D_MODEL))
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("qwen2")
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    wr.add_eos_token_id(505)
    wr.add_chat_template((TOKENIZER / "chat_template.jinja").read_text())
    held = {}
    for name, arr in w.items():
        if qtype is not None and arr.ndim == 2:
            raw = gguf.quants.quantize(arr, qtype)
            wr.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
            held[name] = gguf.quants.dequantize(raw, qtype).reshape(arr.shape).astype(np.float32)
        else:
            wr.add_tensor(gguf_name(name), arr)
            held[name] = arr
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return held


@pytest.mark.parametrize("mode,qtype", [("per_loop", None), ("last_loop", "Q8_0")])
def test_a_dory_gguf_converts_to_the_same_model(tmp_path, weights, mode, qtype):
    """The same weights as llama.cpp's `dory` GGUF (F32, or Q8_0 matrices, which convert exactly): fp32 logits
    within 1e-4 of the reference at loops 1-4, the KV mode, depth and chat template from the metadata, and
    cached greedy decoding equal to the reference's."""
    gguf = pytest.importorskip("gguf")
    hf = hf_config(mode, partial_rotary_factor=1.0, partial_rotary_factor_2=1.0)
    held = write_dory_gguf(tmp_path / "dory.gguf", hf, weights,
                           None if qtype is None else getattr(gguf.GGMLQuantizationType, qtype))
    out = convert(tmp_path / "dory.gguf", tmp_path / "dory.tinyloop", dtype="float32", progress=False)
    engine = Engine.load(out)
    cfg = engine.config
    assert (cfg.kv_mode, cfg.default_loops, cfg.layer_pattern, cfg.rotary_dim) == (mode, DEFAULT_LOOPS, PATTERN, 0)
    assert engine.tokenizer.chat_template == (TOKENIZER / "chat_template.jinja").read_text()
    with torch.inference_mode():
        for loops in (1, 2, 3, 4):
            got = engine.model(torch.tensor([PROMPT]), loops)[0, :, :VOCAB].float().numpy()
            assert np.abs(got - reference(held, hf, PROMPT, loops)).max() < 1e-4, (mode, qtype, loops)
    want, _ = reference_greedy(held, hf, PROMPT, 2, 6)
    assert engine.generate(PROMPT, SamplingParams(max_tokens=6, loops=2, temperature=0, ignore_eos=True)).token_ids \
        == want
