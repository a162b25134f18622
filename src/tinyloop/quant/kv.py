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

from .kv_formats import _BITS, KV_FORMATS, kv_format_bits, kv_format_rotates  # noqa: F401
from .packing import pack, unpack


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


def _take(t: torch.Tensor, index) -> torch.Tensor:
    """t[index]; an index tensor (rows of the first dimension, any shape) goes through index_select, which
    skips the argument parsing of general indexing (it runs for every layer of every step)."""
    if isinstance(index, torch.Tensor):
        return torch.index_select(t, 0, index.reshape(-1)).view(*index.shape, *t.shape[1:])
    return t[index]


class KVTensor:
    """Keys (or values) of a KV store, the one storage implementation every cache layout uses.

    `shape` is (*lead, D): the contiguous cache uses (slots, batch, Hkv, positions, D) and the paged pool
    (pages, page_size, Hkv, D). "fp16" keeps floats in `dtype`; the quantized formats keep codes plus a
    float16 scale and offset per D-vector (`quantize_vectors`), and int4-h multiplies each vector by the
    orthonormal Hadamard matrix H before quantizing and again (H @ H = I) after dequantizing, so readers
    always see the original basis in `dtype`.

    `write(index, x)` stores x at `storage[index]`; `read(index)` returns `storage[index]` dequantized;
    `index` is anything tensor indexing takes (an int, slices, index tensors).
    """

    def __init__(self, shape: tuple[int, ...], kv_format: str, dtype: torch.dtype, device):
        from .hadamard import hadamard_matrix

        bits = kv_format_bits(kv_format)
        *lead, D = shape
        self.shape, self.bits, self.dtype, self.kv_format = tuple(shape), bits, dtype, kv_format
        self.H = None
        if bits is None:
            self.data = torch.zeros(*lead, D, dtype=dtype, device=device)
            self.parts = (self.data,)
            return
        self.codes = torch.zeros(*lead, D * bits // 8, dtype=torch.uint8, device=device)
        self.scale = torch.zeros(*lead, 1, dtype=torch.float16, device=device)
        self.offset = torch.zeros(*lead, 1, dtype=torch.float16, device=device)
        self.parts = (self.codes, self.scale, self.offset)
        if kv_format_rotates(kv_format):
            self.H = hadamard_matrix(D, torch.float64 if dtype == torch.float64 else torch.float32, device)

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts)

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.H is not None:
            x = x.to(self.H.dtype) @ self.H
        return quantize_vectors(x, self.bits)

    def _decode(self, codes, scale, offset, dtype: torch.dtype) -> torch.Tensor:
        if self.H is None:
            return dequantize_vectors(codes, scale, offset, self.bits, dtype)
        return (dequantize_vectors(codes, scale, offset, self.bits, self.H.dtype) @ self.H).to(dtype)

    def write(self, index, x: torch.Tensor) -> None:
        if self.bits is None:
            self.data[index] = x if x.dtype == self.dtype else x.to(self.dtype)
            return
        self.codes[index], self.scale[index], self.offset[index] = self._encode(x)

    def read(self, index, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if self.bits is None:
            x = _take(self.data, index)
            return x if x.dtype == dtype else x.to(dtype)
        return self._decode(_take(self.codes, index), _take(self.scale, index), _take(self.offset, index), dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """x as it would read back after a write (quantized and dequantized; float formats: cast)."""
        if self.bits is None:
            return x.to(self.dtype)
        return self._decode(*self._encode(x), self.dtype)

    def copy(self, src, dst) -> None:
        """storage[dst] = storage[src] (codes move with their own scale and offset)."""
        for t in self.parts:
            t[dst] = t[src].clone()
