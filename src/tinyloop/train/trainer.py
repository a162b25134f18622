"""`tinyloop train`: train a looped LM with per-step sampled loop depth; checkpointed and resumable.

Depth sampling (see docs/training.md): each optimizer micro-step draws one loop count r for the whole
batch - uniform over 1..default_loops with probability 1 - tail_prob, else uniform over
default_loops+1..max_train_loops. Every depth a request or a speculative draft will use (1, 2, ...,
default_loops) gets an equal share of updates, and the tail teaches the state to stay stable past the
default. Gradients flow through only the last `backprop_loops` iterations (earlier ones run without
autograd), which bounds memory and time as in recurrent-depth LMs; the shared weights still get
gradient every step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..config import ModelConfig, preset
from ..model import LoopedTransformer
from ..tokenizer import Tokenizer
from . import data as data_mod
from .checkpoint import CHECKPOINT_NAME, LEGACY_NAME, CheckpointError, legacy_message, load_checkpoint, \
    save_checkpoint


@dataclass
class TrainConfig:
    files: list[str]
    out: str
    run_dir: str
    preset: str = "tinyloop-16m"
    steps: int = 3000
    batch: int = 4
    seq: int = 512
    accum: int = 1
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 150
    weight_decay: float = 0.1
    clip: float = 1.0
    max_train_loops: int = 12
    tail_prob: float = 0.15
    # From this step on, depth follows the deep mixture (see `sample_depth`); None -> never.
    deep_from_step: int | None = None
    deep_mean: float = 7.0
    shallow_prob: float = 0.15
    backprop_loops: int = 4
    seed: int = 0
    bf16: bool = True
    device: str = "auto"
    ckpt_every: int = 100
    eval_every: int = 250
    eval_batches: int = 4
    val_fraction: float = 0.01
    export_dtype: str = "float16"
    overrides: dict = field(default_factory=dict)  # ModelConfig field overrides on top of the preset

    def model_config(self) -> ModelConfig:
        return preset(self.preset).replace(**self.overrides)


def sample_loops(rng: np.random.Generator, default_loops: int, max_train_loops: int, tail_prob: float) -> int:
    if max_train_loops > default_loops and rng.random() < tail_prob:
        return int(rng.integers(default_loops + 1, max_train_loops + 1))
    return int(rng.integers(1, default_loops + 1))


def sample_deep(rng: np.random.Generator, max_train_loops: int, deep_mean: float, shallow_prob: float) -> int:
    """The deep mixture: with probability `shallow_prob` uniform over 1..4 (keeps 1-2 loop drafts
    trained), else 1 + Poisson(lambda) with lambda ~ LogNormal(ln deep_mean, 0.5) - the heavy-tailed
    depth of recurrent-depth LMs - capped at max_train_loops."""
    if rng.random() < shallow_prob:
        return int(rng.integers(1, 5))
    lam = rng.lognormal(np.log(deep_mean), 0.5)
    return int(min(max_train_loops, 1 + rng.poisson(lam)))


def sample_depth(rng: np.random.Generator, step: int, tc: TrainConfig, default_loops: int) -> int:
    if tc.deep_from_step is not None and step >= tc.deep_from_step:
        return sample_deep(rng, tc.max_train_loops, tc.deep_mean, tc.shallow_prob)
    return sample_loops(rng, default_loops, tc.max_train_loops, tc.tail_prob)


def lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    t = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def loss_at_depth(model: LoopedTransformer, x: torch.Tensor, y: torch.Tensor, loops: int,
                  backprop_loops: int | None = None) -> torch.Tensor:
    """Mean next-token loss with `loops` core iterations; autograd through the last `backprop_loops`."""
    ctx = model.context(x.shape[1])
    e = model.embed_prelude(x, ctx)
    h = model.init_state(e)
    n_grad = loops if backprop_loops is None else min(loops, backprop_loops)
    if n_grad < loops:
        with torch.no_grad():
            for r in range(loops - n_grad):
                h = model.core_loop(h, e, r, ctx)
        h = h.detach()
    for r in range(loops - n_grad, loops):
        h = model.core_loop(h, e, r, ctx)
    logits = model.coda_logits(h, ctx)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def param_groups(model: torch.nn.Module, weight_decay: float):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Trainer:
    def __init__(self, tc: TrainConfig):
        self.tc = tc
        self.device = torch.device("cuda" if tc.device == "auto" and torch.cuda.is_available()
                                   else ("cpu" if tc.device == "auto" else tc.device))
        self.run_dir = Path(tc.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_path = self.run_dir / CHECKPOINT_NAME
        self.log_path = self.run_dir / "log.jsonl"
        self.tokenizer = Tokenizer.gpt2()
        self.data = data_mod.prepare(tc.files, self.run_dir / "tokens", self.tokenizer, tc.val_fraction)
        self.cfg = tc.model_config()
        torch.manual_seed(tc.seed)
        self.model = LoopedTransformer(self.cfg).init_weights(tc.seed).to(self.device)
        self.opt = torch.optim.AdamW(param_groups(self.model, tc.weight_decay), lr=tc.lr,
                                     betas=(0.9, 0.95), eps=1e-8)
        self.step = 0
        self.elapsed = 0.0  # training seconds over all sessions of this run
        self._stop = False
        legacy = self.run_dir / LEGACY_NAME
        if legacy.exists() and not self.ckpt_path.exists():
            raise CheckpointError(legacy_message(legacy))
        if self.ckpt_path.exists():
            self._load()

    # -- checkpoints ------------------------------------------------------------------------
    def _save(self) -> None:
        save_checkpoint(self.ckpt_path, self.model, self.opt,
                        {"step": self.step, "elapsed": self.elapsed, "train_config": dataclasses.asdict(self.tc),
                         "model_config": self.cfg.to_dict()})

    def _load(self) -> None:
        model_sd, opt_sd, state = load_checkpoint(self.ckpt_path, self.device)
        if state["model_config"] != json.loads(json.dumps(self.cfg.to_dict())):  # as the JSON state holds it
            raise SystemExit(f"{self.ckpt_path}: checkpoint is for a different model config; "
                             f"use another --run-dir or the same preset/overrides")
        self.model.load_state_dict(model_sd)
        self.opt.load_state_dict(opt_sd)
        self.step = state["step"]
        self.elapsed = state.get("elapsed", 0.0)
        print(f"resumed from {self.ckpt_path} at step {self.step}/{self.tc.steps}")

    def _log(self, row: dict) -> None:
        with open(self.log_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    # -- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, loops_list=(1, 4, 8)) -> dict[int, float]:
        self.model.eval()
        rng = np.random.default_rng(1234)  # same val windows every time
        batches = [self.data.batch("val", self.tc.batch, self.tc.seq, rng) for _ in range(self.tc.eval_batches)]
        out = {}
        for loops in loops_list:
            losses = []
            for b in batches:
                t = torch.from_numpy(b).to(self.device)
                with self._autocast():
                    losses.append(loss_at_depth(self.model, t[:, :-1], t[:, 1:], loops).item())
            out[loops] = float(np.mean(losses))
        self.model.train()
        return out

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.tc.bf16)

    # -- training loop ----------------------------------------------------------------------
    def train(self) -> Path:
        tc = self.tc
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self.model.train()
        tokens_per_step = tc.batch * tc.seq * tc.accum
        bar = tqdm(total=tc.steps, initial=self.step, unit="step", dynamic_ncols=True)
        t_last = time.time()
        try:
            while self.step < tc.steps and not self._stop:
                rng = np.random.default_rng([tc.seed, self.step])  # batch + depth are a function of step
                lr = lr_at(self.step, tc)
                for g in self.opt.param_groups:
                    g["lr"] = lr
                total = 0.0
                depths = []
                for _ in range(tc.accum):
                    loops = sample_depth(rng, self.step, tc, self.cfg.default_loops)
                    depths.append(loops)
                    b = torch.from_numpy(self.data.batch("train", tc.batch, tc.seq, rng)).to(self.device)
                    with self._autocast():
                        loss = loss_at_depth(self.model, b[:, :-1], b[:, 1:], loops, tc.backprop_loops)
                    (loss / tc.accum).backward()
                    total += loss.item() / tc.accum
                gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.clip).item()
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                self.step += 1
                now = time.time()
                dt, t_last = now - t_last, now
                self.elapsed += dt
                tps = tokens_per_step / dt
                bar.update(1)
                bar.set_postfix(loss=f"{total:.3f}", loops=depths[0], tok_s=f"{tps:.0f}", lr=f"{lr:.2e}")
                self._log({"step": self.step, "loss": total, "loops": depths, "lr": lr, "grad_norm": gnorm,
                           "tokens_per_s": tps, "elapsed_s": self.elapsed})
                if self.step % tc.eval_every == 0 or self.step == tc.steps:
                    ev = self.eval_loss()
                    self._log({"step": self.step, "val_loss": {str(k): v for k, v in ev.items()}})
                    bar.write(f"step {self.step}: val loss " + ", ".join(f"loops {k}: {v:.3f}" for k, v in ev.items()))
                if self.step % tc.ckpt_every == 0:
                    self._save()
                    t_last = time.time()
        finally:
            bar.close()
            self._save()
            for s, h in old.items():
                signal.signal(s, h)
        if self._stop:
            print(f"stopped at step {self.step}; checkpoint saved to {self.ckpt_path}. Rerun the same command to resume.")
            return self.ckpt_path
        return self.export()

    def _on_signal(self, signum, frame):  # noqa: ARG002
        self._stop = True

    def export(self) -> Path:
        from ..modelfile.loader import write_model  # the model file is the end product of a run

        tc = self.tc
        prov = {
            "tool": "tinyloop train",
            "train_config": {k: v for k, v in dataclasses.asdict(tc).items() if k not in ("out", "run_dir")},
            "data": self.data.manifest,
            "steps": self.step,
            "tokens_seen": self.step * tc.batch * tc.seq * tc.accum,
            "train_seconds": round(self.elapsed, 1),
            "device": str(self.device),
        }
        dtype = getattr(torch, tc.export_dtype)
        out = write_model(tc.out, self.model.to(dtype).eval(), tokenizer=self.tokenizer, provenance=prov)
        self.model.float()
        print(f"wrote {out}")
        return Path(out)
