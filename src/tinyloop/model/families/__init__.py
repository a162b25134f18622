"""The model families TinyLoop runs: one module each, and the registry every other layer asks.

A family module owns what is its own: how its `config.json` maps onto `ModelConfig` (and which of its
options are refused, by name), how its checkpoint's tensor names map onto TinyLoop's, its tokenizer's
quirks (a tokenizer kept in a repository of its own, a default EOS token), and any math no other family
has. Math several families share stays in `model/layers.py` and `model/looped.py`, switched by
`ModelConfig` fields. A family whose layers are its own (Dory's nGPT blocks) says so: `builds(cfg)` picks it for
a config, `block(cfg, i)` makes block i (prelude, core, coda numbering), `init(model)` draws random weights and
`check(cfg)` checks its own scalars (`ModelConfig.family_params`: only its module reads them); `LoopedTransformer`
asks `own_blocks(cfg)`. Such a block's `native_fields()` say what the native library reads
of it; that math is one file in `kernels/csrc/` registering its block kind by name (csrc/step.h
`register_block`), the executor's one door for it.

    tinyloop      TinyLoop's own format (the shipped model; nothing to convert)
    ouro          ByteDance Ouro                                                 `ouro.py`
    huginn_raven  Huginn-0125 (`huginn.py`) and the retrofitted-recurrence Llama / OLMo-2 conversions that
                  share its model_type (`retrofit.py`)
    nanbeige      Nanbeige4.2                                                    `nanbeige.py`
    parcae        SandyResearch Parcae (recognised by its config class name)     `parcae.py`
    dory          NVIDIA Nemotron-Labs Dory1.0 (nGPT one-sublayer blocks)        `dory.py`

Who asks: `tools/convert.py` (config and tensors), `store/pull.py` (which files to download, a tokenizer
kept apart), the loader (a file header's `family`) and the native executor (what it refuses). Adding a
family: its module here, one line in `_MODULES`, its tests.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ...config import ModelConfig

Emit = Callable[[str, torch.Tensor], None]
# (cfg, name, tensor, emit) -> False when the name is not one of the family's
TensorMap = Callable[[ModelConfig, str, torch.Tensor, Emit], bool]


class ConvertError(ValueError):
    """A snapshot that cannot become a TinyLoop model; the message names what and where."""


def need(cond: bool, src: Path, what: str) -> None:
    """Refuse (naming the snapshot's config.json) unless `cond`."""
    if not cond:
        raise ConvertError(f"{src / 'config.json'}: {what}")


@dataclass(frozen=True)
class Family:
    """One family's entry in the registry (each module defines `FAMILY`)."""

    name: str                                   # config.json's model_type; the model file header's `family`
    summary: str                                # one line for help texts and errors
    # config.json (+ the checkpoint's tensor names where `needs_names`) -> ModelConfig, or ConvertError
    config: Callable[..., ModelConfig] | None = None
    # (cfg, config.json) -> the tensor-name mapping for that checkpoint
    tensors: Callable[[ModelConfig, dict[str, Any]], TensorMap] | None = None
    needs_names: bool = False                   # the config alone does not tell the variant (huginn_raven)
    recognise: Callable[[dict[str, Any]], bool] | None = None   # for configs without a model_type (Parcae)
    weights: tuple[str, ...] = ()               # weight files besides safetensors (`pull` fetches them)
    tokenizer_repo: str | None = None           # where the tokenizer lives when the snapshot has none
    default_eos: str | None = None              # the EOS token when no config names one
    # A family whose blocks are its own: whether a config is built from them, block i of it, random weights,
    # its checks of the config (its `family_params`: ConfigError), what a per-token `logit_scale` is divided by
    builds: Callable[[ModelConfig], bool] | None = None
    block: Callable[[ModelConfig, int], Any] | None = None
    init: Callable[[Any], None] | None = None
    check: Callable[[ModelConfig], None] | None = None
    logit_divisor: Callable[[ModelConfig], float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def convertible(self) -> bool:
        return self.config is not None


# The registry, in the order help texts list the families
_MODULES = ("tinyloop", "ouro", "huginn", "nanbeige", "parcae", "llama", "dory")
FAMILIES: dict[str, Family] = {}
for _m in _MODULES:
    _fam: Family = importlib.import_module(f"{__name__}.{_m}").FAMILY
    FAMILIES[_fam.name] = _fam
CONVERTIBLE = tuple(n for n, f in FAMILIES.items() if f.convertible)


def family_of(hf: dict[str, Any]) -> Any:
    """The family name a config.json describes: its `model_type`, or the family that recognises a config
    without one (Parcae's reference writes `_class_name` / `model_class_name` instead)."""
    if hf.get("model_type") is None:
        for fam in FAMILIES.values():
            if fam.recognise is not None and fam.recognise(hf):
                return fam.name
    return hf.get("model_type")


def own_blocks(cfg: ModelConfig) -> Family | None:
    """The family whose own blocks make a model of this config (`Family.builds`), or None: the shared `Block`."""
    for fam in FAMILIES.values():
        if fam.builds is not None and fam.builds(cfg):
            return fam
    return None


def get(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ConvertError(f"unknown model family {name!r} (TinyLoop runs {', '.join(FAMILIES)})") from None


def lookup(hf: dict[str, Any], src: Path) -> Family:
    """The convertible family of a config.json, or ConvertError naming what it is."""
    name = family_of(hf)
    fam = FAMILIES.get(name) if isinstance(name, str) else None
    if fam is None or not fam.convertible:
        raise ConvertError(f"{src / 'config.json'}: model_type {name!r} is not a looped family this converter "
                           f"reads ({', '.join(CONVERTIBLE)}; Parcae's configs are recognised by _class_name)")
    return fam


def names_help() -> str:
    """'ouro (ByteDance Ouro ...), ...': every convertible family, for help texts."""
    return "; ".join(f"{f.name} ({f.summary})" for f in FAMILIES.values() if f.convertible)


__all__ = ["CONVERTIBLE", "ConvertError", "Emit", "FAMILIES", "Family", "TensorMap", "family_of", "get", "lookup",
           "names_help", "need", "own_blocks"]
