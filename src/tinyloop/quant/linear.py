"""Quantized linear modules, built at load time from the portable layout (`quant.packing`).

`to_kernel_layout` is the one place that knows a torch kernel's private weight layout: it repacks the
portable codes for the device and checks the kernel against a dequantized reference on a random probe,
falling back to a dequantized dense weight (with a warning) when a kernel is missing or disagrees.

    bits 4, CPU   torch.ops.aten._weight_int4pack_mm_for_cpu  (bf16 activations, group-wise scale + zero)
    bits 2        the same int4 kernels: 2-bit codes 0..3 become 4-bit codes 6..9 with the same scale and a
                  shifted offset, so int2 runs at int4 speed (the file is smaller, the bytes read are int4's)
    bits 4/2 CUDA torch.ops.aten._weight_int4pack_mm (tinygemm)
    bits 8        torch.ops.aten._weight_int8pack_mm (per-channel symmetric)
    native        the native executor's kernels (`kernels/`), chosen on CPU when that executor runs: they
                  read the portable tensors as they are (no repacking, fp32 activations), so the native
                  executor and the PyTorch path (tree speculation, forwards without pages) share one
                  copy of the weights

The kernels take bf16 activations (the int4 CPU kernel is ~30x slower with fp32 ones): inputs are cast
to bf16 and outputs back to the caller's dtype. Multi-row inputs (prefill, verification) use the same
kernels: at M = 256 they measured 1.4x slower than a bf16 dense GEMM, while keeping a dense copy would
cost the memory the format exists to save (see docs/quantization.md).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..torch_threads import torch_threads
from .packing import dequantize_any, unpack

KERNEL_DTYPE = torch.bfloat16
CHECK_TOLERANCE = 2e-2  # relative max error of a kernel against the dequantized reference (bf16 inputs)
NATIVE_CHECK_ROWS = 64  # output rows of each layer the native kernels are checked on at load (see to_kernel_layout)


def _int4_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes -> the int4 kernel's codes: 2-bit codes 0..3 are shifted to 6..9, around the kernel's 8, so
    that the bf16 rounding of scale and offset is multiplied by |q - 8| <= 2 instead of up to 8."""
    return q.to(torch.int32) + (6 if bits == 2 else 0)


def _int4_scales_zeros(scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                       mins: torch.Tensor | None = None) -> torch.Tensor:
    """Portable (N, K/G) scale + integer zero (or float minimum) -> torch's (K/G, N, 2) [scale, offset] for
    w = (q4 - 8) * s + o."""
    s = scales.float()
    shift = 6 if bits == 2 else 0
    if mins is not None:   # q s + m = (q - 8) s + (8 s + m)
        offset = 8.0 * s + mins.float()
    else:
        offset = (8.0 - shift - zeros.float()) * s    # (q - z) s = (q + shift - 8) s + (8 - shift - z) s
    return torch.stack([s.t(), offset.t()], dim=-1).contiguous()  # (K/G, N, 2)


