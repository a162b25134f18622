"""The `.tinyloop` model file: a safetensors container with one versioned JSON header.

Layout: safetensors' own framing (8-byte header length, JSON tensor index, raw data), with
`__metadata__["tinyloop"]` holding the header below, the model's tensors under their state-dict names,
and the tokenizer's BPE ranks as the uint8 tensor `tokenizer.bpe_ranks`:

    {"format": "tinyloop", "format_version": 2,
     "config": ModelConfig.to_dict(),
     "weights": {"dtype": "float16", "quant": {"method": "none", "bits": 16, "group_size": null,
                                                "high_precision": []}},
     "tokenizer": {"type": "gpt2-bpe", "tensor": "tokenizer.bpe_ranks", "pattern": ..., "eos_token": ...,
                   "eos_id": 50256, "sha256": ...},
        (or, for imported checkpoints: {"type": "hf-tokenizers", "tensor": ..., "eos_ids": [...], "eos_token":
         ..., "bos_token": ..., "chat_template": ..., "sha256": ...}: the tensor holds tokenizer.json)
     "provenance": {...}}

Format version 2 stores q/k/v and gate/up fused, as the engine computes them (`modelfile.layout`), and
`load_model` binds the model to views of the mapped file: no weight is read or copied at load. A version 1
file is fused in memory at each load, with a one-line notice; `tinyloop upgrade` rewrites it once.

`load_model` checks the framing, the header and every tensor's name, shape and dtype before it builds
anything, and raises `ModelFileError` naming the file and the exact problem.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, ModelConfig
from ..errors import ModelFileError
from .layout import FUSED_VERSION, SUFFIXES, fused_modules
from .header import (DEFAULT_MODEL_NAME, ENV_MODEL, FLOAT_MODEL_NAME, FORMAT, FORMAT_VERSION,  # noqa: F401
                          MODELS_DIR, ST_DTYPES, TOKENIZER_TENSOR, TOKENIZER_TYPES, model_info, packaged_model_path,
                          packaged_models, read_header, resolve_model_path, check_writable)
from ..tokenizer import HFTokenizer, Tokenizer, TokenizerError
from ..version import __version__

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
TORCH_DTYPES_BY_NAME = {**DTYPES, "uint8": torch.uint8, "int8": torch.int8, "int32": torch.int32,
                        "int64": torch.int64, "int16": torch.int16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    header: dict[str, Any]
    path: Path
    draft_exit_path: Path | None = None  # set by Engine.load when it attaches a draft-exit file
    index: dict[str, Any] = field(default_factory=dict)   # the file's tensor index (`header.held_params`)

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg


def expected_tensors(cfg: ModelConfig, weights: dict[str, Any], version: int = FORMAT_VERSION
                     ) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of every model tensor the header's config, weight format and format version
    imply (version 2 and later: projections fused, `modelfile.layout`)."""
    from ..model.fused import meta_model

    dtype = weights.get("dtype")
    model = meta_model(cfg, fused=version >= FUSED_VERSION)
    out = {name: (tuple(t.shape), dtype) for name, t in model.state_dict().items()}
    quant = weights.get("quant") or {}
    if quant.get("method", "none") != "none":
        from ..quant.formats import expected_quantized_tensors  # quantized files name their own tensors
        out = expected_quantized_tensors(out, quant)
    return out


MAX_BLOCKS = 10_000  # layers a header may describe (no real model is near this; a hostile one could be)


def check_header(path: Path, header: dict[str, Any], index: dict[str, Any]) -> ModelConfig:
    """Every tensor's name, shape and dtype against the header's config, before anything is built or
    read. A header of the wrong shape or types (corrupted, or written to attack the loader) is a
    ModelFileError naming the problem, never another exception."""
    try:
        return _check_header(path, header, index)
    except ModelFileError:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed header, whatever part of it is wrong
        raise ModelFileError(path, f"malformed header: {type(exc).__name__}: {exc}") from None


