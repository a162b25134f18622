"""Shared pieces of the reference-fixture builder (scripts/make_reference_fixtures.py): the corpus,
tokenizer saving, seeded weights, greedy runs against the reference code, the records reference.json
keeps, and writing a fixture directory. Runs under the reference venv; never imports tinyloop."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jinja2  # noqa: E402
import safetensors  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from jinja2.ext import Extension  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PINNED_TRANSFORMERS = "4.57.6"
VOCAB = 512
GREEDY_TOKENS = 8
PROMPT_TEXT = "And the naïve king said"  # ï is two bytes in UTF-8 (two byte-level tokens here)
# Weight scales (per family): linear weights ~ N(0, (gain / sqrt(fan_in))^2), embedding/head ~ N(0, embed_std^2).
# Large enough that every loop count gives a different argmax, small enough that the fp32 reference stays within
# a few 1e-5 of a float64 run at every loop count (checked: reference.json checks.float64_vs_float32_max_abs).
# (Huginn at gain 1.5 is chaotic: fp32 vs float64 differ by 1e-2 after 8 recurrences, no engine could match it.)
SCALES = {"ouro": {"gain": 1.0, "embed_std": 0.35}, "huginn": {"gain": 0.7, "embed_std": 0.5},
          "nanbeige": {"gain": 0.8, "embed_std": 0.35}}

# Files a converter reads; everything else in the temporary HF directory (the .py files) stays out.
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]

TOKENIZER_CHECK_STRINGS = [
    "Hello, world!",
    "naïve café — 25°C, 東京 ☕ 🙂",
    "  two  spaces\tand a tab\n\nnew lines\r\n",
    "x += 12345; \\newcommand{\\foo} don't",
]

CHAT_CASES = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is a loop? Answer in one word — please."},
    ],
    [
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": "  Good day, café friend.  "},
        {"role": "user", "content": "Count to 3."},
    ],
]


def log(*a):
    print(*a, flush=True)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------------------------- corpus


def corpus_text(corpus_dir: Path) -> str:
    """About 24 KB of English: fixed slices of three corpus files (deterministic)."""
    parts = []
    for name, start in (("shakespeare", 200_000), ("kjv", 300_000), ("brown", 400_000)):
        with gzip.open(corpus_dir / f"{name}.txt.gz", "rt", encoding="utf-8") as f:
            text = f.read(start + 8_000)
        parts.append(text[start:])
    return "\n".join(parts)


def chunks(text: str, n: int = 400):
    return [text[i : i + n] for i in range(0, len(text), n)]


# ----------------------------------------------------------------------------------------------- tokenizers

def save_hf_tokenizer(tok: Tokenizer, out: Path, tokenizer_class: str, chat_template: str, **special) -> None:
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **special)
    fast.chat_template = chat_template
    fast.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    jinja_file = out / "chat_template.jinja"
    if jinja_file.exists():  # newer transformers write the template to its own file; the real repos embed it
        jinja_file.unlink()
    cfg["chat_template"] = chat_template
    cfg["tokenizer_class"] = tokenizer_class
    cfg["model_max_length"] = special.pop("model_max_length", cfg.get("model_max_length"))
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------------- weights


def fill_weights(model: torch.nn.Module, seed: int, family: str) -> dict[str, torch.Tensor]:
    """Seeded random weights from our own generator (the reference init is not used)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if family == "huginn" and name == "lm_head.weight":
                continue  # tied to transformer.wte.weight
            shape = p.shape
            if name.endswith("norm.weight") or ".norm_" in name or "layernorm" in name or name.endswith("ln_f.weight"):
                v = 0.6 + 0.8 * torch.rand(shape, generator=g)  # RMSNorm gains in [0.6, 1.4]
            elif "early_exit_gate" in name:
                # small: lambda stays near 0.5, so the 1.0 threshold never fires early in fp32
                std = 0.05 if name.endswith("weight") else 0.1
                v = std * torch.randn(shape, generator=g)
            elif name.endswith("qk_bias"):
                v = 0.5 * torch.randn(shape, generator=g)
            elif "embed_tokens" in name or name.endswith("wte.weight") or name == "lm_head.weight":
                v = SCALES[family]["embed_std"] * torch.randn(shape, generator=g)  # logits ~ N(0, std^2 * d)
            else:  # linear layers: fan-in scaled, gain 1.5
                v = SCALES[family]["gain"] * torch.randn(shape, generator=g) / shape[-1] ** 0.5
            p.copy_(v.to(p.dtype))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------------------------- reference runs


def top2_gap(row: torch.Tensor) -> float:
    t = torch.topk(row.double(), 2).values
    return float(t[0] - t[1])


def greedy(forward, ids: list[int], n: int):
    seq = list(ids)
    out, gaps = [], []
    for _ in range(n):
        logits = forward(seq)[-1]
        gaps.append(top2_gap(logits))
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        seq.append(nxt)
    return out, gaps


def noop_generation_env() -> jinja2.Environment:
    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    return jinja2.Environment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, "jinja2.ext.loopcontrols"]
    )


def tokenizer_records(tok, chat_cases) -> tuple[list, list]:
    checks = []
    for s in TOKENIZER_CHECK_STRINGS + chat_special_strings(tok):
        ids = tok.encode(s, add_special_tokens=False)
        checks.append(
            {
                "text": s,
                "ids": ids,
                "ids_add_special_tokens": tok.encode(s, add_special_tokens=True),
                "decoded": tok.decode(ids),
                "tokens": tok.convert_ids_to_tokens(ids),
            }
        )
        assert tok.decode(ids) == s, (s, tok.decode(ids))
    env = noop_generation_env()
    chats = []
    for msgs in chat_cases:
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = list(ids["input_ids"])
        plain = env.from_string(tok.chat_template).render(
            messages=msgs, add_generation_prompt=True, **tok.special_tokens_map
        )
        assert plain == text, ("plain Jinja2 differs from transformers", plain, text)
        assert ids == tok.encode(text, add_special_tokens=False), "template ids != encode(text)"
        chats.append({"messages": msgs, "add_generation_prompt": True, "text": text, "ids": list(ids)})
    return checks, chats


