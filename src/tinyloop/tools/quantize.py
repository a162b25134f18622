"""`tinyloop quantize IN OUT`: read a float .tinyloop file, quantize its block linears, write a quantized one.

The output loads with `Engine.load` like any model file (`quant.formats.load_quantized` swaps in the
quantized modules) and `tinyloop info` reports `quant: int4` (or int2 / int8) from its header.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..modelfile import load_model, make_header, write_model
from ..quant.formats import load_quantized, quantize_head
from ..quant.packing import QuantError
from ..train.data import read_calibration  # noqa: F401 - re-exported: calibration windows are training data
from .gptq import QuantSpec, format_report, quantize_model


def quantized_model(cfg, tensors: dict[str, torch.Tensor], quant: dict[str, Any], dtype: torch.dtype,
                    device: str | torch.device = "cpu") -> torch.nn.Module:
    """Build a quantized LoopedTransformer in memory from `quantize_model`'s tensors (what loading the file gives)."""
    from ..model import LoopedTransformer
    from ..modelfile import DTYPES

    with torch.device("meta"):
        model = LoopedTransformer(cfg)
    name = {v: k for k, v in DTYPES.items()}[dtype]
    return load_quantized(model, dict(tensors), {"dtype": name, "quant": quant}, device=device).eval()


def quantize_file(src: str | Path, dst: str | Path, spec: QuantSpec, *,
                  calib: str | Path | list[str | Path] | None = None, calib_tokens: int = 8192,
                  calib_seq_len: int = 256, calib_val_fraction: float = 0.0,
                  progress: bool = True, head_bits: int | None = None) -> dict[str, Any]:
    """Quantize `src`'s block linears into `dst` (atomically); head_bits 8 or 4 quantizes the LM head too
    (round-to-nearest; int4 with the blocks' group size), None keeps it in the file's float dtype."""
    if head_bits not in (None, 4, 8):
        raise QuantError(f"head bits must be 4 or 8 (or none: a float head), got {head_bits!r}")
    loaded = load_model(src)
    model, tok = loaded.model, loaded.tokenizer
    if (loaded.header["weights"].get("quant") or {}).get("method", "none") != "none":
        raise QuantError(f"{src} is already quantized; quantize a float model file")
    dtype = next(model.parameters()).dtype  # the file's float dtype: high-precision tensors keep it
    if dtype in (torch.float16, torch.bfloat16) and spec.method == "gptq":
        model.float()  # calibrate in fp32 (RTN reads one layer at a time from the mapped file instead)
    calib_ids = None
    if spec.method == "gptq":
        if calib is None:
            raise QuantError("GPTQ needs calibration text: pass --calib FILE (RTN needs none)")
        calib_ids = read_calibration(calib, tok, calib_tokens, min(calib_seq_len, model.cfg.max_seq_len),
                                     val_fraction=calib_val_fraction)
    tensors, quant, report = quantize_model(model, spec, calib_ids, progress=progress, fake_quantize=False)
    tensors = {k: v.to(dtype) if v.is_floating_point() and k in quant["high_precision"] else v
               for k, v in tensors.items()}
    if head_bits is not None:
        head_tensors, quant["head"] = quantize_head(model, head_bits, spec.group_size or 32)
        tensors.update(head_tensors)
    if calib is not None and spec.method == "gptq":
        files = [calib] if isinstance(calib, (str, Path)) else list(calib)
        quant["calibration"]["files"] = [os.path.basename(str(f)) for f in files]
        if calib_val_fraction > 0:
            quant["calibration"]["split"] = f"training split: last {calib_val_fraction:.0%} of each file left out"
    header = make_header(model.cfg, dtype, tok, {"tool": "tinyloop quantize", "source": os.path.basename(str(src)),
                                                 "source_provenance": loaded.header.get("provenance", {})},
                         quant=quant)
    write_model(dst, None, tokenizer=tok, tensors=tensors, header=header)
    report["file_bytes"] = os.path.getsize(dst)
    report["text"] = format_report(report)
    return report
