"""Writing a `.tinyloop` file one tensor at a time, in bounded memory (`tinyloop convert`).

`write_model` (modelfile/loader.py) serialises tensors that are all in memory. `ModelFileWriter` instead lays
out the whole file first (the header with every tensor's name, shape, dtype and offsets, known from the
config before any weight is read), then writes each tensor at its offset as it is produced, so a
conversion holds one tensor at a time, not the model. The result is the same safetensors container
(tensors contiguous, sorted by alignment then name; header padded to 8 bytes), written atomically: a
temporary file beside the target, fsync, rename; on any failure (a full disk, a missing tensor) neither
a partial file nor the temporary one is left.

A file of the run-time layout (format version 2, `modelfile.layout`) stores q/k/v and gate/up fused: `add`
takes either the fused tensor or each of its parts under the PyTorch definition's name (`attn.wk.weight`,
`attn.wk.qweight`, ...), written at its rows, so converting and quantizing never concatenate.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import ModelFileError
from .header import ITEM_BYTES, TOKENIZER_TENSOR
from .layout import FUSED_VERSION, part_rows

ST_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
            torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32", torch.int64: "I64", torch.int16: "I16"}


class ModelFileWriter:
    """with ModelFileWriter(path, specs, header, tokenizer_blob) as w: w.add(name, tensor) for each of `specs`
    ({name: (shape, torch dtype)}); leaving the block without an exception checks every tensor was written
    and moves the file into place."""

    def __init__(self, path: str | Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 header: dict[str, Any], tokenizer_blob: bytes):
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        specs = dict(specs)
        specs[TOKENIZER_TENSOR] = ((len(tokenizer_blob),), torch.uint8)
        order = sorted(specs, key=lambda k: (-ITEM_BYTES[ST_NAMES[specs[k][1]]], k))  # aligned, as safetensors
        index: dict[str, Any] = {"__metadata__": {"tinyloop": json.dumps(header)}}
        offset = 0
        self.spans: dict[str, tuple[int, int, tuple[int, ...], torch.dtype]] = {}
        for name in order:
            shape, dtype = specs[name]
            n = ITEM_BYTES[ST_NAMES[dtype]]
            for d in shape:
                n *= d
            index[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            self.spans[name] = (offset, offset + n, tuple(shape), dtype)
            offset += n
        head = json.dumps(index, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        self.prefix = struct.pack("<Q", len(head)) + head
        self.total = len(self.prefix) + offset
        fused = header.get("format_version", FUSED_VERSION) >= FUSED_VERSION and "config" in header
        # part name -> (fused tensor, first row, rows); fused tensor -> its parts
        self.parts = part_rows(ModelConfig.from_dict(header["config"]), specs) if fused else {}
        self.parts_of: dict[str, list[str]] = {}
        for part, (target, _, _) in self.parts.items():
            self.parts_of.setdefault(target, []).append(part)
        self.written: set[str] = set()
        self._blob = tokenizer_blob
        self._f = None

    def __enter__(self) -> "ModelFileWriter":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.tmp, "w+b")  # (read back: `read`)
            self._f.write(self.prefix)
            self._f.truncate(self.total)
        except OSError as exc:
            self._abort()
            raise ModelFileError(self.path, f"cannot write the model file: {exc.strerror or exc}") from None
        self.add(TOKENIZER_TENSOR, torch.frombuffer(bytearray(self._blob), dtype=torch.uint8))
        return self

    def _span(self, name: str) -> tuple[int, int, tuple[int, ...], torch.dtype]:
        """(start, end, shape, dtype) of a tensor of the file, or of a part of a fused one (its rows)."""
        if name in self.spans:
            return self.spans[name]
        if name not in self.parts:
            raise ModelFileError(self.path, f"tensor {name!r} is not part of this file's layout")
        target, row, rows = self.parts[name]
        start, end, shape, dtype = self.spans[target]
        row_bytes = (end - start) // shape[0]
        return start + row * row_bytes, start + (row + rows) * row_bytes, (rows, *shape[1:]), dtype

    def add(self, name: str, t: torch.Tensor) -> None:
        """Write one tensor (cast to its declared dtype) at its place in the file: a tensor of the layout,
        or a part of a fused one."""
        start, end, shape, dtype = self._span(name)
        if tuple(t.shape) != shape:
            raise ModelFileError(self.path, f"tensor {name!r} has shape {list(t.shape)}, the layout says "
                                            f"{list(shape)}")
        data = t.detach().to("cpu", dtype).contiguous().reshape(-1).view(torch.uint8).numpy()
        try:
            self._f.seek(len(self.prefix) + start)
            self._f.write(memoryview(data))
        except OSError as exc:
            self._abort()
            raise ModelFileError(self.path, f"cannot write the model file: {exc.strerror or exc}") from None
        self.written.add(name)

    def read(self, name: str) -> torch.Tensor:
        """A tensor (or part) already written, read back from the file (a fresh tensor: the file's page
        cache holds it, not this process)."""
        start, end, shape, dtype = self._span(name)
        try:
            self._f.flush()
            data = os.pread(self._f.fileno(), end - start, len(self.prefix) + start)
        except OSError as exc:
            self._abort()
            raise ModelFileError(self.path, f"cannot read back the model file: {exc.strerror or exc}") from None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)

    def complete(self) -> set[str]:
        """The file's tensors written so far (a fused one once all its parts are)."""
        done = self.written & set(self.spans)
        return done | {t for t, parts in self.parts_of.items() if all(p in self.written for p in parts)}

    def __exit__(self, exc_type, exc_value, tb) -> None:
        if exc_type is not None:
            self._abort()
            return
        missing = sorted(set(self.spans) - self.complete())
        if missing:
            self._abort()
            raise ModelFileError(self.path, f"tensor {missing[0]!r} was never written"
                                 + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.chmod(self.tmp, 0o644)
            os.replace(self.tmp, self.path)
        except OSError as exc:
            self._abort()
            raise ModelFileError(self.path, f"cannot write the model file: {exc.strerror or exc}") from None

    def _abort(self) -> None:
        if self._f is not None and not self._f.closed:
            self._f.close()
        self.tmp.unlink(missing_ok=True)
