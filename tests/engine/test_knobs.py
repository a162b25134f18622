"""The knobs are declared once (engine/knobs.py) and reach every route from there: each HTTP body takes the
groups of its mode, the command line has a flag for each, and each maps onto a SamplingParams field."""

import dataclasses

import pytest

from tinyloop.cli import build_parser
from tinyloop.engine.knobs import (PARAM, SERVER_ONLY, DepthKnobs, LoopKnobs, RequestKnobs, SamplingParams,
                                   SpeculationKnobs, TreeKnobs, knob_params, param_default)
from tinyloop.errors import ValidationError
from tinyloop.server.anthropic.schemas import MessagesRequest
from tinyloop.server.native.schemas import GenerateRequest, SpeculativeRequest, TreeSpeculativeRequest
from tinyloop.server.openai.schemas import ChatCompletionRequest, CompletionRequest
from tinyloop.server.responses.schemas import ResponsesRequest

GROUPS = (DepthKnobs, RequestKnobs, SpeculationKnobs, TreeKnobs)


def test_every_knob_is_a_sampling_param_or_the_servers():
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    for name in LoopKnobs.model_fields:
        assert name in SERVER_ONLY or PARAM[name] in fields, name


@pytest.mark.parametrize("body, groups", [
    (ChatCompletionRequest, GROUPS), (CompletionRequest, GROUPS), (MessagesRequest, GROUPS),
    (ResponsesRequest, GROUPS), (GenerateRequest, (DepthKnobs, RequestKnobs)),
    (SpeculativeRequest, (DepthKnobs, RequestKnobs, SpeculationKnobs)), (TreeSpeculativeRequest, GROUPS)])
def test_each_route_takes_its_groups_as_declared(body, groups):
    for group in groups:
        for name, field in group.model_fields.items():
            assert repr(body.model_fields[name]) == repr(field), (body.__name__, name)   # the declaration as is


def test_native_routes_refuse_another_modes_knobs():
    with pytest.raises(Exception, match="draft_loops"):
        GenerateRequest(prompt="x", draft_loops=2)
    with pytest.raises(Exception, match="K_branches"):
        SpeculativeRequest(prompt="x", K_branches=2)


def test_knob_params_fill_the_engines_defaults_and_check_ranges():
    got = knob_params(TreeSpeculativeRequest(prompt="x", kv_loops="last", K_branches=2))
    assert got["kv_loops"] == "last" and got["k_branches"] == 2
    assert got["min_loops"] == param_default("min_loops") and got["draft_ahead"] == param_default("draft_ahead")
    assert "timeout_s" not in got and "keep_alive" not in got
    with pytest.raises(ValidationError, match="draft_ahead"):
        knob_params(SpeculativeRequest(prompt="x", draft_ahead=17))
    with pytest.raises(ValidationError, match="timeout_s"):
        knob_params(GenerateRequest(prompt="x", timeout_s=0.0))


def test_the_command_line_has_a_flag_per_knob():
    parser = build_parser()
    args = parser.parse_args(["generate", "hi"])
    for group in GROUPS:
        for name in group.model_fields:
            if name not in SERVER_ONLY:
                assert getattr(args, PARAM[name]) == param_default(PARAM[name]), name
    args = parser.parse_args(["generate", "hi", "--loops", "auto", "--kv-loops", "2", "--exit-threshold", "0.5",
                              "--k-branches", "3"])
    assert (args.loops, args.kv_loops, args.exit_threshold, args.k_branches) == ("auto", 2, 0.5, 3)
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--exit-criterion", "nope"])
