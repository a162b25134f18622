"""`tinyloop quantize IN OUT`: read a float .tinyloop file, quantize its block linears, write a quantized one.

The output loads with `Engine.load` like any model file (`quant.formats.load_quantized` swaps in the
quantized modules) and `tinyloop info` reports `quant: int4` (or int2 / int8) from its header.

Streamed, in bounded memory: the model is built on the meta device, its small tensors are views of the
mapped input, and each linear to quantize is a `quant.streamed.StreamedLinear` that reads its weight from
the input file when it runs (pread: nothing stays resident). The output's layout (its header, known before
any layer is quantized) is written first; each layer's codes are written at their place as soon as they
are made and read back from there by later GPTQ calibration passes, so the process holds one layer and
the working space of its quantization, never a float copy of the model. The output is moved into place
when complete (atomic).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from ..modelfile.loader import DTYPES, TORCH_DTYPES, TORCH_DTYPES_BY_NAME, check_header, expected_tensors, make_header, \
    map_tensors, read_header, read_tokenizer, tokenizer_blob
from ..modelfile.layout import FUSED_VERSION, part_rows
from ..quant.formats import load_quantized, quantize_head
from ..quant.packing import QuantError
from ..quant.streamed import StreamedLinear
from ..train.data import read_calibration  # noqa: F401 - re-exported: calibration windows are training data
from .gptq import QuantSpec, format_report, quant_section, quantizable_linears, quantize_model


def quantized_model(cfg, tensors: dict[str, torch.Tensor], quant: dict[str, Any], dtype: torch.dtype,
                    device: str | torch.device = "cpu") -> torch.nn.Module:
    """Build a quantized LoopedTransformer in memory from `quantize_model`'s tensors (what loading the file gives)."""
    from ..model.fused import meta_model

    model = meta_model(cfg, fused=False)  # the PyTorch definition's names, as `quantize_model` gives them
    name = {v: k for k, v in DTYPES.items()}[dtype]
    return load_quantized(model, dict(tensors), {"dtype": name, "quant": quant}, device=device).eval()


class FileReader:
    """Tensors of a checked model file read on demand with pread, by the PyTorch definition's names (a
    version 2 file's fused projections are read by their parts' rows). Each read is a fresh tensor; the
    file's pages stay in the page cache, not in this process."""

    def __init__(self, path: Path, index: dict[str, Any], cfg, version: int):
        with open(path, "rb") as f:
            self.base = 8 + int.from_bytes(f.read(8), "little")
        self.fd = os.open(path, os.O_RDONLY)
        self.index = index
        self.parts = part_rows(cfg, index) if version >= FUSED_VERSION else {}

    def __call__(self, name: str) -> torch.Tensor:
        target, row, rows = self.parts.get(name, (name, 0, None))
        t = self.index[target]
        start, end = (int(x) for x in t["data_offsets"])
        shape = [int(d) for d in t["shape"]]
        row_bytes = (end - start) // shape[0]
        rows = shape[0] if rows is None else rows
        data = os.pread(self.fd, rows * row_bytes, self.base + start + row * row_bytes)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(TORCH_DTYPES[t["dtype"]]) \
            .reshape(rows, *shape[1:])

    def close(self) -> None:
        os.close(self.fd)


def streamed_model(path: Path, header: dict[str, Any], index: dict[str, Any], cfg, reader: FileReader,
                   *, calibrate: bool) -> torch.nn.Module:
    """The file's model with the PyTorch definition's modules: every linear to quantize a `StreamedLinear`
    over `reader`, every other tensor a view of the mapped file. `calibrate`: ready for fp32 calibration
    passes (activations in fp32; norms and biases, a few vectors, in fp32; the embedding and head stay
    where they lie)."""
    from ..model.fused import meta_model

    model = meta_model(cfg, fused=False)
    for name, lin in quantizable_linears(model):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                StreamedLinear(lin.in_features, lin.out_features, name, reader))
    tensors = map_tensors(path, index)
    model.load_state_dict({k: tensors[k] for k in model.state_dict()}, strict=True, assign=True)
    if calibrate:
        big = {"embed.weight", "lm_head.weight"}
        for name, p in list(model.named_parameters()):
            if name not in big and p.dtype != torch.float32:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, torch.nn.Parameter(p.detach().float(), requires_grad=False))
        model.act_dtype = torch.float32
    return model.eval()


