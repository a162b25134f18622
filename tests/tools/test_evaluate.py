import math

import torch
import torch.nn.functional as F

from tinyloop.config import preset
from tinyloop.model import build_model
from tinyloop.tools.evaluate import perplexity, windows


def test_windows_score_every_token_once():
    for n, L, s in [(10, 4, 2), (100, 32, 16), (33, 32, 16), (5, 8, 4), (64, 16, 8)]:
        scored = []
        for start, end, first in windows(n, L, s):
            assert end - start <= L and start <= first - 1
            scored += list(range(first, end))
        assert scored == list(range(1, n))


def test_perplexity_matches_direct_loss_in_one_window():
    m = build_model(preset("tiny").replace(vocab_size=300), dtype=torch.float64)
    ids = torch.randint(0, 300, (50,), generator=torch.Generator().manual_seed(0))
    r = perplexity(m, ids, loops=2, seq_len=64)
    logits = m(ids[None], loops=2)[0]
    loss = F.cross_entropy(logits[:-1], ids[1:]).item()
    assert r["tokens_scored"] == 49 and math.isclose(r["loss"], loss, rel_tol=1e-6)


def test_kl_divergence_is_zero_for_the_same_model_and_matches_a_direct_computation():
    from tinyloop.tools.evaluate import kl_divergence

    m = build_model(preset("tiny").replace(vocab_size=300), dtype=torch.float64)
    other = build_model(preset("tiny").replace(vocab_size=300), seed=1, dtype=torch.float64)
    ids = torch.randint(0, 300, (50,), generator=torch.Generator().manual_seed(0))
    assert kl_divergence(m, m, ids, loops=2, seq_len=64)["kl"] == 0.0
    r = kl_divergence(m, other, ids, loops=2, seq_len=64)
    p = F.log_softmax(m(ids[None], loops=2)[0, :-1], -1)
    q = F.log_softmax(other(ids[None], loops=2)[0, :-1], -1)
    want = F.kl_div(q, p, log_target=True, reduction="sum").item() / 49
    assert r["tokens_scored"] == 49 and math.isclose(r["kl"], want, rel_tol=1e-9) and r["kl"] > 0
