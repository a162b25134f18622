"""The `.tinyloop` file's header, read with json and struct only (no torch): what `tinyloop info`, `tinyloop
list` and the command line's checks need before anything heavy is imported. `modelfile` builds on it.

See `modelfile` for the layout.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Callable

from ..config import ConfigError, ModelConfig
from ..errors import ModelFileError
from ..version import __version__

FORMAT = "tinyloop"
FORMAT_VERSION = 2           # what writers write: the run-time layout (`modelfile.layout`)
READ_VERSIONS = (1, 2)       # what loaders read: version 1 files are fused at load (`tinyloop upgrade`)
TOKENIZER_TENSOR = "tokenizer.bpe_ranks"   # GPT-2 ranks or a tokenizer.json, by the header's tokenizer type
TOKENIZER_TYPES = ("gpt2-bpe", "hf-tokenizers")
ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "U8": "uint8",
             "I8": "int8", "I32": "int32", "I64": "int64", "U16": "uint16", "I16": "int16"}
ENV_MODEL = "TINYLOOP_MODEL_PATH"
MODELS_DIR = Path(__file__).parent.parent / "assets" / "models"
FLOAT_MODEL_NAME = "tinyloop-16m.tinyloop"          # the trained model (fp16): the source of the int4 one
DEFAULT_MODEL_NAME = "tinyloop-16m-int4.tinyloop"   # what serve / generate / Engine.load use by default


# -- default model ---------------------------------------------------------------------------
def packaged_model_path(name: str = DEFAULT_MODEL_NAME) -> Path:
    return MODELS_DIR / name


def packaged_models() -> list[str]:
    """Names of the model files shipped inside the package (usable wherever a model path is)."""
    return sorted(p.name for p in MODELS_DIR.glob("*.tinyloop"))


# `hf:` names are the model store's (`tinyloop.store`, a floor above: it converts and so runs the model's
# tools); importing it installs the resolver here, which pulls a missing model on first use.
_hub_resolver: Callable[[str], Path] | None = None


def set_hub_resolver(resolver: Callable[[str], Path]) -> None:
    global _hub_resolver
    _hub_resolver = resolver


def resolve_model_path(model: str | Path | None = None) -> Path:
    """A model argument -> a file path. None -> $TINYLOOP_MODEL_PATH if set, else the package's default
    model; an existing path -> itself; else the name of a packaged model, with or without `.tinyloop`
    (e.g. `tinyloop-16m` for the fp16 one), or `hf:ORG/NAME[@REV][:int4]`, a model pulled into the store
    (`tinyloop pull`; pulled here first, saying so, when the store does not hold it yet). The environment
    variable may hold any of these too."""
    if model is None:
        model = os.environ.get(ENV_MODEL) or packaged_model_path()
    if str(model).startswith("hf:"):
        if _hub_resolver is None:
            raise ModelFileError(Path(str(model)), "hf: names are resolved by the model store: import tinyloop.store "
                                                   "(the engine, the server and the command line do)")
        return _hub_resolver(str(model))
    path = Path(model)
    if path.exists() or path.parent != Path("."):
        return path
    name = path.name if path.name.endswith(".tinyloop") else path.name + ".tinyloop"
    return packaged_model_path(name) if packaged_model_path(name).exists() else path


# -- reading the framing ---------------------------------------------------------------------
def read_header(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tinyloop header, safetensors tensor index) after checking the framing and file size."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(path, "no such file (packaged models, usable by name: "
                                   f"{', '.join(packaged_models()) or 'none'})")
    if path.is_dir():
        raise ModelFileError(path, "is a directory, not a .tinyloop file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFileError(path, f"not a .tinyloop file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n == 0 or n > min(size - 8, 256 * 2**20):
            raise ModelFileError(path, "not a .tinyloop file (no safetensors header)" if n > size - 8 and size > 8 + 4096
                                 else "not a .tinyloop file, or its header is truncated")
        try:
            index = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise ModelFileError(path, "not a .tinyloop file (header is not safetensors JSON)") from None
    if not isinstance(index, dict):
        raise ModelFileError(path, "not a .tinyloop file (header is not a JSON object)")
    meta = index.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not isinstance(meta.get("tinyloop"), str):
        raise ModelFileError(path, "not a .tinyloop file (a safetensors file without a TinyLoop header)")
    try:
        header = json.loads(meta["tinyloop"])
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ModelFileError(path, f"TinyLoop header is not valid JSON: {exc}") from None
    try:
        data_end = max((int(t["data_offsets"][1]) for t in index.values()), default=0)
        if not isinstance(header, dict) or any(
                not (0 <= int(t["data_offsets"][0]) <= int(t["data_offsets"][1])) for t in index.values()):
            raise ValueError("bad tensor offsets" if isinstance(header, dict) else "header is not an object")
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ModelFileError(path, f"not a .tinyloop file (malformed header: {exc})") from None
    expected = 8 + n + data_end
    if size < expected:
        last = max(index, key=lambda k: int(index[k]["data_offsets"][1]))
        cut = next((k for k, t in sorted(index.items(), key=lambda kv: int(kv[1]["data_offsets"][1]))
                    if 8 + n + int(t["data_offsets"][1]) > size), last)
        raise ModelFileError(path, f"truncated: tensor {cut!r} ends at byte {8 + n + int(index[cut]['data_offsets'][1])}"
                                   f" but the file has {size} bytes (the header describes {expected}); "
                                   "copy or convert the file again")
    check_tensor_spans(path, index)
    if header.get("format") != FORMAT:
        raise ModelFileError(path, f"not a .tinyloop file (format is {header.get('format')!r})")
    version = header.get("format_version")
    if version not in READ_VERSIONS:
        raise ModelFileError(path, f"unknown format version {version!r} (this TinyLoop {__version__} "
                                   f"reads versions {', '.join(map(str, READ_VERSIONS))}; a newer TinyLoop "
                                   "wrote it?)")
    return header, index


ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I8": 1, "I32": 4, "I64": 8, "U16": 2, "I16": 2}


def check_tensor_spans(path: Path, index: dict[str, Any]) -> None:
    """Every tensor's bytes: as many as its shape and dtype need, and no two tensors sharing bytes. A
    corrupted index fails here, naming the tensor, before anything is mapped or built."""
    spans = []
    for name, t in index.items():
        try:
            start, end = (int(x) for x in t["data_offsets"])
            shape = [int(d) for d in t["shape"]]
            item = ITEM_BYTES.get(t["dtype"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFileError(path, f"tensor {name!r}: malformed index entry ({exc})") from None
        if item is None:
            raise ModelFileError(path, f"tensor {name!r}: unknown dtype {t['dtype']!r}")
        if any(d < 0 for d in shape):
            raise ModelFileError(path, f"tensor {name!r}: negative shape {shape}")
        need = item
        for d in shape:
            need *= d
        if end - start != need:
            raise ModelFileError(path, f"tensor {name!r} holds {end - start} bytes but its shape {shape} of "
                                       f"{t['dtype']} needs {need} (corrupt file)")
        spans.append((start, end, name))
    spans.sort()
    for (s0, e0, a), (s1, e1, b) in zip(spans, spans[1:]):
        if s1 < e0 and s1 != e1:
            raise ModelFileError(path, f"tensor {b!r} overlaps tensor {a!r} (corrupt file)")


def header_config(path: str | Path) -> ModelConfig:
    """The `ModelConfig` a file's header describes (framing and config checked; tensors are checked when
    the model is loaded). Raises ModelFileError."""
    header, _ = read_header(path)
    try:
        return ModelConfig.from_dict(header["config"])
    except (ConfigError, KeyError, TypeError, ValueError) as exc:
        raise ModelFileError(path, f"bad config in header: {exc}") from None


def held_params(header: dict[str, Any], index: dict[str, Any]) -> int:
    """The parameters a file holds, counted from its tensor index (no family's layout is assumed: whatever
    tensors the family's blocks have, the file lists them): a float tensor element by element; a quantized weight
    as the N x K matrix its codes stand for (`X.qweight`, N rows of K * bits / 8 bytes: `quant.formats.
    portable_shapes`), its scales and offsets not counted; the quantized LM head (`head.*`, a copy of the float
    head or embedding kept beside it) and the tokenizer not counted. The loader checks that a file holds exactly
    the tensors its config implies (`modelfile.loader.check_header`), so for a file that loads this is the count
    of the model built from its config (tests: test_families, test_model, test_formats, test_q4min, test_dory,
    test_smollm2: every family's layout, float and quantized)."""
    quant = (header.get("weights") or {}).get("quant") or {}
    bits = quant.get("bits") if quant.get("method", "none") != "none" else None
    skip = {(header.get("tokenizer") or {}).get("tensor", TOKENIZER_TENSOR)}
    total = 0
    for name, t in index.items():
        shape = [int(v) for v in t.get("shape", ())]
        base, _, suffix = name.rpartition(".")
        if name in skip or base == "head":
            continue
        if bits and f"{base}.qweight" in index:
            if suffix == "qweight":
                total += shape[0] * (shape[1] * 8 // bits)
            continue   # (scales, zeros or mins)
        n = 1
        for v in shape:
            n *= v
        total += n
    return total


def model_info(header: dict[str, Any], index: dict[str, Any]) -> dict[str, Any]:
    """A flat summary of a header and its tensor index (for `tinyloop info` and the server's model_info)."""
    cfg = header["config"]
    quant = header["weights"].get("quant") or {}
    method = quant.get("method", "none")
    short = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}  # the spec's names
    qname = short.get(header["weights"]["dtype"], header["weights"]["dtype"]) if method == "none" \
        else f"int{quant.get('bits')}"
    return {
        "arch": "weight-shared-looped-transformer",
        "dim": cfg["dim"], "n_heads": cfg["n_heads"], "n_kv_heads": cfg.get("n_kv_heads") or cfg["n_heads"],
        "ffn_dim": cfg["ffn_dim"], "vocab_size": cfg["vocab_size"],
        "n_prelude": cfg["n_prelude"], "n_core": cfg["n_core"], "n_coda": cfg["n_coda"],
        "default_loops": cfg["default_loops"], "max_loops": cfg["max_loops"], "max_seq_len": cfg["max_seq_len"],
        "mlp": cfg["mlp"], "injection": cfg["injection"], "tie_embeddings": cfg["tie_embeddings"],
        "quant": qname, "quant_method": method, "quant_group_size": quant.get("group_size"),
        "quant_head": f"int{quant['head']['bits']}" if isinstance(quant.get("head"), dict) else None,
        "params": held_params(header, index),
    }


def check_writable(path: str | Path) -> Path:
    """Fail early (before hours of training or quantizing) when `path` cannot be written: its folder is
    created if missing and a probe file is created and removed there. Raises ModelFileError."""
    path = Path(path)
    if path.is_dir():
        raise ModelFileError(path, "is a folder; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.with_name(f".{path.name}.{os.getpid()}.probe")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ModelFileError(path, f"cannot be written: {exc.strerror or exc}") from None
    return path


def weights_format(header: dict) -> str:
    """What a model file's weights are, as a person asks it: "float16", or for a quantized file its block
    weights' format, the LM head's and the float tensors' ("int4 gptq group 32, int8 head, float16 embedding
    and norms"). The header's `weights.dtype` alone is only the float tensors' dtype."""
    weights = header.get("weights") or {}
    dtype = weights.get("dtype", "?")
    quant = weights.get("quant") or {}
    if quant.get("method", "none") == "none":
        return dtype
    group = f" group {quant['group_size']}" if quant.get("group_size") else " per channel"
    head = quant.get("head")
    if isinstance(head, dict) and head.get("bits"):
        head = f"int{head['bits']} head" + (f" group {head['group_size']}" if head.get("group_size") else "")
    else:
        head = f"{dtype} head"
    minimum = ", float16 minimums" if quant.get("layout") == "tinyloop-packed-min-v1" else ""   # (quant.formats)
    return f"int{quant.get('bits')} {quant['method']}{group}{minimum}, {head}, {dtype} embedding and norms"
