"""A GGUF's Q4_1 block matrices kept as they are (`tools/gguf.py` quant "q4_1": int4's min form, group 32): the
codes, d and m of every block bit for bit in the `.tinyloop` file (q/k rows permuted whole), which dequantize to
exactly the float32 import's weights; the default `convert` of an all-Q4_1 file (SmolLM2-135M-Instruct through it:
test_smollm2.py). The tiny GGUF writer is test_gguf.py's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")

from test_gguf import HEAD_DIM, HEADS, IDS, KV_HEADS, LAYERS, write_gguf  # noqa: E402
from tinyloop.engine import Engine, SamplingParams  # noqa: E402
from tinyloop.modelfile.loader import read_header  # noqa: E402
from tinyloop.quant.formats import MIN_LAYOUT  # noqa: E402
from tinyloop.quant.packing import dequantize_min, unpack  # noqa: E402
from tinyloop.tools.convert import ConvertError, convert  # noqa: E402

Q = gguf.GGMLQuantizationType
PROJ = {"attn_q": ("attn.wqkv", 0), "attn_k": ("attn.wqkv", 1), "attn_v": ("attn.wqkv", 2),
        "attn_output": ("attn.wo", 0), "ffn_gate": ("mlp.w_gate_up", 0), "ffn_up": ("mlp.w_gate_up", 1),
        "ffn_down": ("mlp.w_down", 0)}


def raw_blocks(reader, name: str, shape: tuple[int, int]):
    """A Q4_1 tensor's blocks read here by hand from ggml's block_q4_1 {f16 d; f16 m; u8 qs[16]} (element i of a
    block in the low nibble of qs[i], element i + 16 in its high nibble): codes (N, K), d and m bits (N, K/32)."""
    t = next(t for t in reader.tensors if t.name == name)
    assert t.tensor_type == Q.Q4_1
    N, K = shape
    b = np.asarray(t.data).reshape(N, K // 32, 20)
    codes = np.concatenate([b[..., 4:] & 0xF, b[..., 4:] >> 4], axis=-1).reshape(N, K)
    dm = np.ascontiguousarray(b[..., :4]).view(np.uint16)
    return codes, dm[..., 0], dm[..., 1]


def half_split(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's interleaved q/k rows -> the half-split order TinyLoop computes (per head: even rows, then odd)."""
    r = rows.reshape(heads, -1, *rows.shape[1:])
    return np.concatenate([r[:, 0::2], r[:, 1::2]], axis=1).reshape(rows.shape)


