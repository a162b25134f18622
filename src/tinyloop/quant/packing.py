"""The project's portable weight layout: group-wise asymmetric integers, packed little-end first.

A quantized linear weight W (N out, K in) is stored as three tensors:

    qweight  uint8   (N, K * bits / 8)  bits 4: column 2j in the low nibble of byte j, 2j+1 in the high one;
                                         bits 2: columns 4j..4j+3 from the lowest bit pair up; bits 8: as is
    scales   float16 (N, K / G)         one scale per group of G consecutive input columns
    zeros    uint8   (N, K / G)         integer zero point per group, in 0 .. 2^bits - 1

    W[n, k] ~= (q[n, k] - zeros[n, k // G]) * scales[n, k // G]

8-bit weights are symmetric and per output channel (G = K, zero point 128) so that they map onto int8
kernels directly.

int4's min form (GGUF's Q4_1 blocks, imported as they are: `tools/gguf.py`) keeps a float16 minimum per group
in place of the integer zero point:

    mins     float16 (N, K / G)         W[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G]   (fp32)

the dequantization llama.cpp computes for Q4_1 (d * q + m, d and m float16: d * q is exact in fp32, one rounding
for the sum). Nothing here depends on a torch version or kernel: repacking for a kernel happens at
load time in `quant.linear.to_kernel_layout`.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (2, 4, 8)
KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 kernels accept


class QuantError(ValueError):
    """A quantization request that cannot be honoured (bad bits, group size, shape...)."""


def resolve_group_size(bits: int, group_size: int | None, in_features: int, name: str = "weight",
                       q8_0: bool = False) -> int:
    """The group size actually used for a weight with `in_features` columns; raises QuantError if invalid.
    `q8_0`: 8-bit weights may also come in groups of 32 (a GGUF's Q8_0 blocks as they are: `tools/gguf.py`)."""
    if bits not in SUPPORTED_BITS:
        raise QuantError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if bits == 8 and q8_0 and group_size == 32:
        if in_features % 32:
            raise QuantError(f"groups of 32 do not divide the {in_features} input features of {name}")
        return 32
    if bits == 8:
        if group_size not in (None, 0, in_features):
            raise QuantError(f"8-bit weights are per output channel; group size must be 0 (per channel), "
                             f"got {group_size}")
        return in_features
    if group_size is None or group_size <= 0:
        raise QuantError(f"{bits}-bit weights need a positive group size (32, 64 or 128), got {group_size}")
    if group_size not in KERNEL_GROUP_SIZES:
        raise QuantError(f"group size must be one of {KERNEL_GROUP_SIZES} (what the int4 kernels accept), "
                         f"got {group_size}")
    if in_features % group_size:
        raise QuantError(f"group size {group_size} does not divide the {in_features} input features of {name}")
    return group_size


def minmax_params(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and integer zero point for each row of `w` (..., G) from its min and max.

    Returns (scale, zero), each (..., 1), scale already rounded to float16 (what the file stores).
    """
    maxq = 2 ** bits - 1
    w = w.float()
    if bits == 8:  # symmetric: zero point 128, q in 1..255
        scale = (w.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(1e-8)
        scale = scale.half().float()
        return scale, torch.full_like(scale, 128.0)
    wmin = w.amin(dim=-1, keepdim=True)
    wmax = w.amax(dim=-1, keepdim=True)
    scale = ((wmax - wmin) / maxq).clamp_min(1e-8).half().float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # float16 underflow
    zero = torch.round(-wmin / scale).clamp(0, maxq)
    return scale, zero


def quantize_with(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes (as float) of `w` under given scale/zero (broadcast); clamped to the code range."""
    lo = 1 if bits == 8 else 0
    return torch.clamp(torch.round(w.float() / scale) + zero, lo, 2 ** bits - 1)


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest: w (N, K) -> (q uint8 (N, K), scales float16 (N, K/G), zeros uint8 (N, K/G))."""
    N, K = w.shape
    G = resolve_group_size(bits, group_size, K)
    wg = w.float().reshape(N, K // G, G)                 # (N, groups, G)
    scale, zero = minmax_params(wg, bits)                # (N, groups, 1)
    q = quantize_with(wg, scale, zero, bits).reshape(N, K)
    return q.to(torch.uint8), scale[..., 0].half(), zero[..., 0].to(torch.uint8)


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q - zero) * scale, group-wise: q (N, K) codes, scales/zeros (N, K/G) -> (N, K) in `dtype`."""
    N, K = q.shape
    G = K // scales.shape[1]
    qg = q.float().reshape(N, -1, G)
    w = (qg - zeros.float()[..., None]) * scales.float()[..., None]
    return w.reshape(N, K).to(dtype)


def quantize_min(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 in the min form, as llama.cpp's quantize_row_q4_1 does it: per group m = min, d = (max - min) / 15
    (both float16), q = round((w - m) / d) in 0..15. w (N, K) -> (q uint8 (N, K), scales, mins float16 (N, K/G)).
    (TinyLoop's files get this form from GGUF imports; here for tests and for quantizing a float file alike.)"""
    N, K = w.shape
    G = resolve_group_size(4, group_size, K)
    wg = w.float().reshape(N, K // G, G)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(lo))
    q = torch.clamp(torch.round((wg - m.float()) * inv), 0, 15).reshape(N, K)
    return q.to(torch.uint8), d[..., 0], m[..., 0]


def dequantize_min(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale + min, group-wise (int4's min form, GGUF Q4_1): q (N, K) codes, scales/mins (N, K/G) float16 ->
    (N, K) in `dtype`, computed in fp32 as llama.cpp's dequantize_row_q4_1 does."""
    N, K = q.shape
    G = K // scales.shape[1]
    w = q.float().reshape(N, -1, G) * scales.float()[..., None] + mins.float()[..., None]
    return w.reshape(N, K).to(dtype)


def dequantize_any(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, mins: torch.Tensor | None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`dequantize_min` where `mins` is given, else `dequantize` (the zero-point form)."""
    return dequantize_min(q, scales, mins, dtype) if mins is not None else dequantize(q, scales, zeros, dtype)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes q (N, K) in 0..2^bits-1 -> uint8 (N, K * bits / 8), lowest bits first."""
    if bits not in SUPPORTED_BITS:
        raise QuantError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    q = q.to(torch.uint8)
    if bits == 8:
        return q.contiguous()
    per = 8 // bits
    N, K = q.shape
    if K % per:
        raise QuantError(f"{K} columns cannot be packed {per} per byte")
    qg = q.reshape(N, K // per, per)                       # (N, K/per, per)
    out = torch.zeros(N, K // per, dtype=torch.uint8, device=q.device)
    for i in range(per):
        out |= qg[..., i] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: uint8 (N, K * bits / 8) -> codes uint8 (N, K)."""
    if bits not in SUPPORTED_BITS:
        raise QuantError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if bits == 8:
        return packed
    per = 8 // bits
    mask = 2 ** bits - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).reshape(packed.shape[0], packed.shape[1] * per)  # (N, K)