def chat_special_strings(tok) -> list[str]:
    specials = tok.all_special_tokens
    if "<|im_start|>" in specials:
        return ["<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"]
    return ["<|begin_text|><|begin_header|>user<|end_header|>\n\nhi<|end_turn|><|end_text|>"]


def loop_sensitivity(prompt_logits: dict[int, torch.Tensor], greedy_ids: dict[int, list[int]]) -> dict:
    ks = sorted(prompt_logits)
    pairs = {}
    for a, b in zip(ks, ks[1:]):
        diff = (prompt_logits[a].argmax(-1) != prompt_logits[b].argmax(-1)).sum().item()
        pairs[f"{a}->{b}"] = {
            "prompt_positions_with_different_argmax": int(diff),
            "max_abs_logit_diff": float((prompt_logits[a] - prompt_logits[b]).abs().max()),
            "greedy_differs": greedy_ids[a] != greedy_ids[b],
        }
    return {
        "positions": int(next(iter(prompt_logits.values())).shape[0]),
        "consecutive_pairs": pairs,
        "distinct_greedy_continuations": len({tuple(v) for v in greedy_ids.values()}),
    }


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def new_hf_dir(work: Path, name: str, code_dir: Path, code_files: list[str]) -> Path:
    """A fresh temporary Hugging Face directory holding the family's reference .py files (never the fixture)."""
    hf = work / name
    if hf.exists():
        shutil.rmtree(hf)
    hf.mkdir(parents=True)
    for f in code_files:
        shutil.copyfile(code_dir / f, hf / f)
    return hf


def check_loaded(loaded: dict[str, torch.Tensor], written: dict[str, torch.Tensor]) -> None:
    for name, v in written.items():
        assert torch.equal(loaded[name], v), f"loaded weight differs: {name}"


def run_entry(k: int, pl: torch.Tensor, g_ids: list[int], gaps: list[float], tok) -> dict:
    """reference.json's record of one loop count: its prompt logits' argmaxes and gaps, its greedy tokens."""
    return {
        "logits_key": f"loops_{k}",
        "prompt_argmax": pl.argmax(-1).tolist(),
        "prompt_min_top2_gap": min(top2_gap(r) for r in pl),
        "greedy_ids": g_ids,
        "greedy_text": tok.decode(g_ids),
        "greedy_top2_gaps": gaps,
        "greedy_min_top2_gap": min(gaps),
    }


def greedy_spec() -> dict:
    return {"new_tokens": GREEDY_TOKENS, "eos_stopping": False, "method": "argmax of full no-cache forwards"}


def logits_spec(loops: list[int], n_prompt: int) -> dict:
    return {"file": "reference_logits.safetensors", "keys": [f"loops_{k}" for k in loops],
            "shape": [n_prompt, VOCAB], "dtype": "float32", "rows": "every prompt position"}


def gap_too_small(family: str, seed: int, runs: dict, min_gap: float) -> bool:
    """A seed whose greedy steps are near ties makes a weak reference: skip it (the next seed is tried)."""
    min_greedy = min(r["greedy_min_top2_gap"] for r in runs.values())
    if min_greedy < min_gap:
        log(f"  {family} seed {seed}: greedy min gap {min_greedy:.4f} < {min_gap}; trying another seed")
        return True
    return False


def finalize(hf: Path, dest: Path, files: list[str], ref: dict, logits: dict, code_dir: Path, code_files: list[str]):
    ref["generator"] = {
        "script": "scripts/make_reference_fixtures.py",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "jinja2": jinja2.__version__,
        "dtype": "float32",
        "batch": 1,
        "threads": torch.get_num_threads(),
        "use_cache": False,
        "reference_code_sha256": {f: sha256(code_dir / f) for f in code_files},
    }
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in files + TOKENIZER_FILES:
        shutil.copyfile(hf / f, dest / f)
    save_file(logits, str(dest / "reference_logits.safetensors"), metadata={"format": "pt"})
    os.chmod(dest / "reference_logits.safetensors", 0o644)
    write_json(dest / "reference.json", ref)
    assert not list(dest.glob("*.py")), "reference code must not be copied into the fixtures"


def report(ref: dict) -> None:
    log(f"== {ref['family']} (seed {ref['seed']}) prompt {len(ref['prompt']['ids'])} ids: {ref['prompt']['ids']}")
    for k, r in ref["runs"].items():
        log(f"  loops {k:>2}: greedy {r['greedy_ids']}  min gap {r['greedy_min_top2_gap']:.4f}"
            f"  prompt min gap {r['prompt_min_top2_gap']:.4f}")
    for p, s in ref["loop_sensitivity"]["consecutive_pairs"].items():
        log(f"  {p}: argmax differs at {s['prompt_positions_with_different_argmax']}/"
            f"{ref['loop_sensitivity']['positions']} prompt positions, max |dlogit| {s['max_abs_logit_diff']:.3f},"
            f" greedy differs: {s['greedy_differs']}")
    log(f"  distinct greedy continuations: {ref['loop_sensitivity']['distinct_greedy_continuations']}"
        f"/{len(ref['loops'])}")
    log(f"  checks: {json.dumps(ref['checks'])}")