def _check_header(path: Path, header: dict[str, Any], index: dict[str, Any]) -> ModelConfig:
    for key in ("config", "weights", "tokenizer"):
        if not isinstance(header.get(key), dict):
            raise ModelFileError(path, f"header has no {key!r} section")
    try:
        cfg = ModelConfig.from_dict(header["config"])
    except (ConfigError, TypeError, ValueError) as exc:
        raise ModelFileError(path, f"bad config in header: {exc}") from None
    # Sizes before building anything: a header must not make the loader build what the file cannot hold.
    if cfg.n_prelude + cfg.n_core + cfg.n_coda > MAX_BLOCKS:
        raise ModelFileError(path, f"config describes {cfg.n_prelude + cfg.n_core + cfg.n_coda} layers "
                                   f"(at most {MAX_BLOCKS})")
    weights = header["weights"]
    if weights.get("dtype") not in DTYPES:
        raise ModelFileError(path, f"unknown weight dtype {weights.get('dtype')!r}")
    try:
        expected = expected_tensors(cfg, weights, header["format_version"])
    except ValueError as exc:  # quant.packing.QuantError: a quant section this version cannot read
        raise ModelFileError(path, f"bad quant section in header: {exc}") from None
    present = {k: v for k, v in index.items() if k != header["tokenizer"].get("tensor")}
    missing = sorted(set(expected) - set(present))
    if missing:
        raise ModelFileError(path, f"missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(set(present) - set(expected))
    if extra:
        raise ModelFileError(path, f"unexpected tensor {extra[0]!r} (not part of this config)")
    for name, (shape, dtype) in expected.items():
        got_shape = tuple(present[name]["shape"])
        got_dtype = ST_DTYPES.get(present[name]["dtype"], present[name]["dtype"])
        if got_shape != shape:
            raise ModelFileError(path, f"tensor {name!r} has shape {list(got_shape)}, config needs {list(shape)}")
        if got_dtype != dtype:
            raise ModelFileError(path, f"tensor {name!r} is {got_dtype}, header says {dtype}")
    tok = header["tokenizer"]
    if tok.get("type") not in TOKENIZER_TYPES or tok.get("tensor") not in index:
        raise ModelFileError(path, "header's tokenizer section is missing or names no embedded tensor")
    return cfg


# -- mapping the tensors ---------------------------------------------------------------------
TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32, "I64": torch.int64, "I16": torch.int16,
                "U16": getattr(torch, "uint16", torch.int16)}


