#!/usr/bin/env python3
"""Build the tiny Ouro / Huginn reference fixtures (tests/fixtures/reference/) by RUNNING the reference code.

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch==2.13.0 transformers==4.57.6 tokenizers safetensors jinja2
    /tmp/refvenv/bin/python scripts/make_reference_fixtures.py --ref-dir ../shared/reference \
        [--out tests/fixtures/reference] [--corpus ../shared/corpus]

Runs under that separate virtual environment (NOT the project's .venv, and it never imports tinyloop): the
reference modelling code of both families (`--ref-dir`: ouro/{configuration,modeling}_ouro.py and
huginn/raven_{config,modeling}_minimal.py) is loaded exactly as users load it: the two .py files are copied
next to config.json in a TEMPORARY Hugging Face directory whose config.json carries an `auto_map`, and
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True, dtype=torch.float32)` runs it with
HF_HUB_OFFLINE=1. The .py files are never written into the fixture directories (the project does not carry
the reference code); the fixture directories hold only what a converter reads: config.json,
generation_config.json, *.safetensors (+ index), tokenizer.json, tokenizer_config.json,
special_tokens_map.json, plus the recorded reference.json and reference_logits.safetensors.

For each family (OUT/ouro-tiny, OUT/huginn-tiny):
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
import gzip
import hashlib
import json
import os
import shutil
import sys
import tempfile
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
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PINNED_TRANSFORMERS = "4.57.6"
VOCAB = 512
GREEDY_TOKENS = 8
PROMPT_TEXT = "And the naïve king said"  # ï is two bytes in UTF-8 (two byte-level tokens here)
# Weight scales (per family): linear weights ~ N(0, (gain / sqrt(fan_in))^2), embedding/head ~ N(0, embed_std^2).
# Large enough that every loop count gives a different argmax, small enough that the fp32 reference stays within
# a few 1e-5 of a float64 run at every loop count (checked: reference.json checks.float64_vs_float32_max_abs).
# (Huginn at gain 1.5 is chaotic: fp32 vs float64 differ by 1e-2 after 8 recurrences, no engine could match it.)
SCALES = {"ouro": {"gain": 1.0, "embed_std": 0.35}, "huginn": {"gain": 0.7, "embed_std": 0.5}}

# Files a converter reads; everything else in the temporary HF directory (the .py files) stays out.
FIXTURE_FILES_OURO = ["config.json", "generation_config.json", "model.safetensors"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]

TOKENIZER_CHECK_STRINGS = [
    "Hello, world!",
    "naïve café — 25°C, 東京 ☕ 🙂",
    "  two  spaces\tand a tab\n\nnew lines\r\n",
    "x += 12345; \\newcommand{\\foo} don't",
]

OURO_CHAT_TEMPLATE_SOURCE = (
    "LoopedLMs/ouro_rl ouro_rl/modeling/chat_template.jinja at 3bad4c1891fa7a1c5e11f8eb4e59e7d1cec5502b (the same "
    "repository and commit as ../shared/reference/ouro/*.py; ChatML with a leading system message and the "
    "Thinking variants' enable_thinking switch). The hub tokenizer_config.json is not reachable from here."
)
OURO_CHAT_TEMPLATE = (
    "{# Ouro chat template with enable_thinking support. #}\n"
    "{# When enable_thinking=True, prepends <think>\\n to trigger CoT reasoning. #}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "    {%- if message.role == 'system' and loop.first -%}\n"
    "        {# Skip #}\n"
    "    {%- else -%}\n"
    "        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is true -%}\n"
    "        {{- '<think>\\n' }}\n"
    "    {%- endif -%}\n"
    "{%- endif -%}\n"
)
HUGINN_CHAT_TEMPLATE_SOURCE = (
    "seal-rg/recurrent-pretraining: the template the authors' checkpoint conversion/upload script sets on the "
    "tokenizer it pushes next to the model (\"sean template\", with {% generation %}); the hub "
    "tokenizer_config.json is not reachable from here."
)
HUGINN_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set start_content = '<|begin_header|>' %}"
    "{% set end_content = message['content'] | trim  + '<|end_turn|>' %}{% if loop.index0 == 0 %}"
    "{% set start_content = bos_token + start_content %}{% endif %}"
    "{% if message['role'] == 'Huginn' or message['role'] == 'assistant' %}"
    "{% set start_content = start_content + 'Huginn<|end_header|>\\n\\n' %}{{ start_content }}"
    "{% generation %}{{ end_content }}{% endgeneration %}{% else %}"
    "{% set start_content = start_content + message['role'] + '<|end_header|>\\n\\n' %}{{ start_content }}"
    "{{ end_content }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|begin_header|>Huginn<|end_header|>\\n\\n' }}{% else %}{{ '<|end_text|>' }}{% endif %}"
)
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

OURO_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_ouro_tokenizer(text: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=OURO_SPECIALS,  # trained specials come first: ids 0, 1, 2 as in the real vocabulary
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(chunks(text), trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    for i, s in enumerate(OURO_SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def build_huginn_tokenizer(text: str, ref_dir: Path) -> tuple[Tokenizer, list[str]]:
    regex = (ref_dir / "huginn" / "aeolian_regex.txt").read_text(encoding="utf-8")
    specials = json.loads((ref_dir / "huginn" / "special_tokens_complete.json").read_text(encoding="utf-8"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # no post-processor: prompts carry <|begin_text|> explicitly, as in the real tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - len(specials),
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(chunks(text), trainer)
    assert tok.get_vocab_size() == VOCAB - len(specials), tok.get_vocab_size()
    tok.add_special_tokens(specials)  # appended: the END of the vocabulary, as in the real one (65504 ...)
    assert tok.get_vocab_size() == VOCAB
    for i, s in enumerate(specials):
        assert tok.token_to_id(s) == VOCAB - len(specials) + i
    return tok, specials


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


# ----------------------------------------------------------------------------------------------- families


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_ouro(ref_dir: Path, work: Path, out: Path, text: str, seed: int, min_gap: float) -> dict | None:
    hf = work / "ouro-hf"
    if hf.exists():
        shutil.rmtree(hf)
    hf.mkdir(parents=True)
    for f in ("configuration_ouro.py", "modeling_ouro.py"):
        shutil.copyfile(ref_dir / "ouro" / f, hf / f)
    cfg = {
        "architectures": ["OuroForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_ouro.OuroConfig",
            "AutoModel": "modeling_ouro.OuroModel",
            "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
        },
        "model_type": "ouro",
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 176,
        "layer_types": ["full_attention", "full_attention"],
        "max_position_embeddings": 1024,
        "max_window_layers": 2,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }
    write_json(hf / "config.json", cfg)
    config = AutoConfig.from_pretrained(str(hf), trust_remote_code=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    written = fill_weights(model, seed, "ouro")
    model.save_pretrained(str(hf), safe_serialization=True)
    # config.json: keep our hand-written real-key file (save_pretrained rewrote it with the class's dump)
    write_json(hf / "config.json", {**cfg, "transformers_version": transformers.__version__})
    write_json(
        hf / "generation_config.json",
        {"bos_token_id": 0, "eos_token_id": 2, "transformers_version": transformers.__version__},
    )
    tok_raw = build_ouro_tokenizer(text)
    save_hf_tokenizer(
        tok_raw,
        hf,
        "GPT2Tokenizer",
        OURO_CHAT_TEMPLATE,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=1024,
    )
    assert sorted(p.name for p in hf.glob("*.safetensors")) == ["model.safetensors"]

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(hf))
    prompt_ids = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    loops = [1, 2, 3, 4, 6]
    logits_out, runs, prompt_logits, greedy_ids = {}, {}, {}, {}
    models = {}
    for k in loops:
        m = AutoModelForCausalLM.from_pretrained(str(hf), trust_remote_code=True, dtype=torch.float32, total_ut_steps=k)
        m.eval()
        assert m.model.total_ut_steps == k
        models[k] = m
    loaded = models[4].state_dict()
    for name, v in written.items():
        assert torch.equal(loaded[name], v), f"loaded weight differs: {name}"
    attn_impl = models[4].config._attn_implementation

    def fwd(m):
        def f(seq):
            with torch.no_grad():
                return m(torch.tensor([seq]), use_cache=False).logits[0].float()

        return f

    for k in loops:
        m = models[k]
        pl = fwd(m)(prompt_ids)
        # the 1.0 early-exit threshold must select the last step (it can fire early in fp32 if gates saturate)
        with torch.no_grad():
            last = m(torch.tensor([prompt_ids]), use_cache=False, exit_at_step=k - 1).logits[0].float()
        assert torch.equal(pl, last), f"ouro loops={k}: threshold exit differs from the last step"
        g_ids, gaps = greedy(fwd(m), prompt_ids, GREEDY_TOKENS)
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
        for use_cache in (False, True):
            with torch.no_grad():
                gen = m.generate(
                    torch.tensor([prompt_ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False, use_cache=use_cache
                )
            assert gen[0, len(prompt_ids) :].tolist() == g_ids, (k, use_cache, gen.tolist(), g_ids)
        logits_out[f"loops_{k}"] = pl.contiguous()
        prompt_logits[k] = pl
        greedy_ids[k] = g_ids
        runs[str(k)] = {
            "logits_key": f"loops_{k}",
            "prompt_argmax": pl.argmax(-1).tolist(),
            "prompt_min_top2_gap": min(top2_gap(r) for r in pl),
            "greedy_ids": g_ids,
            "greedy_text": tok.decode(g_ids),
            "greedy_top2_gaps": gaps,
            "greedy_min_top2_gap": min(gaps),
        }
    # numerical sensitivity of the fp32 reference: the same model in float64
    fp64 = {}
    for k in loops:
        m64 = AutoModelForCausalLM.from_pretrained(
            str(hf), trust_remote_code=True, dtype=torch.float64, total_ut_steps=k
        )
        with torch.no_grad():
            l64 = m64(torch.tensor([prompt_ids]), use_cache=False).logits[0]
        fp64[str(k)] = float((l64 - prompt_logits[k].double()).abs().max())
    # k steps == exit_at_step=k-1 of the deepest model
    deep = models[max(loops)]
    step_consistency = {}
    for k in loops:
        with torch.no_grad():
            e = deep(torch.tensor([prompt_ids]), use_cache=False, exit_at_step=k - 1).logits[0].float()
        step_consistency[str(k)] = float((e - prompt_logits[k]).abs().max())
        assert step_consistency[str(k)] <= 1e-5, step_consistency
    # eager vs sdpa attention of the reference itself
    eager = AutoModelForCausalLM.from_pretrained(
        str(hf), trust_remote_code=True, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        el = eager(torch.tensor([prompt_ids]), use_cache=False).logits[0].float()
    eager_diff = float((el - prompt_logits[4]).abs().max())
    # exit gate of the trained depth
    with torch.no_grad():
        _, hs_list, gate_list = models[4].model(torch.tensor([prompt_ids]), use_cache=False)
    gate_logits = [g[0, :, 0].tolist() for g in gate_list]
    lam = [torch.sigmoid(g[0, :, 0]) for g in gate_list]
    rem = torch.ones_like(lam[0])
    pdf = []
    for i, l in enumerate(lam):
        if i < len(lam) - 1:
            pdf.append(l * rem)
            rem = rem * (1 - l)
        else:
            pdf.append(rem)
    pdf_t = torch.stack(pdf, dim=1)  # [T, steps]

    min_greedy = min(r["greedy_min_top2_gap"] for r in runs.values())
    if min_greedy < min_gap:
        log(f"  ouro seed {seed}: greedy min gap {min_greedy:.4f} < {min_gap}; trying another seed")
        return None
    sens = loop_sensitivity(prompt_logits, greedy_ids)
    checks, chats = tokenizer_records(tok, CHAT_CASES)
    ref = {
        "family": "ouro",
        "model_type": "ouro",
        "seed": seed,
        "prompt": {"text": PROMPT_TEXT, "ids": prompt_ids},
        "vocab_size": VOCAB,
        "loop_parameter": "total_ut_steps (from_pretrained(..., total_ut_steps=k); read once at construction)",
        "default_loops": 4,
        "loops": loops,
        "runs": runs,
        "greedy": {"new_tokens": GREEDY_TOKENS, "eos_stopping": False, "method": "argmax of full no-cache forwards"},
        "logits": {"file": "reference_logits.safetensors", "keys": [f"loops_{k}" for k in loops],
                   "shape": [len(prompt_ids), VOCAB], "dtype": "float32", "rows": "every prompt position"},
        "exit_gate": {
            "loops": 4,
            "gate_logits": gate_logits,  # [steps][T]: early_exit_gate(h_t)
            "exit_pdf": pdf_t.tolist(),  # [T][steps]
            "threshold": 1.0,
            "note": "the 1.0 threshold selects the last step at every position (checked)",
        },
        "loop_sensitivity": sens,
        "checks": {
            "k_steps_vs_exit_at_step_of_6_step_model_max_abs": step_consistency,
            "eager_vs_default_attention_max_abs_loops_4": eager_diff,
            "float64_vs_float32_max_abs": fp64,
            "generate_matches_greedy": {"use_cache_false": True, "use_cache_true": True},
            "attn_implementation": attn_impl,
        },
        "special_tokens": {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2},
        "eos": {"config": 2, "generation_config": 2, "tokenizer": 0, "stop_on": [0, 2]},
        "tokenizer_checks": checks,
        "chat_template": {"source": OURO_CHAT_TEMPLATE_SOURCE, "cases": chats},
    }
    finalize(hf, out / "ouro-tiny", FIXTURE_FILES_OURO, ref, logits_out, ref_dir / "ouro",
             ["configuration_ouro.py", "modeling_ouro.py"])
    return ref


def make_huginn(ref_dir: Path, work: Path, out: Path, text: str, seed: int, min_gap: float) -> dict | None:
    hf = work / "huginn-hf"
    if hf.exists():
        shutil.rmtree(hf)
    hf.mkdir(parents=True)
    for f in ("raven_config_minimal.py", "raven_modeling_minimal.py"):
        shutil.copyfile(ref_dir / "huginn" / f, hf / f)
    tok_raw, specials = build_huginn_tokenizer(text, ref_dir)
    sid = {s: VOCAB - len(specials) + i for i, s in enumerate(specials)}
    # the reference config class writes the full config.json (the real files come from it); we then add the
    # hub-only keys
    minimal = {
        "architectures": ["RavenForCausalLM"],
        "auto_map": {
            "AutoConfig": "raven_config_minimal.RavenConfig",
            "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM",
        },
        "model_type": "huginn_raven",
        "n_embd": 64,
        "n_heads": 4,
        "n_layers": 4,
        "n_layers_in_prelude": 1,
        "n_layers_in_recurrent_block": 2,
        "n_layers_in_coda": 1,
        "mean_recurrence": 4,
        "mean_backprop_depth": 2,
        "block_size": 256,
        "vocab_size": VOCAB,
        "padding_multiple": 64,
        "intermediate_size": 176,
        "qk_bias": True,
        "tie_embeddings": True,
        "bias": False,
        "rope_base": 50000,
        "norm_eps": 1e-06,
        "torch_dtype": "float32",
        "bos_token_id": sid["<|begin_text|>"],
        "eos_token_id": sid["<|end_text|>"],
        "pad_token_id": sid["<|pad|>"],
    }
    write_json(hf / "config.json", minimal)
    config = AutoConfig.from_pretrained(str(hf), trust_remote_code=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    written = fill_weights(model, seed, "huginn")
    total = sum(v.numel() * v.element_size() for k, v in written.items() if k != "lm_head.weight")
    model.save_pretrained(str(hf), safe_serialization=True, max_shard_size=int(total * 0.6))
    shards = sorted(p.name for p in hf.glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], shards
    saved_cfg = json.loads((hf / "config.json").read_text(encoding="utf-8"))
    if "dtype" in saved_cfg and "torch_dtype" not in saved_cfg:
        saved_cfg["torch_dtype"] = saved_cfg.pop("dtype")
    saved_cfg["torch_dtype"] = "float32"
    saved_cfg["padded_vocab_size"] = VOCAB
    hub_keys = ("architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id")
    saved_cfg.update({k: minimal[k] for k in hub_keys})
    write_json(hf / "config.json", dict(sorted(saved_cfg.items())))
    write_json(
        hf / "generation_config.json",
        {
            "bos_token_id": sid["<|begin_text|>"],
            "eos_token_id": [sid["<|end_text|>"], sid["<|end_turn|>"]],
            "pad_token_id": sid["<|pad|>"],
            "transformers_version": transformers.__version__,
        },
    )
    save_hf_tokenizer(
        tok_raw,
        hf,
        "PreTrainedTokenizerFast",
        HUGINN_CHAT_TEMPLATE,
        bos_token="<|begin_text|>",
        eos_token="<|end_text|>",
        pad_token="<|pad|>",
        model_max_length=256,
    )

    tok = AutoTokenizer.from_pretrained(str(hf))
    prompt_ids = [sid["<|begin_text|>"]] + tok.encode(PROMPT_TEXT, add_special_tokens=False)
    assert tok.encode("<|begin_text|>" + PROMPT_TEXT, add_special_tokens=False) == prompt_ids
    m = AutoModelForCausalLM.from_pretrained(str(hf), trust_remote_code=True, dtype=torch.float32)
    m.eval()
    loaded = m.state_dict()
    for name, v in written.items():
        assert torch.equal(loaded[name], v), f"loaded weight differs: {name}"
    assert torch.equal(loaded["lm_head.weight"], loaded["transformer.wte.weight"])
    saved_keys = set()
    for s in shards:
        saved_keys |= set(load_file(str(hf / s)).keys())
    assert "freqs_cis" in saved_keys and "lm_head.weight" not in saved_keys, sorted(saved_keys)

    loops = [1, 2, 4, 8]

    def fwd(k):
        def f(seq):
            with torch.no_grad():
                return m(torch.tensor([seq]), num_steps=k, init_scale=0.0, use_cache=False).logits[0].float()

        return f

    # the default init_scale=1.0 is random: show it (two calls differ)
    with torch.no_grad():
        r1 = m(torch.tensor([prompt_ids]), num_steps=4, use_cache=False).logits[0]
        r2 = m(torch.tensor([prompt_ids]), num_steps=4, use_cache=False).logits[0]
    random_default_diff = float((r1 - r2).abs().max())
    logits_out, runs, prompt_logits, greedy_ids = {}, {}, {}, {}
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = sid["<|pad|>"]
    gen_check = {}
    for k in loops:
        pl = fwd(k)(prompt_ids)
        z = torch.zeros(1, len(prompt_ids), 64)
        with torch.no_grad():
            pz = m(torch.tensor([prompt_ids]), num_steps=k, input_states=z, use_cache=False).logits[0].float()
        assert torch.equal(pl, pz), "init_scale=0.0 != input_states=zeros"
        g_ids, gaps = greedy(fwd(k), prompt_ids, GREEDY_TOKENS)
        for use_cache in (False, True):
            with torch.no_grad():
                gen = m.generate(
                    torch.tensor([prompt_ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                    use_cache=use_cache, num_steps=k, init_scale=0.0,
                )
            gen_check[f"{k}_cache_{use_cache}"] = gen[0, len(prompt_ids):].tolist() == g_ids
            assert gen[0, len(prompt_ids):].tolist() == g_ids, (k, use_cache, gen.tolist(), g_ids)
        logits_out[f"loops_{k}"] = pl.contiguous()
        prompt_logits[k] = pl
        greedy_ids[k] = g_ids
        runs[str(k)] = {
            "logits_key": f"loops_{k}",
            "prompt_argmax": pl.argmax(-1).tolist(),
            "prompt_min_top2_gap": min(top2_gap(r) for r in pl),
            "greedy_ids": g_ids,
            "greedy_text": tok.decode(g_ids),
            "greedy_top2_gaps": gaps,
            "greedy_min_top2_gap": min(gaps),
        }
    m64 = AutoModelForCausalLM.from_pretrained(str(hf), trust_remote_code=True, dtype=torch.float64)
    fp64 = {}
    for k in loops:
        with torch.no_grad():
            l64 = m64(torch.tensor([prompt_ids]), num_steps=k, init_scale=0.0, use_cache=False).logits[0]
        fp64[str(k)] = float((l64 - prompt_logits[k].double()).abs().max())
    min_greedy = min(r["greedy_min_top2_gap"] for r in runs.values())
    if min_greedy < min_gap:
        log(f"  huginn seed {seed}: greedy min gap {min_greedy:.4f} < {min_gap}; trying another seed")
        return None
    sens = loop_sensitivity(prompt_logits, greedy_ids)
    checks, chats = tokenizer_records(tok, CHAT_CASES)
    stop_ids = sorted({sid["<|end_text|>"], sid["<|end_turn|>"]})
    ref = {
        "family": "huginn",
        "model_type": "huginn_raven",
        "seed": seed,
        "prompt": {"text": "<|begin_text|>" + PROMPT_TEXT, "ids": prompt_ids},
        "vocab_size": VOCAB,
        "loop_parameter": "num_steps (forward(num_steps=k, init_scale=0.0): zero initial state)",
        "initial_state": "zeros",
        "default_loops": 4,
        "loops": loops,
        "runs": runs,
        "greedy": {"new_tokens": GREEDY_TOKENS, "eos_stopping": False, "method": "argmax of full no-cache forwards"},
        "logits": {"file": "reference_logits.safetensors", "keys": [f"loops_{k}" for k in loops],
                   "shape": [len(prompt_ids), VOCAB], "dtype": "float32", "rows": "every prompt position"},
        "loop_sensitivity": sens,
        "checks": {
            "init_scale_0_equals_input_states_zeros": True,
            "default_init_scale_1_two_calls_max_abs_diff": random_default_diff,
            "float64_vs_float32_max_abs": fp64,
            "generate_matches_greedy": gen_check,
        },
        "special_tokens": {s: sid[s] for s in specials},
        "eos": {"config": sid["<|end_text|>"], "generation_config": stop_ids, "tokenizer": sid["<|end_text|>"],
                "stop_on": stop_ids},
        "tokenizer_checks": checks,
        "chat_template": {"source": HUGINN_CHAT_TEMPLATE_SOURCE, "cases": chats},
    }
    files = ["config.json", "generation_config.json", "model.safetensors.index.json"] + shards
    finalize(hf, out / "huginn-tiny", files, ref, logits_out, ref_dir / "huginn",
             ["raven_config_minimal.py", "raven_modeling_minimal.py"])
    return ref


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref-dir", required=True, type=Path, help="../shared/reference (ouro/, huginn/)")
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "reference")
    ap.add_argument("--corpus", type=Path, default=None, help="default: REF_DIR/../corpus")
    ap.add_argument("--seed", type=int, default=1234, help="first weight seed tried")
    ap.add_argument("--min-gap", type=float, default=0.05, help="smallest acceptable greedy top-1/top-2 gap")
    ap.add_argument("--only", choices=["ouro", "huginn"], default=None)
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
        for fam, make in (("ouro", make_ouro), ("huginn", make_huginn)):
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
