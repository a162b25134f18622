"""`tinyloop convert SRC_DIR OUT.tinyloop`: a local Hugging Face snapshot of a looped family -> a `.tinyloop` file.

The families and what each one's config and tensors become: `model/families/` (a module each, and the
registry this converter asks).

Tensors stream shard by shard (`safetensors.safe_open`), each one cast to the target dtype as it is read,
so the model is held once. A checkpoint's fused projections are split into TinyLoop's names and its
interleaved RoPE pairs (2i, 2i+1) are permuted to the half-split pairs (i, i + D/2) TinyLoop computes:
the same permutation on the q and k rows (and their biases) leaves every attention score unchanged, so the
model computes the same function. The tokenizer (`tokenizer.json`), its chat template and the union of the
snapshot's EOS ids are embedded. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch

from ..config import ConfigError, ModelConfig
from ..modelfile.loader import DTYPES, expected_tensors, make_header, tokenizer_blob
from ..modelfile.writer import ModelFileWriter
from ..modelfile.layout import SEPARATE_VERSION
from ..tokenizer import HFTokenizer, TokenizerError
from ..version import __version__
from ..model.families import ConvertError, Emit, lookup  # noqa: F401  (ConvertError: the converter's error)


def _read_json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.exists():
        if required:
            raise ConvertError(f"{path.parent}: no {path.name}")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConvertError(f"{path}: not valid JSON ({exc})") from None


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def shard_files(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        if not names:
            raise ConvertError(f"{index}: no weight_map")
        missing = [n for n in names if not (src / n).exists()]
        if missing:
            raise ConvertError(f"{src}: shard {missing[0]} named by {index.name} is missing")
        return [src / n for n in names]
    single = src / "model.safetensors"
    if single.exists():
        return [single]
    raise ConvertError(f"{src}: no model.safetensors or model.safetensors.index.json (only safetensors "
                       "checkpoints are read; pickled .bin files are refused)")


PICKLE_NAMES = ("pytorch_model.bin", "model.bin", "model.pt")   # (a pickled checkpoint's names: `Family.weights`)


def pickle_file(src: Path) -> Path | None:
    for n in PICKLE_NAMES:
        if (src / n).exists():
            return src / n
    return None


def iter_pickled(path: Path, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """A torch.save'd state dict, read with torch.load(weights_only=True) only: tensors and plain
    containers, no code. Anything that needs more (a pickled class, a function) is refused. Memory-mapped
    where the file is torch's zip format, so the model is held once."""
    import pickle

    from tqdm import tqdm

    def load(mmap: bool):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)

    try:
        try:
            sd = load(True)
        except RuntimeError as exc:   # an old (non-zip) torch.save file cannot be mapped
            if "mmap" not in str(exc):
                raise
            sd = load(False)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConvertError(f"{path}: refused: it cannot be read with torch.load(weights_only=True), which "
                           f"loads only tensors and plain containers ({first}); TinyLoop runs no code from a "
                           "checkpoint: save its state dict again (torch.save(model.state_dict())) or as "
                           "safetensors") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise ConvertError(f"{path}: not a state dict (a flat mapping of names to tensors)")
    bar = tqdm(total=len(sd), desc="convert", unit="tensor", disable=not progress)
    for key in list(sd):
        yield key, sd.pop(key)
        bar.update(1)
    bar.close()


