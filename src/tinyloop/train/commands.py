"""`tinyloop train`, `init`, `train-draft` and `train-gate`: the commands that make or train a model's weights
(registered by cli.build_parser; torch is imported when one runs, not when the parser is built)."""

from __future__ import annotations

import argparse
import json

from ..config import PRESETS
from ..errors import CommandError


def add_commands(sub) -> None:
    t = sub.add_parser("train", help="train a looped LM on text files and write a .tinyloop file")
    t.add_argument("files", nargs="+", help="text files (.txt or .txt.gz)")
    t.add_argument("--out", required=True, help="output .tinyloop file")
    t.add_argument("--run-dir", required=True, help="checkpoints, token cache and logs; rerun to resume")
    t.add_argument("--preset", default="tinyloop-16m")
    t.add_argument("--overrides", help='JSON of ModelConfig fields, e.g. {"dim": 384}')
    t.add_argument("--steps", type=int, default=3000)
    t.add_argument("--batch", type=int, default=4)
    t.add_argument("--seq", type=int, default=512)
    t.add_argument("--accum", type=int, default=1)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=150)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-train-loops", type=int, default=12)
    t.add_argument("--backprop-loops", type=int, default=4)
    t.add_argument("--deep-from-step", type=int, help="from this step on, sample depth from the deep mixture "
                   "(see docs/training.md); default: never")
    t.add_argument("--deep-mean", type=float, default=7.0)
    t.add_argument("--shallow-prob", type=float, default=0.15,
                   help="deep mixture: share of steps drawn uniformly from 1..4 loops (default 0.15)")
    t.add_argument("--no-bf16", action="store_true", help="train in fp32 instead of bf16 autocast")
    t.add_argument("--device", default="auto")
    t.add_argument("--threads", type=int, default=0)
    t.set_defaults(func=train)
    n = sub.add_parser("init", help="write a randomly initialised model of a preset (tests, benchmarks)")
    n.add_argument("out", help="the .tinyloop file to write")
    n.add_argument("--preset", required=True, choices=sorted(PRESETS), help="the architecture (config.py PRESETS)")
    n.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    n.add_argument("--overrides", help='JSON of ModelConfig fields, e.g. {"default_loops": 4}')
    n.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="default: %(default)s")
    n.set_defaults(func=init)

    td = sub.add_parser("train-draft", help="distil draft exits for self-speculation (docs/speculative.md)")
    td.add_argument("model", help="a float .tinyloop file (or packaged name) to distil from")
    td.add_argument("files", nargs="+", help="text files (.txt or .txt.gz) to draw training windows from")
    td.add_argument("--out", help="output file (default: <model>.draft.safetensors beside the model)")
    td.add_argument("--draft-loops", type=int, nargs="+", default=[1, 2, 4], help="one exit per draft depth")
    td.add_argument("--tokens", type=int, default=1_200_000, help="training tokens (teacher states are kept)")
    td.add_argument("--epochs", type=int, default=4)
    td.add_argument("--seq", type=int, default=256)
    td.add_argument("--batch", type=int, default=8)
    td.add_argument("--lr", type=float, default=3e-4)
    td.add_argument("--val-fraction", type=float, default=0.01,
                    help="each file's held-out tail (as tinyloop train splits it): not trained on, scored on")
    td.add_argument("--seed", type=int, default=0)
    td.add_argument("--threads", type=int, default=0)
    td.set_defaults(func=train_draft)

    tg = sub.add_parser("train-gate", help="train an exit gate for adaptive depth (docs/adaptive.md)")
    tg.add_argument("model", help="a .tinyloop file or packaged model name")
    tg.add_argument("files", nargs="+", help="training text (.txt or .txt.gz); the held-out tail is not used")
    tg.add_argument("--out", help="default: <model>.gate.safetensors beside the model")
    tg.add_argument("--loops", type=int, help="the full depth (default: the model's default_loops)")
    tg.add_argument("--tokens", type=int, default=16384)
    tg.add_argument("--seq", type=int, default=128)
    tg.add_argument("--steps", type=int, default=400)
    tg.add_argument("--val-fraction", type=float, default=0.01)
    tg.add_argument("--seed", type=int, default=0)
    tg.add_argument("--threads", type=int, default=0)
    tg.set_defaults(func=train_gate)


