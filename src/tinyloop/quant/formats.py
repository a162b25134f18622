"""Quantized `.tinyloop` files: which tensors are quantized, what they are named, how they load.

A quantized linear `X.weight` (N, K) is stored as `X.qweight`, `X.scales`, `X.zeros` (layout in
`quant.packing`); every other tensor (embedding / tied head, norms) stays in the header's float dtype and
is listed in `quant["high_precision"]`. The header's quant section:

    {"method": "gptq" | "rtn", "bits": 4, "group_size": 32 (null: per channel), "act_order": false,
     "layout": "tinyloop-packed-v1", "high_precision": ["embed.weight", ...], ...calibration details,
     "head": {"method": "rtn", "bits": 8, "group_size": null}}   # optional: a quantized LM head

A quantized LM head is stored beside the float head (the embedding stays float for lookups when they are
tied) as `head.qweight`, `head.scales`, `head.zeros`, and loads as the model's `head_linear`.

int4's min form (layout "tinyloop-packed-min-v1", method "gguf": a GGUF's Q4_1 blocks imported as they are,
`tools/gguf.py`): each quantized linear is `X.qweight`, `X.scales` and `X.mins` (float16 (N, K/G): w = q * scale
+ min, `quant.packing.dequantize_min`) in place of `X.zeros`; the head, if quantized, keeps the zero-point form.
A reader that predates the form refuses the file by its layout name. A GGUF's Q8_0 head is kept as it is too: an
int8 head (zero point 128) in groups of 32, its `head` entry's method "gguf".

At load (`load_quantized`) the model built on the meta device gets a `QuantLinear` in place of each
quantized `nn.Linear`, and the float tensors are assigned without copies.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .linear import QuantLinear
from .packing import QuantError, SUPPORTED_BITS, pack, resolve_group_size

LAYOUT = "tinyloop-packed-v1"
MIN_LAYOUT = "tinyloop-packed-min-v1"   # int4's min form: X.mins in place of X.zeros
METHODS = ("rtn", "gptq", "gguf")        # gguf: a GGUF's blocks as they are (tools/gguf.py)
_BLOCK_PREFIXES = ("prelude.", "core.", "coda.")
_SUFFIXES = ("qweight", "scales", "zeros")


# the model-wide (dim, dim) linears quantized like the blocks': the injection adapter and
# the diagonal injection's matrix B and its projection C after the loops (`state_proj`)
_MODEL_LINEARS = ("adapter.weight", "injection.B.weight", "state_proj.weight")


def is_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Linear weights of the blocks (attention and MLP projections), the injection adapter and the diagonal injection's B and
    C (not the small value-embedding gates, Linear(32 -> kv heads), which stay as stored: 32 inputs are one
    quantization group, and a gate is read once per block, not per loop step's weights).

    A file quantized before B and C were (they are in its `high_precision` list) loads as it was written."""
    if len(shape) != 2 or not name.endswith(".weight") or name.endswith(".ve_gate.weight"):
        return False
    return name.startswith(_BLOCK_PREFIXES) or name in _MODEL_LINEARS


def quantized_names(expected: dict[str, tuple], quant: dict[str, Any]) -> list[str]:
    keep = set(quant.get("high_precision") or [])
    return [n for n, (shape, _) in expected.items() if is_quantizable(n, tuple(shape)) and n not in keep]


def check_quant(quant: dict[str, Any]) -> tuple[int, int | None]:
    if quant.get("method") not in METHODS:
        raise QuantError(f"unknown quantization method {quant.get('method')!r}; choose one of {list(METHODS)}")
    bits = quant.get("bits")
    if bits not in SUPPORTED_BITS:
        raise QuantError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if quant.get("layout", LAYOUT) not in (LAYOUT, MIN_LAYOUT):
        raise QuantError(f"unknown packed layout {quant.get('layout')!r} (this version reads {LAYOUT} and "
                         f"{MIN_LAYOUT})")
    if quant.get("layout") == MIN_LAYOUT and bits != 4:
        raise QuantError(f"layout {MIN_LAYOUT} (float minimums) is int4's, not int{bits}'s")
    return bits, quant.get("group_size")


def offset_suffix(quant: dict[str, Any]) -> str:
    """The block weights' offset tensor: "mins" (int4's min form) or "zeros" (the zero-point form)."""
    return "mins" if quant.get("layout") == MIN_LAYOUT else "zeros"


HEAD = "head"   # the quantized LM head's tensors: head.qweight, head.scales, head.zeros


def head_quant(quant: dict[str, Any]) -> tuple[int, int | None] | None:
    """(bits, group size) of a quantized LM head, or None (the head stays float)."""
    head = quant.get("head")
    if head is None:
        return None
    if not isinstance(head, dict) or head.get("bits") not in (4, 8):
        raise QuantError(f"bad quantized head {head!r}: bits must be 4 or 8")
    return head["bits"], head.get("group_size")


