"""KV-cache quantizers: one asymmetric scale and offset per (token, head) vector of head_dim values.

    fp16    unquantized (the cache's float dtype)
    int8    8-bit codes + float16 scale and offset per vector: D + 4 bytes per vector
    int4    4-bit codes (two per byte) + float16 scale and offset:  D/2 + 4 bytes per vector
    int4-h  int4 after an orthonormal Walsh-Hadamard rotation over the head dimension (QuaRot): an outlier
            channel is spread over all D channels before rounding, and rotated back when read

Per-vector (per token) quantization keeps a ring-buffer cache simple: a position is written once, read
many times, and rolling back or copying a position moves its codes with their own scale and offset.
"""

from __future__ import annotations

import torch

from .packing import pack, unpack

KV_FORMATS = ("fp16", "int8", "int4", "int4-h")
_BITS = {"fp16": None, "int8": 8, "int4": 4, "int4-h": 4}


def kv_format_bits(kv_format: str) -> int | None:
    """Bits per stored value (None for the unquantized format); ValueError for an unknown format."""
    if kv_format not in _BITS:
        raise ValueError(f"unknown KV cache format {kv_format!r}; choose one of {list(KV_FORMATS)}")
    return _BITS[kv_format]


def kv_format_rotates(kv_format: str) -> bool:
    kv_format_bits(kv_format)
    return kv_format.endswith("-h")


def quantize_vectors(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., D) -> (codes uint8 (..., D * bits / 8), scale float16 (..., 1), offset float16 (..., 1))."""
    maxq = 2 ** bits - 1
    xf = x.float()
    lo = xf.amin(dim=-1, keepdim=True).half()
    hi = xf.amax(dim=-1, keepdim=True)
    scale = ((hi - lo.float()) / maxq).clamp_min(1e-6).half()
    q = torch.clamp(torch.round((xf - lo.float()) / scale.float()), 0, maxq).to(torch.uint8)
    lead, D = q.shape[:-1], q.shape[-1]
    codes = pack(q.reshape(-1, D), bits).reshape(*lead, D * bits // 8)
    return codes, scale, lo


def dequantize_vectors(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_vectors` (up to rounding): -> (..., D) in `dtype`."""
    lead, nb = codes.shape[:-1], codes.shape[-1]
    q = unpack(codes.reshape(-1, nb), bits).reshape(*lead, nb * 8 // bits)
    cdt = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    return (q.to(cdt) * scale.to(cdt) + offset.to(cdt)).to(dtype)


def bytes_per_vector(head_dim: int, kv_format: str, float_bytes: int = 2) -> int:
    """Stored bytes for one (token, head) key or value vector; `float_bytes` for the unquantized format."""
    bits = kv_format_bits(kv_format)
    if bits is None:
        return head_dim * float_bytes
    return head_dim * bits // 8 + 4  # codes + float16 scale + float16 offset
