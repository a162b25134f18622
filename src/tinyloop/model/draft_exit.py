"""Learned draft exits: a coda trained to read a shallow loop's state, for self-speculative drafting.

Self-speculation drafts with the model's first d loops and reads the draft token out through the
model's own coda and LM head. That coda was trained (mostly) on deep states, so on a loop-d state its
argmax often differs from what the full V-loop model would say. A draft exit is a copy of the coda
blocks plus the final norm, fine-tuned by distillation to map the state after loop d-1 to the V-loop
model's next-token distribution (`train.draft_exit`); the LM head stays the model's own. Verification
still runs the real model, so outputs are unchanged: an exit only changes which drafts are proposed,
and so how many are accepted.

An exit's blocks attend over their own keys and values (one extra cache slot per coda block,
`KVCache.slot_extra`), written from loop-d states at every position the draft covers and, in
prefill, at every prompt position.

A model with a state projection (issue 35): the exit copies the whole read-out after the loops, the projection C (`state_proj`, its
own trainable copy) included, so an untrained exit reads a state out exactly as the model's coda does,
except for one thing by design: the exit's blocks have no value embeddings (the coda blocks' gates are
left out of the copy). An exit is a function of the loop-d state alone: its entries are written from a
state wherever the draft has one (a round's backlog entry, written a round later from the kept state, has no
loop input), and its rows need neither the tokens' tables nor the loop input's width. What the value
embeddings added is what distillation (`train.draft_exit`) makes up for; verification runs the model's own
coda, value embeddings and all, so speculative output stays exactly the plain output.

File: `<model>.draft.safetensors` next to the model (a quantized model uses its source model's file,
named in its header's provenance). safetensors metadata `"tinyloop"` holds the header:

    {"format": "tinyloop-draft-exit", "format_version": 1,
     "config": {dim, n_heads, n_kv_heads, head_dim, ffn_dim, mlp, n_coda, vocab_size, norm_eps},
     "draft_loops": [1, 2, 4], "verify_loops": 8, "base_model": "<file name>",
     "agreement": {"2": {"before": ..., "after": ...}, ...}, "provenance": {...}}

and tensors `d{d}.coda.{i}.<Block parameter>` and `d{d}.norm.weight`, one set per draft depth d (with C:
`d{d}.state_proj.weight`, and the config's `"state_proj": true`; a file without them is refused for such a
model, by name).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import ModelConfig
from ..errors import ModelFileError
from ..quant.fp16 import FP16Linear
from ..quant.linear import QuantLinear
from ..quant.packing import pack, quantize_rtn
from .companion import DRAFT_SUFFIX, find_companion
from .fast import fuse_projections, swap_linears
from .fused import split_projections
from .layers import Block, RMSNorm, linear_as

FORMAT = "tinyloop-draft-exit"
FORMAT_VERSION = 1
SUFFIX = DRAFT_SUFFIX
SHAPE_KEYS = ("dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "mlp", "n_coda", "vocab_size")


class DraftExitError(ModelFileError):
    """A draft-exit file that cannot be used (a ModelFileError, so every caller's handling applies)."""


class DraftExit(nn.Module):
    """Coda-shaped blocks (without value embeddings) + a final norm, after a copy of C where the model projects
    its state before the coda (`state_proj`); the LM head is the model's. `blocks(h, ctx, slots)` -> hidden."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.state_proj = nn.Linear(cfg.dim, cfg.dim, bias=False) if cfg.state_proj else None
        self.coda = nn.ModuleList(Block(cfg) for _ in range(cfg.n_coda))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    @classmethod
    def from_model(cls, model: nn.Module) -> "DraftExit":
        """A fresh exit initialised as a copy of `model`'s read-out after the loops (C, the coda blocks, the
        final norm; training starts here). The coda's value-embedding gates are not copied (the module's doc
        says why); a float model's, not a quantized one's (its codes are no trainable weights)."""
        ex = cls(model.cfg)
        coda = copy.deepcopy(model.coda)  # a loaded model's projections are fused, as its file stores them
        split_projections(coda)
        state = {k: v for k, v in coda.state_dict().items() if not k.endswith(".attn.ve_gate.weight")}
        try:
            ex.coda.load_state_dict(state)
            if ex.state_proj is not None:
                ex.state_proj.load_state_dict(model.state_proj.state_dict())
        except RuntimeError as exc:
            raise ValueError("a draft exit starts from a float model's coda (quantized or swapped layers are not "
                             f"trainable weights): {str(exc).splitlines()[0]}") from None
        ex.norm.load_state_dict(model.norm.state_dict())
        return ex.to(next(model.parameters()).dtype)

    def blocks(self, h: torch.Tensor, ctx, slots: list[int] | None) -> torch.Tensor:
        x = h if self.state_proj is None else linear_as(self.state_proj, h)
        for i, blk in enumerate(self.coda):
            x = blk(x, ctx, None if slots is None else slots[i])
        return x


def shape_config(cfg: ModelConfig) -> dict[str, Any]:
    d = cfg.to_dict()
    out = {k: d.get(k) for k in SHAPE_KEYS}
    out["n_kv_heads"] = cfg.n_kv_heads
    out["head_dim"] = cfg.head_dim
    out["norm_eps"] = cfg.norm_eps
    if cfg.state_proj:   # (only where the model has C: the files of every other model keep their config)
        out["state_proj"] = True
    return out


def draft_exit_path(model_path: str | Path, header: dict[str, Any] | None = None) -> Path | None:
    """The draft-exit file for a model file: `<stem>.draft.safetensors` beside it, else (for a quantized
    model) its source model's. None when there is none."""
    return find_companion(model_path, header, SUFFIX)


