import pytest
import torch

from tinyloop.quant.linear import QuantLinear, to_kernel_layout
from tinyloop.quant.packing import dequantize, pack, quantize_rtn


def portable(N, K, bits, group, seed=0):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, s, z = quantize_rtn(w, bits, group)
    return pack(q, bits), s, z, dequantize(q, s, z)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (2, 32), (2, 64), (8, None)])
@pytest.mark.parametrize("M", [1, 5])
def test_quant_linear_matches_dequantized_reference(bits, group, M):
    qw, s, z, w_ref = portable(96, 256, bits, group)
    lin = QuantLinear.from_portable(qw, s, z, bits)
    assert lin.kind != "dense", "this CPU build should have the int4/int8 kernels"
    x = torch.randn(2, M, 256, generator=torch.Generator().manual_seed(1))
    y = lin(x)
    assert y.shape == (2, M, 96) and y.dtype == x.dtype
    ref = x.to(torch.bfloat16).float() @ w_ref.t()  # the kernels take bf16 activations
    assert torch.allclose(y, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_dense_reference_path_matches_dequantized_weights():
    qw, s, z, w_ref = portable(32, 64, 4, 32)
    lin = QuantLinear.from_portable(qw, s, z, 4, kernel="dense")
    x = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    # the dense path keeps the dequantized weight in fp32 and computes in fp32
    assert torch.allclose(lin(x), x @ w_ref.double().t(), rtol=1e-5, atol=1e-6)


def test_int2_and_int4_read_the_same_kernel_bytes():
    k4 = QuantLinear.from_portable(*portable(64, 128, 4, 32)[:3], 4)
    k2 = QuantLinear.from_portable(*portable(64, 128, 2, 32)[:3], 2)
    assert k2.kind == k4.kind == "int4pack_cpu"
    assert k2.weight_bytes == k4.weight_bytes < 64 * 128 * 2 // 2  # well under bf16's 2 bytes per weight


def test_quant_linear_has_no_persistent_state():
    lin = QuantLinear.from_portable(*portable(32, 64, 4, 32)[:3], 4)
    assert lin.state_dict() == {}
    kind, bufs = to_kernel_layout(*portable(32, 64, 4, 32)[:3], 4)
    assert kind == "int4pack_cpu" and set(bufs) == {"packed", "sz"}
