"""Files that sit beside a model file and belong to it: draft exits (`.draft.safetensors`) and a trained exit
gate (`.gate.safetensors`). A quantized file names its source model in its provenance and uses that model's
companions, so an int4 file drafts and exits like the fp16 file it was made from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DRAFT_SUFFIX = ".draft.safetensors"   # draft exits (model/draft_exit.py)
GATE_SUFFIX = ".gate.safetensors"     # a trained exit gate (model/gate.py)


def companion_file(model_path: str | Path, suffix: str) -> Path:
    """`<stem><suffix>` beside the model file (where a trainer writes it)."""
    model_path = Path(model_path)
    return model_path.with_name(model_path.name.removesuffix(".tinyloop") + suffix)


def find_companion(model_path: str | Path, header: dict[str, Any] | None, suffix: str) -> Path | None:
    """The model's own companion file, else its source model's (quantized files); None when there is none."""
    own = companion_file(model_path, suffix)
    if own.exists():
        return own
    source = ((header or {}).get("provenance") or {}).get("source")
    if source:
        src = companion_file(Path(model_path).with_name(Path(source).name), suffix)
        if src.exists():
            return src
    return None
