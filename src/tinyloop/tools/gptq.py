"""Quantize a loaded float model: GPTQ (calibrated, sequential) or round-to-nearest.

GPTQ runs block by block in the order the model computes them (or, with sequential="sublayer", linear
group by group: q/k/v, o, gate/up, down). For each step a calibration pass through the partially quantized
model accumulates the Hessian H = mean(x x^T) of each linear's inputs, `quant.gptq.gptq_quantize`
quantizes its weights, and the dequantized weights replace the float ones so later blocks calibrate on
what the quantized model will really feed them. The pass stops after the stage (prelude / core / coda)
that holds the step's layers. A shared core layer is called once per loop, so its Hessian sums its inputs over
every loop; for the report, each core layer is also quantized with the loop-1 Hessian alone and both
are scored by the relative output error tr(dW H dW^T) / tr(W H W^T) under the all-loops Hessian.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from ..model.fused import split_projections
from ..quant.formats import is_quantizable, portable_tensors, quant_header
from ..quant.gptq import gptq_quantize
from ..quant.packing import QuantError, SUPPORTED_BITS, dequantize, quantize_rtn, resolve_group_size
from ..quant.streamed import Reader, StreamedLinear

Emit = Callable[[str, dict[str, torch.Tensor]], Reader]  # (layer, its file tensors) -> reads them back


@dataclass
class QuantSpec:
    bits: int = 4
    group_size: int | None = 32
    method: str = "gptq"                 # "gptq" | "rtn"
    act_order: bool = False
    percdamp: float = 0.01
    blocksize: int = 128
    hessian: str = "all"                 # core layers: "all" loops' inputs, or "loop1" only (ablation)
    compare_loop1: bool = True           # report all-loops vs loop-1 Hessian for core layers
    loops: int | None = None             # calibration loops (default: the model's default_loops)
    sequential: str = "block"            # recalibrate after each "block" (4 linear groups) or each "sublayer"

    def validate(self, model: nn.Module) -> None:
        if self.method not in ("gptq", "rtn"):
            raise QuantError(f"method must be 'gptq' or 'rtn', got {self.method!r}")
        if self.bits not in SUPPORTED_BITS:
            raise QuantError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.sequential not in ("block", "sublayer"):
            raise QuantError(f"sequential must be 'block' or 'sublayer', got {self.sequential!r}")
        if self.hessian not in ("all", "loop1"):
            raise QuantError(f"hessian must be 'all' or 'loop1', got {self.hessian!r}")
        if not 0 <= self.percdamp < 1:
            raise QuantError(f"dampening must be in [0, 1), got {self.percdamp}")
        for name, mod in quantizable_linears(model):
            resolve_group_size(self.bits, self.group_size, mod.in_features, name)


def quantizable_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each linear to quantize: a plain `nn.Linear`, or a `StreamedLinear` (read from a file)."""
    return [(n, m) for n, m in model.named_modules()
            if type(m) in (nn.Linear, StreamedLinear) and is_quantizable(f"{n}.weight", (m.out_features, m.in_features))]


def _float_weight(lin: nn.Module) -> torch.Tensor:
    return lin.float_weight() if isinstance(lin, StreamedLinear) else lin.weight.detach().float()


# model-wide linears and the stage whose calibration pass reaches them: the injection (adapter, or the diagonal injection's B)
# enters every loop of the core; C (`state_proj`) projects the state before the coda
_STAGE_OF = {"adapter": "core", "injection.B": "core", "state_proj": "coda"}


def blocks(model: nn.Module) -> list[list[list[str]]]:
    """Per block (the injection first in the core, C first in the coda), its linear groups (`units`) in
    forward order; a model-wide linear is a step of its own."""
    out: list[list[list[str]]] = []
    for u in units(model):
        prefix = u[0].split(".")[:2]
        if out and out[-1][0][0].split(".")[:2] == prefix and u[0] not in _STAGE_OF:
            out[-1].append(u)
        else:
            out.append([u])
    return out


