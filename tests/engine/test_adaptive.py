"""Adaptive depth (loops="auto"): each generated token exits at its own loop inside the continuous batch,
its skipped slots hold its last computed loop's keys, and a request's output does not depend on its
neighbours (float64)."""

from __future__ import annotations

import pytest
import torch

from conftest import core_ids, varied_model
from tinyloop.config import preset
from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.serving import BatchEngine, run_to_completion
from tinyloop.errors import ValidationError
from tinyloop.model import KVCache
from tinyloop.model.exits import ExitRule, gate_survival, kl_divergence, latent_change
from tinyloop.modelfile.loader import LoadedModel

CFG = preset("tiny").replace(vocab_size=512, eos_token_id=511, default_loops=6)
PROMPT = [5, 17, 300, 42, 7]


@pytest.fixture(scope="module")
def model():
    return varied_model(CFG, seed=0, dtype=torch.float64)


def auto(threshold=0.1, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=20, loops="auto", exit_threshold=threshold, min_loops=2, ignore_eos=True, **kw)


@torch.inference_mode()
def adaptive_reference(m, prompt, rule: ExitRule, max_tokens: int) -> tuple[list[int], list[int]]:
    """The rule written out on the contiguous cache: the prompt at the ceiling, then per token loop by
    loop until the criterion holds, the skipped slots filled from the last computed loop."""
    L = rule.max_loops
    cache = KVCache(m.cfg, max_positions=len(prompt) + max_tokens, loops=L, dtype=torch.float64)
    logits = m(torch.tensor([prompt]), L, cache=cache, start=0, last_only=True)[0, -1]
    out, depths, pos = [], [L], len(prompt)
    for _ in range(max_tokens):
        tok = int(logits.argmax())
        out.append(tok)
        if len(out) == max_tokens:
            break
        ctx = m.context(1, cache=cache, start=pos)
        e = m.embed_prelude(torch.tensor([[tok]]), ctx)
        h, used, survival = m.init_state(e, ctx.positions), L, torch.ones(1, dtype=torch.float64)
        prev = None
        for r in range(L):
            h_new = m.core_loop(h, e, r, ctx)
            if rule.criterion == "gate":
                survival = gate_survival(survival, m.exit_gate(h_new[0])[:, 0])
                crit = bool(1 - survival[0] >= rule.threshold)
            elif rule.criterion == "kl":
                logp = torch.log_softmax(m.coda_logits(h_new, ctx)[0].double(), -1)
                crit = prev is not None and bool(kl_divergence(logp, prev)[0] < rule.threshold)
                prev = logp
            else:
                crit = bool(latent_change(h[0], h_new[0])[0] < rule.threshold)
            stop = rule.may_exit_after(r) and crit
            h = h_new
            if stop:
                used = r + 1
                break
        for r in range(used, L):
            for j in range(m.cfg.n_core):
                for t in (cache.k, cache.v):
                    t.data[cache.slot_core(r, j), :, :, pos] = t.data[cache.slot_core(used - 1, j), :, :, pos]
        depths.append(used)
        logits = m.coda_logits(h, ctx)[0, -1]
        pos += 1
    return out, depths


def test_tokens_exit_at_their_own_loop_as_the_rule_says(model):
    st: dict = {}
    got = core_ids(model, PROMPT, auto(), stats=st)
    want, depths = adaptive_reference(model, PROMPT, ExitRule("latent", 0.1, 2, 6), 20)
    assert got == want
    hist = {}
    for d in depths:
        hist[str(d)] = hist.get(str(d), 0) + 1
    assert st["loops_histogram"] == hist
    assert len(hist) > 1 and min(depths) < 6                     # exits happen, at different loops
    assert st["loops_used"] == pytest.approx(sum(depths) / len(depths), abs=1e-3)
    # never exiting is plain decoding at the ceiling; always exiting at min_loops is not
    assert core_ids(model, PROMPT, auto(1e-12)) == core_ids(model, PROMPT, SamplingParams(max_tokens=20, loops=6))