def check_blocks_kept(gguf_path: Path, out: Path, n_layers: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Every block matrix of the GGUF against the file's int4 min-form tensors, bit for bit; returns how many."""
    reader = gguf.GGUFReader(str(gguf_path))
    st = safetensors_torch.load_file(str(out))
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    checked = 0
    for i in range(n_layers):
        for part, (module, j) in PROJ.items():
            name = f"blk.{i}.{part}.weight"
            t = next(t for t in reader.tensors if t.name == name)
            shape = tuple(int(d) for d in reversed(t.shape))
            codes, d, m = raw_blocks(reader, name, shape)
            if part in ("attn_q", "attn_k"):
                codes, d, m = (half_split(a, heads if part == "attn_q" else kv_heads) for a in (codes, d, m))
            base = f"core.{i}.{module}"
            if module == "attn.wqkv":
                lo = (0, q_rows, q_rows + kv_rows)[j]
            else:
                lo = j * shape[0]
            rows = slice(lo, lo + shape[0])
            assert np.array_equal(unpack(st[f"{base}.qweight"][rows], 4).numpy(), codes), name
            assert np.array_equal(st[f"{base}.scales"][rows].view(torch.int16).numpy().view(np.uint16), d), name
            assert np.array_equal(st[f"{base}.mins"][rows].view(torch.int16).numpy().view(np.uint16), m), name
            assert f"{base}.zeros" not in st
            checked += 1
    return checked


def test_q4_1_blocks_are_kept_bit_for_bit(tmp_path):
    """The default conversion of an all-Q4_1 GGUF (here with an untied Q8_0 head): every block matrix's codes, d
    and m in the file as they are in the GGUF, dequantizing to exactly the float32 import's weights (llama.cpp's
    d * q + m in fp32); the Q8_0 head as int8 codes q + 128 with d per 32 columns, bit for bit, beside the float
    one; the model decodes."""
    write_gguf(tmp_path / "m.gguf", types={"token_embd": Q.Q8_0, "output": Q.Q8_0}, default=Q.Q4_1, tie=False)
    out = convert(tmp_path / "m.gguf", tmp_path / "m.tinyloop", progress=False)   # default: the blocks kept
    quant = read_header(out)[0]["weights"]["quant"]
    assert (quant["method"], quant["bits"], quant["group_size"], quant["layout"]) == ("gguf", 4, 32, MIN_LAYOUT)
    assert quant["head"] == {"method": "gguf", "bits": 8, "group_size": 32} and "head_note" not in quant
    assert check_blocks_kept(tmp_path / "m.gguf", out, LAYERS, HEADS, KV_HEADS, HEAD_DIM) == 7 * LAYERS
    f32 = safetensors_torch.load_file(str(convert(tmp_path / "m.gguf", tmp_path / "f.tinyloop", dtype="float32",
                                                  progress=False)))
    st = safetensors_torch.load_file(str(out))
    for name, w in f32.items():
        if name.endswith(".weight") and f"{name[:-7]}.qweight" in st:
            base = name[:-7]
            got = dequantize_min(unpack(st[f"{base}.qweight"], 4), st[f"{base}.scales"], st[f"{base}.mins"])
            assert torch.equal(got, w), name
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))   # the head's Q8_0 blocks {f16 d; i8 qs[32]}, by hand
    raw = np.asarray(next(t for t in reader.tensors if t.name == "output.weight").data)
    N, K = f32["lm_head.weight"].shape
    blocks = raw.reshape(N, K // 32, 34)
    assert np.array_equal(st["head.qweight"].numpy().astype(np.int16) - 128,
                          np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(N, K))
    assert np.array_equal(st["head.scales"].view(torch.int16).numpy().view(np.uint16),
                          np.ascontiguousarray(blocks[..., :2]).view(np.uint16)[..., 0])
    assert (st["head.zeros"] == 128).all() and st["head.zeros"].shape == (N, K // 32)
    q, s, z = st["head.qweight"].float(), st["head.scales"].float(), st["head.zeros"].float()
    w = ((q.reshape(N, -1, 32) - z[..., None]) * s[..., None]).reshape(N, K)   # (exact: 11-bit d x 8-bit code)
    assert torch.equal(w, f32["lm_head.weight"])
    r = Engine.load(out).generate(IDS, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(r.token_ids) == 4


def test_what_asks_for_another_conversion(tmp_path):
    """`--dtype` asks for a float conversion of a Q4_1 file; a head of a quantized type other than Q8_0 becomes int8
    per row (RTN, said in the header); a file whose block matrices are not all Q4_1 converts to float by default, and
    asking it for Q4_1 blocks is refused."""
    from tinyloop.tools.gguf import convert_gguf

    write_gguf(tmp_path / "m.gguf", types={"token_embd": Q.Q8_0}, default=Q.Q4_1)
    q = read_header(convert(tmp_path / "m.gguf", tmp_path / "f.tinyloop", dtype="float16", progress=False))[0]
    assert q["weights"]["dtype"] == "float16" and q["weights"]["quant"]["method"] == "none"
    write_gguf(tmp_path / "h.gguf", types={"token_embd": Q.Q4_0}, default=Q.Q4_1)   # a head of another type
    q = read_header(convert(tmp_path / "h.gguf", tmp_path / "h.tinyloop", progress=False))[0]["weights"]["quant"]
    assert q["head"] == {"method": "rtn", "bits": 8, "group_size": None} and "Q8_0" in q["head_note"]
    other = tmp_path / "q8.gguf"
    write_gguf(other, default=Q.Q8_0)
    q = read_header(convert(other, tmp_path / "q8.tinyloop", progress=False))[0]
    assert q["weights"]["quant"]["method"] == "none"
    with pytest.raises(ConvertError, match="every block matrix in Q4_1"):
        convert_gguf(other, tmp_path / "x.tinyloop", quant="q4_1", progress=False)