def write_draft_exits(path: str | Path, exits: dict[int, DraftExit], cfg: ModelConfig,
                      info: dict[str, Any]) -> Path:
    """Write exits {d: DraftExit} (float16) with the header above; atomically."""
    path = Path(path)
    tensors = {}
    for d, ex in sorted(exits.items()):
        for k, v in ex.state_dict().items():
            tensors[f"d{d}.{k}"] = v.detach().to(torch.float16).contiguous().cpu()
    header = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": shape_config(cfg),
              "draft_loops": sorted(exits), **info}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"tinyloop": json.dumps(header)})
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def read_draft_exits(path: str | Path, cfg: ModelConfig) -> tuple[dict[int, DraftExit], dict[str, Any]]:
    """Load and check a draft-exit file against the model config it is for: ({d: DraftExit (fp32)}, header)."""
    path = Path(path)
    if not path.exists():
        raise DraftExitError(path, "no such file")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            header = json.loads((f.metadata() or {}).get("tinyloop", "null"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - any container error, with the file name
        raise DraftExitError(path, f"not a readable draft-exit file ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise DraftExitError(path, f"not a draft-exit file (metadata format is not {FORMAT!r})")
    if header.get("format_version") != FORMAT_VERSION:
        raise DraftExitError(path, f"format_version {header.get('format_version')} is not supported "
                                   f"(this tinyloop reads {FORMAT_VERSION})")
    want = shape_config(cfg)
    diff = {k: (header["config"].get(k), want[k]) for k in want if header["config"].get(k) != want[k]}
    if diff:
        detail = ", ".join(f"{k} {a} (model {b})" for k, (a, b) in sorted(diff.items()))
        raise DraftExitError(path, f"was trained for another model shape: {detail}")
    exits = {}
    for d in header.get("draft_loops", []):
        ex = DraftExit(cfg)
        prefix = f"d{d}."
        state = {k[len(prefix):]: v.float() for k, v in tensors.items() if k.startswith(prefix)}
        try:
            ex.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise DraftExitError(path, f"tensors for draft_loops {d} do not fit: {exc}") from None
        exits[int(d)] = ex.eval()
    return exits, header


def attach_draft_exits(model: nn.Module, exits: dict[int, DraftExit]) -> None:
    """Install exits on a loaded model (`model.draft_exits`), prepared like the model's own blocks: the
    model's float dtype, and on a decode-prepared model the same fusion and fp16 FBGEMM weights; on a CPU model
    whose blocks are int4 (or int2), int4 in their groups (round to nearest: `_coda_quant`)."""
    prepared = getattr(model, "decode_prepared", None) or {}
    weights = prepared.get("weights")
    embed_dtype = model.embed.weight.dtype
    float_dtype = torch.float32 if weights == "fp16" or not embed_dtype.is_floating_point else embed_dtype
    device = model.embed.weight.device
    quant = _coda_quant(model) if device.type == "cpu" else None
    for ex in exits.values():
        ex.to(device=device, dtype=float_dtype).eval()
        for p in ex.parameters():
            p.requires_grad_(False)
        if prepared and any(getattr(b.attn, "wqkv", None) is not None for b in model.coda):  # as the model's
            fuse_projections(ex)
        if quant is not None:   # a quantized model's exits in its blocks' bits and groups (below)
            swap_linears(ex, lambda name, lin: _rtn_linear(lin, *quant))
        elif weights == "fp16":
            swap_linears(ex, lambda name, lin: FP16Linear.from_linear(lin))
    model.draft_exits = dict(exits)


def _coda_quant(model: nn.Module) -> tuple[int, int] | None:
    """The format a quantized model's exits take: int4 in the coda's groups where its linears are int4 (int2
    blocks: int4 in groups of 32, as rounding a float exit to 2 bits would cost its drafts much of their
    agreement), None for float blocks."""
    for blk in model.coda:
        for mod in blk.modules():
            if isinstance(mod, QuantLinear) and mod.bits < 8:
                return 4, mod.group_size if mod.bits == 4 else 32
    return None


def _rtn_linear(lin: nn.Linear, bits: int, group: int) -> nn.Module:
    """A draft exit's float linear rounded to the model's own format (RTN): the exit is a draft's read-out, so
    its rounding changes proposals only, never an output; a 16-bit exit block on a quantized model cost as
    much as two loops a draft (its float GEMVs against the packed int4 kernels)."""
    q, s, z = quantize_rtn(lin.weight.detach().float(), bits, group)
    return QuantLinear.from_portable(pack(q, bits), s, z, bits, device=lin.weight.device)
