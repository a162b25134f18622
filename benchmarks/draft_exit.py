"""What the draft exits buy: acceptance and tokens per round with and without them (no timing).

    python benchmarks/draft_exit.py --json benchmarks/results/draft_exit.json

Greedy chain speculation on the default model (V = 8) over the speculative benchmark's prompts plus
windows of held-out text (the last 1% of each corpus file, which neither the model nor the exits were
trained on), for draft_loops 1/2/4 and draft_ahead 4/8, drafting through the model's coda and through
the draft exit. Acceptance and tokens per round do not depend on the machine's speed, so unlike
tokens/s these figures are exact for the run; the speed-ups they lead to are in benchmarks/speculative.py.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from speculative import PROMPTS  # noqa: E402

from tinyloop.engine import Engine  # noqa: E402
from tinyloop.engine.knobs import SamplingParams  # noqa: E402
from tinyloop.engine.serving import run_ids  # noqa: E402
from tinyloop.train.data import read_text, split_text  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus"


def held_out_prompts(tok, per_file: int, n_tokens: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for f in sorted(CORPUS.glob("*.txt.gz")):
        text = split_text(read_text(f), 0.01)[1]
        for _ in range(per_file):
            i = rng.randrange(0, max(1, len(text) - 4 * n_tokens * 8))
            out.append(tok.encode(text[i:i + 8 * n_tokens])[-n_tokens:])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model file or packaged name (default: the default model)")
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per prompt")
    ap.add_argument("--per-file", type=int, default=2, help="held-out prompts per corpus file")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    eng = Engine.load(args.model)
    info = eng.model_info()["draft_exit"]
    if not info:
        print("this model has no draft-exit file", file=sys.stderr)
        return 2
    prompts = [eng.tokenizer.encode(p) for p in PROMPTS] + held_out_prompts(eng.tokenizer, args.per_file, 48)
    print(f"# draft exits: {eng.path.name} with {info['file']}, V=8, greedy chain, {args.tokens} new tokens "
          f"x {len(prompts)} prompts ({len(PROMPTS)} benchmark + {len(prompts) - len(PROMPTS)} held-out)\n")
    print("| d | k | acceptance (coda) | acceptance (exit) | tokens/round (coda) | tokens/round (exit) | change |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for d in info["draft_loops"]:
        for k in (4, 8):
            figs = {}
            for flag in (False, True):
                rounds = emitted = accepted = proposed = 0
                for ids in prompts:
                    st: dict = {}
                    p = SamplingParams(max_tokens=args.tokens, verify_loops=8, mode="speculative", draft_loops=d,
                                       draft_ahead=k, ignore_eos=True)
                    run_ids(eng, ids, p, stats=st, draft_exit=flag)
                    rounds += st["rounds"]
                    emitted += st["accepted_tokens"] + st["rounds"]  # each round: its accepted drafts + 1
                    accepted += st["accepted_tokens"]
                    proposed += st["proposed_tokens"]
                figs[flag] = (accepted / proposed, emitted / rounds)
            row = dict(draft_loops=d, draft_ahead=k, acceptance_coda=figs[False][0], acceptance_exit=figs[True][0],
                       tokens_per_round_coda=figs[False][1], tokens_per_round_exit=figs[True][1])
            rows.append(row)
            print(f"| {d} | {k} | {figs[False][0]:.3f} | {figs[True][0]:.3f} | {figs[False][1]:.2f} | "
                  f"{figs[True][1]:.2f} | {figs[True][1] / figs[False][1] - 1:+.1%} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(model=str(eng.path), draft_exit=info, tokens=args.tokens,
                                                   prompts=len(prompts), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
