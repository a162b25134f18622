"""`tinyloop train-draft`: distil draft exits (see `model.draft_exit`) for a trained model file.

For every draft depth d the exit starts as a copy of the model's coda and final norm and is trained to
make `head(exit(state after loop d-1))` match the V-loop model's next-token distribution, where
V = the model's default loops. The loss is the KL divergence from the teacher's distribution over the
draft vocabulary (the `DRAFT_VOCAB` most frequent tokens, the rows the drafting head scores) to the
exit's. The model itself is frozen: the teacher runs once over the training windows, keeping each
window's loop-d states and its final normed hidden states (float16), and the exits train on those.

Windows come from the training part of each text file (its last `val_fraction` is left out, as
`tinyloop train` does); agreement (exit argmax == V-loop argmax over the full vocabulary) is reported
before and after on windows from the held-out part, and recorded in the file's header.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..engine.draft_vocab import frequency_ranking
from ..modelfile.loader import load_model
from ..model.draft_exit import DraftExit, write_draft_exits
from .data import read_calibration

DEFAULT_DRAFT_LOOPS = (1, 2, 4)


@torch.no_grad()
def teacher_pass(model, windows: torch.Tensor, draft_loops: tuple[int, ...], batch: int,
                 full_argmax: bool = False) -> dict[str, torch.Tensor]:
    """Run the frozen model over windows: {"h{d}": loop-d states (fp16), "y": final normed hidden
    states (fp16)} and, with `full_argmax`, "argmax": the V-loop model's token at every position."""
    V = model.cfg.default_loops
    T = windows.shape[1]
    out: dict[str, list[torch.Tensor]] = {f"h{d}": [] for d in draft_loops}
    out["y"], out["argmax"] = [], []
    for s in range(0, len(windows), batch):
        x = windows[s:s + batch]
        ctx = model.context(T)
        e = model.embed_prelude(x, ctx)
        h = model.init_state(e)
        for r in range(V):
            h = model.core_loop(h, e, r, ctx)
            if r + 1 in draft_loops:
                out[f"h{r + 1}"].append(h.half())
        y = model.run_coda(h, ctx, e)   # the model's own read-out: C, the post-loop norm, value embeddings
        yn = model.final_norm(y)
        out["y"].append(yn.half())
        if full_argmax:
            out["argmax"].append(F.linear(yn, model.head_weight).argmax(-1))
    return {k: torch.cat(v) for k, v in out.items() if v}


def softcap(logits: torch.Tensor, model) -> torch.Tensor:
    """The model's logit soft-cap (c tanh(logits / c)), as `LoopedTransformer.logits` applies it."""
    c = model.cfg.logit_softcap
    return logits if c == 0 else c * torch.tanh(logits / c)


def exit_loss(model, ex: DraftExit, h: torch.Tensor, y: torch.Tensor, head_rows: torch.Tensor):
    """(exit logits over the draft vocabulary, mean KL(teacher || exit) per position) for a batch of
    loop-d states h and the teacher's normed final states y."""
    lg = softcap(F.linear(ex.norm(ex.blocks(h.float(), model.context(h.shape[1]), None)), head_rows), model)
    teacher = F.log_softmax(softcap(F.linear(y.float(), head_rows), model), dim=-1)
    kl = F.kl_div(F.log_softmax(lg, dim=-1).flatten(0, 1), teacher.flatten(0, 1), log_target=True,
                  reduction="batchmean")
    return lg, kl


def evaluate(model, ex: DraftExit, data: dict[str, torch.Tensor], d: int, head_rows: torch.Tensor,
             ranked: torch.Tensor, batch: int) -> tuple[float, float]:
    """(agreement: share of positions where the exit's draft-vocabulary argmax is the V-loop model's
    token over the full vocabulary, mean KL from the teacher) on held-out windows."""
    hits, kl_sum = 0, 0.0
    with torch.no_grad():
        for s in range(0, len(data["y"]), batch):
            lg, kl = exit_loss(model, ex, data[f"h{d}"][s:s + batch], data["y"][s:s + batch], head_rows)
            hits += int((ranked[lg.argmax(-1)] == data["argmax"][s:s + batch]).sum())
            kl_sum += kl.item() * lg.shape[0] * lg.shape[1]
    n = data["argmax"].numel()
    return hits / n, kl_sum / n


