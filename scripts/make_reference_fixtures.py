#!/usr/bin/env python3
"""Build the tiny Ouro / Huginn / Nanbeige / Parcae reference fixtures (tests/fixtures/reference/) by RUNNING the reference code.

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch==2.13.0 transformers==4.57.6 tokenizers safetensors jinja2 einops
    /tmp/refvenv/bin/python scripts/make_reference_fixtures.py --ref-dir REF_DIR \
        [--out tests/fixtures/reference] [--corpus data/corpus]

Runs under that separate virtual environment (NOT the project's .venv, and it never imports tinyloop): the
reference modelling code of the families (`--ref-dir`: ouro/{configuration,modeling}_ouro.py,
huginn/raven_{config,modeling}_minimal.py and nanbeige/{configuration,modeling}_nanbeige.py with its
chat_template.jinja) is loaded exactly as users load it: the two .py files are copied
next to config.json in a TEMPORARY Hugging Face directory whose config.json carries an `auto_map`, and
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True, dtype=torch.float32)` runs it with
HF_HUB_OFFLINE=1. The .py files are never written into the fixture directories (the project does not carry
the reference code); the fixture directories hold only what a converter reads: config.json,
generation_config.json, *.safetensors (+ index), tokenizer.json, tokenizer_config.json,
special_tokens_map.json, plus the recorded reference.json and reference_logits.safetensors.

For each family (OUT/ouro-tiny, OUT/huginn-tiny; OUT/nanbeige-tiny is built by reference_fixtures/nanbeige.py,
whose docstring says how it differs: per-loop cache checks, both norm rules, its template as its own file;
OUT/parcae-tiny and OUT/parcae-tiny-tokenizer by reference_fixtures/parcae.py: no remote code, the reference
is the sandyresearch/parcae checkout REF_DIR/parcae put on sys.path, a pickled pytorch_model.bin, the
tokenizer as a repository of its own):
  * a tiny config with the family's real key names (written by the family's own config class);
  * seeded random weights (own generator, not the reference init), large enough that the loop count changes
    the next-token argmax; Ouro as one model.safetensors with an untied lm_head, Huginn as two shards plus
    model.safetensors.index.json, tied head, with its persistent freqs_cis buffer, exactly as save_pretrained
    of the reference classes writes them;
  * a byte-level BPE tokenizer trained with `tokenizers` on a few KB of the English corpus, with the family's
    special tokens at the family's positions (Ouro: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2; Huginn: the
    36 "complete" specials at the END of the vocabulary, pre-tokenizer = Split(aeolian regex) + ByteLevel, no
    post-processor), and the family's chat template in tokenizer_config.json;
  * reference outputs in float32, batch 1, one thread, full no-cache forwards (use_cache=False):
    reference_logits.safetensors (one [T, V] tensor per loop count, key `loops_<k>`) and reference.json
    (prompt ids, greedy continuations with EOS stopping off and their top-1/top-2 gaps, tokenizer checks,
    rendered chat templates). Ouro loop counts via from_pretrained(..., total_ut_steps=k); Huginn via
    forward(num_steps=k, init_scale=0.0) i.e. the deterministic zero initial state.

The script checks its own outputs (loaded weights == written weights, greedy == HF generate with and without
cache, k-step Ouro == exit_at_step=k-1 of a deeper model, the early-exit threshold does not fire, loop counts
change the argmax, greedy gaps above --min-gap) and exits non-zero if one fails. A seed that gives a too small
greedy gap is skipped (the next seed is tried); the seed used is recorded in reference.json.
"""


from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: the reference_fixtures package

from reference_fixtures.common import (PINNED_TRANSFORMERS, REPO, corpus_text, log, report,  # noqa: E402
                                       tokenizers, torch, transformers)
from reference_fixtures.huginn import make_huginn  # noqa: E402
from reference_fixtures.nanbeige import make_nanbeige  # noqa: E402
from reference_fixtures.ouro import make_ouro  # noqa: E402
from reference_fixtures.parcae import make_parcae  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref-dir", required=True, type=Path, help="the families' reference code: ouro/, huginn/, nanbeige/, parcae/ (tests/fixtures/reference/README.md says where to get it)")
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "reference")
    ap.add_argument("--corpus", type=Path, default=None, help="default: REF_DIR/../corpus")
    ap.add_argument("--seed", type=int, default=1234, help="first weight seed tried")
    ap.add_argument("--min-gap", type=float, default=0.05, help="smallest acceptable greedy top-1/top-2 gap")
    ap.add_argument("--only", choices=["ouro", "huginn", "nanbeige", "parcae"], default=None)
    args = ap.parse_args()

    if transformers.__version__ != PINNED_TRANSFORMERS:
        log(f"error: transformers {transformers.__version__}; the reference needs {PINNED_TRANSFORMERS}")
        return 2
    if "tinyloop" in sys.modules:
        return 2
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    ref_dir = args.ref_dir.resolve()
    corpus = (args.corpus or ref_dir.parent / "corpus").resolve()
    text = corpus_text(corpus)
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, tokenizers {tokenizers.__version__}; "
        f"tokenizer corpus {len(text.encode())} bytes")
    with tempfile.TemporaryDirectory(prefix="tinyloop-ref-") as tmp:
        work = Path(tmp)
        for fam, make in (("ouro", make_ouro), ("huginn", make_huginn), ("nanbeige", make_nanbeige),
                          ("parcae", make_parcae)):
            if args.only and args.only != fam:
                continue
            for seed in range(args.seed, args.seed + 50):
                ref = make(ref_dir, work, args.out, text, seed, args.min_gap)
                if ref is not None:
                    break
            else:
                log(f"error: no seed gave a greedy gap >= {args.min_gap} for {fam}")
                return 1
            report(ref)
            sens = ref["loop_sensitivity"]
            if sum(p["prompt_positions_with_different_argmax"] for p in sens["consecutive_pairs"].values()) < 3:
                log(f"error: {fam}: the loop count hardly changes the argmax")
                return 1
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    log(f"fixtures in {args.out}: {total / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
