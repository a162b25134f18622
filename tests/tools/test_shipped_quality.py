"""The shipped int4 model keeps the fp16 model's quality (issue 6: GPTQ int4 within 5% at loops 8)."""

from __future__ import annotations

import torch

from tinyloop.modelfile.loader import load_model
from tinyloop.tools.evaluate import kl_divergence, perplexity

# Written for this test (not in the training corpus).
TEXT = (
    "The old bridge over the river had stood for two hundred years, and the people of the town spoke of it "
    "as if it were a member of every family. In the spring the water rose high against its stones, and the "
    "children came down from the school to watch the ice break and turn in the current. The miller said that "
    "the bridge would outlast them all; his wife said that nothing made by hands lasts for ever, and that a "
    "wise man mends his roof before the rain. When the great storm came in the autumn of that year, the "
    "bridge held, but the mill was carried away, and the miller went to live with his brother in the city, "
    "where he told anyone who would listen that he had always known the river would have its way. "
) * 2


def test_int4_default_within_5_percent_of_fp16(shipped_model_path, shipped_float_model_path):
    fp16 = load_model(shipped_float_model_path, dtype=torch.float32)
    int4 = load_model(shipped_model_path)
    assert int4.header["weights"]["quant"]["bits"] == 4
    ids = torch.tensor(fp16.tokenizer.encode(TEXT))
    p16 = perplexity(fp16.model, ids, 8)["perplexity"]
    p4 = perplexity(int4.model, ids, 8)["perplexity"]
    assert p4 <= 1.05 * p16, (p4, p16)
    kl = kl_divergence(fp16.model, int4.model, ids[:256], 8)["kl"]
    assert 0 < kl < 0.01, kl  # mean nats/token; int2 on this model is ~0.02-0.07