def _kernel_call(kind: str, x: torch.Tensor, bufs: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    if kind == "native":
        from ..kernels.layers import linear_forward
        return linear_forward(_NativeView(bufs, group_size), x)
    if kind == "int4pack_cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, bufs["packed"], group_size, bufs["sz"])
    if kind == "int4pack_cuda":
        return torch.ops.aten._weight_int4pack_mm(x, bufs["packed"], group_size, bufs["sz"])
    if kind == "int8pack":
        return torch.ops.aten._weight_int8pack_mm(x, bufs["w8"], bufs["s8"])
    return F.linear(x.to(bufs["w"].dtype), bufs["w"])


class _NativeView:
    """The portable buffers as `kernels.executor.linear_desc` reads a `QuantLinear` of kind "native"."""

    def __init__(self, bufs: dict[str, torch.Tensor], group_size: int):
        k = group_size * bufs["scales"].shape[1]
        self.w = {"bits": bufs["qweight"].shape[1] * 8 // k, "group_size": group_size, **bufs}

    def native_weights(self) -> dict:
        return self.w


def _native_executor() -> bool:
    from ..kernels.lib import native_wanted
    return native_wanted()


def to_kernel_layout(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                     device: torch.device | str = "cpu", *, kernel: str = "auto",
                     check: bool = True, mins: torch.Tensor | None = None) -> tuple[str, dict[str, torch.Tensor]]:
    """Portable tensors -> (kind, buffers) for `QuantLinear`. THE torch-version-specific repacking.
    `mins` (int4 only, `zeros` None): the min form, w = q * scale + min (quant/packing.py `dequantize_min`).

    kernel: "auto" (the native kernels where the native executor runs, else the device's torch kernel),
    "torch" (the device's torch kernel), "native", or "dense" (dequantized float32 weight: a reference path).
    """
    device = torch.device(device)
    if mins is not None and bits != 4:
        raise ValueError(f"float minimums are int4's form, not int{bits}'s")
    N, K = qweight.shape[0], qweight.shape[1] * 8 // bits
    offsets = {"mins": mins.contiguous()} if mins is not None else {"zeros": zeros.contiguous()}
    group_size = K // scales.shape[1]
    kind, bufs = "dense", {}
    if kernel == "auto" and device.type == "cpu" and _native_executor():
        kernel = "native"
    if kernel == "native":
        if device.type != "cpu":
            raise ValueError("the native kernels run on the CPU")
        # the portable tensors as they lie (views of a mapped file: nothing is copied), checked on their
        # first rows: every output row is computed from its own codes alone, so a slice catches a wrong
        # layout or instruction path without unpacking the whole layer at every load
        kind, bufs = "native", {"qweight": qweight.contiguous(), "scales": scales.contiguous(), **offsets}
        if check:
            # on one torch thread: a few small tensors, next to the native pool's spinning workers (a 4B
            # model's 180 checks took 16 s on two threads of a loaded two-core host, 0.6 s on one)
            rows = min(N, NATIVE_CHECK_ROWS)
            with torch_threads(1):
                ok = _check_kernel(kind, {k: v[:rows] for k, v in bufs.items()}, group_size,
                                   dequantize_any(unpack(qweight[:rows], bits), scales[:rows],
                                                  None if zeros is None else zeros[:rows],
                                                  None if mins is None else mins[:rows]), device)
            if not ok:
                kind, bufs = "dense", {}
        check = False
    q = unpack(qweight, bits) if kind != "native" else None    # (N, K) codes
    if kernel in ("auto", "torch"):
        try:
            if bits in (2, 4) and device.type == "cpu":
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(_int4_codes(q, bits), 1)
                kind, bufs = "int4pack_cpu", {"packed": packed,
                                              "sz": _int4_scales_zeros(scales, zeros, bits, mins).to(KERNEL_DTYPE)}
            elif bits in (2, 4) and device.type == "cuda":
                q8 = _int4_codes(q, bits).to(torch.uint8)
                u8 = (q8[:, ::2] << 4 | q8[:, 1::2]).to(device)    # tinygemm's input: high nibble first
                packed = torch.ops.aten._convert_weight_to_int4pack(u8, 8)
                kind, bufs = "int4pack_cuda", {"packed": packed,
                                               "sz": _int4_scales_zeros(scales, zeros, bits, mins).to(device, KERNEL_DTYPE)}
            elif bits == 8 and scales.shape[1] == 1:   # (per channel; int8 in groups, a Q8_0 head: dense here)
                w8 = (q.to(torch.int16) - zeros.to(torch.int16)).to(torch.int8)  # symmetric: zero point 128
                kind, bufs = "int8pack", {"w8": w8.to(device),
                                          "s8": scales[:, 0].to(device, KERNEL_DTYPE).contiguous()}
        except (RuntimeError, NotImplementedError) as exc:
            warnings.warn(f"no {bits}-bit kernel for {N}x{K} on {device.type} ({exc}); using a dense weight")
            kind, bufs = "dense", {}
    if kind != "dense" and check and not _check_kernel(kind, bufs, group_size, dequantize_any(q, scales, zeros, mins),
                                                       device):
        kind, bufs = "dense", {}
    if kind == "dense":
        q = unpack(qweight, bits) if q is None else q
        bufs = {"w": dequantize_any(q, scales, zeros, mins, torch.float32).to(device)}
    return kind, bufs


def _check_kernel(kind: str, bufs: dict[str, torch.Tensor], group_size: int, w_ref: torch.Tensor,
                  device: torch.device) -> bool:
    """Whether the kernel `kind` over `bufs` computes x w_ref^T (within CHECK_TOLERANCE) on a random probe;
    warns (a dense weight is used instead) when it does not."""
    N, K = w_ref.shape
    probe = torch.randn(2, K, generator=torch.Generator().manual_seed(0)).to(device, KERNEL_DTYPE)
    try:
        got = _kernel_call(kind, probe, bufs, group_size).float()
        ref = probe.float() @ w_ref.to(device).t()
        bad = not torch.isfinite(got).all() or \
            (got - ref).abs().max() > CHECK_TOLERANCE * ref.abs().max().clamp_min(1e-6)
    except (RuntimeError, NotImplementedError) as exc:
        bad = True
        warnings.warn(f"{kind} kernel failed on {device.type}: {exc}")
    if bad:
        warnings.warn(f"{kind} kernel disagrees with the dequantized weights on {device.type}; "
                      f"using a dense weight for this {N}x{K} layer")
    return not bad


class QuantLinear(nn.Module):
    """y = x W^T for a W stored in `bits` bits (no bias). Holds only the kernel's buffers (not persistent:
    the file keeps the portable tensors under their own names, see `quant.formats`)."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, kind: str,
                 bufs: dict[str, torch.Tensor]):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.kind = bits, group_size, kind
        for name, t in bufs.items():
            self.register_buffer(name, t, persistent=False)
        self._names = tuple(bufs)

    @classmethod
    def from_portable(cls, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                      device: torch.device | str = "cpu", *, kernel: str = "auto",
                      mins: torch.Tensor | None = None) -> "QuantLinear":
        N = qweight.shape[0]
        K = qweight.shape[1] * 8 // bits
        kind, bufs = to_kernel_layout(qweight, scales, zeros, bits, device, kernel=kernel, mins=mins)
        return cls(K, N, bits, K // scales.shape[1], kind, bufs)

    def native_weights(self) -> dict | None:
        """What the native executor (`kernels/`) reads for this layer (kind "native"; None otherwise)."""
        if self.kind != "native":
            return None
        offset = "mins" if "mins" in self._names else "zeros"   # (int4's min form: GGUF Q4_1)
        return {"bits": self.bits, "group_size": self.group_size, "qweight": self.qweight, "scales": self.scales,
                offset: getattr(self, offset)}

    @property
    def weight_bytes(self) -> int:
        """Bytes this layer reads per matmul (what bounds batch-1 decode)."""
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in self._names)

    @classmethod
    def concat(cls, parts: list["QuantLinear"]) -> "QuantLinear | None":
        """One layer whose output rows are `parts`' rows in order (fused q/k/v or gate/up), or None.

        Every kernel here computes each output row from that row's codes and scales alone, so stacking
        the kernel buffers along the output dimension is exact where the layout keeps rows apart (the CPU
        int4 layout packs rows in blocks of 64, so parts must be multiples of 64 rows). The result is
        checked against the parts on a random probe (bitwise) and None is returned if they do not stack.
        """
        first = parts[0]
        if any((p.kind, p.bits, p.group_size, p.in_features, p._names) !=
               (first.kind, first.bits, first.group_size, first.in_features, first._names) for p in parts):
            return None
        # output dimension of each buffer: sz is (K/G, N, 2); every other buffer has N first
        bufs = {n: torch.cat([getattr(p, n) for p in parts], dim=1 if n == "sz" else 0) for n in first._names}
        fused = cls(first.in_features, sum(p.out_features for p in parts), first.bits, first.group_size,
                    first.kind, bufs)
        dev = bufs[first._names[0]].device
        probe = torch.randn(3, first.in_features, generator=torch.Generator().manual_seed(0)).to(dev)
        with torch.no_grad():
            ok = torch.equal(fused(probe), torch.cat([p(probe) for p in parts], dim=-1))
        return fused if ok else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "native":  # fp32 activations in and out (the native executor's layers)
            from ..kernels.layers import linear_forward
            return linear_forward(self, x).to(x.dtype)
        x2 = x.reshape(-1, self.in_features)                      # (M, K)
        if self.kind == "int4pack_cpu":  # the hot path (CPU decode): no per-call dict of buffers
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(KERNEL_DTYPE), self.packed, self.group_size,
                                                            self.sz)
        else:
            bufs = {n: getattr(self, n) for n in self._names}
            xin = x2 if self.kind == "dense" else x2.to(KERNEL_DTYPE)
            y = _kernel_call(self.kind, xin, bufs, self.group_size)  # (M, N)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, kernel={self.kind}")
