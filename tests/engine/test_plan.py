"""The request plan: every check and every model-dependent default, resolved once (no model, no torch)."""

import pytest

from tinyloop.config import preset
from tinyloop.engine import RequestPlan, SamplingParams, param_default, plan_request
from tinyloop.errors import ValidationError

SHALLOW = preset("tiny").replace(default_loops=3, max_loops=16, max_seq_len=256)   # default_loops < 8
DEEP = preset("tiny").replace(default_loops=12, max_loops=16, max_seq_len=256)     # default_loops > 8
PROMPT = [464, 5822, 531]


def plan(params, cfg=SHALLOW, *, prompt=PROMPT, max_seq_len=256, n=1) -> RequestPlan:
    return plan_request(prompt, params, cfg, max_seq_len=max_seq_len, n=n)


def spec(**kw) -> SamplingParams:
    return SamplingParams(mode="speculative", max_tokens=16, **kw)


def test_verify_depth_defaults_to_the_models_default_loops_not_8():
    # default_loops 3: drafting with 4 loops cannot be shallower than the 3-loop verify -> 400 up front
    with pytest.raises(ValidationError) as exc:
        plan(spec(draft_loops=4))
    assert exc.value.param == "draft_loops" and "verify_loops (3)" in exc.value.message
    # default_loops 12: draft_loops 10 < 12 is a valid request
    p = plan(spec(draft_loops=10), DEEP)
    assert p.loops == 12 and p.draft_loops == 10
    # the bug's other face through validate itself
    with pytest.raises(ValidationError):
        spec(draft_loops=4).validate(max_loops=16, default_loops=3)
    spec(draft_loops=10).validate(max_loops=16, default_loops=12)


def test_explicit_depths_win_over_the_models_default():
    assert plan(spec(draft_loops=4, verify_loops=6)).loops == 6
    assert plan(spec(draft_loops=4, loops=5)).loops == 5          # verify_loops None -> loops
    assert plan(spec(draft_loops=2, loops=5, verify_loops=9), DEEP).loops == 9
    with pytest.raises(ValidationError) as exc:
        plan(spec(draft_loops=2, verify_loops=17), DEEP)
    assert exc.value.param == "verify_loops"


def test_generate_defaults_resolved_from_the_model():
    for cfg in (SHALLOW, DEEP):
        p = plan(SamplingParams(max_tokens=10), cfg)
        assert p.loops == cfg.default_loops and p.mode == "generate" and p.n == 1
        assert p.draft_loops is None and p.draft_ahead == 0 and p.k_branches == 1 and p.window == 0
    assert plan(SamplingParams(max_tokens=10, loops=7)).loops == 7
    assert plan(SamplingParams(max_tokens=10, cache_window=32)).window == 32


def test_max_positions_and_blocks_per_mode():
    g = plan(SamplingParams(max_tokens=20))
    assert g.max_positions == len(PROMPT) + 20 and g.max_tokens == 20 and g.prompt_ids == tuple(PROMPT)
    assert g.blocks(16) == 2 and g.blocks(23) == 1 and g.blocks(22) == 2
    s = plan(spec(draft_loops=2, draft_ahead=5))
    assert s.draft_ahead == 5 and s.k_branches == 1
    assert s.max_positions == len(PROMPT) + 16 + 5 + 1
    t = plan(SamplingParams(mode="tree_speculative", max_tokens=16, draft_loops=1, draft_ahead=3, k_branches=4))
    assert t.k_branches == 4 and t.max_positions == len(PROMPT) + 16 + 4 * 3 + 1
    # a chain naming no draft_ahead drafts 4 a round and may run 8 (RequestPlan.draft_run): room for 8 + 1
    d = plan(spec(draft_loops=2))
    assert (d.draft_ahead, d.draft_run) == (4, 8) and d.max_positions == len(PROMPT) + 16 + 8 + 1
    assert plan(spec(draft_loops=2, draft_ahead=5)).draft_run == 5
    t = plan(SamplingParams(mode="tree_speculative", max_tokens=16, draft_loops=1, k_branches=4))
    assert (t.draft_ahead, t.draft_run) == (4, 4) and t.max_positions == len(PROMPT) + 16 + 4 * 4 + 1
    # k_branches means nothing outside tree mode
    assert plan(spec(draft_loops=2, k_branches=4)).k_branches == 1


def test_n_is_checked_and_named():
    assert plan(SamplingParams(max_tokens=4), n=8).n == 8
    for bad in (0, 9):
        with pytest.raises(ValidationError) as exc:
            plan(SamplingParams(max_tokens=4), n=bad)
        assert exc.value.param == "n" and "n:" in exc.value.message


def test_context_length_is_checked_against_the_served_limit():
    plan(SamplingParams(max_tokens=253))  # 3 + 253 = 256 fits exactly
    with pytest.raises(ValidationError) as exc:
        plan(SamplingParams(max_tokens=254))
    assert exc.value.param == "max_tokens" and exc.value.code == "context_length_exceeded"
    assert exc.value.message == ("prompt_tokens (3) + max_tokens (254) = 257 exceeds the context length 256; "
                                 "shorten the prompt or lower max_tokens")
    with pytest.raises(ValidationError) as exc:
        plan(SamplingParams(max_tokens=100), max_seq_len=64)  # a server cap below the model's
    assert exc.value.code == "context_length_exceeded" and "context length 64" in exc.value.message


def test_other_checks_use_the_models_limits():
    with pytest.raises(ValidationError) as exc:
        plan(SamplingParams(max_tokens=4, loops=17))
    assert exc.value.param == "loops" and "1..16" in exc.value.message
    with pytest.raises(ValidationError) as exc:
        plan(SamplingParams(max_tokens=4, stop_token_ids=[SHALLOW.vocab_size]))
    assert exc.value.param == "stop"


def test_param_default_reads_the_dataclass():
    assert param_default("max_tokens") == SamplingParams().max_tokens == 128
    assert param_default("draft_loops") == SamplingParams().draft_loops
    assert param_default("stop") == []


@pytest.mark.parametrize("verify,draft", [(2, 1), (3, 1), (4, 1), (8, 2), (12, 3), (16, 4)])
def test_draft_depth_defaults_to_a_quarter_of_the_verifier(verify, draft):
    """Unset draft_loops is a quarter of the verifier's loops, at least 1: a 2-loop model (Nanbeige) or a
    4-loop one (Ouro) drafts at 1 loop instead of being refused, 8 loops keep the old default 2."""
    assert plan(spec(verify_loops=verify)).draft_loops == draft
    cfg = preset("tiny").replace(default_loops=verify, max_loops=16, max_seq_len=256)
    assert plan(spec(), cfg).draft_loops == draft          # the model's depth as the verifier
    assert plan(spec(verify_loops=verify, draft_loops=1)).draft_loops == 1   # a given depth is kept
    with pytest.raises(ValidationError) as exc:             # and checked as before
        plan(spec(verify_loops=verify, draft_loops=verify))
    assert exc.value.param == "draft_loops"
