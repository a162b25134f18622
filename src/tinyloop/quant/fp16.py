"""fp16 weights, fp32 activations: FBGEMM's packed fp16-weight GEMM (CPU).

At batch-1 decode a linear layer is bound by the bytes of weight it reads. FBGEMM's fp16-weight kernel
reads 2 bytes per weight and runs at ~0.8 of the memory-bandwidth ceiling on this class of CPU, where
eager bf16 `F.linear` reaches ~0.45 (see docs/decode.md). Activations and accumulation stay fp32.

Numerics: a bf16 or fp16 weight converts to fp16 exactly, except bf16 values below fp16's smallest normal
(|w| < 6.1e-5, absolute error < 3e-8) and above its largest finite value (|w| > 65504: refused). An fp32
weight is rounded to the nearest fp16 (relative error <= 2^-11): lossy, so callers ask for it explicitly.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

FP16_MAX = 65504.0

# Both kernels print a deprecation warning on first use; nothing replaces them on CPU, so silence just those.
warnings.filterwarnings("ignore", message=r"fbgemm_(pack_gemm_matrix_fp16|linear_fp16_weight_fp32_activation)")


def fbgemm_fp16_available() -> bool:
    """True where torch was built with FBGEMM (x86 CPU builds) and the CPU can run it."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            packed = torch.fbgemm_pack_gemm_matrix_fp16(torch.ones(8, 8))
            torch.fbgemm_linear_fp16_weight_fp32_activation(torch.ones(1, 8), packed, None)
        return True
    except RuntimeError:
        return False


def _check_fp16_range(w: torch.Tensor) -> None:
    big = w.detach().abs().max().item() if w.numel() else 0.0
    if big > FP16_MAX:
        raise ValueError(f"weight has |w| = {big:g} > {FP16_MAX:g}, which fp16 cannot hold")


class FP16Linear(nn.Module):
    """y = x @ W^T (+ b) with W held as fp16 in FBGEMM's packed layout; x is cast to fp32, y is fp32.

    The packed weight is an opaque tensor, not a parameter: this module contributes nothing to a
    state dict (it is built at load time from the file's weights, which keep their names).

    `pack=False` (the native executor runs the model): no FBGEMM copy is made; the layer computes on its
    16-bit weight as stored through the native kernels (`kernels.executor.linear_forward`), so the weights
    stay the file's mapped tensors. `pack()` makes the FBGEMM copy later (the executor turned out not to run
    the model).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True):
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D (out, in), got {tuple(weight.shape)}")
        if weight.device.type != "cpu":
            raise ValueError("FP16Linear is a CPU kernel (FBGEMM)")
        src = weight.detach()
        self.out_features, self.in_features = src.shape
        self.bias = None if bias is None else bias.detach().float().clone()
        # the weights as the native executor reads them: the caller's 16-bit tensor itself (no copy), or
        # fp32 weights rounded to fp16 as FBGEMM holds them (the opt-in lossy mode)
        if src.dtype in (torch.float16, torch.bfloat16):
            self.source = src.contiguous()
        else:
            _check_fp16_range(src)
            self.source = src.half()
        self._packed = None
        if pack:
            self.pack()

    def pack(self) -> None:
        """Build FBGEMM's packed fp16 copy (what `forward` uses when it exists)."""
        if self._packed is None:
            if self.source.dtype == torch.bfloat16:   # bf16 reaches past fp16's range; as stored it need not
                _check_fp16_range(self.source)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "deprecated" in recent torch; no replacement kernel exists
                self._packed = torch.fbgemm_pack_gemm_matrix_fp16(self.source.float().contiguous())

    @property
    def packed(self) -> bool:
        return self._packed is not None

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, pack: bool = True) -> "FP16Linear":
        return cls(linear.weight, linear.bias, pack=pack)

    def native_weights(self) -> torch.Tensor:
        """What the native executor (`kernels/`) reads for this layer: the 16-bit weight (out, in)."""
        return self.source

    @property
    def weight_nbytes(self) -> int:
        """Bytes of weight one forward call reads."""
        return 2 * self.out_features * self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if self._packed is None:
            from ..kernels.layers import linear_forward

            y = linear_forward(self, x2)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = torch.fbgemm_linear_fp16_weight_fp32_activation(x2, self._packed, self.bias)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        how = "fp16 (fbgemm)" if self.packed else f"{self.source.dtype} as stored (native kernels)"
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={how}"
