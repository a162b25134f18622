"""The shipped model through the engine core with the native executor and without: greedy tokens identical
for 256 tokens at loops 1, 4, 8 and 16 (plain), and in the speculative, tree and adaptive modes at loops 8.

Native and PyTorch sum in different orders, so two fp32 logits that nearly tie may swap; a divergence is
accepted only where the PyTorch reference's top two logits at that position are within 1e-3, and the test
checks that it is such a tie. Speculative greedy output also equals plain greedy output within the native
path."""

from __future__ import annotations

import pytest
import torch

from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.serving import run_ids
from tinyloop.kernels.lib import NativeBuildError, load
from tinyloop.modelfile.loader import FLOAT_MODEL_NAME

try:
    load()
except NativeBuildError as exc:
    pytest.skip(f"native library unavailable: {exc}", allow_module_level=True)

pytestmark = pytest.mark.slow
PROMPT = "The king said unto his servants,"
TOKENS = 256


@pytest.fixture(scope="module")
def engine():
    e = Engine.load(FLOAT_MODEL_NAME, executor="native")
    assert e.model.executor is not None
    return e


def both(engine, params):
    ids = engine.tokenizer.encode(PROMPT)
    ex = engine.model.executor
    try:
        engine.model.executor = None
        ref = run_ids(engine, ids, params)
    finally:
        engine.model.executor = ex
    return ids, ref, run_ids(engine, ids, params)


def assert_same_or_tie(engine, ids, ref, got, loops):
    n = min(len(ref), len(got))
    first = next((i for i in range(n) if ref[i] != got[i]), None)
    if first is None:
        assert len(ref) == len(got)
        return
    ex = engine.model.executor
    try:
        engine.model.executor = None
        logits = engine.logits(ids + ref[:first], loops=loops)[-1]
    finally:
        engine.model.executor = ex
    top2 = torch.topk(logits.double(), 2).values
    gap = (top2[0] - top2[1]).item()
    assert gap < 1e-3, f"native diverged at token {first} where the reference's top-2 gap is {gap:.3g}"


@pytest.mark.parametrize("loops", [1, 4, 8, 16])
def test_plain_greedy_identical(engine, loops):
    params = SamplingParams(max_tokens=TOKENS, loops=loops, temperature=0, ignore_eos=True)
    ids, ref, got = both(engine, params)
    assert len(ref) == TOKENS
    assert_same_or_tie(engine, ids, ref, got, loops)


@pytest.mark.parametrize("mode", ["speculative", "tree_speculative", "auto"])
def test_other_modes_identical(engine, mode):
    if mode == "auto":
        params = SamplingParams(max_tokens=TOKENS, loops="auto", temperature=0, ignore_eos=True)
        loops = engine.config.default_loops
    else:
        params = SamplingParams(max_tokens=TOKENS, mode=mode, draft_loops=2, verify_loops=8, temperature=0,
                                ignore_eos=True)
        loops = 8
    ids, ref, got = both(engine, params)
    assert_same_or_tie(engine, ids, ref, got, loops)
    if mode != "auto":  # speculative greedy equals plain greedy, within the native path
        plain = run_ids(engine, ids, SamplingParams(max_tokens=TOKENS, loops=8, temperature=0, ignore_eos=True))
        assert_same_or_tie(engine, ids, plain, got, 8)