def units(model: nn.Module) -> list[list[str]]:
    """Groups of linears that share one input, in the order a forward pass computes them."""
    out: list[list[str]] = []
    present = {n for n, _ in quantizable_linears(model)}
    stacks = [("prelude", model.prelude), ("core", model.core), ("coda", model.coda)]
    for stack_name, blocks in stacks:
        for name, stage in _STAGE_OF.items():
            if stage == stack_name and name in present:
                out.append([name])
        for i, _ in enumerate(blocks):
            p = f"{stack_name}.{i}"
            # (attn.wg: an nGPT block's output-gate projection, reading the same input as q, k and v)
            for group in ([f"{p}.attn.wq", f"{p}.attn.wk", f"{p}.attn.wv", f"{p}.attn.wg"], [f"{p}.attn.wo"],
                          [f"{p}.mlp.w_gate", f"{p}.mlp.w_up"], [f"{p}.mlp.w_down"]):
                group = [n for n in group if n in present]
                if group:
                    out.append(group)
    return out


def relative_output_error(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> float:
    """tr(dW H dW^T) / tr(W H W^T): the layer's output error on inputs with second moment H."""
    W, dW = W.double(), (W.double() - W_hat.double())
    return float(torch.einsum("nk,kl,nl->", dW, H, dW) / torch.einsum("nk,kl,nl->", W, H, W))


class _HessianCollector:
    """Forward pre-hooks summing x x^T of each watched linear's input: all loops, and loop 1 alone."""

    def __init__(self, model: nn.Module, names: list[str], loop1: bool = True):
        self.model, self.loop1 = model, loop1  # loop1: also sum loop 1's inputs alone (pointless with 1 loop)
        self.loop_idx: int | None = None
        self.H: dict[str, torch.Tensor] = {}
        self.H1: dict[str, torch.Tensor] = {}
        self.n: dict[str, int] = {}
        self.n1: dict[str, int] = {}
        self.handles = [model.get_submodule(n).register_forward_pre_hook(self._hook(n)) for n in names]

    def _hook(self, name: str):
        def hook(mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()   # (tokens, K)
            xx = (x.t() @ x).double()
            if name not in self.H:
                self.H[name] = torch.zeros_like(xx)
                self.n[name] = 0
            self.H[name] += xx
            self.n[name] += x.shape[0]
            if self.loop_idx == 0 and self.loop1:
                self.H1[name] = self.H1.get(name, torch.zeros_like(xx)) + xx
                self.n1[name] = self.n1.get(name, 0) + x.shape[0]
        return hook

    def hessian(self, name: str, loop1: bool = False) -> torch.Tensor:
        if loop1 and name in self.H1:
            return self.H1[name] / self.n1[name]
        return self.H[name] / self.n[name]  # (with one loop, loop 1's Hessian is this one)

    def release(self, name: str) -> None:
        """Drop a quantized layer's sums (a K x K double each: 0.25 GiB for a 5632-wide down projection)."""
        for d in (self.H, self.H1):
            d.pop(name, None)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@torch.inference_mode()
def _calibration_pass(model: nn.Module, calib: torch.Tensor, loops: int, collector: _HessianCollector,
                      batch: int = 8, stop_after: str = "coda") -> None:
    """Run calibration sequences (N, T) up to the end of `stop_after` ("prelude", "core" or "coda"; the LM
    head needs no Hessian, and nothing after the watched layers changes their inputs)."""
    for s in range(0, calib.shape[0], batch):
        tokens = calib[s:s + batch]
        ctx = model.context(tokens.shape[1])
        collector.loop_idx = None
        e = model.embed_prelude(tokens, ctx)
        if stop_after == "prelude":
            continue
        h = model.init_state(e)
        for r in range(loops):
            collector.loop_idx = r
            h = model.core_loop(h, e, r, ctx)
        collector.loop_idx = None
        if stop_after == "core":
            continue
        model.run_coda(h, ctx, e)   # as the model reads out: C, the coda's value embeddings from e


def _progress(total: int, desc: str, enabled: bool):
    """A bar on a terminal; None elsewhere (a redirected log gets one line per block, `_log_block`)."""
    if not enabled or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit="layer", file=sys.stderr, dynamic_ncols=True)
    except ImportError:  # pragma: no cover - tqdm is a dependency of the dev environment only
        return None


def _log_block(enabled: bool, desc: str, i: int, n: int, names: list[str], t0: float) -> None:
    if enabled and not sys.stderr.isatty():
        block = names[0].rsplit(".", 2)[0] if "." in names[0] else names[0]
        print(f"{desc}: step {i}/{n} ({block}) done at {time.perf_counter() - t0:.1f} s", file=sys.stderr,
              flush=True)


def quant_section(model: nn.Module, spec: QuantSpec, calib: torch.Tensor | None) -> dict[str, Any]:
    """The header's quant section `quantize_model` will produce, known before any layer is quantized (a
    streamed output file lays out its header first)."""
    quantized = {n for n, _ in quantizable_linears(model)}
    high_precision = [k for k in model.state_dict() if k[: -len(".weight")] not in quantized]
    extra: dict[str, Any] = {}
    if spec.method == "gptq":
        extra = {"calibration": {"tokens": int(calib.numel()), "seq_len": int(calib.shape[1]),
                                 "loops": spec.loops or model.cfg.default_loops,
                                 "hessian": "sum over all loops" if spec.hessian == "all" else "loop 1 only",
                                 "percdamp": spec.percdamp, "blocksize": spec.blocksize,
                                 "sequential": spec.sequential}}
    return quant_header(spec.method, spec.bits, spec.group_size, act_order=spec.act_order,
                        high_precision=high_precision, **extra)


def quantize_model(model: nn.Module, spec: QuantSpec, calib: torch.Tensor | None = None, *,
                   progress: bool = True, fake_quantize: bool = True, emit: Emit | None = None
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """Quantize every block linear of `model` (a float LoopedTransformer, with the PyTorch definition's
    separate projections). Later blocks see the quantized weights: an `nn.Linear` is overwritten with its
    dequantized weights (always with GPTQ, with RTN unless `fake_quantize=False`, which only reads them), a
    `StreamedLinear` switched to its codes (`use_quantized`). Each layer's file tensors go to `emit` as they
    are made (`emit` returns a reader of them: `tinyloop quantize` writes them to the output file at once
    and reads them back), by default into the returned dict. Returns (file tensors, header quant section,
    report). A loaded model's fused projections are split first, into row views (`split_projections`)."""
    split_projections(model)
    spec.validate(model)
    if spec.method == "gptq" and calib is None:
        raise QuantError("GPTQ needs calibration text: pass --calib FILE (RTN needs none)")
    loops = spec.loops or model.cfg.default_loops
    bits, G = spec.bits, spec.group_size
    names = [n for u in units(model) for n in u]
    core_names = {n for n in names if n.startswith("core.") or _STAGE_OF.get(n) == "core"}
    out: dict[str, torch.Tensor] = {}
    if emit is None:
        def emit(name: str, tensors: dict[str, torch.Tensor]) -> Reader:
            out.update(tensors)
            return out.__getitem__
    report: dict[str, Any] = {"method": spec.method, "bits": bits, "group_size": G, "layers": []}
    t0 = time.perf_counter()
    bar = _progress(len(names), f"{spec.method} int{bits}", progress)
    device = next(model.parameters()).device
    steps = blocks(model) if spec.sequential == "block" else [[u] for u in units(model)]
    for i_step, step in enumerate(steps):
        step_names = [n for u in step for n in u]
        collector = None
        if spec.method == "gptq":
            collector = _HessianCollector(model, step_names, loop1=loops > 1)
            stage = _STAGE_OF.get(step_names[0]) or step_names[0].split(".")[0]
            try:
                _calibration_pass(model, calib.to(device), loops, collector, stop_after=stage)
            finally:
                collector.close()
        for name in step_names:
            lin = model.get_submodule(name)
            W = _float_weight(lin)
            row: dict[str, Any] = {"name": name, "shape": list(W.shape)}
            if spec.method == "rtn":
                q, s, z = quantize_rtn(W, bits, G)
            else:
                use_loop1 = spec.hessian == "loop1" and name in core_names
                H = collector.hessian(name, loop1=use_loop1)
                q, s, z = gptq_quantize(W, H, bits, G, blocksize=spec.blocksize, percdamp=spec.percdamp,
                                        act_order=spec.act_order)
                H_all = collector.hessian(name)
                W_hat = dequantize(q, s, z)
                row["err_gptq"] = relative_output_error(W, W_hat, H_all)
                row["err_rtn"] = relative_output_error(W, dequantize(*quantize_rtn(W, bits, G)), H_all)
                if spec.compare_loop1 and name in core_names and name in collector.H1:
                    H1 = collector.hessian(name, loop1=True)
                    other = H1 if not use_loop1 else H_all
                    q2, s2, z2 = gptq_quantize(W, other, bits, G, blocksize=spec.blocksize,
                                               percdamp=spec.percdamp, act_order=spec.act_order)
                    err_other = relative_output_error(W, dequantize(q2, s2, z2), H_all)
                    row["err_all_loops_hessian"] = row["err_gptq"] if not use_loop1 else err_other
                    row["err_loop1_hessian"] = err_other if not use_loop1 else row["err_gptq"]
            del W
            if collector is not None:
                collector.release(name)
            read = emit(name, portable_tensors(name, q, s, z, bits))
            if fake_quantize or spec.method == "gptq":  # later units calibrate on the quantized weights
                if isinstance(lin, StreamedLinear):
                    lin.use_quantized(bits, read)
                else:
                    with torch.no_grad():
                        lin.weight.copy_(dequantize(q, s, z, lin.weight.dtype))
            report["layers"].append(row)
            if bar is not None:
                bar.update(1)
        _log_block(progress, f"{spec.method} int{bits}", i_step + 1, len(steps), step_names, t0)
    if bar is not None:
        bar.close()
    report["seconds"] = round(time.perf_counter() - t0, 1)
    quant = quant_section(model, spec, calib)
    out.update({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()
                if k in quant["high_precision"]})
    core_rows = [r for r in report["layers"] if "err_loop1_hessian" in r]
    if core_rows:
        report["core_hessian"] = {
            "mean_err_all_loops": sum(r["err_all_loops_hessian"] for r in core_rows) / len(core_rows),
            "mean_err_loop1": sum(r["err_loop1_hessian"] for r in core_rows) / len(core_rows),
            "mean_err_rtn": sum(r["err_rtn"] for r in core_rows) / len(core_rows)}
    return out, quant, report


def format_report(report: dict[str, Any]) -> str:
    """A plain-text table of per-layer relative output errors (GPTQ runs)."""
    rows = report["layers"]
    lines = [f"{report['method']} int{report['bits']} group {report['group_size']}: {len(rows)} layers "
             f"in {report['seconds']} s"]
    if rows and "err_gptq" in rows[0]:
        lines.append(f"{'layer':<24} {'shape':>12} {'rtn err':>9} {'gptq err':>9} {'H loop1':>9} {'H all':>9}")
        for r in rows:
            l1 = f"{r['err_loop1_hessian']:.5f}" if "err_loop1_hessian" in r else "-"
            la = f"{r['err_all_loops_hessian']:.5f}" if "err_all_loops_hessian" in r else "-"
            lines.append(f"{r['name']:<24} {'x'.join(map(str, r['shape'])):>12} {r['err_rtn']:>9.5f} "
                         f"{r['err_gptq']:>9.5f} {l1:>9} {la:>9}")
    ch = report.get("core_hessian")
    if ch:
        lines.append(f"core layers, relative output error on all loops' inputs: Hessian from all loops "
                     f"{ch['mean_err_all_loops']:.5f} vs loop 1 only {ch['mean_err_loop1']:.5f} "
                     f"({ch['mean_err_loop1'] / max(ch['mean_err_all_loops'], 1e-12):.2f}x)")
    return "\n".join(lines)