def train_draft_exits(model_path: str | Path, files: list[str | Path], out: str | Path, *,
                      draft_loops: tuple[int, ...] = DEFAULT_DRAFT_LOOPS, tokens: int = 1_200_000,
                      seq: int = 256, batch: int = 8, epochs: int = 4, lr: float = 3e-4,
                      val_tokens: int = 16_384, val_fraction: float = 0.01, draft_vocab: int = 4096,
                      seed: int = 0, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train one exit per d in `draft_loops` for the model file at `model_path` and write them to `out`."""
    loaded = load_model(model_path, dtype=torch.float32)
    model, cfg = loaded.model.eval(), loaded.model.cfg
    for p in model.parameters():
        p.requires_grad_(False)
    V = cfg.default_loops
    draft_loops = tuple(sorted(set(int(d) for d in draft_loops)))
    if not draft_loops or not all(1 <= d < V for d in draft_loops):
        raise ValueError(f"draft_loops must be in 1..{V - 1} (the model verifies with {V} loops), got {draft_loops}")
    if tokens < seq or epochs < 1 or batch < 1:
        raise ValueError("tokens must be >= seq, and epochs and batch >= 1")
    missing = [str(f) for f in files if not Path(f).is_file()]
    if not files or missing:
        raise ValueError(f"training text files not found: {missing}" if missing else "no training text file given")
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    train_w = read_calibration(list(files), loaded.tokenizer, tokens, seq, seed=seed, val_fraction=val_fraction)
    val_w = read_calibration(list(files), loaded.tokenizer, val_tokens, seq, seed=seed + 1, val_fraction=val_fraction,
                             held_out=True)
    log(f"windows: {tuple(train_w.shape)} train, {tuple(val_w.shape)} held out ({time.perf_counter() - t0:.0f} s)")
    t0 = time.perf_counter()
    train = teacher_pass(model, train_w, draft_loops, batch)
    val = teacher_pass(model, val_w, draft_loops, batch, full_argmax=True)
    log(f"teacher ({V} loops) over {train_w.numel() + val_w.numel()} tokens: {time.perf_counter() - t0:.0f} s")
    n_draft = min(draft_vocab, cfg.vocab_size)
    ranked = frequency_ranking(cfg.vocab_size)[:n_draft]
    head_rows = model.head_weight.detach()[ranked].float()
    exits: dict[int, DraftExit] = {}
    scores: dict[str, dict[str, float]] = {}
    steps = epochs * math.ceil(len(train_w) / batch)
    for d in draft_loops:
        ex = DraftExit.from_model(model).float().train()
        before, kl_before = evaluate(model, ex, val, d, head_rows, ranked, batch)
        opt = torch.optim.AdamW(ex.parameters(), lr=lr, weight_decay=0.0)
        step, t0 = 0, time.perf_counter()
        g = torch.Generator().manual_seed(seed + d)
        for ep in range(epochs):
            order = torch.randperm(len(train_w), generator=g)
            total = 0.0
            for s in range(0, len(order), batch):
                idx = order[s:s + batch]
                for group in opt.param_groups:  # cosine from lr to 0
                    group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
                _, loss = exit_loss(model, ex, train[f"h{d}"][idx], train["y"][idx], head_rows)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += loss.item() * len(idx)
                step += 1
            log(f"d={d} epoch {ep + 1}/{epochs}: KL {total / len(train_w):.4f} ({time.perf_counter() - t0:.0f} s)")
        ex.eval()
        after, kl_after = evaluate(model, ex, val, d, head_rows, ranked, batch)
        log(f"d={d}: on held-out text, agreement with the {V}-loop model {before:.4f} -> {after:.4f}, "
            f"KL {kl_before:.4f} -> {kl_after:.4f}")
        exits[d] = ex
        scores[str(d)] = {"before": round(before, 4), "after": round(after, 4),
                          "kl_before": round(kl_before, 5), "kl_after": round(kl_after, 5)}
    info = {"verify_loops": V, "base_model": Path(model_path).name, "draft_vocab": n_draft,
            "agreement": scores,
            "agreement_tokens": int(val_w.numel()),
            "provenance": {"tool": "tinyloop train-draft", "files": [str(f) for f in files],
                           "tokens": int(train_w.numel()), "seq": seq, "batch": batch, "epochs": epochs,
                           "lr": lr, "val_fraction": val_fraction, "seed": seed}}
    write_draft_exits(out, exits, cfg, info)
    log(f"wrote {out}")
    return info
