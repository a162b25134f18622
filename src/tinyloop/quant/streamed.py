"""A linear layer whose weight is read from a file at each call: the streaming quantizer's model.

`tinyloop quantize` calibrates GPTQ with forward passes through the whole model, once per block. Holding
the model in fp32 for them costs 4 bytes per parameter (5.7 GiB at a 1.4B shape); a
`StreamedLinear` instead reads its weight when it runs (the float source file's, then, once quantized, its
codes from the output file) and computes in fp32 with a transient copy of that one layer. The values are
those an fp32 model holding the same weights computes with, so the codes are the same.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .packing import dequantize, unpack

Reader = Callable[[str], torch.Tensor]  # file tensor name -> a fresh tensor


class StreamedLinear(nn.Module):
    """y = x W^T in fp32 (no bias) for the weight `name` (e.g. `core.0.attn.wq`) that `read` returns as
    `name.weight`, or, after `use_quantized`, as `name.qweight`/`.scales`/`.zeros`. Holds no tensor."""

    def __init__(self, in_features: int, out_features: int, name: str, read: Reader):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.name, self._read = name, read
        self.bits: int | None = None

    def use_quantized(self, bits: int, read: Reader) -> None:
        """From now on the weight is the dequantized codes `read` gives for this layer."""
        self.bits, self._read = bits, read

    def float_weight(self) -> torch.Tensor:
        """The weight as the layer computes with it: (out, in) fp32, a fresh tensor."""
        if self.bits is None:
            return self._read(f"{self.name}.weight").float()
        qweight, scales, zeros = (self._read(f"{self.name}.{s}") for s in ("qweight", "scales", "zeros"))
        return dequantize(unpack(qweight, self.bits), scales, zeros, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.float_weight())

    def extra_repr(self) -> str:
        src = "float" if self.bits is None else f"int{self.bits}"
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={src} (read per call)"
