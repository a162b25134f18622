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
@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_quant_linear_matches_dequantized_reference(bits, group, M, kernel, monkeypatch):
    monkeypatch.setenv("TINYLOOP_NATIVE_Q8", "0")   # fp32 activations (tests/kernels covers int8 ones)
    qw, s, z, w_ref = portable(96, 256, bits, group)
    lin = QuantLinear.from_portable(qw, s, z, bits, kernel=kernel)
    assert lin.kind != "dense", "this CPU build should have the int4/int8 kernels"
    x = torch.randn(2, M, 256, generator=torch.Generator().manual_seed(1))
    y = lin(x)
    assert y.shape == (2, M, 96) and y.dtype == x.dtype
    if kernel == "native":  # fp32 activations and accumulation
        ref = x @ w_ref.t()
        assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        return
    ref = x.to(torch.bfloat16).float() @ w_ref.t()  # the torch kernels take bf16 activations
    assert torch.allclose(y, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_dense_reference_path_matches_dequantized_weights():
    qw, s, z, w_ref = portable(32, 64, 4, 32)
    lin = QuantLinear.from_portable(qw, s, z, 4, kernel="dense")
    x = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    # the dense path keeps the dequantized weight in fp32 and computes in fp32
    assert torch.allclose(lin(x), x @ w_ref.double().t(), rtol=1e-5, atol=1e-6)


def test_int2_and_int4_read_the_same_kernel_bytes():
    k4 = QuantLinear.from_portable(*portable(64, 128, 4, 32)[:3], 4, kernel="torch")
    k2 = QuantLinear.from_portable(*portable(64, 128, 2, 32)[:3], 2, kernel="torch")
    assert k2.kind == k4.kind == "int4pack_cpu"
    assert k2.weight_bytes == k4.weight_bytes < 64 * 128 * 2 // 2  # well under bf16's 2 bytes per weight


def test_native_kernels_read_the_portable_bytes():
    """The native kind keeps the file's own tensors: int2 reads half of int4's bytes, nothing is repacked."""
    qw, sc, zr = portable(64, 128, 4, 32)[:3]
    k4 = QuantLinear.from_portable(qw, sc, zr, 4, kernel="native")
    k2 = QuantLinear.from_portable(*portable(64, 128, 2, 32)[:3], 2, kernel="native")
    assert k4.kind == k2.kind == "native" and k4.qweight.data_ptr() == qw.data_ptr()
    assert k2.weight_bytes < k4.weight_bytes
    assert k4.state_dict() == {}


def test_quant_linear_has_no_persistent_state():
    lin = QuantLinear.from_portable(*portable(32, 64, 4, 32)[:3], 4, kernel="torch")
    assert lin.state_dict() == {}
    kind, bufs = to_kernel_layout(*portable(32, 64, 4, 32)[:3], 4, kernel="torch")
    assert kind == "int4pack_cpu" and set(bufs) == {"packed", "sz"}


@pytest.mark.parametrize("bits,group,kernel", [(4, 32, "torch"), (2, 64, "torch"), (8, None, "torch"),
                                               (4, 32, "native"), (2, 64, "native"), (8, None, "native"),
                                               (4, 32, "dense")])
def test_concat_fuses_exactly(bits, group, kernel):
    # fused q/k/v (or gate/up): one kernel call whose output rows are the parts' rows, bit for bit
    parts = [QuantLinear.from_portable(*portable(n, 256, bits, group, seed=i)[:3], bits, kernel=kernel)
             for i, n in enumerate((256, 64, 64))]
    fused = QuantLinear.concat(parts)
    assert fused is not None and fused.kind == parts[0].kind and fused.out_features == 384
    x = torch.randn(3, 4, 256, generator=torch.Generator().manual_seed(3))
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    # with AVX-512 the CPU int4 layout packs rows in blocks of 64, so parts of 32 rows do not stack there and
    # the probe says so (None); on CPUs where they do stack, the fused layer is exact
    if bits in (2, 4) and kernel == "auto":
        small = [QuantLinear.from_portable(*portable(32, 256, bits, group, seed=i)[:3], bits) for i in range(2)]
        got = QuantLinear.concat(small)
        assert got is None or torch.equal(got(x), torch.cat([p(x) for p in small], dim=-1))
    # different formats do not fuse
    other = QuantLinear.from_portable(*portable(64, 256, 4, 128)[:3], 4)
    assert QuantLinear.concat([parts[0], other]) is None


def test_quantized_file_is_fused_and_keeps_its_logits(tokenizer, tmp_path, capfd):
    """A quantized file stores q/k/v and gate/up fused (format 2) and loads them as they lie; a file of
    format 1 is fused at load: both compute exactly what the separate quantized layers compute."""
    from conftest import write_legacy

    from tinyloop.config import preset
    from tinyloop.model import build_model
    from tinyloop.model.fast import prepare_for_decode
    from tinyloop.modelfile.loader import load_model, make_header, write_model
    from tinyloop.tools.gptq import QuantSpec, quantize_model
    from tinyloop.tools.quantize import quantized_model

    cfg = preset("tiny").replace(vocab_size=512, eos_token_id=511, n_kv_heads=4)  # k, v: 64 rows each
    tensors, quant, _ = quantize_model(build_model(cfg, seed=0), QuantSpec(bits=4, group_size=32, method="rtn"),
                                       progress=False)
    header = make_header(cfg, torch.float32, tokenizer, {"tool": "tests"}, quant=quant)
    path = write_model(tmp_path / "q.tinyloop", None, tokenizer=tokenizer, tensors=tensors, header=header)
    write_legacy(tmp_path / "old.tinyloop", tensors, header, tokenizer)
    separate = quantized_model(cfg, tensors, quant, torch.float32)     # wq, wk, wv ... as quantized
    fused = prepare_for_decode(load_model(path).model, executor="torch")
    assert fused.decode_prepared["fused"] == 0  # nothing left to fuse: the file holds the fused layers
    legacy = load_model(tmp_path / "old.tinyloop").model
    assert "older TinyLoop (version 1)" in capfd.readouterr().err
    x = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    for model in (fused, legacy):
        assert isinstance(model.core[0].attn.wqkv, QuantLinear) and isinstance(model.core[0].mlp.w_gate_up, QuantLinear)
        with torch.inference_mode():
            assert torch.equal(model(x, 3), separate(x, 3))
