"""The run-time layout of a `.tinyloop` file's tensors: which projections a file stores fused.

The engine computes q, k and v in one matrix product and (swiglu) gate and up in another. Files of format
version 1 store them under the PyTorch definition's names (`attn.wq`, `attn.wk`, `attn.wv`, `mlp.w_gate`,
`mlp.w_up`), so every load concatenated them: a private copy of nearly every weight. From version 2 the
file stores them as the engine uses them, and the loader binds them as views of the mapped file:

    X.attn.wqkv.S     rows q (n_heads * head_dim), then k, then v (n_kv_heads * head_dim each)
    X.mlp.w_gate_up.S rows gate (ffn_dim), then up (ffn_dim)            (swiglu models only)

for every block X and every suffix S the layer has (`weight`; a quantized layer's `qweight`, `scales`,
`zeros` or `mins`: each has the output dimension first, so parts stack by rows). The model's PyTorch definition
keeps the separate modules (training builds them); `model.fused` fuses a model's modules to match a file
(on the meta device: no data) or splits them again (into row views: no copy).

This module needs no torch: the command line's checks and `tinyloop upgrade`'s refusals use it.
"""

from __future__ import annotations

from typing import Any, Iterable

SEPARATE_VERSION = 1  # projections under their own names (fused in memory at each load)
FUSED_VERSION = 2     # q/k/v and gate/up stored fused: the run-time layout (what writers write)
SUFFIXES = ("weight", "qweight", "scales", "zeros", "mins")   # (mins: int4's min form, quant/formats.py)


def fused_modules(cfg: Any) -> dict[str, list[tuple[str, int]]]:
    """Fused module name -> [(part module name, its output rows)] in row order, for a `ModelConfig`."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    pattern = getattr(cfg, "layer_pattern", "")   # nGPT blocks: an attention or an MLP each
    out: dict[str, list[tuple[str, int]]] = {}
    b = 0
    for stack, n in (("prelude", cfg.n_prelude), ("core", cfg.n_core), ("coda", cfg.n_coda)):
        for i in range(n):
            p = f"{stack}.{i}"
            if not pattern or pattern[b] != "-":
                out[f"{p}.attn.wqkv"] = [(f"{p}.attn.wq", q), (f"{p}.attn.wk", kv), (f"{p}.attn.wv", kv)]
            if cfg.mlp == "swiglu" and (not pattern or pattern[b] == "-"):
                out[f"{p}.mlp.w_gate_up"] = [(f"{p}.mlp.w_gate", cfg.ffn_dim), (f"{p}.mlp.w_up", cfg.ffn_dim)]
            b += 1
    return out


def part_rows(cfg: Any, names: Iterable[str]) -> dict[str, tuple[str, int, int]]:
    """Part tensor name -> (fused tensor name, first row, rows), for each fused tensor among `names` (a
    version 2 file's tensor names): e.g. `core.0.attn.wk.qweight` -> (`core.0.attn.wqkv.qweight`, 64, 32)."""
    names = set(names)
    out: dict[str, tuple[str, int, int]] = {}
    for fused, parts in fused_modules(cfg).items():
        for suffix in SUFFIXES:
            target = f"{fused}.{suffix}"
            if target not in names:
                continue
            row = 0
            for part, rows in parts:
                out[f"{part}.{suffix}"] = (target, row, rows)
                row += rows
    return out
