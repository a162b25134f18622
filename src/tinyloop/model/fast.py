"""The decode fast path: rebuild a loaded model's modules for fewer, cheaper ops per token.

`prepare_for_decode(model)` works in place on a loaded `LoopedTransformer` and keeps every API the rest
of the engine uses (`forward`, `embed_prelude`/`core_loop`/`coda_logits`, `StepContext`, `KVCache`):

- fuses wq/wk/wv into one `wqkv` projection and (swiglu) w_gate/w_up into one `w_gate_up`; the fused
  blocks then run one RoPE over q and k together and grouped-query attention without copying K/V;
- for 16-bit models on CPU, swaps every `nn.Linear` of the blocks (and, without the native executor, the LM
  head) for FBGEMM's fp16-weight kernel (`quant.fp16.FP16Linear`) and runs activations in fp32;
- runs one-token steps on fewer threads where a second thread does not pay (`threads="auto"`; prefill
  keeps every thread).

The `.tinyloop` file is untouched: fusion and packing happen at load time, from the file's tensor names.
A prepared model is for inference: its state dict no longer has the file's names (wq/wk/wv are gone,
packed fp16 weights are not parameters), so write model files from an unprepared model.

`swap_linears` is the generic module swap other weight formats (int4/int2) use the same way: it hands
every `nn.Linear` inside an Attention or MLP to a factory and installs what the factory returns.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn as nn

from .layers import MLP, Attention, RMSNorm

WEIGHT_MODES = ("auto", "keep", "fp16")
LinearFactory = Callable[[str, nn.Linear], "nn.Module | None"]


def swap_linears(model: nn.Module, factory: LinearFactory,
                 inside: tuple[type, ...] = (Attention, MLP)) -> int:
    """Replace each `nn.Linear` child of every `inside` module by `factory(qualified_name, linear)`.

    A factory returning None keeps that linear. Returns how many modules were replaced. Fused projections
    (`wqkv`, `w_gate_up`) are plain `nn.Linear`s too, so a swap after `fuse_projections` packs them fused.
    """
    n = 0
    for mod_name, mod in model.named_modules():
        if not isinstance(mod, inside):
            continue
        for child_name, child in list(mod.named_children()):
            if type(child) is not nn.Linear:
                continue
            new = factory(f"{mod_name}.{child_name}" if mod_name else child_name, child)
            if new is not None:
                setattr(mod, child_name, new)
                n += 1
    return n


def _concat_linear(parts: list[nn.Linear]) -> nn.Linear:
    w = torch.cat([p.weight.detach() for p in parts], dim=0)  # (sum out, in)
    with torch.device("meta"):
        fused = nn.Linear(w.shape[1], w.shape[0], bias=False)
    fused.weight = nn.Parameter(w, requires_grad=False)
    return fused


def _fusable(mod: nn.Module, names: tuple[str, ...]) -> bool:
    parts = [getattr(mod, n, None) for n in names]
    return all(type(p) is nn.Linear and p.bias is None for p in parts) and \
        len({(p.weight.dtype, p.weight.device, p.in_features) for p in parts}) == 1


def _fuse(mod: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    """The fused layer for `names` of `mod` (float: concatenated weights; quantized: stacked kernel
    buffers, see `QuantLinear.concat`), or None when they cannot be fused."""
    from ..quant.linear import QuantLinear

    parts = [getattr(mod, n, None) for n in names]
    if _fusable(mod, names):
        return _concat_linear(parts)
    if all(type(p) is QuantLinear for p in parts):
        return QuantLinear.concat(parts)
    return None


def fuse_projections(model: nn.Module) -> int:
    """wq/wk/wv -> wqkv (rows q, k, v) and swiglu w_gate/w_up -> w_gate_up (rows gate, up), in place.

    Exact: a fused GEMM computes each output row from the same weights and input as the separate ones.
    Bias-free `nn.Linear`s and quantized `QuantLinear`s of one format are fused; anything else is left
    as it is. Returns how many fusions were made.
    """
    n = 0
    for mod in model.modules():
        if isinstance(mod, Attention) and mod.wqkv is None:
            fused = _fuse(mod, ("wq", "wk", "wv"))
            if fused is not None:
                mod.wqkv = fused
                del mod.wq, mod.wk, mod.wv
                n += 1
        elif isinstance(mod, MLP) and mod.kind == "swiglu" and mod.w_gate_up is None:
            fused = _fuse(mod, ("w_gate", "w_up"))
            if fused is not None:
                mod.w_gate_up = fused
                del mod.w_gate, mod.w_up
                n += 1
    return n


def recommended_threads(model: nn.Module) -> int | None:
    """Threads for batch-1 decode: 1 for small models (per-op overhead bound; a second thread only adds
    synchronisation), None (leave torch's setting) for models whose GEMVs are big enough to split.

    The cut is measured by benchmarks/decode.py (see docs/decode.md): 384-dim decodes faster on one thread.
    """
    cfg = model.cfg
    return 1 if cfg.dim * cfg.ffn_dim <= 1024 * 4096 else None


def _executor_setting(executor: str | None) -> str:
    """"native", "torch" or "auto": the caller's choice, else `TINYLOOP_EXECUTOR`'s."""
    from ..kernels.lib import EXECUTORS, executor_setting

    setting = executor_setting() if executor in (None, "auto") else executor
    if setting not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {setting!r}")
    return setting


def _native_expected(executor: str | None) -> bool:
    """Whether `attach_executor(model, executor)` will try the native executor (its library loads here)."""
    from ..kernels.lib import native_wanted

    setting = _executor_setting(executor)
    return setting == "native" or (setting == "auto" and native_wanted())


def attach_executor(model: nn.Module, executor: str | None = None) -> str:
    """Give `model` the native executor (`kernels/`) when it is wanted and runs this model; returns the
    executor's name ("native (...)" or "torch"). executor: "native", "torch", or None/"auto" (the
    `TINYLOOP_EXECUTOR` setting: native where its library builds here)."""
    from ..kernels.executor import NativeExecutor, Unsupported

    model.executor = None
    if not _native_expected(executor):
        return "torch"
    try:
        model.executor = NativeExecutor(model)
    except Unsupported as exc:
        if _executor_setting(executor) == "native":
            raise
        warnings.warn(f"the native executor does not run this model ({exc}); using the PyTorch path")
        return "torch"
    return model.executor.name


def executor_name(model: nn.Module) -> str:
    ex = getattr(model, "executor", None)
    return "torch" if ex is None else ex.name


def prepare_for_decode(model: nn.Module, *, weights: str = "auto", fuse: bool = True,
                       threads: int | str | None = "auto", executor: str | None = None) -> nn.Module:
    """Make `model` (a loaded LoopedTransformer, in eval mode) fast at decode, in place; returns it.

    weights: "auto" - fp16 FBGEMM for bf16/fp16 models on CPU, fp32/fp64 weights kept exactly;
             "fp16" - FBGEMM fp16 also for fp32 models (lossy: weights rounded to fp16, opt-in);
             "keep" - leave the linears' dtype and kernels alone.
    fuse:    fuse QKV and gate/up projections (exact).
    threads: torch threads for one-token forward calls (decode steps; prefill keeps torch's setting):
             "auto" - `recommended_threads`; an int - that many; None - torch's setting.
    executor: "native", "torch" or None (`TINYLOOP_EXECUTOR`, default: native where it builds): who runs
             the one-token rows of serving steps (`attach_executor`).
    """
    from ..quant.fp16 import FP16Linear, fbgemm_fp16_available

    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    if getattr(model, "decode_prepared", None):
        return model
    dtype = model.embed.weight.dtype
    on_cpu = model.embed.weight.device.type == "cpu"
    if weights == "auto":
        weights = "fp16" if dtype in (torch.bfloat16, torch.float16) and on_cpu and fbgemm_fp16_available() \
            else "keep"
    if weights == "fp16" and not (on_cpu and fbgemm_fp16_available()):
        raise RuntimeError("fp16 weights need FBGEMM on CPU, which this torch build or device lacks")
    fused = fuse_projections(model) if fuse else 0
    swapped = 0
    # with the native executor, 16-bit layers stay as stored and multi-row calls (prefill) run on its
    # panels: FBGEMM's pack would be a second, private copy of every weight (the file's size, per process)
    pack = not _native_expected(executor)
    if weights == "fp16":
        swapped = swap_linears(model, lambda name, lin: FP16Linear.from_linear(lin, pack=pack))
        if type(model.adapter) is nn.Linear:
            model.adapter = FP16Linear.from_linear(model.adapter, pack=pack)
        model.act_dtype = torch.float32
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight = nn.Parameter(mod.weight.detach().float(), requires_grad=False)
    n_threads = recommended_threads(model) if threads == "auto" else threads
    model.decode_threads = None if n_threads is None else int(n_threads)
    name = attach_executor(model, executor)
    if model.executor is None and not pack:   # it does not run this model after all: FBGEMM serves
        for mod in model.modules():
            if isinstance(mod, FP16Linear):
                mod.pack()
    # the native executor reads a 16-bit head as stored; a quantized file's head is its own QuantLinear
    if weights == "fp16" and model.executor is None and model.head_linear is None:
        model.head_linear = FP16Linear(model.head_weight)  # logits() uses it; head_weight stays readable
    model.decode_prepared = {"weights": weights, "fused": fused, "swapped": swapped, "threads": n_threads,
                             "executor": name}
    return model