def quantize_file(src: str | Path, dst: str | Path, spec: QuantSpec, *,
                  calib: str | Path | list[str | Path] | None = None, calib_tokens: int = 8192,
                  calib_seq_len: int = 256, calib_val_fraction: float = 0.0,
                  progress: bool = True, head_bits: int | None = None) -> dict[str, Any]:
    """Quantize the float model file `src` into `dst` (streamed, see the module's doc). Returns the report
    (per-layer errors for GPTQ, `seconds`, `file_bytes`, `text`). head_bits 8 or 4 quantizes the LM head
    too (round-to-nearest; int4 with the blocks' group size); None keeps it in the file's float dtype."""
    if head_bits not in (None, 4, 8):
        raise QuantError(f"head bits must be 4 or 8 (or none: a float head), got {head_bits!r}")
    from ..modelfile.writer import ModelFileWriter

    t0 = time.perf_counter()
    src = Path(src)
    header, index = read_header(src)
    cfg = check_header(src, header, index)
    if (header["weights"].get("quant") or {}).get("method", "none") != "none":
        raise QuantError(f"{src} is already quantized; quantize a float model file")
    tok_tensor = header["tokenizer"]["tensor"]
    tok = read_tokenizer(src, header, map_tensors(src, {tok_tensor: index[tok_tensor]})[tok_tensor].numpy().tobytes(),
                         cfg)
    dtype = DTYPES[header["weights"]["dtype"]]  # the file's float dtype: high-precision tensors keep it
    calib_ids = None
    if spec.method == "gptq":
        if calib is None:
            raise QuantError("GPTQ needs calibration text: pass --calib FILE (RTN needs none)")
        calib_ids = read_calibration(calib, tok, calib_tokens, min(calib_seq_len, cfg.max_seq_len),
                                     val_fraction=calib_val_fraction)
    reader = FileReader(src, index, cfg, header["format_version"])
    try:
        model = streamed_model(src, header, index, cfg, reader, calibrate=spec.method == "gptq")
        spec.validate(model)
        quant = quant_section(model, spec, calib_ids)
        if calib is not None and spec.method == "gptq":
            files = [calib] if isinstance(calib, (str, Path)) else list(calib)
            quant["calibration"]["files"] = [os.path.basename(str(f)) for f in files]
            if calib_val_fraction > 0:
                quant["calibration"]["split"] = f"training split: last {calib_val_fraction:.0%} of each file left out"
        head = {}
        if head_bits is not None:   # the head's codes, beside the float embedding (quant.formats)
            head, quant["head"] = quantize_head(model, head_bits, spec.group_size or 32)
        out_header = make_header(cfg, dtype, tok, {"tool": "tinyloop quantize", "source": src.name,
                                                   "source_provenance": header.get("provenance", {})}, quant=quant)
        layout = expected_tensors(cfg, out_header["weights"])
        specs = {k: (shape, TORCH_DTYPES_BY_NAME[dt]) for k, (shape, dt) in layout.items()}
        with ModelFileWriter(dst, specs, out_header, tokenizer_blob(tok)) as writer:
            def emit(name: str, tensors: dict[str, torch.Tensor]):
                for k, t in tensors.items():
                    writer.add(k, t)
                return writer.read

            _, _, report = quantize_model(model, spec, calib_ids, progress=progress, fake_quantize=False, emit=emit)
            for k, t in model.state_dict().items():  # the high-precision tensors, in the file's dtype
                writer.add(k, t.to(dtype) if t.is_floating_point() else t)
            for k, t in head.items():
                writer.add(k, t)
    finally:
        reader.close()
    report["file_bytes"] = os.path.getsize(dst)
    report["total_seconds"] = round(time.perf_counter() - t0, 1)
    report["text"] = format_report(report) + f"\nwritten in {report['total_seconds']} s in all"
    return report
