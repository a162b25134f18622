"""`tinyloop train-gate MODEL FILES...`: a learned exit gate for a model that has none (adaptive depth).

The gate is `Linear(dim -> 1)` on the core state after each loop, the form of a converted checkpoint's gate, so the `gate`
criterion (`model/exits.py`: exit once the cumulative probability 1 - prod (1 - lambda_i) reaches the
threshold) runs it unchanged. It is trained here, with the model frozen, as a logistic regression: after
loop r, lambda_r = sigmoid(gate(h_r)) predicts whether the read-out of h_r already gives the same greedy
token as the full depth. Training text is the training split of the files (`--val-fraction`, as `tinyloop
train` split them), so the held-out tail stays unseen.

The file format and loading are `model/gate.py`; `Engine.load(gate=True)` (the default) attaches the file
beside the model; a model file with its own gate (converted from a checkpoint that has one) keeps that.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..model.gate import write_gate

@torch.no_grad()
def loop_states(model, windows: torch.Tensor, loops: int, batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, T) windows -> states (loops, N*T, dim) after each loop and agreement (loops, N*T): whether loop r's
    read-out gives the full depth's greedy token."""
    states, agree = [], []
    for i in range(0, windows.shape[0], batch):
        toks = windows[i:i + batch]
        ctx = model.context(toks.shape[1])
        e = model.embed_prelude(toks, ctx)
        h = model.init_state(e, ctx.positions)
        hs, tops = [], []
        for r in range(loops):
            h = model.core_loop(h, e, r, ctx)
            hs.append(h.reshape(-1, h.shape[-1]).float())
            tops.append(model.coda_logits(h, ctx).argmax(-1).reshape(-1))
        states.append(torch.stack(hs))
        agree.append(torch.stack([t == tops[-1] for t in tops]))
    return torch.cat(states, 1), torch.cat(agree, 1).float()


def train_gate(model, train_windows: torch.Tensor, val_windows: torch.Tensor, *, loops: int, steps: int = 400,
               lr: float = 0.05, seed: int = 0) -> tuple[nn.Linear, dict[str, Any]]:
    """Fit the gate (logistic regression on the frozen model's states); returns it and its figures."""
    X, Y = loop_states(model, train_windows, loops)
    Xv, Yv = loop_states(model, val_windows, loops)
    dim = X.shape[-1]
    X, Y, Xv, Yv = X[:-1].reshape(-1, dim), Y[:-1].reshape(-1), Xv[:-1].reshape(-1, dim), Yv[:-1].reshape(-1)
    scale = X.pow(2).mean(-1, keepdim=True).mean().sqrt().clamp_min(1e-6)  # fit on unit-scale inputs
    g = torch.Generator().manual_seed(seed)
    gate = nn.Linear(dim, 1)
    with torch.no_grad():
        gate.weight.normal_(0, 0.01, generator=g)
        gate.bias.zero_()
    opt = torch.optim.Adam(gate.parameters(), lr=lr)
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(gate(X / scale)[:, 0], Y)
            loss.backward()
            opt.step()
    with torch.no_grad():  # fold the input scale into the weight: the engine feeds raw states
        gate.weight.div_(scale)
        pv = torch.sigmoid(gate(Xv)[:, 0])
        val_loss = F.binary_cross_entropy(pv.clamp(1e-7, 1 - 1e-7), Yv).item()
        acc = ((pv > 0.5).float() == Yv).float().mean().item()
    report = {"loops": loops, "train_positions": int(train_windows.numel()), "val_positions": int(val_windows.numel()),
              "train_loss": round(loss.item(), 4), "val_loss": round(val_loss, 4), "val_accuracy": round(acc, 4),
              "val_agreement_by_loop": [round(v, 4) for v in loop_states(model, val_windows, loops)[1].mean(1).tolist()]}
    return gate, report


def train_gate_file(model_path: str | Path, files: list[str], out: str | Path, *, loops: int | None = None,
                    tokens: int = 16384, seq: int = 128, steps: int = 400, seed: int = 0,
                    val_fraction: float = 0.01) -> dict[str, Any]:
    from ..modelfile.loader import load_model
    from .data import read_calibration

    loaded = load_model(model_path, dtype=torch.float32)
    model, cfg = loaded.model, loaded.model.cfg
    loops = cfg.default_loops if loops is None else loops
    if not 2 <= loops <= cfg.max_loops:
        raise ValueError(f"--loops must be in 2..{cfg.max_loops}, got {loops}")
    seq = min(seq, cfg.max_seq_len)
    train_w = read_calibration(files, loaded.tokenizer, tokens, seq, seed=seed, val_fraction=val_fraction)
    val_w = read_calibration(files, loaded.tokenizer, max(tokens // 8, seq), seq, seed=seed + 1,
                             val_fraction=val_fraction, held_out=True)
    gate, report = train_gate(model, train_w, val_w, loops=loops, steps=steps, seed=seed)
    meta = {"dim": cfg.dim, "model": Path(model_path).name, **report,
            "provenance": {"tool": "tinyloop train-gate", "files": [Path(f).name for f in files], "seed": seed,
                           "val_fraction": val_fraction,
                           "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}}
    write_gate(out, gate, meta)
    return meta
