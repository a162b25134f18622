"""The CUDA path (skipped without a CUDA device: conftest's `gpu` marker): int4 and int2 layers run on
tinygemm (`_weight_int4pack_mm`, `quant/linear.py`), int8 on `_weight_int8pack_mm`, and the shipped int4 model
decodes end to end on the GPU with those kernels, no core layer falling back to a dense weight.

Tolerance: the kernels take bf16 activations (8 significant bits: a relative rounding of 2^-9 per input)
and accumulate in fp32 over K = 256 products; against the fp32 product of the same bf16 inputs with the
dequantized weights the difference is the kernels' own rounding of scales and zeros to bf16 (2^-9
relative each, the int4 kernel's group-wise `sz` tensor), summed over K terms of random sign: well under
1e-2 of the output's largest magnitude (the CPU test's bound for the same bf16 kernels, tests/quant/test_linear.py).
"""

from __future__ import annotations

import pytest
import torch

from tinyloop.quant.linear import QuantLinear
from tinyloop.quant.packing import dequantize, pack, quantize_rtn

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (2, 32), (2, 64), (8, None)])
@pytest.mark.parametrize("M", [1, 5, 64])
def test_cuda_kernels_match_the_dequantized_reference(bits, group, M):
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    q, s, z = quantize_rtn(w, bits, group)
    lin = QuantLinear.from_portable(pack(q, bits), s, z, bits, device="cuda")
    assert lin.kind == ("int8pack" if bits == 8 else "int4pack_cuda")   # (a fallback would be "dense")
    x = torch.randn(2, M, 256, generator=torch.Generator().manual_seed(1)).cuda()
    y = lin(x)
    assert y.shape == (2, M, 96) and y.dtype == x.dtype and y.device.type == "cuda"
    ref = x.to(torch.bfloat16).float() @ dequantize(q, s, z).cuda().t()
    assert torch.allclose(y, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_the_shipped_int4_model_decodes_on_the_gpu(shipped_model_path):
    from tinyloop.engine import Engine, SamplingParams

    eng = Engine.load(shipped_model_path, device="cuda")
    head = eng.model.head_linear
    kinds = {m.kind for m in eng.model.modules() if isinstance(m, QuantLinear) and m is not head}
    assert kinds == {"int4pack_cuda"}, kinds
    # the int8 head off the native executor runs on its dequantized weight by design (bf16 activations would
    # round a row differently alone and in a verification batch: quant/formats.py load_quantized)
    assert head is None or head.kind == "dense"
    out = eng.generate("And the LORD spake unto Moses, saying,",
                       SamplingParams(max_tokens=24, temperature=0, loops=4, ignore_eos=True))
    assert len(out.token_ids) == 24 and len(set(out.token_ids)) > 3
    again = eng.generate("And the LORD spake unto Moses, saying,",
                         SamplingParams(max_tokens=24, temperature=0, loops=4, ignore_eos=True))
    assert again.token_ids == out.token_ids


def test_every_decoding_mode_runs_on_the_gpu(shipped_model_path):
    """Plain, `auto`, chain and tree speculation, sampled and n = 2, batched on one engine core on the GPU:
    each output runs to max_tokens (a tensor left on the host would fail its step: the paged attention's
    mask did, until this test)."""
    from tinyloop.engine import Engine, SamplingParams
    from tinyloop.engine.serving import BatchEngine, run_to_completion

    eng = Engine.load(shipped_model_path, device="cuda")
    ids = eng.tokenizer.encode("And the LORD spake unto Moses, saying,")
    base = dict(max_tokens=16, ignore_eos=True)
    reqs = [SamplingParams(temperature=0, loops=4, **base), SamplingParams(temperature=0, loops="auto", **base),
            SamplingParams(temperature=0, mode="speculative", **base),
            SamplingParams(temperature=0, mode="tree_speculative", k_branches=2, **base),
            SamplingParams(temperature=0.8, seed=3, top_p=0.9, **base)]
    res = run_to_completion(BatchEngine(eng, max_num_seqs=8), [(ids, p) for p in reqs])
    for p, events in zip(reqs, res):
        assert not any(isinstance(e, Exception) for e in events), (p, events[-1])
        assert sum(len(e.token_ids) for e in events) == 16, p
    two = run_to_completion(BatchEngine(eng, max_num_seqs=8), [(ids, reqs[-1])], n=2)[0]
    assert {e.index for e in two} == {0, 1}
