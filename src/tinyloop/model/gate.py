"""The exit-gate file of a model that has no gate of its own (`tinyloop train-gate`, `train/gate.py`).

File: `<model>.gate.safetensors` beside the model (a quantized model uses its source model's, as draft exits
do), tensors `exit_gate.weight` (1, dim) and `exit_gate.bias` (1,), and a JSON header `tinyloop_gate` with
the model shape it fits, the depth it was trained at, its figures and provenance. The gate is
`Linear(dim -> 1)` on the core state after each loop, the form of a converted checkpoint's, read by adaptive depth's `gate`
criterion (`model/exits.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.nn as nn

from ..errors import ModelFileError
from .companion import GATE_SUFFIX, find_companion

SUFFIX = GATE_SUFFIX


def gate_path(model_path: str | Path, header: dict[str, Any] | None = None) -> Path | None:
    """`<stem>.gate.safetensors` beside the model, else its source model's (quantized files); None if none."""
    return find_companion(model_path, header, SUFFIX)


def read_gate(path: str | Path, dim: int) -> nn.Linear:
    """The gate in `path`, checked against a model of width `dim`; ModelFileError names what does not fit."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("tinyloop_gate", "null"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - any container error, named with the file
        raise ModelFileError(path, f"not a gate file: {exc}") from None
    if not isinstance(meta, dict) or set(tensors) != {"exit_gate.weight", "exit_gate.bias"}:
        raise ModelFileError(path, "not a TinyLoop gate file (needs exit_gate.weight, exit_gate.bias and a header)")
    w, b = tensors["exit_gate.weight"], tensors["exit_gate.bias"]
    if tuple(w.shape) != (1, dim) or tuple(b.shape) != (1,) or meta.get("dim") != dim:
        raise ModelFileError(path, f"gate of shape {list(w.shape)} does not fit a model of dim {dim}")
    gate = nn.Linear(dim, 1, bias=True)
    gate.weight = nn.Parameter(w.float(), requires_grad=False)
    gate.bias = nn.Parameter(b.float(), requires_grad=False)
    return gate


def write_gate(path: str | Path, gate: nn.Linear, meta: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"exit_gate.weight": gate.weight.detach().float().contiguous(),
               "exit_gate.bias": gate.bias.detach().float().contiguous()}, str(tmp),
              metadata={"tinyloop_gate": json.dumps(meta)})
    tmp.chmod(0o644)  # a model-side file is data anyone may read
    tmp.replace(path)
    return path
