"""Write kjv_cloze.jsonl: a last-word cloze task from text the shipped model never trained on.

The source is the validation split of the corpus's King James Bible (`data/corpus/kjv.txt.gz` after `make corpus`, its last
1% cut at a line break: what `tinyloop train` holds out, docs/data.md): the end of Revelation. Each verse
of at least 8 words is one item: the context is the verse without its last word, the choices are that
word and three last words of other verses (seeded), the answer is always listed at a seeded position.
lm-eval scores it as a `multiple_choice` task (kjv_cloze.yaml): the log-likelihood of each choice.

    python benchmarks/lm_eval/make_kjv_cloze.py [--corpus data/corpus] [--items 150]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from tinyloop.train.data import read_text, split_text

HERE = Path(__file__).resolve().parent


def verses(text: str) -> list[str]:
    """Verse texts: a verse starts with its number at the start of a line; wrapped lines are joined."""
    parts = re.split(r"\n\s+\d+ ", "\n" + text)
    return [" ".join(p.split()) for p in parts[1:]]


def items(text: str, n: int, seed: int = 0) -> list[dict]:
    rows = []
    for v in verses(text):
        words = v.split()
        last = re.sub(r"[^\w']+$", "", words[-1])
        if len(words) < 8 or not last or not last.isalpha():
            continue
        rows.append((" ".join(words[:-1]), last))
    rng = random.Random(seed)
    pool = sorted({w for _, w in rows})
    out = []
    for context, last in rows[:n]:
        distractors = rng.sample([w for w in pool if w != last], 3)
        choices = distractors[:]
        answer = rng.randrange(4)
        choices.insert(answer, last)
        out.append({"context": context, "choices": [" " + c for c in choices], "answer": answer})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=HERE.parents[1] / "data" / "corpus")
    ap.add_argument("--items", type=int, default=150)
    ap.add_argument("--out", type=Path, default=HERE / "kjv_cloze.jsonl")
    args = ap.parse_args()
    _, held_out = split_text(read_text(args.corpus / "kjv.txt.gz"), 0.01)
    rows = items(held_out, args.items)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} items -> {args.out}")


if __name__ == "__main__":
    main()
