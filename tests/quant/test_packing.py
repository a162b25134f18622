import pytest
import torch

from tinyloop.quant.packing import QuantError, dequantize, pack, quantize_rtn, resolve_group_size, unpack


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 2 ** bits, (24, 64), generator=g, dtype=torch.uint8)
    packed = pack(q, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 64 * bits // 8)
    assert torch.equal(unpack(packed, bits), q)


def test_pack_layout_is_low_bits_first():
    q = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert pack(q, 4).tolist() == [[0x21, 0x43]]
    assert pack(q[:, :4] % 4, 2).tolist() == [[1 | 2 << 2 | 3 << 4 | 0 << 6]]


@pytest.mark.parametrize("bits,group", [(2, 32), (4, 32), (4, 64), (8, None)])
def test_rtn_error_is_at_most_half_a_step(bits, group):
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(0))
    q, s, z = quantize_rtn(w, bits, group)
    assert q.dtype == torch.uint8 and s.dtype == torch.float16 and z.dtype == torch.uint8
    G = 128 if group is None else group
    assert s.shape == (16, 128 // G)
    assert int(q.max()) < 2 ** bits
    err = (dequantize(q, s, z) - w).abs()
    step = s.float().repeat_interleave(G, dim=1)
    assert torch.all(err <= 0.5 * step + 1e-6)


def test_bad_specs_raise_clear_errors():
    with pytest.raises(QuantError, match="bits must be one of"):
        resolve_group_size(3, 32, 64)
    with pytest.raises(QuantError, match="does not divide the 96 input features"):
        resolve_group_size(4, 64, 96, "core.0.mlp.w_down")
    with pytest.raises(QuantError, match="group size must be one of"):
        resolve_group_size(4, 48, 96)
    with pytest.raises(QuantError, match="per output channel"):
        resolve_group_size(8, 32, 64)
    with pytest.raises(QuantError, match="bits must be one of"):
        pack(torch.zeros(2, 8, dtype=torch.uint8), 3)
