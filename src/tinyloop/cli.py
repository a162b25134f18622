"""The `tinyloop` command line."""

from __future__ import annotations

import argparse
import json
import sys


def _train(args: argparse.Namespace) -> int:
    from .train.trainer import TrainConfig, Trainer

    overrides = json.loads(args.overrides) if args.overrides else {}
    tc = TrainConfig(files=args.files, out=args.out, run_dir=args.run_dir, preset=args.preset,
                     steps=args.steps, batch=args.batch, seq=args.seq, accum=args.accum, lr=args.lr,
                     warmup=args.warmup, seed=args.seed, bf16=not args.no_bf16, device=args.device,
                     max_train_loops=args.max_train_loops, backprop_loops=args.backprop_loops,
                     overrides=overrides)
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    Trainer(tc).train()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tinyloop", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

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
    t.add_argument("--no-bf16", action="store_true", help="train in fp32 instead of bf16 autocast")
    t.add_argument("--device", default="auto")
    t.add_argument("--threads", type=int, default=0)
    t.set_defaults(func=_train)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
