"""What `tinyloop serve A B ...` serves: each model as given on the command line, in a directory or in a config file
(TOML or JSON) with its own defaults (`ModelSpec`), the settings each one runs with, and what a model file's
header says of it before it is loaded (its /v1/models card). Torch-free: `serve` reads these before it loads
anything (server/models.py, the pool, runs them)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import ValidationError
from .settings import parse_keep_alive

CONFIG_SUFFIXES = (".toml", ".json")
MODEL_KEYS = {"path", "names", "loops", "kv", "context", "keep_alive", "draft_exit"}


# -- what is served ------------------------------------------------------------------------------
@dataclass
class ModelSpec:
    """One served model as given on the command line or in a config file: its source (a path, a packaged
    model's name or an `hf:` name), its names in the API (the first is its id; [] -> derived) and its own
    defaults (None: the server's)."""
    source: str
    names: list[str] = field(default_factory=list)
    loops: int | None = None            # the depth of a request that names none
    kv: str | None = None               # KV cache format (fp16, int8, int4, int4-h)
    context: int | None = None          # max_seq_len served
    keep_alive: float | None = None     # seconds; PINNED; None: the server's
    draft_exit: Path | bool | None = None


def _spec_of(name: str | None, entry: dict[str, Any], defaults: dict[str, Any], where: str) -> ModelSpec:
    unknown = set(entry) - MODEL_KEYS
    if unknown:
        raise SystemExit(f"tinyloop serve: {where}: unknown key(s) {', '.join(sorted(unknown))} (known: "
                         f"{', '.join(sorted(MODEL_KEYS))})")
    merged = {**defaults, **entry}
    if "path" not in merged:
        raise SystemExit(f"tinyloop serve: {where}: no path (a .tinyloop file, a packaged name or an hf: name)")
    names = merged.get("names") or []
    if isinstance(names, str):
        names = [names]
    names = ([name] if name else []) + [n for n in names if n != name]
    try:
        keep = parse_keep_alive(merged.get("keep_alive"), f"{where}: keep_alive")
    except ValidationError as exc:
        raise SystemExit(f"tinyloop serve: {exc.message}") from None
    for key in ("loops", "context"):
        value = merged.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise SystemExit(f"tinyloop serve: {where}: {key} must be a positive integer, got {value!r}")
    kv = merged.get("kv")
    if kv is not None and kv not in ("fp16", "int8", "int4", "int4-h"):
        raise SystemExit(f"tinyloop serve: {where}: kv must be fp16, int8, int4 or int4-h, got {kv!r}")
    draft = merged.get("draft_exit")
    if isinstance(draft, str):
        draft = {"auto": True, "none": False}.get(draft.lower(), Path(draft))
    return ModelSpec(str(merged["path"]), names, merged.get("loops"), kv, merged.get("context"), keep, draft)


def specs_from_config(path: Path) -> tuple[list[ModelSpec], dict[str, Any]]:
    """A config file (TOML or JSON): per-model tables under `models` (`[models.NAME]` with `path` and any of
    names, loops, kv, context, keep_alive, draft_exit); top-level keys of those names are every model's
    defaults, and `max_loaded_models`, `max_memory`, `keep_alive` the server's. Returns (specs, server keys)."""
    try:
        text = path.read_text()
        if path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"tinyloop serve: cannot read the models config {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("models"), (dict, list)) or not data["models"]:
        raise SystemExit(f"tinyloop serve: {path}: needs a 'models' table (e.g. [models.small] path = \"...\")")
    server = {k: data[k] for k in ("max_loaded_models", "max_memory") if k in data}
    defaults = {k: v for k, v in data.items() if k in MODEL_KEYS - {"path", "names"}}
    unknown = set(data) - MODEL_KEYS - {"models", "max_loaded_models", "max_memory"}
    if unknown:
        raise SystemExit(f"tinyloop serve: {path}: unknown key(s) {', '.join(sorted(unknown))}")
    models = data["models"]
    items = models.items() if isinstance(models, dict) else [(m.get("name"), m) for m in models]
    specs = [_spec_of(name, {k: v for k, v in dict(entry).items() if k != "name"}, defaults, f"{path}: {name}")
             for name, entry in items]
    return specs, server


def specs_from_args(items: list[str]) -> tuple[list[ModelSpec], dict[str, Any]]:
    """`tinyloop serve A B ...`: each a model (a path, a packaged name, an `hf:` name, or NAME=any of these),
    a directory (every .tinyloop file in it, named by its stem) or a config file (.toml / .json)."""
    specs: list[ModelSpec] = []
    server: dict[str, Any] = {}
    for item in items:
        name, _, source = item.partition("=") if "=" in item and not item.startswith(("hf:", "/", ".")) \
            else ("", "", item)
        path = Path(source).expanduser()
        if not name and path.suffix in CONFIG_SUFFIXES and path.is_file():
            more, keys = specs_from_config(path)
            specs += more
            server.update(keys)
        elif not name and path.is_dir():
            files = sorted(p for p in path.glob("*.tinyloop") if p.is_file())
            if not files:
                raise SystemExit(f"tinyloop serve: the directory {path} holds no .tinyloop file")
            specs += [ModelSpec(str(p)) for p in files]
        else:
            specs.append(ModelSpec(source, [name] if name else []))
    return specs, server


def default_names(source: str, path: Path) -> list[str]:
    """A model's names when none are given: its packaged/hf name or file stem, then its path."""
    stem = str(path).rsplit("/", 1)[-1].removesuffix(".tinyloop")
    first = source.removesuffix(".tinyloop") if source.startswith("hf:") or "/" not in source else stem
    return list(dict.fromkeys([first, stem, str(path), str(path).lstrip("/")]))


def model_settings(settings, spec: ModelSpec):
    """The server's settings with one model's own: its file, names and defaults."""
    changes: dict[str, Any] = {"model_path": Path(spec.source) if not spec.source.startswith("hf:") else spec.source,
                               "served_model_names": list(spec.names), "models": []}
    if spec.kv is not None:
        changes["kv_cache_mode"] = spec.kv
    if spec.context is not None:
        changes["max_seq_len"] = spec.context
    if spec.loops is not None:
        changes["default_loops"] = spec.loops
    if spec.keep_alive is not None:
        changes["keep_alive"] = spec.keep_alive
    if spec.draft_exit is not None:
        changes["draft_exit"] = spec.draft_exit
    return replace(settings, **changes)


def offline_card(entry, lmstudio: bool) -> dict[str, Any]:
    """The card of a model that is not loaded: what its file's header says (nothing more when unreadable)."""
    from ..modelfile.header import header_config, model_info, read_header

    try:
        header, index = read_header(entry.path)
        cfg = header_config(entry.path)
        info = model_info(header, index)
    except Exception:  # noqa: BLE001 - a file that will not load: its card says only its name
        cfg, info = None, {}
    loops = entry.settings.default_loops or (cfg.default_loops if cfg is not None else None)
    if lmstudio:
        return {"id": entry.name, "object": "model", "type": "llm", "publisher": "tinyloop",
                "arch": info.get("arch"), "compatibility_type": "tinyloop", "quantization": info.get("quant"),
                "state": "not-loaded", "max_context_length": None if cfg is None else
                min(cfg.max_seq_len, entry.settings.max_seq_len or cfg.max_seq_len)}
    return {"id": entry.name, "object": "model", "created": entry.created, "owned_by": "tinyloop",
            "default_loops": loops, "max_loops": cfg.max_loops if cfg is not None else None,
            "trained_loops": (list(cfg.trained_loops) or None) if cfg is not None else None}