def train(args: argparse.Namespace) -> int:
    from .trainer import TrainConfig, Trainer

    overrides = json.loads(args.overrides) if args.overrides else {}
    tc = TrainConfig(files=args.files, out=args.out, run_dir=args.run_dir, preset=args.preset,
                     steps=args.steps, batch=args.batch, seq=args.seq, accum=args.accum, lr=args.lr,
                     warmup=args.warmup, seed=args.seed, bf16=not args.no_bf16, device=args.device,
                     max_train_loops=args.max_train_loops, backprop_loops=args.backprop_loops,
                     deep_from_step=args.deep_from_step, deep_mean=args.deep_mean,
                     shallow_prob=args.shallow_prob,
                     overrides=overrides)
    import torch

    from ..modelfile.loader import ModelFileError, check_writable
    from .checkpoint import CheckpointError
    try:
        check_writable(args.out)  # before the run, not after it
    except ModelFileError as exc:
        raise CommandError(str(exc))
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        Trainer(tc).train()
    except CheckpointError as exc:
        raise CommandError(str(exc))
    except ModelFileError as exc:  # the model file could not be written (full disk, ...): no partial file
        raise CommandError(f"{exc} (the run's checkpoint in {args.run_dir} is kept: fix the cause and rerun to resume)")
    return 0


def init(args: argparse.Namespace) -> int:
    import torch

    from ..config import ConfigError, preset
    from ..model import build_model
    from ..modelfile.loader import write_model
    from ..tokenizer import Tokenizer

    try:
        cfg = preset(args.preset)
        if args.overrides:
            cfg = cfg.replace(**json.loads(args.overrides))
    except (ConfigError, TypeError, ValueError) as exc:
        raise CommandError(str(exc))
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    model = build_model(cfg, seed=args.seed, dtype=dtype)
    out = write_model(args.out, model, tokenizer=Tokenizer.gpt2(),
                      provenance={"tool": "tinyloop init", "preset": args.preset, "seed": args.seed,
                                  "trained": False, "note": "random weights (tests and benchmarks)"})
    print(f"wrote {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, random weights)")
    return 0


def _companion_job(args: argparse.Namespace, suffix: str) -> tuple[str, str]:
    """A training command's model path and the companion file it writes (`--out`, else beside the model), with
    its thread count set."""
    import torch

    from ..model.companion import companion_file
    from ..modelfile.loader import resolve_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    return path, args.out or str(companion_file(path, suffix))


def train_draft(args: argparse.Namespace) -> int:
    from ..model.draft_exit import SUFFIX
    from ..modelfile.loader import ModelFileError
    from .draft_exit import train_draft_exits

    path, out = _companion_job(args, SUFFIX)
    try:
        train_draft_exits(path, args.files, out, draft_loops=tuple(args.draft_loops), tokens=args.tokens,
                          seq=args.seq, batch=args.batch, epochs=args.epochs, lr=args.lr, seed=args.seed,
                          val_fraction=args.val_fraction)
    except (ModelFileError, ValueError) as exc:
        raise CommandError(str(exc))
    return 0


def train_gate(args: argparse.Namespace) -> int:
    from ..modelfile.loader import ModelFileError
    from ..model.gate import SUFFIX
    from .gate import train_gate_file

    path, out = _companion_job(args, SUFFIX)
    try:
        meta = train_gate_file(path, args.files, out, loops=args.loops, tokens=args.tokens, seq=args.seq,
                               steps=args.steps, seed=args.seed, val_fraction=args.val_fraction)
    except (ModelFileError, ValueError) as exc:
        raise CommandError(str(exc))
    print(f"wrote {out}: held-out accuracy {meta['val_accuracy']:.3f}, agreement with the full depth by loop "
          f"{meta['val_agreement_by_loop']}")
    return 0
