"""A model's trained depth range and `reasoning_effort` choosing the depth (issue 55, items 3 and 4).

The range is the family's declaration (`ModelConfig.trained_loops`, left out of file headers when none); the
request plan (`plan_request`, which every route's request passes) turns an effort into a depth inside it when
the request names none. Here: the config field, each family's declaration, the plan, and a tiny Dory model
(nGPT blocks, the family's own config mapping) generating at the depth each effort picks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tinyloop.config import ConfigError, ModelConfig, preset
from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.plan import plan_request
from tinyloop.errors import ValidationError
from tinyloop.model.families import dory, huginn, nanbeige, ouro

SRC = Path("snapshot")


def dory_hf(loops: int = 4, vocab: int = 512) -> dict:
    """A tiny Dory config.json (the release's keys; 2 input, 3 recurrent, 2 output layers)."""
    return {"architectures": ["DoryForCausalLM"], "model_type": "dory", "dory_format_version": 1,
            "vocab_size": vocab, "hidden_size": 32, "num_hidden_layers": 7, "intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "attention_head_dim": 16,
            "max_position_embeddings": 128, "tie_word_embeddings": False, "hybrid_layer_pattern": "S-*S-*-",
            "swa_window_size": 3, "init_method_std": 0.02, "n_input_layers": 2, "n_recurrent_layers": 3,
            "n_output_layers": 2, "n_recurrent_loops": loops, "recurrent_kv_cache_mode": "per_loop"}


def llama_hf(**over) -> dict:
    return {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
            "num_hidden_layers": 2, "vocab_size": 512, **over}


# -- the declaration --------------------------------------------------------------------------------------
def test_trained_loops_is_left_out_of_headers_at_its_default_and_round_trips():
    assert "trained_loops" not in preset("tiny").to_dict()      # files written before it read the same
    cfg = preset("tiny").replace(trained_loops=(1, 4))
    assert cfg.to_dict()["trained_loops"] == [1, 4] and ModelConfig.from_dict(cfg.to_dict()) == cfg
    for bad in ((0, 2), (3, 2), (1, 65), (2,)):
        with pytest.raises(ConfigError, match="trained_loops"):
            preset("tiny").replace(trained_loops=bad)


def test_effort_maps_onto_the_trained_range():
    cfg = preset("tiny").replace(trained_loops=(1, 4))
    got = {e: cfg.effort_loops(e) for e in ("none", "minimal", "low", "medium", "high", "xhigh", "max")}
    assert got == {"none": 1, "minimal": 1, "low": 1, "medium": 2, "high": 4, "xhigh": 4, "max": 4}
    assert [preset("tiny").replace(trained_loops=r).effort_loops("medium") for r in ((1, 3), (2, 8), (4, 4))] == [2, 5, 4]
    assert preset("tiny").effort_loops("high") is None      # no declared range


def test_each_family_declares_what_its_config_says():
    # Dory: every depth 1..n_recurrent_loops (HF config and, with the same rule, its GGUF)
    assert dory.config(dory_hf(4), SRC, [0]).trained_loops == (1, 4)
    assert dory.config(dory_hf(2), SRC, [0]).trained_loops == (1, 2)
    # Ouro: the loss at every exit step 1..total_ut_steps
    assert ouro.config(llama_hf(total_ut_steps=4), SRC, [0]).trained_loops == (1, 4)
    # Nanbeige: with no loop_loss_weights only the last loop's loss: num_loops alone
    assert nanbeige.config(llama_hf(num_loops=2), SRC, [0]).trained_loops == (2, 2)
    # Huginn (and its retrofits, Parcae): a sampled recurrence with no declared bound: none
    hug = {"n_embd": 32, "n_heads": 4, "intermediate_size": 64, "n_layers_in_prelude": 1,
           "n_layers_in_recurrent_block": 2, "n_layers_in_coda": 1, "vocab_size": 512, "mean_recurrence": 8}
    assert huginn.huginn_config(hug, SRC, [0]).trained_loops == ()


# -- the plan ---------------------------------------------------------------------------------------------
RANGED = preset("tiny").replace(default_loops=4, trained_loops=(1, 4))


def plan(params: SamplingParams, cfg: ModelConfig = RANGED):
    return plan_request([1, 2, 3], params, cfg, max_seq_len=cfg.max_seq_len)


def test_effort_picks_the_depth_and_an_explicit_one_wins():
    for effort, depth in (("low", 1), ("medium", 2), ("high", 4), ("minimal", 1), ("xhigh", 4)):
        p = plan(SamplingParams(max_tokens=2, reasoning_effort=effort))
        assert p.loops == p.params.loops == depth, effort
    assert plan(SamplingParams(max_tokens=2, loops=7, reasoning_effort="low")).loops == 7      # beyond the range
    assert plan(SamplingParams(max_tokens=2, loops="auto", reasoning_effort="low")).params.loops == "auto"
    spec = plan(SamplingParams(max_tokens=2, mode="speculative", reasoning_effort="high"))
    assert (spec.loops, spec.draft_loops) == (4, 1)                                  # verify at the effort's depth
    spec = plan(SamplingParams(max_tokens=2, mode="speculative", verify_loops=3, reasoning_effort="high"))
    assert spec.loops == 3                                                           # verify_loops wins
    assert plan(SamplingParams(max_tokens=2)).loops == 4                             # no effort: the default


def test_a_model_without_a_range_keeps_its_default_and_never_errors():
    tiny = preset("tiny")
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh"):
        assert plan(SamplingParams(max_tokens=2, reasoning_effort=effort), tiny).loops == tiny.default_loops
    with pytest.raises(ValidationError) as err:
        plan(SamplingParams(max_tokens=2, reasoning_effort="extreme"), tiny)
    assert err.value.param == "reasoning_effort"


def test_effort_low_with_speculation_names_the_depth():
    """Effort low on a range from 1 leaves nothing shallower to draft at: the 400 names draft_loops."""
    with pytest.raises(ValidationError) as err:
        plan(SamplingParams(max_tokens=2, mode="speculative", reasoning_effort="low"))
    assert err.value.param == "draft_loops"


# -- a tiny Dory model --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dory_engine(tmp_path_factory):
    from conftest import varied_model
    from tinyloop.modelfile.loader import write_model
    from tinyloop.tokenizer import Tokenizer

    cfg = dory.config(dory_hf(4, vocab=50257), SRC, [50256]).replace(max_seq_len=64)
    path = tmp_path_factory.mktemp("dory") / "dory.tinyloop"
    write_model(path, varied_model(cfg, seed=3), tokenizer=Tokenizer.gpt2())
    return Engine.load(path)


def test_a_dory_model_generates_at_the_depth_each_effort_picks(dory_engine):
    eng = dory_engine
    assert eng.model_info()["trained_loops"] == [1, 4] and eng.model_info()["default_loops"] == 4
    prompt = [464, 5822, 318, 257]
    outs = {}
    for effort, depth in (("low", 1), ("medium", 2), ("high", 4)):
        got = eng.generate(prompt, SamplingParams(max_tokens=6, reasoning_effort=effort, ignore_eos=True))
        want = eng.generate(prompt, SamplingParams(max_tokens=6, loops=depth, ignore_eos=True))
        assert got.stats["loops_used"] == depth and got.stats["loops_histogram"] == {str(depth): 6}
        assert got.token_ids == want.token_ids
        outs[depth] = got.token_ids
    assert len({tuple(v) for v in outs.values()}) > 1            # the depths differ: the effort mattered
    got = eng.generate(prompt, SamplingParams(max_tokens=3, loops=3, reasoning_effort="low", ignore_eos=True))
    assert got.stats["loops_used"] == 3
