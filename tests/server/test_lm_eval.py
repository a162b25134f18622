"""lm-eval (lm-evaluation-harness) end to end against the server (issue 17): its `local-completions` model
runs a log-likelihood task and a generate_until task from local files (tests/fixtures/lm_eval), tokenizing
through the server (/tokenizer_info, /tokenize: no Hugging Face tokenizer, nothing downloaded), and what it
scores equals the engine's own log_softmax at the depth the model name asks for (docs/evaluation.md)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tinyloop.engine import Engine, SamplingParams

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval[api]: its API models need it

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "fixtures" / "lm_eval"


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return Engine.load(tiny_model_path)


def evaluate(url: str, model: str, tasks: list[str], monkeypatch) -> dict:
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(REPO)                      # the task files name their data relative to the repository
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": model, "base_url": f"{url}/v1/completions", "max_length": 256, "num_concurrent": 2},
        tasks=tasks, task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def continuation_logprob(engine, context: str, continuation: str, loops: int) -> float:
    ctx, cont = engine.tokenizer.encode(context), engine.tokenizer.encode(continuation)
    lp = torch.log_softmax(engine.logits(ctx + cont, loops=loops).double(), -1)
    return sum(float(lp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))


@pytest.mark.parametrize("loops", [1, 3])
def test_lm_eval_scores_equal_the_engine(tiny_server, engine, loops, monkeypatch):
    out = evaluate(tiny_server.url, f"tiny@loops={loops}", ["tinyloop_cloze", "tinyloop_complete"], monkeypatch)
    res = out["results"]
    assert 0.0 <= res["tinyloop_cloze"]["acc,none"] <= 1.0
    assert 0.0 <= res["tinyloop_complete"]["exact_match,none"] <= 1.0
    cloze = out["samples"]["tinyloop_cloze"]
    assert len(cloze) == 6
    for sample in cloze:
        doc = sample["doc"]
        got = [float(r[0][0]) for r in sample["resps"]]
        want = [continuation_logprob(engine, doc["context"], c, loops) for c in doc["choices"]]
        assert got == pytest.approx(want, abs=1e-4)
        assert sample["acc"] == float(max(range(4), key=lambda i: got[i]) == doc["answer"])
    for sample in out["samples"]["tinyloop_complete"]:
        ids = engine.tokenizer.encode(sample["doc"]["context"])
        text = engine.generate(ids, SamplingParams(max_tokens=8, loops=loops, stop=[".", "\n\n"])).text
        assert sample["resps"][0][0] == text
    if loops == 1:  # the depth matters: the other depth's scores differ
        other = continuation_logprob(engine, cloze[0]["doc"]["context"], cloze[0]["doc"]["choices"][0], 3)
        assert not math.isclose(float(cloze[0]["resps"][0][0][0]), other, abs_tol=1e-3)