def tensor_names(files: list[Path]) -> set[str]:
    """The names the shards hold, read from their headers (no tensor data)."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                names.update(h.keys())
        except (OSError, RuntimeError) as exc:  # safetensors' own errors
            raise ConvertError(f"{f}: cannot read ({exc})") from None
    return names


def iter_tensors(files: list[Path], progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    from tqdm import tqdm

    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            total += len(list(h.keys()))
    bar = tqdm(total=total, desc="convert", unit="tensor", disable=not progress)
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for key in h.keys():
                    yield key, h.get_tensor(key)
                    bar.update(1)
        except (OSError, RuntimeError) as exc:  # safetensors' own errors
            raise ConvertError(f"{f}: cannot read ({exc})") from None
    bar.close()


# -- tokenizer ----------------------------------------------------------------------------------------
def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def load_tokenizer(src: Path, hf: dict[str, Any], gen: dict[str, Any], *, default_eos: str | None = None,
                   missing: str = "the tokenizer is embedded in the model file") -> HFTokenizer:
    """The tokenizer of the directory `src` (tokenizer.json, tokenizer_config.json, chat template). EOS ids:
    the union of config.json's, generation_config.json's and the tokenizer's eos token; `default_eos`, the
    family's eos token, where none of them names one."""
    tj = src / "tokenizer.json"
    if not tj.exists():
        raise ConvertError(f"{src}: no tokenizer.json ({missing})")
    tc = _read_json(src / "tokenizer_config.json", required=False)
    template = tc.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (src / "chat_template.jinja").exists():
        template = (src / "chat_template.jinja").read_text(encoding="utf-8")
    text = tj.read_text(encoding="utf-8")
    eos_token, bos_token = _token_text(tc.get("eos_token")), _token_text(tc.get("bos_token"))
    from tokenizers import Tokenizer as _HF

    try:
        probe = _HF.from_str(text)
    except Exception as exc:  # noqa: BLE001
        raise ConvertError(f"{tj}: cannot be read ({exc})") from None
    eos = _ids(hf.get("eos_token_id")) + _ids(gen.get("eos_token_id"))
    if eos_token is not None and probe.token_to_id(eos_token) is not None:
        eos.append(probe.token_to_id(eos_token))
    if not eos and default_eos is not None and probe.token_to_id(default_eos) is not None:
        eos_token = default_eos
        eos.append(probe.token_to_id(default_eos))
    eos = list(dict.fromkeys(eos))  # the union, first seen first
    if not eos:
        raise ConvertError(f"{src}: no eos token id in config.json, generation_config.json or tokenizer_config.json")
    try:
        return HFTokenizer(text, eos_ids=eos, eos_token=eos_token or probe.id_to_token(eos[0]),
                           chat_template=template, bos_token=bos_token)
    except TokenizerError as exc:
        raise ConvertError(f"{tj}: {exc}") from None


# -- the whole conversion -----------------------------------------------------------------------------


def model_config(hf: dict[str, Any], src: Path, eos: list[int], names: set[str] | None = None) -> ModelConfig:
    """A checkpoint's config.json -> ModelConfig, or ConvertError saying why the architecture is not
    supported. Needs no weights: `tinyloop pull` runs it on config.json before downloading any. `names`, the
    checkpoint's tensor names where known, tell apart the variants one config class covers (huginn_raven)."""
    family = lookup(hf, src)
    try:
        return family.config(hf, src, eos, names)
    except ConvertError:
        raise   # (already names the file)
    except KeyError as exc:
        raise ConvertError(f"{src / 'config.json'}: missing {exc.args[0]!r}") from None
    except (ConfigError, TypeError, ValueError) as exc:
        raise ConvertError(f"{src / 'config.json'}: {exc}") from None