def map_tensors(path: Path, index: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a checked file as a view of one memory mapping of it: nothing is read or copied
    until a page is used, and processes that map the same file share its pages in the page cache (a
    second server or Ray replica adds no copy of the weights). The mapping is copy-on-write (MAP_PRIVATE),
    so an in-place write to a weight changes only this process's copy of that page, never the file. The
    mapping lives as long as the tensors do (torch.frombuffer holds it). A model file renamed over this one
    (writes are atomic) leaves the mapped one intact."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:
        raise ModelFileError(path, f"cannot map the file: {exc}") from None
    base = 8 + n
    out = {}
    for name, t in index.items():
        start, end = (int(x) for x in t["data_offsets"])
        dtype = TORCH_DTYPES[t["dtype"]]
        shape = [int(d) for d in t["shape"]]
        if end == start:  # an empty tensor has no bytes to view
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        raw = torch.frombuffer(mapping, dtype=torch.uint8, count=end - start, offset=base + start)
        if (base + start) % raw.new_empty((), dtype=dtype).element_size():
            raw = raw.clone()  # a misaligned tensor (never in files TinyLoop writes) is copied
        out[name] = raw.view(dtype).reshape(shape)
    return out


def fuse_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A version 1 file's tensors -> the version 2 names: each fused projection's parts concatenated by
    rows (a copy); every other tensor as it is."""
    out = dict(tensors)
    for fused, parts in fused_modules(cfg).items():
        for suffix in SUFFIXES:
            names = [f"{part}.{suffix}" for part, _ in parts]
            if all(n in out for n in names):
                out[f"{fused}.{suffix}"] = torch.cat([out.pop(n) for n in names], dim=0)
    return out


def read_tokenizer(path: Path, header: dict[str, Any], blob: bytes, cfg: ModelConfig) -> Tokenizer | HFTokenizer:
    """The tokenizer a checked file embeds (`blob`: its tokenizer tensor's bytes)."""
    tok_h = header["tokenizer"]
    if tok_h.get("sha256") and hashlib.sha256(blob).hexdigest() != tok_h["sha256"]:
        raise ModelFileError(path, "embedded tokenizer does not match its checksum (corrupt file)")
    try:
        if tok_h["type"] == "hf-tokenizers":
            tokenizer = HFTokenizer(blob.decode("utf-8"), eos_ids=tok_h["eos_ids"], eos_token=tok_h["eos_token"],
                                    chat_template=tok_h.get("chat_template"), bos_token=tok_h.get("bos_token"))
        else:
            tokenizer = Tokenizer.from_ranks_blob(blob, pattern=tok_h["pattern"], eos_token=tok_h["eos_token"],
                                                  eos_id=tok_h["eos_id"])
    except (TokenizerError, KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
        raise ModelFileError(path, f"embedded tokenizer: {exc}") from None
    if isinstance(tokenizer, HFTokenizer):  # (GPT-2 files are read as they always were)
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ModelFileError(path, f"embedded tokenizer has {tokenizer.vocab_size} tokens, the model only "
                                       f"{cfg.vocab_size}")
        tokenizer.pad_vocab(cfg.vocab_size)
    return tokenizer


# -- public API ------------------------------------------------------------------------------
def load_model(path: str | Path | None = None, *, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> LoadedModel:
    """Load and check a model file (a path or packaged name, see `resolve_model_path`; default: the default
    model), optionally casting floats to `dtype`."""
    from ..model.fused import meta_model

    path = resolve_model_path(path)
    if not path.exists() and path == packaged_model_path():
        raise ModelFileError(path, "the default model is not installed with this package; pass --model PATH "
                                   "or set TINYLOOP_MODEL_PATH (tinyloop init writes a random one for tests)")
    header, index = read_header(path)
    cfg = check_header(path, header, index)
    tensors = map_tensors(path, index)
    quant = header["weights"].get("quant") or {}
    tokenizer = read_tokenizer(path, header, tensors.pop(header["tokenizer"]["tensor"]).numpy().tobytes(), cfg)
    if header["format_version"] < FUSED_VERSION:
        print(f"tinyloop: {path.name} has the format of an older TinyLoop (version {header['format_version']}): "
              f"its projections are fused in memory at every load; `tinyloop upgrade {path}` rewrites it once",
              file=sys.stderr)
        tensors = fuse_tensors(tensors, cfg)
    model = meta_model(cfg)  # the file's names: the model is bound to its tensors where they lie
    if quant.get("method", "none") != "none":
        from ..quant.formats import load_quantized  # swaps in quantized linear modules
        model = load_quantized(model, tensors, header["weights"], device=device, dtype=dtype)
    else:
        if dtype is not None:
            tensors = {k: v.to(dtype) for k, v in tensors.items()}
        model.load_state_dict(tensors, assign=True)
        model = model.to(device)
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, header=header, path=path, index=index)


def tokenizer_blob(tokenizer: Tokenizer | HFTokenizer) -> bytes:
    """What a model file embeds: GPT-2 BPE ranks, or a Hugging Face tokenizer.json."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.json_text.encode("utf-8")
    return tokenizer.ranks_blob()


def tokenizer_section(tokenizer: Tokenizer | HFTokenizer) -> dict[str, Any]:
    sha = hashlib.sha256(tokenizer_blob(tokenizer)).hexdigest()
    if isinstance(tokenizer, HFTokenizer):
        return {"type": "hf-tokenizers", "tensor": TOKENIZER_TENSOR, "eos_ids": tokenizer.eos_ids,
                "eos_token": tokenizer.eos_token, "bos_token": tokenizer.bos_token,
                "chat_template": tokenizer.chat_template, "sha256": sha}
    return {"type": "gpt2-bpe", "tensor": TOKENIZER_TENSOR, "pattern": tokenizer.pattern,
            "eos_token": tokenizer.eos_token, "eos_id": tokenizer.eos_id, "sha256": sha}


def make_header(cfg: ModelConfig, dtype: torch.dtype, tokenizer: Tokenizer | HFTokenizer,
                provenance: dict[str, Any], quant: dict[str, Any] | None = None) -> dict[str, Any]:
    name = {v: k for k, v in DTYPES.items()}[dtype]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "config": cfg.to_dict(),
        "weights": {"dtype": name, "quant": quant or {"method": "none", "bits": 16 if dtype != torch.float32 else 32,
                                                      "group_size": None, "high_precision": []}},
        "tokenizer": tokenizer_section(tokenizer),
        "provenance": {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "tool_version": __version__, **provenance},
    }


def write_model(path: str | Path, model: torch.nn.Module, *, tokenizer: Tokenizer,
                provenance: dict[str, Any] | None = None, tensors: dict[str, torch.Tensor] | None = None,
                header: dict[str, Any] | None = None) -> Path:
    """Write `model` (or explicit `tensors` + `header`, for quantized files) atomically: to a temporary
    file beside `path`, flushed to disk, then renamed over it. A failure (full disk, unwritable folder)
    raises ModelFileError naming the path and leaves neither a partial file nor the temporary one.
    The file has the run-time layout (`modelfile.layout`): tensors may come under the PyTorch definition's
    names (a model trained or built in memory) or the fused ones (a loaded model); each part is written
    at its rows (`ModelFileWriter`), from where it lies: no serialised copy of the model is built."""
    from .writer import ModelFileWriter

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelFileError(path, f"cannot create its folder: {exc.strerror or exc}") from None
    if tensors is None:
        tensors = {k: v.detach() for k, v in model.state_dict().items()}
        dtype = next(iter(tensors.values())).dtype
        header = make_header(model.cfg, dtype, tokenizer, provenance or {})
    try:
        layout = expected_tensors(ModelConfig.from_dict(header["config"]), header["weights"], header["format_version"])
    except ValueError as exc:  # quant.packing.QuantError, ConfigError: a header this version could not read
        raise ModelFileError(path, f"bad header: {exc}") from None
    specs = {k: (shape, TORCH_DTYPES_BY_NAME[dt]) for k, (shape, dt) in layout.items()}
    with ModelFileWriter(path, specs, header, tokenizer_blob(tokenizer)) as writer:
        for name, t in tensors.items():
            writer.add(name, t)
    return path
