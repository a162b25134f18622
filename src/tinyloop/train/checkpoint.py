"""Training checkpoints: one safetensors file, tensors plus JSON state, no pickle.

`<run-dir>/checkpoint.safetensors` holds the model's parameters (`model.<name>`) and every tensor of the
optimizer's state (`opt.<param index>.<key>`, e.g. AdamW's `exp_avg`, `exp_avg_sq` and `step`). Its
`__metadata__["tinyloop_checkpoint"]` is one JSON object with everything else: the step, the training
seconds, the train and model configs, the optimizer's param groups and any non-tensor state values.
Reading it runs no code from the file (safetensors is raw bytes plus JSON), unlike `torch.load` of a
pickle. The file is written atomically (a temporary file, fsync, rename), so an interrupted save leaves
the previous checkpoint in place.

Run directories from before this format hold a pickled `checkpoint.pt`; it is refused with a message
saying why (`CheckpointError`, see `legacy_message`), never unpickled.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CHECKPOINT_NAME = "checkpoint.safetensors"
LEGACY_NAME = "checkpoint.pt"
META_KEY = "tinyloop_checkpoint"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message says why and what to do."""


def legacy_message(path: Path) -> str:
    return (f"{path} is a pickled torch.save checkpoint written by an older TinyLoop. It is not loaded: "
            f"unpickling runs code stored in the file. Checkpoints are now {CHECKPOINT_NAME} (tensors plus "
            f"JSON, no code). Delete {path.name} to start this run again from step 0, or use another "
            f"--run-dir.")


def _encode_opt(opt_state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Optimizer state_dict -> (tensors, JSON-able rest)."""
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for idx, entry in opt_state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"opt.{int(idx)}.{key}"] = value.detach().contiguous().cpu()
            else:
                plain.setdefault(str(int(idx)), {})[key] = value
    return tensors, {"param_groups": opt_state["param_groups"], "plain_state": plain}


def _decode_opt(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for idx, entry in meta.get("plain_state", {}).items():
        state.setdefault(int(idx), {}).update(entry)
    for name, value in tensors.items():
        _, idx, key = name.split(".", 2)
        state.setdefault(int(idx), {})[key] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def save_checkpoint(path: str | Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
                    state: dict[str, Any]) -> Path:
    """Write model + optimizer tensors and the JSON `state` atomically to `path`."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, t in model.state_dict(keep_vars=False).items():
        ptr = t.data_ptr()
        if ptr in seen and t.numel() > 0:  # tied weights (embedding = head): stored once
            aliases[name] = seen[ptr]
            continue
        seen[ptr] = name
        tensors[f"model.{name}"] = t.detach().contiguous().cpu()
    opt_tensors, opt_meta = _encode_opt(opt.state_dict())
    tensors.update(opt_tensors)
    meta = {"format_version": FORMAT_VERSION, "state": state, "optimizer": opt_meta, "aliases": aliases}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(meta)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu"
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(model state_dict, optimizer state_dict, JSON state) from a checkpoint written by `save_checkpoint`."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            meta = json.loads((f.metadata() or {})[META_KEY])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (KeyError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not a TinyLoop training checkpoint ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - safetensors' own errors: truncated, corrupt
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc}); delete it to restart the run") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format_version')!r}, this TinyLoop "
                              f"reads {FORMAT_VERSION}")
    model_sd = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    for name, target in meta.get("aliases", {}).items():
        model_sd[name] = model_sd[target]
    opt_sd = _decode_opt({k: v for k, v in tensors.items() if k.startswith("opt.")}, meta["optimizer"])
    return model_sd, opt_sd, meta["state"]


def checkpoint_model(path: str | Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model of a training checkpoint, in fp32 on the CPU, and its JSON state (for the benchmarks
    that evaluate a run while it trains)."""
    from ..config import ModelConfig
    from ..model import LoopedTransformer

    model_sd, _, state = load_checkpoint(path)
    with torch.device("meta"):
        model = LoopedTransformer(ModelConfig.from_dict(state["model_config"]))
    model.load_state_dict({k: v.float() for k, v in model_sd.items()}, assign=True)
    return model.eval(), state
