"""int4's min form (w = q * scale + min per group, float16 scale and min: GGUF's Q4_1 blocks as they are): its
dequantization is llama.cpp's, the PyTorch kernels take it, and a `.tinyloop` file of it round-trips."""

import numpy as np
import pytest
import torch

from tinyloop.config import preset
from tinyloop.model import build_model, param_count
from tinyloop.modelfile.loader import load_model, make_header, model_info, read_header, write_model
from tinyloop.quant.formats import MIN_LAYOUT, is_quantizable, portable_min_tensors, quant_header
from tinyloop.quant.linear import CHECK_TOLERANCE, QuantLinear
from tinyloop.quant.packing import QuantError, dequantize_min, pack, quantize_min, unpack

CFG = preset("tiny").replace(vocab_size=512, eos_token_id=511)


def q4_1_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> np.ndarray:
    """Codes and float16 d, m -> GGUF Q4_1 blocks (ggml's block_q4_1: d, m, then 16 bytes: element i in the low
    nibble of byte i, element i + 16 in its high nibble), (N, K / 32, 20) uint8."""
    N, K = q.shape
    qb = q.reshape(N, K // 32, 32).numpy()
    qs = (qb[..., :16] | (qb[..., 16:] << 4)).astype(np.uint8)
    dm = np.stack([d.numpy(), m.numpy()], axis=-1).astype(np.float16).view(np.uint8)   # (N, K/32, 4)
    return np.concatenate([dm, qs], axis=-1)


def test_dequantize_min_is_llamacpps_q4_1():
    """dequantize_min equals gguf's (llama.cpp's Python reader's) Q4_1 dequantization bit for bit, codes at
    both ends and minimums of both signs included."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(0))
    w[0, :32] += 3.0
    q, d, m = quantize_min(w, 32)
    assert int(q.min()) == 0 and int(q.max()) == 15 and (m.float() > 0).any() and (m.float() < 0).any()
    ref = dequantize(q4_1_blocks(q, d, m).reshape(24, -1), GGMLQuantizationType.Q4_1)
    assert np.array_equal(dequantize_min(q, d, m).numpy(), ref.reshape(24, 128))
    # and it is what quantize_min meant: every weight within half a step of its group
    err = (dequantize_min(q, d, m) - w).abs().reshape(24, 4, 32)
    assert (err <= d.float()[..., None] / 2 + 1e-3).all()


@pytest.mark.parametrize("kernel", ["dense", "torch"])
def test_quant_linear_takes_the_min_form(kernel):
    """QuantLinear on the dequantized weights (dense) and on torch's int4 CPU kernel ((q - 8) s + (8 s + min):
    bf16 activations, within the CHECK_TOLERANCE every torch kernel is held to)."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    q, d, m = quantize_min(w, 32)
    lin = QuantLinear.from_portable(pack(q, 4), d, None, 4, kernel=kernel, mins=m)
    assert lin.kind == ("dense" if kernel == "dense" else "int4pack_cpu")
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    ref = x @ dequantize_min(q, d, m).t()
    assert (lin(x) - ref).abs().max() <= CHECK_TOLERANCE * ref.abs().max()
    with pytest.raises(ValueError, match="int4"):
        QuantLinear.from_portable(pack(q, 4), d, None, 8, kernel="dense", mins=m)


def min_form_file(tmp_path, tokenizer):
    """The tiny model with every block projection in the min form, written as a `.tinyloop` file."""
    model = build_model(CFG, seed=0)
    tensors, high = {}, []
    for name, t in model.state_dict().items():
        if is_quantizable(name, tuple(t.shape)):
            q, d, m = quantize_min(t.float(), 32)
            tensors.update(portable_min_tensors(name[: -len(".weight")], q, d, m))
        else:
            tensors[name] = t.float()
            high.append(name)
    quant = quant_header("gguf", 4, 32, high_precision=high, layout=MIN_LAYOUT)
    header = make_header(CFG, torch.float32, tokenizer, {"tool": "tests"}, quant=quant)
    return write_model(tmp_path / "min.tinyloop", None, tokenizer=tokenizer, tensors=tensors, header=header), tensors


def test_min_form_file_round_trips(tmp_path, tokenizer):
    """Written and read back: the codes, scales and minimums as written (q/k/v and gate/up stored fused: their
    parts' rows in order), every block projection a min-form QuantLinear, and the forward the dequantized weights'."""
    path, tensors = min_form_file(tmp_path, tokenizer)
    h, index = read_header(path)
    assert h["weights"]["quant"]["layout"] == MIN_LAYOUT and model_info(h, index)["quant"] == "int4"
    assert model_info(h, index)["params"] == param_count(CFG)   # (the min form's codes counted as their matrices)
    loaded = load_model(path, dtype=torch.float32)
    wqkv = loaded.model.core[0].attn.wqkv
    assert isinstance(wqkv, QuantLinear) and "zeros" not in wqkv._names
    # (torch's int4 kernel, the PyTorch path's, folds each group's minimum into its offsets: `sz` = 8 s + m)
    assert "mins" in wqkv._names or (wqkv.kind == "int4pack_cpu" and "sz" in wqkv._names)
    parts = [f"core.0.attn.{p}" for p in ("wq", "wk", "wv")]
    w = wqkv.native_weights() if wqkv.kind == "native" else None
    if w is not None:   # (the native kernels keep the file's tensors as they are)
        assert torch.equal(w["qweight"], torch.cat([tensors[f"{p}.qweight"] for p in parts]))
        assert torch.equal(w["scales"], torch.cat([tensors[f"{p}.scales"] for p in parts]))
        assert torch.equal(w["mins"], torch.cat([tensors[f"{p}.mins"] for p in parts]))
    ref = build_model(CFG, seed=0)
    with torch.no_grad():   # the reference: the float model with each weight dequantized
        for name, t in ref.state_dict().items():
            base = name[: -len(".weight")]
            if f"{base}.qweight" in tensors:
                t.copy_(dequantize_min(unpack(tensors[f"{base}.qweight"], 4), tensors[f"{base}.scales"],
                                       tensors[f"{base}.mins"]))
    x = torch.randint(0, CFG.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        a, b = loaded.model(x, 2), ref(x, 2)
    assert float((a - b).norm() / b.norm()) < 2e-2   # (int8 or bf16 activations in the quantized kernels)


def test_min_form_is_int4_only():
    with pytest.raises(QuantError, match="int4"):
        quant_header("gguf", 8, None, high_precision=[], layout=MIN_LAYOUT)