def convert(src: str | Path, out: str | Path, *, dtype: str | None = None, progress: bool = True,
            provenance: dict[str, Any] | None = None, tokenizer: str | Path | None = None,
            quant: str | None = None) -> Path:
    """Convert the snapshot `src` into the model file `out` (atomically); `provenance` is added to the
    header's (`tinyloop pull` records the repository and commit there). `tokenizer`: a directory holding the
    tokenizer when the snapshot has none of its own (`Family.tokenizer_repo`). dtype None: bfloat16
    for a snapshot. A GGUF file (or
    `pkg:NAME`, the one an installed package ships) is read by `tools/gguf.py` (dtype None: float16 there;
    `quant="int4"`: then RTN int4, its logit difference reported)."""
    from .gguf import convert_gguf, is_gguf_source

    if is_gguf_source(src):
        if tokenizer is not None:
            raise ConvertError(f"{src}: --tokenizer is for snapshots; a GGUF file carries its own tokenizer")
        return convert_gguf(src, out, dtype=dtype, progress=progress, provenance=provenance, quant=quant)
    if quant is not None:
        raise ConvertError(f"{src}: --int4 is for GGUF files; quantize a converted snapshot with tinyloop quantize")
    dtype = dtype or "bfloat16"
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise ConvertError(f"{src}: not a directory (give a local Hugging Face snapshot)")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConvertError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    hf = _read_json(src / "config.json")
    gen = _read_json(src / "generation_config.json", required=False)
    family = lookup(hf, src)
    model_config(hf, src, [0])  # the architecture is refused before the tokenizer and the weights are read
    tok_dir = Path(tokenizer) if tokenizer is not None else src
    if tokenizer is not None and not tok_dir.is_dir():
        raise ConvertError(f"{tok_dir}: not a directory (give the tokenizer's: tokenizer.json and its config)")
    missing = "the tokenizer is embedded in the model file"
    if family.tokenizer_repo is not None:
        missing = (f"{family.name}'s tokenizer is a repository of its own, {family.tokenizer_repo}: download it and "
                   "pass its directory with --tokenizer")
    tokenizer = load_tokenizer(tok_dir, hf, gen, default_eos=family.default_eos, missing=missing)
    pickled = pickle_file(src) if family.weights else None
    files = [] if pickled is not None else shard_files(src)
    names = tensor_names(files) if family.needs_names else None   # (the shards' headers only)
    cfg = model_config(hf, src, sorted(set(tokenizer.eos_ids), key=tokenizer.eos_ids.index), names)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConvertError(f"{src}: tokenizer has {tokenizer.vocab_size} tokens, the model's vocabulary only "
                           f"{cfg.vocab_size}")
    torch_dtype = DTYPES[dtype]
    expected = expected_tensors(cfg, {"dtype": dtype}, SEPARATE_VERSION)  # what the checkpoint's names map to
    header = make_header(cfg, torch_dtype, tokenizer, {"converted_from": str(src.resolve()), "family": family.name,
                                                       "source_dtype": hf.get("torch_dtype"),
                                                       "converter_version": __version__, **(provenance or {})})
    # Streamed: the file's layout is known from the config, so each tensor is cast and written at its place
    # as it is read (one tensor in memory at a time, one shard mapped), then the file is moved into place.
    # The file has the run-time layout (q/k/v and gate/up fused): the writer puts each projection at its rows.
    layout = expected_tensors(cfg, {"dtype": dtype})
    with ModelFileWriter(out, {k: (shape, torch_dtype) for k, (shape, _) in layout.items()}, header,
                         tokenizer_blob(tokenizer)) as writer:
        def emit(name: str, t: torch.Tensor) -> None:
            if name not in expected:
                raise ConvertError(f"{src}: tensor maps to {name!r}, which this config does not have")
            shape = expected[name][0]
            if tuple(t.shape) != shape:
                raise ConvertError(f"{src}: {name} has shape {list(t.shape)}, the config needs {list(shape)}")
            writer.add(name, t)

        convert_one = family.tensors(cfg, hf)
        for name, t in (iter_pickled(pickled, progress) if pickled is not None else iter_tensors(files, progress)):
            if not convert_one(cfg, name, t, lambda n, x, src_name=name: _emit_named(emit, src_name, n, x)):
                raise ConvertError(f"{src}: unexpected tensor {name!r} with shape {list(t.shape)} for {family.name}")
        missing = sorted(set(expected) - writer.written)
        if missing:
            raise ConvertError(f"{src}: the checkpoint has no tensor for {missing[0]!r}"
                               + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return out


def _emit_named(emit: Emit, src_name: str, name: str, t: torch.Tensor) -> None:
    try:
        emit(name, t)
    except ConvertError as exc:
        raise ConvertError(f"{exc} (from {src_name!r})") from None