def test_output_is_the_same_alone_and_in_a_batch(model):
    engine = Engine(LoadedModel(model, None, {}, None))
    alone = [core_ids(model, p, sp) for p, sp in [(PROMPT, auto()), ([1, 2], auto(0.2, max_loops=5))]]
    items = [(PROMPT, auto()), ([9, 9, 9], SamplingParams(max_tokens=20, loops=4, ignore_eos=True)),
             ([1, 2], auto(0.2, max_loops=5)), (list(range(30, 50)), SamplingParams(max_tokens=20, loops=6,
                                                                                      ignore_eos=True))]
    events = run_to_completion(BatchEngine(engine, page_size=4), items)
    got = [[t for e in evs for t in e.token_ids] for evs in events]
    assert got[0] == alone[0] and got[2] == alone[1]


def test_exited_rows_cost_no_loops(model):
    st: dict = {}
    model.core_loop_tokens = 0
    core_ids(model, PROMPT, auto(), stats=st)
    generated = sum(int(k) * v for k, v in st["loops_histogram"].items()) - 6   # the first token came from the prompt
    assert model.core_loop_tokens == len(PROMPT) * 6 + generated


@pytest.mark.parametrize("kw,field", [(dict(mode="speculative"), "loops"), (dict(exit_criterion="magic"), "exit_criterion"),
                                      (dict(min_loops=9), "min_loops"), (dict(max_loops=99), "max_loops"),
                                      (dict(exit_threshold=-1.0), "exit_threshold")])
def test_bad_adaptive_requests_name_the_field(model, kw, field):
    engine = Engine(LoadedModel(model, None, {}, None))
    with pytest.raises(ValidationError) as err:
        engine.plan(PROMPT, SamplingParams(loops="auto", **kw))
    assert err.value.param == field
    with pytest.raises(ValidationError, match="loops"):
        engine.plan(PROMPT, SamplingParams(loops="deep"))


def test_the_gate_rule_of_a_model_with_an_exit_gate():
    """Ouro's cumulative exit rule on a tiny Ouro-shaped model: as the reference written out; the same
    alone and in a batch; refused on a model without a gate."""
    cfg = CFG.replace(n_prelude=0, n_coda=0, injection="none", norm_placement="sandwich", loop_norm=True,
                      head_norm=False, exit_gate=True, tie_embeddings=False)
    m = varied_model(cfg, seed=1, dtype=torch.float64)
    with torch.no_grad():
        m.exit_gate.bias.fill_(-1.0)
    params = SamplingParams(max_tokens=16, loops="auto", exit_criterion="gate", exit_threshold=0.8, ignore_eos=True)
    st: dict = {}
    got = core_ids(m, PROMPT, params, stats=st)
    want, depths = adaptive_reference(m, PROMPT, ExitRule("gate", 0.8, 1, 6), 16)
    assert got == want and len(set(depths)) > 1
    engine = Engine(LoadedModel(m, None, {}, None))
    events = run_to_completion(BatchEngine(engine, page_size=4),
                               [([3, 3], SamplingParams(max_tokens=16, loops=5, ignore_eos=True)), (PROMPT, params)])
    assert [t for e in events[1] for t in e.token_ids] == got
    with pytest.raises(ValidationError, match="exit gate") as err:
        Engine(LoadedModel(varied_model(CFG), None, {}, None)).plan(PROMPT, params)
    assert err.value.param == "exit_criterion"
    with pytest.raises(ValidationError) as err:
        engine.plan(PROMPT, params.replace(exit_threshold=2.0))
    assert err.value.param == "exit_threshold"


def test_the_kl_rule_reads_out_every_loop(model):
    """kl: the read-out's distributions after successive loops, as the reference written out (its coda
    writes are overwritten by the final read-out); the same alone and in a batch."""
    params = SamplingParams(max_tokens=16, loops="auto", exit_criterion="kl", exit_threshold=0.5, min_loops=2,
                            ignore_eos=True)
    st: dict = {}
    got = core_ids(model, PROMPT, params, stats=st)
    want, depths = adaptive_reference(model, PROMPT, ExitRule("kl", 0.5, 2, 6), 16)
    assert got == want and len(set(depths)) > 1
    engine = Engine(LoadedModel(model, None, {}, None))
    events = run_to_completion(BatchEngine(engine, page_size=4),
                               [(PROMPT, params), ([7, 7, 1], auto()), ([3], SamplingParams(max_tokens=16, loops=3))])
    assert [t for e in events[0] for t in e.token_ids] == got