def portable_shapes(shape: tuple[int, int], bits: int, group_size: int | None, name: str,
                    offset: str = "zeros", q8_0: bool = False) -> dict[str, tuple]:
    N, K = shape
    G = resolve_group_size(bits, group_size, K, name, q8_0=q8_0)
    return {"qweight": ((N, K * bits // 8), "uint8"), "scales": ((N, K // G), "float16"),
            offset: ((N, K // G), "float16" if offset == "mins" else "uint8")}


def expected_quantized_tensors(expected: dict[str, tuple[tuple[int, ...], str]],
                               quant: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """The float model's tensor list -> the quantized file's: each quantized weight becomes three tensors."""
    bits, group_size = check_quant(quant)
    qnames = set(quantized_names(expected, quant))
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, (shape, dtype) in expected.items():
        if name not in qnames:
            out[name] = (tuple(shape), dtype)
            continue
        base = name[: -len(".weight")]
        for suffix, spec in portable_shapes(tuple(shape), bits, group_size, name, offset_suffix(quant)).items():
            out[f"{base}.{suffix}"] = spec
    head = head_quant(quant)
    if head is not None:
        shape = expected["lm_head.weight" if "lm_head.weight" in expected else "embed.weight"][0]
        q8_0 = quant["head"].get("method") == "gguf"   # (a GGUF's Q8_0 head as it is: int8 in groups of 32)
        for suffix, spec in portable_shapes(tuple(shape), head[0], head[1], "the LM head", q8_0=q8_0).items():
            out[f"{HEAD}.{suffix}"] = spec
    return out


def quantize_head(model: nn.Module, bits: int, group_size: int | None) -> tuple[dict[str, torch.Tensor], dict]:
    """Round-to-nearest codes of the model's LM head (the embedding when tied): (the file's tensors, the
    header's `head` entry). int8 is per channel; int4 takes `group_size`."""
    from .packing import quantize_rtn

    group = None if bits == 8 else group_size
    q, scales, zeros = quantize_rtn(model.head_weight.detach().float(), bits, group)
    return portable_tensors(HEAD, q, scales, zeros, bits), {"method": "rtn", "bits": bits, "group_size": group}


def portable_tensors(base: str, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     bits: int) -> dict[str, torch.Tensor]:
    """Codes q (N, K) + scales/zeros (N, K/G) -> the file's tensors for module `base`."""
    return {f"{base}.qweight": pack(q, bits).contiguous().cpu(),
            f"{base}.scales": scales.to(torch.float16).contiguous().cpu(),
            f"{base}.zeros": zeros.to(torch.uint8).contiguous().cpu()}


def portable_min_tensors(base: str, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> dict[str, torch.Tensor]:
    """int4 codes q (N, K) + float16 scales/mins (N, K/G) -> the min form's tensors for module `base`."""
    return {f"{base}.qweight": pack(q, 4).contiguous().cpu(),
            f"{base}.scales": scales.to(torch.float16).contiguous().cpu(),
            f"{base}.mins": mins.to(torch.float16).contiguous().cpu()}


def quant_header(method: str, bits: int, group_size: int | None, *, act_order: bool = False,
                 high_precision: list[str], layout: str = LAYOUT, **extra: Any) -> dict[str, Any]:
    quant = {"method": method, "bits": bits, "group_size": None if bits == 8 else group_size,
             "act_order": bool(act_order), "layout": layout, "high_precision": sorted(high_precision), **extra}
    check_quant(quant)
    return quant


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_name, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def install_quantized(model: nn.Module, tensors: dict[str, torch.Tensor], bits: int, *,
                      device: torch.device | str = "cpu", kernel: str = "auto") -> list[str]:
    """Swap in a `QuantLinear` for every `X.qweight` in `tensors` (consumed from the dict); returns X's.
    A layer with `X.mins` (int4's min form) in place of `X.zeros` gets that form."""
    bases = sorted(k[: -len(".qweight")] for k in tensors if k.endswith(".qweight"))
    for base in bases:
        qw, sc = tensors.pop(f"{base}.qweight"), tensors.pop(f"{base}.scales")
        if f"{base}.mins" in tensors:
            mod = QuantLinear.from_portable(qw, sc, None, bits, device, kernel=kernel, mins=tensors.pop(f"{base}.mins"))
        else:
            mod = QuantLinear.from_portable(qw, sc, tensors.pop(f"{base}.zeros"), bits, device, kernel=kernel)
        _set_module(model, base, mod)
    return bases


def load_quantized(model: nn.Module, tensors: dict[str, torch.Tensor], weights: dict[str, Any], *,
                   device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
    """A model built on the meta device + the file's tensors -> a quantized model on `device`."""
    bits, _ = check_quant(weights["quant"])
    tensors = dict(tensors)
    head = head_quant(weights["quant"])
    head_parts = [tensors.pop(f"{HEAD}.{s}") for s in _SUFFIXES] if head is not None else None
    install_quantized(model, tensors, bits, device=device)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    model.load_state_dict(tensors, strict=True, assign=True)
    if head_parts is not None:   # logits() reads it; head_weight (float) stays for lookups and draft heads
        # the torch kernels take bf16 activations, whose rounding depends on the rows of a call: a head must
        # score one row and a verification batch alike (speculation equals plain greedy), so without the
        # native kernels the head runs on its dequantized weight
        from .linear import _native_executor
        kernel = "auto" if torch.device(device).type == "cpu" and _native_executor() else "dense"
        model.head_linear = QuantLinear.from_portable(*head_parts, head[0], device, kernel=kernel)
    return model.to(device)


def quantized_weight_bytes(model: nn.Module) -> int:
    """Bytes of the block weights one token's pass reads once (quantized kernels' buffers + float linears)."""
    total = 0
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            total += mod.weight_bytes
        elif isinstance(mod, nn.Linear) and is_quantizable(f"{name}.weight", tuple(mod.weight.shape)):
            total += mod.weight.numel() * mod.weight.element_size()
    return total
